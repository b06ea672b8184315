"""torch.distributed support: collective saves and loads with the same API (docs/distributed.md).

When ``torch.distributed`` is initialized, ``save_*``, ``load_*`` and :class:`~zerostall.Checkpointer`
act collectively: every rank calls them with the same path / step.

* :mod:`~zerostall.distributed.context` (training thread): the engine's
  :class:`~zerostall.engine.Coordinator` (rank, run id, save counter); the one collective of a
  save happens at an engine's first save. The writers' side, hashing, ownership and the
  storage-based agreement, is a step of the one save job (:mod:`zerostall.persist.collective`).
* :mod:`~zerostall.distributed.dtensor`: DTensor shards (a flattener and a template box
  registered with the tree and restore layers when this package is imported).
* :mod:`~zerostall.distributed.load`: collective loads (replicated leaves read once, broadcast).

Nothing here imports torch at module load.
"""

from zerostall.distributed import dtensor as _dtensor  # noqa: F401 - registers the DTensor hooks
from zerostall.distributed.context import DistContext, active, agree_steps
from zerostall.distributed.load import agree_step, load
from zerostall.options import DistributedOptions, Replicated

__all__ = ["DistributedOptions", "Replicated", "DistContext", "active", "agree_step", "agree_steps", "load"]
