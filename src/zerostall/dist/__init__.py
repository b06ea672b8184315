"""torch.distributed support: collective saves and loads with the same API (docs/distributed.md).

When ``torch.distributed`` is initialized, ``save_*``, ``load_*`` and :class:`~zerostall.Checkpointer`
act collectively: every rank calls them with the same path / step.

* :mod:`~zerostall.dist.context` (training thread): rank, run id, save counter; the one
  collective of a save happens at an engine's first save.
* :mod:`~zerostall.dist.job` (writer process): hash, deduplicate replicated leaves, write this
  rank's file, report; rank 0 merges the reports into one manifest and commits.
* :mod:`~zerostall.dist.protocol`: names and the decision file through which ranks agree via
  the storage, never via the trainer's process groups.
* :mod:`~zerostall.dist.dtensor`: DTensor shards and resharded loads.
* :mod:`~zerostall.dist.load`: collective loads (broadcast of replicated leaves).

Nothing here imports torch at module load.
"""

from zerostall.options import DistributedOptions, Replicated

__all__ = ["DistributedOptions", "Replicated"]
