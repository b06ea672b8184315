"""Free functions: save and load one tree (``*_pytree``) or several named items (``*_checkpointables``).

The synchronous saves are the asynchronous ones plus ``result()``: one code path. The free
functions share one background writer and one set of staging buffers per :class:`SaveOptions`
in this process, started on first use and closed at interpreter exit (after in-flight saves
commit); use a :class:`~zerostall.Checkpointer` to own them explicitly.

Example::

    >>> import torch, zerostall
    >>> state = {"w": torch.arange(4.0), "step": 3}
    >>> response = zerostall.save_pytree_async("/tmp/zs-doc/ckpt", state)   # doctest: +SKIP
    >>> state["w"].add_(1)        # safe: the old values were already staged   # doctest: +SKIP
    >>> response.result()          # committed                                  # doctest: +SKIP
    >>> zerostall.load_pytree("/tmp/zs-doc/ckpt")["w"]                         # doctest: +SKIP
    tensor([0., 1., 2., 3.])
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from zerostall.distributed import DistContext, load
from zerostall.engine import Engine
from zerostall.errors import MissingKeyError
from zerostall.options import LoadOptions, SaveOptions
from zerostall.response import Response
from zerostall.storage import split_url

__all__ = [
    "PYTREE",
    "save_pytree", "save_pytree_async", "save_checkpointables", "save_checkpointables_async",
    "load_pytree", "load_checkpointables",
]

#: the item name under which ``save_pytree`` stores its tree
PYTREE = "pytree"

_engines: dict[SaveOptions, Engine] = {}
_engines_lock = threading.Lock()


def _engine(options: SaveOptions | None) -> Engine:
    opts = options or SaveOptions()
    with _engines_lock:
        eng = _engines.get(opts)
        if eng is None or eng.closed:
            eng = _engines[opts] = Engine(opts, coordinator=DistContext(opts.distributed))
        return eng


@atexit.register
def _close_engines() -> None:
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for eng in engines:
        eng.close()


def _path(path: str | os.PathLike[str]) -> str:
    return os.fspath(path)


def save_checkpointables_async(
    path: str | os.PathLike[str], items: dict[str, Any], *, metadata: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
) -> Response:
    """Stage ``{name: item}`` and return; the checkpoint at ``path`` commits in the background.

    ``path`` must not hold a checkpoint yet. On return every array has been copied, except the
    tensors only ``optimizer.step()`` modifies (overlapped staging, the default: the next
    ``step()`` waits for their copy; see :meth:`Response.wait_staged` and docs/guarantees.md).
    ``metadata`` is plain JSON stored in the manifest. Under
    ``torch.distributed`` the call is collective (docs/distributed.md).

    Raises:
        CheckpointExistsError: ``path`` already holds something (a committed checkpoint or not).
        UnsupportedLeafError: a leaf zerostall cannot save (the error names its key).
        WriterError: no writer could take the save.
        Errors of the background part (``StorageError`` with its errno, ``WriterError``,
        ``TornSnapshotError``, ...) are raised by the returned response's ``result()``.
    """
    parent, name = split_url(_path(path))
    return _engine(options).save_async(parent, name, dict(items), metadata=metadata)


def save_checkpointables(
    path: str | os.PathLike[str], items: dict[str, Any], *, metadata: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
) -> None:
    """Save ``{name: item}`` to ``path`` and return once it is committed.

    Raises:
        CheckpointExistsError, UnsupportedLeafError: as :func:`save_checkpointables_async`.
        StorageError: an I/O failure (errno kept: ENOSPC, EIO, ...); nothing was committed.
        WriterError: the writer died before the commit.
    """
    save_checkpointables_async(path, items, metadata=metadata, options=options).result()


def save_pytree_async(
    path: str | os.PathLike[str], tree: Any, *, metadata: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
) -> Response:
    """Stage ``tree`` and return; see :func:`save_checkpointables_async` (same errors)."""
    return save_checkpointables_async(path, {PYTREE: tree}, metadata=metadata, options=options)


def save_pytree(
    path: str | os.PathLike[str], tree: Any, *, metadata: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
) -> None:
    """Save ``tree`` to ``path`` and return once it is committed; see :func:`save_checkpointables` (same errors)."""
    save_pytree_async(path, tree, metadata=metadata, options=options).result()


def load_checkpointables(
    path: str | os.PathLike[str], items: dict[str, Any] | None = None, *, options: LoadOptions | None = None,
) -> dict[str, Any]:
    """Load named items. ``items`` maps a name to a template (filled in place) or ``None``.

    ``items=None`` loads every item as saved. A template restricts what is read to its keys;
    tensors and arrays in it are filled in place; ``Stateful`` objects get ``load_state_dict``.
    Every leaf read is verified against its checksum (``LoadOptions(verify=False)`` skips it).

    Raises:
        CheckpointNotFoundError: nothing is committed at ``path``.
        MissingKeyError: an item or a template key is not in the checkpoint.
        MismatchError: a template leaf differs in shape, dtype or kind.
        ChecksumMismatchError: a leaf's bytes do not match their checksum (names the key).
        CorruptCheckpointError: a data file is missing, truncated or malformed.
        UnsupportedFormatError: the checkpoint is of a newer format, or names an unregistered handler.
        StorageError: an I/O failure.
    """
    parent, name = split_url(_path(path))
    return load(parent, name, items, options)


def load_pytree(
    path: str | os.PathLike[str], template: Any = None, *, options: LoadOptions | None = None,
) -> Any:
    """Load the tree saved by :func:`save_pytree`, into ``template`` in place if given.

    Raises:
        The errors of :func:`load_checkpointables`.
    """
    out = load_checkpointables(path, {PYTREE: template}, options=options)
    if PYTREE not in out:  # pragma: no cover - load_items raises first
        raise MissingKeyError("no pytree item", path=str(path), key=PYTREE)
    return out[PYTREE]
