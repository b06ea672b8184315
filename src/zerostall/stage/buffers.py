"""Host staging buffers: allocated once, reused every save, shared with the writer process.

A buffer is a ``memfd`` (anonymous shared memory, :class:`zerostall.buffers.HostBuffer`) mapped
into the trainer; its descriptor is passed to the writer process, which maps the same pages, so
persisting reads the staged bytes without another copy. With CUDA present the mapping is also
page-locked (``cudaHostRegister``) so device-to-host copies run at full speed and async. This
module pools them into slots (one per save in flight) and keeps them per layout.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from zerostall.buffers import HostBuffer

__all__ = ["HostBuffer", "Slot", "BufferPool"]


class Slot:
    """One in-flight save's buffers (one per data file) and the typed views planned into them."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.buffers: list[HostBuffer] = []
        self.signature: tuple[object, ...] | None = None
        self.views: list[Any] = []  # per leaf: a typed destination view, built lazily by the stager
        #: the stager's grouping of a layout's leaves for batched copies (stager._split): indices only
        self.batch: Any = None

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers)


class _Parked:
    """An idle buffer set kept for a layout (its headers and typed views stay valid)."""

    __slots__ = ("buffers", "signature", "views")

    def __init__(self, buffers: list[HostBuffer], signature: tuple[object, ...] | None, views: list[Any]) -> None:
        self.buffers = buffers
        self.signature = signature
        self.views = views

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers)

    def fits(self, sizes: list[int]) -> bool:
        return len(self.buffers) == len(sizes) and all(b.size >= s for b, s in zip(self.buffers, sizes, strict=True))


class BufferPool:
    """``max_in_flight`` slots. :meth:`acquire` blocks until one is free.

    A slot keeps its buffers across saves; they are replaced only when a new layout needs a
    file larger than the buffer (``on_free`` lets the writer unmap the old one first).

    With ``cache_bytes`` > 0, buffers a slot gives up for another layout are parked instead of
    freed, and a later save of their layout takes them back with its headers and typed views
    still in place (no allocation, no page faults, no re-planning of views). A layout with no
    parked set of its own takes the smallest parked set large enough, if any, before allocating. Parked sets are
    evicted least recently used first whenever all the pool's buffers (in slots and parked)
    exceed ``cache_bytes``; buffers in a slot are never evicted, so one layout larger than the
    bound still saves. ``cache_bytes=0`` (the default) parks nothing.
    """

    def __init__(self, slots: int, *, pin: bool = False, on_free: Callable[[HostBuffer], None] | None = None,
                 cache_bytes: int = 0) -> None:
        self._free: deque[Slot] = deque(Slot(i) for i in range(slots))
        self._all = list(self._free)
        self._cond = threading.Condition()
        self._pin = pin
        self._on_free = on_free
        self.cache_bytes = max(0, int(cache_bytes))
        self._parked: OrderedDict[int, _Parked] = OrderedDict()  # least recently used first
        self._parked_ids = itertools.count()
        #: buffers allocated over the pool's life, and their bytes (tests and benchmarks read them)
        self.allocations = 0
        self.allocated_bytes = 0
        #: the most bytes the pool held at once (in slots and parked): what host_memory_limit bounds
        self.peak_bytes = 0

    def acquire(self, timeout: float | None = None) -> Slot:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout):
                raise TimeoutError("no staging buffer became free")
            return self._free.popleft()

    def release(self, slot: Slot) -> None:
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
                self._cond.notify()

    def fit(self, slot: Slot, sizes: list[int], *, signature: tuple[object, ...] | None = None) -> bool:
        """Make ``slot`` hold buffers of at least ``sizes``; True if it had to (re)allocate.

        ``signature`` (the plan's layout) lets the pool hand back buffers parked for that very
        layout; without it, or with ``cache_bytes=0``, any buffers large enough are reused.
        """
        if slot.buffers and (signature is None or self.cache_bytes == 0 or slot.signature in (None, signature)) \
                and _fits(slot.buffers, sizes):
            return False
        with self._cond:
            if slot.buffers:
                self._parked[next(self._parked_ids)] = _Parked(slot.buffers, slot.signature, slot.views)
            slot.buffers, slot.views, slot.signature = [], [], None
            key = self._pick(sizes, signature)
            if key is not None:
                got = self._parked.pop(key)
                slot.buffers, slot.views, slot.signature = got.buffers, got.views, got.signature
            evict = self._over_budget(extra=0 if key is not None else sum(sizes))
        self._close_all(evict)
        if key is not None:
            return False
        slot.buffers = [HostBuffer(s, pin=self._pin) for s in sizes]
        self.allocations += len(sizes)
        self.allocated_bytes += sum(b.size for b in slot.buffers)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())
        return True

    def resize(self, slots: int) -> None:
        """Free every buffer and make the pool ``slots`` slots (every slot must be free: the
        engine waits for its saves first). A layout whose fit under ``host_memory_limit`` differs
        from the previous one's starts from no buffers, so old and new never add up."""
        with self._cond:
            if len(self._free) != len(self._all):
                raise RuntimeError("resize() with a slot in use")
            old = [b for s in self._all for b in s.buffers]
            old += [b for p in self._parked.values() for b in p.buffers]
            self._parked.clear()
            self._free = deque(Slot(i) for i in range(slots))
            self._all = list(self._free)
        self._close_all(old)

    @property
    def slots(self) -> int:
        """How many slots the pool has."""
        return len(self._all)

    def _pick(self, sizes: list[int], signature: tuple[object, ...] | None) -> int | None:
        """The parked set to use: the layout's own, else the smallest one large enough (its
        headers and views are rewritten: cheaper than allocating and faulting new pages)."""
        if signature is not None and self.cache_bytes > 0:
            for key, p in self._parked.items():
                if p.signature == signature and p.fits(sizes):
                    return key
        best = [(p.nbytes, key) for key, p in self._parked.items() if p.fits(sizes)]
        return min(best)[1] if best else None

    def _over_budget(self, *, extra: int) -> list[HostBuffer]:
        """Unpark least recently used sets until the pool (plus ``extra`` bytes) fits the bound."""
        held = extra + sum(s.nbytes for s in self._all) + sum(p.nbytes for p in self._parked.values())
        out: list[HostBuffer] = []
        while self._parked and held > self.cache_bytes:
            _, p = self._parked.popitem(last=False)
            held -= p.nbytes
            out.extend(p.buffers)
        return out

    def _close_all(self, buffers: list[HostBuffer]) -> None:
        for b in buffers:
            if self._on_free is not None:
                self._on_free(b)
            b.close()

    def held_bytes(self) -> int:
        """Bytes of staging memory the pool holds now (in slots and parked)."""
        with self._cond:
            return sum(s.nbytes for s in self._all) + sum(p.nbytes for p in self._parked.values())

    def parked_layouts(self) -> int:
        """How many idle buffer sets are parked for other layouts."""
        with self._cond:
            return len(self._parked)

    def close(self) -> None:
        with self._cond:
            for slot in self._all:
                slot.views = []
                for b in slot.buffers:
                    b.close()
                slot.buffers = []
            for p in self._parked.values():
                p.views = []
                for b in p.buffers:
                    b.close()
            self._parked.clear()


def _fits(buffers: list[HostBuffer], sizes: list[int]) -> bool:
    return len(buffers) == len(sizes) and all(b.size >= s for b, s in zip(buffers, sizes, strict=True))
