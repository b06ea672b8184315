"""Node-loss survival by XOR parity across hosts: the layout, bulk XOR, accumulation and rebuild.

A *parity group* is ``G >= 2`` members, numbered ``0 .. G-1`` (in the product one rank per host of
``G`` consecutive hosts, the same local index on each). Member ``m``'s *share* is the bytes of its
step's data files concatenated in manifest file order, ``sizes[m]`` bytes (sizes may differ; 0 is
allowed). The layout is RAID-5's, with the parity rotating over the members:

* the chunk size is ``c = ceil(max(sizes) / (G - 1))`` rounded up to a multiple of :data:`ALIGN`
  (4 KiB); member ``m``'s share, zero-padded to ``(G - 1) * c`` bytes, is ``G - 1`` chunks;
* stripe ``s`` is held by member ``s``: its parity is ``P_s = XOR over every m != s of chunk
  j(m, s)`` of ``m``, with ``j(m, s) = s if s < m else s - 1``: member ``m``'s chunks go, in order,
  to the ``G - 1`` other members, one each. ``G = 2`` is a mirror (each holds the other's share).

What holds:

* every member holds ``c`` bytes for the others (``c * (G - 1) >= max(sizes)``), about
  ``1 / (G - 1)`` of a share instead of a full replica's copy; each member sends ``G - 1`` chunks,
  about one share, per step: a replica's traffic;
* any one member's share is rebuilt bit for bit from the ``G - 1`` others' shares and parities
  (:func:`rebuild`); two members of one group lost is a :class:`~zerostall.errors.ReplicaError`;
* a member's bytes past ``sizes[m]`` are implicit zeros: never sent, never stored, never
  allocated (:meth:`ParityLayout.chunk_range` clips to the real bytes);
* parity is arithmetic, not a check: a wrong parity byte gives a wrong rebuilt byte, silently, so
  a rebuilt share is checked against its manifest's CRC32Cs before it is loaded, as a replica is;
* a parity of step N rebuilds only with every survivor's share *of step N*: the holders' parities
  and the members' shares of one step go together: each member keeps its step-N share and each
  holder its step-N parity until every holder of the group has completed step N+1's parity;
  until then N is the step a loss rebuilds.

Bulk XOR is numpy's ``bitwise_xor(..., out=)`` over ``np.frombuffer`` views of the caller's
buffers (no copy of a source, no per-byte Python), which releases the GIL. Bytes (``uint8``)
throughout: numpy vectorises ``uint8`` with the same SIMD width as ``uint64`` (equal rates, out of
cache and in it), while a ``uint64`` view of a buffer that is not 8-aligned is about half as fast
(``python -m benchmarks.parity`` measures all three). Several sources into one destination go in
:data:`BLOCK`-sized pieces, each finished (every source XORed in) while it is in the core's cache,
so the destination crosses the memory bus once instead of once per source. One thread: two
threads over halves of the same buffers gained nothing consistent on a 2-core machine (the
benchmark measures it), and a keeper shares its host's cores with training; a caller with cores
to spare runs independent stripes (a rebuild's, or several groups') on threads of its own, in
parallel, since the GIL is released.

No torch, no zerostall stage/engine/tree: this is the codec only; moving chunks between hosts,
keeping a step's shares while its parities form, and checking a rebuilt share are the caller's.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from zerostall.errors import ArgumentTypeError, InvalidArgumentError, ReplicaError

__all__ = [
    "ALIGN",
    "BLOCK",
    "Accumulator",
    "ParityLayout",
    "Views",
    "encode",
    "partial",
    "pieces",
    "rebuild",
    "xor_into",
]

#: a chunk's size is a multiple of this: chunks of a page-aligned share start on page boundaries
#: (mapped, sent and received page by page; a caller's threads split on them sharing no cache line)
ALIGN = 4096
#: bytes of destination finished at a time when several sources go into it: well inside a core's
#: L2 (1 MiB on this machine's cores and most servers') beside the sources' lines streaming through
BLOCK = 512 << 10

#: a share: one buffer, or its data files' buffers in manifest order, read as one
Views: TypeAlias = memoryview | Sequence[memoryview]

_Bytes = npt.NDArray[np.uint8]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _int(name: str, v: object) -> int:
    if type(v) is not int:
        raise ArgumentTypeError(f"{name} must be an int, got {type(v).__name__}", argument=name)
    return v


def _array(view: object, name: str, *, writable: bool = False) -> _Bytes:
    """``view``'s bytes as a uint8 array over the same memory (no copy)."""
    try:
        mv = view if isinstance(view, memoryview) else memoryview(view)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentTypeError(f"{name} must be a buffer (a memoryview), got {type(view).__name__}",
                                argument=name) from None
    if not mv.c_contiguous:
        raise InvalidArgumentError(f"{name} must be contiguous", argument=name)
    if writable and mv.readonly:
        raise InvalidArgumentError(f"{name} is read-only: it is written into", argument=name)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return np.frombuffer(mv, dtype=np.uint8)


class _Concat:
    """Byte arrays read as one: ``arrays[i]`` covers ``[starts[i], starts[i] + len)``, in order."""

    __slots__ = ("arrays", "size", "starts")

    def __init__(self, arrays: Sequence[_Bytes]) -> None:
        self.arrays: list[_Bytes] = []
        self.starts: list[int] = []
        pos = 0
        for a in arrays:
            if len(a):  # an empty file covers nothing; it would tie two starts
                self.arrays.append(a)
                self.starts.append(pos)
                pos += len(a)
        self.size = pos

    @classmethod
    def of(cls, views: object, name: str, *, writable: bool = False) -> _Concat:
        if isinstance(views, memoryview | bytes | bytearray):
            return cls([_array(views, name, writable=writable)])
        if not isinstance(views, Sequence):
            raise ArgumentTypeError(f"{name} must be a memoryview or a sequence of them, got "
                                    f"{type(views).__name__}", argument=name)
        return cls([_array(v, f"{name}[{i}]", writable=writable) for i, v in enumerate(views)])

    def window(self, start: int, end: int) -> _Concat:
        """Bytes ``[start, end)``, counted from 0 (``end`` clipped to the size)."""
        end = min(end, self.size)
        out = _Concat(())
        if start >= end:
            return out
        i = bisect.bisect_right(self.starts, start) - 1
        while i < len(self.arrays) and self.starts[i] < end:
            a, s = self.arrays[i], self.starts[i]
            lo, hi = max(start, s), min(end, s + len(a))
            out.arrays.append(a[lo - s:hi - s])
            out.starts.append(lo - start)
            i += 1
        out.size = end - start
        return out

    def piece(self, lo: int, hi: int) -> _Bytes:
        """Bytes ``[lo, hi)``, which lie within one array (the caller cut at every array's start)."""
        i = bisect.bisect_right(self.starts, lo) - 1
        s = self.starts[i]
        return self.arrays[i][lo - s:hi - s]


def _cuts(dst: _Concat, sources: Sequence[_Concat]) -> list[int]:
    """Where ``dst`` is cut so that each piece lies in one array of every buffer, each source
    covers it wholly or not at all, and none is longer than :data:`BLOCK`."""
    n = dst.size
    cuts = {0, n, *range(BLOCK, n, BLOCK)}
    for c in (dst, *sources):
        cuts.update(s for s in c.starts if 0 < s < n)
    cuts.update(c.size for c in sources if 0 < c.size < n)
    return sorted(cuts)


def _combine(dst: _Concat, sources: Sequence[_Concat], *, assign: bool) -> None:
    """``dst`` ``=`` (``assign``) or ``^=`` the XOR of ``sources``; a source shorter than ``dst``
    is zeros past its end. Piece by piece: every source goes into a piece while it is in cache."""
    cuts = _cuts(dst, sources)
    for x, y in itertools.pairwise(cuts):
        d = dst.piece(x, y)
        fresh = assign  # nothing of the old contents counts yet: the first source is copied
        for src in sources:
            if x >= src.size:
                continue
            if fresh:
                np.copyto(d, src.piece(x, y))
                fresh = False
            else:
                np.bitwise_xor(d, src.piece(x, y), out=d)
        if fresh:
            d.fill(0)


def xor_into(dst: memoryview, src: memoryview) -> None:
    """``dst ^= src``, in place, byte for byte; both the same length. ``src`` is not copied.

    Example::

        >>> d = bytearray(b"\\x0f\\xf0")
        >>> xor_into(memoryview(d), memoryview(b"\\xff\\xff"))
        >>> bytes(d)
        b'\\xf0\\x0f'
    """
    d, s = _array(dst, "dst", writable=True), _array(src, "src")
    if len(d) != len(s):
        raise InvalidArgumentError(f"dst has {len(d)} bytes and src {len(s)}: XOR needs equal lengths",
                                   argument="src")
    np.bitwise_xor(d, s, out=d)


@dataclass(frozen=True)
class ParityLayout:
    """Where each member's chunks go in a parity group of ``group`` members (the module docstring).

    ``sizes[m]`` is member ``m``'s share in bytes. ``chunk`` is ``c``, the size of every chunk and
    of every parity.

    Example::

        >>> lay = ParityLayout((10_000, 0, 5), 3)
        >>> lay.chunk, lay.stripes_of(0), lay.chunk_range(0, 2), lay.chunk_range(2, 0)
        (8192, (1, 2), (8192, 10000), (0, 5))
    """

    sizes: tuple[int, ...]
    group: int
    chunk: int = field(init=False)

    def __post_init__(self) -> None:
        g = _int("group", self.group)
        if g < 2:
            raise InvalidArgumentError(f"a parity group needs at least 2 members, got group={g}", argument="group")
        if not isinstance(self.sizes, Sequence):
            raise ArgumentTypeError(f"sizes must be a sequence of ints, got {type(self.sizes).__name__}",
                                    argument="sizes")
        sizes = tuple(_int(f"sizes[{i}]", v) for i, v in enumerate(self.sizes))
        if len(sizes) != g:
            raise InvalidArgumentError(f"sizes has {len(sizes)} entries for a group of {g}: one per member",
                                       argument="sizes")
        if min(sizes) < 0:
            raise InvalidArgumentError(f"sizes must be >= 0, got {sizes}", argument="sizes")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "chunk", _ceil(_ceil(max(sizes), g - 1), ALIGN) * ALIGN)

    def _member(self, name: str, m: object) -> int:
        v = _int(name, m)
        if not 0 <= v < self.group:
            raise InvalidArgumentError(f"{name} {v} is not a member of a group of {self.group}", argument=name)
        return v

    def chunk_index(self, member: int, stripe: int) -> int:
        """``j(member, stripe)``: which of ``member``'s chunks goes into stripe ``stripe``'s parity.
        A member's chunks never go into its own stripe (``member == stripe`` raises)."""
        m, s = self._member("member", member), self._member("stripe", stripe)
        if m == s:
            raise InvalidArgumentError(f"member {m} holds stripe {s}: none of its own chunks goes into it",
                                       argument="stripe")
        return s if s < m else s - 1

    def chunk_range(self, member: int, stripe: int) -> tuple[int, int]:
        """``(start, end)`` within ``member``'s share of its chunk for ``stripe``, clipped to its real
        ``sizes[member]`` bytes: the chunk's other ``chunk - (end - start)`` bytes are implicit zeros."""
        j = self.chunk_index(member, stripe)
        n = self.sizes[member]
        return min(j * self.chunk, n), min((j + 1) * self.chunk, n)

    def stripes_of(self, member: int) -> tuple[int, ...]:
        """The stripes (their holders) that ``member``'s chunks ``0 .. G-2`` go to, in chunk order."""
        m = self._member("member", member)
        return tuple(s for s in range(self.group) if s != m)

    def extra_bytes(self, member: int) -> int:
        """What ``member`` holds for the others: its stripe's parity, ``chunk`` bytes."""
        self._member("member", member)
        return self.chunk


class _Intervals:
    """Disjoint ``[a, b)`` ranges, kept merged and sorted."""

    __slots__ = ("_a", "_b", "total")

    def __init__(self) -> None:
        self._a: list[int] = []
        self._b: list[int] = []
        self.total = 0

    def gaps(self, a: int, b: int) -> list[tuple[int, int]]:
        """The parts of ``[a, b)`` no range covers."""
        out = []
        pos = a
        i = bisect.bisect_right(self._b, a)
        while i < len(self._a) and self._a[i] < b:
            if self._a[i] > pos:
                out.append((pos, self._a[i]))
            pos = max(pos, self._b[i])
            i += 1
        if pos < b:
            out.append((pos, b))
        return out

    def add(self, a: int, b: int) -> None:
        self.total += sum(y - x for x, y in self.gaps(a, b))
        i = bisect.bisect_left(self._b, a)  # the first range ending at or after a
        j = bisect.bisect_right(self._a, b)  # past the last range starting at or before b
        if i < j:
            a, b = min(a, self._a[i]), max(b, self._b[j - 1])
        self._a[i:j] = [a]
        self._b[i:j] = [b]


class Accumulator:
    """Stripe ``stripe``'s parity formed in ``out`` (``layout.chunk`` bytes) as the members' chunks
    arrive, in pieces of any size, in any order, interleaved between members.

    Each byte of ``out`` is written as the first piece covering it arrives (a copy: ``out``'s old
    contents never count, so a reused buffer needs no clearing) and XORed by every later one; the
    bytes no member has (past every member's real bytes) are zeroed when the last piece arrives.
    ``out`` is the parity once :attr:`complete`; before, it is partial sums. :meth:`add` refuses,
    with a :class:`~zerostall.errors.ReplicaError` and ``out`` unchanged, a piece from the holder
    itself, outside the member's real bytes of its chunk, or overlapping bytes of that member
    already added (a chunk's bytes count once); a member number outside the group is an
    :class:`~zerostall.errors.InvalidArgumentError`.

    Example::

        >>> lay = ParityLayout((0, 6, 3), 3)
        >>> p = bytearray(lay.chunk)
        >>> acc = Accumulator(lay, 0, memoryview(p))
        >>> acc.add(2, 0, memoryview(b"abc"))
        >>> acc.add(1, 0, memoryview(b"\\x00\\x00\\x00xyz"))
        >>> acc.complete, bytes(p[:6])
        (True, b'abcxyz')
    """

    def __init__(self, layout: ParityLayout, stripe: int, out: memoryview) -> None:
        if not isinstance(layout, ParityLayout):
            raise ArgumentTypeError(f"layout must be a ParityLayout, got {type(layout).__name__}", argument="layout")
        self.layout = layout
        self.stripe = layout._member("stripe", stripe)
        n = len(_array(out, "out", writable=True))
        if n != layout.chunk:
            raise InvalidArgumentError(f"out has {n} bytes; stripe {self.stripe}'s parity has {layout.chunk}",
                                       argument="out")
        self._out = out
        #: each member's real bytes of its chunk for this stripe: what must arrive from it
        self._need: dict[int, int] = {}
        for m in layout.stripes_of(self.stripe):
            a, b = layout.chunk_range(m, self.stripe)
            self._need[m] = b - a
        self._got = {m: _Intervals() for m in self._need}
        self._covered = _Intervals()
        self._done = False
        self._finish()

    @property
    def complete(self) -> bool:
        """Every member's real bytes of its chunk have arrived: ``out`` is the parity."""
        return self._done

    @property
    def missing(self) -> tuple[int, ...]:
        """The members some of whose chunk's bytes have not arrived."""
        return tuple(m for m, n in self._need.items() if self._got[m].total < n)

    def add(self, member: int, offset_in_chunk: int, piece: memoryview) -> None:
        """XOR ``piece``, bytes ``[offset_in_chunk, offset_in_chunk + len(piece))`` of ``member``'s
        chunk for this stripe, into ``out``. Not thread-safe: one caller adds at a time."""
        m = self.layout._member("member", member)
        if m == self.stripe:
            raise ReplicaError(f"member {m} sent a piece for its own stripe {m}: a member's chunks go only "
                               f"into the other members' parities")
        off = _int("offset_in_chunk", offset_in_chunk)
        src = _array(piece, "piece")
        end = off + len(src)
        if off < 0 or end > self._need[m]:
            raise ReplicaError(f"member {m}'s piece [{off}, {end}) for stripe {self.stripe} is outside its chunk's "
                               f"{self._need[m]} real bytes (the rest of the {self.layout.chunk}-byte chunk is "
                               f"implicit zeros and never sent)")
        if off == end:
            return
        if self._got[m].gaps(off, end) != [(off, end)]:
            raise ReplicaError(f"member {m}'s bytes [{off}, {end}) of its chunk for stripe {self.stripe} overlap "
                               f"bytes of it already added: a chunk's bytes count once")
        dst = _array(self._out, "out", writable=True)
        fresh = self._covered.gaps(off, end)
        edges = sorted({off, end, *(x for g in fresh for x in g)})
        firsts = {a for a, _ in fresh}
        for a, b in itertools.pairwise(edges):
            d, s = dst[a:b], src[a - off:b - off]
            if a in firsts:  # no earlier piece covers these bytes: out's old contents do not count
                np.copyto(d, s)
            else:
                np.bitwise_xor(d, s, out=d)
        self._got[m].add(off, end)
        self._covered.add(off, end)
        self._finish()

    def _finish(self) -> None:
        if self._done or self.missing:
            return
        dst = _array(self._out, "out", writable=True)
        for a, b in self._covered.gaps(0, self.layout.chunk):
            dst[a:b] = 0
        self._done = True


def pieces(share: Views, start: int, end: int) -> list[memoryview]:
    """The views of bytes ``[start, end)`` of ``share`` (one buffer, or its files' buffers read as
    one), in order, without copying: what a member sends of a chunk, or where a rebuilt chunk is
    received into. ``end`` past the share's end is clipped to it.

    Example::

        >>> [bytes(v) for v in pieces([memoryview(b"abc"), memoryview(b"defg")], 2, 5)]
        [b'c', b'de']
    """
    lo, hi = _int("start", start), _int("end", end)
    if not 0 <= lo <= hi:
        raise InvalidArgumentError(f"need 0 <= start <= end, got [{lo}, {hi})", argument="start")
    views = [share] if isinstance(share, memoryview) else list(share)
    out: list[memoryview] = []
    pos = 0
    for v in views:
        mv = memoryview(v)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        n = len(mv)
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append(mv[a - pos:b - pos])
        pos += n
    return out


def _share(layout: ParityLayout, m: int, views: object, name: str, *, writable: bool = False) -> _Concat:
    c = _Concat.of(views, name, writable=writable)
    if c.size != layout.sizes[m]:
        raise InvalidArgumentError(f"{name} has {c.size} bytes; member {m}'s share has {layout.sizes[m]}",
                                   argument=name)
    return c


def _chunk_of(layout: ParityLayout, share: _Concat, m: int, stripe: int, n: int) -> _Concat:
    """The first ``n`` bytes of ``m``'s chunk for ``stripe`` (its real bytes of them)."""
    a, b = layout.chunk_range(m, stripe)
    return share.window(a, min(b, a + n))


def encode(layout: ParityLayout, stripe: int, shares: Mapping[int, Views], out: memoryview) -> None:
    """``out`` (``layout.chunk`` bytes) := stripe ``stripe``'s parity, from every other member's
    whole share at hand: the one-call form of an :class:`Accumulator`, each piece of ``out``
    finished while in cache."""
    s = layout._member("stripe", stripe)
    want = set(layout.stripes_of(s))
    if set(shares) != want:
        raise InvalidArgumentError(f"stripe {s}'s parity needs the shares of members {sorted(want)}, got "
                                   f"{sorted(shares)}", argument="shares")
    dst = _Concat.of(out, "out", writable=True)
    if dst.size != layout.chunk:
        raise InvalidArgumentError(f"out has {dst.size} bytes; a parity has {layout.chunk}", argument="out")
    srcs = [_chunk_of(layout, _share(layout, m, shares[m], f"shares[{m}]"), m, s, layout.chunk) for m in sorted(want)]
    _combine(dst, srcs, assign=True)


def partial(layout: ParityLayout, stripe: int, target: int, members: Mapping[int, Views], out: memoryview) -> None:
    """``out ^=`` the XOR of the given members' chunks for ``stripe`` (the first ``len(out)`` bytes
    of each; ``len(out) <= layout.chunk``): one hop of rebuilding ``target``'s chunk for ``stripe``
    over a chain.

    The chain: the holder of ``stripe`` starts ``out`` as a copy of its parity's first
    ``L = end - start`` bytes (``layout.chunk_range(target, stripe)``), each survivor not in
    ``{stripe, target}`` applies its own share and forwards ``out``; after every one of them,
    ``out`` is ``target``'s chunk. Each hop sends ``L`` bytes, and the new host receives ``L`` per
    stripe (its share, once) instead of every survivor's chunks. The order of hops does not matter.
    """
    s, t = layout._member("stripe", stripe), layout._member("target", target)
    if s == t:
        raise InvalidArgumentError(f"target {t} holds stripe {s}: it has no chunk in it (its parity is rebuilt "
                                   f"from the new shares, not from this stripe)", argument="stripe")
    bad = sorted(m for m in members if m in (s, t) or type(m) is not int or not 0 <= m < layout.group)
    if bad:
        raise InvalidArgumentError(f"members {bad} have no chunk to add to target {t}'s chunk for stripe {s}",
                                   argument="members")
    dst = _Concat.of(out, "out", writable=True)
    if dst.size > layout.chunk:
        raise InvalidArgumentError(f"out has {dst.size} bytes, more than a chunk's {layout.chunk}", argument="out")
    srcs = [_chunk_of(layout, _share(layout, m, v, f"members[{m}]"), m, s, dst.size) for m, v in sorted(members.items())]
    _combine(dst, srcs, assign=False)


def rebuild(layout: ParityLayout, lost: int, parities: Mapping[int, memoryview], shares: Mapping[int, Views],
            out: Views) -> None:
    """Member ``lost``'s share, its real ``sizes[lost]`` bytes, into ``out`` (one buffer or its
    files' buffers): for every stripe ``s != lost``, its chunk ``j(lost, s)`` is ``P_s`` XOR the
    chunk ``j(m, s)`` of every member ``m`` not in ``{s, lost}``.

    ``parities[s]`` is holder ``s``'s parity and ``shares[m]`` member ``m``'s share, of the same
    step, for every member but ``lost``. A member missing from either means two members of the
    group are gone: a :class:`~zerostall.errors.ReplicaError`, since one parity per stripe survives
    one loss only. The result is as good as its inputs: check it against the manifest's CRC32Cs.
    """
    lo_ = layout._member("lost", lost)
    others = layout.stripes_of(lo_)
    for name, given in (("parities", parities), ("shares", shares)):
        extra = sorted(k for k in given if k not in others)
        if extra:
            raise InvalidArgumentError(f"{name} names {extra}, not surviving members of a group of {layout.group} "
                                       f"that lost member {lo_}", argument=name)
    gone = sorted(m for m in others if m not in parities or m not in shares)
    if gone:
        what = ", ".join(f"{m} (no {'parity' if m not in parities else 'share'}"
                         f"{' nor share' if m not in parities and m not in shares else ''})" for m in gone)
        raise ReplicaError(f"member {lo_} of a parity group of {layout.group} cannot be rebuilt: member(s) {what} "
                           f"are gone too, and the group's one parity per stripe survives the loss of one member "
                           f"only")
    dst = _share(layout, lo_, out, "out", writable=True)
    pars: dict[int, _Concat] = {}
    for s in others:
        pars[s] = _Concat.of(parities[s], f"parities[{s}]")
        if pars[s].size != layout.chunk:
            raise InvalidArgumentError(f"parities[{s}] has {pars[s].size} bytes; a parity has {layout.chunk}",
                                       argument="parities")
    sh = {m: _share(layout, m, shares[m], f"shares[{m}]") for m in others}
    for s in others:
        a, b = layout.chunk_range(lo_, s)
        if a == b:
            continue
        d = dst.window(a, b)
        srcs = [pars[s].window(0, b - a)] + [_chunk_of(layout, sh[m], m, s, b - a) for m in others if m != s]
        _combine(d, srcs, assign=True)
