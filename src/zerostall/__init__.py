"""zerostall: checkpoint training state without stalling training.

Saving copies every array into reused host buffers (the only part the training thread waits
for); a background writer process writes, checksums and commits. Loading reads straight into
existing tensors and verifies checksums. Data files are safetensors; nothing runs pickle.
"""

from zerostall._version import __version__
from zerostall.advice import Advice, FailureMix, MeasuredCosts, ReplicaCost, TierAdvice
from zerostall.api import (
    load_checkpointables,
    load_metadata,
    load_pytree,
    prepare,
    release_buffers,
    save_checkpointables,
    save_checkpointables_async,
    save_pytree,
    save_pytree_async,
)
from zerostall.checkpointer import Checkpointer
from zerostall.errors import (
    AdviceError,
    ArgumentTypeError,
    BackgroundSaveError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DirectoryReplacedError,
    DonatedArrayError,
    InvalidArgumentError,
    KeeperLostError,
    KeeperPersistError,
    MetadataError,
    MetadataTypeError,
    MismatchError,
    MissingDependencyError,
    MissingKeyError,
    NoValidCheckpointError,
    PreemptionError,
    ReadOnlyError,
    StorageError,
    TornSnapshotError,
    UnsupportedFormatError,
    UnsupportedLeafError,
    WriterError,
    ZerostallError,
    ZerostallWarning,
)
from zerostall.memtier.keeperfail import UnadoptableKeeper
from zerostall.options import DistributedOptions, LoadOptions, MemoryTier, Replicated, SaveOptions, Staging, WriterKind
from zerostall.response import Response, SaveStats
from zerostall.tree import LeafHandler, Stateful, register_handler, unregister_handler

__all__ = [
    "__version__",
    # saving and loading
    "save_pytree", "save_pytree_async", "save_checkpointables", "save_checkpointables_async",
    "load_pytree", "load_checkpointables", "load_metadata",
    "prepare", "release_buffers",
    "Checkpointer", "Response", "SaveStats",
    # configuration and extension
    "SaveOptions", "LoadOptions", "WriterKind", "Staging", "DistributedOptions", "Replicated", "MemoryTier",
    "Stateful", "LeafHandler", "register_handler", "unregister_handler",
    # how often to save (Checkpointer.advice, save_interval="auto")
    "Advice", "MeasuredCosts", "FailureMix", "ReplicaCost", "TierAdvice",
    # errors (docs/guarantees.md lists which builtin each also is)
    "ZerostallError", "InvalidArgumentError", "ArgumentTypeError", "AdviceError", "MissingDependencyError",
    "CheckpointNotFoundError", "CheckpointExistsError", "ReadOnlyError",
    "CorruptCheckpointError", "ChecksumMismatchError", "NoValidCheckpointError", "UnsupportedFormatError",
    "MismatchError", "MissingKeyError", "UnsupportedLeafError", "MetadataError", "MetadataTypeError",
    "StorageError", "WriterError", "BackgroundSaveError", "TornSnapshotError", "DonatedArrayError",
    "KeeperPersistError",
    "KeeperLostError", "DirectoryReplacedError", "ZerostallWarning",
    # a keeper a restart cannot adopt (listed in Checkpointer.keeper_failures, not raised)
    "UnadoptableKeeper",
    "PreemptionError",
]

import importlib as _importlib

from zerostall.tree import register_lazy_integration as _register_lazy


# JAX arrays and pytrees work without an explicit import: the integration loads at the first save or
# load after jax itself has been imported (so `import zerostall` never imports jax).
def _load_jax_integration() -> None:
    _importlib.import_module("zerostall.integrations.jax")


_register_lazy("jax", _load_jax_integration)
