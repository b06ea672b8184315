"""The memory tier's keeper: the writer process, holding the newest step in memory for a restart.

With ``Checkpointer(memory_tier=MemoryTier(...))`` the writer process is also the *keeper*.
Every save is a memory-tier job (:attr:`SaveJob.memory`): the keeper checksums the staged
leaves the staging copy did not already checksum (:attr:`SaveJob.crcs`), builds the same
manifest storage would get, and then holds those buffers (the staging
slot itself: no copy) as the newest in-memory step. Only when a newer step has committed to
memory does it hand the older step's slot back (:class:`Released`), so the trainer never stages
into the bytes of the step the keeper holds, and a crash in the middle of a save leaves the
previous complete step in place. Jobs whose ``persist`` is set are also written to storage first.

The keeper already outlives its trainer (its own session, so torchrun's ``killpg`` of a failed
worker group does not reach it). When the trainer dies (the socket reaches EOF), the keeper
persists the newest memory-only step in the background (a collective step through the collective
protocol, with every rank's keeper: see docs/distributed.md, "The keepers' persist after a crash")
while it *lingers* up to ``linger_s`` on an abstract unix
socket named after the user, the checkpoint directory and the rank (:func:`keeper_address`).
A new trainer of the same triple connects (:func:`adopt`), both ends check that the other is the
same user (``SO_PEERCRED``), and the keeper becomes that trainer's writer, still holding the
step. A trainer asks for the held step with :class:`ImageQuery`; the keeper answers with an
:class:`Image` and the buffers' descriptors, which the trainer maps read-only to restore from.
On expiry the keeper exits (once that persist has ended); the kernel frees the memory, and an
abstract socket leaves no file.

Beside that persist, the keeper checks the held step after a crash: every leaf's CRC32C against
its manifest, on every core it may use (:mod:`zerostall.memtier.imagecheck`). The restarted
trainer's query waits for that check, and an :class:`Image` that passed it says ``verified``:
the trainer's load then only copies (docs/guarantees.md, "Where the memory tier's bytes are
verified").
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any

from zerostall import envvars
from zerostall.buffers import HostBuffer
from zerostall.commit import committed_steps, parse_step, step_name
from zerostall.errors import ChecksumMismatchError, DirectoryReplacedError, ZerostallError
from zerostall.format.layout import DATA_DIR
from zerostall.format.manifest import parse_manifest
from zerostall.lease import Lease
from zerostall.memtier.imagecheck import cpus, first_bad_leaf
from zerostall.memtier.keeperfail import KeeperFailure, write_marker
from zerostall.memtier.messages import (
    Adopt,
    Closed,
    HeldParityInfo,
    Image,
    ImageFile,
    ImageQuery,
    KeeperBusy,
    KeeperFailed,
    Persisted,
    PersistHeld,
    ReplicaSetup,
)
from zerostall.memtier.paritygroup import HeldParity
from zerostall.memtier.paritypeers import ParityPeers
from zerostall.memtier.peers import Peers
from zerostall.memtier.replica import ReceivedStep
from zerostall.memtier.spec import (
    HELLO_TIMEOUT_S,
    KeeperSpec,
    directory_replaced,
    name_holder,
    peer_credentials,
    peer_pid,
    pid_running,
    root_key,
    silence,
    who,
)
from zerostall.memtier.standin import alive_target, stand_in
from zerostall.messages import (
    Collective,
    LeafRow,
    Message,
    Released,
    SaveJob,
    WireError,
    WriterStats,
    decode,
    encode,
    to_wire,
)
from zerostall.options import RetentionPolicy
from zerostall.persist import faults
from zerostall.persist.collective import CollectiveStep, RankTaken, abort_attempts_except, sweep_aborted_decisions
from zerostall.persist.job import SoloStep, run_save, solo_manifest
from zerostall.persist.server import lower_priority, serve
from zerostall.storage import Storage, open_storage

__all__ = ["Keeper", "MemoryStep", "main"]

#: how long a new keeper keeps trying a name whose holder does not answer (it may be between its
#: bind and its listen, or exiting) before it gives up and tells its trainer the name is held
_BIND_RETRY_S = 5.0
#: the slowest a keeper looks for attempts to abort after its trainer died (a root listing each)
_SCAN_MIN_S = 0.25
#: how often a lingering keeper looks whether its directory still exists (one small read each)
_INSTANCE_POLL_S = 2.0


class MemoryStep:
    """The step of a memory-only save: nothing is written; the manifest is built and kept."""

    applies_retention = False
    writes = False
    #: staging's CRC32Cs are taken, the rest checksummed here: the keeper holds what it verified
    known_crcs: Sequence[int | None] | None = None
    guard: Callable[[], None] | None = None

    def __init__(self, job: SaveJob) -> None:
        self.job = job
        self.manifest_bytes = b""
        self.check_lease: Callable[[], None] = lambda: None  # nothing is leased: nothing is written

    def begin(self) -> None:
        return None

    def data_key(self, file_name: str) -> str:  # pragma: no cover - writes nothing
        return file_name

    def owned(self, views: Any, hash_leaf: Callable[[LeafRow], bool]) -> list[int]:
        return list(range(len(self.job.leaves)))

    def commit(self, written: list[dict[str, Any]], files: list[dict[str, Any]]) -> None:
        self.manifest_bytes = solo_manifest(self.job, written, files, DATA_DIR)

    def fail(self, exc: BaseException) -> BaseException:
        return exc

    def after_commit(self) -> None:
        return None

    def lease_targets(self) -> list[str]:
        return []  # nothing is created under the root

    def retain(self, storage: Storage, policy: RetentionPolicy | None, newest: int | None,
               deleted: list[int]) -> None:
        return None  # retention applies to storage only


class _Held:
    """One complete step in memory: its job, manifest and its own mappings of the staged buffers."""

    def __init__(self, job: SaveJob, manifest: bytes, fds: list[int], sizes: list[int], session: int,
                 persisted: bool) -> None:
        self.job, self.manifest, self.fds, self.sizes = job, manifest, fds, sizes
        self.session, self.persisted = session, persisted
        #: a persist after its trainer died was tried (once: a collective attempt's names are taken)
        self.attempted = False
        #: a persist of it runs now (two never run at once)
        self.persisting = False
        #: threads reading the views (the persist after a crash); close() waits for the last one
        self.users = 0
        self.doomed = False
        self.maps = [mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                     for fd, size in zip(fds, sizes, strict=True)]
        self.views = {f.buffer: memoryview(m) for f, m in zip(job.files, self.maps, strict=True)}
        #: the keeper's check of every leaf after the trainer died (None: never started); set when it ended
        self.checked: threading.Event | None = None
        #: that check ended and every leaf matched (written before ``checked`` is set)
        self.verified = False
        #: the first leaf that did not match, if any
        self.bad_key: str | None = None

    def image(self, with_files: bool = True) -> Image:
        # ``verified`` holds for as long as the keeper holds the step: the trainer that staged
        # these buffers is dead (the check starts only then), a held step's slot is never handed
        # back to a later trainer (Released goes only to the session that staged it), the keeper
        # maps them writable but never writes, and a trainer it sends them to maps them read-only.
        return Image(step=self.job.step, name=self.job.name, manifest=self.manifest.decode(),
                     files=tuple(ImageFile(name=f.name, length=f.length, size=s)
                                 for f, s in zip(self.job.files, self.sizes, strict=True)) if with_files else (),
                     verified=self.verified, persisted=self.persisted)

    def close(self) -> None:
        for v in self.views.values():
            v.release()
        for m in self.maps:
            try:
                m.close()
            except BufferError:  # a failed job's traceback may still reference a slice
                pass
        for fd in self.fds:
            os.close(fd)
        self.views, self.maps, self.fds = {}, [], []


def _share(held: _Held) -> tuple[tuple[str, memoryview], ...] | None:
    """The held step's data files as views of the staged buffers, in the manifest's order (what a
    replica sends and a parity exchange codes); None when the step has no usable manifest."""
    if held.job.step is None:
        return None
    try:
        man = parse_manifest(held.manifest, path=f"memory:{held.job.name}")
    except ZerostallError:
        return None
    by_name = {f.name: f for f in held.job.files}
    files = []
    for mf in man.files:
        f = by_name.get(mf.path.rsplit("/", 1)[-1])
        if f is None:
            return None
        files.append((f.name, held.views[f.buffer][:f.length]))
    return tuple(files)


def _manifest_crcs(held: _Held) -> list[int] | None:
    """The CRC32C of each of ``held.job.leaves`` (in its order) from the held step's manifest;
    None if the manifest does not give one for every leaf (then the persist checksums itself)."""
    try:
        crcs = {lf.key: lf.crc32c for lf in parse_manifest(held.manifest, path=f"memory:{held.job.name}").leaves}
    except ZerostallError:
        return None
    out = [crcs.get(lf.key) for lf in held.job.leaves]
    return None if len(crcs) != len(out) or any(c is None for c in out) else [c for c in out if c is not None]


def _answering(send: Callable[[Message], None], request: int) -> Callable[[Message], None]:
    """``send``, an :class:`Image` marked as the answer to query ``request``."""

    def answer(m: Message) -> None:
        send(dataclasses.replace(m, request=request) if isinstance(m, Image) else m)

    return answer


def _empty_image() -> Image:
    return Image(step=None, name="", manifest="", files=())


class Keeper:
    """The keeper's state across trainer sessions (runs in the writer process)."""

    def __init__(self, address: bytes, spec: KeeperSpec) -> None:
        self.address, self.spec = address, spec
        self._fds: dict[int, tuple[int, int]] = {}  # this session's buffer id -> (dup'ed fd, size)
        self.held: _Held | None = None
        self.session = 0
        self._cond = threading.Condition()
        self._trainer_pid: int | None = None
        self._waiting: Connection | None = None
        self._listener: socket.socket | None = None
        #: the newest collective job of the current session (its run and counter), if any
        self._last_coll: Collective | None = None
        #: the persists of the held step after a trainer died (each runs while the keeper lingers
        #: or serves the next trainer), and their abort scanners
        self._crashes: list[threading.Thread] = []
        self._root_of_run: str | None = None
        #: each dead trainer's collective run, with the thread that persists its step (and its root)
        self._dead_runs: list[tuple[threading.Thread, str, Collective]] = []
        #: the step of this session's newest save that went to storage and is not held (a
        #: persisted collective save: storage has it, memory does not keep it)
        self._stored_step: int | None = None
        self._stop = threading.Event()
        self._scanners: list[threading.Thread] = []
        #: failed persists after a crash that no trainer has been told of yet (see :meth:`take_failed`)
        self._failed: list[KeeperFailure] = []
        #: set by :meth:`listen` when a keeper of this user holds the name: what to tell the trainer
        self.busy: KeeperBusy | None = None
        #: set by :meth:`listen` when this keeper serves but cannot be adopted (the bind failed, or
        #: another user's process holds the name): told to the trainer in its Hello
        self.unadoptable: WireError | None = None
        #: the directory is not the instance this keeper's steps were saved into any more (deleted,
        #: or deleted and created again): nothing is offered, persisted or recorded there; it exits
        self.replaced = False
        #: replication: this keeper's held steps sent to other hosts' keepers, their replicas kept here
        self.peers = Peers(spec.instance)
        #: parity: each held step's XOR parity formed with the keepers of this rank's parity group
        self.parity = ParityPeers()
        #: with replicas: the lease that says this keeper lives (:mod:`zerostall.memtier.standin`)
        self._alive: Lease | None = None

    # -- the listening socket -------------------------------------------------------------

    def listen(self, trainer: Connection | None = None) -> bool:
        """Bind the keeper's name; False if it could not.

        ``trainer`` is the first trainer's connection: it is that trainer's keeper from the
        moment the name is bound, so a claimant arriving before the session starts is refused
        (:class:`KeeperBusy`), never queued. When a keeper of this user holds the name (two
        trainers of one directory and rank started at once, before either keeper existed),
        :attr:`busy` is what to tell ``trainer`` instead of a Hello; a name taken by another
        user (a squatter) leaves :attr:`busy` None: this keeper serves, not adoptable, and
        :attr:`unadoptable` says why (as does any other bind error), for the trainer's Hello.
        """
        silence(1)  # the keeper never prints to stdout; it may outlive whoever reads the trainer's
        if trainer is not None:
            self._trainer_pid = peer_pid(trainer)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + _BIND_RETRY_S
        while True:
            try:
                faults.hit("keeper_bind")
                sock.bind(self.address)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    sock.close()
                    print(f"zerostall keeper: cannot bind its name ({exc}); this one will not be adoptable "
                          "after a crash", file=sys.stderr, flush=True)
                    self.unadoptable = to_wire(exc, path=self.spec.root)
                    return False
            # Who holds it? None: it went, or is not listening yet: try the name again.
            holder = name_holder(self.address)
            if holder is None and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            sock.close()
            if holder == "other":
                print("zerostall keeper: another user's process holds this directory and rank's name; this "
                      "keeper will not be adoptable after a crash", file=sys.stderr, flush=True)
                self.unadoptable = WireError(cls="StorageError", errno=errno.EADDRINUSE, path=self.spec.root,
                                             message=f"its name is held by another user's process ({who(self.address)})")
                return False
            # The trainer hears it instead of a Hello, and raises (see server.main).
            self.busy = holder if isinstance(holder, KeeperBusy) else KeeperBusy(pid=0, pid_is_keeper=True)
            return False
        sock.listen(8)
        self._listener = sock
        threading.Thread(target=self._accept_loop, name="zerostall-keeper-accept", daemon=True).start()
        return True

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            try:
                _, uid, _ = peer_credentials(sock)
            except OSError:
                uid = -1
            if uid != os.getuid():  # only the same user may see or claim the memory
                sock.close()
                continue
            conn = Connection(sock.detach())
            try:
                self._greet(conn)
            except Exception:  # noqa: BLE001 - one bad client must not stop the keeper
                conn.close()

    def _greet(self, conn: Connection) -> None:
        if not conn.poll(HELLO_TIMEOUT_S):
            conn.close()
            return
        msg = decode(conn.recv_bytes())
        if isinstance(msg, ImageQuery):  # a look, not a claim
            with self._cond:
                img = self.held.image(with_files=False) if self.held is not None else _empty_image()
                live = self._trainer_pid is not None and pid_running(self._trainer_pid)
                img = dataclasses.replace(img, trainer_pid=self._trainer_pid if live else None,
                                          instance=self.spec.instance)
            conn.send_bytes(encode(img))
            conn.close()
            return
        if not isinstance(msg, Adopt) or msg.rank != self.spec.rank or root_key(msg.root) != root_key(self.spec.root):
            conn.close()
            return
        with self._cond:
            if self._trainer_pid is not None and pid_running(self._trainer_pid):
                try:  # our trainer lives: a second memory tier of this directory and rank is refused
                    conn.send_bytes(encode(KeeperBusy(pid=self._trainer_pid)))
                finally:
                    conn.close()
                return
            if msg.instance == self.spec.instance and not self.replaced:
                if self._waiting is not None:
                    self._waiting.close()
                self._waiting = conn
                self._cond.notify_all()
                return
        # A trainer of a new directory at this path: what is held here belongs to the deleted one.
        # The name goes first, so that the keeper that trainer starts next can bind it.
        self._directory_gone("a trainer of a new directory at this path claimed it")
        conn.close()

    def _directory_gone(self, why: str) -> None:
        """The directory is not this keeper's instance any more: give up the name, persist and
        record nothing there, and exit once no trainer is served (:meth:`session_ended`)."""
        with self._cond:
            if self.replaced:
                return
            self.replaced = True
            self._cond.notify_all()
        self._release_name()
        print(f"zerostall keeper: {self.spec.root} is no longer the directory its steps were saved into ({why}); "
              "it persists nothing into it and exits", file=sys.stderr, flush=True)

    def _release_name(self) -> None:
        with self._cond:
            listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()

    # -- a session ------------------------------------------------------------------------

    def session_started(self, conn: Connection) -> None:
        pid = peer_pid(conn)
        with self._cond:
            self.session += 1
            self._trainer_pid = pid
        self._last_coll = None  # the new trainer numbers its saves in a run of its own
        self._stored_step = None

    def on_map(self, buffer: int, fd: int, size: int) -> None:
        old = self._fds.pop(buffer, None)
        if old is not None:
            os.close(old[0])
        self._fds[buffer] = (os.dup(fd), size)

    def on_unmap(self, buffer: int) -> None:
        old = self._fds.pop(buffer, None)
        if old is not None:
            os.close(old[0])

    def run(self, job: SaveJob, views: dict[int, memoryview], send: Callable[[Message], None]) -> WriterStats:
        """Run a memory-tier job: persist it if asked, then hold its buffers as the newest step.

        A collective step that persists is written like any collective save and not held
        (its manifest on storage is the ranks' merged one): storage then has the newer step.
        """
        if job.collective is not None:
            self._last_coll, self._root_of_run = job.collective, job.root
        if job.collective is not None and job.persist:
            stats = run_save(job, views, lambda: send(Released(job=job.id)))
            self._drop_held(send)  # storage now has a newer step than memory held
            self._stored_step = job.step
            return stats
        storage = open_storage(job.root)
        step: SoloStep | MemoryStep = SoloStep(job, storage) if job.persist else MemoryStep(job)
        stats = run_save(job, views, lambda: None, step=step)
        fds = [os.dup(self._fds[f.buffer][0]) for f in job.files]
        held = _Held(job, step.manifest_bytes, fds, [self._fds[f.buffer][1] for f in job.files], self.session,
                     persisted=job.persist)
        self._drop_held(send, held)
        tiers: tuple[str, ...] = ("memory", "storage") if job.persist else ("memory",)
        if (self.peers.active and self._hold_alive(job) and self._replicate(held)) or (self.parity.active and self._exchange_parity(held)):
            tiers = ("memory", "peer", "storage") if job.persist else ("memory", "peer")
        return dataclasses.replace(stats, tiers=tiers)

    def handle(self, msg: Message, conn: Connection, send: Callable[[Message], None]) -> bool:
        """A message of the memory tier's own kinds (:mod:`zerostall.memtier.messages`), on the
        writer's loop (so after every job the trainer sent before it); False for any other."""
        if isinstance(msg, ImageQuery):
            answer = _answering(send, msg.request)
            self.send_image(conn, answer, msg.origin, msg.parity)
            self.report_failed(conn)
        elif isinstance(msg, ReplicaSetup):
            self.setup_replicas(msg)
        elif isinstance(msg, PersistHeld):  # the trainer's wait(); it goes on
            self.persist_held(closing=True, timeout_s=msg.timeout_s)
            self.report_failed(conn)
            send(Persisted(request=msg.request, step=self.durable_step()))
        else:
            return False
        return True

    def closing(self, conn: Connection, send: Callable[[Message], None]) -> None:
        """The trainer's clean close: persist the step only memory holds, and say where it is."""
        self.persist_held(closing=True)
        self.report_failed(conn)
        send(Closed(step=self.durable_step()))

    def setup_replicas(self, setup: ReplicaSetup) -> None:
        """The trainer's replication settings (sent after each Hello): see
        :mod:`zerostall.memtier.peers` and :mod:`zerostall.memtier.paritypeers`."""
        self.peers.configure(setup)
        self.parity.configure(setup)

    def _hold_alive(self, job: SaveJob) -> bool:
        """Hold the keeper lease, before the first replica leaves: a holder stands in for this
        rank only once no live lease names it. False (nothing is replicated) if it cannot be written."""
        if self._alive is not None:
            return True
        try:
            self._alive = Lease(open_storage(job.root), [alive_target(self.spec.instance, self.spec.rank)]).acquire()
        except Exception as exc:  # noqa: BLE001 - the save is then in memory only, and says so
            print(f"zerostall keeper: cannot write rank {self.spec.rank}'s keeper lease in {job.root} ({exc}); its "
                  f"step {job.step} is not replicated", file=sys.stderr, flush=True)
            return False
        return True

    def _replicate(self, held: _Held) -> bool:
        """Send the held step to its holders, from the staged buffers; True when every holder verified it."""
        files = _share(held)
        return files is not None and held.job.step is not None and \
            self.peers.send(held.job.step, held.manifest, files)

    def _exchange_parity(self, held: _Held) -> bool:
        """Form the held step's parity with this rank's parity group; True when it holds it."""
        files = _share(held)
        return files is not None and held.job.step is not None and \
            self.parity.exchange(held.job.step, held.manifest, files)

    def _drop_held(self, send: Callable[[Message], None], new: _Held | None = None) -> None:
        """Make ``new`` the held step (the new one first: never a moment without a complete
        step), then give the old one's slot back to its trainer."""
        with self._cond:
            old, self.held = self.held, new
        if old is not None:
            if old.session == self.session:  # its slot may be staged into again
                send(Released(job=old.job.id))
            self._close_held(old)

    def _close_held(self, held: _Held) -> None:
        """Close ``held`` now, or when the persist that reads it finishes."""
        with self._cond:
            if held.users:
                held.doomed = True
                return
        held.close()

    def _use_held(self) -> _Held | None:
        """The held step, reserved against closing until :meth:`_unuse_held`."""
        with self._cond:
            held = self.held
            if held is not None:
                held.users += 1
            return held

    def _unuse_held(self, held: _Held) -> None:
        with self._cond:
            held.users -= 1
            close = held.users == 0 and held.doomed
        if close:
            held.close()

    def send_image(self, conn: Connection, send: Callable[[Message], None], origin: int | None = None,
                   parity: bool = False) -> None:
        if parity:
            self.parity.with_held(lambda p, buf: self._send_parity(conn, send, p, buf))
            return
        if origin is not None:
            faults.hit("keeper_serve_replica")
            self.peers.with_replica(origin, lambda r: self._send_replica(conn, send, r), lend=True)
            return
        held = self.held  # stable: only this thread (the job loop) replaces it
        if held is None:
            send(dataclasses.replace(_empty_image(), replicas=self.peers.held(),
                                     parity_step=self.parity.held_step()))
            return
        if held.checked is not None:
            # The check after a crash is running: it is the pass the trainer would make itself
            # (the same bytes, the same cores), so wait for it rather than do it twice.
            held.checked.wait()
        send(dataclasses.replace(held.image(), replicas=self.peers.held(), parity_step=self.parity.held_step()))
        for fd in held.fds:
            send_handle(conn, fd, 0)

    def _send_parity(self, conn: Connection, send: Callable[[Message], None], p: HeldParity | None,
                     buffer: HostBuffer | None) -> None:
        """The parity ``p`` as an :class:`Image` whose one file is its ``buffer`` (an empty one: none held)."""
        if p is None or buffer is None:
            send(_empty_image())
            return
        info = HeldParityInfo(step=p.step, member=p.member, size=p.layout.group, sizes=p.layout.sizes,
                              manifests=tuple(m.decode() for m in p.manifests))
        send(Image(step=p.step, name=step_name(p.step), manifest="", parity=info,
                   files=(ImageFile(name="parity", length=p.layout.chunk, size=buffer.size),)))
        send_handle(conn, buffer.fd, 0)

    def _send_replica(self, conn: Connection, send: Callable[[Message], None], r: ReceivedStep | None) -> None:
        """The replica ``r`` as an :class:`Image` with its descriptors (an empty one: none held)."""
        if r is None:
            send(_empty_image())
            return
        send(Image(step=r.of.step, name=step_name(r.of.step), manifest=r.manifest.decode(),
                   files=tuple(ImageFile(name=n, length=ln, size=b.size)
                               for n, ln, b in zip(r.names, r.lengths, r.buffers, strict=True))))
        for b in r.buffers:
            send_handle(conn, b.fd, 0)

    def session_ended(self, closed: bool) -> Connection | None:
        """The trainer closed (``closed``) or died. If it died, persist the newest memory-only
        step in the background and linger for a new trainer. Returns the new trainer's
        connection, or None to exit (:meth:`shutdown` waits for the persist first)."""
        with self._cond:
            self._trainer_pid = None
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds = {}
        if not closed and not self.replaced:
            self._start_check()
            self._start_crash_persist()
        if closed or self._listener is None:
            return None
        if not self._crashes:
            # Lingering must not keep the dead trainer's output pipes open: whoever reads them (a
            # launcher, a test) would wait for the keeper to expire. (A persist still running
            # keeps stderr to report a failure, and silences it when done.)
            silence(2)
        deadline = time.monotonic() + self.spec.linger_s
        look = time.monotonic() + _INSTANCE_POLL_S  # whether the directory still exists
        while True:
            with self._cond:
                if self._waiting is not None:
                    conn, self._waiting = self._waiting, None
                    return conn
                now = time.monotonic()
                if self.replaced or now >= deadline:
                    return None
                if now < look:
                    self._cond.wait(min(deadline, look) - now)
                    continue
            look = time.monotonic() + _INSTANCE_POLL_S
            if directory_replaced(self.spec.root, self.spec.instance):
                self._directory_gone("it was deleted")

    def persist_held(self, closing: bool = False, timeout_s: float | None = None) -> None:
        """Write the held step to storage if only memory has it (its trainer closed, died, or asked
        for it in ``wait()``).

        A collective step goes through the collective protocol under the attempt names every
        rank derives from the step's ``(run, counter)``: it commits only if every rank's keeper
        (or, at a clean close, writer) takes part, else it is aborted, bounded by the
        collective ``timeout_s``. Each held step is tried once (an attempt's names are used up).

        When the live trainer asks (``closing``: its clean close or its ``wait()``) a persist after an earlier crash is waited for only if it
        is of this very step; one of an older step (the dead run's, while this trainer saved
        newer ones) neither delays nor blocks this persist, and once this one has stored the
        newest step it is abandoned (:meth:`_abandon_dead_runs`).

        ``timeout_s`` bounds a collective persist below the job's ``timeout_s`` (after a
        preemption notice: the time the notice leaves).
        """
        held = self._use_held()
        stored = self._stored_step  # nothing held: the newest step went to storage with its save
        if held is not None:
            try:
                if closing:
                    self._wait_persisting(held)  # the persist after a crash may be writing this very step
                self._persist(held, closing=closing, timeout_s=timeout_s)
                stored = held.job.step if held.persisted else None
            finally:
                self._unuse_held(held)
        if closing and stored is not None:
            self._abandon_dead_runs(stored)

    def durable_step(self) -> int | None:
        """The held step if it is on storage (None: none held, or not persisted)."""
        held = self.held  # stable: only the job loop's thread, which calls this, replaces it
        return held.job.step if held is not None and held.persisted else None

    def _wait_persisting(self, held: _Held) -> None:
        with self._cond:
            while held.persisting:
                self._cond.wait()

    def _abandon_dead_runs(self, stored: int) -> None:
        """Abort what is left of the dead runs' attempts at steps older than ``stored``.

        Called at the clean close of the trainer that adopted this keeper, once that trainer's
        newest step, ``stored``, is on storage: storage then loses nothing a restart would resume
        from. (An attempt at a newer step, which keepers on other hosts may still commit, is left
        alone.) Aborting it lets the keeper exit now instead of after the dead run's collective
        ``timeout_s`` (its attempt waits for keepers that may be gone with their host); its
        writers (this keeper's persist thread among them) see the decision, remove their parts
        and end. When that step's persist failed, this is not called: the attempt ends on its
        own, bounded by that timeout, and may still store an older step.
        """
        with self._cond:
            runs = [(t, root, coll) for t, root, coll in self._dead_runs if t.is_alive()]
        for _, root, coll in runs:
            reason = f"rank {coll.rank}'s keeper was adopted by a job that has closed with step {stored} stored"
            try:
                abort_attempts_except(open_storage(root), coll.run, None, coll.rank, reason,
                                      only=lambda n: (s := parse_step(n.name)) is not None and s < stored)
            except Exception:  # noqa: BLE001,S110 - the attempt then ends on its own timeout
                pass

    def _claim(self, held: _Held) -> bool:
        """Reserve ``held`` for one persist (False: it is persisted, being persisted, or used up)."""
        with self._cond:  # two persists after crashes may hold the same step: one tries it
            # A solo step whose persist failed is tried again at a clean close (its attempt names
            # are its own); a collective attempt's names are used up, and a step whose bytes
            # changed in memory is never persisted.
            if held.persisted or held.persisting or (
                    held.attempted and (held.job.collective is not None or held.bad_key is not None)):
                return False
            held.persisting = True
            held.attempted = True
            return True

    def _persist(self, held: _Held, closing: bool = False, *, claimed: bool = False,
                 timeout_s: float | None = None) -> None:
        if not claimed and not self._claim(held):
            return
        try:
            self._persist_once(held, closing, timeout_s)
        finally:
            with self._cond:
                held.persisting = False
                self._cond.notify_all()

    def _persist_once(self, held: _Held, closing: bool, timeout_s: float | None = None) -> None:
        job = dataclasses.replace(held.job, persist=True)
        coll = job.collective
        if coll is not None and timeout_s is not None and timeout_s < coll.timeout_s:
            job = dataclasses.replace(job, collective=dataclasses.replace(coll, timeout_s=max(0.1, timeout_s)))
        known: list[int] | None = None
        if held.checked is not None:
            # A leaf the check after the crash found changed since its save is never persisted
            # (not even with the manifest's checksums: storage would then hold a step every load refuses).
            held.checked.wait()
            if held.bad_key is not None:
                print(f"zerostall keeper: not persisting {job.path}: leaf {held.bad_key!r} changed in memory "
                      "after its save", file=sys.stderr, flush=True)
                self._record_failure(job, ChecksumMismatchError(
                    f"leaf {held.bad_key!r} changed in memory after its save; not persisted", path=job.path,
                    key=held.bad_key), closing)
                # A collective step: the other ranks' keepers then abort on the collective timeout.
                # (Deciding "abort" here raced with the sweep of the dead run's abort decisions, which
                # could remove it before a slower rank's keeper had started and seen it.)
                return
            # Every leaf matched its manifest after the trainer died, and nothing writes to these
            # bytes since (see _Held.image): the persist commits the manifest's CRCs instead of a
            # second checksum pass over the same bytes.
            known = _manifest_crcs(held) if held.verified else None
        try:
            faults.hit("keeper_persist")
            # Never into a new directory at the same path: before anything is written, and again
            # right before the commit (the step's check_lease).
            self._check_directory(job, closing)
            storage = open_storage(job.root)
            if held.job.step is not None and held.job.step in committed_steps(storage):
                held.persisted = True
                return
            # A collective step's part yields: a stand-in may have taken it while this keeper hung
            # (its lease lapsed), writing the same step from its verified replica.
            guard = lambda: self._check_directory(job, closing)  # noqa: E731 - one guard, two steps
            run_save(job, held.views, lambda: None,
                     step=SoloStep(job, storage, known_crcs=known, guard=guard) if job.collective is None else
                     CollectiveStep(job, job.collective, storage, yields=True, known_crcs=known, guard=guard))
            held.persisted = True
        except RankTaken:
            print(f"zerostall keeper: rank {self.spec.rank}'s part of {job.path} was taken by a stand-in (this keeper "
                  "did not answer in time); the attempt goes on with it", file=sys.stderr, flush=True)
        except DirectoryReplacedError as exc:
            if closing:  # the live trainer's close() raises it: its newest step is stored nowhere
                self._record_failure(job, exc, closing)
            print(f"zerostall keeper: not persisting {job.path}: {exc.message}", file=sys.stderr, flush=True)
        except BaseException as exc:  # told to the next trainer (report_failed), or left in a marker
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            print(f"zerostall keeper: persisting {job.path}, held only in memory, failed: {exc}",
                  file=sys.stderr, flush=True)
            if envvars.get(envvars.DEBUG):
                traceback.print_exc()
            self._record_failure(job, exc, closing)

    def _check_directory(self, job: SaveJob, closing: bool) -> None:
        """Raise :class:`DirectoryReplacedError` when ``job``'s directory is not this keeper's
        instance any more (after a crash, the keeper then exits: :meth:`session_ended`)."""
        if self.replaced or directory_replaced(job.root, self.spec.instance):
            if not closing and self._trainer_pid is None:
                self._directory_gone("it was deleted")
            raise DirectoryReplacedError(
                f"the directory was deleted after step {job.step} was saved into it (a directory at this path now is "
                f"another one); step {job.step}, held only in memory, belongs to the deleted directory and is not "
                "persisted into the new one", path=job.path)

    # -- failed persists: told to the next trainer, or left in a marker ---------------------------

    def _record_failure(self, job: SaveJob, exc: BaseException, closing: bool = False) -> None:
        with self._cond:
            self._failed.append(KeeperFailure(step=job.step, path=job.path, error=to_wire(exc, path=job.path),
                                              rank=self.spec.rank, time=time.time(), closing=closing))

    def report_failed(self, conn: Connection) -> None:
        """Tell the trainer on ``conn`` of every failed persist not told yet (on the job loop's
        thread, the only one that writes to a trainer). A failure whose message could not be
        sent stays for the next trainer, or the marker at exit."""
        while True:
            with self._cond:
                if not self._failed:
                    return
                f = self._failed[0]
            try:
                conn.send_bytes(encode(KeeperFailed(step=f.step, path=f.path, error=f.error, rank=f.rank,
                                                    closing=f.closing)))
            except OSError:
                return
            with self._cond:
                self._failed.remove(f)

    def _leave_marker(self) -> None:
        """At exit: a failed persist nobody was told of goes to a marker the next trainer (or
        ``zerostall list``) reports (:mod:`zerostall.memtier.keeperfail`)."""
        with self._cond:
            failed, self._failed = self._failed, []
        if not failed:
            return
        if self.replaced or directory_replaced(self.spec.root, self.spec.instance):
            # Failures of the deleted directory's steps: a new directory at the path has no use for them.
            print(f"zerostall keeper: the failed persist of {failed[0].path} is not recorded: its directory was "
                  "deleted", file=sys.stderr, flush=True)
            return
        try:
            storage: Storage | None = open_storage(self.spec.root)
        except Exception:  # noqa: BLE001 - the marker goes to this host instead
            storage = None
        try:
            where = write_marker(storage, self.spec.root, self.spec.rank, failed)
        except OSError as exc:
            print(f"zerostall keeper: could not record the failed persist of {failed[0].path} anywhere: {exc}",
                  file=sys.stderr, flush=True)
            return
        print(f"zerostall keeper: the failed persist of {failed[0].path} is recorded in {where}", file=sys.stderr,
              flush=True)

    # -- after a crash: the check of the held step --------------------------------------------

    def _start_check(self) -> None:
        """Check every leaf of the held step in the background (once per held step: nothing can
        write to it after its trainer died, so a second trainer's death changes nothing)."""
        held = self._use_held()
        if held is None:
            return
        if held.checked is not None:
            self._unuse_held(held)
            return
        held.checked = threading.Event()  # set before session_ended returns: a query waits for it
        threading.Thread(target=self._check, args=(held,), name="zerostall-keeper-check", daemon=True).start()

    def _check(self, held: _Held) -> None:
        assert held.checked is not None
        try:
            faults.hit("keeper_check")
            views = {f.name: held.views[f.buffer] for f in held.job.files}
            held.bad_key = first_bad_leaf(held.manifest, views, cpus(), path=f"memory:{held.job.name}")
            held.verified = held.bad_key is None
            if held.bad_key is not None:  # the restarted trainer's load verifies and names it too
                print(f"zerostall keeper: leaf {held.bad_key!r} of {held.job.name} held in memory does not "
                      "match its checksum", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - not verified: the trainer's load checks it itself
            print(f"zerostall keeper: checking {held.job.name} in memory failed: {exc}", file=sys.stderr, flush=True)
        finally:
            held.checked.set()
            self._unuse_held(held)

    # -- after a crash: the persist, and the aborts of what this rank will never finish ----------

    def _start_crash_persist(self) -> None:
        coll = self._last_coll
        self._last_coll = None
        # The held step is claimed here, before a new trainer's session can start: a close of that
        # trainer waits for this persist only if it is of the step still held then (persist_held).
        held = self._use_held()
        if held is not None and not self._claim(held):
            self._unuse_held(held)
            held = None
        if coll is None and held is None:
            return  # nothing to persist, no run whose attempts could wait for this rank
        # (A previous crash's persist may still run, if an adopted trainer died too: never wait
        # for it here, a restart must not.)
        t = threading.Thread(target=self._after_crash, args=(coll, held), name="zerostall-keeper-persist",
                             daemon=True)
        self._crashes.append(t)
        if coll is not None and self._root_of_run is not None:
            with self._cond:
                self._dead_runs.append((t, self._root_of_run, coll))
        t.start()
        if held is not None and held.job.collective is not None and held.job.step is not None:
            # The replicas held here of the same step: each lost origin's part of this attempt.
            for r in self.peers.pin(held.job.step, held.job.collective.world):
                s = threading.Thread(target=self._stand_in, args=(held.job, r), name="zerostall-keeper-standin",
                                     daemon=True)
                self._crashes.append(s)
                s.start()

    def _stand_in(self, job: SaveJob, replica: ReceivedStep) -> None:
        """Take the part of ``replica``'s origin rank in this keeper's persist of ``job`` once that
        rank's keeper is proven gone (:mod:`zerostall.memtier.standin`)."""
        origin = replica.of.rank
        try:
            stand_in(job, replica, open_storage(job.root), instance=self.spec.instance,
                     holders=self.peers.holders_of(origin), me=self.spec.rank, stop=self._stop,
                     guard=lambda: self._check_directory(job, False),
                     say=lambda m: print(f"zerostall keeper: {m}", file=sys.stderr, flush=True))
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            print(f"zerostall keeper: standing in for rank {origin} to persist {job.path} failed: {exc}",
                  file=sys.stderr, flush=True)
            if not isinstance(exc, DirectoryReplacedError):
                self._record_failure(job, exc)
        finally:
            self.peers.unpin(replica)

    def _after_crash(self, coll: Collective | None, held: _Held | None) -> None:
        """The persist of ``held`` (reserved and claimed for it, or None) after its trainer died,
        and the aborts and sweep of the dead trainer's run ``coll``."""
        settled = threading.Event()  # this rank's part is settled for good: no more aborts needed
        own_done = threading.Event()  # this rank's own attempt has ended (or never started)
        storage = self._run_storage(coll)
        keep: int | None = None  # the one attempt of the dead trainer's run this rank takes part in
        try:
            try:
                if coll is not None and storage is not None:
                    if held is not None:
                        mine = held.job.collective
                        keep = mine.counter if mine is not None and mine.run == coll.run else None
                    scanner = threading.Thread(target=self._abort_others, args=(storage, coll, keep, settled, own_done),
                                               name="zerostall-keeper-abort", daemon=True)
                    self._scanners.append(scanner)
                    scanner.start()
                if held is not None:
                    self._persist(held, claimed=True)
                    if held.persisted:  # committed: every rank took part, no other attempt waits on us
                        settled.set()
            finally:
                own_done.set()
                if held is not None:
                    self._unuse_held(held)
            if coll is not None and storage is not None:
                if not settled.is_set():
                    # One more round now that this rank's attempt is over: the rank that aborted it
                    # did so only once its own attempt was in progress, so this round finds that one.
                    self._abort_round(storage, coll, keep, once_keep_started=False)
                try:
                    sweep_aborted_decisions(storage, coll.run)
                except Exception:  # noqa: BLE001,S110 - gc removes them later
                    pass
        finally:
            silence(2)  # the trainer is dead: nobody reads its stderr any more (see session_ended)

    def _abort_others(self, storage: Storage, coll: Collective, keep: int | None, settled: threading.Event,
                      own_done: threading.Event) -> None:
        """For up to ``coll.timeout_s`` while the keeper lives: abort every attempt of the dead
        trainer's run that this rank will never take part in (any other rank's writer or keeper
        waiting on one), once this rank's own attempt is in progress. Keeps going after this
        rank's own attempt was aborted: a rank whose trainer dies later may still start one of
        another step, and would otherwise wait out its timeout."""
        deadline = time.monotonic() + coll.timeout_s
        while not (self._stop.is_set() or settled.is_set()) and time.monotonic() < deadline:
            self._abort_round(storage, coll, keep, once_keep_started=not own_done.is_set())
            self._stop.wait(max(coll.poll_s, _SCAN_MIN_S))

    def _abort_round(self, storage: Storage, coll: Collective, keep: int | None, *, once_keep_started: bool) -> None:
        reason = f"rank {coll.rank}'s trainer died without this save in its keeper's memory"
        try:
            abort_attempts_except(storage, coll.run, keep, coll.rank, reason, once_keep_started=once_keep_started)
        except Exception:  # noqa: BLE001,S110 - retried next round; the others time out at worst
            pass

    def _run_storage(self, coll: Collective | None) -> Storage | None:
        """The storage of the dead trainer's collective run (None: no run, or it cannot be opened)."""
        if coll is None or self._root_of_run is None:
            return None
        try:
            return open_storage(self._root_of_run)
        except Exception:  # noqa: BLE001 - the persist reports storage failures
            return None

    def _join_crash(self) -> None:
        """Wait for every persist after a crash (each bounded by the collective ``timeout_s``)."""
        while self._crashes:
            self._crashes[0].join()
            self._crashes.pop(0)

    def shutdown(self) -> None:
        """Free everything: the name, the held step, the descriptors. A persist still running
        after a crash is waited for (bounded by the collective ``timeout_s``), with the name
        already given up so that no new trainer waits on this keeper meanwhile."""
        self._release_name()
        self._join_crash()
        self._stop.set()
        for t in self._scanners:  # never exit in the middle of a decision's put
            t.join()
        self._leave_marker()
        self.peers.close()
        self.parity.close()
        if self._alive is not None:
            self._alive.release()
        with self._cond:
            held, self.held = self.held, None
            waiting, self._waiting = self._waiting, None
        if held is not None:
            self._close_held(held)
        if waiting is not None:
            waiting.close()
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds = {}


def main(argv: list[str]) -> int:
    """``python -m zerostall.memtier.keeper FD NICE SCHED <spec>``: the memory tier's keeper, the
    writer of a trainer with a memory tier. It runs the writer's loop (:func:`zerostall.persist.server.serve`)
    for trainer after trainer (adopted after a crash) until it may exit."""
    fd, nice, sched = int(argv[1]), int(argv[2]), argv[3]
    lower_priority(nice, sched)
    address, spec = KeeperSpec.from_argv(argv[4:])
    keeper = Keeper(address, spec)
    first = Connection(fd)
    if not keeper.listen(first) and keeper.busy is not None:
        # Another keeper of this user took the name first (two trainers started at once): a
        # keeper no restart could find would lose this trainer's memory-only steps silently, so
        # tell the trainer (it raises, as when it finds a live keeper) and serve nothing.
        try:
            first.send_bytes(encode(keeper.busy))
        except OSError:
            pass
        first.close()
        return 0
    conn: Connection | None = first
    try:
        while conn is not None:
            keeper.session_started(conn)
            closed = serve(conn, keeper)
            conn = keeper.session_ended(closed)
    finally:
        keeper.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
