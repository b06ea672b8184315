"""Host staging buffers: allocated once, reused every save, shared with the writer process.

A buffer is a ``memfd`` (anonymous shared memory) mapped into the trainer; its descriptor is
passed to the writer process, which maps the same pages, so persisting reads the staged bytes
without another copy. The memory is freed by the kernel when the last process holding it
exits: a crash of either process leaks nothing. With CUDA present the mapping is also
page-locked (``cudaHostRegister``) so device-to-host copies run at full speed and async.
"""

from __future__ import annotations

import itertools
import mmap
import os
import sys
import tempfile
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

__all__ = ["HostBuffer", "Slot", "BufferPool"]

_ids = itertools.count(1)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class HostBuffer:
    """``size`` bytes of shared memory, pre-faulted so the first copy into it runs at memcpy speed."""

    def __init__(self, size: int, *, pin: bool = False) -> None:
        self.id = next(_ids)
        self.size = size
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create(f"zerostall-stage-{self.id}", getattr(os, "MFD_CLOEXEC", 0))
        else:  # pragma: no cover - non-Linux: an unlinked file in shared memory
            with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
                self.fd = os.dup(f.fileno())
        try:
            os.ftruncate(self.fd, size)  # EFBIG under a file-size limit (ulimit -f): memfds count
            self.mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)  # nobody else holds it: each failed save would leak one
            raise
        self._prefault()
        self.view = memoryview(self.mmap)
        self.pinned = False
        if pin:
            self.pinned = _cuda_host_register(self)

    def _prefault(self) -> None:
        # Page faults during the first save would cost ~3.5x a warm copy; take them now, on all
        # cores: the kernel zeroes the pages, which is the bulk of the cost.
        if _populate_parallel(self.mmap, self.size):
            return
        import numpy as np

        np.frombuffer(self.mmap, dtype=np.uint8)[:: mmap.PAGESIZE] = 0

    def close(self) -> None:
        if self.pinned:
            _cuda_host_unregister(self)
            self.pinned = False
        self.view.release()
        try:
            self.mmap.close()
        except BufferError:
            # A typed view into the buffer is still referenced somewhere; the mapping is
            # released when that view is collected.
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _populate_parallel(mm: mmap.mmap, size: int) -> bool:
    """``madvise(MADV_POPULATE_WRITE)`` over ``mm`` in one thread per core; False if unsupported."""
    import ctypes
    import ctypes.util
    from concurrent.futures import ThreadPoolExecutor

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return False
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    workers = max(1, min(os.cpu_count() or 1, 8, size // (64 << 20)))
    step = -(-size // workers // mmap.PAGESIZE) * mmap.PAGESIZE
    ranges = [(off, min(step, size - off)) for off in range(0, size, step)]

    def populate(r: tuple[int, int]) -> int:
        # ctypes drops the GIL around the call, so the ranges fault in concurrently.
        return int(libc.madvise(ctypes.c_void_p(base + r[0]), ctypes.c_size_t(r[1]), _MADV_POPULATE_WRITE))

    if len(ranges) == 1:
        return populate(ranges[0]) == 0
    with ThreadPoolExecutor(max_workers=len(ranges)) as pool:
        return all(rc == 0 for rc in pool.map(populate, ranges))


def _buffer_address(buf: HostBuffer) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf.mmap))


def _cuda_host_register(buf: HostBuffer) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(_buffer_address(buf), buf.size, 0)
    return int(rc) == 0


def _cuda_host_unregister(buf: HostBuffer) -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.cuda.cudart().cudaHostUnregister(_buffer_address(buf))


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
        return True

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
