"""What zerostall holds in one rank's host memory, and whether it fits ``host_memory_limit``.

The one place that accounts for it (``Checkpointer(host_memory_limit=...)``): the engine asks
:meth:`HostLimit.decide` at the first save of each layout, before any byte is staged, and the
Checkpointer's constructor asks :meth:`HostLimit.check_fixed` for what is known without the state.
The parts, per rank, in bytes (:class:`HostMemory`):

* **slots**: the staging slots, one per save in flight (``SaveOptions.max_in_flight``), each a
  full image of this rank's data file (the state plus its header and padding, whole pages);
* **held step**: the memory tier's keeper holds the newest in-memory step's slot
  (``WriterSide.held_slots`` more slots);
* **replicas**: the copies a keeper keeps of other ranks' states for ``MemoryTier(replicas=r)``:
  two per replica (the newest and the one arriving), one with ``replicas_in_place=True``. A holder
  holds its origins' states, which under the placement's rule (equally many ranks per host) are
  as large as its own: counted at this rank's slot size;
* **transfer**: what moving a replica may buffer beside the mapped slots: one chunk
  (:data:`TRANSFER_CHUNK`, the replica link's ``CHUNK_BYTES``) per replica.

What is not counted: the trainer's own tensors, torch's and the allocator's caches, the
interpreters of the trainer, writer and keeper, and a load's buffers (a load reads into the
templates). A state whose slot does not fit stages and persists in pieces of at most
:attr:`Fit.piece_bytes` (docs/guarantees.md, "Host memory limit").

Imports only :mod:`zerostall.errors` and :mod:`zerostall.validate`: the engine, the Checkpointer
and the advisor's docs all name this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerostall.errors import HostMemoryLimitError
from zerostall.validate import check_optional_int

__all__ = ["HostMemory", "HostLimit", "Fit", "account", "check_limit", "gib", "PIECE_ALIGN", "MIN_PIECE",
           "TRANSFER_CHUNK"]

#: a piece of a piecewise save is a multiple of this (whole pages; a multiple of every
#: element size, so a leaf split across pieces splits between elements)
PIECE_ALIGN = 4096
#: the smallest piece buffer: below it, the per-piece round trip to the writer dominates
MIN_PIECE = 1 << 20
#: bytes one replica's transfer may buffer (``zerostall.memtier.replica.CHUNK_BYTES``; a test
#: checks they agree)
TRANSFER_CHUNK = 16 << 20

ARGUMENT = "host_memory_limit"


def gib(n: int) -> str:
    """``n`` bytes for a message: GiB with one decimal (MiB below 1 GiB)."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class HostMemory:
    """What one configuration holds in this rank's host memory, per part (bytes and counts)."""

    slots: int
    held_step: int
    replicas: int
    transfer: int
    n_slots: int
    n_held: int
    n_copies: int

    @property
    def total(self) -> int:
        return self.slots + self.held_step + self.replicas + self.transfer

    def describe(self) -> str:
        """The parts, as an error message names them."""
        parts = [f"{self.n_slots} staging slot{'s' if self.n_slots != 1 else ''} {gib(self.slots)}"]
        if self.n_held:
            parts.append(f"held step {gib(self.held_step)}")
        if self.n_copies:
            parts.append(f"{self.n_copies} replica cop{'ies' if self.n_copies != 1 else 'y'} {gib(self.replicas)}")
        if self.transfer:
            parts.append(f"transfer {gib(self.transfer)}")
        return ", ".join(parts)


def account(slot_bytes: int, *, slots: int, held_slots: int = 0, replicas: int = 0,
            in_place: bool = False) -> HostMemory:
    """The host memory of ``slots`` staging slots of ``slot_bytes``, the memory tier's
    ``held_slots`` and ``replicas`` (one copy each ``in_place``, else two)."""
    copies = replicas * (1 if in_place else 2)
    return HostMemory(slots=slots * slot_bytes, held_step=held_slots * slot_bytes, replicas=copies * slot_bytes,
                      transfer=replicas * TRANSFER_CHUNK, n_slots=slots, n_held=held_slots, n_copies=copies)


@dataclass(frozen=True)
class Fit:
    """How saves of one layout fit the limit: ``slots`` whole slots in the pool, or
    (``piece_bytes`` > 0) ``slots`` piece buffers of ``piece_bytes`` each."""

    slots: int
    piece_bytes: int = 0
    memory: HostMemory | None = None

    @property
    def pieces(self) -> bool:
        return self.piece_bytes > 0


def check_limit(value: object, *, path: str | None = None) -> int | None:
    """``host_memory_limit`` as given: None or an int of bytes >= 0 (a bool, float or str is a type error)."""
    return check_optional_int(ARGUMENT, value, lo=0, path=path)


@dataclass(frozen=True)
class HostLimit:
    """A rank's ``host_memory_limit`` and the configuration that fills it."""

    limit: int
    max_in_flight: int
    held_slots: int = 0
    replicas: int = 0
    in_place: bool = False

    @property
    def memory_tier(self) -> bool:
        return self.held_slots > 0

    def fixed(self) -> int:
        """What any state needs: one piece buffer (or, with the memory tier, one page per slot,
        plus the replicas' transfer)."""
        if not self.memory_tier:
            return MIN_PIECE
        return account(PIECE_ALIGN, slots=self.max_in_flight, held_slots=self.held_slots, replicas=self.replicas,
                       in_place=self.in_place).total

    def check_fixed(self, path: str | None = None) -> None:
        """Raise :class:`HostMemoryLimitError` if even the smallest state cannot fit (the constructor)."""
        need = self.fixed()
        if self.limit < need:
            what = ("one piece buffer of a piecewise save" if not self.memory_tier else
                    "the memory tier's slots and replicas' transfer before any state")
            raise HostMemoryLimitError(f"host_memory_limit is {self.limit} bytes; {what} needs {need} bytes",
                                       argument=ARGUMENT, path=path)

    def decide(self, slot_bytes: int, *, path: str | None = None, step: int | None = None,
               collective: bool = False, piece_writes: bool = True) -> Fit:
        """How saves whose data-file image is ``slot_bytes`` fit (called before staging).

        Whole slots when ``max_in_flight`` of them (and the memory tier's parts) fit; without the
        memory tier, fewer slots in flight when fewer fit, else pieces.

        Raises:
            HostMemoryLimitError: the memory tier's parts do not fit (a memory step is whole
                in memory), or pieces are needed where they cannot be used (a collective save, a
                storage that writes no pieces); the message names the parts and what would fit.
        """
        full = account(slot_bytes, slots=self.max_in_flight, held_slots=self.held_slots, replicas=self.replicas,
                       in_place=self.in_place)
        if full.total <= self.limit:
            return Fit(slots=self.max_in_flight + self.held_slots, memory=full)
        at = f"step {step}: " if step is not None else ""
        if self.memory_tier:
            raise HostMemoryLimitError(at + self._memory_tier_message(slot_bytes, full), argument=ARGUMENT, path=path)
        whole = self.limit // slot_bytes if slot_bytes else self.max_in_flight
        if whole >= 1:
            return Fit(slots=int(whole), memory=account(slot_bytes, slots=int(whole)))
        why = ("a collective save (torch.distributed) stages whole" if collective else
               "this storage writes no data file in pieces (local directories do)" if not piece_writes else "")
        if why:
            raise HostMemoryLimitError(
                f"{at}one staging slot needs {gib(slot_bytes)} ({slot_bytes} bytes), host_memory_limit is "
                f"{gib(self.limit)} ({self.limit} bytes); a save in pieces would fit, but {why}", argument=ARGUMENT,
                path=path)
        n = 2 if self.limit >= 2 * MIN_PIECE else 1  # two: one is staged while the writer writes the other
        piece = self.limit // n // PIECE_ALIGN * PIECE_ALIGN
        return Fit(slots=n, piece_bytes=piece, memory=HostMemory(slots=n * piece, held_step=0, replicas=0,
                                                                 transfer=0, n_slots=n, n_held=0, n_copies=0))

    def _memory_tier_message(self, slot_bytes: int, full: HostMemory) -> str:
        tier = f"MemoryTier(replicas={self.replicas})" if self.replicas else "MemoryTier()"
        msg = (f"{tier} needs {gib(full.total)} per rank ({full.describe()}; {full.total} bytes), host_memory_limit "
               f"is {gib(self.limit)} ({self.limit} bytes)")
        alternatives: list[tuple[str, HostMemory]] = []
        slots, held = self.max_in_flight, self.held_slots
        if self.replicas and not self.in_place:
            alternatives.append(("replicas_in_place=True", account(slot_bytes, slots=slots, held_slots=held,
                                                                   replicas=self.replicas, in_place=True)))
        if self.replicas:
            alternatives.append(("without replicas", account(slot_bytes, slots=slots, held_slots=held)))
        if self.max_in_flight > 1:
            alternatives.append(("max_in_flight=1 without replicas" if self.replicas else "max_in_flight=1", account(slot_bytes, slots=1,
                                                                             held_slots=self.held_slots)))
        for what, m in alternatives:
            verdict = "fits" if m.total <= self.limit else "does not fit either"
            msg += f"; {what} needs {gib(m.total)}: {verdict}"
        msg += ("; without the memory tier, saves persist to storage in pieces that fit (a memory step is held "
                "whole, so it cannot be saved in pieces)")
        return msg
