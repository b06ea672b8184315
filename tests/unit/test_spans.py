"""Byte-range splitting of an all-or-nothing load's passes, and joining CRC32Cs of parts."""

from __future__ import annotations

import os
import random

import pytest

from zerostall.checksum import checksum, checksum_combine
from zerostall.restore.spans import join_crcs, run_all, split_chunks, split_even, workers


@pytest.mark.parametrize("n", [0, 1, 3, 4096, 100_003, 3 << 20])
def test_combine_equals_the_checksum_of_the_concatenation(n: int) -> None:
    a, b = os.urandom(777), os.urandom(n)
    assert checksum_combine(checksum(a), checksum(b), len(b)) == checksum(a + b)
    assert checksum_combine(0, checksum(b), len(b)) == checksum(b)


def test_split_even_tiles_every_item_exactly_once() -> None:
    rng = random.Random(5)
    for _ in range(500):
        sizes = [rng.choice([0, 1, 100, 4096, 5000, 1 << 20, 3 << 20]) for _ in range(rng.randint(0, 7))]
        parts = rng.randint(1, 5)
        runs = split_even(sizes, parts)
        assert len(runs) <= parts
        covered: dict[int, list[tuple[int, int]]] = {}
        for run in runs:
            for i, lo, hi in run:
                assert 0 <= lo < hi <= sizes[i]
                covered.setdefault(i, []).append((lo, hi))
        for i, n in enumerate(sizes):
            pos = 0
            for lo, hi in sorted(covered.get(i, [])):
                assert lo == pos
                pos = hi
            assert pos == n


def test_one_large_item_is_shared_between_threads() -> None:
    runs = split_even([64 << 20], 2)
    assert runs == [[(0, 0, 32 << 20)], [(0, 32 << 20, 64 << 20)]]


def test_split_chunks_keeps_small_groups_whole_and_cuts_large_leaves() -> None:
    pieces = split_chunks([[(0, 10), (1, 20)], [(2, 100)]], 32)
    assert pieces == [[(0, 0, 10), (1, 0, 20)], [(2, 0, 32)], [(2, 32, 64)], [(2, 64, 96)], [(2, 96, 100)]]


def test_join_crcs_from_parts_in_any_order() -> None:
    data = [os.urandom(10_000), os.urandom(5)]
    parts = [((0, lo, hi), checksum(data[0][lo:hi])) for lo, hi in [(7000, 10_000), (0, 4096), (4096, 7000)]]
    parts.append(((1, 0, 5), checksum(data[1])))
    assert join_crcs(parts, 3) == [checksum(data[0]), checksum(data[1]), None]


def test_run_all_runs_everything_then_raises_the_first_error() -> None:
    done: list[int] = []

    def fn(i: int) -> int:
        done.append(i)
        if i in (1, 3):
            raise ValueError(i)
        return i * 2

    with pytest.raises(ValueError, match="1"):
        run_all(fn, [0, 1, 2, 3, 4], 2)
    assert sorted(done) == [0, 1, 2, 3, 4]
    assert run_all(lambda i: i + 1, [1, 2, 3], 2) == [2, 3, 4]
    assert 1 <= workers(64) <= len(os.sched_getaffinity(0)) and workers(1) == 1
