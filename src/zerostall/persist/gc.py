"""Garbage collection: remove every partial or abandoned save that no live writer holds.

What a save can leave behind when its writer dies, on any host:

* POSIX: a hidden attempt directory ``.<name>.zs-tmp-<id>/`` (solo or collective), a deletion
  directory ``.<name>.zs-del-<id>/`` (retention cut short), collective decision files
  ``.<name>.zs-decision-<attempt>[.failed]``, and temporary files of conditional puts beside them;
* any storage with temporaries (POSIX): a lease's own temporary ``.zs-lease-….json.tmp-<pid>-<hex>``,
  left by a writer killed while writing or renewing its lease;
* object stores: a data prefix ``<name>/data-<id>/`` that no committed manifest refers to,
  a collective coordination prefix ``<name>/zs-coord-<attempt>/``, decision files, and
  incomplete multipart uploads (their parts cost storage and are invisible to listings).

Each of them is removed once no live lease (:mod:`zerostall.lease`) covers it. Writers take
their lease before creating anything, so the candidates are listed *first* and the leases
second: a partial seen in the first listing whose writer is alive has a lease that the second
listing sees. A data prefix is checked against the manifest once more right before it is
deleted, because its writer may have committed (manifest put, then lease released) between
the two listings. Deletion directories are always removable (already invisible, already
doomed). A lease's temporary goes with its lease: kept while the lease is live, removed once it
is dead or gone (if gone, its writer was killed writing its first lease, unless it is a live
process of this host; :meth:`~zerostall.lease.Lease.acquire` retries should a collector on
another host take the temporary of a first write still in flight). A partial that no lease covers at all is left alone only when its name says it belongs
to a live process of this host (writers of versions before leases).

Runs wherever a :class:`~zerostall.Checkpointer` opens (at start-up, before its writer runs)
and in ``zerostall gc``; never during a save.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from zerostall.format.layout import (
    COORD_PREFIX,
    DATA_PREFIX,
    DEC_MARK,
    DEL_MARK,
    LEASE_TMP_RE,
    MANIFEST_NAME,
    SOLO_ATTEMPT_RE,
    TMP_MARK,
)
from zerostall.lease import LeaseInfo, covers, host_id, pid_alive, read_leases
from zerostall.storage import Storage
from zerostall.storage.base import as_multipart

__all__ = ["GcReport", "collect_garbage", "collect_at_start"]

_log = logging.getLogger("zerostall")


@dataclass
class GcReport:
    """What :func:`collect_garbage` found and did (``dry_run``: would do)."""

    url: str
    dry_run: bool = False
    #: partial saves, deletion leftovers and coordination files removed
    removed: list[str] = field(default_factory=list)
    #: incomplete multipart uploads aborted, as ``key#upload-id``
    uploads_aborted: list[str] = field(default_factory=list)
    #: partials left in place because a live writer (any host) holds them
    kept_live: list[str] = field(default_factory=list)
    #: leases of dead writers removed once nothing they protected was left
    leases_removed: list[str] = field(default_factory=list)
    #: leases still live (their writer may be running)
    live_leases: list[str] = field(default_factory=list)
    #: what could not be removed this time (retried by the next collection)
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Candidate:
    key: str
    always: bool = False  # removable whatever the leases say (deletion leftovers)
    step: str | None = None  # an object-store data prefix of this step: re-check its manifest
    lease: str | None = None  # a lease's put temporary: judged by that lease, not by its targets


def collect_garbage(storage: Storage, *, dry_run: bool = False, now: float | None = None) -> GcReport:
    """Remove the abandoned partial saves under ``storage``'s root; never a live writer's, never a checkpoint.

    ``now`` (wall-clock seconds) judges lease expiry; default the current time. With
    ``dry_run`` nothing is deleted and the report says what would be.

    Raises:
        OSError: the root could not be listed. Failures to delete single items are reported in
            ``errors`` and retried by the next collection.

    Example::

        >>> from zerostall.storage import open_storage
        >>> report = collect_garbage(open_storage("/tmp/run1"))   # doctest: +SKIP
        >>> report.removed                                         # doctest: +SKIP
        ['.step_00000300.zs-tmp-node7~4026531836-4242-0a1b2c3d4e5f']
    """
    report = GcReport(url=storage.url, dry_run=dry_run)
    here = host_id()
    candidates = _candidates(storage)
    uploads = _uploads(storage, report)
    leases = read_leases(storage)  # after the candidates: see the module docstring
    t = time.time() if now is None else now
    live = [ls for ls in leases if ls.live(t, here)]
    report.live_leases = [ls.key for ls in live]
    dead = [ls for ls in leases if not ls.live(t, here)]

    blind = [ls.key for ls in live if ls.expires is None]
    for k in blind:
        report.errors.append(f"{k}: unreadable lease of a writer not provably dead; nothing but deletion "
                             "leftovers is removed while it is there (delete it by hand once its writer is gone)")

    def held(key: str) -> bool:
        return bool(blind) or any(covers(tg, key) for ls in live for tg in ls.targets)

    def known(key: str) -> bool:
        return any(covers(tg, key) for ls in leases for tg in ls.targets)

    by_key = {ls.key: ls for ls in leases}
    for c in candidates:
        if c.lease is not None:
            if _lease_tmp_live(c, by_key.get(c.lease), t, here):
                report.kept_live.append(c.key)
            else:
                _remove(report, c.key, partial(storage.delete, c.key), report.removed, dry_run)
            continue
        if not c.always and (held(c.key) or (not known(c.key) and _legacy_live(c.key, here))):
            report.kept_live.append(c.key)
            continue
        if c.step is not None and _referenced(storage, c.step, c.key):
            continue  # committed between the listings: part of a checkpoint now
        _remove(report, c.key, partial(storage.delete, c.key), report.removed, dry_run)
    multipart = as_multipart(storage)
    for key, upload_id in uploads:
        if held(key):
            report.kept_live.append(f"{key}#{upload_id}")
            continue
        if multipart is not None:
            _remove(report, f"{key}#{upload_id}", partial(multipart.abort_upload, key, upload_id),
                    report.uploads_aborted, dry_run)
    failed = [e.split(": ", 1)[0].split("#", 1)[0] for e in report.errors]
    for ls in dead:
        if any(covers(tg, k) for tg in ls.targets for k in failed):
            continue  # something it protected could not be removed: keep the record, retry later
        _remove(report, ls.key, partial(storage.delete, ls.key), report.leases_removed, dry_run)
    return report


def _remove(report: GcReport, what: str, fn: Callable[[], object], into: list[str], dry_run: bool) -> None:
    if not dry_run:
        try:
            fn()
        except OSError as exc:  # another collector may be deleting it too; retried next time
            report.errors.append(f"{what}: {type(exc).__name__}: {exc}")
            return
    into.append(what)


def _candidates(storage: Storage) -> list[_Candidate]:
    out = []
    for n in storage.list(""):
        if DEL_MARK in n:
            out.append(_Candidate(n, always=True))
        elif (m := LEASE_TMP_RE.match(n)) is not None:
            out.append(_Candidate(n, lease=m.group("lease")))
        elif TMP_MARK in n or DEC_MARK in n:
            out.append(_Candidate(n))
        elif not storage.atomic_rename and not n.startswith("."):
            out.extend(_object_store_partials(storage, n))
    return out


def _object_store_partials(storage: Storage, name: str) -> list[_Candidate]:
    """Data prefixes of ``name`` that its manifest does not refer to, and coordination prefixes."""
    children = storage.list(name)
    parts = [c for c in children if c.startswith((DATA_PREFIX, COORD_PREFIX))]
    if not parts or (MANIFEST_NAME in children and len(parts) == 1 and parts[0].startswith(DATA_PREFIX)):
        return []  # nothing, or a committed step's one data prefix (a commit refers to its own): no read
    refs = _manifest_dirs(storage, name)
    if refs is None:
        return []  # a manifest we cannot read: do not guess which data it refers to
    return [_Candidate(f"{name}/{c}", step=name if c.startswith(DATA_PREFIX) else None)
            for c in parts if c not in refs]


def _manifest_dirs(storage: Storage, name: str) -> set[str] | None:
    """The data directories ``name``'s manifest refers to (empty: no manifest); None if unreadable."""
    try:
        doc = json.loads(storage.get(f"{name}/{MANIFEST_NAME}"))
        return {str(f["path"]).split("/", 1)[0] for f in doc["files"]}
    except FileNotFoundError:
        return set()
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        return None


def _referenced(storage: Storage, step: str, key: str) -> bool:
    refs = _manifest_dirs(storage, step)
    return refs is None or key.split("/", 1)[1] in refs


def _uploads(storage: Storage, report: GcReport) -> list[tuple[str, str]]:
    multipart = as_multipart(storage)
    if multipart is None:
        return []
    try:
        return [(str(k), str(u)) for k, u in multipart.list_uploads("")]
    except OSError as exc:  # a server without ListMultipartUploads: lifecycle rules must expire them
        report.errors.append(f"listing multipart uploads: {type(exc).__name__}: {exc}")
        return []


def _lease_tmp_live(c: _Candidate, lease: LeaseInfo | None, now: float, here: str) -> bool:
    """Whether a lease's temporary may still be written: its lease is live, or, with no lease
    left, its writer is a live process of this host."""
    if lease is not None:
        return lease.live(now, here)
    m = LEASE_TMP_RE.match(c.key)
    return m is not None and m.group("host") == here and pid_alive(int(m.group("pid")))


def _legacy_live(key: str, here: str) -> bool:
    """Whether a partial that no lease covers may still be written by a writer from before leases.

    Writers that take leases never leave an unleased partial (the lease goes first and is
    released only once the partial is gone or committed), so this costs nothing for them. A
    solo attempt's name carries its writer's host and pid: kept if that pid lives on this host,
    or if it is another host's (nothing proves it dead).
    """
    m = SOLO_ATTEMPT_RE.match(key)
    if m is None:
        return False
    return m.group("host") != here or pid_alive(int(m.group("pid")))


def collect_at_start(storage: Storage) -> GcReport | None:
    """:func:`collect_garbage` for a Checkpointer opening: a failure is logged (WARNING), never raised.

    Leftovers never make a checkpoint wrong (they are invisible); failing to remove them must not
    stop training. The next Checkpointer or ``zerostall gc`` retries.
    """
    try:
        report = collect_garbage(storage)
    except OSError as exc:
        _log.warning("zerostall: could not collect abandoned partial saves under %s: %s", storage.url, exc)
        return None
    if report.errors:
        _log.warning("zerostall: %d abandoned item(s) under %s could not be removed yet: %s", len(report.errors),
                     storage.url, "; ".join(report.errors[:3]))
    return report
