"""The trainer's side of the writer: start it, hand it buffers and jobs, route its answers.

Answers arrive on a listener thread: ``released`` (the job's buffers may be staged into
again), then ``done`` or ``error``. If the writer dies, every job it had not finished fails
with :class:`~zerostall.errors.WriterError`, its buffers are released, and the next submit
starts a fresh writer.

A writer that is more than a writer (the memory tier's keeper) plugs in through one seam,
:class:`WriterSide` (:mod:`zerostall.memtier.client` implements it): how to start or adopt it, its
messages of its own kinds, the slots it holds after a job is done, and what its end means. It is
the mirror of the writer's own seam, :class:`zerostall.persist.server.HeldSteps`. This module
knows nothing more of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, Protocol

from zerostall.buffers import HostBuffer
from zerostall.commit import is_committed
from zerostall.envvars import settled_switches
from zerostall.errors import WriterError, ZerostallError
from zerostall.messages import (
    PROTOCOL,
    Close,
    Done,
    Failed,
    ForgetLayout,
    Hello,
    LeafLayout,
    LeafRow,
    MapBuffer,
    Message,
    NodeIndex,
    ProtocolMismatchError,
    Released,
    SaveJob,
    SavePiece,
    UnmapBuffer,
    WriterStats,
    decode,
    encode,
    from_wire,
    node_delta,
    node_index,
)
from zerostall.options import WriterKind
from zerostall.storage import open_storage

__all__ = ["WriterClient", "WriterSide", "OnDone"]

#: called once per job: the writer's statistics, or the error
OnDone = Callable[[WriterStats | None, BaseException | None], None]

log = logging.getLogger("zerostall")
#: leaf layouts a client names (the engine keeps 8 plans); the writer drops those it is told to forget
_LAYOUTS_KEEP = 16
_ABSENT = object()
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CLIENTS: weakref.WeakSet[WriterClient] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker, say) must not keep the trainer's end of the writer
    # socket open: the writer exits on EOF once the trainer dies, and a copy held by a child
    # would delay that. The writer belongs to the parent; the child starts its own if it saves.
    for client in list(_CLIENTS):
        client._detach_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class WriterSide(Protocol):
    """What a writer that is more than a writer adds to its trainer's client (the memory tier's
    keeper: :class:`zerostall.memtier.client.KeeperSide`). Every hook but :meth:`attach`,
    :meth:`adopt` and :meth:`connected` runs on the client's listener thread."""

    #: the staging slots the writer keeps after their job is done (the keeper holds the newest
    #: step's): the engine's pool has this many more than ``max_in_flight``
    held_slots: int

    def attach(self, client: WriterClient) -> None:
        """The client this side belongs to (called once, by the client's constructor)."""

    def command(self) -> list[str]:
        """The writer's entry point and arguments after ``FD NICE SCHED`` (``-m <module> ...``)."""

    def adopt(self) -> tuple[Connection, Hello] | None:
        """A writer of this side that already runs and takes this trainer (a keeper that
        outlived the trainer before): its connection and Hello, or None to start one."""

    def connected(self) -> None:
        """A writer, started or adopted, now serves: tell it what it must know first."""

    def on_hello(self, hello: Hello) -> None:
        """The writer's Hello (before :meth:`WriterClient.wait_ready` returns)."""

    def on_message(self, msg: Message, conn: Connection) -> bool:
        """A message of the side's own kinds (descriptors that follow it are read from ``conn``
        here): True once handled."""

    def done(self, job: SaveJob, release: Callable[[], None] | None) -> bool:
        """Job ``job`` is done (``release``: its slot's, if not released yet). True when the
        writer keeps that slot: the side then calls ``release`` once the writer lets go of it
        (a later :class:`Released`, :meth:`on_released`), not the client now."""

    def on_released(self, job_id: int) -> None:
        """The writer let go of the slot of a job that is no longer pending."""

    def refusal(self) -> ZerostallError | None:
        """Why the writer that started will never serve (the keeper found its place taken), once;
        raised by :meth:`WriterClient.start` and :meth:`WriterClient.wait_ready`."""

    def failing(self) -> ZerostallError | None:
        """Why the jobs still pending when the writer ended failed, if the side knows better
        than "the writer died" (the same refusal); None otherwise."""

    def ended(self, closing: bool) -> None:
        """The writer's connection ended (``closing``: this trainer asked for it)."""

    def closing(self) -> None:
        """This trainer is about to say :class:`Close`."""

    def closed(self) -> None:
        """The writer has answered this trainer's :class:`Close` and its connection ended."""

    def abandoned(self) -> None:
        """This trainer leaves the writer as a crash would (no :class:`Close`)."""

    def forked(self) -> None:
        """In a child forked from the trainer: forget everything of the parent's writer."""


@dataclass
class _Pending:
    job: SaveJob
    on_released: Callable[[], None]
    on_done: OnDone
    released: bool = False


def _committed_anyway(p: _Pending) -> bool:
    """Whether a save whose writer died is committed all the same (single-process saves only)."""
    if p.job.collective is not None:
        return False
    try:
        return is_committed(open_storage(p.job.root), p.job.name)
    except Exception:  # noqa: BLE001 - cannot tell: the save is reported as failed
        return False


class WriterClient:
    """One background writer (process or thread) and the jobs in flight on it. ``side``: what the
    writer is beyond a writer (the memory tier's keeper), or None."""

    def __init__(self, kind: WriterKind = WriterKind.PROCESS, *, nice: int = 10, sched: str = "batch",
                 side: WriterSide | None = None) -> None:
        self.kind = kind
        self.nice = nice
        self.sched = sched
        self.side = side
        self._adopted_pid: int | None = None
        self._ids = itertools.count(1)
        #: numbers for requests that expect an answer (a side's queries)
        self.requests = itertools.count(1)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        #: the pieces of a piecewise save the writer has not let go of: piece id -> release
        self._pieces: dict[int, Callable[[], None]] = {}
        self._mapped: set[int] = set()
        self._conn: Connection | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._listener: threading.Thread | None = None
        self._closing = False
        #: set when the writer introduced itself with another protocol: restarting cannot help
        self._incompatible: ProtocolMismatchError | None = None
        #: set when the running writer has said hello (or its listener ended): see wait_ready()
        self._ready = threading.Event()
        #: the leaf layouts of this trainer's saves (:class:`LeafLayout`), by the identity of their
        #: rows tuple (the engine hands a plan's own): id(rows) -> (rows, layout id); ids are never
        #: reused, so a writer that holds an id holds that layout
        self._layouts: OrderedDict[int, tuple[tuple[LeafRow, ...], int]] = OrderedDict()
        self._layout_ids = itertools.count(1)
        #: the layouts the running writer holds (for its connection only: a restarted writer or an
        #: adopted keeper holds none), with the item nodes each was sent with and their index
        self._sent_layouts: dict[int, tuple[dict[str, Any], NodeIndex]] = {}
        if side is not None:
            side.attach(self)
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
        self._pieces = {}
        self._mapped = set()
        self._sent_layouts = {}
        self._adopted_pid = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        if self.side is not None:
            self.side.forked()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else self._adopted_pid

    @property
    def adopted(self) -> bool:
        """Whether this writer was running before this trainer (a keeper adopted from an earlier
        trainer: not our child)."""
        return self._adopted_pid is not None

    @property
    def held_slots(self) -> int:
        """Staging slots the writer keeps after their jobs are done (see :attr:`WriterSide.held_slots`)."""
        return self.side.held_slots if self.side is not None else 0

    @property
    def closing_now(self) -> bool:
        """Whether this trainer is closing (or abandoning) the writer right now."""
        return self._closing

    def alive(self) -> bool:
        if self._conn is None:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        if self._adopted_pid is not None:
            return self._listener is not None and self._listener.is_alive()
        return self._thread is not None and self._thread.is_alive()

    def listening(self) -> bool:
        """Whether the listener still reads the writer's answers (it has not ended)."""
        return self._listener is not None and self._listener.is_alive()

    def start(self) -> None:
        """Start the writer if it is not running (called ahead of the first save to pre-warm).

        Raises:
            ProtocolMismatchError: an earlier writer spoke another protocol version.
            ZerostallError: the side's refusal (:meth:`WriterSide.refusal`; the memory tier of
                this directory and rank is held by another live trainer), once.
        """
        if self._incompatible is not None:
            raise self._incompatible
        if self.alive():
            return
        self._reap()
        self._raise_refusal()
        side = self.side
        if self.kind is WriterKind.PROCESS and side is not None:
            claimed = side.adopt()
            if claimed is not None:
                self._conn, hello = claimed
                self._adopted_pid = hello.pid
                self._ready = threading.Event()
                self._ready.set()  # adopt() read its Hello already
                self._mapped = set()
                self._sent_layouts = {}  # a writer holds layouts per trainer connection
                self._listener = threading.Thread(target=self._listen, args=(self._conn,),
                                                  name="zerostall-listener", daemon=True)
                self._listener.start()
                side.connected()
                return
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.kind is WriterKind.PROCESS:
            env = settled_switches(dict(os.environ))  # a bad switch is warned about here, not again there
            env["PYTHONPATH"] = _PKG_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            entry = side.command() if side is not None else ["-m", "zerostall.persist.server"]
            # A fresh interpreter, not a fork: safe with CUDA and threads, and no re-import of the
            # user's __main__. Its own session: a Ctrl-C to the trainer's terminal does not cut a
            # commit short; it exits by itself once the trainer's end of the socket closes.
            self._proc = subprocess.Popen(
                [sys.executable, entry[0], entry[1], str(child.fileno()), str(self.nice), self.sched, *entry[2:]],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                close_fds=True)
            child.close()
        else:
            from zerostall.persist.server import serve

            self._thread = threading.Thread(target=serve, args=(Connection(child.detach()),),
                                            kwargs={"own_process": False}, name="zerostall-writer", daemon=True)
            self._thread.start()
        self._conn = Connection(parent.detach())
        self._ready = threading.Event()
        self._mapped = set()
        self._sent_layouts = {}
        self._listener = threading.Thread(target=self._listen, args=(self._conn,), name="zerostall-listener",
                                          daemon=True)
        self._listener.start()
        if side is not None:
            side.connected()

    def _reap(self) -> None:
        """Forget a dead writer once its listener has failed its pending jobs."""
        if self._listener is not None and self._listener is not threading.current_thread():
            self._listener.join()
        if self._proc is not None:
            self._proc.wait()
        self._proc = None
        self._adopted_pid = None
        self._thread = None
        self._conn = None
        self._listener = None

    def close(self) -> None:
        """Stop the writer after the jobs already submitted (call after waiting for them).

        With a side (the memory tier), the writer may have more to do before it lets this
        trainer go (the keeper first persists the newest step only its memory holds): this waits
        for it for as long as the writer runs it (each of the keeper's waits is bounded by the
        storage's timeouts and, for a collective step, by ``DistributedOptions.timeout_s``).
        """
        side = self.side
        self._closing = True
        if side is not None:
            side.closing()
        if self._conn is not None:
            try:
                self.send(Close())
            except OSError:
                pass
        if self._listener is not None:
            self._listener.join(timeout=None if side is not None else 60)
        if side is not None:
            side.closed()
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
        self._adopted_pid = None
        self._thread = None
        self._conn = None
        self._closing = False

    def abandon(self) -> None:
        """Leave the writer as a crash would (no :class:`Close`): a keeper then lingers for a
        restarted trainer instead of exiting. Call after waiting for the jobs submitted."""
        conn, self._conn = self._conn, None
        if self.side is not None:
            self.side.abandoned()
        if conn is not None:
            self._closing = True
            try:  # wakes our listener (EOF) and tells the writer its trainer is gone
                socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if self._listener is not None and self._listener is not threading.current_thread():
                self._listener.join(timeout=60)
            conn.close()
        self._proc = None  # not waited for: it lingers (Popen reaps it if it exits before us)
        self._adopted_pid = None
        self._listener = None
        self._closing = False

    # -- jobs ------------------------------------------------------------------------------

    def send(self, msg: Message, fd: int | None = None) -> None:
        """Send one message (and a descriptor after it) to the running writer.

        Raises:
            OSError: no writer runs, or its connection broke.
        """
        conn = self._conn
        if conn is None:
            raise OSError("no writer runs")
        with self._send_lock:
            conn.send_bytes(encode(msg))
            if fd is not None:
                send_handle(conn, fd, self._proc.pid if self._proc is not None else os.getpid())

    def _send_job(self, job: SaveJob) -> None:
        """Send ``job`` naming its leaf layout: the rows and the item nodes the writer already
        holds are not sent again (~185 bytes of JSON a leaf, decoded again by the writer). The
        layout goes first if the running writer does not hold it."""
        assert self._conn is not None
        rows = job.leaves
        with self._send_lock:
            entry = self._layouts.get(id(rows))
            if entry is not None and entry[0] is rows:
                self._layouts.move_to_end(id(rows))
                lid = entry[1]
            else:
                lid = next(self._layout_ids)
                self._layouts[id(rows)] = (rows, lid)  # holds the tuple: its id is not reused while kept
                while len(self._layouts) > _LAYOUTS_KEEP:
                    _, (_, old) = self._layouts.popitem(last=False)
                    if self._sent_layouts.pop(old, None) is not None:
                        self._conn.send_bytes(encode(ForgetLayout(id=old)))
            held = self._sent_layouts.get(lid)
            if held is None:
                self._conn.send_bytes(encode(LeafLayout(id=lid, leaves=rows, items=job.items)))
                held = self._sent_layouts[lid] = (job.items, node_index(job.items))
            nodes, index = held
            changed = {name: node_delta(node, index) for name, node in job.items.items()
                       if nodes.get(name, _ABSENT) is not node}
            self._conn.send_bytes(encode(dataclasses.replace(job, leaves=(), items=changed, layout=lid,
                                                             order=tuple(job.items))))

    def forget(self, buf: HostBuffer) -> None:
        """The trainer is about to free ``buf``: the writer drops its mapping."""
        if buf.id in self._mapped and self.alive():
            try:
                self.send(UnmapBuffer(buffer=buf.id))
            except OSError:
                pass
        self._mapped.discard(buf.id)

    def submit(self, job: SaveJob, buffers: list[HostBuffer], on_released: Callable[[], None],
               on_done: OnDone) -> int:
        """Queue ``job``; its ``files[i]`` are written from ``buffers[i]`` (the job's ``id`` is
        assigned here and returned: a piecewise job's pieces name it, :meth:`submit_piece`).

        Raises:
            WriterError: no writer could be started or reached (twice).
        """
        for attempt in range(2):
            self.start()
            job = dataclasses.replace(job, id=next(self._ids))
            with self._lock:
                self._pending[job.id] = _Pending(job, on_released, on_done)
            try:
                for b in buffers:
                    if b.id not in self._mapped:
                        self.send(MapBuffer(buffer=b.id, size=b.size), fd=b.fd)
                        self._mapped.add(b.id)
                self._send_job(job)
                return job.id
            except OSError:
                # The writer died under us: its listener fails what it had; try once more on a new one.
                with self._lock:
                    self._pending.pop(job.id, None)
                if self._proc is not None:
                    self._proc.wait()
                self._reap()
                if attempt == 1:
                    raise WriterError("could not hand the save to a writer process") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def submit_piece(self, job: int, *, file: int, offset: int, length: int, buffer: HostBuffer,
                     crcs: tuple[tuple[int, int, int, int], ...], on_released: Callable[[], None]) -> None:
        """Send one piece of piecewise job ``job`` (:class:`SavePiece`), staged in ``buffer``;
        ``on_released`` runs once the writer no longer reads it (or the writer is gone).

        Raises:
            WriterError: the writer is gone (its job fails with it; ``on_released`` has run).
        """
        pid = next(self._ids)
        with self._lock:
            self._pieces[pid] = on_released
        try:
            if buffer.id not in self._mapped:
                self.send(MapBuffer(buffer=buffer.id, size=buffer.size), fd=buffer.fd)
                self._mapped.add(buffer.id)
            self.send(SavePiece(id=pid, job=job, file=file, offset=offset, length=length, buffer=buffer.id,
                                crcs=crcs))
        except OSError:
            self._release_piece(pid)
            raise WriterError("the writer went away during a save in pieces; nothing of it was committed") from None

    def abort_pieces(self, job: int) -> None:
        """Tell the writer that piecewise job ``job`` gets no more pieces: it fails the job."""
        try:
            self.send(SavePiece(id=next(self._ids), job=job, file=0, offset=0, length=0, buffer=0, abort=True))
        except OSError:
            pass  # no writer: the job failed with it

    def _release_piece(self, pid: int) -> bool:
        with self._lock:
            release = self._pieces.pop(pid, None)
        if release is None:
            return False
        release()
        return True

    def _listen(self, conn: Connection) -> None:
        side = self.side
        while True:
            try:
                msg = decode(conn.recv_bytes())
            except (EOFError, OSError):
                break
            except ProtocolMismatchError as exc:
                self._incompatible = exc
                break
            except ZerostallError:
                break  # a malformed message: this writer cannot be trusted; fail what it had
            if isinstance(msg, Hello):
                if msg.protocol != PROTOCOL:  # pragma: no cover - decode() already refuses it
                    break
                if side is not None:  # before _ready: the constructor warns of what it says
                    side.on_hello(msg)
                self._ready.set()
            elif isinstance(msg, Released) and self._release_piece(msg.job):
                pass
            elif isinstance(msg, Released):
                with self._lock:
                    p = self._pending.get(msg.job)
                if p is not None and not p.released:
                    p.released = True
                    p.on_released()
                elif p is None and side is not None:
                    side.on_released(msg.job)
            elif isinstance(msg, (Done, Failed)):
                with self._lock:
                    p = self._pending.pop(msg.job, None)
                if p is None:
                    continue
                if isinstance(msg, Done) and side is not None and side.done(p.job, None if p.released else p.on_released):
                    p.released = True  # the writer holds this step's buffers until it lets go of them
                if not p.released:
                    p.released = True
                    p.on_released()
                if isinstance(msg, Done):
                    p.on_done(msg.stats, None)
                else:
                    p.on_done(None, from_wire(msg.error))
            elif side is None or not side.on_message(msg, conn):
                break  # a kind this client does not take: this writer cannot be trusted
        if self._incompatible is not None:
            conn.close()  # the writer exits once it sees its trainer's end close
        if side is not None:
            side.ended(self._closing)
        self._ready.set()  # nobody waits for a writer that is gone
        self._fail_pending()

    def mark_ready(self) -> None:
        """The running writer will never say Hello (its side refused to serve): wake waiters."""
        self._ready.set()

    def _fail_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            pieces, self._pieces = self._pieces, {}
        for release in pieces.values():  # a writer that is gone reads no piece
            release()
        if not pending:
            return
        how = "was closed"
        if self._proc is not None:
            rc = self._proc.wait()
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        known = self.side.failing() if self.side is not None else None
        for p in pending.values():
            if not p.released:
                p.released = True
                p.on_released()
            if self._incompatible is not None:
                p.on_done(None, self._incompatible)
                continue
            if known is not None:  # the writer never served: nothing was saved
                p.on_done(None, known)
                continue
            if _committed_anyway(p):
                # It died after the rename (during retention, say): the checkpoint is complete.
                p.on_done(WriterStats(nbytes=sum(f.length for f in p.job.files),
                                      retention_error=f"the writer process {how}"), None)
                continue
            p.on_done(None, WriterError(f"the writer process {how} before the checkpoint was committed; "
                                        "nothing of this save was committed", path=p.job.path))

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the running writer has introduced itself (its interpreter is up and reading).

        Returns False if no writer runs, or on timeout. Jobs sent earlier are not lost: they
        queue in the socket. Waiting here keeps the writer's start-up out of later saves' stalls.

        Raises:
            ZerostallError: the side's refusal (:meth:`WriterSide.refusal`: the memory tier's
                keeper found its directory and rank held by another live trainer's keeper on
                this host: it started at the same moment).
        """
        if self._conn is None:
            return False
        # Not alive() first: a writer that refused to serve exits at once, and its listener (which
        # sets _ready when it ends) may still be reading that refusal.
        ready = self._ready.wait(timeout)
        self._raise_refusal()
        return ready and self.alive()

    def _raise_refusal(self) -> None:
        """Raise the side's refusal once; a later start() tries again (adopt, or a new writer)."""
        refusal = self.side.refusal() if self.side is not None else None
        if refusal is not None:
            self._reap()
            raise refusal
