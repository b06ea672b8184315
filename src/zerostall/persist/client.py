"""The trainer's side of the writer: start it, hand it buffers and jobs, route its answers.

Answers arrive on a listener thread: ``released`` (the job's buffers may be staged into
again), then ``done`` or ``error``. If the writer dies, every job it had not finished fails
with :class:`~zerostall.errors.WriterError`, its buffers are released, and the next submit
starts a fresh writer.
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
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

from zerostall.commit import is_committed
from zerostall.envvars import settled_switches
from zerostall.errors import (
    InvalidArgumentError,
    KeeperLostError,
    KeeperPersistError,
    WriterError,
    ZerostallError,
)
from zerostall.memtier.keeperfail import KeeperFailure, UnadoptableKeeper, as_error
from zerostall.memtier.spec import KeeperSpec, adopt, busy_error
from zerostall.messages import (
    PROTOCOL,
    Close,
    Closed,
    Done,
    Failed,
    ForgetLayout,
    Hello,
    Image,
    ImageQuery,
    KeeperBusy,
    KeeperFailed,
    LeafLayout,
    LeafRow,
    MapBuffer,
    Message,
    NodeIndex,
    Persisted,
    PersistHeld,
    ProtocolMismatchError,
    Released,
    ReplicaSetup,
    SaveJob,
    UnmapBuffer,
    WriterStats,
    decode,
    encode,
    from_wire,
    node_delta,
    node_index,
)
from zerostall.options import WriterKind
from zerostall.stage.buffers import HostBuffer
from zerostall.storage import open_storage

__all__ = ["WriterClient", "OnDone"]

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
    """One background writer (process or thread) and the jobs in flight on it."""

    def __init__(self, kind: WriterKind = WriterKind.PROCESS, *, nice: int = 10, sched: str = "batch",
                 keeper: KeeperSpec | None = None) -> None:
        self.kind = kind
        self.nice = nice
        self.sched = sched
        #: the memory tier: the writer is a keeper, adopted from a dead trainer when one lingers
        self.keeper = keeper
        self._adopted_pid: int | None = None
        #: memory-tier jobs done but whose buffers the keeper still holds: job id -> release
        self._held: dict[int, Callable[[], None]] = {}
        self._image_waiter: tuple[int, list[tuple[Image, list[int]] | None]] | None = None
        self._image_event = threading.Event()
        self._query_lock = threading.Lock()
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
        #: set when the writer introduced itself with another protocol: restarting cannot help
        self._incompatible: ProtocolMismatchError | None = None
        #: set when the running writer has said hello (or its listener ended): see wait_ready()
        self._ready = threading.Event()
        #: the keeper's failed persists of memory-only steps it reported (oldest first); see
        #: :attr:`zerostall.Checkpointer.keeper_failures`
        self.keeper_failures: list[KeeperPersistError | UnadoptableKeeper] = []
        #: those of them that a persist this trainer asked for itself (its clean close, or
        #: :meth:`persist_held`) reported; each is raised once, by whichever asked
        self.close_failures: list[KeeperPersistError] = []
        #: the keeper's answers to :meth:`persist_held`: request number -> the step it said is stored
        self._persisted: dict[int, int | None] = {}
        self._persisted_event = threading.Condition()
        self._requests = itertools.count(1)
        #: the newest memory-tier save done, if only memory holds it (None once a newer one persisted):
        #: the step a clean close must see stored (:meth:`close`)
        self._memory_only: SaveJob | None = None
        #: the step the keeper said is on storage at this close (:class:`Closed`)
        self._durable: int | None = None
        #: the keeper ended while it held ``_memory_only``: that step, and the error naming it
        self._lost: tuple[int | None, KeeperLostError] | None = None
        #: our keeper found the memory tier held by another trainer's keeper (:class:`KeeperBusy`
        #: instead of its Hello) and exited: raised by the next wait_ready(), start() or the jobs it had
        self._busy: InvalidArgumentError | None = None
        #: our keeper said in its Hello that it cannot be adopted: to be warned of on the training thread
        self._unadoptable: list[UnadoptableKeeper] = []
        #: loads from memory in progress (:meth:`pin_held`), and the slots the keeper let go of
        #: meanwhile, handed back for staging only when the last of those loads has ended
        self._pins = 0
        self._deferred: list[Callable[[], None]] = []
        #: replication settings the keeper is told after each Hello (a new or adopted keeper)
        self.replica_setup: ReplicaSetup | None = None
        #: the leaf layouts of this trainer's saves (:class:`LeafLayout`), by the identity of their
        #: rows tuple (the engine hands a plan's own): id(rows) -> (rows, layout id); ids are never
        #: reused, so a writer that holds an id holds that layout
        self._layouts: OrderedDict[int, tuple[tuple[LeafRow, ...], int]] = OrderedDict()
        self._layout_ids = itertools.count(1)
        #: the layouts the running writer holds (for its connection only: a restarted writer or an
        #: adopted keeper holds none), with the item nodes each was sent with and their index
        self._sent_layouts: dict[int, tuple[dict[str, Any], NodeIndex]] = {}
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
        self._sent_layouts = {}
        self._held = {}
        self._adopted_pid = None
        self._busy = None
        self._unadoptable = []
        self._pins = 0
        self._deferred = []
        self._image_waiter = None
        self._image_event = threading.Event()
        self._query_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else self._adopted_pid

    @property
    def adopted(self) -> bool:
        """Whether this writer is a keeper adopted from an earlier trainer (not our child)."""
        return self._adopted_pid is not None

    def alive(self) -> bool:
        if self._conn is None:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        if self._adopted_pid is not None:
            return self._listener is not None and self._listener.is_alive()
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the writer if it is not running (called ahead of the first save to pre-warm).

        Raises:
            ProtocolMismatchError: an earlier writer spoke another protocol version.
            InvalidArgumentError: the memory tier of this directory and rank is held on this host
                by another live trainer (refused by the keeper we tried to adopt, or reported by
                the keeper we started, which lost the name to that trainer's; raised once).
        """
        if self._incompatible is not None:
            raise self._incompatible
        if self.alive():
            return
        self._reap()
        self._raise_busy()
        if self.kind is WriterKind.PROCESS and self.keeper is not None:
            claimed = adopt(self.keeper)
            if claimed is not None:
                self._conn, hello = claimed
                self._adopted_pid = hello.pid
                self._ready = threading.Event()
                self._ready.set()  # adopt() read its Hello already
                self._mapped = set()
                self._sent_layouts = {}  # a keeper holds layouts per trainer connection
                self._listener = threading.Thread(target=self._listen, args=(self._conn,),
                                                  name="zerostall-listener", daemon=True)
                self._listener.start()
                self._tell_replica_setup()
                return
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.kind is WriterKind.PROCESS:
            env = settled_switches(dict(os.environ))  # a bad switch is warned about here, not again there
            env["PYTHONPATH"] = _PKG_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            # A fresh interpreter, not a fork: safe with CUDA and threads, and no re-import of the
            # user's __main__. Its own session: a Ctrl-C to the trainer's terminal does not cut a
            # commit short; it exits by itself once the trainer's end of the socket closes.
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "zerostall.persist.server" if self.keeper is None else "zerostall.memtier.keeper",
                 str(child.fileno()), str(self.nice), self.sched, *(self.keeper.argv() if self.keeper is not None else [])],
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
        self._tell_replica_setup()

    def _tell_replica_setup(self) -> None:
        if self.replica_setup is not None and self.keeper is not None:
            try:
                self._send(self.replica_setup)
            except OSError:
                pass  # the keeper is gone: the next start tells the next one

    def set_replica_setup(self, setup: ReplicaSetup) -> None:
        """Tell the keeper (now, and every keeper started or adopted later) how to replicate."""
        self.replica_setup = setup
        if self.alive():
            self._tell_replica_setup()

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

        With a memory tier, the keeper first persists the newest step only its memory holds; this
        waits for that persist for as long as the keeper runs it (each of its waits is bounded by
        the storage's timeouts and, for a collective step, by ``DistributedOptions.timeout_s``).
        If the keeper ends without saying that step is stored, and without reporting the failure,
        :attr:`close_failures` gets a :class:`KeeperLostError` naming it.
        """
        self._closing = True
        self._durable = None
        if self._conn is not None:
            try:
                self._send(Close())
            except OSError:
                pass
        if self._listener is not None:
            self._listener.join(timeout=None if self.keeper is not None else 60)
        self._check_stored_at_close()
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
        self._release_held()
        self._proc = None
        self._adopted_pid = None
        self._thread = None
        self._conn = None
        self._closing = False

    def abandon(self) -> None:
        """Leave the writer as a crash would (no :class:`Close`): a keeper then lingers for a
        restarted trainer instead of exiting. Call after waiting for the jobs submitted."""
        conn, self._conn = self._conn, None
        self._memory_only = None  # left to the keeper for a restart: no close() will ask for it
        if conn is not None:
            self._closing = True
            try:  # wakes our listener (EOF) and tells the keeper its trainer is gone
                socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if self._listener is not None and self._listener is not threading.current_thread():
                self._listener.join(timeout=60)
            conn.close()
        self._release_held()
        self._proc = None  # not waited for: it lingers (Popen reaps it if it exits before us)
        self._adopted_pid = None
        self._listener = None
        self._closing = False

    # -- jobs ------------------------------------------------------------------------------

    def _send(self, msg: Message, fd: int | None = None) -> None:
        assert self._conn is not None
        with self._send_lock:
            self._conn.send_bytes(encode(msg))
            if fd is not None:
                send_handle(self._conn, fd, self._proc.pid if self._proc is not None else os.getpid())

    def _send_job(self, job: SaveJob) -> None:
        """Send ``job`` naming its leaf layout: the rows and the item nodes the writer already
        holds are not sent again (~170 bytes of JSON a leaf, decoded again by the writer). The
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
                self._send(UnmapBuffer(buffer=buf.id))
            except OSError:
                pass
        self._mapped.discard(buf.id)

    def submit(self, job: SaveJob, buffers: list[HostBuffer], on_released: Callable[[], None],
               on_done: OnDone) -> None:
        """Queue ``job``; its ``files[i]`` are written from ``buffers[i]`` (the job's ``id`` is assigned here).

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
                        self._send(MapBuffer(buffer=b.id, size=b.size), fd=b.fd)
                        self._mapped.add(b.id)
                self._send_job(job)
                return
            except OSError:
                # The writer died under us: its listener fails what it had; try once more on a new one.
                with self._lock:
                    self._pending.pop(job.id, None)
                if self._proc is not None:
                    self._proc.wait()
                self._reap()
                if attempt == 1:
                    raise WriterError("could not hand the save to a writer process") from None

    def _listen(self, conn: Connection) -> None:
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
                if msg.unadoptable is not None and self.keeper is not None:  # before _ready: the constructor warns
                    self._note_unadoptable(msg)
                self._ready.set()
            elif isinstance(msg, KeeperBusy):  # our keeper lost the name to another trainer's; it exits
                if self.keeper is not None:
                    self._busy = busy_error(self.keeper, msg)
                self._ready.set()
            elif isinstance(msg, Released):
                with self._lock:
                    p = self._pending.get(msg.job)
                    hold = self._held.pop(msg.job, None)
                    if hold is not None and self._pins:  # a load may be reading that slot: not yet
                        self._deferred.append(hold)
                        hold = None
                if p is not None and not p.released:
                    p.released = True
                    p.on_released()
                if hold is not None:
                    hold()
            elif isinstance(msg, KeeperFailed):
                err = self.note_keeper_failure(KeeperFailure(step=msg.step, path=msg.path, error=msg.error,
                                                             rank=msg.rank, time=0.0))
                if msg.closing:
                    self.close_failures.append(err)
            elif isinstance(msg, Closed):
                self._durable = msg.step
            elif isinstance(msg, Persisted):
                with self._persisted_event:
                    self._persisted[msg.request] = msg.step
                    self._persisted_event.notify_all()
            elif isinstance(msg, Image):
                fds = [recv_handle(conn) for _ in msg.files]
                self._image_reply((msg, fds))
            elif isinstance(msg, (Done, Failed)):
                with self._lock:
                    p = self._pending.pop(msg.job, None)
                if p is None:
                    continue
                if isinstance(msg, Done) and p.job.memory:
                    self._memory_only = None if p.job.persist else p.job
                if not p.released and isinstance(msg, Done) and p.job.memory:
                    # the keeper holds this step's buffers until a newer step is in memory
                    p.released = True
                    with self._lock:
                        self._held[p.job.id] = p.on_released
                if not p.released:
                    p.released = True
                    p.on_released()
                if isinstance(msg, Done):
                    p.on_done(msg.stats, None)
                else:
                    p.on_done(None, from_wire(msg.error))
        if self._incompatible is not None:
            conn.close()  # the writer exits once it sees its trainer's end close
        if not self._closing:
            self._note_lost()  # the keeper died under a live trainer: told now, raised by close()
        self._ready.set()  # nobody waits for a writer that is gone
        with self._persisted_event:
            self._persisted_event.notify_all()
        self._image_reply(None)
        self._release_held()
        self._fail_pending()

    # -- the memory tier -------------------------------------------------------------------

    def _release_held(self) -> None:
        """The keeper is gone (or closing): the slots it held may be staged into again."""
        with self._lock:
            held, self._held = self._held, {}
            if self._pins:  # a load may be reading one of them: handed back when it ends
                self._deferred += held.values()
                held = {}
        for release in held.values():
            release()

    def pin_held(self) -> None:
        """Until the matching :meth:`unpin_held`, keep every slot the keeper lets go of from being
        staged into again. A load from memory maps the step the keeper holds, which may be this
        trainer's own staging slot: a save on another thread meanwhile would make the keeper let go
        of it, and a later save would stage into the very bytes that load copies from."""
        with self._lock:
            self._pins += 1

    def unpin_held(self) -> None:
        """End a :meth:`pin_held`; the last one hands the slots let go of meanwhile back for staging."""
        with self._lock:
            self._pins -= 1
            release, self._deferred = (self._deferred, []) if not self._pins else ([], self._deferred)
        for r in release:
            r()

    def _note_lost(self) -> KeeperLostError | None:
        """The keeper has ended: if it held the newest step this trainer saved and only memory had
        it, that step is lost. Logged and listed once (:attr:`keeper_failures`); returned for
        :meth:`close` to raise (None: nothing was lost)."""
        job = self._memory_only
        if job is None or self.keeper is None:
            return None
        if self._lost is not None and self._lost[0] == job.step:
            return self._lost[1]
        pid = self.pid
        err = KeeperLostError(
            f"the memory tier's keeper ({f'pid {pid}, ' if pid is not None else ''}rank {self.keeper.rank}) ended "
            f"before step {job.step}, which only its memory held, reached storage: step {job.step} is lost, and "
            "storage's newest step is an older one", path=job.path, rank=self.keeper.rank, step=job.step)
        self._lost = (job.step, err)
        self.keeper_failures.append(err)
        log.warning("zerostall: %s", err)
        return err

    def _check_stored_at_close(self) -> None:
        """After a clean close: the newest memory-only step must be on storage (the keeper said so
        with :class:`Closed`), or its failed persist was reported; else the keeper ended without
        storing it, and close() raises :class:`KeeperLostError` naming it."""
        job = self._memory_only
        if job is None or self.keeper is None or self._durable == job.step:
            return
        if any(e.step == job.step for e in self.close_failures):
            return
        err = self._note_lost()
        if err is not None:
            self.close_failures.append(err)

    @property
    def memory_only_step(self) -> int | None:
        """The newest step this trainer saved if only the keeper's memory holds it (None: none)."""
        job = self._memory_only
        return job.step if job is not None else None

    def persist_held(self, timeout: float | None = None, *, sent: Callable[[], None] | None = None,
                     bound_s: float | None = None) -> None:
        """Have the keeper persist the newest step this trainer saved that only memory holds (none:
        return at once), and return once it is on storage; the keeper goes on serving. Call after
        the jobs submitted have finished. Under torch.distributed the persist of a collective step
        is collective: every rank's trainer must call this (it is the persist of :meth:`close`).

        ``timeout``: return after about this many seconds even if the keeper has not answered
        (the persist goes on; a later call, or close(), waits for it again). ``bound_s`` bounds
        a collective step's persist in the keepers below the job's ``timeout_s``. ``sent()`` is
        called once the request is on its way (or there is nothing to ask): a save handed over
        after it is persisted after this step, never instead of it.

        Raises:
            KeeperPersistError: the persist failed (its ``cause`` says why; the step is still in
                this host's memory, and :meth:`close` tries again unless the step is collective).
            KeeperLostError: the keeper ended without storing the step: it is lost.
        """
        job = self._memory_only
        if job is None or self.keeper is None or self.kind is not WriterKind.PROCESS:
            if sent is not None:
                sent()
            return
        told = len(self.close_failures)
        request = next(self._requests)
        try:
            if self._conn is None:
                raise OSError("no keeper")
            self._send(PersistHeld(request=request, timeout_s=bound_s))
        except OSError:  # no keeper to ask: its listener saw it end
            request = 0
        finally:
            if sent is not None:
                sent()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._persisted_event:
            while request and request not in self._persisted and self._listener is not None \
                    and self._listener.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._persisted_event.wait(left)
            stored = self._persisted.pop(request, None) if request else None
        if stored is not None and stored == job.step:
            if self._memory_only is job:
                self._memory_only = None
            return
        failed = [e for e in self.close_failures[told:] if e.step == job.step]
        if failed:
            raise failed[-1]
        if request and (self._listener is not None and self._listener.is_alive()):
            err: KeeperPersistError = KeeperPersistError(
                f"the memory tier's keeper (rank {self.keeper.rank}) did not persist step {job.step}, which only "
                "its memory holds (a collective step's persist is tried once)", path=job.path,
                rank=self.keeper.rank, step=job.step)
            self.close_failures.append(err)
            raise err
        lost = self._note_lost()
        if lost is not None:
            if all(e is not lost for e in self.close_failures):
                self.close_failures.append(lost)
            raise lost

    def note_keeper_failure(self, failure: KeeperFailure) -> KeeperPersistError:
        """Record a failed persist of the keeper (from its message or a marker) and log it."""
        err = as_error(failure)
        self.keeper_failures.append(err)
        log.warning("zerostall: %s", err)
        return err

    def _note_unadoptable(self, hello: Hello) -> None:
        """Our keeper serves but cannot be adopted: list it with the keeper failures, and keep it
        for the training thread to warn of (:meth:`take_unadoptable`)."""
        assert self.keeper is not None and hello.unadoptable is not None
        record = UnadoptableKeeper.from_hello(self.keeper.root, self.keeper.rank, hello.pid, hello.unadoptable)
        self.keeper_failures.append(record)
        with self._lock:
            self._unadoptable.append(record)

    def take_unadoptable(self) -> list[UnadoptableKeeper]:
        """The unadoptable keepers reported since the last call (each warned of once)."""
        if not self._unadoptable:
            return []
        with self._lock:
            out, self._unadoptable = self._unadoptable, []
        return out

    def _image_reply(self, reply: tuple[Image, list[int]] | None) -> None:
        """An :class:`Image` arrived (None: the keeper ended). One that answers a query nobody
        waits for any more (it timed out: the keeper hung meanwhile) is dropped, descriptors
        closed: it may describe another rank's replica than the query now waiting asked for."""
        waiter = self._image_waiter
        if waiter is None or (reply is not None and reply[0].request != waiter[0]):
            if reply is not None:
                for fd in reply[1]:
                    os.close(fd)
            return
        self._image_waiter = None
        waiter[1].append(reply)
        self._image_event.set()

    def query_image(self, timeout: float | None = 600.0, *, start: bool = True,
                    origin: int | None = None) -> tuple[Image, list[int]] | None:
        """The keeper's newest in-memory step and one descriptor per data file (the caller
        closes them); None when this writer is no keeper or is not running.

        ``origin``: the replica this keeper holds of rank ``origin``'s step instead.
        Answered after every job submitted before the call has finished. ``start=False``: None
        rather than starting a writer that is not running (a background query must not start
        a keeper after the Checkpointer closed).
        """
        if self.keeper is None or self.kind is not WriterKind.PROCESS:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        # another thread's query may be waiting for a keeper that hung: never past our own timeout
        if not self._query_lock.acquire(timeout=-1 if timeout is None else timeout):
            return None
        try:
            if not start and (not self.alive() or self._closing):
                return None
            try:
                self.start()
            except ZerostallError:
                return None
            box: list[tuple[Image, list[int]] | None] = []
            request = next(self._requests)
            self._image_event.clear()
            self._image_waiter = (request, box)
            try:
                self._send(ImageQuery(origin=origin, request=request))
            except OSError:
                self._image_waiter = None
                return None
            if not self._image_event.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                self._image_waiter = None
                return None
            return box[0] if box else None
        finally:
            self._query_lock.release()

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
            if self._incompatible is not None:
                p.on_done(None, self._incompatible)
                continue
            if self._busy is not None:  # the keeper never served: nothing was saved
                p.on_done(None, self._busy)
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
            InvalidArgumentError: the memory tier's keeper found its directory and rank held by
                another live trainer's keeper on this host (it started at the same moment).
        """
        if self._conn is None:
            return False
        # Not alive() first: a keeper that said KeeperBusy exits at once, and its listener (which
        # sets _ready when it ends) may still be reading that message.
        ready = self._ready.wait(timeout)
        self._raise_busy()
        return ready and self.alive()

    def _raise_busy(self) -> None:
        """Raise our keeper's refusal once; a later start() tries again (adopt, or a new keeper)."""
        busy, self._busy = self._busy, None
        if busy is not None:
            self._reap()
            raise busy
