"""A read-only backend over the memory tier's step: the keeper's buffers, mapped in this process.

The keeper hands over its newest in-memory step as a manifest and one shared-memory descriptor
per data file (the staged file images, which are the data files byte for byte). Registered as
``zsimage://<token>`` for as long as a load uses it, so the restore code reads it like any other
storage: the manifest is validated and every leaf is checksummed as usual.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from zerostall.format.layout import MANIFEST_NAME
from zerostall.memcopy import copy_array
from zerostall.storage import register_scheme
from zerostall.storage.base import Capabilities
from zerostall.storage.release import unmap_later

__all__ = ["ImageStorage", "open_image", "SCHEME"]

SCHEME = "zsimage"
_IMAGES: dict[str, ImageStorage] = {}
_LOCK = threading.Lock()
_tokens = itertools.count(1)
_LIVE: weakref.WeakSet[ImageStorage] = weakref.WeakSet()
#: a forked child's inherited images' mappings, never unmapped there (see :func:`_forget_in_child`)
_FORKED: list[object] = []


class ImageStorage:
    """Checkpoint ``name``: ``manifest`` and data files ``data/<file>`` mapped read-only from ``fds``.

    Takes ownership of the descriptors (closed once mapped). Use as a context manager; leaving
    unmaps the files and unregisters the URL.
    """

    atomic_rename = False
    capabilities = Capabilities(vectored_reads=True, scan=True, map_file=True, probe=True)

    def __init__(self, name: str, manifest: bytes, files: Sequence[tuple[str, int, int, int]]) -> None:
        """``files``: ``(file name, length, mapping size, fd)`` per data file."""
        self.name = name
        self._objects: dict[str, bytes] = {f"{name}/{MANIFEST_NAME}": manifest}
        self._maps: list[mmap.mmap] = []
        self._views: dict[str, memoryview] = {}
        #: ``(st_dev, st_ino)`` of each data file's descriptor: the same memfds, the same bytes
        self.identity: tuple[tuple[int, int], ...] = ()
        #: set while :meth:`populate` runs: close() stops it and waits before unmapping
        self._populating = threading.Lock()
        self._stop = threading.Event()
        #: bytes :meth:`populate` has pre-faulted so far
        self.populated = 0
        try:
            self.identity = tuple((st.st_dev, st.st_ino) for st in (os.fstat(f[3]) for f in files))
            for fname, length, size, fd in files:
                m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
                self._maps.append(m)
                if hasattr(mmap, "MADV_DONTFORK"):
                    # A child forked meanwhile (a DataLoader's workers) must not inherit it: its
                    # mapping would keep the step's memory alive after the keeper let go of it.
                    m.madvise(mmap.MADV_DONTFORK)
                self._views[f"{name}/data/{fname}"] = memoryview(m)[:length]
        finally:
            for *_, fd in files:
                os.close(fd)
        self.token = f"{os.getpid()}-{next(_tokens)}"
        self.url = f"{SCHEME}://{self.token}"
        with _LOCK:
            _IMAGES[self.token] = self
            _LIVE.add(self)

    def close(self) -> None:
        self._stop.set()
        with self._populating:  # madvise on a range being unmapped could fault in another mapping
            pass
        with _LOCK:
            _IMAGES.pop(self.token, None)
        for v in self._views.values():
            v.release()
        self._views = {}
        for m in self._maps:  # a view handed out still alive: unmapped when it goes
            unmap_later(m)
        self._maps = []

    def stop_populating(self) -> None:
        """Make a running (or later) :meth:`populate` return after its current piece."""
        self._stop.set()

    def populate(self, piece: int = 64 << 20) -> int:
        """Fault every page of the mapped files into this process's page tables now, ``piece``
        bytes at a time; returns the bytes done (fewer when :meth:`close` stopped it).

        A fresh mapping of the keeper's shared memory costs its first reader about 0.11 s of CPU
        per GiB of page-table work (one entry per 4 KiB page) that a memcpy does not pay. Run on
        a background thread right after a restarted trainer adopts its keeper, this moves that
        work off the first load. ``madvise(MADV_POPULATE_READ)`` through ctypes (the GIL is
        released during the call; ``mmap.madvise`` holds it); on a kernel without it (before
        5.14), one read per page.
        """
        done = 0
        with self._populating:
            # Last byte first: were a load to copy meanwhile (first bytes first), the two would
            # fault disjoint pages.
            for m in reversed(self._maps):
                if self._stop.is_set():
                    break
                arr = np.frombuffer(m, dtype=np.uint8)
                base = arr.ctypes.data
                for a in reversed(range(0, len(arr), piece)):
                    if self._stop.is_set():
                        break
                    n = min(piece, len(arr) - a)
                    if not _populate_read(base + a, n):
                        int(arr[a:a + n:mmap.PAGESIZE].sum())  # numpy reads without holding the GIL
                    done += n
                    self.populated += n
                del arr  # an exported buffer would keep close() from unmapping
        return done

    def __enter__(self) -> ImageStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------

    def _missing(self, key: str) -> FileNotFoundError:
        return FileNotFoundError(errno.ENOENT, "not in the memory tier's step", key)

    def get(self, key: str) -> bytes:
        if key in self._objects:
            return self._objects[key]
        v = self._views.get(key)
        if v is None:
            raise self._missing(key)
        return bytes(v)

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        v = self._views.get(key)
        if v is None:
            data = self.get(key)
            if offset + len(buf) > len(data):
                raise EOFError(f"{key}: object ends before byte {offset + len(buf)}")
            buf[:] = data[offset:offset + len(buf)]
            return
        if offset + len(buf) > len(v):
            raise EOFError(f"{key}: object ends before byte {offset + len(buf)}")
        # numpy copies without holding the GIL (a memoryview assignment holds it): the load's
        # threads copy side by side.
        copy_array(np.frombuffer(buf, dtype=np.uint8), np.frombuffer(v, dtype=np.uint8, count=len(buf), offset=offset))

    def map_file(self, key: str) -> ImageMap | None:
        """The data file's bytes where they lie, for a load that verifies before it copies.

        A memory-tier image is always resident (shared memory), so a load checksums it in place
        and copies it once into its templates: no staging copy, no scratch buffer.
        """
        v = self._views.get(key)
        return ImageMap(v) if v is not None and len(v) else None

    def scan(self, key: str, offset: int, length: int, on_piece: Callable[[memoryview], None], *,
             chunk: int = 1 << 20) -> None:
        """Hand ``on_piece`` the bytes of ``key`` at ``offset`` in ``chunk``-sized views (no copy)."""
        v = self._views.get(key)
        if v is None:
            raise self._missing(key)
        if offset + length > len(v):
            raise EOFError(f"{key}: object ends before byte {offset + length}")
        for a in range(offset, offset + length, max(1, chunk)):
            on_piece(v[a:min(a + chunk, offset + length)])

    def read_vectored(self, key: str, offset: int, bufs: list[memoryview], *, cached: bool = False) -> None:
        """Fill ``bufs`` one after the other from ``key`` at ``offset`` (``cached`` changes nothing:
        an image is always resident)."""
        for b in bufs:
            self.read_into(key, offset, b)
            offset += len(b)

    def size(self, key: str) -> int:
        if key in self._objects:
            return len(self._objects[key])
        v = self._views.get(key)
        if v is None:
            raise self._missing(key)
        return len(v)

    def exists(self, key: str) -> bool:
        keys = list(self._objects) + list(self._views)
        return any(k == key or k.startswith(key + "/") for k in keys) or key == ""

    def list(self, prefix: str) -> list[str]:
        base = prefix.rstrip("/") + "/" if prefix else ""
        keys = list(self._objects) + list(self._views)
        return sorted({k[len(base):].split("/", 1)[0] for k in keys if k.startswith(base)})

    # -- no writing: the memory tier is written by the keeper only --------------------------

    def _read_only(self, key: str) -> OSError:
        return OSError(errno.EROFS, "the memory tier's step is read-only here", key)

    def write_from_buffer(self, key: str, buf: memoryview, length: int, *, threads: int, chunk_bytes: int,
                          direct: bool) -> None:
        raise self._read_only(key)

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        raise self._read_only(key)

    def delete(self, prefix: str) -> None:
        raise self._read_only(prefix)

    def rename(self, src: str, dst: str) -> None:
        raise self._read_only(src)

    def sync(self, prefix: str) -> None:
        return None

    def probe(self, *, write: bool) -> None:
        return None  # an image that is mapped is reachable; it is never written


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_madvise: Callable[[int, int, int], int] | None = None


def _populate_read(addr: int, length: int) -> bool:
    """``madvise(addr, length, MADV_POPULATE_READ)``; False if this kernel or libc cannot."""
    global _madvise
    if _madvise is None:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _madvise = lambda a, n, advice: -1  # noqa: E731
        else:
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
    return _madvise(addr, length, _MADV_POPULATE_READ) == 0


def _open(url: str) -> ImageStorage:
    token = url.split("://", 1)[1].rstrip("/")
    with _LOCK:
        img = _IMAGES.get(token)
    if img is None:
        raise FileNotFoundError(errno.ENOENT, "no such memory-tier image in this process", url)
    return img


def open_image(name: str, manifest: bytes, files: Sequence[tuple[str, int, int, int]]) -> ImageStorage:
    """Map the memory tier's step ``name`` and register it under its :attr:`ImageStorage.url`."""
    return ImageStorage(name, manifest, files)


register_scheme(SCHEME, _open)


def _forget_in_child() -> None:
    """In a forked child the images are not mapped (``MADV_DONTFORK``): drop them without
    unmapping, since an ``mmap`` object's close would unmap whatever the child put there since."""
    for img in list(_LIVE):
        _FORKED.append((img._maps, img._views))
        img._maps, img._views = [], {}
        img._populating = threading.Lock()  # a parent's thread may have held it at the fork
    _IMAGES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class ImageMap:
    """A data file of an image as a load's in-place verification sees a mapped file: always
    resident; closing it leaves the image's own mapping alone."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self._arr = np.frombuffer(view, dtype=np.uint8)

    def cached(self, offset: int, length: int) -> bool:
        return offset >= 0 and offset + length <= len(self._arr)

    def copy_into(self, offset: int, dest: memoryview, crc: int | None = None) -> int | None:
        """Copy the bytes at ``offset`` into ``dest`` (without holding the GIL); with ``crc``,
        their CRC32C too where the copy's pass can compute it (``memcopy.copy_array``)."""
        out = np.frombuffer(dest, dtype=np.uint8)
        return copy_array(out, self._arr[offset:offset + len(out)], crc)

    def close(self) -> None:
        del self._arr
