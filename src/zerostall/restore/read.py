"""Read execution: fill every planned destination from the data files, in parallel, verified.

Reads run on ``LoadOptions.io_threads`` threads, largest first. A large leaf streams through one
open file (the local backend reads cold ranges with ``O_DIRECT``), checksummed piece by piece
while each piece is still in cache; runs of neighbouring small leaves are read with one
vectored call straight into their destinations.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from zerostall.checksum import checksum
from zerostall.errors import ChecksumMismatchError, CorruptCheckpointError, StorageError
from zerostall.manifest import LeafEntry, Manifest
from zerostall.options import LoadOptions
from zerostall.restore.files import missing_file_error
from zerostall.restore.plan import ReadRequest
from zerostall.storage import Storage

__all__ = ["execute_reads"]

_VERIFY_CHUNK = 4 << 20


def execute_reads(storage: Storage, name: str, m: Manifest, reads: list[ReadRequest], opts: LoadOptions, path: str) -> None:
    # Every file read here was checked by _Files when its leaves were planned.
    if not reads:
        return
    # Verifying, read in cache-sized pieces and checksum each one right after it lands, while it
    # is still in cache: one pass over memory instead of two.
    chunk = min(opts.chunk_bytes, _VERIFY_CHUNK) if opts.verify else opts.chunk_bytes
    vectored = getattr(storage, "read_vectored", None)
    tasks = _group(reads, chunk) if vectored is not None else [[r] for r in reads]
    # Largest first, so one big read does not finish last on its own.
    tasks.sort(key=lambda g: -sum(r.leaf.nbytes for r in g))

    def fail(exc: BaseException, leaf: LeafEntry) -> BaseException:
        if isinstance(exc, EOFError):
            return CorruptCheckpointError(f"data ends early: {exc}", path=path, key=leaf.key)
        if isinstance(exc, FileNotFoundError):
            return missing_file_error(storage, name, m.files[leaf.file].path, path, leaf.key)
        assert isinstance(exc, OSError)
        return StorageError(f"read failed: {exc}", errno=exc.errno, path=path, key=leaf.key)

    def check(r: ReadRequest, got: int) -> None:
        leaf = r.leaf
        if not (opts.verify and r.verify):
            return
        if leaf.crc32c is None:
            raise CorruptCheckpointError("leaf has no checksum to verify (load with verify=False)",
                                         path=path, key=leaf.key)
        if got != leaf.crc32c:
            raise ChecksumMismatchError(
                f"checksum mismatch: crc32c {got:#010x}, manifest says {leaf.crc32c:#010x}; the data file "
                f"{m.files[leaf.file].path} is corrupt", path=path, key=leaf.key)

    def read_one(r: ReadRequest) -> None:
        leaf = r.leaf
        fkey = f"{name}/{m.files[leaf.file].path}"
        got = 0

        def add(piece: memoryview) -> None:
            nonlocal got
            got = checksum(piece, got)

        want = opts.verify and r.verify
        try:
            sequential = getattr(storage, "read_sequential", None)
            if sequential is not None:  # one open file per leaf: readahead spans the leaf
                sequential(fkey, leaf.offset, r.dest, chunk=chunk, on_piece=add if want else None)
            else:
                for off in range(0, leaf.nbytes, chunk):
                    piece = r.dest[off:off + chunk]
                    storage.read_into(fkey, leaf.offset + off, piece)
                    if want:
                        add(piece)
        except (EOFError, OSError) as exc:
            raise fail(exc, leaf) from exc
        check(r, got)

    def read_group(group: list[ReadRequest]) -> None:
        if len(group) == 1:
            read_one(group[0])
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
            assert vectored is not None
            vectored(f"{name}/{m.files[first.file].path}", first.offset, bufs)
        except (EOFError, OSError) as exc:
            raise fail(exc, first) from exc
        for r in group:
            check(r, checksum(r.dest) if opts.verify and r.verify else 0)

    if opts.io_threads == 1 or len(tasks) == 1:
        for g in tasks:
            read_group(g)
        return
    with ThreadPoolExecutor(max_workers=opts.io_threads, thread_name_prefix="zerostall-read") as pool:
        futures = [pool.submit(read_group, g) for g in tasks]
        errors = [f.exception() for f in futures]
    first_error = next((e for e in errors if e is not None), None)
    if first_error is not None:
        raise first_error


def _group(reads: list[ReadRequest], limit: int) -> list[list[ReadRequest]]:
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
