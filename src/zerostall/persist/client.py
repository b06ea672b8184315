"""The trainer's side of the writer: start it, hand it buffers and jobs, route its answers.

Answers arrive on a listener thread: ``released`` (the job's buffers may be staged into
again), then ``done`` or ``error``. If the writer dies, every job it had not finished fails
with :class:`~zerostall.errors.WriterError`, its buffers are released, and the next submit
starts a fresh writer.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, Callable

from zerostall.errors import WriterError, from_wire
from zerostall.options import WriterKind
from zerostall.stage.buffers import HostBuffer

__all__ = ["WriterClient"]

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CLIENTS: "weakref.WeakSet[WriterClient]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker, say) must not keep the trainer's end of the writer
    # socket open: the writer exits on EOF once the trainer dies, and a copy held by a child
    # would delay that. The writer belongs to the parent; the child starts its own if it saves.
    for client in list(_CLIENTS):
        client._detach_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class _Pending:
    on_released: Callable[[], None]
    on_done: Callable[[dict[str, Any] | None, BaseException | None], None]
    path: str | None = None
    root: str | None = None
    name: str | None = None
    nbytes: int = 0
    released: bool = False


def _committed_anyway(p: _Pending) -> bool:
    """Whether a save whose writer died is committed all the same (single-process saves only)."""
    if p.root is None or p.name is None:
        return False
    try:
        from zerostall.commit import is_committed
        from zerostall.storage import open_storage

        return is_committed(open_storage(p.root), p.name)
    except Exception:
        return False


class WriterClient:
    """One background writer (process or thread) and the jobs in flight on it."""

    def __init__(self, kind: WriterKind = WriterKind.PROCESS, *, nice: int = 10) -> None:
        self.kind = kind
        self.nice = nice
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._mapped: set[int] = set()
        self._conn: Connection | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._listener: threading.Thread | None = None
        self._closing = False
        _CLIENTS.add(self)

    def _detach_after_fork(self) -> None:
        if self._conn is not None:
            try:
                os.close(self._conn.fileno())
            except OSError:
                pass
        self._conn = None
        self._proc = None
        self._thread = None
        self._listener = None
        self._pending = {}
        self._mapped = set()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        if self._conn is None:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the writer if it is not running (called ahead of the first save to pre-warm)."""
        if self.alive():
            return
        self._reap()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.kind is WriterKind.PROCESS:
            env = dict(os.environ)
            env["PYTHONPATH"] = _PKG_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            # A fresh interpreter, not a fork: safe with CUDA and threads, and no re-import of the
            # user's __main__. Its own session: a Ctrl-C to the trainer's terminal does not cut a
            # commit short; it exits by itself once the trainer's end of the socket closes.
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "zerostall.persist.server", str(child.fileno()), str(self.nice)],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                close_fds=True)
            child.close()
        else:
            from zerostall.persist.server import serve

            self._thread = threading.Thread(target=serve, args=(Connection(child.detach()),),
                                            name="zerostall-writer", daemon=True)
            self._thread.start()
        self._conn = Connection(parent.detach())
        self._mapped = set()
        self._listener = threading.Thread(target=self._listen, args=(self._conn,), name="zerostall-listener",
                                          daemon=True)
        self._listener.start()

    def _reap(self) -> None:
        """Forget a dead writer once its listener has failed its pending jobs."""
        if self._listener is not None and self._listener is not threading.current_thread():
            self._listener.join()
        if self._proc is not None:
            self._proc.wait()
        self._proc = None
        self._thread = None
        self._conn = None
        self._listener = None

    def close(self) -> None:
        """Stop the writer after the jobs already submitted (call after waiting for them)."""
        self._closing = True
        if self._conn is not None:
            try:
                self._send({"op": "close"})
            except OSError:
                pass
        if self._listener is not None:
            self._listener.join(timeout=60)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self._conn is not None:
            self._conn.close()
        self._proc = None
        self._thread = None
        self._conn = None
        self._closing = False

    # -- jobs ------------------------------------------------------------------------------

    def _send(self, msg: dict[str, Any], fd: int | None = None) -> None:
        assert self._conn is not None
        with self._send_lock:
            self._conn.send_bytes(json.dumps(msg).encode())
            if fd is not None:
                send_handle(self._conn, fd, self._proc.pid if self._proc is not None else os.getpid())

    def forget(self, buf: HostBuffer) -> None:
        """The trainer is about to free ``buf``: the writer drops its mapping."""
        if buf.id in self._mapped and self.alive():
            try:
                self._send({"op": "unmap", "buffer": buf.id})
            except OSError:
                pass
        self._mapped.discard(buf.id)

    def submit(
        self,
        job: dict[str, Any],
        buffers: list[HostBuffer],
        on_released: Callable[[], None],
        on_done: Callable[[dict[str, Any] | None, BaseException | None], None],
    ) -> None:
        """Queue ``job``; its ``files[i]`` are written from ``buffers[i]``."""
        for attempt in range(2):
            self.start()
            jid = next(self._ids)
            job = dict(job, op="save", id=jid)
            job["files"] = [dict(f, buffer=b.id) for f, b in zip(job["files"], buffers)]
            with self._lock:
                self._pending[jid] = _Pending(on_released, on_done, path=job.get("path"), root=job.get("root"),
                                              name=job.get("name"),
                                              nbytes=sum(int(f.get("length", 0)) for f in job["files"]))
            try:
                for b in buffers:
                    if b.id not in self._mapped:
                        self._send({"op": "map", "buffer": b.id, "size": b.size}, fd=b.fd)
                        self._mapped.add(b.id)
                self._send(job)
                return
            except OSError:
                # The writer died under us: its listener fails what it had; try once more on a new one.
                with self._lock:
                    self._pending.pop(jid, None)
                if self._proc is not None:
                    self._proc.wait()
                self._reap()
                if attempt == 1:
                    raise WriterError("could not hand the save to a writer process") from None

    def _listen(self, conn: Connection) -> None:
        while True:
            try:
                msg = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            op = msg.get("op")
            if op == "released":
                with self._lock:
                    p = self._pending.get(msg["id"])
                if p is not None and not p.released:
                    p.released = True
                    p.on_released()
            elif op in ("done", "error"):
                with self._lock:
                    p = self._pending.pop(msg["id"], None)
                if p is None:
                    continue
                if not p.released:
                    p.released = True
                    p.on_released()
                if op == "done":
                    p.on_done(msg["stats"], None)
                else:
                    p.on_done(None, from_wire(msg["error"]))
        self._fail_pending()

    def _fail_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        how = "was closed"
        if self._proc is not None:
            rc = self._proc.wait()
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        for p in pending.values():
            if not p.released:
                p.released = True
                p.on_released()
            if _committed_anyway(p):
                # It died after the rename (during retention, say): the checkpoint is complete.
                p.on_done({"nbytes": p.nbytes, "write_s": None, "persist_s": None, "commit_s": None,
                           "writer_peak_rss": None, "retention_error": f"the writer process {how}"}, None)
                continue
            p.on_done(None, WriterError(f"the writer process {how} before the checkpoint was committed; "
                                        "nothing of this save was committed", path=p.path))
