"""Lightning's ``CheckpointIO`` plugin backed by zerostall: ``Trainer(plugins=[ZerostallCheckpointIO()])``.

A short import path for :mod:`zerostall.integrations.lightning`; see there and docs/integrations.md.

Example::

    >>> import lightning.pytorch as pl                          # doctest: +SKIP
    >>> from zerostall.lightning import ZerostallCheckpointIO   # doctest: +SKIP
    >>> trainer = pl.Trainer(plugins=[ZerostallCheckpointIO()])  # doctest: +SKIP
"""

from zerostall.integrations.lightning import ZerostallCheckpointIO

__all__ = ["ZerostallCheckpointIO"]
