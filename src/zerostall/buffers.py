"""Shared-memory buffers: a ``memfd`` mapped here, whose descriptor other processes map too.

One home for what both sides of the trainer/writer boundary hold: the trainer's staging slots
(:mod:`zerostall.stage.buffers` pools them), the writer's and the keeper's mappings of them, and
the buffers a keeper receives a replica into (:mod:`zerostall.memtier.replica`). The memory is freed
by the kernel when the last process holding it exits: a crash of either process leaks nothing.
With CUDA present a buffer can be page-locked (``cudaHostRegister``) so device-to-host copies run
at full speed and async. Imports nothing of zerostall.
"""

from __future__ import annotations

import itertools
import mmap
import os
import sys
import tempfile

__all__ = ["HostBuffer"]

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
