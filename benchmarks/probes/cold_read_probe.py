"""Where a cold load's time goes, against a raw sequential read of the same file (one process).

    PYTHONPATH=src:. python -m benchmarks.probes.cold_read_probe [--gib 1] [--repeats 3] [--dir /tmp]

A data file written as zerostall writes it (``O_DIRECT``) is read cold (``POSIX_FADV_DONTNEED``
before every variant) in ways that differ in one thing at a time: the number of parallel streams,
the request size, ``O_DIRECT`` against the page cache, ``sendfile`` into the cache only (what the
all-or-nothing load's fill does) against a read into a buffer, and the copy/CRC passes that follow
a fill. Each repeat runs every variant in turn, the paired raw read (``benchmarks.measure.raw_read``,
the reference of ``restore_ab --cold``) first and again last, so the disk's swings show up in the
reference too. Prints wall and CPU seconds per variant, medians, and each one's ratio to the
median raw read. The ``pipe_*`` variants are the load's cold pass: one thread fills the file
front to back on one descriptor while others checksum each piece behind it (``fresh``: a
descriptor per piece). ``pipe_8M_undo`` / ``pipe_8M_undo_fresh2`` sketch an all-or-nothing load
that writes each verified piece straight into its destination, having first copied the
destination's old bytes aside (into a buffer faulted in beforehand / into a fresh one, as a load
would have to). A diagnosis tool: compare within one run.

What it showed on the 2-vCPU VM of the reference runs (its virtual disk): ``O_DIRECT`` reads ran
at about 1 GB/s whatever the streams (1-8) or request size (1-8 MiB), page-cache fills and
buffered reads at 2.5-3.4 GB/s, so a cold load fills the page cache. One reader with the
checksums 8 MiB behind it read 256 MiB in 0.097-0.109 s against a raw read of 0.101-0.112 s; a
descriptor per piece took 0.126 s against 0.097 s (readahead restarts). Undoing into a fresh
buffer cost more than the copy pass it would hide (1 GiB: 0.59-0.64 s against 0.39-0.43 s, the
raw read 0.35-0.37 s): fresh pages fault and, with the page cache full, reclaim. So the
all-or-nothing load keeps holding bytes back.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks import measure
from zerostall.checksum import checksum

_DEVNULL = os.open(os.devnull, os.O_WRONLY)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ranges(size: int, piece: int) -> list[tuple[int, int]]:
    return [(a, min(piece, size - a)) for a in range(0, size, piece)]


def _parallel(n: int, items: list[tuple[int, int]], fn: Callable[[tuple[int, int]], object]) -> None:
    if n == 1:
        for it in items:
            fn(it)
        return
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(fn, items))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        import torch

        import zerostall

        n = int(args.gib * (1 << 30)) // 4 // 64
        zerostall.save_pytree(d / "c", {f"p{i}": torch.randn(n) for i in range(64)})
        path = next((d / "c" / "data").iterdir())
        size = os.path.getsize(path)
        mem = mmap.mmap(-1, (size + 4095) // 4096 * 4096)
        buf = memoryview(mem)
        arr = np.frombuffer(mem, dtype=np.uint8)
        arr[:] = 1  # faulted in, not timed
        dst = np.empty(size, dtype=np.uint8)
        dst[:] = 1

        def direct(threads: int, piece: int) -> Callable[[], None]:
            def run() -> None:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                try:
                    _parallel(threads, _ranges(len(buf), piece),
                              lambda r: os.preadv(fd, [buf[r[0]:r[0] + r[1]]], r[0]))
                finally:
                    os.close(fd)
            return run

        def buffered(threads: int, piece: int, crc: bool = False) -> Callable[[], None]:
            def one(r: tuple[int, int], fd: int) -> None:
                os.preadv(fd, [buf[r[0]:r[0] + r[1]]], r[0])
                if crc:
                    checksum(buf[r[0]:r[0] + r[1]])

            def run() -> None:
                fd = os.open(path, os.O_RDONLY)
                try:
                    _parallel(threads, _ranges(size, piece), lambda r: one(r, fd))
                finally:
                    os.close(fd)
            return run

        def fill(threads: int, piece: int, crc: bool = False, copy: bool = False,
                 fresh_fd: bool = True, willneed: bool = False, willneed_piece: bool = False,
                 sequential: bool = False) -> Callable[[], None]:
            def run() -> None:
                m = mmap.mmap(os.open(path, os.O_RDONLY), size, prot=mmap.PROT_READ) if crc or copy else None
                shared = os.open(path, os.O_RDONLY)
                if willneed:
                    os.posix_fadvise(shared, 0, size, os.POSIX_FADV_WILLNEED)

                def one(r: tuple[int, int]) -> None:
                    fd = os.open(path, os.O_RDONLY) if fresh_fd else shared
                    try:
                        pos, end = r[0], r[0] + r[1]
                        if willneed_piece:  # the piece's readahead submitted whole, at once
                            os.posix_fadvise(fd, pos, end - pos, os.POSIX_FADV_WILLNEED)
                        if sequential:  # a fresh descriptor's readahead window doubled from the start
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                        while pos < end:
                            pos += os.sendfile(_DEVNULL, fd, pos, end - pos)
                    finally:
                        if fresh_fd:
                            os.close(fd)
                    if crc and m is not None:
                        checksum(memoryview(m)[r[0]:r[0] + r[1]])
                try:
                    _parallel(threads, _ranges(size, piece), one)
                    if copy and m is not None:
                        src = np.frombuffer(m, dtype=np.uint8)
                        half = size // 2 // 4096 * 4096
                        _parallel(2, [(0, half), (half, size - half)],
                                  lambda r: np.copyto(dst[r[0]:r[0] + r[1]], src[r[0]:r[0] + r[1]]))
                        del src
                finally:
                    os.close(shared)
                    if m is not None:
                        m.close()
            return run

        wants_undo = not args.only or "pipe_8M_undo" in args.only.split(",")
        backup = np.empty(size, dtype=np.uint8) if wants_undo else None  # the old bytes, set aside
        if backup is not None:
            backup[:] = 1  # faulted in, not timed

        def pipe(piece: int, crc_threads: int = 1, copy: bool = False, fresh_fd: bool = False,
                 undo: bool = False, fresh_undo: bool = False) -> Callable[[], None]:
            """One descriptor read front to back by one thread (the raw read's pattern, into the
            cache only), each piece checksummed by the other threads as soon as it has landed."""
            import queue
            import threading

            def run() -> None:
                fd = os.open(path, os.O_RDONLY)
                m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                q: queue.Queue[tuple[int, int] | None] = queue.Queue()

                def filler() -> None:
                    for a, n in _ranges(size, piece):
                        pos = a
                        f = os.open(path, os.O_RDONLY) if fresh_fd else fd
                        while pos < a + n:
                            pos += os.sendfile(_DEVNULL, f, pos, a + n - pos)
                        if fresh_fd:
                            os.close(f)
                        q.put((a, n))
                    for _ in range(crc_threads):
                        q.put(None)

                old = np.empty(size, dtype=np.uint8) if fresh_undo else None  # not faulted in: timed

                def checker() -> None:
                    if undo:  # keep the destination's old bytes first (the disk is the bottleneck)
                        assert backup is not None
                        np.copyto(backup, dst)
                    while (r := q.get()) is not None:
                        if old is not None:  # per piece: the old bytes aside, then copy and checksum
                            np.copyto(old[r[0]:r[0] + r[1]], dst[r[0]:r[0] + r[1]])
                            np.copyto(dst[r[0]:r[0] + r[1]], np.frombuffer(m, dtype=np.uint8, count=r[1], offset=r[0]))
                            checksum(memoryview(m)[r[0]:r[0] + r[1]])
                            continue
                        checksum(memoryview(m)[r[0]:r[0] + r[1]])
                        if undo:  # verified piece straight into the destination
                            np.copyto(dst[r[0]:r[0] + r[1]], np.frombuffer(m, dtype=np.uint8, count=r[1], offset=r[0]))
                ts = [threading.Thread(target=filler)] + [threading.Thread(target=checker) for _ in range(crc_threads)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                if copy:
                    src = np.frombuffer(m, dtype=np.uint8)
                    half = size // 2 // 4096 * 4096
                    _parallel(2, [(0, half), (half, size - half)],
                              lambda r: np.copyto(dst[r[0]:r[0] + r[1]], src[r[0]:r[0] + r[1]]))
                    del src
                m.close()
                os.close(fd)
            return run

        variants: dict[str, Callable[[], object]] = {
            "raw_read": lambda: measure.raw_read(path, buf[:size]),
            "direct_1x8M": direct(1, 8 << 20),
            "direct_2x8M": direct(2, 8 << 20),
            "direct_4x8M": direct(4, 8 << 20),
            "direct_4x4M": direct(4, 4 << 20),
            "direct_8x4M": direct(8, 4 << 20),
            "direct_8x1M": direct(8, 1 << 20),
            "buffered_1x64M": buffered(1, 64 << 20),
            "buffered_2x32M": buffered(2, 32 << 20),
            "buffered_2x32M_crc": buffered(2, 32 << 20, crc=True),
            "buffered_1x4M_crc": buffered(1, 4 << 20, crc=True),
            "fill_1x1G": fill(1, 1 << 40),
            "fill_2x32M": fill(2, 32 << 20),
            "fill_2x32M_shared_fd": fill(2, 32 << 20, fresh_fd=False),
            "fill_4x32M": fill(4, 32 << 20),
            "fill_4x32M_willneed_piece": fill(4, 32 << 20, willneed_piece=True),
            "fill_4x32M_crc": fill(4, 32 << 20, crc=True),
            "fill_4x32M_crc_copy": fill(4, 32 << 20, crc=True, copy=True),
            "fill_4x16M": fill(4, 16 << 20),
            "fill_4x32M_seq": fill(4, 32 << 20, sequential=True),
            "fill_4x64M": fill(4, 64 << 20),
            "fill_2x128M_seq": fill(2, 128 << 20, sequential=True),
            "fill_4x16M_willneed_piece": fill(4, 16 << 20, willneed_piece=True),
            "fill_2x32M_shared_willneed": fill(2, 32 << 20, fresh_fd=False, willneed=True),
            "fill_2x8M_shared": fill(2, 8 << 20, fresh_fd=False),
            "fill_2x32M_shared_crc": fill(2, 32 << 20, crc=True, fresh_fd=False),
            "fill_2x32M_shared_crc_copy": fill(2, 32 << 20, crc=True, copy=True, fresh_fd=False),
            "fill_2x32M_crc": fill(2, 32 << 20, crc=True),
            "fill_2x32M_crc_copy": fill(2, 32 << 20, crc=True, copy=True),
            "pipe_32M_crc": pipe(32 << 20),
            "pipe_8M_crc": pipe(8 << 20),
            "pipe_32M_crc_copy": pipe(32 << 20, copy=True),
            "pipe_8M_crc_copy": pipe(8 << 20, copy=True),
            "pipe_8M_crc_fresh": pipe(8 << 20, fresh_fd=True),
            "pipe_8M_crc_copy_fresh": pipe(8 << 20, copy=True, fresh_fd=True),
            "pipe_8M_crc2_copy": pipe(8 << 20, crc_threads=2, copy=True),
            "pipe_4M_crc_copy": pipe(4 << 20, copy=True),
            "pipe_8M_undo": pipe(8 << 20, undo=True),
            "pipe_8M_undo_fresh2": pipe(8 << 20, crc_threads=2, fresh_undo=True),
            "raw_read_again": lambda: measure.raw_read(path, buf[:size]),
        }
        if args.only:
            keep = {"raw_read", "raw_read_again", *args.only.split(",")}
            variants = {k: v for k, v in variants.items() if k in keep}
        times: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(args.repeats):
            for k, f in variants.items():
                measure.drop_cache(path)
                c0, t0 = _cpu(), time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(_cpu() - c0)
            print(f"repeat {r}: " + " ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()), flush=True)
        raw = statistics.median(times["raw_read"] + times["raw_read_again"])
        print(f"\n{size / 2**30:.2f} GiB cold, medians of {args.repeats}, load avg {os.getloadavg()[0]:.2f}; "
              f"ratio = median raw read / variant")
        for k in variants:
            med = statistics.median(times[k])
            print(f"  {k:24s} {med:.3f} s  CPU {statistics.median(cpu[k]):.3f} s  {raw / med:.2f}x  "
                  f"(min {min(times[k]):.3f} max {max(times[k]):.3f})")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
