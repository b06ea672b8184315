"""CRC32C, the checksum of every leaf: computed by the writer, checked by every load and verify.

Hardware-accelerated, and the GIL is released, so the writer's checksum thread runs beside its
writes: the C extension's kernel where it is built (carry-less multiplication on AVX-512
VPCLMULQDQ, about 30 GB/s on one core; the crc32 instruction elsewhere, about 15 GB/s), else the
``crc32c`` package (SSE4.2 / ARMv8 CRC instructions). A bottom layer: both the persist and the
restore side import it.
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c

from zerostall.memcopy import combine
from zerostall.memcopy import crc32c as _fast_crc

__all__ = ["checksum", "checksum_combine", "Span", "split_even", "join_crcs"]

#: ``(item index, start, end)``: bytes ``[start, end)`` of one item (a leaf) of a split pass.
Span = tuple[int, int, int]

_ALIGN = 4096  # cut points between threads: whole pages, so no two threads write one cache line


def checksum(view: memoryview | bytes | bytearray, value: int = 0) -> int:
    """CRC32C of ``view``, continuing from ``value`` (0 starts a new checksum).

    Example::

        >>> checksum(b"123456789") == 0xE3069283
        True
        >>> checksum(b"6789", checksum(b"12345")) == checksum(b"123456789")
        True
    """
    fast = _fast_crc(view, value)  # the C extension's kernel, where built
    return fast if fast is not None else int(crc32c.crc32c(view, value))


# CRC32C's polynomial, bit-reversed (the form the table-less arithmetic below uses).
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (bit-reversed polynomials over GF(2), as zlib's)."""
    m = 1 << 31
    p = 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    t = [1 << 30]  # x^1
    for _ in range(31):
        t.append(_multmodp(t[-1], t[-1]))  # x^(2^k)
    return t


_X2N = _x2n_table()


def checksum_combine(first: int, second: int, second_len: int) -> int:
    """CRC32C of ``A + B`` from ``checksum(A)``, ``checksum(B)`` and ``len(B)``.

    Lets several threads checksum parts of one large buffer and join the results: a few dozen
    integer operations, whatever the lengths.

    Example::

        >>> checksum_combine(checksum(b"12345"), checksum(b"6789"), 4) == checksum(b"123456789")
        True
    """
    if second_len <= 0:
        return first
    fast = combine(first, second, second_len)  # the C extension's, where built
    if fast is not None:
        return fast
    n, k, p = second_len, 3, 1 << 31  # x^(8 * second_len), by squares: x^(n * 2^k), k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, first) ^ (second & 0xFFFFFFFF)


# -- splitting one pass over many leaves between threads, by bytes ---------------------------


def split_even(sizes: Sequence[int], parts: int) -> list[list[Span]]:
    """Cut the concatenation of items of ``sizes`` bytes into ``parts`` runs of nearly equal bytes.

    Cut points fall on page boundaries of the concatenation; runs that would be empty are
    dropped. Every byte of every item is in exactly one span, and spans come in item order.

    Example::

        >>> split_even([10000, 2000], 2)
        [[(0, 0, 4096)], [(0, 4096, 10000), (1, 0, 2000)]]
    """
    total = sum(sizes)
    if total == 0 or parts <= 1:
        return [[(i, 0, n) for i, n in enumerate(sizes) if n]] if total else []
    cuts = sorted({min(total, (total * k // parts) // _ALIGN * _ALIGN) for k in range(1, parts)} | {total})
    out: list[list[Span]] = []
    cur: list[Span] = []
    base = 0  # offset of item i in the concatenation
    ci = 0
    for i, n in enumerate(sizes):
        lo = 0
        while lo < n:
            while cuts[ci] <= base + lo:  # a cut at or before here: start the next run
                if cur:
                    out.append(cur)
                    cur = []
                ci += 1
            hi = min(n, cuts[ci] - base)
            cur.append((i, lo, hi))
            lo = hi
        base += n
    if cur:
        out.append(cur)
    return out


def join_crcs(parts: Sequence[tuple[Span, int]], count: int) -> list[int | None]:
    """Each request's CRC32C from the checksums of its spans (any order); None for a request with
    no span (an empty leaf has none: its checksum is 0)."""
    # Most leaves have one span: their CRC is that span's, with no list per leaf (this runs per leaf).
    first: list[tuple[int, int, int] | None] = [None] * count
    more: dict[int, list[tuple[int, int, int]]] = {}
    for (i, lo, hi), crc in parts:
        if first[i] is None:
            first[i] = (lo, hi, crc)
        else:
            more.setdefault(i, []).append((lo, hi, crc))
    out: list[int | None] = []
    for i, one in enumerate(first):
        if one is None:
            out.append(None)
            continue
        if one[0] == 0 and i not in more:
            out.append(one[2])
            continue
        spans = [one, *more.get(i, ())]
        spans.sort()
        pos, crc = 0, 0
        for lo, hi, c in spans:
            if lo != pos:  # a hole or an overlap: the split is wrong, never a corrupt file
                raise AssertionError(f"spans do not tile the leaf: {lo} after {pos}")
            crc = checksum_combine(crc, c, hi - lo) if lo else c
            pos = hi
        out.append(crc)
    return out
