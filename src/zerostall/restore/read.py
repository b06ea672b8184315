"""Read execution: fill every planned destination from the data files, in parallel, verified.

Reads run on ``LoadOptions.io_threads`` threads, largest first. A large leaf streams through one
open file (the local backend reads cold ranges with ``O_DIRECT``), checksummed piece by piece
while each piece is still in cache; runs of neighbouring small leaves are read with one
vectored call straight into their destinations.

All or nothing (``LoadOptions(atomic=True)``; the default streams, one verified pass, see
:meth:`_Reader.stream_spans`): reads into a template's own memory
(``ReadRequest.in_place``) are held back until everything verified. :func:`prepare_reads`
checks those leaves where they lie -- the page cache's own pages through the local backend's
``scan``, or a staging copy on other backends -- and finishes every other read; only the callable
it returns writes into the templates, and by then nothing is left to verify.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

import zerostall.memcopy as memcopy
from zerostall.checksum import checksum
from zerostall.errors import ChecksumMismatchError, CorruptCheckpointError, StorageError, ZerostallError
from zerostall.format.manifest import LeafEntry, Manifest
from zerostall.options import LoadOptions
from zerostall.restore.device import prepare_device_reads
from zerostall.restore.files import missing_file_error
from zerostall.restore.plan import ReadRequest
from zerostall.restore.spans import Span, join_crcs, run_all, split_chunks, split_even, workers
from zerostall.storage import Storage
from zerostall.storage.base import (
    MappedRange,
    as_fill_cache,
    as_map_file,
    as_scan,
    as_sequential,
    as_vectored,
)

__all__ = ["execute_reads", "prepare_reads", "available_memory", "ATOMIC_MEMORY_FRACTION"]

log = logging.getLogger("zerostall")

_VERIFY_CHUNK = 4 << 20
#: A pass that reads as it goes (bytes not yet in the page cache) works in pieces of this size in
#: file order: one thread (:class:`_FillAhead`) brings them into the cache front to back while the
#: pass's threads check (and copy) each piece right behind it, so the pass costs the read and
#: little more.
_FILL_CHUNK = 8 << 20

#: ``atomic="auto"`` holds a load's in-place bytes back (in the page cache, or in a staging copy)
#: only while they are at most this fraction of the memory the kernel reports available.
ATOMIC_MEMORY_FRACTION = 0.5

_T = TypeVar("_T")
#: A pass's work on one piece: ``(requests, piece, warm, reader, piece index)`` -> the piece's
#: spans with their CRC32Cs (see ``_Reader.verify_piece``, ``_Reader.stream_piece``).
_PieceFn = Callable[[list[ReadRequest], list[Span], bool, "_FillAhead | None", int], list[tuple[Span, int]]]


def available_memory() -> int | None:
    """Bytes the kernel could hand out without swapping (``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def execute_reads(storage: Storage, name: str, m: Manifest, reads: list[ReadRequest], opts: LoadOptions, path: str) -> None:
    """Fill every request's destination, verified; all or nothing per ``opts.atomic``."""
    prepare_reads(storage, name, m, reads, opts, path)()


def prepare_reads(storage: Storage, name: str, m: Manifest, reads: list[ReadRequest], opts: LoadOptions,
                  path: str) -> Callable[[], None]:
    """Do every read and every check that can happen before a template byte changes; return the rest.

    When the load is atomic (see ``LoadOptions.atomic``), no in-place destination has changed
    when this returns or raises, and the returned callable copies the verified bytes in (only an
    I/O error can still fail it). Otherwise everything is read here and the callable does nothing;
    with ``atomic=False`` an error raised then says that templates may be partly overwritten
    (``"auto"`` beyond its memory bound says so in its INFO line instead).
    A collective load calls the callable only once every rank has verified.
    """
    try:
        return _prepare(storage, name, m, reads, opts, path)
    except ZerostallError as exc:
        if opts.atomic is False and any(q.in_place or q.device is not None for q in reads):
            exc.message += ("; this load was not all or nothing, so templates loaded in place may be partly "
                            "overwritten (LoadOptions(atomic=True) leaves them unchanged)")
        raise


def _prepare(storage: Storage, name: str, m: Manifest, reads: list[ReadRequest], opts: LoadOptions,
             path: str) -> Callable[[], None]:
    # Every file read here was checked by _Files when its leaves were planned.
    if not reads:
        return _nothing
    r = _Reader(storage, name, m, opts, path)
    on_device = [q for q in reads if q.device is not None]
    if on_device:
        # First, so that a bad leaf there fails the load before any host template is touched
        # either; held back on the device (or host) when all or nothing: see restore.device.
        held = [q for q in on_device if q.verify] if opts.verify else []
        hold = bool(held) and opts.atomic is not False
        send = prepare_device_reads(r, storage, on_device, verify=opts.verify, hold=hold,
                                    host_ok=lambda: _atomic(held, opts, path), group=_group,
                                    io_threads=opts.io_threads)
        rest = [q for q in reads if q.device is None]
        host = _prepare(storage, name, m, rest, opts, path) if rest else _nothing

        def both() -> None:
            host()
            send()
        return both
    held = [q for q in reads if q.in_place and q.verify] if opts.verify else []
    if not held or not _atomic(held, opts, path):
        # One pass. Leaves whose data file maps (local files, a memory-tier image) are read by byte
        # ranges on every core, each piece brought into the page cache, checksummed and copied
        # right behind (restore.spans); the rest group by group.
        streamed = r.mappable(reads)
        if r.copy_by_groups(streamed):
            streamed = []
        ids = {id(q) for q in streamed}
        try:
            r.stream_spans(streamed)
            r.read_fresh([q for q in reads if id(q) not in ids])
        finally:
            r.close()
        return _nothing
    fresh = [q for q in reads if not (q.in_place and q.verify)]
    if r.scan is None:  # no way to look at the bytes where they lie: verify a staging copy
        staged = [ReadRequest(q.leaf, _scratch(q.leaf.nbytes), q.verify) for q in held]
        r.read_fresh(fresh + staged)

        def copy_staged() -> None:
            for q, s in zip(held, staged, strict=True):
                q.dest[:] = s.dest
        return copy_staged
    # Leaves whose data file maps (the page cache's pages, or a memory-tier image) are checked and
    # copied by byte ranges on every core (restore.spans); the rest group by group.
    mapped = r.mappable(held)
    ids = {id(q) for q in mapped}
    held_tasks = [g for g in r.tasks(held) if id(g[0]) not in ids]
    try:
        r.run([(g, False) for g in r.tasks(fresh)] + [(g, True) for g in held_tasks], r.read_or_scan)
        r.verify_spans(mapped)
    except BaseException:
        r.close()
        raise

    def copy_verified() -> None:
        try:
            r.copy_spans(mapped)
            r.run(held_tasks, r.copy_held)
        finally:
            r.close()
    return copy_verified


def _scratch(n: int) -> memoryview:
    buf: Any = np.empty(n, dtype=np.uint8)  # not zeroed: every byte is read over
    return memoryview(buf)


def _nothing() -> None:
    return None


def _atomic(held: list[ReadRequest], opts: LoadOptions, path: str) -> bool:
    if opts.atomic is not True and opts.atomic != "auto":
        return False
    if opts.atomic == "auto":
        need = sum(q.leaf.nbytes for q in held)
        avail = available_memory()
        if avail is not None and need > avail * ATOMIC_MEMORY_FRACTION:
            log.info("%s: loading %d bytes in place, more than %.0f%% of the %d bytes of available memory: "
                     "not all-or-nothing (a failure may leave the template partly overwritten; "
                     "LoadOptions(atomic=True) forces it)", path, need, ATOMIC_MEMORY_FRACTION * 100, avail)
            return False
    return True


class _Reader:
    """One load's reads: grouping, the read and scan primitives, the thread pool."""

    def __init__(self, storage: Storage, name: str, m: Manifest, opts: LoadOptions, path: str) -> None:
        self.storage, self.name, self.m, self.opts, self.path = storage, name, m, opts, path
        # Verifying, read in cache-sized pieces and checksum each one right after it lands, while it
        # is still in cache: one pass over memory instead of two.
        self.chunk = min(opts.chunk_bytes, _VERIFY_CHUNK) if opts.verify else opts.chunk_bytes
        # The optional read paths the backend declares (storage.base.Capabilities)
        self.vectored = as_vectored(storage)
        self.sequential = as_sequential(storage)
        self.scan = as_scan(storage)
        self.map_file = as_map_file(storage)
        self.fill_cache = as_fill_cache(storage)
        self._maps: dict[int, MappedRange | None] = {}  # data file index -> its mapping, or None
        self._maps_lock = threading.Lock()
        self._mapped: set[int] = set()  # id() of held groups verified through a mapping

    def tasks(self, reads: list[ReadRequest]) -> list[list[ReadRequest]]:
        tasks = _group(reads, self.chunk) if self.vectored is not None else [[r] for r in reads]
        # Largest first, so one big read does not finish last on its own.
        tasks.sort(key=lambda g: -sum(r.leaf.nbytes for r in g))
        return tasks

    def read_fresh(self, reqs: list[ReadRequest]) -> None:
        """Read and check ``reqs`` into their own (not template) memory, group by group."""
        self.run(self.tasks(reqs), self.read_group)

    def run(self, tasks: list[_T], fn: Callable[[_T], None]) -> None:
        if self.opts.io_threads == 1 or len(tasks) <= 1:
            for t in tasks:
                fn(t)
            return
        with ThreadPoolExecutor(max_workers=self.opts.io_threads, thread_name_prefix="zerostall-read") as pool:
            futures = [pool.submit(fn, t) for t in tasks]
            errors = [f.exception() for f in futures]
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error

    def key(self, leaf: LeafEntry) -> str:
        return f"{self.name}/{self.m.files[leaf.file].path}"

    def fail(self, exc: BaseException, leaf: LeafEntry) -> BaseException:
        if isinstance(exc, EOFError):
            return CorruptCheckpointError(f"data ends early: {exc}", path=self.path, key=leaf.key)
        if isinstance(exc, FileNotFoundError):
            return missing_file_error(self.storage, self.name, self.m.files[leaf.file].path, self.path, leaf.key)
        assert isinstance(exc, OSError)
        return StorageError(f"read failed: {exc}", errno=exc.errno, path=self.path, key=leaf.key)

    def check(self, r: ReadRequest, got: int) -> None:
        leaf = r.leaf
        if not (self.opts.verify and r.verify):
            return
        if leaf.crc32c is None:
            raise CorruptCheckpointError("leaf has no checksum to verify (load with verify=False)",
                                         path=self.path, key=leaf.key)
        if got != leaf.crc32c:
            raise ChecksumMismatchError(
                f"checksum mismatch: crc32c {got:#010x}, manifest says {leaf.crc32c:#010x}; the data file "
                f"{self.m.files[leaf.file].path} is corrupt", path=self.path, key=leaf.key)

    # -- reading into destinations -----------------------------------------------------------

    def read_one(self, r: ReadRequest, want: bool, chunk: int, cached: bool = False) -> None:
        leaf = r.leaf
        got = 0

        def add(piece: memoryview) -> None:
            nonlocal got
            got = checksum(piece, got)

        try:
            if self.sequential is not None:  # one open file per leaf: readahead spans the leaf
                self.sequential.read_sequential(self.key(leaf), leaf.offset, r.dest, chunk=chunk,
                                                on_piece=add if want else None, cached=cached)
            else:
                for off in range(0, leaf.nbytes, chunk):
                    piece = r.dest[off:off + chunk]
                    self.storage.read_into(self.key(leaf), leaf.offset + off, piece)
                    if want:
                        add(piece)
        except (EOFError, OSError) as exc:
            raise self.fail(exc, leaf) from exc
        if want:
            self.check(r, got)

    def read_group(self, group: list[ReadRequest], verify: bool = True, cached: bool = False) -> None:
        want = [verify and self.opts.verify and r.verify for r in group]
        if len(group) == 1:
            self.read_one(group[0], want[0], self.chunk if want[0] else self.opts.chunk_bytes, cached)
            return
        first = group[0].leaf
        bufs: list[memoryview] = []
        pos = first.offset
        for r in group:  # alignment gaps between leaves land in a scratch buffer
            if r.leaf.offset > pos:
                bufs.append(memoryview(bytearray(r.leaf.offset - pos)))
            bufs.append(r.dest)
            pos = r.leaf.offset + r.leaf.nbytes
        try:
            assert self.vectored is not None
            self.vectored.read_vectored(self.key(first), first.offset, bufs, cached=cached)
        except (EOFError, OSError) as exc:
            raise self.fail(exc, first) from exc
        for r, w in zip(group, want, strict=True):
            if w:
                self.check(r, checksum(r.dest))

    def read_unverified(self, group: list[ReadRequest]) -> None:
        # The scan just went through the page cache (local backend): no residency checks again.
        self.read_group(group, verify=False, cached=True)

    # -- verifying where the bytes lie -------------------------------------------------------

    def scan_group(self, group: list[ReadRequest]) -> None:
        """Checksum a run of neighbouring leaves without writing to their destinations."""
        start = group[0].leaf.offset
        end = group[-1].leaf.offset + group[-1].leaf.nbytes
        crcs = [0] * len(group)
        state = [0, start]  # the first leaf not yet complete, the file offset of the next piece

        def on_piece(piece: memoryview) -> None:
            i, pos = state
            stop = pos + len(piece)
            while i < len(group):
                lf = group[i].leaf
                lo, hi = max(lf.offset, pos), min(lf.offset + lf.nbytes, stop)
                if hi > lo:
                    crcs[i] = checksum(piece[lo - pos:hi - pos], crcs[i])
                if lf.offset + lf.nbytes > stop:
                    break
                i += 1
            state[0], state[1] = i, stop

        assert self.scan is not None
        try:
            self.scan.scan(self.key(group[0].leaf), start, end - start, on_piece)
        except (EOFError, OSError) as exc:
            raise self.fail(exc, group[0].leaf) from exc
        for r, c in zip(group, crcs, strict=True):
            self.check(r, c)

    def read_or_scan(self, task: tuple[list[ReadRequest], bool]) -> None:
        group, held = task
        if not held:
            self.read_group(group)
        elif not self.verify_mapped(group):
            self.scan_group(group)

    # -- bytes already in the page cache: checksum and copy them where they lie ---------------

    def mapping(self, file: int) -> Any:
        with self._maps_lock:
            if file not in self._maps:
                try:
                    self._maps[file] = (self.map_file.map_file(self.key_of_file(file))
                                        if self.map_file is not None else None)
                except OSError:
                    self._maps[file] = None  # read the ordinary way, which reports the error properly
            return self._maps[file]

    def mapped(self, file: int) -> MappedRange:
        """The mapping of data file ``file``, which :meth:`mappable` opened."""
        mf = self._maps[file]
        assert mf is not None  # only requests that mappable() returned get here
        return mf

    def key_of_file(self, file: int) -> str:
        return f"{self.name}/{self.m.files[file].path}"

    def verify_mapped(self, group: list[ReadRequest]) -> bool:
        """Checksum a run of leaves in the page cache's own pages (read into the cache first if need
        be); False if they cannot be had there."""
        mf = self.mapping(group[0].leaf.file)
        start = group[0].leaf.offset
        end = group[-1].leaf.offset + group[-1].leaf.nbytes
        if mf is None:
            return False
        if not mf.cached(start, end - start):
            if self.fill_cache is None:
                return False
            try:  # read into the cache only, errors reported; then checksum it there
                self.fill_cache.fill_cache(self.key(group[0].leaf), start, end - start)
            except (EOFError, OSError) as exc:
                raise self.fail(exc, group[0].leaf) from exc
            if not mf.cached(start, end - start):  # evicted already: verify a copy instead
                return False
        for r in group:
            lf = r.leaf
            got = 0
            for a in range(lf.offset, lf.offset + lf.nbytes, _VERIFY_CHUNK):
                got = checksum(mf.view[a:min(a + _VERIFY_CHUNK, lf.offset + lf.nbytes)], got)
            self.check(r, got)
        self._mapped.add(id(group))
        return True

    def copy_held(self, group: list[ReadRequest]) -> None:
        """Write a verified run of leaves into their destinations: from the mapping while the
        pages are still cached (checked again: they may have been evicted since), else by reads."""
        mf = self._maps.get(group[0].leaf.file)
        start = group[0].leaf.offset
        end = group[-1].leaf.offset + group[-1].leaf.nbytes
        if id(group) in self._mapped and mf is not None and mf.cached(start, end - start):
            for r in group:
                mf.copy_into(r.leaf.offset, r.dest)
            return
        self.read_unverified(group)

    # -- by byte ranges, on every core: leaves whose data file maps --------------------------

    def mappable(self, held: list[ReadRequest]) -> list[ReadRequest]:
        """The held requests whose data file maps, in file order (their mappings opened here)."""
        if self.map_file is None or not held:
            return []
        return sorted((q for q in held if self.mapping(q.leaf.file) is not None),
                      key=lambda q: (q.leaf.file, q.leaf.offset))

    def copy_by_groups(self, reqs: list[ReadRequest]) -> bool:
        """Whether a one-pass load of ``reqs`` is better left to the group-by-group reads: nothing
        to check and nothing to read from disk, only one copy, and no streaming stores for it.
        With cached stores the group reads cost less CPU (``preadv`` from the page cache: 0.16-0.17
        s per GiB against 0.20 s through a fresh mapping); with streaming stores
        (:mod:`zerostall.memcopy`) the copy out of the mapping on every core wins (1 GiB warm, 7
        pairs: median 0.096 s against 0.125 s; ``benchmarks/probes/restore_ab.py``)."""
        return (not memcopy.STREAMING and not any(self.opts.verify and q.verify for q in reqs)
                and self.resident(reqs))

    def resident(self, reqs: list[ReadRequest]) -> bool:
        """Whether every byte of ``reqs`` (whose files are mapped) is in memory right now."""
        return all(self.mapped(f).cached(lo, hi - lo) for f, lo, hi in _extents(reqs))

    def pieces(self, reqs: list[ReadRequest], n: int) -> tuple[bool, list[list[Span]]]:
        """Whether every byte of ``reqs`` is resident (asked once), and the pieces of a pass over
        them: one run per thread when resident, else :data:`_FILL_CHUNK` pieces in file order."""
        if self.resident(reqs):
            return True, split_even([q.leaf.nbytes for q in reqs], n)
        index = {id(q): i for i, q in enumerate(reqs)}
        # Neighbours are packed up to a whole piece: a piece is the unit the reader reports filled
        # and a thread then checks, so small leaves would add a hand-over each.
        groups = [[(index[id(q)], q.leaf.nbytes) for q in g] for g in _group(reqs, _FILL_CHUNK)]
        return False, split_chunks(groups, _FILL_CHUNK)

    def verify_spans(self, reqs: list[ReadRequest]) -> None:
        """Checksum every byte of ``reqs`` where it lies, split evenly between the threads when
        it is all in memory already, else read into the page cache piece by piece (in file order)
        and checked right behind the read. Raises for the first bad leaf in file order."""
        if not reqs:
            return
        for q, crc in zip(reqs, self.by_pieces(reqs, self.verify_piece), strict=True):
            self.check(q, crc or 0)

    def by_pieces(self, reqs: list[ReadRequest], do: _PieceFn) -> list[int | None]:
        """Run ``do`` over the pieces of a pass over ``reqs`` (:meth:`pieces`; cold, behind the
        reader of :meth:`fill_ahead`) on every core; each request's CRC32C joined from its parts."""
        n = workers(self.opts.io_threads)
        warm, pieces = self.pieces(reqs, n)
        with self.fill_ahead(reqs, pieces, warm) as filler:
            if filler is None and not warm:
                n = max(n, self.opts.io_threads)  # the threads' own reads mostly wait for the disk
            parts = [p for got in run_all(lambda k: do(reqs, pieces[k], warm, filler, k), range(len(pieces)), n)
                     for p in got]
        return join_crcs(parts, len(reqs))

    def fill_ahead(self, reqs: list[ReadRequest], pieces: list[list[Span]], warm: bool) -> _FillAhead:
        """The pass's reader: fills ``pieces`` in order on a thread of its own when they are not
        resident and the storage can fill its page cache (else it enters as None)."""
        fill = None if warm else self.fill_cache
        if fill is None:
            return _FillAhead(None, [])
        spans = []
        for piece in pieces:
            first, last = reqs[piece[0][0]].leaf, reqs[piece[-1][0]].leaf
            spans.append((first.file, self.key(first), first.offset + piece[0][1], last.offset + piece[-1][2]))
        return _FillAhead(fill.fill_cache, spans)

    def filled(self, filler: _FillAhead | None, k: int, leaf: LeafEntry) -> None:
        """Wait until the reader has brought piece ``k`` into the page cache (or stopped short of
        it); its read error, if it had one, raised here against ``leaf``."""
        if filler is None:
            return
        exc = filler.wait(k)
        if exc is None:
            return
        if isinstance(exc, (EOFError, OSError)):
            raise self.fail(exc, leaf) from exc
        raise exc

    def verify_piece(self, reqs: list[ReadRequest], piece: list[Span], warm: bool, filler: _FillAhead | None,
                     k: int) -> list[tuple[Span, int]]:
        """Checksum a piece's spans: straight from the mapping when the pass found everything
        resident (``warm``: not asked again, ``mincore`` over a GiB costs tens of milliseconds),
        else once the reader has filled it (if there is one), each span asked first."""
        self.filled(filler, k, reqs[piece[0][0]].leaf)
        out = []
        for i, lo, hi in piece:
            leaf = reqs[i].leaf
            mf = self.mapped(leaf.file)
            a = leaf.offset + lo
            if warm or mf.cached(a, hi - lo):
                crc = checksum(mf.view[a:a + hi - lo])
            else:  # evicted already (or never cached): read it through a scratch buffer
                acc = [0]

                def add(view: memoryview, acc: list[int] = acc) -> None:
                    acc[0] = checksum(view, acc[0])
                assert self.scan is not None
                try:
                    self.scan.scan(self.key(leaf), a, hi - lo, add)
                except (EOFError, OSError) as exc:
                    raise self.fail(exc, leaf) from exc
                crc = acc[0]
            out.append(((i, lo, hi), crc))
        return out

    def copy_spans(self, reqs: list[ReadRequest]) -> None:
        """Copy verified bytes into their destinations, split evenly between the threads: out of
        the mapping while it is resident (checked again right before), else by reads."""
        if not reqs:
            return

        # Resident right now (asked once for all: a page of a file mapping that has to come from
        # disk turns a read error into SIGBUS); else each span is asked before it is touched.
        warm = all(self.mapped(f).cached(lo, hi - lo) for f, lo, hi in _extents(reqs))

        def copy(piece: list[Span]) -> None:
            for i, lo, hi in piece:
                q = reqs[i]
                mf = self.mapped(q.leaf.file)
                a = q.leaf.offset + lo
                if warm or mf.cached(a, hi - lo):
                    mf.copy_into(a, q.dest[lo:hi])
                    continue
                try:
                    self.storage.read_into(self.key(q.leaf), a, q.dest[lo:hi])
                except (EOFError, OSError) as exc:
                    raise self.fail(exc, q.leaf) from exc

        n = workers(self.opts.io_threads)
        run_all(copy, split_even([q.leaf.nbytes for q in reqs], n), n)

    def stream_spans(self, reqs: list[ReadRequest]) -> None:
        """Read, checksum and copy ``reqs`` in one pass, by byte ranges on every core (a load
        that is not all-or-nothing): warm, the bytes are cut into one run per thread; cold, into
        pieces of :data:`_FILL_CHUNK` in file order, each brought into the page cache
        (``fill_cache``, a buffered read: on this VM's virtual disk ``O_DIRECT`` reads ran at about
        a third of the page cache's rate, benchmarks/probes/cold_read_probe.py) while the other threads
        checksum and copy theirs. Raises for the first bad leaf in file order, after every piece
        has been copied."""
        if not reqs:
            return
        for q, crc in zip(reqs, self.by_pieces(reqs, self.stream_piece), strict=True):
            if self.opts.verify and q.verify:
                self.check(q, crc or 0)

    def stream_piece(self, reqs: list[ReadRequest], piece: list[Span], warm: bool, filler: _FillAhead | None,
                     k: int) -> list[tuple[Span, int]]:
        """Copy a piece's spans into their destinations, checksummed in the copy's own pass (or
        ``_FUSE`` bytes at a time right before they are copied, read from memory once); cold,
        once the reader has filled the piece (see :meth:`verify_piece`)."""
        self.filled(filler, k, reqs[piece[0][0]].leaf)
        out = []
        for i, lo, hi in piece:
            q = reqs[i]
            leaf = q.leaf
            mf = self.mapped(leaf.file)
            want = self.opts.verify and q.verify
            a = leaf.offset + lo
            dest = q.dest[lo:hi]
            if warm or mf.cached(a, hi - lo):  # resident: no read error can become a SIGBUS
                out.append(((i, lo, hi), _copy_checked(mf, a, dest, want)))
                continue
            acc = [0]  # evicted already (or never cached): read into the destination, then check it

            def add(view: memoryview, acc: list[int] = acc) -> None:
                acc[0] = checksum(view, acc[0])
            try:
                for b in range(0, hi - lo, _VERIFY_CHUNK):
                    part = dest[b:b + _VERIFY_CHUNK]
                    self.storage.read_into(self.key(leaf), a + b, part)
                    if want:
                        add(part)
            except (EOFError, OSError) as exc:
                raise self.fail(exc, leaf) from exc
            out.append(((i, lo, hi), acc[0]))
        return out

    def close(self) -> None:
        with self._maps_lock:
            maps, self._maps = list(self._maps.values()), {}
        for mf in maps:
            if mf is not None:
                mf.close()


class _FillAhead:
    """A cold pass's reader: brings its pieces into the page cache in file order, on a thread of
    its own, while the pass's threads check (and copy) each piece as soon as it has landed.

    Why one reader and not each thread reading its own piece: the disk is read the way the raw
    read reads it, one stream front to back, and the checks trail it by a piece instead of
    waiting for a whole round of reads (256 MiB cold: filled by four threads 32 MiB at a time and
    checked by each, 0.123 s; one reader and checks 8 MiB behind, 0.097-0.109 s; the raw read
    0.101-0.112 s; benchmarks/probes/cold_read_probe.py). Neighbouring pieces of one file are one
    ``fill_cache`` call, one descriptor: its readahead keeps growing.

    A piece the reader did not fill (it stopped at a read error, or the storage filled nothing)
    is reported as done anyway: the pass asks the page cache span by span and reads what is
    missing itself. A read error is handed to the thread that waits for the piece it hit.
    """

    #: Pieces this close together in one file are filled by one call, the gap read too.
    _JOIN_GAP = 1 << 20

    def __init__(self, fill: Callable[..., None] | None, spans: list[tuple[int, str, int, int]]) -> None:
        self._fill, self._spans = fill, spans  # per piece: (file, key, start, end)
        self._done = [threading.Event() for _ in spans]
        self._errors: list[BaseException | None] = [None] * len(spans)
        self._stop = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _FillAhead | None:
        if self._fill is None or not self._spans:
            return None
        self._thread = threading.Thread(target=self._run, name="zerostall-fill", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True  # the pass ended (or failed): read no further
        if self._thread is not None:
            self._thread.join()

    def wait(self, k: int) -> BaseException | None:
        """Block until piece ``k`` is filled or will not be; the read error that stopped it, if any."""
        self._done[k].wait()
        return self._errors[k]

    def _runs(self) -> list[tuple[str, int, int, list[int]]]:
        runs: list[tuple[str, int, int, list[int]]] = []
        last_file = -1
        for k, (file, key, start, end) in enumerate(self._spans):
            if runs and file == last_file and 0 <= start - runs[-1][2] < self._JOIN_GAP:
                key0, start0, _, ks = runs[-1]
                ks.append(k)
                runs[-1] = (key0, start0, end, ks)
            else:
                runs.append((key, start, end, [k]))
            last_file = file
        return runs

    def _run(self) -> None:
        assert self._fill is not None
        for key, start, end, ks in self._runs():
            nxt = 0  # the run's first piece not yet reported

            def on_filled(pos: int, ks: list[int] = ks) -> None:
                nonlocal nxt
                while nxt < len(ks) and self._spans[ks[nxt]][3] <= pos:
                    self._done[ks[nxt]].set()
                    nxt += 1
                if self._stop:
                    raise _Stopped
            try:
                if not self._stop:
                    self._fill(key, start, end - start, piece=_FILL_CHUNK, on_filled=on_filled)
            except _Stopped:
                pass
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that checks the piece it hit
                if nxt < len(ks):
                    self._errors[ks[nxt]] = exc
            finally:
                for k in ks[nxt:]:
                    self._done[k].set()


class _Stopped(Exception):
    """Raised inside a fill to end it early: the pass it reads for has ended."""


#: Where the copy cannot checksum in its own pass (``memcopy.CRC_COPY`` off), a streaming pass
#: checksums this many bytes of the source and copies them right after, while they are in the
#: shared L3 (32 MiB here). Each chunk costs two calls from Python, taken in turn by the threads
#: under the GIL: 1 GiB warm, 9 rounds, this machine: 105 ms a load with 512 KiB chunks, 94 ms
#: with 1 MiB, 83-84 ms with 4 MiB, 86-87 ms with 16-64 MiB.
_FUSE = 4 << 20


def _copy_checked(mf: Any, offset: int, dest: memoryview, want: bool) -> int:
    """Copy ``len(dest)`` bytes of the mapping at ``offset`` into ``dest``; their CRC32C if ``want``."""
    if not want:
        mf.copy_into(offset, dest)
        return 0
    if memcopy.CRC_COPY:  # one pass over the source: each block checksummed, then copied from L1
        got = mf.copy_into(offset, dest, crc=0)
        return checksum(mf.view[offset:offset + len(dest)]) if got is None else got
    crc = 0
    for b in range(0, len(dest), _FUSE):
        part = mf.view[offset + b:offset + min(b + _FUSE, len(dest))]
        crc = checksum(part, crc)
        mf.copy_into(offset + b, dest[b:b + len(part)])
    return crc


def _extents(reqs: list[ReadRequest]) -> list[tuple[int, int, int]]:
    """``(file, start, end)``: the range each data file's requests span (in file order)."""
    out: dict[int, list[int]] = {}
    for q in reqs:  # comparisons, not min/max calls and tuples: this runs per leaf, twice a load
        lf = q.leaf
        lo, hi = lf.offset, lf.offset + lf.nbytes
        span = out.get(lf.file)
        if span is None:
            out[lf.file] = [lo, hi]
        else:
            if lo < span[0]:
                span[0] = lo
            if hi > span[1]:
                span[1] = hi
    return [(f, lo, hi) for f, (lo, hi) in out.items()]


def _group(reads: Iterable[ReadRequest], limit: int) -> list[list[ReadRequest]]:
    """Runs of neighbouring leaves (same file, in file order, gaps under a page, up to ``limit``
    bytes together) to read with one vectored call; a leaf of ``limit`` bytes or more goes alone."""
    groups: list[list[ReadRequest]] = []
    cur: list[ReadRequest] = []
    cur_bytes = 0
    for r in sorted(reads, key=lambda r: (r.leaf.file, r.leaf.offset)):
        leaf = r.leaf
        if leaf.nbytes >= limit:
            groups.append([r])
            continue
        if cur:
            last = cur[-1].leaf
            gap = leaf.offset - (last.offset + last.nbytes)
            if (leaf.file != last.file or not 0 <= gap < 4096 or cur_bytes + leaf.nbytes > limit
                    or len(cur) >= 256):
                groups.append(cur)
                cur, cur_bytes = [], 0
        cur.append(r)
        cur_bytes += leaf.nbytes
    if cur:
        groups.append(cur)
    return groups
