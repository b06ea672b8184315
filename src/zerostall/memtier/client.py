"""The trainer's side of its keeper: what a keeper is beyond the trainer's writer.

The keeper is the writer process of a trainer with a memory tier (:mod:`zerostall.memtier.keeper`).
The trainer talks to it through an ordinary :class:`~zerostall.persist.client.WriterClient`, to
which :class:`KeeperSide` is the side (:class:`~zerostall.persist.client.WriterSide`): it adopts a
lingering keeper instead of starting one, tells every keeper the job's replication settings, keeps
the slot of the step the keeper holds until the keeper lets go of it (and keeps it longer while a
load reads it: :meth:`KeeperSide.pin_held`), asks for the held step's image and for its persist,
and hears of the keeper's failed persists, of a keeper that cannot be adopted, of one whose place
another trainer's keeper took, and of a keeper that ended while only it held the newest step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from zerostall.errors import InvalidArgumentError, KeeperLostError, KeeperPersistError, ZerostallError
from zerostall.memtier.keeperfail import KeeperFailure, UnadoptableKeeper, as_error
from zerostall.memtier.messages import (
    Closed,
    Image,
    ImageQuery,
    KeeperBusy,
    KeeperFailed,
    Persisted,
    PersistHeld,
    ReplicaSetup,
)
from zerostall.memtier.spec import KeeperSpec, adopt, busy_error
from zerostall.messages import Hello, Message, SaveJob
from zerostall.options import WriterKind
from zerostall.persist.client import WriterClient

__all__ = ["KeeperSide"]

log = logging.getLogger("zerostall")


class KeeperSide:
    """The keeper of ``spec`` (this trainer's directory and rank), as its trainer's writer client sees it."""

    #: the keeper holds the newest in-memory step's slot until a newer one is in memory: one more
    #: slot than in flight, so a save never waits for the held one
    held_slots = 1

    def __init__(self, spec: KeeperSpec) -> None:
        self.keeper = spec
        self._client: WriterClient | None = None
        self._lock = threading.Lock()
        #: memory-tier jobs done but whose buffers the keeper still holds: job id -> release
        self._held: dict[int, Callable[[], None]] = {}
        #: loads from memory in progress (:meth:`pin_held`), and the slots the keeper let go of
        #: meanwhile, handed back for staging only when the last of those loads has ended
        self._pins = 0
        self._deferred: list[Callable[[], None]] = []
        self._image_waiter: tuple[int, list[tuple[Image, list[int]] | None]] | None = None
        self._image_event = threading.Event()
        self._query_lock = threading.Lock()
        #: the keeper's failed persists of memory-only steps it reported (oldest first); see
        #: :attr:`zerostall.Checkpointer.keeper_failures`
        self.keeper_failures: list[KeeperPersistError | UnadoptableKeeper] = []
        #: those of them that a persist this trainer asked for itself (its clean close, or
        #: :meth:`persist_held`) reported; each is raised once, by whichever asked
        self.close_failures: list[KeeperPersistError] = []
        #: the keeper's answers to :meth:`persist_held`: request number -> the step it said is stored
        self._persisted: dict[int, int | None] = {}
        self._persisted_event = threading.Condition()
        #: the newest memory-tier save done, if only memory holds it (None once a newer one persisted):
        #: the step a clean close must see stored (:meth:`closed`)
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
        #: replication settings the keeper is told after each Hello (a new or adopted keeper)
        self.replica_setup: ReplicaSetup | None = None

    @property
    def client(self) -> WriterClient:
        assert self._client is not None, "KeeperSide is used through the WriterClient it was given to"
        return self._client

    # -- the seam (persist.client.WriterSide) ----------------------------------------------------

    def attach(self, client: WriterClient) -> None:
        self._client = client

    def command(self) -> list[str]:
        return ["-m", "zerostall.memtier.keeper", *self.keeper.argv()]

    def adopt(self) -> tuple[Connection, Hello] | None:
        return adopt(self.keeper)

    def connected(self) -> None:
        self._tell_replica_setup()

    def on_hello(self, hello: Hello) -> None:
        if hello.unadoptable is not None:
            self._note_unadoptable(hello)

    def on_message(self, msg: Message, conn: Connection) -> bool:
        if isinstance(msg, KeeperBusy):  # our keeper lost the name to another trainer's; it exits
            self._busy = busy_error(self.keeper, msg)
            self.client.mark_ready()
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
        else:
            return False
        return True

    def done(self, job: SaveJob, release: Callable[[], None] | None) -> bool:
        if not job.memory:
            return False
        self._memory_only = None if job.persist else job
        if release is None:
            return False
        with self._lock:  # the keeper holds this step's buffers until a newer step is in memory
            self._held[job.id] = release
        return True

    def on_released(self, job_id: int) -> None:
        with self._lock:
            hold = self._held.pop(job_id, None)
            if hold is not None and self._pins:  # a load may be reading that slot: not yet
                self._deferred.append(hold)
                hold = None
        if hold is not None:
            hold()

    def refusal(self) -> ZerostallError | None:
        busy, self._busy = self._busy, None
        return busy

    def failing(self) -> ZerostallError | None:
        return self._busy  # the keeper never served: nothing was saved

    def ended(self, closing: bool) -> None:
        if not closing:
            self._note_lost()  # the keeper died under a live trainer: told now, raised by close()
        with self._persisted_event:
            self._persisted_event.notify_all()
        self._image_reply(None)
        self._release_held()

    def closing(self) -> None:
        self._durable = None

    def closed(self) -> None:
        self._check_stored_at_close()
        self._release_held()

    def abandoned(self) -> None:
        self._memory_only = None  # left to the keeper for a restart: no close() will ask for it
        self._release_held()

    def forked(self) -> None:
        self._held = {}
        self._pins = 0
        self._deferred = []
        self._busy = None
        self._unadoptable = []
        self._image_waiter = None
        self._image_event = threading.Event()
        self._query_lock = threading.Lock()
        self._lock = threading.Lock()

    # -- replication ----------------------------------------------------------------------------

    def _tell_replica_setup(self) -> None:
        if self.replica_setup is not None:
            try:
                self.client.send(self.replica_setup)
            except OSError:
                pass  # the keeper is gone: the next start tells the next one

    def set_replica_setup(self, setup: ReplicaSetup) -> None:
        """Tell the keeper (now, and every keeper started or adopted later) how to replicate."""
        self.replica_setup = setup
        if self.client.alive():
            self._tell_replica_setup()

    # -- the held step's slots ------------------------------------------------------------------

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

    # -- what only memory holds -----------------------------------------------------------------

    def _note_lost(self) -> KeeperLostError | None:
        """The keeper has ended: if it held the newest step this trainer saved and only memory had
        it, that step is lost. Logged and listed once (:attr:`keeper_failures`); returned for
        :meth:`closed` to raise (None: nothing was lost)."""
        job = self._memory_only
        if job is None:
            return None
        if self._lost is not None and self._lost[0] == job.step:
            return self._lost[1]
        pid = self.client.pid
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
        if job is None or self._durable == job.step:
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
        is collective: every rank's trainer must call this (it is the persist of a close).

        ``timeout``: return after about this many seconds even if the keeper has not answered
        (the persist goes on; a later call, or close(), waits for it again). ``bound_s`` bounds
        a collective step's persist in the keepers below the job's ``timeout_s``. ``sent()`` is
        called once the request is on its way (or there is nothing to ask): a save handed over
        after it is persisted after this step, never instead of it.

        Raises:
            KeeperPersistError: the persist failed (its ``cause`` says why; the step is still in
                this host's memory, and the close tries again unless the step is collective).
            KeeperLostError: the keeper ended without storing the step: it is lost.
        """
        job = self._memory_only
        client = self.client
        if job is None or client.kind is not WriterKind.PROCESS:
            if sent is not None:
                sent()
            return
        told = len(self.close_failures)
        request = next(client.requests)
        try:
            client.send(PersistHeld(request=request, timeout_s=bound_s))
        except OSError:  # no keeper to ask: its listener saw it end
            request = 0
        finally:
            if sent is not None:
                sent()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._persisted_event:
            while request and request not in self._persisted and client.listening():
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
        if request and client.listening():
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

    # -- failures -------------------------------------------------------------------------------

    def note_keeper_failure(self, failure: KeeperFailure) -> KeeperPersistError:
        """Record a failed persist of the keeper (from its message or a marker) and log it."""
        err = as_error(failure)
        self.keeper_failures.append(err)
        log.warning("zerostall: %s", err)
        return err

    def _note_unadoptable(self, hello: Hello) -> None:
        """Our keeper serves but cannot be adopted: list it with the keeper failures, and keep it
        for the training thread to warn of (:meth:`take_unadoptable`)."""
        assert hello.unadoptable is not None
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

    # -- the held step's image ------------------------------------------------------------------

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
                    origin: int | None = None, parity: bool = False) -> tuple[Image, list[int]] | None:
        """The keeper's newest in-memory step and one descriptor per data file (the caller
        closes them); None when the keeper is not running, or does not answer within ``timeout``.

        ``origin``: the replica this keeper holds of rank ``origin``'s step instead. ``parity``:
        the parity it holds instead (:attr:`Image.parity`; its one descriptor is the parity's buffer).
        Answered after every job submitted before the call has finished. ``start=False``: None
        rather than starting a keeper that is not running (a background query must not start
        a keeper after the Checkpointer closed).
        """
        client = self.client
        if client.kind is not WriterKind.PROCESS:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        # another thread's query may be waiting for a keeper that hung: never past our own timeout
        if not self._query_lock.acquire(timeout=-1 if timeout is None else timeout):
            return None
        try:
            if not start and (not client.alive() or client.closing_now):
                return None
            try:
                client.start()
            except ZerostallError:
                return None
            box: list[tuple[Image, list[int]] | None] = []
            request = next(client.requests)
            self._image_event.clear()
            self._image_waiter = (request, box)
            try:
                client.send(ImageQuery(origin=origin, parity=parity, request=request))
            except OSError:
                self._image_waiter = None
                return None
            if not self._image_event.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                self._image_waiter = None
                return None
            return box[0] if box else None
        finally:
            self._query_lock.release()
