"""A keeper's part in parity: every held step's XOR parity formed with the keepers of its parity
group (:func:`~zerostall.memtier.placement.parity_groups`: the ranks of one local index on
consecutive hosts), and the newest parity kept here.

The trainer configures it (:class:`~zerostall.memtier.messages.ReplicaSetup` with
``parity_group``). Then, for every step the keeper holds, :meth:`ParityPeers.exchange` runs the
group's :meth:`~zerostall.memtier.paritygroup.ParityGroup.exchange` on the keeper's job loop,
straight from the staged buffers, never on the training thread; every member of the group does
so for the same step. The group forms at its first exchange and is kept while its exchanges
succeed. The parity of the step before is dropped as the exchange starts (its buffer takes the
new parity): from then until every member's exchange ended the group holds no parity that
matches its members' held steps, so a host lost in that window (the exchange's own duration,
after each save) costs the group its memory step, and the restart loads storage's
(docs/guarantees.md, "Parity across hosts").

One failed exchange (a member dead, silent past ``timeout_s``, another step's, a wrong secret)
ends parity for the job set up now, on every member: the one that saw it fail marks the group
broken in the job's store, and the others read the mark before their next exchange, so no save
waits out ``timeout_s`` again for a dead host. A restarted job (a new setup) forms a new group.

The parity held survives a new setup: a restarted job's trainers rebuild a lost rank's step
from it (:meth:`zerostall.memtier.tier.MemorySide.load_replicated`), which the keeper lends them
(:meth:`ParityPeers.with_held`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from zerostall.buffers import HostBuffer
from zerostall.errors import ZerostallError
from zerostall.lease import host_id
from zerostall.memtier.messages import ReplicaSetup
from zerostall.memtier.paritygroup import HeldParity, ParityGroup
from zerostall.memtier.peers import open_store
from zerostall.memtier.placement import parity_group_of, parity_groups

__all__ = ["ParityPeers", "group_name"]

#: the store key (under the job's prefix) that marks a group's parity broken for this job
_BROKEN = "parity-broken/{}"
#: the exchange's pieces: each peer's chunk arrives through WINDOW slots of this size, so the
#: transfer holds G - 1 times WINDOW of them beside the parity, and the allocator keeps them
#: between exchanges (benchmarks/hostmem.py, a group of 4 at 256 MiB per rank: the job held 3.90x
#: the state with the replicas' 16 MiB pieces, 3.21x with 4 MiB, 3.02x with 1 MiB)
PIECE_BYTES = 1 << 20


def group_name(setup: ReplicaSetup) -> tuple[str, int, int, list[int]]:
    """(name of this rank's parity group, its member number, the group's size, its ranks)."""
    groups = parity_groups(setup.world, setup.ranks_per_host, setup.parity_group)
    index, member = parity_group_of(setup.rank, groups)
    return f"g{index}", member, len(groups[index]), groups[index]


class ParityPeers:
    """Parity for one keeper."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._setup: ReplicaSetup | None = None
        self._store: Any = None
        self._group: ParityGroup | None = None
        self._broken = False
        #: the newest parity formed here (of the step this keeper held then), and its buffer
        self._held: HeldParity | None = None
        self._buffer: HostBuffer | None = None
        #: the held parity's buffer was handed to a trainer (a rebuild maps it): never formed into again
        self._lent = False

    @property
    def active(self) -> bool:
        return self._setup is not None and self._setup.parity_group > 0

    def configure(self, setup: ReplicaSetup) -> None:
        """Join the job ``setup`` names (the same setup again changes nothing). The parity held
        stays: a restarted job's load may rebuild a lost rank from it."""
        if setup == self._setup:
            return
        if setup.parity_group > 0:
            import torch.distributed  # noqa: F401  - on the message loop: see peers.Peers.configure

        with self._lock:
            group, self._group = self._group, None
            self._setup, self._store, self._broken = setup, None, False
        if group is not None:
            group.close()

    def exchange(self, step: int, manifest: bytes, files: tuple[tuple[str, memoryview], ...]) -> bool:
        """Form this keeper's parity of ``step`` with its group (``files``: its data files in
        manifest order); True when it holds that parity."""
        with self._lock:
            setup, spare = self._setup, None
            if setup is None or setup.parity_group <= 0:
                return False
            # The old parity no longer matches the step held: its buffer takes the new one, unless a
            # trainer maps it (then the memory goes once that mapping does).
            old, self._held, self._buffer, lent, self._lent = self._buffer, None, None, self._lent, False
            if old is not None and lent:
                old.close()
            elif old is not None:
                spare = old
            if self._broken:
                if spare is not None:
                    spare.close()
                return False
        name, member, size, ranks = group_name(setup)
        store = self._store
        try:
            if store is None:
                store = self._store = open_store(setup)
            if store.check([_BROKEN.format(name)]):
                raise ZerostallError(f"another member of parity group {ranks} gave it up: "
                                     f"{bytes(store.get(_BROKEN.format(name))).decode(errors='replace')}")
            group = self._group
            if group is None:
                group = self._group = ParityGroup(store, job_id=setup.job, secret=bytes.fromhex(setup.secret),
                                                  member=member, size=size, host=host_id(), group=f"exchange/{name}",
                                                  timeout_s=setup.timeout_s, chunk_bytes=PIECE_BYTES)
            held = group.exchange(step, manifest, [v for _, v in files], spare=spare)
            buffer = held.parity
            assert isinstance(buffer, HostBuffer)  # exchange forms it in one
        except (ZerostallError, RuntimeError, OSError) as exc:
            self._give_up(store, name, f"rank {setup.rank}: {exc}")
            _say(f"rank {setup.rank}'s step {step} has no parity in group {ranks} ({exc}); no step of this job is "
                 "protected by parity until it restarts")
            return False
        with self._lock:
            if self._setup is setup:
                self._held, self._buffer = held, buffer
                return True
        buffer.close()  # a new job came meanwhile: its own exchanges start afresh
        return False

    def _give_up(self, store: Any, name: str, why: str) -> None:
        with self._lock:
            self._broken = True
            group, self._group = self._group, None
        if group is not None:
            group.close()
        if store is not None:
            try:
                store.set(_BROKEN.format(name), why[:500])
            except (ZerostallError, RuntimeError, OSError):
                pass  # the others' next exchange ends within timeout_s instead

    def held_step(self) -> int | None:
        with self._lock:
            return self._held.step if self._held is not None else None

    def held_bytes(self) -> int:
        with self._lock:
            return self._buffer.size if self._buffer is not None else 0

    def with_held(self, use: Callable[[HeldParity | None, HostBuffer | None], None]) -> None:
        """``use(the parity held and its buffer, or None twice)``, which hands the buffer to
        another process: it is never formed into again (the next exchange takes a new one)."""
        with self._lock:
            if self._held is not None:
                self._lent = True
            use(self._held, self._buffer)

    def close(self) -> None:
        with self._lock:
            group, self._group = self._group, None
            buffer, self._held, self._buffer = self._buffer, None, None
        if group is not None:
            group.close()
        if buffer is not None:
            buffer.close()


def _say(what: str) -> None:
    print(f"zerostall keeper: {what}", file=sys.stderr, flush=True)
