"""Leases: how a writer says "this partial save is mine and I am alive", to any host.

A writer takes a lease before it creates anything of a save (a temporary directory, a data
prefix, a multipart upload, a collective decision file) and renews it while the save runs. The
lease is a small JSON object beside the checkpoints, ``<root>/.zs-lease-<host>-<pid>-<id>.json``::

    {"v": 1, "host": "node7~4026531836", "pid": 4242, "expires": 1763891234.5,
     "renewed": 1763891204.5, "targets": [".step_00000100.zs-tmp-...", ...]}

``targets`` names what the lease protects (storage keys or prefixes under the root). A partial
save may be removed (by a later :class:`~zerostall.Checkpointer` or ``zerostall gc``) only when
no *live* lease covers it. A lease is live until its ``expires`` time has passed on the clock of
whoever judges it, except that on the writer's own host a lease whose process is gone is dead at
once. A writer whose renewal came too late (past its own expiry: a stalled or suspended process)
fails its save instead of committing, since its partial files may already be gone.

The host id is the hostname qualified by the PID namespace (containers sharing a hostname do not
judge each other's processes); ``ZEROSTALL_HOST_ID`` overrides it (tests simulate other hosts
with it; clusters whose hostnames collide can set it). ``ZEROSTALL_LEASE_S`` sets the lease's
duration in seconds (default 60; renewed every quarter of it).

Runs in the writer process (holding) and wherever garbage is collected (reading); no torch here.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from zerostall import envvars
from zerostall.errors import WriterError
from zerostall.format.layout import LEASE_MARK, LEASE_RE
from zerostall.storage import Storage

__all__ = [
    "LEASE_MARK", "HOST_ENV", "LEASE_ENV", "DEFAULT_LEASE_S", "host_id", "pid_alive", "lease_seconds",
    "LeaseInfo", "Lease", "read_leases", "covers",
]

HOST_ENV = envvars.HOST_ID.name
LEASE_ENV = envvars.LEASE_S.name
DEFAULT_LEASE_S = 60.0


def host_id() -> str:
    """This host, as leases and partial-directory names record it.

    ``ZEROSTALL_HOST_ID`` if set; else the hostname qualified by the PID namespace: containers
    that share a hostname (host networking) but not their process table must not judge each
    other's writers dead.

    Example::

        >>> os.environ["ZEROSTALL_HOST_ID"] = "node-a"; host_id()
        'node-a'
        >>> del os.environ["ZEROSTALL_HOST_ID"]
    """
    forced = os.environ.get(HOST_ENV)
    if forced:
        return forced
    host = socket.gethostname()
    try:
        return f"{host}~{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return host


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def lease_seconds() -> float:
    """The lease duration this process uses (``ZEROSTALL_LEASE_S``, default 60 s)."""
    raw = os.environ.get(LEASE_ENV)
    if not raw:
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        # Read in the writer, mid-save: a typo must not fail saves, but it must be seen.
        logging.getLogger("zerostall").warning("zerostall: %s=%r is not a positive number of seconds; "
                                               "using %g", LEASE_ENV, raw, DEFAULT_LEASE_S)
        return DEFAULT_LEASE_S
    return value


def covers(target: str, key: str) -> bool:
    """Whether a lease target protects ``key``: the same key, one inside the other, or a
    sibling derived from the target's name (``<decision>.failed``, a conditional put's temporary)."""
    return (key == target or key.startswith((target + "/", target + "."))
            or target.startswith(key + "/"))


@dataclass(frozen=True)
class LeaseInfo:
    """A lease as found in the storage."""

    key: str
    host: str
    pid: int
    expires: float | None  # None: unreadable (being rewritten, or torn by a crash)
    targets: tuple[str, ...]

    def live(self, now: float, here: str) -> bool:
        """Whether its writer may still be running, judged at ``now`` on host ``here``."""
        if self.host == here and not pid_alive(self.pid):
            return False  # the one case a lease is provably dead before it expires
        if self.expires is None:
            return True  # unreadable and not provably dead: never touch what may be live
        return now <= self.expires


def read_leases(storage: Storage) -> list[LeaseInfo]:
    """Every lease under the storage root (a missing or vanishing one is skipped)."""
    out = []
    for name in storage.list(""):
        m = LEASE_RE.match(name)
        if m is None:
            continue
        try:
            raw = storage.get(name)
        except FileNotFoundError:
            continue  # released between the listing and the read
        try:
            doc = json.loads(raw)
            expires: float | None = float(doc["expires"])
            targets = tuple(str(t) for t in doc["targets"])
        except (ValueError, KeyError, TypeError):
            expires, targets = None, ()
        out.append(LeaseInfo(name, m.group("host"), int(m.group("pid")), expires, targets))
    return out


class Lease:
    """A writer's lease on the partial files of one save, renewed on a thread until released.

    Example::

        lease = Lease(storage, [attempt.staging]).acquire()
        try:
            ...             # write the partial files
            lease.check()   # just before the commit: raises if the lease lapsed
            ...             # commit
        finally:
            lease.release()
    """

    def __init__(self, storage: Storage, targets: list[str], *, duration_s: float | None = None) -> None:
        self.storage = storage
        self.targets = list(targets)
        self.duration = lease_seconds() if duration_s is None else duration_s
        self.host = host_id()
        self.key = f"{LEASE_MARK}{self.host}-{os.getpid()}-{uuid.uuid4().hex[:12]}.json"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._expires = 0.0
        self._lapsed: str | None = None

    def _write(self) -> None:
        now = time.time()
        if self._expires and now > self._expires and self._lapsed is None:
            self._lapsed = f"renewed {now - self._expires:.1f} s after it expired"
        expires = now + self.duration
        doc = {"v": 1, "host": self.host, "pid": os.getpid(), "renewed": now, "expires": expires,
               "targets": self.targets}
        self.storage.put(self.key, json.dumps(doc).encode())
        self._expires = expires

    def acquire(self) -> Lease:
        """Write the lease (before anything it protects exists) and start renewing it.

        Raises:
            OSError: the storage refused the lease; the save must not start.
        """
        try:
            try:
                self._write()
            except FileNotFoundError:
                # A collector on another host may take the temporary of a first lease write that
                # has no lease yet (see zerostall.persist.gc): write it once more.
                self._write()
        except OSError as exc:
            # The failing name was the lease's temporary file (".zs-lease-...json.tmp-..."), which
            # told a user nothing: name the directory and what the file is for.
            where = self.storage.url
            raise OSError(exc.errno, f"cannot write this save's lease file in {where} (it marks the partial "
                                     f"files as a live writer's): {exc.strerror or exc}") from exc
        self._thread = threading.Thread(target=self._renew, name="zerostall-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.duration / 4):
            try:
                self._write()
            except Exception:  # noqa: BLE001 - retried next period; check() reports a lapse
                continue

    def check(self, path: str | None = None) -> None:
        """Raise if the lease lapsed at any time: a collector may have removed the partial files.

        Raises:
            WriterError: the lease expired before it was renewed (the writer stalled).
        """
        lapsed = self._lapsed or (f"not renewed for {time.time() - self._expires + self.duration:.1f} s"
                                  if time.time() > self._expires else None)
        if lapsed is not None:
            raise WriterError(f"this save's lease on its partial files lapsed ({lapsed}; lease "
                              f"{self.duration:g} s): another process may have removed them as abandoned, "
                              "so the save is not committed", path=path)

    def release(self, *, delete: bool = True) -> None:
        """Stop renewing; delete the lease unless ``delete`` is False (it then expires)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if delete:
            try:
                self.storage.delete(self.key)
            except OSError:
                pass  # it expires on its own; a collector then removes it
