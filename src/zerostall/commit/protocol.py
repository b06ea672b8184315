"""One place decides the commit: how a checkpoint's files become visible, all at once or not at all.

Two protocols, picked by what the storage can do:

* :class:`RenameCommit` (POSIX, memory): write everything into ``.<name>.zs-tmp-<id>/`` next to
  the target, fsync files and directory, write the manifest last, rename the directory onto
  ``<name>`` (which fails if it exists), fsync the parent.
* :class:`ManifestLastCommit` (object stores, no rename): data objects go under
  ``<name>/data-<attempt>/``; the manifest ``<name>/manifest.json`` is put last with a
  conditional put, so two writers cannot both commit a step.

Under both, a checkpoint exists iff ``<name>/manifest.json`` exists, and retention deletes a
step only after a newer one is committed, making it invisible (manifest gone) before its data.
Runs in the writer, never on the training thread.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from zerostall.errors import CheckpointExistsError, StorageError
from zerostall.format.layout import (
    ATTEMPT_RE,
    DATA_DIR,
    DATA_PREFIX,
    DEL_MARK,
    MANIFEST_NAME,
    TMP_MARK,
    parse_step,
    step_name,
)
from zerostall.lease import host_id, pid_alive
from zerostall.storage import Storage
from zerostall.storage.base import as_probe

__all__ = [
    "Attempt", "CommitProtocol", "RenameCommit", "ManifestLastCommit", "protocol_for",
    "exists_error", "is_committed", "remove_stale_attempts", "step_name", "parse_step", "committed_steps", "steps_to_delete", "delete_checkpoint",
    "check_reachable",
    "steps_to_delete_everywhere",
]
__all__ += ["check_reachable"]



def _host_id() -> str:
    """This host, qualified by the PID namespace (``ZEROSTALL_HOST_ID`` overrides it): see
    :func:`zerostall.lease.host_id`."""
    return host_id()


def _attempt_tag() -> str:
    """``<host>-<pid>-<id>``: who made a partial directory (:data:`~zerostall.format.layout.ATTEMPT_RE`
    reads it back), so leftovers of dead writers on this host can be told apart from the attempts
    of live ones."""
    return f"{_host_id()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def remove_stale_attempts(storage: Storage) -> list[str]:
    """Delete partial save and deletion directories whose writer (on this host) is dead.

    Returns the names removed. Directories of live writers and of other hosts are left alone.
    """
    host = _host_id()
    removed = []
    try:
        names = storage.list("")
    except FileNotFoundError:
        return []
    for n in names:
        m = ATTEMPT_RE.match(n)
        if m is None or m.group("host") != host or _pid_alive(int(m.group("pid"))):
            continue
        try:
            storage.delete(n)
        except OSError:
            # Best effort: another process opening a Checkpointer may be deleting it too
            # (rmtree then finds files gone); a failure here must not stop training.
            continue
        removed.append(n)
    return removed


def _pid_alive(pid: int) -> bool:
    return pid_alive(pid)


def is_committed(storage: Storage, name: str) -> bool:
    return storage.exists(f"{name}/{MANIFEST_NAME}")


def committed_steps(storage: Storage, *, unreadable: list[int] | None = None) -> list[int]:
    """Steps under the storage root whose manifest exists, ascending.

    A step folder whose manifest cannot be checked (permission denied) raises ``StorageError``
    naming it, rather than being skipped (which made an older step look like the newest); pass
    ``unreadable=[]`` to collect such steps there instead (``zerostall list`` / ``verify DIR``
    report them one by one).
    """
    try:
        names = storage.list("")
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        s = parse_step(n)
        if s is None:
            continue
        try:
            committed = is_committed(storage, n)
        except StorageError:
            if unreadable is None:
                raise
            unreadable.append(s)
            continue
        except OSError as exc:
            if unreadable is None:
                raise StorageError(f"cannot tell whether {n} is committed (its {MANIFEST_NAME}: "
                                   f"{exc.strerror or exc}); fix the permissions or remove it",
                                   errno=exc.errno, path=f"{storage.url.rstrip('/')}/{n}") from exc
            unreadable.append(s)
            continue
        if committed:
            out.append(s)
    return sorted(out)


@dataclass(frozen=True)
class Attempt:
    name: str  # the checkpoint's final name under the storage root
    staging: str  # where this attempt's files are written
    data_dir: str  # the data directory, relative to the checkpoint (recorded in the manifest)


class CommitProtocol:
    """How one save's files become a checkpoint: all at once, or not at all."""

    def begin(self, name: str) -> Attempt:
        """Start an attempt at ``name``: where its files go.

        Raises:
            CheckpointExistsError: ``name`` already holds a committed checkpoint (or, with a
                rename, anything at all).
        """
        raise NotImplementedError

    def commit(self, attempt: Attempt, manifest: bytes) -> None:
        """Make the attempt durable and visible; the manifest goes last. Runs in the writer.

        Raises:
            CheckpointExistsError: another writer committed ``name`` first (nothing of ours is visible).
            OSError: the storage failed; the attempt is not committed.
        """
        raise NotImplementedError

    def abort(self, attempt: Attempt) -> None:
        """Remove what the attempt wrote; never data that a committed manifest refers to.

        Raises:
            OSError: the storage failed (the attempt stays invisible).
        """
        raise NotImplementedError


class RenameCommit(CommitProtocol):
    """POSIX and memory: a hidden temporary directory, fsynced, renamed onto the name."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def begin(self, name: str) -> Attempt:
        if self.storage.exists(name):
            raise exists_error(self.storage, name, _join(self.storage.url, name))
        return Attempt(name=name, staging=f".{name}{TMP_MARK}{_attempt_tag()}", data_dir=DATA_DIR)

    def commit(self, attempt: Attempt, manifest: bytes) -> None:
        s = self.storage
        s.sync(f"{attempt.staging}/{attempt.data_dir}")
        s.put(f"{attempt.staging}/{MANIFEST_NAME}", manifest)
        s.sync(attempt.staging)
        try:
            s.rename(attempt.staging, attempt.name)
        except FileExistsError as exc:
            raise CheckpointExistsError("another writer committed this checkpoint first",
                                        path=_join(s.url, attempt.name)) from exc
        s.sync("")

    def abort(self, attempt: Attempt) -> None:
        self.storage.delete(attempt.staging)


class ManifestLastCommit(CommitProtocol):
    """Object stores: data under a unique prefix, then the manifest with a conditional put."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def begin(self, name: str) -> Attempt:
        if is_committed(self.storage, name):
            raise CheckpointExistsError("a checkpoint already exists here; zerostall never overwrites one",
                                        path=_join(self.storage.url, name))
        data_dir = f"{DATA_PREFIX}{uuid.uuid4().hex[:12]}"
        return Attempt(name=name, staging=name, data_dir=data_dir)

    def commit(self, attempt: Attempt, manifest: bytes) -> None:
        key = f"{attempt.name}/{MANIFEST_NAME}"
        try:
            self.storage.put(key, manifest, if_absent=True)
        except FileExistsError as exc:
            if self._landed(key, manifest):  # our own put, retried after its reply was lost
                return
            raise CheckpointExistsError("another writer committed this checkpoint first",
                                        path=_join(self.storage.url, attempt.name)) from exc
        except OSError:
            # The outcome of a put that timed out is unknown: it may have landed. If it did, the
            # checkpoint is committed and abort() must not touch its data.
            if self._landed(key, manifest):
                return
            raise

    def _landed(self, key: str, manifest: bytes) -> bool:
        try:
            return self.storage.get(key) == manifest
        except (OSError, EOFError):
            return False

    def abort(self, attempt: Attempt) -> None:
        # Never delete data that a committed manifest points at: after a commit whose outcome
        # was unknown, the manifest may be there. The data directory's name is unique to this
        # attempt, so finding it in the manifest means this attempt is the committed one. If the
        # manifest cannot be read, leave the (invisible) data behind rather than guess.
        try:
            current = self.storage.get(f"{attempt.name}/{MANIFEST_NAME}")
        except FileNotFoundError:
            current = None
        except (OSError, EOFError):
            return
        if current is not None and f'"{attempt.data_dir}/'.encode() in current:
            return
        self.storage.delete(f"{attempt.name}/{attempt.data_dir}")


def exists_error(storage: Storage, name: str, path: str) -> CheckpointExistsError:
    """The error for saving onto an existing ``name``: a committed checkpoint, or something else."""
    if is_committed(storage, name):
        return CheckpointExistsError("a checkpoint already exists here; zerostall never overwrites one", path=path)
    return CheckpointExistsError("something that is not a committed checkpoint (no manifest) is in the way; "
                                 "zerostall will not write over it: remove it or save elsewhere", path=path)


def protocol_for(storage: Storage) -> CommitProtocol:
    return RenameCommit(storage) if storage.atomic_rename else ManifestLastCommit(storage)


def delete_checkpoint(storage: Storage, name: str) -> None:
    """Make ``name`` invisible first (rename away, or drop its manifest), then delete its data.

    Raises:
        OSError: the storage failed; ``name`` is then either still whole or already invisible.
    """
    if storage.atomic_rename:
        doomed = f".{name}{DEL_MARK}{_attempt_tag()}"
        try:
            storage.rename(name, doomed)
        except FileNotFoundError:
            return
        storage.sync("")
        storage.delete(doomed)
    else:
        storage.delete(f"{name}/{MANIFEST_NAME}")
        storage.delete(name)


def steps_to_delete(steps: list[int], *, newest: int, keep_last: int | None,
                    keep_every_n_steps: int | None) -> list[int]:
    """Which committed ``steps`` retention removes once ``newest`` is committed.

    Never the newest committed step, nor any step after ``newest`` (a concurrent, later save).
    ``keep_last=None`` keeps everything.
    """
    if keep_last is None:
        return []
    older = sorted(s for s in steps if s < newest)
    keep = set(older[-(keep_last - 1):]) if keep_last > 1 else set()
    out = []
    for s in older:
        if s in keep:
            continue
        if keep_every_n_steps and s % keep_every_n_steps == 0:
            continue
        out.append(s)
    return out


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def check_reachable(storage: Storage, *, write: bool, path: str) -> None:
    """Probe ``storage`` (see ``Storage.probe``); a failure becomes a :class:`StorageError` naming ``path``.

    A backend that declares no probe (``Capabilities.probe``) is probed by listing its root.
    """
    probe = as_probe(storage)
    try:
        if probe is not None:
            probe.probe(write=write)
        else:
            try:
                storage.list("")
            except FileNotFoundError:
                pass  # nothing there yet: not unreachable
    except OSError as exc:
        how = "cannot be created or written" if write else "cannot be reached"
        raise StorageError(f"the storage location {how}: {exc.strerror or exc}"
                           + (f" ({exc.filename})" if isinstance(exc.filename, str) and exc.filename != path else ""),
                           errno=exc.errno, path=path) from exc


def steps_to_delete_everywhere(views: list[list[int]], *, newest: int, keep_last: int | None,
                               keep_every_n_steps: int | None) -> list[int]:
    """Which steps retention removes once ``newest`` is committed on every rank, given each
    rank's view of the committed steps (``views``; they differ where ranks see different storage).

    ``keep_last`` counts the steps committed in *every* view (``newest`` included), so that many
    steps stay loadable by every rank. A step is removed only if it is older than all of those:
    every rank has committed ``keep_last`` newer steps. Steps that some views lack and that are
    newer than the oldest kept one stay until they are that old. With one view this is
    :func:`steps_to_delete`.

    Example::

        >>> steps_to_delete_everywhere([[1, 2, 3], [1, 3]], newest=4, keep_last=2, keep_every_n_steps=None)
        [1, 2]
        >>> steps_to_delete_everywhere([[1, 2, 3], [1, 2]], newest=4, keep_last=3, keep_every_n_steps=None)
        []
    """
    if keep_last is None or not views:
        return []
    common = set(views[0]).intersection(*views[1:]) | {newest}
    window = sorted(s for s in common if s <= newest)[-keep_last:]
    floor = window[0]
    union = set().union(*views)
    return sorted(s for s in union
                  if s < floor and not (keep_every_n_steps and s % keep_every_n_steps == 0))
