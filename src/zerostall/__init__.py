"""zerostall: checkpoint training state without stalling training.

Saving copies every array into reused host buffers (the only part the training thread waits
for); a background writer process writes, checksums and commits. Loading reads straight into
existing tensors and verifies checksums. Data files are safetensors; nothing runs pickle.

The public names are imported on first use (PEP 562): ``import zerostall`` loads only the
version and the errors, so the writer and keeper processes, which import ``zerostall.persist``
or ``zerostall.memtier``, start without the save and load API (about half their start-up).
"""

import importlib as _importlib
import importlib.util as _importlib_util
import typing as _typing

from zerostall._version import __version__
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

if _typing.TYPE_CHECKING:
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
    from zerostall.memtier.keeperfail import UnadoptableKeeper
    from zerostall.options import (
        DistributedOptions,
        LoadOptions,
        MemoryTier,
        Replicated,
        SaveOptions,
        Staging,
        WriterKind,
    )
    from zerostall.response import Response, SaveStats
    from zerostall.tree import LeafHandler, Stateful, register_handler, unregister_handler

#: public name -> the module that defines it, imported at the first access
_LAZY: dict[str, str] = {
    "Advice": "zerostall.advice",
    "FailureMix": "zerostall.advice",
    "MeasuredCosts": "zerostall.advice",
    "ReplicaCost": "zerostall.advice",
    "TierAdvice": "zerostall.advice",
    "load_checkpointables": "zerostall.api",
    "load_metadata": "zerostall.api",
    "load_pytree": "zerostall.api",
    "prepare": "zerostall.api",
    "release_buffers": "zerostall.api",
    "save_checkpointables": "zerostall.api",
    "save_checkpointables_async": "zerostall.api",
    "save_pytree": "zerostall.api",
    "save_pytree_async": "zerostall.api",
    "Checkpointer": "zerostall.checkpointer",
    "UnadoptableKeeper": "zerostall.memtier.keeperfail",
    "DistributedOptions": "zerostall.options",
    "LoadOptions": "zerostall.options",
    "MemoryTier": "zerostall.options",
    "Replicated": "zerostall.options",
    "SaveOptions": "zerostall.options",
    "Staging": "zerostall.options",
    "WriterKind": "zerostall.options",
    "Response": "zerostall.response",
    "SaveStats": "zerostall.response",
    "LeafHandler": "zerostall.tree",
    "Stateful": "zerostall.tree",
    "register_handler": "zerostall.tree",
    "unregister_handler": "zerostall.tree",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        # a submodule (zerostall.api, ...) is an attribute after `import zerostall`, as when every
        # public name was imported eagerly
        if not name.startswith("_") and _importlib_util.find_spec(f"zerostall.{name}") is not None:
            return _importlib.import_module(f"zerostall.{name}")
        raise AttributeError(f"module 'zerostall' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later accesses are plain attribute lookups
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
