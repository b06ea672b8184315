"""Failures of the keeper's persist after a crash, kept where the next trainer will find them.

The keeper reports a failed persist of a memory-only step to the trainer that adopts it
(:class:`~zerostall.messages.KeeperFailed`). When no trainer adopts it before its linger expires
(or none is left to tell at a clean close), the failure is written to a *marker*:

* ``<directory>/.zs-keeper-failed-r<rank>.json`` on the checkpoint's own storage, so that
  ``zerostall list`` and the next ``Checkpointer`` of that directory and rank see it wherever
  they run;
* if storage refuses even that small file (the very failure may be a full or read-only
  directory), ``$XDG_STATE_HOME/zerostall/keeper-failed/<digest>.json`` on this host
  (``~/.local/state`` when unset), ``<digest>`` naming the user, directory and rank as the
  keeper's socket name does.

A marker holds a JSON object ``{"root", "rank", "failures": [{"step", "path", "error", "time"}]}``
(``error`` as :class:`~zerostall.messages.WireError` writes it). A reader that reports it removes
it (:func:`take_markers`): each failure is reported once, like a background save error.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from zerostall.errors import KeeperPersistError, ZerostallError
from zerostall.format.layout import KEEPER_FAILED_PREFIX as MARKER_PREFIX
from zerostall.messages import WireError, from_wire
from zerostall.storage import Storage, local_path

__all__ = ["KeeperFailure", "marker_key", "local_marker", "write_marker", "read_markers", "take_markers",
           "as_error", "MARKER_PREFIX", "UnadoptableKeeper"]


@dataclass(frozen=True)
class KeeperFailure:
    """One failed persist: the step, its path, the error, when (``time.time()``), which rank's keeper."""

    step: int | None
    path: str
    error: WireError
    rank: int
    time: float
    #: it was the persist at the trainer's clean close (``close()`` raises it)
    closing: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "error": self.error.to_json(), "rank": self.rank,
                "time": self.time}

    @staticmethod
    def from_json(d: Any, rank: int) -> KeeperFailure | None:
        if not isinstance(d, dict):
            return None
        step, path, at = d.get("step"), d.get("path"), d.get("time")
        return KeeperFailure(step=step if type(step) is int else None, path=path if isinstance(path, str) else "",
                             error=WireError.from_json(d.get("error")), rank=rank,
                             time=float(at) if isinstance(at, (int, float)) else 0.0)


def _errno_tag(cause: BaseException) -> str:
    """``"[ENOSPC] "`` for a cause with an errno, else nothing: how a keeper failure names its errno."""
    code = getattr(cause, "errno", None)
    return f"[{errno.errorcode.get(code, code)}] " if isinstance(code, int) else ""


def as_error(f: KeeperFailure) -> KeeperPersistError:
    """The user-facing error of a failure: names the step, the path and the cause."""
    cause = from_wire(f.error)
    step = f"step {f.step}" if f.step is not None else "a step"
    return KeeperPersistError(f"the memory tier's keeper (rank {f.rank}) could not persist {step}, which only its "
                              f"memory held, to storage: {type(cause).__name__}: {_errno_tag(cause)}{cause.message}",
                              path=f.path, rank=f.rank, step=f.step, cause=cause)


@dataclass(frozen=True)
class UnadoptableKeeper:
    """A memory tier's keeper that serves its trainer but cannot be adopted after a crash.

    A record, not an error: nothing failed that the trainer could catch. The keeper could not
    bind its name (``cause``: a ``StorageError`` with the bind's errno), or another user's process
    holds that name (a squatter; ``cause`` says which pid and uid, errno ``EADDRINUSE``). The
    trainer's saves to memory and storage work as usual; what is lost is the restart from memory:
    after a crash this keeper persists the newest memory-only step and exits, and the restart
    resumes from storage. Warned of (:class:`~zerostall.errors.ZerostallWarning`, with ``str()`` of
    this record) on the training thread at the ``Checkpointer`` construction (or the first save
    after the keeper started) and listed in :attr:`zerostall.Checkpointer.keeper_failures`
    (docs/guarantees.md, "A keeper that cannot be adopted").
    """

    #: the checkpoint directory
    path: str
    rank: int
    #: the keeper process
    keeper_pid: int
    #: why it cannot be adopted, as the keeper's Hello reported it
    cause: ZerostallError

    @staticmethod
    def from_hello(root: str, rank: int, keeper_pid: int, cause: WireError) -> UnadoptableKeeper:
        """The record of a keeper whose Hello said it cannot be adopted (its ``unadoptable``)."""
        return UnadoptableKeeper(path=root, rank=rank, keeper_pid=keeper_pid, cause=from_wire(cause))

    @property
    def step(self) -> None:
        """Always None: no step failed to persist (every entry of ``keeper_failures`` has a ``step``)."""
        return None

    @property
    def errno(self) -> int | None:
        """The cause's errno (the bind's, or ``EADDRINUSE`` for a squatter), if it has one."""
        value = getattr(self.cause, "errno", None)
        return value if isinstance(value, int) else None

    def __str__(self) -> str:
        return (f"the memory tier's keeper (pid {self.keeper_pid}, rank {self.rank}) serves this trainer but cannot be "
                f"adopted after a crash: {_errno_tag(self.cause)}{self.cause.message}. Saves work as usual; after a crash the keeper "
                "persists the newest memory-only step and exits, so the restart resumes from storage, not from memory "
                f"(checkpoint {self.path!r}, rank {self.rank})")


def marker_key(rank: int) -> str:
    return f"{MARKER_PREFIX}{rank}.json"


def _root_key(root: str) -> str:
    local = local_path(root)
    return os.path.realpath(local) if local is not None else root


def local_marker(root: str, rank: int) -> str:
    """This host's fallback marker path of ``(user, root, rank)``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    digest = hashlib.sha256(f"{os.getuid()}\0{_root_key(root)}\0{rank}".encode()).hexdigest()[:32]
    return os.path.join(base, "zerostall", "keeper-failed", f"{digest}.json")


def _parse(raw: bytes, rank: int) -> list[KeeperFailure]:
    try:
        doc = json.loads(raw)
    except ValueError:
        return []
    rows = doc.get("failures") if isinstance(doc, dict) else None
    out = [KeeperFailure.from_json(r, rank) for r in rows] if isinstance(rows, list) else []
    return [f for f in out if f is not None]


def _encode(root: str, rank: int, failures: list[KeeperFailure]) -> bytes:
    return json.dumps({"root": root, "rank": rank, "failures": [f.to_json() for f in failures]},
                      indent=1).encode()


def write_marker(storage: Storage | None, root: str, rank: int, failures: list[KeeperFailure]) -> str:
    """Add ``failures`` to the marker of ``(root, rank)``: on storage, else on this host.

    Returns where they went. Raises ``OSError`` when neither place takes them.
    """
    if storage is not None:
        try:
            try:
                old = _parse(storage.get(marker_key(rank)), rank)
            except FileNotFoundError:
                old = []
            storage.put(marker_key(rank), _encode(root, rank, old + failures))
            return f"{root.rstrip('/')}/{marker_key(rank)}"
        except Exception:  # noqa: BLE001,S110 - the fallback below
            pass
    path = local_marker(root, rank)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        with open(path, "rb") as f:
            old = _parse(f.read(), rank)
    except FileNotFoundError:
        old = []
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(_encode(root, rank, old + failures))
    os.replace(tmp, path)
    return path


def _marker_ranks(storage: Storage) -> list[int]:
    try:
        names = storage.list("")
    except OSError:
        return []
    ranks = []
    for n in names:
        n = n.rstrip("/")
        if n.startswith(MARKER_PREFIX) and n.endswith(".json") and n[len(MARKER_PREFIX):-5].isdigit():
            ranks.append(int(n[len(MARKER_PREFIX):-5]))
    return sorted(ranks)


def _local_ranks(root: str) -> list[int]:
    """The ranks with a fallback marker of ``root`` on this host (the marker names its root)."""
    folder = os.path.dirname(local_marker(root, 0))
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    ranks = []
    for n in names:
        if not n.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, n), "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            continue
        r = doc.get("rank") if isinstance(doc, dict) else None
        if type(r) is int and isinstance(doc.get("root"), str) and _root_key(doc["root"]) == _root_key(root):
            ranks.append(r)
    return ranks


def read_markers(storage: Storage | None, root: str, rank: int | None = None, *,
                 remove: bool = False) -> list[KeeperFailure]:
    """The failures recorded for ``root`` (one ``rank``'s, or every rank's: on storage, and this
    host's fallbacks), oldest first; ``remove``: delete the markers read."""
    if rank is not None:
        ranks = [rank]
    else:
        ranks = sorted(set(_marker_ranks(storage) if storage is not None else []) | set(_local_ranks(root)))
    out: list[KeeperFailure] = []
    for r in ranks:
        if storage is not None:
            try:
                out += _parse(storage.get(marker_key(r)), r)
                if remove:
                    storage.delete(marker_key(r))
            except OSError:
                pass
        path = local_marker(root, r)
        try:
            with open(path, "rb") as f:
                out += _parse(f.read(), r)
            if remove:
                os.unlink(path)
        except OSError:
            pass
    return sorted(out, key=lambda f: f.time)


def take_markers(storage: Storage | None, root: str, rank: int) -> list[KeeperFailure]:
    """Read and remove the markers of ``(root, rank)``: a failure is reported once."""
    return read_markers(storage, root, rank, remove=True)


def now() -> float:
    return time.time()
