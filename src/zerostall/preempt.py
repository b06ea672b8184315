"""Preemption notices: a signal makes the newest memory-only step durable at once, and every rank
saves (and persists) one agreed final step, then stops.

The signal handler only records the signal and writes one byte to a pipe (no lock, no I/O
beyond that write); the pipe is also the process's wakeup fd (``signal.set_wakeup_fd``), to
which Python's C-level handler writes the signal's number at once, even while the main thread
is inside a long C call and the Python handler has to wait for it. A thread of this module reads
the pipe and does the rest:

* **One rank** (no ``torch.distributed``): the final step is the first step after the one the
  training thread last passed to ``should_save``; then the newest memory-only step is persisted.
* **Ranks of a group**: the signalled rank posts a notice to the job's ``torch.distributed`` store.
  A watcher thread on every rank sees it (a blocking store wait, woken by the server), posts the
  step its training thread last passed to ``should_save``, and once every rank has posted, the
  final step is ``max + 1``. A training thread that reaches the step after the one it posted
  waits there until the final step is known, so no rank passes it unknowing; every rank then
  answers ``should_save`` true at the same first step at or after it. Only the ranks' watchers
  take part in the agreement, never a training thread, so a rank blocked in a collective of the
  training step, or seconds behind the others, cannot hold it up; steps with no notice cost one
  uncontended lock, no store round trip.

**No thread holds anything while it waits for another rank.** The immediate persist of the
newest memory-only step is collective (every keeper of the group persists the same step), so the
ranks must agree on a step that no save handed over meanwhile replaces. Each watcher first waits,
holding nothing, for the saves in flight on its rank to end (briefly: a collective save in flight
may need a rank that is seconds behind); then the watchers meet (a barrier of watchers only);
then each holds its training thread's *next* hand-over back (the freeze: local, no lock held
while waiting on others), reads whether its rank is idle and which step only memory holds, and
the watchers exchange those. If every rank is idle with the same step, each sends its keeper the
request to persist it and only then lets its training thread go on: a save handed over after the
request is persisted after that step, never instead of it. The hand-over gate itself is held
only while the training thread hands a save over, and the watcher waits for it briefly, never
while it waits for another rank. Otherwise (a save was in flight on one rank) nothing is persisted
early: the final save, a few steps later, persists a newer step anyway.

**A notice bounds its own waits by the time a preemption leaves** (``grace_s``, measured from the
moment this rank learned of the notice): the agreement, the training thread's wait for it and
the immediate persist's exchanges end within half of it; the immediate persist in the keepers
and the final save's wait for the other ranks end within all of it. Every store request is
bounded (:mod:`zerostall.jobstore`: torch's client waits forever for a store that stops
answering). A rank whose watcher cannot agree in time (a rank cut off or hung) raises
:class:`~zerostall.errors.PreemptionError` at its next ``should_save``, naming the ranks that did
not answer and the step its memory holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import FrameType
from typing import Any

from zerostall.distributed import active
from zerostall.distributed.context import group_rank_world
from zerostall.errors import ArgumentTypeError, InvalidArgumentError, PeerUnreachableError, PreemptionError
from zerostall.jobstore import bounded
from zerostall.options import DistributedOptions

__all__ = ["Preemption", "check_signals", "check_grace", "GRACE_S"]

log = logging.getLogger("zerostall")

#: the default time a preemption leaves (``Checkpointer(preemption_grace_s=...)``): well inside
#: torchrun's 30 s between its SIGTERM and its SIGKILL (``--shutdown-timeout`` /
#: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), so the final save has a third of it to spare
GRACE_S = 20.0
#: the share of the grace the ranks' agreement (and the immediate persist's exchanges) may take
_AGREE_SHARE = 0.5
#: how long a watcher waits, holding nothing, for the saves in flight on its rank before the
#: immediate persist (longer: a collective save in flight waits for a rank behind the others,
#: and the final save makes a newer step durable anyway)
_SETTLE_S = 2.0
#: how long a watcher waits for a hand-over in progress on its own rank (local: staging)
_HANDOVER_S = 1.0
#: how long one wait of the store watcher lasts (it is woken by a notice or by close(), never polls)
_WATCH = timedelta(days=1)
#: signals no process can catch
_UNCATCHABLE = {int(getattr(signal, n)) for n in ("SIGKILL", "SIGSTOP") if hasattr(signal, n)}
_instances = itertools.count()
#: what our handler writes to the pipe (above any signal number the wakeup fd writes)
_WAKE = b"\xff"

Handler = Callable[[int, FrameType | None], Any] | int | None


def check_signals(value: object, *, path: str | None = None) -> tuple[int, ...]:
    """``preemption_signals``: None or a tuple/list of catchable signals (``signal.SIGTERM``, an int)."""
    name = "preemption_signals"
    if value is None:
        return ()
    if not isinstance(value, (tuple, list)):
        raise ArgumentTypeError(f"{name} must be a tuple of signals (e.g. (signal.SIGTERM,)) or None, got "
                                f"{type(value).__name__} {value!r:.60}", argument=name, path=path)
    valid = {int(s) for s in signal.valid_signals()}
    out: list[int] = []
    for s in value:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ArgumentTypeError(f"{name} must hold signals (signal.SIGTERM or an int), got "
                                    f"{type(s).__name__} {s!r:.60}", argument=name, path=path)
        if int(s) not in valid or int(s) in _UNCATCHABLE:
            raise InvalidArgumentError(f"{name}: {s!r} is not a signal this process can catch", argument=name,
                                       path=path)
        if int(s) not in out:
            out.append(int(s))
    return tuple(out)


def check_grace(value: object, *, path: str | None = None) -> float:
    """``preemption_grace_s``: a positive number of seconds."""
    name = "preemption_grace_s"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r:.60}",
                                argument=name, path=path)
    if not 0 < float(value) < float("inf"):
        raise InvalidArgumentError(f"{name} must be > 0 seconds (torchrun's grace is 30 s by default), got {value!r}",
                                   argument=name, path=path)
    return float(value)


class Preemption:
    """One Checkpointer's handling of preemption notices (see the module's docstring).

    Args:
        signals: the signals that are a notice (checked by :func:`check_signals`); the handlers
            are installed here (the main thread only) and the previous ones restored by :meth:`close`.
        path: the Checkpointer's directory, for errors and the store's keys.
        dist: the collective options of the Checkpointer's saves (group, ``timeout_s``).
        grace_s: the time a preemption leaves (:data:`GRACE_S`); every wait a notice adds ends within it.
        idle: whether no save is in flight on this rank (None: no memory tier, no immediate persist).
        held: the step only this host's memory holds (None: none), asked while no save is in flight
            and none is being handed over.
        persist: ``persist(bound_s, sent)`` makes that step durable (the keeper client's
            :meth:`~zerostall.persist.client.WriterClient.persist_held`), its collective part
            bounded by ``bound_s``; it calls ``sent()`` once the request is on its way.
    """

    def __init__(self, signals: tuple[int, ...], *, path: str, dist: DistributedOptions | None,
                 grace_s: float = GRACE_S, idle: Callable[[], bool] | None = None,
                 held: Callable[[], int | None] | None = None,
                 persist: Callable[[float, Callable[[], None]], None] | None = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError("preemption_signals: signal handlers can only be installed from the main "
                                       "thread; create this Checkpointer there", argument="preemption_signals",
                                       path=path)
        self.path = path
        self.grace_s = float(grace_s)
        self._idle, self._held, self._persist = idle, held, persist
        self._lock = threading.Lock()
        self._known = threading.Condition(self._lock)
        self._gate = threading.Lock()  # held by the training thread while it hands a save over
        self._frozen = False  # the next hand-over waits (set by the immediate persist, briefly)
        self._reached = -1  # the last step the training thread passed to should_save
        self._posted: int | None = None  # the step this rank posted for the agreement
        self._final: int | None = None
        self._failed: PreemptionError | None = None
        self._failure_told = False
        self._given = False
        self._closed = False
        #: wall-clock times (time.time()): the first signal; the newest memory-only step durable
        self.signalled_at: float | None = None
        self.held_durable_at: float | None = None
        #: when this rank learned of the notice (time.monotonic(); its own signal or another rank's)
        self._noticed_at: float | None = None
        #: the memory-only step persisted at once (None: none was, or not yet)
        self.held_persisted: int | None = None
        self._rank, self._world, self._prefix = 0, 1, ""
        self._timeout_s = (dist or DistributedOptions()).timeout_s
        self._store: Any = None
        self._watch_client: Any = None
        self._notice_client: Any = None
        if active(dist):
            import torch.distributed as tdist

            group, self._rank, self._world = group_rank_world(dist)
            ranks = tdist.get_process_group_ranks(group) if group is not None else list(range(self._world))
            # a worker group torchrun restarted must not see the notice of the one before it
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
            ident = hashlib.sha1(f"{path}|{ranks}|{attempt}".encode()).hexdigest()[:16]
            self._store = tdist.distributed_c10d._get_default_store()
            # One client per thread (a TCPStore client runs one request at a time, and the
            # watcher's wait would hold up the notice), each request bounded: a store that stops
            # answering must not hold a notice past the grace (zerostall.jobstore).
            self._watch_client, self._notice_client = _clone(self._store, self.grace_s), _clone(self._store, self.grace_s)
            self._prefix = f"zerostall/preempt/{ident}/{next(_instances)}"
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._previous: dict[int, Handler] = {}
        self._signals = frozenset(signals)
        self._noticed = False
        self._wakeup = False
        try:
            for s in signals:
                self._previous[s] = signal.signal(s, self._on_signal)
            # Python's C-level handler writes the signal's number to this fd at once, even while the
            # main thread is inside a long C call (a collective, a kernel) and our handler cannot
            # run yet. One fd per process: one an event loop set up first is left alone (then the
            # notice waits for our handler).
            old = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
            self._wakeup = old == -1
            if not self._wakeup:
                signal.set_wakeup_fd(old)
        except BaseException:
            self._restore()
            os.close(self._rfd)
            os.close(self._wfd)
            raise
        self._threads = [threading.Thread(target=self._read_pipe, name="zerostall-preempt-signal", daemon=True)]
        if self._store is not None:
            self._threads.append(threading.Thread(target=self._watch_store, name="zerostall-preempt-watch",
                                                  daemon=True))
        for t in self._threads:
            t.start()
        _ACTIVE.add(self)

    # -- the time a notice leaves ------------------------------------------------------------

    def _noticed_now(self) -> None:
        with self._lock:
            if self._noticed_at is None:
                self._noticed_at = time.monotonic()

    def _agree_by(self) -> float:
        """When the ranks' agreement (and the immediate persist's exchanges) must have ended."""
        t0 = self._noticed_at if self._noticed_at is not None else time.monotonic()
        return t0 + self.grace_s * _AGREE_SHARE

    def _durable_by(self) -> float:
        """When the final step must be durable (the immediate persist and the final save end by then)."""
        t0 = self._noticed_at if self._noticed_at is not None else time.monotonic()
        return t0 + self.grace_s

    def time_left(self) -> float | None:
        """Seconds until the final step must be durable (None: no notice came)."""
        if self._noticed_at is None:
            return None
        return max(0.0, self._durable_by() - time.monotonic())

    # -- the signal handler (main thread, between bytecodes) -----------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._closed:  # closed off the main thread, or a forked child: behave as the handler we replaced
            self._pass_on(signum, frame, reraise=True)
            return
        if self.signalled_at is None:
            self.signalled_at = time.time()
        with contextlib.suppress(OSError):  # a full pipe already holds a wake-up
            os.write(self._wfd, _WAKE)
        self._pass_on(signum, frame, reraise=False)

    def _pass_on(self, signum: int, frame: FrameType | None, *, reraise: bool) -> None:
        """Chain to the handler installed before ours. A default action (terminate, ignore,
        KeyboardInterrupt) is not chained while armed: it would end the process before the
        final save; once closed, the default is re-delivered as it would have been."""
        prev = self._previous.get(signum)
        if callable(prev) and prev is not signal.default_int_handler:
            prev(signum, frame)
        elif reraise:
            signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
            if prev is signal.default_int_handler:
                raise KeyboardInterrupt
            if prev == signal.SIG_DFL:
                os.kill(os.getpid(), signum)

    # -- the training thread ----------------------------------------------------------------

    def observe(self, step: int) -> bool:
        """Called by ``should_save(step)``: whether ``step`` is the final save (true once, at the
        first step at or after the agreed one). Waits for the agreement only at the step after
        the one this rank posted, if it is not known yet, and no longer than the agreement may
        take (half the grace, from when this rank learned of the notice).

        Raises:
            PreemptionError: the ranks did not agree in time (names the ranks that did not answer).
        """
        with self._lock:
            self._reached = max(self._reached, step)
            if self._failed is not None and not self._failure_told:
                self._failure_told = True
                raise self._failed
            if self._posted is None or self._given:
                return False
            if self._final is None:
                deadline = self._agree_by()
                while self._final is None and self._failed is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._known.wait(left)
            if self._final is None:
                self._failure_told = True
                raise self._failed or PreemptionError(
                    f"a preemption notice arrived, but the ranks did not agree on the final step within "
                    f"{self.grace_s * _AGREE_SHARE:g} s (half of preemption_grace_s={self.grace_s:g}); should_save "
                    f"was at step {step}", path=self.path, rank=self._rank)
            if step < self._final:
                return False
            self._given = True
            return True

    def is_final(self, step: int) -> bool:
        """Whether ``step`` is the final save :meth:`observe` answered (it must persist)."""
        return self._given and self._final is not None and step >= self._final

    @property
    def preempted(self) -> bool:
        """A notice arrived and ``should_save`` has answered true for the final step."""
        return self._given

    @property
    def final_step(self) -> int | None:
        return self._final

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around handing a save over: never while the immediate persist reads which step memory
        holds and asks its keeper to persist it (the freeze; it never lasts past the grace)."""
        while True:
            self._gate.acquire()
            with self._lock:
                if not self._frozen:
                    break
            self._gate.release()
            with self._lock:  # held back only while the watcher reads the step and sends its request
                deadline = self._durable_by()
                while self._frozen and time.monotonic() < deadline:
                    self._known.wait(deadline - time.monotonic())
                if self._frozen:  # the watcher is stuck: never hold training past the grace
                    self._frozen = False
                    log.warning("zerostall: the persist after the preemption notice did not let the save go on "
                                "within preemption_grace_s; handing it over")
        try:
            yield
        finally:
            self._gate.release()

    # -- the threads -------------------------------------------------------------------------

    def _read_pipe(self) -> None:
        while True:
            try:
                got = os.read(self._rfd, 64)
            except OSError:
                return
            if not got or self._closed:
                return
            if self._noticed or not any(b in self._signals or b == _WAKE[0] for b in got):
                continue  # another signal Python handles (the wakeup fd carries them all), or a repeat
            self._noticed = True
            self._noticed_now()
            if self.signalled_at is None:
                self.signalled_at = time.time()
            if self._store is None:
                self._agree_alone()
                return
            try:
                self._notice_client.set(f"{self._prefix}/notice", str(self._rank))
                # wakes every rank's watcher (the store server notifies its wait), in one request
                self._notice_client.multi_set([self._wake(r) for r in range(self._world)],
                                              [str(self._rank)] * self._world)
            except Exception as exc:  # noqa: BLE001 - the store is gone or cut off: told on the training thread
                self._fail(f"could not post the preemption notice to the job's store ({exc}); no other rank "
                           f"heard of it{self._holding()}")
                return
            log.warning("zerostall: rank %d got a preemption signal; told the other ranks", self._rank)

    def _agree_alone(self) -> None:
        with self._lock:
            self._posted = self._reached
            self._final = self._reached + 1
            self._known.notify_all()
        log.warning("zerostall: preemption signal: the final save is at step %d", self._final)
        self._persist_now(None)

    def _watch_store(self) -> None:
        """Wait on this rank's wake key, set by a notice (every rank's) or by this rank's close()."""
        store = self._watch_client
        assert store is not None
        while True:
            try:
                store.wait([self._wake(self._rank)], _WATCH)
            except Exception as exc:  # noqa: BLE001 - the store went away: no notice can reach this rank now
                if not self._closed:
                    log.info("zerostall: the preemption watcher stops: the job's store failed: %s", exc)
                return
            if self._closed:
                return
            try:
                if store.check([f"{self._prefix}/notice"]):
                    break
            except Exception as exc:  # noqa: BLE001 - as above
                if not self._closed:
                    log.info("zerostall: the preemption watcher stops: the job's store failed: %s", exc)
                return
        self._noticed_now()
        try:
            self._agree(store)
        except Exception as exc:  # noqa: BLE001 - told on the training thread
            self._fail(f"the ranks could not agree on the final step after a preemption notice: {exc}"
                       f"{self._holding()}")

    def _agree(self, store: Any) -> None:
        with self._lock:
            self._posted = self._reached
        reached = self._exchange(store, "reached", self._posted)
        with self._lock:
            self._final = max(int(r) for r in reached if r is not None) + 1
            self._known.notify_all()
        if self._rank == 0:
            log.warning("zerostall: preemption notice: the %d ranks save step %d last", self._world, self._final)
        try:
            self._persist_now(store)
        except Exception as exc:  # noqa: BLE001 - the final save still makes a newer step durable
            log.warning("zerostall: the ranks did not persist their memory-only step after the preemption "
                        "notice (the final save will): %s", exc)

    def _wake(self, rank: int) -> str:
        return f"{self._prefix}/wake/{rank}"

    def _exchange(self, store: Any, what: str, value: Any) -> list[Any]:
        """Post ``value`` and return every rank's, in rank order, by the agreement's deadline.

        Raises:
            PeerUnreachableError: a rank did not post in time (it is named), or the store did not answer.
        """
        keys = [f"{self._prefix}/{what}/{r}" for r in range(self._world)]
        try:
            store.set(keys[self._rank], json.dumps(value))
        except Exception as exc:
            raise PeerUnreachableError(f"the job's store did not answer ({exc})", path=self.path,
                                       rank=self._rank) from exc
        left = self._agree_by() - time.monotonic()
        try:
            if left <= 0:
                raise PeerUnreachableError("no time left")
            store.wait(keys, timedelta(seconds=left))
        except Exception as exc:  # the wait timed out (a rank cut off, hung), or the store did not answer
            missing = self._missing(store, keys)
            err = PeerUnreachableError(
                f"rank(s) {missing} did not answer within {self.grace_s * _AGREE_SHARE:g} s (half of "
                f"preemption_grace_s): cut off, hung or gone" if missing else
                f"the job's store did not answer ({exc})", path=self.path, rank=self._rank,
                ranks=tuple(missing))
            with contextlib.suppress(Exception):  # a rank that answers late must not go on alone
                store.set(f"{self._prefix}/failed", f"rank {self._rank}: {err.message}")
            raise err from exc
        failed = f"{self._prefix}/failed"
        try:
            gave_up = store.check([failed])  # every rank answered, but one gave up waiting first
            why = bytes(store.get(failed)).decode(errors="replace") if gave_up else ""
            values = [] if gave_up else store.multi_get(keys)
        except Exception as exc:
            raise PeerUnreachableError(f"the job's store did not answer ({exc})", path=self.path,
                                       rank=self._rank) from exc
        if gave_up:
            raise PeerUnreachableError(f"another rank gave up the agreement ({why})", path=self.path, rank=self._rank)
        return [json.loads(v) for v in values]

    @staticmethod
    def _missing(store: Any, keys: list[str]) -> list[int]:
        """The ranks whose key is absent (empty: the store itself did not answer)."""
        try:
            return [r for r, k in enumerate(keys) if not store.check([k])]
        except Exception:  # noqa: BLE001 - the store is unreachable: no rank can be named
            return []

    def _holding(self) -> str:
        """What this rank's memory holds, for a failure's message."""
        if self._idle is None or self._held is None:
            return ""
        try:
            step = self._held()
        except Exception:  # noqa: BLE001 - the keeper is gone: nothing to say
            return ""
        if step is None:
            return ""
        return (f"; this rank's memory holds step {step}, which its keeper persists with the other ranks' keepers "
                "once the job's trainers have ended")

    def _persist_now(self, store: Any | None) -> None:
        """Persist the newest memory-only step if every rank is idle and holds it only in memory.

        ``store`` None: one rank. Otherwise the watchers meet first (none waits for a save in
        flight once another has frozen its rank), then each freezes its rank's next hand-over,
        reads, and exchanges; see the module's docstring. Nothing here holds the gate, or keeps
        its rank frozen, while it waits for another rank.
        """
        if self._idle is None or self._held is None or self._persist is None:
            return
        settle_by = min(time.monotonic() + _SETTLE_S, self._agree_by())
        while not self._idle() and time.monotonic() < settle_by:  # holding nothing
            time.sleep(0.005)
        if store is not None:
            self._exchange(store, "settled", True)
        with self._lock:
            self._frozen = True
        try:
            held: int | None = None
            if self._gate.acquire(timeout=_HANDOVER_S):  # a hand-over in progress: local, short
                try:
                    held = self._held() if self._idle() else None
                finally:
                    self._gate.release()
            step = held if store is None else _common(self._exchange(store, "held", held))
            if step is None or step != held:
                return
            bound = self._durable_by() - time.monotonic()
            try:
                self._persist(bound, self._unfreeze)
            except Exception as exc:  # noqa: BLE001 - the keeper's failure is also in keeper_failures
                log.warning("zerostall: persisting step %s after the preemption signal failed: %s", step, exc)
                return
            self.held_persisted, self.held_durable_at = step, time.time()
            log.warning("zerostall: preemption: step %d, held only in memory, is on storage", step)
        finally:
            self._unfreeze()

    def _unfreeze(self) -> None:
        with self._lock:
            if self._frozen:
                self._frozen = False
                self._known.notify_all()

    def _fail(self, why: str) -> None:
        with self._lock:
            self._failed = PreemptionError(why, path=self.path, rank=self._rank)
            self._known.notify_all()
        log.error("zerostall: %s", why)

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Restore the handlers installed before (from the main thread; elsewhere ours stays and
        behaves as the previous one) and stop the threads."""
        if self._closed:
            return
        self._closed = True
        _ACTIVE.discard(self)
        if self._gate.acquire(timeout=_HANDOVER_S):  # a hand-over a watcher is reading ends first
            self._gate.release()
        restored = self._restore()
        with contextlib.suppress(OSError):
            os.write(self._wfd, b"c")
        if self._store is not None and self._threads[-1].is_alive():
            if self._noticed_at is not None:  # the agreement or the immediate persist runs: each ends by the grace
                self._threads[-1].join(timeout=self.time_left())
            with contextlib.suppress(Exception):  # the store is gone: so is the watcher's wait
                self._notice_client.set(self._wake(self._rank), "closed")
        elif self._store is None and self._noticed_at is not None and self._threads[0] is not threading.current_thread():
            self._threads[0].join(timeout=self.time_left())  # the immediate persist of one rank
        t = self._threads[0]
        if t is not threading.current_thread():
            t.join(timeout=5.0)
        if restored and not t.is_alive():  # else our handler may still write to the pipe
            os.close(self._rfd)
            os.close(self._wfd)

    def _forget_in_child(self) -> None:
        """In a child forked from this process (a DataLoader worker, say): the signal is not a
        notice to it, and must never wake this process's threads through the inherited pipe (the
        wakeup fd): the previous handlers and wakeup fd come back, the pipe is closed."""
        self._closed = True
        if self._restore():
            os.close(self._rfd)
            os.close(self._wfd)

    def _restore(self) -> bool:
        """Put the previous handlers back (False: not on the main thread, or a later handler chains to ours)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        ours = True
        if self._wakeup:
            current = signal.set_wakeup_fd(-1)
            if current != self._wfd:  # set by someone after us: theirs stays, and may still write to ours
                signal.set_wakeup_fd(current)
                ours = False
            self._wakeup = False
        for s, prev in self._previous.items():
            if signal.getsignal(s) == self._on_signal:
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            else:  # a handler installed after ours stays, and may call ours
                ours = False
        return ours


def _common(held: list[int | None]) -> int | None:
    """The step every rank holds only in memory, or None if they differ (or one holds none)."""
    first = held[0]
    return first if first is not None and all(h == first for h in held) else None


def _clone(store: Any, bound_s: float) -> Any:
    """A client of ``store`` of its own, each request bounded by ``bound_s`` (a wait by its own
    timeout): see :mod:`zerostall.jobstore`."""
    return bounded(store.clone, bound_s, what="the job's store")


#: the Preemptions with handlers installed, for the fork hook below
_ACTIVE: weakref.WeakSet[Preemption] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for p in list(_ACTIVE):
        p._forget_in_child()
    _ACTIVE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
