"""The parity codec (zerostall.memtier.parity): the layout's arithmetic, parities formed whole and
piece by piece against a plain reference, every single member rebuilt bit for bit (directly and
over a chain), and what it refuses. Small buffers: a few pages per chunk."""

from __future__ import annotations

import doctest
import itertools
import random
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerostall.checksum import checksum
from zerostall.errors import ArgumentTypeError, InvalidArgumentError, ReplicaError
from zerostall.memtier import parity
from zerostall.memtier.parity import Accumulator, ParityLayout, encode, partial, pieces, rebuild, xor_into

PAGE = 4096

#: (group, sizes): empty, one byte, exact multiples of (G-1) pages, one much larger than the others
CASES = [
    (2, (0, 0)),
    (2, (1, 10_000)),
    (2, (3 * PAGE, 3 * PAGE)),
    (3, (10_000, 0, 5)),
    (3, (2 * PAGE, 4 * PAGE, 1)),
    (4, (3 * PAGE, 6 * PAGE, 9 * PAGE, 3 * PAGE)),
    (4, (50_001, 1, 0, 7_777)),
    (4, (0, 0, 0, 1)),
    (8, (70_000, 1, 0, 7 * PAGE, 12_345, 70_000, 69_999, 3)),
    (8, tuple(range(8))),
]


def ref_chunk(sizes: tuple[int, ...], group: int) -> int:
    c = -(-max(sizes) // (group - 1))
    return -(-c // PAGE) * PAGE


def ref_parity(shares: list[bytes], group: int, stripe: int) -> bytes:
    """P_s from the definition: every other member's share zero-padded to (G-1) chunks, its chunk
    j(m, s) taken, all XORed."""
    c = ref_chunk(tuple(len(s) for s in shares), group)
    p = np.zeros(c, np.uint8)
    for m in range(group):
        if m == stripe:
            continue
        j = stripe if stripe < m else stripe - 1
        padded = np.zeros((group - 1) * c, np.uint8)
        padded[:len(shares[m])] = np.frombuffer(shares[m], np.uint8)
        p ^= padded[j * c:(j + 1) * c]
    return p.tobytes()


def make_shares(sizes: tuple[int, ...], seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def as_files(data: bytes, rng: random.Random, *, writable: bool = False) -> list[memoryview]:
    """``data`` cut into a few buffers at random points (some empty), as a step's data files."""
    cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(0, 3)))
    edges = [0, *cuts, len(data)]
    return [memoryview(bytearray(data[a:b]) if writable else data[a:b]) for a, b in itertools.pairwise(edges)]


def parities_of(layout: ParityLayout, shares: list[bytes]) -> dict[int, bytearray]:
    out = {}
    for s in range(layout.group):
        out[s] = bytearray(layout.chunk)
        encode(layout, s, {m: memoryview(shares[m]) for m in layout.stripes_of(s)}, memoryview(out[s]))
    return out


def coded(sizes: tuple[int, ...], seed: int) -> tuple[ParityLayout, list[bytes], dict[int, bytearray]]:
    """A group of ``len(sizes)`` members: its layout, random shares and their parities."""
    lay = ParityLayout(sizes, len(sizes))
    shares = make_shares(sizes, seed)
    return lay, shares, parities_of(lay, shares)


def test_the_module_s_examples_run() -> None:
    assert doctest.testmod(parity).failed == 0


@pytest.mark.parametrize("group,sizes", CASES)
def test_the_layout_s_chunks_cover_every_share_once_in_pages(group: int, sizes: tuple[int, ...]) -> None:
    lay = ParityLayout(sizes, group)
    c = lay.chunk
    assert c == ref_chunk(sizes, group)
    assert c % PAGE == 0 and c * (group - 1) >= max(sizes)
    assert c * (group - 1) < max(sizes) + group * PAGE  # no more than rounding
    for m in range(group):
        assert lay.extra_bytes(m) == c
        stripes = lay.stripes_of(m)
        assert stripes == tuple(s for s in range(group) if s != m)
        assert [lay.chunk_index(m, s) for s in stripes] == list(range(group - 1))  # in order, one each
        covered = [lay.chunk_range(m, s) for s in stripes]
        assert covered[0][0] == 0 and covered[-1][1] == sizes[m]
        assert all(a <= b <= a + c for a, b in covered)
        assert all(b == a2 for (_, b), (a2, _) in itertools.pairwise(covered))  # contiguous, no overlap


def test_two_members_are_a_mirror_and_the_chunk_index_rotates() -> None:
    lay = ParityLayout((5000, 9000), 2)
    assert lay.chunk == 3 * PAGE
    assert lay.chunk_range(1, 0) == (0, 9000) and lay.chunk_range(0, 1) == (0, 5000)
    lay = ParityLayout((1, 1, 1, 1), 4)
    assert [lay.chunk_index(2, s) for s in (0, 1, 3)] == [0, 1, 2]
    assert [lay.chunk_index(0, s) for s in (1, 2, 3)] == [0, 1, 2]


def test_a_layout_refuses_what_is_not_a_group() -> None:
    with pytest.raises(InvalidArgumentError, match="at least 2 members"):
        ParityLayout((5,), 1)
    with pytest.raises(InvalidArgumentError, match="one per member"):
        ParityLayout((5, 6, 7), 2)
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        ParityLayout((5, -1), 2)
    with pytest.raises(ArgumentTypeError):
        ParityLayout((5, 2.0), 2)  # type: ignore[arg-type]
    lay = ParityLayout([3, 4, 5], 3)  # type: ignore[arg-type]
    assert lay.sizes == (3, 4, 5)  # a list is taken as the tuple it stands for (frozen, hashable)
    with pytest.raises(InvalidArgumentError, match="holds stripe"):
        lay.chunk_range(1, 1)
    with pytest.raises(InvalidArgumentError, match="not a member"):
        lay.stripes_of(3)


@pytest.mark.parametrize("group,sizes", CASES)
def test_encode_is_the_definition_s_parity(group: int, sizes: tuple[int, ...]) -> None:
    lay = ParityLayout(sizes, group)
    shares = make_shares(sizes)
    rng = random.Random(1)
    for s in range(group):
        out = bytearray(b"\xa5" * lay.chunk)  # a reused buffer: its old bytes must not count
        encode(lay, s, {m: as_files(shares[m], rng) for m in lay.stripes_of(s)}, memoryview(out))
        assert bytes(out) == ref_parity(shares, group, s)


@pytest.mark.parametrize("group,sizes", CASES)
def test_pieces_in_any_order_and_size_accumulate_to_the_parity(group: int, sizes: tuple[int, ...]) -> None:
    lay = ParityLayout(sizes, group)
    shares = make_shares(sizes, seed=2)
    rng = random.Random(3)
    for s in range(group):
        want = ref_parity(shares, group, s)
        for _ in range(3):
            out = bytearray(rng.randbytes(lay.chunk))
            acc = Accumulator(lay, s, memoryview(out))
            todo = []
            for m in lay.stripes_of(s):
                a, b = lay.chunk_range(m, s)
                pos = 0
                while pos < b - a:
                    n = rng.choice([1, 7, 4096, 5000, b - a])
                    todo.append((m, pos, min(pos + n, b - a)))
                    pos += n
            rng.shuffle(todo)
            for i, (m, x, y) in enumerate(todo):
                assert not acc.complete
                assert m in acc.missing
                a, _ = lay.chunk_range(m, s)
                acc.add(m, x, memoryview(shares[m])[a + x:a + y])
                assert acc.complete == (i == len(todo) - 1)
            assert acc.complete and acc.missing == ()
            assert bytes(out) == want


def test_an_accumulator_with_nothing_to_receive_is_complete_and_zero() -> None:
    lay = ParityLayout((0, 0, 20_000), 3)
    out = bytearray(b"\xff" * lay.chunk)
    acc = Accumulator(lay, 2, memoryview(out))
    assert acc.complete and bytes(out) == bytes(lay.chunk)


def test_an_accumulator_refuses_bad_pieces_and_keeps_its_sums() -> None:
    lay = ParityLayout((9000, 9000, 100), 3)
    shares = make_shares(lay.sizes, seed=4)
    out = bytearray(lay.chunk)
    acc = Accumulator(lay, 0, memoryview(out))
    a1, b1 = lay.chunk_range(1, 0)
    acc.add(1, 0, memoryview(shares[1])[a1:a1 + 1000])
    before = bytes(out)
    with pytest.raises(ReplicaError, match="its own stripe"):
        acc.add(0, 0, memoryview(shares[0])[:10])
    with pytest.raises(ReplicaError, match="outside its chunk"):
        acc.add(2, 50, memoryview(bytes(51)))  # member 2 has 100 real bytes
    with pytest.raises(ReplicaError, match="outside its chunk"):
        acc.add(1, b1 - a1 - 4, memoryview(bytes(8)))  # past the chunk's end
    with pytest.raises(ReplicaError, match="outside its chunk"):
        acc.add(1, -1, memoryview(bytes(1)))
    with pytest.raises(ReplicaError, match="count once"):
        acc.add(1, 999, memoryview(shares[1])[a1 + 999:a1 + 1100])  # one byte already added
    with pytest.raises(InvalidArgumentError, match="not a member"):
        acc.add(3, 0, memoryview(bytes(1)))
    with pytest.raises(ArgumentTypeError):
        acc.add(1, 1000, "text")  # type: ignore[arg-type]
    assert bytes(out) == before and acc.missing == (1, 2)
    acc.add(1, 1000, memoryview(shares[1])[a1 + 1000:b1])
    acc.add(2, 0, memoryview(shares[2]))
    assert acc.complete and bytes(out) == ref_parity(shares, 3, 0)
    with pytest.raises(ReplicaError, match="count once"):
        acc.add(2, 0, memoryview(shares[2])[:1])


def test_an_accumulator_needs_a_writable_parity_sized_buffer() -> None:
    lay = ParityLayout((9000, 9000), 2)
    with pytest.raises(InvalidArgumentError, match="bytes"):
        Accumulator(lay, 0, memoryview(bytearray(lay.chunk - 1)))
    with pytest.raises(InvalidArgumentError, match="read-only"):
        Accumulator(lay, 0, memoryview(bytes(lay.chunk)))


@pytest.mark.parametrize("group,sizes", CASES)
def test_every_single_member_lost_is_rebuilt_bit_for_bit(group: int, sizes: tuple[int, ...]) -> None:
    lay, shares, pars = coded(sizes, seed=5)
    rng = random.Random(6)
    for lost in range(group):
        out = as_files(bytes(rng.randbytes(sizes[lost])), rng, writable=True)  # stale bytes, in files
        rebuild(lay, lost, {s: memoryview(pars[s]) for s in lay.stripes_of(lost)},
                {m: as_files(shares[m], rng) for m in lay.stripes_of(lost)}, out)
        assert b"".join(bytes(v) for v in out) == shares[lost]


@pytest.mark.parametrize("group,sizes", CASES)
def test_a_chain_of_partials_gives_the_lost_member_s_chunks(group: int, sizes: tuple[int, ...]) -> None:
    lay, shares, pars = coded(sizes, seed=7)
    rng = random.Random(8)
    for lost in range(group):
        got = bytearray(sizes[lost])
        for s in lay.stripes_of(lost):
            a, b = lay.chunk_range(lost, s)
            hop = bytearray(pars[s][:b - a])  # the holder starts the chain with its parity
            survivors = [m for m in lay.stripes_of(lost) if m != s]
            rng.shuffle(survivors)
            for m in survivors:  # each survivor adds its own chunk and forwards
                partial(lay, s, lost, {m: memoryview(shares[m])}, memoryview(hop))
            got[a:b] = hop  # the new host receives one chunk per stripe
        assert bytes(got) == shares[lost]
        # one hop holding several survivors at once does the same
        for s in lay.stripes_of(lost):
            a, b = lay.chunk_range(lost, s)
            hop = bytearray(pars[s][:b - a])
            partial(lay, s, lost, {m: memoryview(shares[m]) for m in lay.stripes_of(lost) if m != s}, memoryview(hop))
            assert bytes(hop) == shares[lost][a:b]


def test_a_partial_refuses_members_with_no_chunk_for_the_target() -> None:
    lay = ParityLayout((9000, 9000, 9000), 3)
    shares = make_shares(lay.sizes)
    with pytest.raises(InvalidArgumentError, match="no chunk"):
        partial(lay, 0, 1, {0: memoryview(shares[0])}, memoryview(bytearray(10)))
    with pytest.raises(InvalidArgumentError, match="holds stripe"):
        partial(lay, 1, 1, {2: memoryview(shares[2])}, memoryview(bytearray(10)))
    with pytest.raises(InvalidArgumentError, match="more than a chunk"):
        partial(lay, 0, 1, {2: memoryview(shares[2])}, memoryview(bytearray(lay.chunk + 1)))


def test_a_corrupted_parity_byte_gives_a_share_whose_crc32c_differs() -> None:
    lay, shares, pars = coded((30_000, 20_000, 25_000, 1_000), seed=9)
    rng = random.Random(10)
    for lost, s in itertools.product(range(4), range(4)):
        if s == lost:
            continue
        a, b = lay.chunk_range(lost, s)
        if a == b:
            continue
        bad = {k: bytearray(v) for k, v in pars.items()}
        bad[s][rng.randrange(b - a)] ^= 1 << rng.randrange(8)
        out = bytearray(lay.sizes[lost])
        rebuild(lay, lost, {k: memoryview(bad[k]) for k in lay.stripes_of(lost)},
                {m: memoryview(shares[m]) for m in lay.stripes_of(lost)}, memoryview(out))
        assert checksum(memoryview(out)) != checksum(shares[lost])


def test_two_members_lost_in_one_group_is_a_replica_error() -> None:
    lay, shares, pars = coded((9000, 9000, 9000, 9000), seed=0)
    out = memoryview(bytearray(9000))
    with pytest.raises(ReplicaError, match="one member only") as e:
        rebuild(lay, 1, {0: memoryview(pars[0]), 3: memoryview(pars[3])},
                {0: memoryview(shares[0]), 3: memoryview(shares[3])}, out)
    assert "2 (no parity nor share)" in str(e.value)
    with pytest.raises(ReplicaError, match=r"3 \(no share\)"):
        rebuild(lay, 1, {s: memoryview(pars[s]) for s in (0, 2, 3)},
                {0: memoryview(shares[0]), 2: memoryview(shares[2])}, out)
    with pytest.raises(InvalidArgumentError, match="not surviving"):
        rebuild(lay, 1, {s: memoryview(pars[s]) for s in (0, 1, 2, 3)},
                {m: memoryview(shares[m]) for m in (0, 2, 3)}, out)


def test_a_rebuild_checks_every_buffer_s_size() -> None:
    lay, shares, pars = coded((9000, 8000, 7000), seed=0)
    p = {s: memoryview(pars[s]) for s in (1, 2)}
    sh = {m: memoryview(shares[m]) for m in (1, 2)}
    with pytest.raises(InvalidArgumentError, match="member 0's share has 9000"):
        rebuild(lay, 0, p, sh, memoryview(bytearray(8999)))
    with pytest.raises(InvalidArgumentError, match=r"shares\[2\] has 6999"):
        rebuild(lay, 0, p, {1: sh[1], 2: sh[2][:6999]}, memoryview(bytearray(9000)))
    with pytest.raises(InvalidArgumentError, match="a parity has"):
        rebuild(lay, 0, {1: p[1], 2: p[2][:-1]}, sh, memoryview(bytearray(9000)))


def test_xor_into_is_bytewise_at_any_alignment_and_refuses_mismatches() -> None:
    rng = np.random.default_rng(11)
    a, b = rng.integers(0, 256, 10_000, np.uint8), rng.integers(0, 256, 10_001, np.uint8)
    for lo, hi in [(0, 10_000), (1, 9_999), (3, 8), (7, 7), (5, 4101)]:
        d = bytearray(a.tobytes())
        src = memoryview(b.tobytes())[lo + 1:hi + 1]  # src and dst at different alignments
        xor_into(memoryview(d)[lo:hi], src)
        want = a.copy()
        want[lo:hi] ^= b[lo + 1:hi + 1]
        assert bytes(d) == want.tobytes()
    f = np.arange(4, dtype=np.float32)  # any contiguous format is its bytes
    xor_into(memoryview(f), memoryview(f.tobytes()))
    assert not f.any()
    with pytest.raises(InvalidArgumentError, match="equal lengths"):
        xor_into(memoryview(bytearray(4)), memoryview(bytes(5)))
    with pytest.raises(InvalidArgumentError, match="read-only"):
        xor_into(memoryview(bytes(4)), memoryview(bytes(4)))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        xor_into(memoryview(bytearray(8))[::2], memoryview(bytes(4)))


def test_bulk_xor_copies_no_source_bytes() -> None:
    n = 32 << 20
    dst, src, out = bytearray(n), bytes(range(256)) * (n // 256), bytearray(n)
    lay = ParityLayout((n, n), 2)
    par = bytearray(lay.chunk)
    tracemalloc.start()  # numpy reports its allocations to tracemalloc
    try:
        xor_into(memoryview(dst), memoryview(src))
        encode(lay, 0, {1: memoryview(src)}, memoryview(par))
        rebuild(lay, 1, {0: memoryview(par)}, {0: memoryview(dst)}, memoryview(out))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert dst == src and out == src


def test_pieces_are_views_of_the_files_in_order() -> None:
    files = [memoryview(bytearray(b"abc")), memoryview(b""), memoryview(bytearray(b"defgh"))]
    got = pieces(files, 1, 7)
    assert [bytes(v) for v in got] == [b"bc", b"defg"]
    got[1][0:1] = b"D"  # a view, not a copy
    assert bytes(files[2]) == b"Defgh"
    assert pieces(files, 8, 20) == []
    with pytest.raises(InvalidArgumentError):
        pieces(files, 5, 2)


@settings(max_examples=60, deadline=None)
@given(group=st.integers(2, 8), data=st.data())
def test_any_group_rebuilds_any_lost_member(group: int, data: st.DataObject) -> None:
    sizes = tuple(data.draw(st.lists(st.integers(0, 3 * PAGE + 5), min_size=group, max_size=group)))
    lost = data.draw(st.integers(0, group - 1))
    seed = data.draw(st.integers(0, 2**32 - 1))
    lay, shares, pars = coded(sizes, seed)
    assert all(bytes(pars[s]) == ref_parity(shares, group, s) for s in range(group))
    out = bytearray(sizes[lost])
    rebuild(lay, lost, {s: memoryview(pars[s]) for s in lay.stripes_of(lost)},
            {m: memoryview(shares[m]) for m in lay.stripes_of(lost)}, memoryview(out))
    assert bytes(out) == shares[lost]
