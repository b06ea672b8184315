"""A keeper's part in replication: each held step sent to the keepers of other hosts, and the
newest replica of each of their ranks' steps kept here.

The trainer configures it (:class:`~zerostall.messages.ReplicaSetup`: the job's keeper group,
its secret, the world's layout). Then, for every step the keeper holds, :meth:`Peers.send`
offers it to each holder (:func:`~zerostall.memtier.placement.replica_holders`) through the
job's store and sends it over the pair's authenticated :class:`ReplicaGroup`: straight from the
staged buffers, on the keeper's job loop, never on the training thread. A pair (origin, holder)
forms its group once, at its first offer, and keeps it for every later step while its transfers
succeed (a group costs a store rendezvous and gloo's connections; a step, only its bytes and a
handshake). A receiver thread per origin rank
(:func:`~zerostall.memtier.placement.replica_origins`) waits on the store for that rank's next
offer to this keeper (the store answers when it is set: no polling), receives each step into
shared memory, verified leaf by leaf against the CRC32Cs of its manifest, and keeps only the
newest one of each origin rank (the one being received is the only other copy). The buffers of
the replica a newer one replaced are kept to receive the next step into: faulting in, zeroing
and freeing fresh memory for every step cost a keeper more CPU than the transfer itself, and the
one being received needs that memory anyway (the holder's peak is the same). A replica is
identified by the directory's instance, the world size, the origin rank and the step
(:class:`ReplicaOf`); one that fails any check is never kept.

A holder that failed (dead, refused, silent past ``timeout_s``) is not offered more steps until
the next setup (a restarted job): saves do not wait ``timeout_s`` each for a dead host. Both ends
of a failed transfer drop the pair's group; the receiver forms a new one at the next offer, named
by that offer's number, as the sender does (after a new setup).
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from zerostall.buffers import HostBuffer
from zerostall.errors import ZerostallError
from zerostall.jobstore import bounded
from zerostall.lease import host_id
from zerostall.memtier.messages import HeldReplica, ReplicaSetup
from zerostall.memtier.placement import replica_holders, replica_origins
from zerostall.memtier.replica import OutgoingStep, ReceivedStep, ReplicaGroup, ReplicaOf

__all__ = ["Peers", "open_store", "pair_group", "SENDER", "RECEIVER"]

#: member ids of the two ends of a pair formation
SENDER, RECEIVER = 0, 1
#: how long one wait for the next offer lasts (a stop sets the awaited key: no wake-ups; a wait
#: that times out is logged by torch, so it must be rare)
_OFFER_WAIT = timedelta(hours=24)
#: pause after a store request that failed at once (the store is gone or restarting)
_STORE_RETRY_S = 0.25
#: what a stop puts under the offer key a receiver waits on
_STOP_OFFER = json.dumps({"stop": True})
#: store requests in a row that fail at once before the receiver takes the store for gone (the job ended)
_STORE_TRIES = 3


def open_store(setup: ReplicaSetup) -> Any:
    """A client of the job's store, prefixed for this job's replicas, every request bounded by
    the job's ``timeout_s`` (:mod:`zerostall.jobstore`: torch's client waits forever for a store
    that stops answering). It connects at its first request."""
    import torch.distributed

    dist: Any = torch.distributed  # its store classes are not in its stubs' exports
    host, _, port = setup.store.rpartition(":")
    return bounded(lambda: dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=setup.timeout_s)),
                   setup.timeout_s, what=f"the job's store at {setup.store}", prefix=f"zerostall-replicas/{setup.job}")


def pair_group(store: Any, setup: ReplicaSetup, name: str, generation: int, member: int) -> ReplicaGroup:
    """The two-member group of one transfer (``name`` and ``generation`` name it in the store)."""
    return ReplicaGroup(store, job_id=setup.job, secret=bytes.fromhex(setup.secret), member=member, size=2,
                        host=host_id(), group=name, generation=generation, timeout_s=setup.timeout_s)


class Peers:
    """Replication for the keeper of ``instance`` (the directory's instance id)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self._lock = threading.Lock()
        self._setup: ReplicaSetup | None = None
        self._store: Any = None
        self._dead: set[int] = set()
        #: holder rank -> the pair group this keeper sends its steps to it over
        self._links: dict[int, ReplicaGroup] = {}
        #: a send is running (on the keeper's job loop); groups a new setup replaced meanwhile
        self._sending = False
        self._stale: list[ReplicaGroup] = []
        self._unreachable = False
        #: origin rank -> the newest replica of its step held here
        self._kept: dict[int, ReceivedStep] = {}
        #: origin rank -> the buffers of its replaced replica, to receive its next step into
        self._spare: dict[int, list[HostBuffer]] = {}
        #: replicas a stand-in persist reads (id -> users); one replaced or dropped meanwhile is
        #: closed when its last user is done
        self._pins: dict[int, int] = {}
        self._doomed: set[int] = set()
        self._closed = False
        self._stop = threading.Event()
        self._receivers: list[threading.Thread] = []
        #: origin -> the offer number its receiver waits for next (published before it checks
        #: whether to stop, so a stop that reads it wakes the wait)
        self._waiting: dict[int, int] = {}

    @property
    def active(self) -> bool:
        return self._setup is not None and self._setup.replicas > 0

    def configure(self, setup: ReplicaSetup) -> None:
        """Join the job ``setup`` names (a new job replaces the old one's receiver; the replicas
        already held stay: they are identified by the directory, world, rank and step). The same
        setup again (told after each Hello) changes nothing: its receivers and groups go on."""
        if setup == self._setup and (self._receivers or setup.replicas <= 0):
            return
        self._halt_receiver()
        self._drop_links(setup)
        if setup.replicas <= 0:
            return
        # Imported here, on the keeper's message loop, not by the receivers' threads: the trainer's
        # next request is answered only once this is done (see MemorySide.setup_replicas).
        # In the threads it ran beside the trainer's restore that followed and slowed it by more
        # than the import's own second of CPU (the GIL, and the cores).
        import torch.distributed  # noqa: F401

        self._stop, self._waiting = threading.Event(), {}
        for origin in replica_origins(setup.rank, setup.world, setup.ranks_per_host, setup.replicas):
            t = threading.Thread(target=self._receive_loop, args=(setup, origin, self._stop, self._waiting),
                                 name=f"zerostall-keeper-replicas-{origin}", daemon=True)
            t.start()
            self._receivers.append(t)

    def _halt_receiver(self) -> None:
        """Tell the receivers to stop after what they are doing; never waits for them (a receive
        in progress ends within ``timeout_s``, and must not delay an adopting trainer's first job).
        A receiver waiting on the store for its next offer is woken by a stop marker put under that
        offer's key (unless the offer came first), from a thread of its own: the store may be gone."""
        self._stop.set()
        setup, waiting = self._setup, dict(self._waiting)
        self._receivers = []
        if setup is None or setup.replicas <= 0 or not waiting:
            return

        def wake() -> None:
            # a store that is gone ends its receivers' waits itself
            with contextlib.suppress(Exception):
                store = open_store(setup)
                for origin, n in waiting.items():
                    store.compare_set(f"offer/{origin}-{setup.rank}/{n}", "", _STOP_OFFER)

        threading.Thread(target=wake, name="zerostall-keeper-replicas-stop", daemon=True).start()

    def _drop_links(self, setup: ReplicaSetup | None) -> None:
        """Close the sending groups of the job set up so far (one a send is using is closed when
        that send ends) and start ``setup``'s (None: the end)."""
        with self._lock:
            links, self._links = self._links, {}
            if setup is not None:
                self._setup, self._store, self._dead, self._unreachable = setup, None, set(), False
            if self._sending:
                self._stale.extend(links.values())
                return
        for g in links.values():
            g.close()

    # -- sending --------------------------------------------------------------------------

    def send(self, step: int, manifest: bytes, files: tuple[tuple[str, memoryview], ...]) -> bool:
        """Send this keeper's ``step`` to each of its holders; True when every one verified it."""
        with self._lock:
            setup, links, dead = self._setup, self._links, self._dead
            if setup is None or setup.replicas <= 0:
                return False
            self._sending = True
        try:
            return self._send(setup, links, dead, step, manifest, files)
        finally:
            with self._lock:
                self._sending = False
                stale, self._stale = self._stale, []
            for g in stale:
                g.close()

    def _send(self, setup: ReplicaSetup, links: dict[int, ReplicaGroup], dead: set[int], step: int,
              manifest: bytes, files: tuple[tuple[str, memoryview], ...]) -> bool:
        """:meth:`send` for the job ``setup`` (its groups ``links``, its failed holders ``dead``)."""
        store = self._store
        if store is None:
            if self._unreachable:
                return False
            try:
                store = open_store(setup)
            except Exception as exc:  # noqa: BLE001 - the save is then in memory only, and says so
                self._unreachable = True  # not tried again (a timeout each) until the next setup
                _say(f"cannot reach the job's store {setup.store} to replicate step {step}: {exc}; no step is "
                     "replicated until the job restarts")
                return False
            with self._lock:
                if self._setup is setup:
                    self._store = store
        out = OutgoingStep(of=ReplicaOf(self.instance, setup.world, setup.rank, step), manifest=manifest,
                           files=files)
        ok = True
        for h in replica_holders(setup.rank, setup.world, setup.ranks_per_host, setup.replicas):
            if h in dead:
                ok = False
                continue
            try:
                # The offer and the pair's formation end within timeout_s together, whatever
                # the store or the holder does (cut off, stopped); the transfer's own waits are
                # each bounded by it too (a cut mid-transfer ends at the first piece it stalls).
                store.deadline = time.monotonic() + setup.timeout_s
                n = int(store.add(f"offers/{setup.rank}-{h}", 1))
                store.set(f"offer/{setup.rank}-{h}/{n}", json.dumps({"step": step}))
                g = links.get(h)
                if g is None:  # the pair's first offer: both ends form its group, named by it
                    g = links[h] = pair_group(store, setup, f"pair/{setup.rank}-{h}", n, SENDER)
                store.deadline = None
                g.send_step(RECEIVER, out)
            except (ZerostallError, RuntimeError, OSError) as exc:
                store.deadline = None
                dead.add(h)
                dropped = links.pop(h, None)
                if dropped is not None:
                    dropped.close()
                ok = False
                _say(f"rank {setup.rank}'s step {step} is not replicated on rank {h}'s keeper ({exc}); that "
                     "holder is not offered more steps until the job restarts")
        return ok

    # -- receiving ------------------------------------------------------------------------

    def _receive_loop(self, setup: ReplicaSetup, origin: int, stop: threading.Event,
                      waiting: dict[int, int]) -> None:
        """Receive the steps rank ``origin``'s keeper offers this one, in order (a thread per origin:
        one origin's transfer never delays another's)."""
        try:
            store = open_store(setup)
        except Exception as exc:  # noqa: BLE001 - this keeper then holds no replicas
            _say(f"cannot reach the job's store {setup.store} to receive replicas: {exc}")
            return
        group: ReplicaGroup | None = None
        n = 1  # the job's own keys (a new job, a new prefix): every offer is for this keeper
        refused = 0  # store requests in a row that failed at once
        try:
            while True:
                waiting[origin] = n  # before the stop check: see _halt_receiver
                if stop.is_set():
                    return
                key = f"offer/{origin}-{setup.rank}/{n}"
                t0 = time.monotonic()
                try:
                    store.wait([key], _OFFER_WAIT)
                    offer = json.loads(bytes(store.get(key)))
                    if stop.is_set():
                        return
                    step = int(offer["step"])
                except RuntimeError as exc:  # the store is gone (or, once a day, the wait timed out)
                    refused = refused + 1 if time.monotonic() - t0 < 1.0 else 0
                    if refused >= _STORE_TRIES:
                        if not stop.is_set():
                            _say(f"the job's store {setup.store} is gone ({exc}); rank {setup.rank}'s keeper "
                                 f"receives no more replicas of rank {origin} until the job restarts")
                        return
                    if refused:
                        stop.wait(_STORE_RETRY_S)
                    continue
                except (ValueError, KeyError, TypeError) as exc:
                    _say(f"offer {n} to rank {setup.rank}'s keeper is malformed ({exc}); skipped")
                    n += 1
                    continue
                refused = 0
                group = self._receive(store, group, setup, n, origin, step, stop)
                n += 1
        finally:
            if group is not None:
                group.close()

    def _receive(self, store: Any, group: ReplicaGroup | None, setup: ReplicaSetup, n: int, origin: int,
                 step: int, stop: threading.Event) -> ReplicaGroup | None:
        """Receive offer ``n`` over the pair's group (formed now if there is none); the group to
        receive the next offer over (None after a failure: both ends dropped it)."""
        with self._lock:
            spare = self._spare.pop(origin, [])
            if setup.in_place and not stop.is_set():
                # One copy: the held replica's buffers take the arriving one, so from here until it
                # has arrived and matched its checksums this holder has no replica of ``origin``.
                # One that a stand-in reads or another process maps is left whole (the arriving
                # step then takes new buffers, as without in_place).
                held = self._kept.get(origin)
                if held is not None and not held.shared and id(held) not in self._pins:
                    del self._kept[origin]
                    spare = [*spare, *held.release()]
        try:
            if group is None:
                group = pair_group(store, setup, f"pair/{origin}-{setup.rank}", n, RECEIVER)
            got = group.recv_step(SENDER, run_id=self.instance, world=setup.world, rank=origin, step=step,
                                  reuse=spare)
        except (ZerostallError, RuntimeError, OSError) as exc:
            _say(f"the replica of rank {origin}'s step {step} was not received: {exc}")
            if group is not None:
                group.close()
            else:  # recv_step, which takes the spare buffers over, never ran
                for b in spare:
                    b.close()
            return None
        with self._lock:
            old: ReceivedStep | None = got
            if not stop.is_set():  # else a new job (or the end) came meanwhile: its replicas are kept
                old, self._kept[origin] = self._kept.get(origin), got
            old = self._unless_pinned(old)
            if old is not None and not old.shared and not self._closed and origin not in self._spare \
                    and not setup.in_place:
                # (a receiver of a new job for the same origin may have left one already)
                self._spare[origin], old = old.release(), None
        if old is not None:
            old.close()
        return group

    # -- what is held ---------------------------------------------------------------------

    def held_bytes(self) -> int:
        """Bytes of host memory this keeper's replicas hold now: the replicas kept and the spare
        buffers kept to receive the next ones into (one copy per origin with ``in_place``, else
        two once a second step has arrived)."""
        with self._lock:
            return (sum(b.size for r in self._kept.values() for b in r.buffers)
                    + sum(b.size for bufs in self._spare.values() for b in bufs))

    def held(self) -> tuple[HeldReplica, ...]:
        with self._lock:
            return tuple(HeldReplica(origin=o, step=r.of.step) for o, r in sorted(self._kept.items()))

    def with_replica(self, origin: int, use: Callable[[ReceivedStep | None], None], *, lend: bool = False) -> None:
        """``use(the replica of origin's step, or None)``, while no newer one may replace (and free)
        it. ``lend``: ``use`` hands its descriptors to another process, so its buffers are never
        received into again."""
        with self._lock:
            r = self._kept.get(origin)
            if r is not None and lend:
                r.shared = True
            use(r)

    def holders_of(self, origin: int) -> list[int]:
        """The ranks that hold ``origin``'s replicas in the job set up now, in placement order."""
        setup = self._setup
        if setup is None or setup.replicas <= 0:
            return []
        return replica_holders(origin, setup.world, setup.ranks_per_host, setup.replicas)

    def pin(self, step: int, world: int) -> list[ReceivedStep]:
        """The replicas held here of step ``step`` at world size ``world``, reserved against
        closing (a newer replica may still replace them) until :meth:`unpin`."""
        with self._lock:
            got = [r for _, r in sorted(self._kept.items()) if r.of.step == step and r.of.world == world]
            for r in got:
                self._pins[id(r)] = self._pins.get(id(r), 0) + 1
            return got

    def unpin(self, r: ReceivedStep) -> None:
        with self._lock:
            n = self._pins.pop(id(r)) - 1
            if n:
                self._pins[id(r)] = n
            close = not n and id(r) in self._doomed
            if close:
                self._doomed.discard(id(r))
        if close:
            r.close()

    def _unless_pinned(self, r: ReceivedStep | None) -> ReceivedStep | None:
        """``r`` to close now, or None when a stand-in reads it (closed at its last unpin). Under the lock."""
        if r is not None and id(r) in self._pins:
            self._doomed.add(id(r))
            return None
        return r

    def close(self) -> None:
        self._halt_receiver()
        self._drop_links(None)
        with self._lock:
            self._closed = True
            kept, self._kept = self._kept, {}
            spare, self._spare = self._spare, {}
            gone = [r for r in kept.values() if self._unless_pinned(r) is not None]
        for r in gone:
            r.close()
        for bufs in spare.values():
            for b in bufs:
                b.close()


def _say(what: str) -> None:
    print(f"zerostall keeper: {what}", file=sys.stderr, flush=True)

