"""zerostall: checkpoint training state without stalling training.

Saving copies every array into reused host buffers (the only part the training thread waits
for); a background writer process writes, checksums and commits. Loading reads straight into
existing tensors and verifies checksums. Data files are safetensors; nothing runs pickle.

The public face has three namespaces, each with a pinned ``__all__``:

* ``zerostall``: what a save-and-load loop needs (the free functions, :class:`Checkpointer`,
  :class:`Response`, the options, custom leaves) and the errors such a loop catches;
* :mod:`zerostall.errors`: every error class and :class:`~zerostall.errors.ZerostallWarning`;
* :mod:`zerostall.advice`: the checkpoint-interval advisor (:class:`~zerostall.advice.Advice`,
  :class:`~zerostall.advice.MeasuredCosts`, ...).

The top level keeps three errors besides :class:`ZerostallError`: those a training loop branches
on whose builtin is too broad to catch alone. :class:`CorruptCheckpointError` (a ``ValueError``)
is what a resume falls back to an older step on (its subclasses: a checksum that differs, no step
that verifies); :class:`BackgroundSaveError` (a ``RuntimeError``) is a save that failed after its
``save_*_async`` returned, raised by the next save, ``wait()`` or ``close()``. Every other error
either is caught as its builtin (``CheckpointNotFoundError`` is a ``FileNotFoundError``,
``StorageError`` an ``OSError`` with its errno), or is a mistake to fix rather than catch
(``MismatchError``, ``InvalidArgumentError``, ...), or belongs to one feature (the memory tier's,
preemption's): it lives in :mod:`zerostall.errors` only.

A name that moved from the top level to its namespace still resolves from ``zerostall``, with a
``DeprecationWarning`` at each access naming its home, and is left out of ``__all__`` and
``dir()``.

The public names are imported on first use (PEP 562): ``import zerostall`` loads only the
version and the errors, so the writer and keeper processes, which import ``zerostall.persist``
or ``zerostall.memtier``, start without the save and load API (about half their start-up).
"""

import importlib as _importlib
import importlib.util as _importlib_util
import sys as _sys
import typing as _typing
import warnings as _warnings

from zerostall import errors
from zerostall._version import __version__
from zerostall.errors import BackgroundSaveError, CorruptCheckpointError, ZerostallError

if _typing.TYPE_CHECKING:
    from zerostall import advice
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

#: a name that was public at the top level -> its public home now. Resolved at every access with
#: a DeprecationWarning and never cached here, so each place that still uses it is told (the
#: warnings filter then shows each place once) and the name stays out of dir().
_MOVED: dict[str, str] = {
    **dict.fromkeys((
        "InvalidArgumentError", "ArgumentTypeError", "AdviceError", "MissingDependencyError",
        "CheckpointNotFoundError", "CheckpointExistsError", "ReadOnlyError",
        "ChecksumMismatchError", "NoValidCheckpointError", "UnsupportedFormatError",
        "MismatchError", "MissingKeyError", "UnsupportedLeafError", "MetadataError", "MetadataTypeError",
        "StorageError", "WriterError", "TornSnapshotError", "DonatedArrayError",
        "KeeperPersistError", "KeeperLostError", "DirectoryReplacedError", "ZerostallWarning",
        "PreemptionError",
    ), "zerostall.errors"),
    **dict.fromkeys(("Advice", "MeasuredCosts", "FailureMix", "ReplicaCost", "TierAdvice"), "zerostall.advice"),
    # a record in Checkpointer.keeper_failures, not an error (nothing raises it): it stays with
    # the memory tier's other keeper-failure records
    "UnadoptableKeeper": "zerostall.memtier.keeperfail",
}


def __getattr__(name: str) -> _typing.Any:
    home = _MOVED.get(name)
    if home is not None:
        # `from zerostall import X` asks twice: the import system's hasattr (to tell a name from a
        # submodule), then the statement itself; only the statement's ask warns
        if _sys._getframe(1).f_globals.get("__name__") != "importlib._bootstrap":
            _warnings.warn(f"zerostall.{name} is {home}.{name}: import it from there", DeprecationWarning,
                           stacklevel=2)
        return getattr(_importlib.import_module(home), name)
    module = _LAZY.get(name)
    if module is None:
        # a submodule (zerostall.advice, zerostall.api, ...) is an attribute after
        # `import zerostall`, as when every public name was imported eagerly
        if not name.startswith("_") and _importlib_util.find_spec(f"zerostall.{name}") is not None:
            return _importlib.import_module(f"zerostall.{name}")
        raise AttributeError(f"module 'zerostall' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later accesses are plain attribute lookups
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(__all__))


__all__ = [
    "__version__",
    # the two namespaces that hold the rest of the public names
    "errors", "advice",
    # saving and loading
    "save_pytree", "save_pytree_async", "save_checkpointables", "save_checkpointables_async",
    "load_pytree", "load_checkpointables", "load_metadata",
    "prepare", "release_buffers",
    "Checkpointer", "Response", "SaveStats",
    # configuration and extension
    "SaveOptions", "LoadOptions", "WriterKind", "Staging", "DistributedOptions", "Replicated", "MemoryTier",
    "Stateful", "LeafHandler", "register_handler", "unregister_handler",
    # the errors a training loop catches (every error class: zerostall.errors)
    "ZerostallError", "CorruptCheckpointError", "BackgroundSaveError",
]
