"""Lightning integration: :class:`ZerostallCheckpointIO`, a ``CheckpointIO`` plugin that saves through zerostall.

``save_checkpoint`` returns once the checkpoint is staged (copied into zerostall's host buffers);
zerostall's writer process commits it in the background, and still does if the trainer is killed.
``load_checkpoint`` reads it back without pickle. Only the public ``zerostall`` API and the layout's names
(:mod:`zerostall.format.layout`) are used.

Layout. Lightning names a checkpoint by a file path (``.../epoch=3-step=40.ckpt``), expects that
path to exist as soon as ``save_checkpoint`` returns (``ModelCheckpoint`` picks the next free name
with ``fs.exists``) and overwrites some paths (``last.ckpt``). A zerostall checkpoint exists only
once committed and is never overwritten. So the Lightning path is a directory, created before
``save_checkpoint`` returns, that holds zerostall checkpoints named like a Checkpointer's steps::

    epoch=3-step=40.ckpt/          created at once by save_checkpoint
      step_00000001/               a committed zerostall checkpoint (manifest.json, data/)
      .step_00000002.zs-tmp-…/     a save still in flight (invisible until its rename)

Loading reads the newest committed ``step_*``. Saving to the same path again writes the next
number and deletes the older ones only after it has committed: an overwrite is atomic, and a
crash at any moment leaves the path loadable (if it ever was). The numbers count saves to that
path; Lightning's global step is inside the checkpoint (and in the manifest's metadata).

What is saved. Two items: ``lightning`` (the checkpoint dict, with the values below converted)
and ``conversions`` (where those values were, and their type), so that loading gives them back:

* ``argparse.Namespace`` → dict of its attributes → ``Namespace``;
* ``pathlib`` paths → ``str`` → the same path class (a concrete class of another OS → its pure one);
* ``set`` / ``frozenset`` → list → ``set`` / ``frozenset``;
* ``torch.Size`` → tuple of ints → ``torch.Size``;
* ``collections.OrderedDict`` and Lightning's ``AttributeDict`` → dict → the same class.

Other dict, list and tuple subclasses come back as plain dict / list / tuple (named tuples too:
the checkpoint never names a class to import). An object with ``state_dict()`` /
``load_state_dict()`` outside ``state_dict`` / ``optimizer_states`` (an ``nn.Module`` in the
hyper-parameters, say) is refused with :class:`~zerostall.UnsupportedLeafError` naming its key:
it would come back as its state dict, not as the object. Anything else zerostall cannot save (an
``Enum``, a class, a function, an OmegaConf config) is refused the same way, unless its type has a
handler registered with :func:`zerostall.register_handler`. Nothing is pickled or dropped.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import logging
import os
import pathlib
import shutil
import threading
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, Union

import numpy as np
import torch

import zerostall
from zerostall import CorruptCheckpointError, DistributedOptions, LoadOptions, Response, SaveOptions, ZerostallError
from zerostall.errors import (
    ArgumentTypeError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    MissingDependencyError,
    MissingKeyError,
    StorageError,
    UnsupportedFormatError,
    UnsupportedLeafError,
    ZerostallWarning,
)
from zerostall.format.layout import (
    LIGHTNING_REMOVED_MARK,
    MANIFEST_NAME,
    STEP_RE,
    TAKEN_STEP_RE,
    fsync_dir,
    step_name,
)

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.utilities import AttributeDict
except ImportError as exc:  # depends on the environment (tests/adversarial/test_missing_dependencies.py blocks it)
    raise MissingDependencyError(
        "zerostall.lightning needs the `lightning` package, which is not installed: "
        "pip install 'zerostall[lightning]'", name=(exc.name or "lightning").split(".")[0]) from exc

__all__ = ["ZerostallCheckpointIO"]

log = logging.getLogger("zerostall")

PathLike = Union[str, "os.PathLike[str]"]
Key = str | int

#: the item holding Lightning's checkpoint dict, and the item recording converted values
ITEM = "lightning"
CONVERSIONS = "conversions"

# Filled by torch's state_dict(): tensors and plain values, where zerostall's own rules apply and
# walking thousands of leaves twice would only cost the training thread time.
_TORCH_STATE = frozenset({"state_dict", "optimizer_states"})
_PLAIN = frozenset({type(None), bool, int, float, str, bytes})
_MAX_DEPTH = 200

_PATH_TYPES: dict[str, type[pathlib.PurePath]] = {
    cls.__name__: cls
    for cls in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path,
                pathlib.PosixPath, pathlib.WindowsPath)
}
_PURE_OF: dict[str, type[pathlib.PurePath]] = {
    "Path": pathlib.PurePath, "PosixPath": pathlib.PurePosixPath, "WindowsPath": pathlib.PureWindowsPath,
}


# ----------------------------------------------------------------------------------------------
# converting the values zerostall has no node for, and back


def _key(path: list[Key]) -> str:
    return "/".join(str(k) for k in path)


def _encode(obj: Any, path: list[Key], out: list[list[Any]]) -> Any:
    """Return ``obj`` with convertible values replaced (copying only the containers that change)
    and append ``[path, tag]`` to ``out`` for each one. Unknown leaves are left for zerostall."""
    if len(path) > _MAX_DEPTH:
        raise UnsupportedLeafError(f"checkpoint is nested deeper than {_MAX_DEPTH} levels (a cycle?)",
                                   key=_key(path))
    t = type(obj)
    if t in _PLAIN or isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        return obj
    if isinstance(obj, dict):
        if t is collections.OrderedDict or isinstance(obj, AttributeDict):
            out.append([list(path), "OrderedDict" if t is collections.OrderedDict else "AttributeDict"])
        return _encode_dict(obj, path, out)
    if isinstance(obj, argparse.Namespace):
        out.append([list(path), "Namespace"])
        return _encode_dict(dict(vars(obj)), path, out, copy=True)
    if isinstance(obj, pathlib.PurePath):
        name = next(c.__name__ for c in t.__mro__ if _PATH_TYPES.get(c.__name__) is c)
        out.append([list(path), f"path:{name}"])
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        out.append([list(path), "frozenset" if isinstance(obj, frozenset) else "set"])
        return [_encode(v, [*path, i], out) for i, v in enumerate(obj)]
    if t is torch.Size:
        out.append([list(path), "torch.Size"])
        return tuple(int(s) for s in obj)
    if isinstance(obj, (list, tuple)):
        values = [_encode(v, [*path, i], out) for i, v in enumerate(obj)]
        if all(a is b for a, b in zip(values, obj, strict=True)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return t._make(values)
        return values if isinstance(obj, list) else tuple(values)
    if t.__module__.partition(".")[0] == "omegaconf":
        raise UnsupportedLeafError(
            f"cannot save an OmegaConf {t.__name__}; call self.save_hyperparameters("
            "OmegaConf.to_container(cfg, resolve=True)) so that the hyper-parameters are plain values",
            key=_key(path))
    if not isinstance(obj, type) and callable(getattr(obj, "state_dict", None)) \
            and callable(getattr(obj, "load_state_dict", None)):
        raise UnsupportedLeafError(
            f"a {t.__module__}.{t.__qualname__} in a Lightning checkpoint would be loaded back as its "
            "state_dict(), not as the object; store obj.state_dict() there yourself, or (hyper-parameters) "
            "leave it out with self.save_hyperparameters(ignore=[...])", key=_key(path))
    return obj  # zerostall decides: a registered handler, or UnsupportedLeafError naming the key


def _encode_dict(obj: dict[Any, Any], path: list[Key], out: list[list[Any]], copy: bool = False) -> Any:
    changed = copy
    values = []
    for k, v in obj.items():
        if not path and k in _TORCH_STATE:
            values.append(v)
            continue
        nv = _encode(v, [*path, k], out)
        changed = changed or nv is not v
        values.append(nv)
    return dict(zip(obj.keys(), values, strict=True)) if changed else obj


@dataclasses.dataclass
class _Trie:
    tag: str | None = None
    children: dict[Key, _Trie] = dataclasses.field(default_factory=dict)


def _decode(tree: Any, conversions: Any, where: str) -> Any:
    """Undo :func:`_encode` on a loaded tree, innermost values first."""
    root = _Trie()
    if not isinstance(conversions, (list, tuple)):
        raise CorruptCheckpointError("the conversions item is not a list", path=where, key=CONVERSIONS)
    for entry in conversions:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str)
                and isinstance(entry[0], (list, tuple)) and all(type(k) in (str, int) for k in entry[0])):
            raise CorruptCheckpointError(f"malformed conversion entry {entry!r}", path=where, key=CONVERSIONS)
        node = root
        for k in entry[0]:
            node = node.children.setdefault(k, _Trie())
        node.tag = entry[1]
    return _apply(tree, root, [], where)


def _apply(node: Any, trie: _Trie, path: list[Key], where: str) -> Any:
    if trie.children:
        if isinstance(node, dict):
            for k, sub in trie.children.items():
                if k not in node:
                    raise CorruptCheckpointError("a recorded conversion names a missing key", path=where,
                                                 key=_key([*path, k]))
                node[k] = _apply(node[k], sub, [*path, k], where)
        elif isinstance(node, (list, tuple)):
            items = list(node)
            for k, sub in trie.children.items():
                if not isinstance(k, int) or not 0 <= k < len(items):
                    raise CorruptCheckpointError("a recorded conversion names a missing index", path=where,
                                                 key=_key([*path, k]))
                items[k] = _apply(items[k], sub, [*path, k], where)
            node = items if isinstance(node, list) else tuple(items)
        else:
            raise CorruptCheckpointError("a recorded conversion names a leaf's child", path=where, key=_key(path))
    return node if trie.tag is None else _restore(node, trie.tag, path, where)


def _restore(value: Any, tag: str, path: list[Key], where: str) -> Any:
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"recorded as {tag} but {what}: {type(value).__name__}", path=where,
                                      key=_key(path))

    if tag in ("Namespace", "OrderedDict", "AttributeDict"):
        if not isinstance(value, dict):
            raise bad("not saved as a dict")
        if tag == "Namespace":
            if not all(isinstance(k, str) for k in value):
                raise bad("has non-string keys")
            return argparse.Namespace(**value)
        return collections.OrderedDict(value) if tag == "OrderedDict" else AttributeDict(value)
    if tag in ("set", "frozenset"):
        if not isinstance(value, list):
            raise bad("not saved as a list")
        try:
            return set(value) if tag == "set" else frozenset(value)
        except TypeError as exc:
            raise bad(f"holds an unhashable value ({exc})") from exc
    if tag == "torch.Size":
        if not (isinstance(value, (list, tuple)) and all(type(s) is int for s in value)):
            raise bad("not saved as a tuple of ints")
        return torch.Size(value)
    kind, _, name = tag.partition(":")
    if kind == "path" and name in _PATH_TYPES:
        if not isinstance(value, str):
            raise bad("not saved as a str")
        try:
            return _PATH_TYPES[name](value)
        except NotImplementedError:  # a concrete path of another OS (WindowsPath on Linux)
            return _PURE_OF[name](value)
    raise UnsupportedFormatError(f"unknown converted type {tag!r} (saved by a newer zerostall?)", path=where,
                                 key=_key(path))


# ----------------------------------------------------------------------------------------------
# map_location


def _placement(map_location: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How to place each loaded (CPU) tensor, following ``torch.load``'s ``map_location`` forms.

    zerostall does not record the device a tensor was saved from, so a dict or a function is
    applied as if every tensor had been saved from ``"cpu"``.
    """
    if map_location is None:
        return None
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return None if target is None else _placement(target)
    if isinstance(map_location, (str, torch.device, int)):
        device = torch.device(map_location)
        if device.type == "cpu":
            return None
        return lambda t: t.to(device)
    if callable(map_location):
        fn = map_location

        def by_function(t: torch.Tensor) -> torch.Tensor:
            placed = fn(t.untyped_storage(), "cpu")
            device = getattr(placed, "device", None)
            if not isinstance(device, torch.device):
                raise ArgumentTypeError(f"map_location function returned {type(placed).__name__}, not a storage")
            return t if device == t.device else t.to(device)

        return by_function
    raise ArgumentTypeError(f"map_location must be None, a device (str, torch.device, int), a dict or a function; "
                            f"got {type(map_location).__name__}", argument="map_location")


def _place(tree: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return move(tree)
    if isinstance(tree, dict):
        for k, v in tree.items():
            tree[k] = _place(v, move)
        return tree
    if isinstance(tree, list):
        return [_place(v, move) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_place(v, move) for v in tree)
    return tree


# ----------------------------------------------------------------------------------------------
# the container directory


def _local_path(path: PathLike) -> str:
    p = os.path.expanduser(os.fspath(path))
    if p.startswith("file://"):
        return p[len("file://"):]
    if "://" in p:
        raise StorageError("ZerostallCheckpointIO supports local filesystem paths only", errno=errno.EOPNOTSUPP,
                           path=p)
    return p


def _storage_error(exc: OSError, path: str, doing: str) -> StorageError:
    return StorageError(f"{doing}: {exc.strerror or exc}", errno=exc.errno, path=path)


def _numbers(container: str) -> list[tuple[int, str]]:
    """``(number, name)`` of every committed ``step_*`` checkpoint in ``container``, ascending."""
    found = []
    with os.scandir(container) as it:
        for entry in it:
            m = STEP_RE.match(entry.name)
            if m and os.path.isfile(os.path.join(entry.path, MANIFEST_NAME)):
                found.append((int(m.group(1)), entry.name))
    return sorted(found)


def _never_committed(container: str) -> str:
    """Why a plugin directory holds no committed checkpoint, and where to resume from instead.

    The directory is made when its first save starts (Lightning expects the path at once), so a
    trainer killed during that save leaves it empty, and ``fit(ckpt_path="last")`` picks it:
    the user is told which sibling checkpoints hold committed saves.
    """
    siblings = []
    try:
        with os.scandir(os.path.dirname(container) or ".") as it:
            for entry in sorted(it, key=lambda e: e.name):
                if entry.is_dir() and entry.path != container and not entry.name.startswith("."):
                    try:
                        if _numbers(entry.path):
                            siblings.append(entry.path)
                    except OSError:
                        continue
    except OSError:
        pass
    why = ": its first save never committed (the trainer was killed, or the save failed, before the commit)"
    if siblings:
        return (f"{why}; these hold committed ones: {', '.join(repr(s) for s in siblings[:8])} (pass one as "
                "ckpt_path), and delete this directory (Lightning's ckpt_path='last' picks it while it exists)")
    return (f"{why}; nothing beside it holds a committed save either: delete this directory and start without "
            "ckpt_path (Lightning's ckpt_path='last' picks it while it exists)")


def _newest_committed_sibling(container: str) -> tuple[str, int | None] | None:
    """The newest committed checkpoint of the plugin directories beside ``container``:
    ``(its step directory, its Lightning global step)``, or None when there is none.

    "Newest" is the highest ``global_step`` in the manifest's metadata (what Lightning's own
    resume continues from), then the highest save number, then the newest manifest; a sibling
    whose manifest cannot be read is passed over (the load of the one chosen verifies it).
    """
    best: tuple[tuple[int, int, float], str, int | None] | None = None
    try:
        with os.scandir(os.path.dirname(container) or ".") as it:
            entries = [e for e in it if not e.name.startswith(".")]
    except OSError:
        return None
    for entry in entries:
        try:
            if entry.path == container or not entry.is_dir(follow_symlinks=False) or not _is_container(entry.path):
                continue
            numbers = _numbers(entry.path)
            if not numbers:
                continue
            where = os.path.join(entry.path, numbers[-1][1])
            meta = zerostall.load_metadata(where).get("lightning", {})
            mtime = os.stat(os.path.join(where, MANIFEST_NAME)).st_mtime
        except (OSError, ZerostallError):
            continue
        step = meta.get("global_step") if isinstance(meta, dict) else None
        step = step if type(step) is int else None
        key = (-1 if step is None else step, numbers[-1][0], mtime)
        if best is None or key > best[0]:
            best = (key, where, step)
    return None if best is None else (best[1], best[2])


def _is_container(path: str) -> bool:
    """A directory this plugin made: only ``step_*`` checkpoints and hidden entries inside."""
    with os.scandir(path) as it:
        return all(STEP_RE.match(e.name) or e.name.startswith(".") for e in it)


def _delete(path: str) -> None:
    """Delete a checkpoint directory (or file) so that no moment of it looks committed.

    Every ``manifest.json`` goes first (the checkpoint and each ``step_*`` in it become invisible
    at once), then the data. A missing path is not an error.
    """
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            os.unlink(path)
            return
        with os.scandir(path) as it:
            subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
        for sub in (path, *subdirs):
            try:
                os.unlink(os.path.join(sub, MANIFEST_NAME))
            except FileNotFoundError:
                pass
        shutil.rmtree(path)
    except FileNotFoundError:
        pass


@dataclasses.dataclass(eq=False)
class _Save:
    response: Response
    container: str  # real path of the Lightning path's directory
    number: int
    created: bool  # the container was made by this save (its parent entry is fsynced after commit)
    replaced: str | None  # an old file moved aside for this save, deleted once it commits


# ----------------------------------------------------------------------------------------------
# the plugin


class ZerostallCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves asynchronously through zerostall and loads without pickle.

    ``save_checkpoint`` returns once the state is staged; the checkpoint commits in the background
    (a writer process, which finishes it even if the trainer is killed). The path Lightning gives
    becomes a directory at once (see the module docstring for the layout and for which values are
    converted). ``remove_checkpoint`` and ``load_checkpoint`` first wait for saves still in flight to
    that path; ``teardown`` (end of ``fit`` / ``validate`` / ...) waits for all of them. A save that
    failed in the background is raised by the next ``save_checkpoint``, ``remove_checkpoint``,
    ``load_checkpoint`` or ``teardown``, with its zerostall error class (naming the checkpoint's path).

    Args:
        save_options: how saves are staged and written (``max_in_flight=2`` lets the ``last.ckpt``
            save that follows a top-k save start without waiting for the first one's bytes to be
            written). Saves are per process: Lightning already calls ``save_checkpoint`` on global
            rank 0 only, so ``distributed`` must be unset or disabled.
        load_options: how checkpoints are read (``verify=False`` skips checksums).

    Raises:
        ValueError: ``save_options`` or ``load_options`` enable collective (torch.distributed) behaviour.

    Example::

        >>> import lightning.pytorch as pl                                     # doctest: +SKIP
        >>> from zerostall.lightning import ZerostallCheckpointIO              # doctest: +SKIP
        >>> trainer = pl.Trainer(plugins=[ZerostallCheckpointIO()],            # doctest: +SKIP
        ...                      callbacks=[pl.callbacks.ModelCheckpoint(save_last=True)])
        >>> trainer.fit(model, ckpt_path="last")                               # doctest: +SKIP
    """

    def __init__(self, save_options: SaveOptions | None = None, load_options: LoadOptions | None = None) -> None:
        super().__init__()
        for name, value, cls in (("save_options", save_options, SaveOptions), ("load_options", load_options, LoadOptions)):
            if value is not None and not isinstance(value, cls):  # a dict failed later, as AttributeError
                raise ArgumentTypeError(f"ZerostallCheckpointIO {name} must be a zerostall.{cls.__name__} or None, got "
                                        f"{type(value).__name__}: pass {name}=zerostall.{cls.__name__}(...)",
                                        argument=name)
        self.save_options = _per_process(save_options or SaveOptions())
        self.load_options = _per_process(load_options or LoadOptions())
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._saves: dict[str, list[_Save]] = {}  # container -> saves not yet settled
        self._failures: list[ZerostallError] = []
        self._cleaner: ThreadPoolExecutor | None = None
        self._cleanups: set[Future[None]] = set()

    # Spawn-based launchers (ddp_spawn) pickle the trainer and its plugins: send the options only.
    def __getstate__(self) -> dict[str, Any]:
        return {"save_options": self.save_options, "load_options": self.load_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.save_options = state["save_options"]
        self.load_options = state["load_options"]
        self._init_runtime()

    # -- CheckpointIO ----------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` and return; it commits under ``path`` in the background.

        ``path`` exists (as a directory) when this returns. A path saved before is overwritten
        atomically: loads see the previous checkpoint until the new one has committed.

        Raises:
            UnsupportedLeafError: a value cannot be saved faithfully (its key is named).
            CheckpointExistsError: ``path`` is a directory that this plugin did not make.
            ZerostallError: a previous save failed in the background (its own class).
            TypeError: ``storage_options`` was given (there are none).
        """
        self._raise_failure()
        if storage_options is not None:
            raise ArgumentTypeError(f"{type(self).__name__} takes no storage_options; configure it with "
                                    "ZerostallCheckpointIO(save_options=zerostall.SaveOptions(...))")
        p = _local_path(path)
        if not isinstance(checkpoint, dict):  # Lightning passes dump_checkpoint()'s dict; a list failed as AttributeError
            raise ArgumentTypeError(f"checkpoint must be a dict (what Lightning's dump_checkpoint returns), got "
                                    f"{type(checkpoint).__name__}", argument="checkpoint", path=p)
        conversions: list[list[Any]] = []
        try:
            tree = _encode(checkpoint, [], conversions)
        except UnsupportedLeafError as exc:
            raise UnsupportedLeafError(exc.message, path=p, key=exc.key) from exc
        container, created, replaced = self._container(p)
        with self._lock:
            pending = [s.number for s in self._saves.get(container, [])]
        try:
            taken = [int(m.group(1)) for n in os.listdir(container) if (m := TAKEN_STEP_RE.match(n))]
        except OSError as exc:
            raise _storage_error(exc, p, "cannot list the checkpoint directory") from exc
        number = max([0, *taken, *pending]) + 1
        metadata = {"lightning": {"path": p, "save": number,
                                  **{k: checkpoint[k] for k in ("epoch", "global_step")
                                     if type(checkpoint.get(k)) is int}}}
        try:
            response = zerostall.save_checkpointables_async(
                os.path.join(container, step_name(number)), {ITEM: tree, CONVERSIONS: conversions},
                metadata=metadata, options=self.save_options)
        except BaseException as exc:
            self._undo_container(p, container, created, replaced)
            if isinstance(exc, UnsupportedLeafError) and exc.key is not None and exc.key.startswith(ITEM):
                raise UnsupportedLeafError(exc.message, path=p, key=exc.key[len(ITEM) + 1:] or None) from exc
            raise
        save = _Save(response, container, number, created, replaced)
        with self._lock:
            self._saves.setdefault(container, []).append(save)
        response.add_done_callback(lambda _r: self._settle(save))

    def load_checkpoint(self, path: PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the newest committed checkpoint at ``path`` (waiting for saves to it still in flight).

        Tensors come back in CPU memory unless ``map_location`` says otherwise: a device (str,
        ``torch.device``, int) moves every tensor there; a dict or a function is applied as if
        every tensor had been saved from ``"cpu"`` (the checkpoint does not record devices).
        ``weights_only`` is accepted for Lightning's sake: nothing is ever unpickled.

        Raises:
            CheckpointNotFoundError: nothing committed at ``path`` (or it is a file, e.g. from torch.save).
            CorruptCheckpointError: the bytes or the manifest are damaged (checksums are verified).
            ZerostallError: a previous save failed in the background (its own class).
            TypeError: an unsupported ``map_location``.
        """
        self._raise_failure()
        move = _placement(map_location)
        p = _local_path(path)
        container = os.path.realpath(p)
        self._wait(container)
        if not os.path.isdir(container):
            what = "is a file, not a zerostall checkpoint directory (zerostall never unpickles)" \
                if os.path.exists(container) else "does not exist"
            raise CheckpointNotFoundError(f"the checkpoint path {what}", path=p)
        try:
            numbers = _numbers(container)
        except OSError as exc:
            raise _storage_error(exc, p, "cannot list the checkpoint directory") from exc
        if numbers:
            where = os.path.join(container, numbers[-1][1])
        else:
            # The directory is made when its first save starts (Lightning wants the path at once),
            # so a trainer killed during that save leaves it empty, and fit(ckpt_path="last") picks
            # it at every restart. Resume from the newest committed save beside it, and say so.
            # Only for a "last" checkpoint (what Lightning's "last" resolves to): a path asked for by
            # name (a top-k one, or one whose save failed) stays an error naming the siblings.
            sibling = _newest_committed_sibling(container) if "last" in os.path.basename(container) else None
            if sibling is None:
                raise CheckpointNotFoundError("no committed zerostall checkpoint in this directory"
                                              + _never_committed(container), path=p)
            where, step = sibling
            msg = (f"zerostall: {p} holds no committed checkpoint (its first save never committed: the trainer "
                   f"was killed, or the save failed, before the commit); loading the newest committed one beside "
                   f"it instead: {where}" + (f" (global step {step})" if step is not None else ""))
            log.warning("%s", msg)
            warnings.warn(msg, ZerostallWarning, stacklevel=2)
        out = zerostall.load_checkpointables(where, options=self.load_options)
        if ITEM not in out:
            raise MissingKeyError("not a Lightning checkpoint (no 'lightning' item)", path=where, key=ITEM)
        tree = out[ITEM] if move is None else _place(out[ITEM], move)
        loaded = _decode(tree, out.get(CONVERSIONS, []), where)
        if not isinstance(loaded, dict):
            raise CorruptCheckpointError(f"the Lightning checkpoint is a {type(loaded).__name__}, not a dict",
                                         path=where, key=ITEM)
        return loaded

    def remove_checkpoint(self, path: PathLike) -> None:
        """Remove ``path``, first waiting for saves to it that are still in flight.

        ``path`` is gone when this returns (renamed away in one step); the files are deleted in the
        background, every ``manifest.json`` first. A symlink (``save_last="link"``) is unlinked,
        never followed.

        Raises:
            ZerostallError: a save failed in the background (its own class), or the removal failed
                (``StorageError``).
        """
        self._raise_failure()
        p = _local_path(path)
        if os.path.islink(p):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise _storage_error(exc, p, "cannot remove the checkpoint link") from exc
            return
        self._wait(os.path.realpath(p))
        if not os.path.lexists(p):
            return
        parent, name = os.path.split(os.path.abspath(p))
        doomed = os.path.join(parent, f".{name}{LIGHTNING_REMOVED_MARK}{uuid.uuid4().hex[:12]}")
        try:
            os.rename(p, doomed)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _storage_error(exc, p, "cannot remove the checkpoint") from exc
        self._clean(p, _delete, doomed)

    def teardown(self) -> None:
        """Wait until every save has committed or failed and every deletion is done; raise a failure.

        Raises:
            ZerostallError: a save or a deletion failed in the background (its own class).
        """
        with self._lock:
            containers = list(self._saves)
        for container in containers:
            self._wait(container, raise_failure=False)
        with self._lock:
            cleaner, self._cleaner = self._cleaner, None
        if cleaner is not None:
            cleaner.shutdown(wait=True)
        self._raise_failure()

    # -- internals -------------------------------------------------------------------------------

    def _container(self, p: str) -> tuple[str, bool, str | None]:
        """Make ``p`` a container directory; return its real path, whether it is new, and where an
        old file at ``p`` was moved (deleted once the new save commits)."""
        replaced = None
        try:
            if os.path.islink(p):  # save_last="link" made it; the link's target is not ours to touch
                os.unlink(p)
            elif os.path.isfile(p):  # e.g. torch.save's last.ckpt from an earlier run: kept until replaced
                parent, name = os.path.split(os.path.abspath(p))
                replaced = os.path.join(parent, f".{name}{LIGHTNING_REMOVED_MARK}{uuid.uuid4().hex[:12]}")
                os.rename(p, replaced)
            elif os.path.isdir(p):
                if not _is_container(p):
                    raise CheckpointExistsError(
                        "this directory was not made by ZerostallCheckpointIO; refusing to overwrite it", path=p)
                return os.path.realpath(p), False, None
            os.makedirs(p)
        except OSError as exc:
            if isinstance(exc, ZerostallError):
                raise
            raise _storage_error(exc, p, "cannot create the checkpoint directory") from exc
        return os.path.realpath(p), True, replaced

    def _undo_container(self, p: str, container: str, created: bool, replaced: str | None) -> None:
        """A save that failed before staging leaves ``p`` as it found it."""
        if not created:
            return
        try:
            os.rmdir(container)
            if replaced is not None:
                os.rename(replaced, p)
        except OSError:
            log.warning("zerostall: could not restore %s after a failed save", p)

    def _settle(self, save: _Save) -> None:
        """Record the outcome of a finished save, once (from its done callback or from a waiter)."""
        with self._lock:
            pending = self._saves.get(save.container)
            if pending is None or save not in pending:
                return
            pending.remove(save)
            if not pending:
                del self._saves[save.container]
            error = save.response.exception()
            if error is not None:
                self._failures.append(error if isinstance(error, ZerostallError) else
                                      ZerostallError(f"{type(error).__name__}: {error}", path=save.container))
                return
        self._clean(save.container, self._prune, save)

    def _prune(self, save: _Save) -> None:
        """After ``save`` committed: delete the older checkpoints in its container."""
        try:
            names = os.listdir(save.container)
        except FileNotFoundError:  # removed meanwhile
            return
        for name in names:
            m = STEP_RE.match(name)
            if m and int(m.group(1)) < save.number:
                _delete(os.path.join(save.container, name))
        if save.replaced is not None:
            _delete(save.replaced)
        if save.created:  # the container's own entry, so that a power loss cannot lose it
            fsync_dir(os.path.dirname(save.container))

    def _clean(self, path: str, fn: Callable[[Any], None], arg: Any) -> None:
        """Run ``fn(arg)`` on the background cleaner; a failure is raised by the next call."""
        def record(f: Future[None]) -> None:
            with self._lock:
                self._cleanups.discard(f)
                exc = f.exception()
                if exc is None:
                    return
                error = _storage_error(exc, path, "deleting an old checkpoint failed") \
                    if isinstance(exc, OSError) else ZerostallError(f"deleting an old checkpoint failed: {exc}", path=path)
                self._failures.append(error)
            log.warning("zerostall: %s", error)

        with self._lock:
            if self._cleaner is None:
                self._cleaner = ThreadPoolExecutor(1, thread_name_prefix="zerostall-lightning")
            try:
                future = self._cleaner.submit(fn, arg)
            except RuntimeError:  # interpreter exit: the older checkpoints stay (the newest still wins)
                return
            self._cleanups.add(future)
        future.add_done_callback(record)

    def _wait(self, container: str, raise_failure: bool = True) -> None:
        """Wait for the saves to ``container`` still in flight, then raise any recorded failure."""
        while True:
            with self._lock:
                pending = list(self._saves.get(container, ()))
            if not pending:
                break
            for save in pending:
                save.response.exception()  # blocks until committed or failed
                self._settle(save)
        if raise_failure:
            self._raise_failure()

    def _raise_failure(self) -> None:
        with self._lock:
            if not self._failures:
                return
            first = self._failures[0]
            self._failures.clear()  # the others were logged by zerostall as they happened
        raise first


Options = TypeVar("Options", SaveOptions, LoadOptions)


def _per_process(options: Options) -> Options:
    """Lightning decides which ranks save and load: zerostall must not act collectively."""
    dist = options.distributed
    if dist is None:
        return dataclasses.replace(options, distributed=DistributedOptions(enabled=False))
    if dist.enabled:
        raise InvalidArgumentError("ZerostallCheckpointIO saves and loads per process (Lightning calls save_checkpoint on "
                         "global rank 0 only); leave distributed unset or use DistributedOptions(enabled=False)")
    return options
