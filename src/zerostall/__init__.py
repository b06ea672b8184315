"""zerostall: checkpoint training state without stalling training.

Saving copies every array into reused host buffers (the only part the training thread waits
for); a background writer process writes, checksums and commits. Loading reads straight into
existing tensors and verifies checksums. Data files are safetensors; nothing runs pickle.
"""

from zerostall._version import __version__
from zerostall.api import (
    load_checkpointables,
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
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    MismatchError,
    MissingKeyError,
    NoValidCheckpointError,
    StorageError,
    TornSnapshotError,
    UnsupportedFormatError,
    UnsupportedLeafError,
    WriterError,
    ZerostallError,
)
from zerostall.options import DistributedOptions, LoadOptions, MemoryTier, Replicated, SaveOptions, Staging, WriterKind
from zerostall.response import Response, SaveStats
from zerostall.tree import LeafHandler, Stateful, register_handler, unregister_handler

__all__ = [
    "__version__",
    # saving and loading
    "save_pytree", "save_pytree_async", "save_checkpointables", "save_checkpointables_async",
    "load_pytree", "load_checkpointables",
    "prepare", "release_buffers",
    "Checkpointer", "Response", "SaveStats",
    # configuration and extension
    "SaveOptions", "LoadOptions", "WriterKind", "DistributedOptions", "Replicated", "Stateful", "LeafHandler", "register_handler",
    "unregister_handler", "MemoryTier",
    # errors
    "ZerostallError", "CheckpointNotFoundError", "CheckpointExistsError", "CorruptCheckpointError",
    "ChecksumMismatchError", "UnsupportedFormatError", "MismatchError", "MissingKeyError",
    "UnsupportedLeafError", "StorageError", "WriterError",
    "NoValidCheckpointError",
    # overlapped staging
    "Staging", "TornSnapshotError",
]

from zerostall.errors import BackgroundSaveError, ReadOnlyError

__all__ += ["BackgroundSaveError", "ReadOnlyError"]

from zerostall.api import load_metadata  # noqa: E402 - added apart from the block above to keep merges simple
from zerostall.errors import ArgumentTypeError, InvalidArgumentError, MetadataError, MetadataTypeError  # noqa: E402

__all__ += ["load_metadata", "InvalidArgumentError", "ArgumentTypeError", "MetadataError", "MetadataTypeError"]

import importlib as _importlib  # noqa: E402

from zerostall.tree import register_lazy_integration as _register_lazy  # noqa: E402


# JAX arrays and pytrees work without an explicit import: the integration loads at the first save or
# load after jax itself has been imported (so `import zerostall` never imports jax).
def _load_jax_integration() -> None:
    _importlib.import_module("zerostall.integrations.jax")


_register_lazy("jax", _load_jax_integration)
