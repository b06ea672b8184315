"""POSIX filesystem backend: atomic directory rename, fsync, optional O_DIRECT writes."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from zerostall.format.layout import PUT_TMP_MARK, fsync_dir
from zerostall.memcopy import copy_array
from zerostall.storage.base import Capabilities
from zerostall.storage.release import unmap_later

# lstat errors that do not mean "not there" (exists() raises them instead of answering False)
_CANNOT_TELL = frozenset({errno.EACCES, errno.EPERM, errno.EIO})

__all__ = ["LocalStorage", "MappedFile"]

_ALIGN = 4096
_IOV_MAX = 1024  # Linux's limit on buffers per preadv
_DIRECT_READ_MIN = 8 << 20  # smaller ranges: the page-cache path's overhead is noise
_BOUNCE = 8 << 20  # one O_DIRECT read; 8 MiB requests keep a virtio disk at its full rate
_PIECE = 1 << 20  # copied into the destination and handed to on_piece while in L2
_SCRATCH = 1 << 20  # scan: one buffered read, checksummed while it is in L2
_local = threading.local()
_LIBC: ctypes.CDLL | bool | None = False  # loaded on first use
_DEVNULL: int | bool | None = False  # opened on first use


class LocalStorage:
    """Objects are files under a root directory; a prefix is a directory."""

    atomic_rename = True
    capabilities = Capabilities(vectored_reads=True, sequential_reads=True, scan=True, map_file=True,
                                fill_cache=True, write_pieces=True, probe=True, local_files=True)

    def __init__(self, root_url: str) -> None:
        root = root_url.removeprefix("file://")
        self.root = os.path.abspath(root)
        self.url = self.root

    def _p(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"storage key {key!r} leaves the root {self.root!r}")
        return os.path.join(self.root, key) if key else self.root

    def file_path(self, key: str) -> str:
        """The absolute path of ``key`` under the root directory."""
        return self._p(key)

    # -- writing ---------------------------------------------------------------------------

    def write_from_buffer(self, key: str, buf: memoryview, length: int, *, threads: int, chunk_bytes: int,
                          direct: bool) -> None:
        """Write ``buf[:length]`` to a new file ``key``; durable (fsynced) on return."""
        path = self._p(key)
        _makedirs(os.path.dirname(path))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        use_direct = direct and hasattr(os, "O_DIRECT") and _aligned(buf, length)
        fd = -1
        if use_direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # tmpfs and friends refuse O_DIRECT
                    raise
                use_direct = False
        if fd < 0:
            fd = os.open(path, flags, 0o644)
        try:
            # Direct I/O writes whole 4 KiB blocks: the tail is padded from the buffer's slack and
            # the file is cut back to `length` afterwards.
            end = _round_up(length, _ALIGN) if use_direct else length
            try:
                _parallel_pwrite(fd, buf, end, threads, chunk_bytes)
            except OSError as exc:
                if not (use_direct and exc.errno == errno.EINVAL):
                    raise
                os.close(fd)
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0))
                use_direct = False
                _parallel_pwrite(fd, buf, length, threads, chunk_bytes)
            if use_direct and end != length:
                os.ftruncate(fd, length)
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_pieces(self, key: str, header: bytes, size: int, pieces: Iterable[tuple[memoryview, int]]) -> None:
        """Write a new ``size``-byte file: ``header`` at 0, then each ``(bytes, offset)`` piece; durable on return.

        Each piece goes from its buffer straight to its offset (no assembled copy); gaps read
        back as zeros. Fails with ``FileExistsError`` if ``key`` exists.
        """
        path = self._p(key)
        _makedirs(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            _pwrite_all(fd, memoryview(header), 0)
            for data, offset in pieces:
                _pwrite_all(fd, data, offset)
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        path = self._p(key)
        _makedirs(os.path.dirname(path))
        if if_absent:
            # Write aside, then link: link(2) fails if the target exists, so two writers cannot
            # both win, and a reader never sees a half-written object.
            tmp = f"{path}{PUT_TMP_MARK}{os.getpid()}-{id(data):x}"
            try:
                _write_file(tmp, data)
                os.link(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        else:
            # Written aside and renamed over: a reader (a collector reading a lease being renewed)
            # sees the old object or the new one, never half of one.
            tmp = f"{path}{PUT_TMP_MARK}{os.getpid()}-{id(data):x}"
            try:
                _write_file(tmp, data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise

    def probe(self, *, write: bool) -> None:
        """The root is a directory (created with ``write``) that this process can list, and write to with ``write``."""
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", self.root)
        if not write:
            if os.path.isdir(self.root):
                with os.scandir(self.root):  # EACCES for a directory this process cannot read
                    pass
            return
        _makedirs(self.root)
        _probe_write(self.root)

    # -- reading ---------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        with open(self._p(key), "rb") as f:
            return f.read()

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        fd = os.open(self._p(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            _pread_full(fd, buf, offset, key)
        finally:
            os.close(fd)

    def read_sequential(self, key: str, offset: int, buf: memoryview, *, chunk: int,
                        on_piece: Callable[[memoryview], None] | None = None, cached: bool = False) -> None:
        """Fill ``buf`` from ``key`` at ``offset`` through one open file, ``chunk`` bytes a call.

        A range that is mostly not in the page cache (``mincore``; zerostall's own
        ``O_DIRECT`` writes leave nothing there) is read with ``O_DIRECT`` through a small
        aligned bounce buffer: the page cache costs 0.4-1 s of kernel CPU per GiB on a cold read
        and is filled only to be thrown away. Otherwise one descriptor for the whole range keeps
        the kernel's readahead window growing (a fresh open per piece restarts it), and the range
        is announced up front (``POSIX_FADV_WILLNEED``). ``on_piece`` sees each piece of ``buf``,
        in order, right after it lands, while it is still in cache. A range wholly cached, or
        ``cached`` (the caller just read it through the cache), skips the advice: on cached pages
        it only walks them once more.
        """
        fd = os.open(self._p(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            frac = None if cached or len(buf) < _DIRECT_READ_MIN else _resident(fd, offset, len(buf))
            if frac is not None and frac < 0.5:
                try:
                    dfd = os.open(self._p(key), os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                        raise
                else:
                    try:
                        if _read_direct(dfd, offset, buf, key, on_piece):
                            return
                    finally:
                        os.close(dfd)
            if hasattr(os, "posix_fadvise") and len(buf) and not cached and frac != 1.0:
                os.posix_fadvise(fd, offset, len(buf), os.POSIX_FADV_WILLNEED)
            for off in range(0, len(buf), chunk):
                piece = buf[off:off + chunk]
                _pread_full(fd, piece, offset + off, key)
                if on_piece is not None:
                    on_piece(piece)
        finally:
            os.close(fd)

    def read_vectored(self, key: str, offset: int, bufs: list[memoryview], *, cached: bool = False) -> None:
        """Fill ``bufs`` one after the other from the contiguous range of ``key`` at ``offset``.

        One ``preadv`` scatters a run of neighbouring leaves straight into their destinations:
        one system call and one readahead stream instead of one per leaf.
        """
        total = sum(len(b) for b in bufs)
        fd = os.open(self._p(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if hasattr(os, "posix_fadvise") and total and not cached:
                os.posix_fadvise(fd, offset, total, os.POSIX_FADV_WILLNEED)
            done, idx, skip = 0, 0, 0
            while done < total:
                iov = [bufs[idx][skip:], *bufs[idx + 1:idx + _IOV_MAX]]
                got = os.preadv(fd, iov, offset + done)
                if got == 0:
                    raise EOFError(f"{key}: object ends before byte {offset + total}")
                done += got
                while got:  # advance past what this call filled
                    left = len(bufs[idx]) - skip
                    if got >= left:
                        got -= left
                        idx, skip = idx + 1, 0
                    else:
                        skip += got
                        got = 0
        finally:
            os.close(fd)

    def scan(self, key: str, offset: int, length: int, on_piece: Callable[[memoryview], None], *,
             chunk: int = _SCRATCH) -> None:
        """Hand ``on_piece`` the bytes of ``key`` at ``offset``, in order, without keeping them.

        What a load verifies before it writes anything into its templates, for bytes not yet in
        the page cache (cached ones it checks through :meth:`map_file`): buffered reads into this
        thread's scratch buffer (``chunk`` bytes at most, checksummed while in L2), which also
        leave the range in the page cache for the copy that follows. Pieces are valid only
        during the call.
        """
        if not length:
            return
        fd = os.open(self._p(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            scratch = _scratch()
            step = max(1, min(chunk, len(scratch)))
            for a in range(offset, offset + length, step):
                piece = scratch[:min(step, offset + length - a)]
                _pread_full(fd, piece, a, key)
                on_piece(piece)
        finally:
            os.close(fd)

    def fill_cache(self, key: str, offset: int, length: int, *, piece: int = 0,
                   on_filled: Callable[[int], None] | None = None) -> None:
        """Bring the range into the page cache, reporting read errors, without copying it anywhere.

        ``sendfile`` to ``/dev/null``: the kernel reads the pages into the cache and discards
        them at the other end (a tenth of the CPU of reading them into a buffer, measured), and a
        failed read is an ``OSError`` with its errno here, not later. Does nothing where that is
        not available; the caller checks what is cached either way.

        With ``on_filled``, the range is read front to back in ``piece``-byte calls on this one
        descriptor, whose readahead window keeps growing (a descriptor per piece read 256 MiB
        cold in 0.126 s against 0.097 s, benchmarks/probes/cold_read_probe.py), and
        ``on_filled(end)`` is called after each with the file offset filled up to.
        """
        if not length or not hasattr(os, "sendfile"):
            return
        fd = os.open(self._p(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            null = _devnull()
            if null is None:
                return
            end = offset + length
            step = piece if piece > 0 and on_filled is not None else end - offset
            for a in range(offset, end, step):
                pos, stop = a, min(a + step, end)
                while pos < stop:
                    try:
                        n = os.sendfile(null, fd, pos, min(stop - pos, 1 << 30))
                    except OSError as exc:
                        if exc.errno in (errno.EINVAL, errno.ENOSYS) and pos == offset:
                            return  # this kernel or filesystem cannot: the caller reads instead
                        raise
                    if n == 0:
                        raise EOFError(f"{key}: object ends before byte {end}")
                    pos += n
                if on_filled is not None:
                    on_filled(stop)
        finally:
            os.close(fd)

    def map_file(self, key: str) -> MappedFile | None:
        """A read-only mapping of the whole of ``key`` (None when it is empty or cannot be mapped).

        For bytes already in the page cache: a load checksums them and copies them out of the
        cache's own pages, with no system call per piece and no copy into a scratch buffer.
        """
        fd = os.open(self._p(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            if not size or _libc() is None:
                return None
            try:
                m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            except (OSError, ValueError):
                return None
            mf, fd = MappedFile(m, fd), -1  # the descriptor stays open for cachestat
            return mf
        finally:
            if fd >= 0:
                os.close(fd)

    def size(self, key: str) -> int:
        return os.stat(self._p(key)).st_size

    def exists(self, key: str) -> bool:
        try:
            os.lstat(self._p(key))
        except OSError as exc:
            # os.path.lexists says False for a manifest it may not stat (EACCES): a committed step
            # then looked absent, and a load silently took an older one. Say so, as S3 does (403).
            if exc.errno in _CANNOT_TELL:
                raise
            return False
        except ValueError:  # a NUL in the name: no such file can exist
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._p(prefix)))
        except (FileNotFoundError, NotADirectoryError):  # as on an object store: nothing there
            return []

    # -- metadata --------------------------------------------------------------------------

    def delete(self, prefix: str) -> None:
        path = self._p(prefix)
        while os.path.isdir(path) and not os.path.islink(path):
            try:
                shutil.rmtree(path, ignore_errors=False)
            except FileNotFoundError:
                # Another process removes it at the same moment (two ranks' writers removing an
                # aborted attempt): rmtree stops at the first entry the other one took. Go on with
                # what is left, so that the directory is gone on return: a writer that found its
                # attempt still there would keep its lease, and the lease would keep the attempt's
                # decision file from the sweep until it expired. Each pass removes something or
                # finds the directory gone.
                continue
        if os.path.lexists(path) and not os.path.isdir(path):
            os.unlink(path)

    def rename(self, src: str, dst: str) -> None:
        s, d = self._p(src), self._p(dst)
        if os.path.lexists(d):
            raise FileExistsError(errno.EEXIST, "target exists", d)
        try:
            os.rename(s, d)  # fails with ENOTEMPTY/EEXIST if a non-empty directory appeared
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(errno.EEXIST, "target exists", d) from exc
            raise

    def sync(self, prefix: str) -> None:
        fsync_dir(self._p(prefix))


class MappedFile:
    """A read-only mapping of a data file, touched only where the page cache holds it.

    A page of a file mapping that is not in the cache is read from disk when first touched, and
    a read error there is a ``SIGBUS`` rather than an ``EIO``: callers ask :meth:`cached` right
    before they touch a range, and read the ordinary way when it says no.
    """

    def __init__(self, m: mmap.mmap, fd: int = -1) -> None:
        """Owns ``m`` and ``fd`` (the file's descriptor, if given: residency by ``cachestat``)."""
        self._m = m
        self._fd = fd
        self.view = memoryview(m)
        self._arr = np.frombuffer(m, dtype=np.uint8)
        self._addr = int(self._arr.ctypes.data)

    def cached(self, offset: int, length: int) -> bool:
        """Whether every page of the range is in the page cache right now (``mincore``)."""
        libc = _libc()
        if libc is None or offset < 0 or offset + length > len(self._arr):
            return False
        if self._fd >= 0:
            got = _cachestat(self._fd, offset, length)
            if got is not None:
                return got[0] == got[1]
        start = offset - offset % mmap.PAGESIZE
        size = offset + length - start
        vec = np.zeros((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE, dtype=np.uint8)
        if libc.mincore(ctypes.c_void_p(self._addr + start), ctypes.c_size_t(size),
                        vec.ctypes.data_as(ctypes.c_void_p)) != 0:
            return False
        return bool((vec & 1).all())

    def copy_into(self, offset: int, dest: memoryview, crc: int | None = None) -> int | None:
        """Copy the bytes at ``offset`` into ``dest`` (without holding the GIL); with ``crc``,
        their CRC32C too where the copy's pass can compute it (``memcopy.copy_array``)."""
        out = np.frombuffer(dest, dtype=np.uint8)
        return copy_array(out, self._arr[offset:offset + len(out)], crc)

    def close(self) -> None:
        self.view.release()
        del self._arr
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        unmap_later(self._m)  # a view still alive somewhere: the mapping goes with it


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _aligned(buf: memoryview, length: int) -> bool:
    import ctypes

    if len(buf) < _round_up(length, _ALIGN) or buf.readonly:
        return False
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return addr % _ALIGN == 0


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):  # pwrite may write less than asked
        w = os.pwrite(fd, view[done:], offset + done)
        if w == 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        done += w


def _parallel_pwrite(fd: int, buf: memoryview, end: int, threads: int, chunk: int) -> None:
    ranges = [(off, min(chunk, end - off)) for off in range(0, end, chunk)]

    def write_range(r: tuple[int, int]) -> None:
        off, n = r
        _pwrite_all(fd, buf[off:off + n], off)

    if threads <= 1 or len(ranges) <= 1:
        for r in ranges:
            write_range(r)
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(ranges))) as pool:
        for _ in pool.map(write_range, ranges):
            pass


def _resident(fd: int, offset: int, length: int) -> float | None:
    """The fraction of the range's pages in the page cache (``mincore`` on a mapping of it); None
    when that cannot be told.

    Mapping a file without touching it reads nothing, and ``mincore`` only looks the pages up;
    a probe read (even ``RWF_NOWAIT``) would start readahead of the very range it asks about.
    """
    libc = _libc()
    if libc is None:
        return None
    got = _cachestat(fd, offset, length)
    if got is not None:
        return got[0] / got[1] if got[1] else 1.0
    start = offset - offset % mmap.PAGESIZE
    size = offset + length - start
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = np.zeros(pages, dtype=np.uint8)
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec.ctypes.data_as(ctypes.c_void_p)) != 0:
            return None
        return int(np.count_nonzero(vec & 1)) / pages
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_SYS_CACHESTAT = 451  # Linux 6.5+, on x86-64 and on the architectures of the generic table (arm64, riscv)
_cachestat_ok = platform.machine() in ("x86_64", "aarch64", "arm64", "riscv64")  # until the kernel says no


def _cachestat(fd: int, offset: int, length: int) -> tuple[int, int] | None:
    """``(pages cached, pages)`` of the range, by ``cachestat(2)``; None where that is missing.

    Counted by the kernel per folio of the page cache: about 0.1 ms for a GiB here, where
    ``mincore`` on a mapping of it (one byte per 4 KiB page) takes 40-140 ms.
    """
    global _cachestat_ok
    libc = _libc()
    if not _cachestat_ok or libc is None or not hasattr(libc, "syscall"):
        return None
    start = offset - offset % mmap.PAGESIZE
    pages = (offset + length - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    rng, out = _CachestatRange(start, pages * mmap.PAGESIZE), _Cachestat()
    if libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # older kernel, or a seccomp filter
            _cachestat_ok = False
        return None
    return int(out.cache), pages


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is False:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _LIBC = lib
        except (OSError, AttributeError):
            _LIBC = None
    return _LIBC if isinstance(_LIBC, ctypes.CDLL) else None


def _bounce() -> tuple[memoryview, np.ndarray]:
    """This thread's page-aligned read buffer (anonymous mmap), made on first use."""
    b = getattr(_local, "bounce", None)
    if b is None:
        m = mmap.mmap(-1, _BOUNCE)
        b = _local.bounce = (memoryview(m), np.frombuffer(m, dtype=np.uint8))
    return b


def _devnull() -> int | None:
    """A descriptor on /dev/null for :meth:`LocalStorage.fill_cache`, opened once per process."""
    global _DEVNULL
    if _DEVNULL is False:
        try:
            _DEVNULL = os.open(os.devnull, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            _DEVNULL = None
    return _DEVNULL if isinstance(_DEVNULL, int) and not isinstance(_DEVNULL, bool) else None


def _scratch() -> memoryview:
    """This thread's scan buffer, made on first use."""
    b: memoryview | None = getattr(_local, "scratch", None)
    if b is None:
        b = _local.scratch = memoryview(mmap.mmap(-1, _SCRATCH))
    return b


def _read_direct(fd: int, offset: int, buf: memoryview, key: str,
                 on_piece: Callable[[memoryview], None] | None) -> bool:
    """Fill ``buf`` from an ``O_DIRECT`` descriptor at ``offset`` through the bounce buffer.

    Reads cover whole 4 KiB blocks around the range; only the range's bytes are copied out
    (numpy copies without holding the GIL). Returns False, before anything was copied, if the
    kernel refuses the direct read (EINVAL), so the caller can fall back to buffered reads.
    """
    view, arr = _bounce()
    dest = np.frombuffer(buf, dtype=np.uint8)
    end = offset + len(buf)
    pos = offset - offset % _ALIGN
    first = True
    while pos < end:
        want = min(_BOUNCE, _round_up(end - pos, _ALIGN))
        try:
            got = os.preadv(fd, [view[:want]], pos)
        except OSError as exc:
            if first and exc.errno == errno.EINVAL:
                return False
            raise
        first = False
        lo = max(pos, offset)
        hi = min(pos + got, end)
        if hi <= lo:
            raise EOFError(f"{key}: object ends before byte {end}")
        for a in range(lo, hi, _PIECE):
            b = min(a + _PIECE, hi)
            np.copyto(dest[a - offset:b - offset], arr[a - pos:b - pos])  # on_piece reads it from cache
            if on_piece is not None:
                on_piece(buf[a - offset:b - offset])
        if got < want and hi < end:
            raise EOFError(f"{key}: object ends before byte {end}")
        pos += got
    return True


def _pread_full(fd: int, buf: memoryview, offset: int, key: str) -> None:
    n = len(buf)
    done = 0
    while done < n:
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise EOFError(f"{key}: object ends before byte {offset + n}")
        done += got


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, except that a file in the way is ``ENOTDIR``.

    ``makedirs`` reports a regular file at ``path`` as ``FileExistsError``, which would reach the
    caller as ``CheckpointExistsError``: the truth is that the directory cannot be created.
    """
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, "not a directory (a file is in the way)", path) from None


def _probe_write(directory: str) -> None:
    """Create a file in ``directory`` and remove it: what a save does first (root is not exempt
    from a read-only mount, a full quota or a missing directory, so this fails for root too)."""
    try:
        # An unnamed file (O_TMPFILE) leaves nothing behind even if this process dies right here.
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o600)
        os.close(fd)
        return
    except AttributeError:
        pass  # no O_TMPFILE in this Python build
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    path = os.path.join(directory, f".zerostall-probe-{os.getpid()}-{threading.get_ident():x}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    os.close(fd)
    os.unlink(path)
