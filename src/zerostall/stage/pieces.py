"""Stage one byte range of a data file's image into a piece buffer (a save in pieces).

Runs on the training thread. Under ``Checkpointer(host_memory_limit=...)`` a state whose data
file does not fit one staging slot is staged and written in consecutive byte ranges of that file
(:attr:`zerostall.budget.Fit.piece_bytes` each): :func:`fill_piece` writes the part of the header
and of every leaf that falls in the range, zeroes the padding between them, and returns the
CRC32C of each leaf part, which the writer joins into the leaf's (:func:`zerostall.checksum.join_crcs`).
A leaf larger than a piece is split by element ranges; a strided leaf is copied by rows, so no
temporary copy of a whole leaf is made. The bytes are those a whole-slot save stages: the file
written is the same, bit for bit.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zerostall.arraytypes import ArrayLeaf
from zerostall.buffers import HostBuffer
from zerostall.checksum import checksum
from zerostall.dtypes import to_numpy_dtype, to_torch_dtype
from zerostall.format.manifest import LeafEntry

__all__ = ["fill_piece"]

#: a leaf part: (leaf index, first byte, end byte, CRC32C of those bytes)
Part = tuple[int, int, int, int]


def fill_piece(buf: HostBuffer, start: int, length: int, header: bytes, leaves: Sequence[ArrayLeaf],
               rows: Sequence[LeafEntry], starts: Sequence[int]) -> tuple[Part, ...]:
    """Copy bytes ``start:start+length`` of the data file's image into ``buf`` (from 0).

    ``rows`` are the plan's leaf entries (absolute offsets in the file), ``starts`` their offsets
    in order (the plan lays leaves out in ascending order). Returns the leaf parts' CRC32Cs."""
    end = start + length
    mm = buf.mmap
    view = buf.view
    parts: list[Part] = []
    pos = start  # the file position filled up to
    if start < len(header):
        h = min(end, len(header))
        mm[0:h - start] = header[start:h]
        pos = h
    torch = sys.modules.get("torch")
    grad_off = torch.no_grad() if torch is not None else None
    if grad_off is not None:
        grad_off.__enter__()
    try:
        i = max(0, bisect_right(starts, start) - 1)
        while i < len(rows) and rows[i].offset < end:
            row, leaf = rows[i], leaves[i]
            lo, hi = max(start, row.offset), min(end, row.offset + row.nbytes)
            if hi > lo:
                if lo > pos:
                    _zero(mm, pos - start, lo - start)
                _copy_part(mm, lo - start, leaf, lo - row.offset, hi - row.offset)
                parts.append((i, lo - row.offset, hi - row.offset, checksum(view[lo - start:hi - start])))
                pos = hi
            i += 1
    finally:
        if grad_off is not None:
            grad_off.__exit__(None, None, None)
    if pos < end:
        _zero(mm, pos - start, length)
    return tuple(parts)


def _zero(mm: Any, a: int, b: int) -> None:
    np.frombuffer(mm, dtype=np.uint8, count=b - a, offset=a)[:] = 0


def _copy_part(mm: Any, at: int, leaf: ArrayLeaf, lo: int, hi: int) -> None:
    """Bytes ``lo:hi`` of ``leaf`` into ``mm`` at ``at`` (both ends fall between elements:
    pieces are whole pages and leaves start at multiples of 64)."""
    n = hi - lo
    if leaf.kind == "torch":
        torch = sys.modules["torch"]
        dst = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=at).view(to_torch_dtype(leaf.dtype))
        size = dst.element_size()
        _copy_elems(dst, leaf.value, lo // size, hi // size, lambda t: bool(t.is_contiguous()),
                    lambda d, s: d.copy_(s))
    elif leaf.kind in ("numpy", "numpy_scalar"):
        dst_np = np.frombuffer(mm, dtype=np.uint8, count=n, offset=at).view(to_numpy_dtype(leaf.dtype))
        size = dst_np.itemsize
        # a background source (a jax.Array) gives its host view: the whole-slot path reads the same one
        src = np.asarray(leaf.value)
        _copy_elems(dst_np, src, lo // size, hi // size, lambda a: bool(a.flags.c_contiguous),
                    lambda d, s: np.copyto(d, s))
    else:  # bytes and custom handlers' bytes
        mm[at:at + n] = memoryview(leaf.value).cast("B")[lo:hi]


def _copy_elems(dst: Any, src: Any, e0: int, e1: int, contiguous: Callable[[Any], bool],
                copy: Callable[[Any, Any], Any]) -> None:
    """Elements ``e0:e1`` of ``src`` in row-major order into the flat ``dst``: one copy for a
    contiguous (or 1-d) source; otherwise the whole rows as one strided copy and the partial rows
    at both ends by recursion (at most three copies per dimension)."""
    if e0 >= e1:
        return
    if src.ndim <= 1 or contiguous(src):
        copy(dst, src.reshape(-1)[e0:e1])
        return
    rest = tuple(src.shape[1:])
    row = math.prod(rest)
    first, last = -(-e0 // row), e1 // row  # the whole rows: first:last
    if first > last:  # within one row
        r = e0 // row
        _copy_elems(dst, src[r], e0 - r * row, e1 - r * row, contiguous, copy)
        return
    k = 0
    if e0 < first * row:
        k = first * row - e0
        _copy_elems(dst[:k], src[first - 1], row - k, row, contiguous, copy)
    if last > first:
        m = (last - first) * row
        copy(dst[k:k + m].reshape((last - first, *rest)), src[first:last])
        k += m
    if e1 > last * row:
        _copy_elems(dst[k:], src[last], 0, e1 - last * row, contiguous, copy)
