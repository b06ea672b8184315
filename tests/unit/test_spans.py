"""Byte-range splitting of an all-or-nothing load's passes, and joining CRC32Cs of parts."""

from __future__ import annotations

import os
import random
import threading

import pytest

from zerostall.checksum import checksum, checksum_combine
from zerostall.cpus import PinnedTeam, pinned_team, usable_cpus
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


def _where() -> tuple[str, frozenset[int]]:
    return threading.current_thread().name, frozenset(os.sched_getaffinity(0))


def test_pinned_team_runs_share_i_on_cpu_i_and_returns_errors_in_order() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    team = PinnedTeam(cpus)
    try:
        got = team.run(lambda i: _where(), list(range(len(cpus))))
        assert [e for e, _ in got] == [None] * len(cpus)
        assert [r for _, r in got] == [(f"zerostall-pass-cpu{c}", frozenset({c})) for c in cpus]

        def fn(i: int) -> int:
            if i == 0:
                raise ValueError("share 0")
            return i

        out = team.run(fn, [0] * len(cpus))
        assert all(isinstance(e, ValueError) and r is None for e, r in out)
        with pytest.raises(ValueError, match="items for a team"):
            team.run(fn, [1] * (len(cpus) + 1))
    finally:
        team.stop()


def test_a_pass_on_every_cpu_runs_on_the_pinned_team_else_on_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    n = usable_cpus()
    where = run_all(lambda i: _where(), list(range(n)), n)
    if n >= 2:  # one share per CPU, each on the member pinned to it
        assert [w for w in where] == [(f"zerostall-pass-cpu{c}", frozenset({c}))
                                      for c in sorted(os.sched_getaffinity(0))]
        ran: list[int] = []

        def fails_first(i: int) -> int:
            ran.append(i)
            if i == 0:
                raise ValueError("share 0")
            return i
        with pytest.raises(ValueError, match="share 0"):  # raised once every share has run
            run_all(fails_first, list(range(n)), n)
        assert sorted(ran) == list(range(n))
        # more shares than CPUs (a cold pass): the pool, unpinned
        assert all(not w[0].startswith("zerostall-pass-cpu") for w in run_all(lambda i: _where(), [0] * (n + 1), n + 1))
    else:
        assert pinned_team() is None


def test_the_team_follows_the_cpus_the_process_may_use() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    try:
        first = pinned_team()
        assert first is None if len(cpus) < 2 else first.cpus == tuple(cpus)
        os.sched_setaffinity(0, cpus[:1])  # taskset down to one CPU: no team
        assert pinned_team() is None
    finally:
        os.sched_setaffinity(0, cpus)
    again = pinned_team()
    assert (again is None) if len(cpus) < 2 else (again is not None and again.cpus == tuple(cpus))


def test_a_member_that_runs_a_pass_itself_runs_it_inline() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    team = PinnedTeam(cpus)
    try:
        # an item that starts a pass on the same team: queueing to itself would wait forever
        got = team.run(lambda i: [r for _, r in team.run(lambda j: (j, threading.current_thread().name), [1, 2])],
                       [0])
        assert got[0][0] is None
        inner = got[0][1]
        assert inner is not None and [j for j, _ in inner] == [1, 2]
        assert {name for _, name in inner} == {f"zerostall-pass-cpu{cpus[0]}"}  # the calling member
    finally:
        team.stop()
