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
import logging
import os
import threading
from typing import Any

from zerostall.commit import committed_steps, is_committed, parse_step, step_name
from zerostall.distributed import DistContext, active, agree_step, load
from zerostall.engine import Engine
from zerostall.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MismatchError,
    MissingKeyError,
    NoValidCheckpointError,
)
from zerostall.options import LoadOptions, SaveOptions, WriterKind
from zerostall.response import Response
from zerostall.restore import ReadPlanner, Thunk, read_manifest, register_node_reader
from zerostall.storage import open_storage, split_url
from zerostall.validate import check_instance, check_int, check_items, check_path, clean_metadata

__all__ = [
    "PYTREE",
    "save_pytree", "save_pytree_async", "save_checkpointables", "save_checkpointables_async",
    "load_pytree", "load_checkpointables", "load_metadata",
    "load_newest_valid",
    "prepare", "release_buffers", "set_buffer_cache_limit",
]

log = logging.getLogger("zerostall")

#: the item name under which ``save_pytree`` stores its tree
PYTREE = "pytree"

_engines: dict[SaveOptions, Engine] = {}
_engines_lock = threading.Lock()


def _default_cache_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError):  # pragma: no cover - no sysconf: 4 GiB
        return 4 << 30


#: the bound on the staging memory each shared engine keeps (see set_buffer_cache_limit)
_cache_bytes = _default_cache_bytes()


def _engine(options: SaveOptions | None) -> Engine:
    opts = options or SaveOptions()
    with _engines_lock:
        eng = _engines.get(opts)
        if eng is None or eng.closed:
            eng = _engines[opts] = Engine(opts, coordinator=DistContext(opts.distributed),
                                          buffer_cache_bytes=_cache_bytes)
        return eng


@atexit.register
def _close_engines() -> None:
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for eng in engines:
        eng.close()


def _raise_shared_failures() -> None:
    """Raise a background failure of any shared engine (whatever its options) that nobody received."""
    with _engines_lock:
        engines = list(_engines.values())
    for eng in engines:
        eng.raise_failures()


def _path(path: str | os.PathLike[str]) -> str:
    return check_path(path)


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
        MetadataError: ``metadata`` holds NaN or infinity, or (``MetadataTypeError``) a value JSON
            cannot hold; the error names the key. Checked before anything is staged; numpy
            scalars are converted (see :func:`zerostall.validate.clean_metadata`).
        ArgumentTypeError, InvalidArgumentError: ``path``, ``items`` or ``options`` is malformed.
        WriterError: no writer could take the save.
        Errors of the background part (``StorageError`` with its errno, ``WriterError``,
        ``TornSnapshotError``, ...) are raised by the returned response's ``result()``.
        BackgroundSaveError: an earlier free-function save failed in the background and its
            response never raised it (``result()``); it names that save's step or path and cause.
            Nothing was saved by this call. A failure never received is warned about at
            interpreter exit (``RuntimeWarning``).
    """
    where = _path(path)
    check_items(items, where)
    check_instance("options", options, SaveOptions)
    metadata = clean_metadata(metadata, path=where)
    _raise_shared_failures()
    parent, name = split_url(where)
    check_writer_reaches(where, options)
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
    fallback: bool = False,
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
        NoValidCheckpointError: ``fallback=True`` and no candidate checkpoint loads.

    ``fallback=True`` walks back to the newest checkpoint that loads and verifies: ``path`` is a
    run directory (a :class:`~zerostall.Checkpointer`'s; its committed steps are tried newest
    first) or one of its ``step_…`` folders (that step first, then older ones). A checkpoint
    that is corrupt (``CorruptCheckpointError``, checksums included) or gone
    (``CheckpointNotFoundError``) is skipped with a WARNING on the ``zerostall`` logger naming it
    and why, and another naming the one loaded instead; other errors (a template mismatch)
    are raised at once. The step finally loaded overwrites every leaf the templates ask for, so
    nothing of a skipped step remains in them (with ``LoadOptions(atomic=True)`` a skipped step
    never touched them).
    """
    where = _path(path)
    if items is not None:
        check_items(items, where)
    check_instance("options", options, LoadOptions)
    if fallback:
        root, names = _fallback_candidates(where, options)
        return load_newest_valid(root, names, items, options)[1]
    parent, name = split_url(where)
    try:
        return load(parent, name, items, options)
    except MissingKeyError as exc:
        hinted_key = hint_item_layout(exc, parent, name)
        if hinted_key is exc:
            raise
        raise hinted_key from exc
    except CheckpointNotFoundError as exc:
        step = parse_step(name)
        hinted = exc if step is None else hint_held_in_memory(exc, parent, step)
        if hinted is exc:
            hinted = hint_run_layout(exc, where)
        if hinted is exc:
            raise
        raise hinted from exc


def hint_run_layout(exc: CheckpointNotFoundError, where: str, *,
                    newest: str = "the newest that loads with fallback=True (or Checkpointer(dir, read_only=True)"
                                  ".load_pytree(template=...))") -> CheckpointNotFoundError:
    """Given a Checkpointer's run directory, or a step folder it does not have (``step_1`` for
    ``step_00000001``), say which steps are there: "no manifest" alone does not say where to look."""
    try:
        steps = committed_steps(open_storage(where))
        if steps:
            path = f"{where.rstrip('/')}/{step_name(steps[-1])}"
            return CheckpointNotFoundError(
                f"{exc.message}; this is a run directory (a Checkpointer's) with {len(steps)} committed step(s) "
                f"({_few(steps)}): load one, e.g. {path!r}, or {newest}", path=exc.path, key=exc.key)
        parent, name = split_url(where)
        steps = committed_steps(open_storage(parent)) if parent else []
    except Exception:  # noqa: BLE001 - only a hint: the original error is what the user gets
        return exc
    if not steps:
        return exc
    return CheckpointNotFoundError(
        f"{exc.message}; {parent.rstrip('/')} has no {name!r} but holds committed steps {_few(steps)}, named like "
        f"{step_name(steps[-1])!r}", path=exc.path, key=exc.key)


def hint_item_layout(exc: MissingKeyError, parent: str, name: str) -> MissingKeyError:
    """A checkpoint of named items loaded with ``load_pytree`` (or a pytree one with named items):
    "no item 'pytree'" does not say which function saved it, nor which one loads it."""
    if exc.key is None or "/" in exc.key:
        return exc  # a key inside an item: the template's business
    if exc.key == PYTREE:
        return MissingKeyError(f"{exc.message}; it was saved with save_checkpointables (named items): load it with "
                               "load_checkpointables(path) or load_checkpointables(path, {name: template}) "
                               "(a Checkpointer: ckpt.load_checkpointables(step, {name: template}))",
                               path=exc.path, key=exc.key)
    try:
        saved = set(read_manifest(open_storage(parent), name, path=exc.path or name).items)
    except Exception:  # noqa: BLE001 - only a hint: the original error is what the user gets
        return exc
    if saved != {PYTREE}:
        return exc
    return MissingKeyError(f"{exc.message}; it was saved with save_pytree: load it with load_pytree(path) or "
                           f"load_pytree(path, {{{exc.key!r}: template, ...}}) (its tree's keys)",
                           path=exc.path, key=exc.key)


def _few(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"


def hint_held_in_memory(exc: CheckpointNotFoundError, directory: str, step: int) -> CheckpointNotFoundError:
    """``zerostall list`` shows a step "in memory only" that a keeper on this host holds for a
    trainer still running (or a crashed one's, not adopted yet): say why it does not load."""
    from zerostall.memtier.spec import held_steps  # a rare error's hint: a plain load imports no memory tier

    try:
        ranks = [rank for rank, img in held_steps(directory) if img.step == step]
    except Exception:  # noqa: BLE001 - only a hint: the original error is what the user gets
        return exc
    if not ranks:
        return exc
    return CheckpointNotFoundError(
        f"{exc.message}; step {step} is held only in the memory of this host's keeper of rank "
        f"{', '.join(map(str, ranks))}, which belongs to a trainer still running (or to a crashed one, "
        "until a Checkpointer with a memory tier adopts it): it reaches storage at that trainer's next persisted save or its close()",
        path=exc.path, key=exc.key, rank=exc.rank)


def load_pytree(
    path: str | os.PathLike[str], template: Any = None, *, options: LoadOptions | None = None,
    fallback: bool = False,
) -> Any:
    """Load the tree saved by :func:`save_pytree`, into ``template`` in place if given.

    ``fallback=True``: the newest checkpoint of a run that loads (see :func:`load_checkpointables`).

    Raises:
        The errors of :func:`load_checkpointables`.
    """
    out = load_checkpointables(path, {PYTREE: template}, options=options, fallback=fallback)
    if PYTREE not in out:  # pragma: no cover - load_items raises first
        raise MissingKeyError("no pytree item", path=str(path), key=PYTREE)
    return out[PYTREE]


def _fallback_candidates(path: str, options: LoadOptions | None) -> tuple[str, list[str]]:
    """Where a fallback load looks: (root, checkpoint names under it, newest first)."""
    parent, name = split_url(path)
    step = parse_step(name)
    if step is not None:  # a step of a run: it, then the older committed ones
        older = [s for s in committed_steps(open_storage(parent)) if s < step]
        root, names = parent, [name, *(step_name(s) for s in reversed(older))]
    elif not is_committed(open_storage(parent), name) and (steps := committed_steps(open_storage(path))):
        root, names = path, [step_name(s) for s in reversed(steps)]  # a run directory
    else:
        root, names = parent, [name]  # a lone checkpoint: nothing older to fall back to
    dopts = (options or LoadOptions()).distributed
    if active(dopts):  # every rank tries the same checkpoints in the same order
        root, names = agree_step((root, names), dopts)
    return root, names


def load_newest_valid(root: str, names: list[str], items: dict[str, Any] | None,
                      options: LoadOptions | None = None) -> tuple[str, dict[str, Any]]:
    """Load the first of ``names`` (checkpoints under ``root``, newest first) that loads and verifies.

    Returns its name and the loaded items. Each skipped checkpoint is logged (WARNING, the
    ``zerostall`` logger) with the error that skipped it, and the one loaded instead as well.

    Raises:
        CheckpointNotFoundError: ``names`` is empty, or none of them exists.
        NoValidCheckpointError: none of them loads; the message names each and why.
        The other errors of :func:`load_checkpointables` at once (they would recur on every step).
    """
    if not names:
        raise CheckpointNotFoundError("no committed checkpoint to load", path=root)
    failures: list[tuple[str, BaseException]] = []
    for name in names:
        try:
            out = load(root, name, items, options)
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            failures.append((name, exc))
            log.warning("fallback: skipping %s/%s, it does not load: %s: %s", root.rstrip("/"), name,
                        type(exc).__name__, exc)
            continue
        if failures:
            log.warning("fallback: loaded %s/%s instead of %s (%d newer checkpoint(s) skipped)", root.rstrip("/"),
                        name, failures[0][0], len(failures))
        return name, out
    if all(isinstance(e, CheckpointNotFoundError) for _, e in failures):  # nothing there at all
        raise CheckpointNotFoundError(f"no committed checkpoint to load (tried {', '.join(n for n, _ in failures)})",
                                      path=root) from failures[-1][1]
    tried = "; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in failures)
    raise NoValidCheckpointError(f"no checkpoint loads ({len(failures)} tried, newest first: {tried})",
                                 path=root) from failures[-1][1]


def load_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``metadata=`` a checkpoint was saved with (a Checkpointer's step adds ``"step"``).

    Reads the manifest only: no array data, no writer, no torch. ``path`` is one checkpoint
    (for a :class:`~zerostall.Checkpointer`, one ``step_...`` directory; or use its
    :meth:`~zerostall.Checkpointer.metadata`).

    Raises:
        CheckpointNotFoundError: nothing is committed at ``path``.
        CorruptCheckpointError, UnsupportedFormatError: the manifest is malformed or newer.
        StorageError: an I/O failure.

    Example::

        >>> zerostall.save_pytree("/tmp/zs-doc/m", {"w": 1}, metadata={"loss": 0.5})   # doctest: +SKIP
        >>> zerostall.load_metadata("/tmp/zs-doc/m")                                   # doctest: +SKIP
        {'loss': 0.5}
    """
    where = _path(path)
    parent, name = split_url(where)
    try:
        return dict(read_manifest(open_storage(parent), name, path=where).metadata)
    except CheckpointNotFoundError as exc:
        hinted = hint_run_layout(exc, where, newest="the newest with Checkpointer(dir, read_only=True).metadata()")
        if hinted is exc:
            raise
        raise hinted from exc


# -- the shared engines' buffers ---------------------------------------------------------------


def prepare(tree: Any = None, *, items: dict[str, Any] | None = None, options: SaveOptions | None = None) -> int:
    """Get the free functions ready to save ``tree`` (or ``items``) cheaply, without saving it.

    Plans the layout, allocates and pre-faults the staging buffers for it (every in-flight slot
    of ``options.max_in_flight``) and starts the background writer, returning once it is up; the
    first :func:`save_pytree` (or :func:`save_checkpointables` for ``items``) of that layout with
    the same ``options`` then only copies and writes, like a later one. Call it once the state
    has its final layout (optimizers create their state at their first step). Returns the bytes
    of staging memory allocated for the layout; they stay until :func:`release_buffers`, the
    cache's bound or interpreter exit.

    Raises:
        ValueError: neither or both of ``tree`` and ``items`` were given.
        UnsupportedLeafError: a leaf zerostall cannot save (the error names its key).

    Example::

        >>> zerostall.prepare(state)                          # doctest: +SKIP
        >>> zerostall.save_pytree("/tmp/zs-doc/a", state)     # as cheap as a later save  # doctest: +SKIP
    """
    if (tree is None) == (items is None):
        raise InvalidArgumentError("pass exactly one of tree or items=", argument="items")
    if items is not None:
        check_items(items)  # a list failed in dict() with a bare TypeError
    check_instance("options", options, SaveOptions)
    eng = _engine(options)
    nbytes = eng.prepare(dict(items) if items is not None else {PYTREE: tree})
    eng.writer_ready(_WRITER_READY_TIMEOUT_S)
    return nbytes


#: how long prepare() waits for the writer to say hello (a slower start is not an error)
_WRITER_READY_TIMEOUT_S = 60.0


def release_buffers() -> int:
    """Free the free functions' staging buffers and stop their writers; returns the bytes freed.

    Waits for the free functions' in-flight saves to commit first. The next free-function save
    (or :func:`prepare`) allocates and starts again. Also done at interpreter exit. A
    :class:`~zerostall.Checkpointer` owns its own buffers and is not affected. Do not call it
    while another thread is in a free-function save.

    Raises:
        BackgroundSaveError: a free-function save failed in the background and nobody received
            its error (names its path and cause); the buffers are freed all the same.

    Example::

        >>> zerostall.save_pytree("/tmp/zs-doc/b", state)   # doctest: +SKIP
        >>> zerostall.release_buffers() > 0                 # doctest: +SKIP
        True
    """
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    freed = 0
    failures = []
    for eng in engines:
        if not eng.closed:
            freed += eng.pool.held_bytes()
            eng.close()
        err = eng.take_failures()
        if err is not None:
            failures.append(err)
    if failures:
        raise failures[0] from failures[0].cause
    return freed


def set_buffer_cache_limit(nbytes: int) -> None:
    """Bound the staging memory each set of :class:`SaveOptions` keeps for the free functions.

    The free functions keep staging buffers per layout, so alternating saves of different
    layouts (a model alone, then model and optimizer) each find theirs ready. Idle buffer sets
    are freed, least recently used first, when one engine's buffers exceed ``nbytes``; the
    buffers of the save being staged are always kept, so a state larger than the bound still
    saves (it only loses its spares). Default: a quarter of physical memory. Running engines
    follow the new bound from their next save on; ``0`` keeps only the buffers in use.

    Raises:
        ValueError: ``nbytes`` < 0.
    """
    global _cache_bytes
    check_int("nbytes", nbytes, lo=0)
    with _engines_lock:
        _cache_bytes = int(nbytes)
        for eng in _engines.values():
            eng.pool.cache_bytes = _cache_bytes


# -- common mistakes, refused with what to do -------------------------------------------------


def check_writer_reaches(path: str, options: SaveOptions | None) -> None:
    """Refuse a save to ``memory://`` that the default writer *process* would make in its own memory.

    ``memory://`` storage is a dictionary of the process that opens it: a writer process would
    commit the checkpoint into its own memory, where this process never finds it (a silent loss).

    Raises:
        InvalidArgumentError: ``path`` is a ``memory://`` URL and ``options`` does not ask for
            the thread writer.
    """
    if not str(path).lower().startswith("memory://"):
        return
    if (options or SaveOptions()).writer is WriterKind.THREAD:
        return
    raise InvalidArgumentError(
        "memory:// storage lives in one process, and saves are written by a separate writer process by "
        "default, so this checkpoint could never be loaded here: pass "
        "SaveOptions(writer=WriterKind.THREAD) (options= or a Checkpointer's save_options=), or save to a directory",
        path=str(path), argument="options")


def _refuse_meta_template(planner: ReadPlanner, node: dict[str, object], tmpl: object, key: str) -> Thunk | None:
    """A template tensor on torch's ``meta`` device has no memory to load into: loading would hand
    it back still empty, as if it had been restored. Refused, naming the key."""
    if getattr(tmpl, "is_meta", False) is not True:
        return None
    raise MismatchError(
        "the template tensor is on the meta device (it has no storage to load into): materialize it first, "
        "e.g. model.to_empty(device='cpu') or the device it trains on, then load", path=planner.path, key=key)


register_node_reader(_refuse_meta_template)
