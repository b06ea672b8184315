"""Leaf checksums computed chunk by chunk on the writing thread, right before each chunk is written.

The writer used to checksum every leaf on a thread of its own, beside the thread that writes:
two writer threads runnable at once on a machine whose cores the trainer's OpenMP team uses.
Here the one writing thread checksums the bytes of a chunk and then hands the same chunk to
``O_DIRECT``: one runnable writer thread at a time, and the bytes are read while the write is
about to fetch them anyway. The cost: the checksum pass no longer overlaps the disk, which adds
the CRC time (~0.1 s per GiB) to the time until the save is durable.

``ZEROSTALL_WRITER_PIPELINE=serial`` in the writer's environment selects this (the default stays the
checksum thread until a quiet-machine A/B, ``benchmarks/dip_ab.py``, shows a difference). ``ZEROSTALL_WRITER_PACE=D`` (0 < D < 1) makes
the writer sleep after each chunk's checksum so that it uses at most a fraction D of a core
while checksumming (a bounded duty cycle; the writes themselves sleep in the kernel).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from zerostall.checksum import checksum
from zerostall.messages import LeafRow
from zerostall.persist import faults

__all__ = ["ChunkChecksums", "pipeline", "pace"]

PIPELINE_ENV = "ZEROSTALL_WRITER_PIPELINE"
PACE_ENV = "ZEROSTALL_WRITER_PACE"


def pipeline() -> str:
    """``"threads"`` (default: a checksum thread beside the writes) or ``"serial"`` (checksum on the
    writing thread). Not a measured win yet (docs/performance.md, "The dip, this round"): opt-in."""
    return "serial" if os.environ.get(PIPELINE_ENV, "").strip() == "serial" else "threads"


def pace() -> float:
    """The writer's duty cycle while checksumming (1.0: no pacing)."""
    try:
        d = float(os.environ.get(PACE_ENV, "1"))
    except ValueError:
        return 1.0
    return d if 0.0 < d < 1.0 else 1.0


class ChunkChecksums:
    """CRC32C of every leaf in ``mine``, fed chunk by chunk as each file is written.

    Example::

        sums = ChunkChecksums(leaves, mine, views)
        storage.write_from_buffer(key, views[0], n, ..., before_chunk=sums.hook(0))
        crcs = sums.finish()  # one per leaf of ``mine``, in its order
    """

    def __init__(self, leaves: Sequence[LeafRow], mine: Sequence[int], views: Sequence[memoryview]) -> None:
        self._leaves = leaves
        self._mine = list(mine)
        self._views = views
        self.crcs = [0] * len(self._mine)
        self._covered = [0] * len(self._mine)
        self._duty = pace()
        self._started = False
        #: per file: (position in mine, start, end) sorted by start
        self._by_file: dict[int, list[tuple[int, int, int]]] = {}
        for pos, li in enumerate(self._mine):
            lf = leaves[li]
            self._by_file.setdefault(lf.file, []).append((pos, lf.offset, lf.offset + lf.nbytes))
        for rows in self._by_file.values():
            rows.sort(key=lambda r: r[1])

    def hook(self, file: int) -> Callable[[int, int], None]:
        """The ``before_chunk`` callback for data file ``file`` (chunks come in order of offset)."""
        rows = self._by_file.get(file, [])
        view = self._views[file] if file < len(self._views) else memoryview(b"")
        state = {"next": 0, "done": 0}

        def before_chunk(offset: int, n: int) -> None:
            if not self._started:
                self._started = True
                faults.hit("checksum")
            lo_chunk, hi_chunk = max(offset, state["done"]), offset + n
            if hi_chunk <= lo_chunk:  # offered again after a fallback: already summed
                return
            t = time.thread_time()
            i = state["next"]
            while i < len(rows) and rows[i][1] < hi_chunk:
                pos, s, e = rows[i]
                lo, hi = max(s, lo_chunk), min(e, hi_chunk)
                if lo < hi:
                    self.crcs[pos] = checksum(view[lo:hi], self.crcs[pos])
                    self._covered[pos] += hi - lo
                if e <= hi_chunk:
                    i += 1
                else:
                    break
            state["next"], state["done"] = i, hi_chunk
            if self._duty < 1.0:
                busy = time.thread_time() - t
                time.sleep(busy * (1.0 - self._duty) / self._duty)

        return before_chunk

    def finish(self) -> list[int]:
        """The checksums; a leaf the hooks did not cover whole (none should be) is summed here."""
        if not self._started:
            self._started = True
            faults.hit("checksum")
        for pos, li in enumerate(self._mine):
            lf = self._leaves[li]
            if self._covered[pos] != lf.nbytes:
                self.crcs[pos] = checksum(self._views[lf.file][lf.offset:lf.offset + lf.nbytes])
                self._covered[pos] = lf.nbytes
        return self.crcs
