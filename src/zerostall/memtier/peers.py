"""A keeper's part in replication: each held step sent to the keepers of other hosts, and the
newest replica of each of their ranks' steps kept here.

The trainer configures it (:class:`~zerostall.messages.ReplicaSetup`: the job's keeper group,
its secret, the world's layout). Then, for every step the keeper holds, :meth:`Peers.send`
offers it to each holder (:func:`~zerostall.memtier.placement.replica_holders`) through the
job's store and sends it over a pair of the job's authenticated :class:`ReplicaGroup`: straight
from the staged buffers, on the keeper's job loop, never on the training thread. A receiver
thread per origin rank (:func:`~zerostall.memtier.placement.replica_origins`) takes that rank's
offers to this keeper, one at a time, receives each step into fresh
shared memory, verified leaf by leaf against the CRC32Cs of its manifest, and keeps only the
newest one of each origin rank (the one being received is the only other copy). A replica is
identified by the directory's instance, the world size, the origin rank and the step
(:class:`ReplicaOf`); one that fails any check is never kept.

A holder that failed (dead, refused, silent past ``timeout_s``) is not offered more steps until
the next setup (a restarted job): saves do not wait ``timeout_s`` each for a dead host.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from zerostall.errors import ZerostallError
from zerostall.lease import host_id
from zerostall.memtier.placement import replica_holders, replica_origins
from zerostall.memtier.replica import OutgoingStep, ReceivedStep, ReplicaGroup, ReplicaOf
from zerostall.messages import HeldReplica, ReplicaSetup

__all__ = ["Peers", "open_store", "pair_group", "SENDER", "RECEIVER"]

#: member ids of the two ends of a pair formation
SENDER, RECEIVER = 0, 1
#: how often the receiver looks for its next offer (one small store request each)
_OFFER_POLL_S = 0.05


def open_store(setup: ReplicaSetup) -> Any:
    """A client of the job's store, prefixed for this job's replicas."""
    import torch.distributed

    dist: Any = torch.distributed  # its store classes are not in its stubs' exports
    host, _, port = setup.store.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=setup.timeout_s))
    return dist.PrefixStore(f"zerostall-replicas/{setup.job}", store)


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
        self._unreachable = False
        #: origin rank -> the newest replica of its step held here
        self._kept: dict[int, ReceivedStep] = {}
        #: replicas a stand-in persist reads (id -> users); one replaced or dropped meanwhile is
        #: closed when its last user is done
        self._pins: dict[int, int] = {}
        self._doomed: set[int] = set()
        self._stop = threading.Event()
        self._receivers: list[threading.Thread] = []

    @property
    def active(self) -> bool:
        return self._setup is not None and self._setup.replicas > 0

    def configure(self, setup: ReplicaSetup) -> None:
        """Join the job ``setup`` names (a new job replaces the old one's receiver; the replicas
        already held stay: they are identified by the directory, world, rank and step)."""
        self._halt_receiver()
        with self._lock:
            self._setup, self._store, self._dead, self._unreachable = setup, None, set(), False
        if setup.replicas <= 0:
            return
        self._stop = threading.Event()
        for origin in replica_origins(setup.rank, setup.world, setup.ranks_per_host, setup.replicas):
            t = threading.Thread(target=self._receive_loop, args=(setup, origin, self._stop),
                                 name=f"zerostall-keeper-replicas-{origin}", daemon=True)
            t.start()
            self._receivers.append(t)

    def _halt_receiver(self) -> None:
        """Tell the receivers to stop after what they are doing; never waits for them (a receive
        in progress ends within ``timeout_s``, and must not delay an adopting trainer's first job)."""
        self._stop.set()
        self._receivers = []

    # -- sending --------------------------------------------------------------------------

    def send(self, step: int, manifest: bytes, files: tuple[tuple[str, memoryview], ...]) -> bool:
        """Send this keeper's ``step`` to each of its holders; True when every one verified it."""
        setup = self._setup
        if setup is None or setup.replicas <= 0:
            return False
        if self._store is None:
            if self._unreachable:
                return False
            try:
                self._store = open_store(setup)
            except Exception as exc:  # noqa: BLE001 - the save is then in memory only, and says so
                self._unreachable = True  # not tried again (a timeout each) until the next setup
                _say(f"cannot reach the job's store {setup.store} to replicate step {step}: {exc}; no step is "
                     "replicated until the job restarts")
                return False
        out = OutgoingStep(of=ReplicaOf(self.instance, setup.world, setup.rank, step), manifest=manifest,
                           files=files)
        ok = True
        for h in replica_holders(setup.rank, setup.world, setup.ranks_per_host, setup.replicas):
            if h in self._dead:
                ok = False
                continue
            try:
                n = int(self._store.add(f"offers/{setup.rank}-{h}", 1))
                self._store.set(f"offer/{setup.rank}-{h}/{n}", json.dumps({"step": step}))
                with pair_group(self._store, setup, f"pair/{setup.rank}-{h}", n, SENDER) as g:
                    g.send_step(RECEIVER, out)
            except (ZerostallError, RuntimeError, OSError) as exc:
                self._dead.add(h)
                ok = False
                _say(f"rank {setup.rank}'s step {step} is not replicated on rank {h}'s keeper ({exc}); that "
                     "holder is not offered more steps until the job restarts")
        return ok

    # -- receiving ------------------------------------------------------------------------

    def _receive_loop(self, setup: ReplicaSetup, origin: int, stop: threading.Event) -> None:
        """Receive the steps rank ``origin``'s keeper offers this one, in order (a thread per origin:
        one origin's transfer never delays another's)."""
        try:
            store = open_store(setup)
        except Exception as exc:  # noqa: BLE001 - this keeper then holds no replicas
            _say(f"cannot reach the job's store {setup.store} to receive replicas: {exc}")
            return
        n = 1  # the job's own keys (a new job, a new prefix): every offer is for this keeper
        while not stop.is_set():
            key = f"offer/{origin}-{setup.rank}/{n}"
            try:
                if not store.check([key]):
                    stop.wait(_OFFER_POLL_S)
                    continue
                step = int(json.loads(bytes(store.get(key)))["step"])
            except RuntimeError:  # the store is gone or slow: look again
                stop.wait(_OFFER_POLL_S)
                continue
            except (ValueError, KeyError, TypeError) as exc:
                _say(f"offer {n} to rank {setup.rank}'s keeper is malformed ({exc}); skipped")
                n += 1
                continue
            self._receive(store, setup, n, origin, step, stop)
            n += 1

    def _receive(self, store: Any, setup: ReplicaSetup, n: int, origin: int, step: int,
                 stop: threading.Event) -> None:
        try:
            with pair_group(store, setup, f"pair/{origin}-{setup.rank}", n, RECEIVER) as g:
                got = g.recv_step(SENDER, run_id=self.instance, world=setup.world, rank=origin, step=step)
        except (ZerostallError, RuntimeError, OSError) as exc:
            _say(f"the replica of rank {origin}'s step {step} was not received: {exc}")
            return
        with self._lock:
            old: ReceivedStep | None = got
            if not stop.is_set():  # else a new job (or the end) came meanwhile: its replicas are kept
                old, self._kept[origin] = self._kept.get(origin), got
            old = self._unless_pinned(old)
        if old is not None:
            old.close()

    # -- what is held ---------------------------------------------------------------------

    def held(self) -> tuple[HeldReplica, ...]:
        with self._lock:
            return tuple(HeldReplica(origin=o, step=r.of.step) for o, r in sorted(self._kept.items()))

    def with_replica(self, origin: int, use: Callable[[ReceivedStep | None], None]) -> None:
        """``use(the replica of origin's step, or None)``, while no newer one may replace (and free) it."""
        with self._lock:
            use(self._kept.get(origin))

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
        with self._lock:
            kept, self._kept = self._kept, {}
            gone = [r for r in kept.values() if self._unless_pinned(r) is not None]
        for r in gone:
            r.close()


def _say(what: str) -> None:
    print(f"zerostall keeper: {what}", file=sys.stderr, flush=True)

