"""Byte-range work splitting for the passes of an all-or-nothing load over bytes in memory.

A load that verifies before it copies (``LoadOptions.atomic``) makes two passes over the bytes
it holds back: a checksum pass and a copy pass. Both are bound by memory bandwidth, so they are
split by *bytes*, not by leaf: one large leaf must not leave every thread but one idle. A leaf
cut between threads is checksummed in parts and the parts joined with
:func:`~zerostall.checksum.checksum_combine`, so every leaf is still checked against its own
CRC32C. Each thread copies its share with one large copy per contiguous range, with streaming
stores (:mod:`zerostall.memcopy`: glibc's ``memmove`` uses them only for copies of hundreds of
MiB; cached stores cost up to 1.8x as much, measured here).

A pass on every CPU the process may use, one share per CPU, runs on
:func:`zerostall.cpus.pinned_team`: one thread pinned to each CPU, so that no two shares start on
the same core. Other passes (a cold
one: many pieces, each taken by whichever thread is free once it has been read) take threads from one pool per process
(:func:`zerostall.cpus.shared_pool`), made on first use: starting threads costs milliseconds per
load on a busy machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar, cast

# The splitting and joining are pure byte arithmetic, shared with the memory tier's keeper (a
# sibling layer: memtier.keeper checks a held step the same way), so they live in checksum.
from zerostall.checksum import Span, join_crcs, split_even
from zerostall.cpus import pinned_team, shared_pool, usable_cpus

__all__ = ["Span", "workers", "split_even", "split_chunks", "run_all", "join_crcs"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def workers(io_threads: int) -> int:
    """Threads for a memory-bound pass: ``io_threads``, but no more than the CPUs this process may
    run on (``sched_getaffinity``): a third thread on two cores only adds switches."""
    return max(1, min(io_threads, usable_cpus()))


def split_chunks(groups: Sequence[Sequence[tuple[int, int]]], chunk: int) -> list[list[Span]]:
    """Runs of at most about ``chunk`` bytes, in order: each group (``(request index, nbytes)``
    items that lie next to each other) whole if it fits, else cut into ``chunk``-byte pieces.

    For a pass that reads as it goes: the pieces are the units read and then checked, in order.
    """
    out: list[list[Span]] = []
    for g in groups:
        if sum(n for _, n in g) <= chunk:
            out.append([(i, 0, n) for i, n in g])
            continue
        for i, n in g:
            out.extend([(i, lo, min(n, lo + chunk))] for lo in range(0, n, chunk))
    return out


def run_all(fn: Callable[[_T], _R], items: Sequence[_T], threads: int) -> list[_R]:
    """``fn`` over ``items`` on up to ``threads`` threads (the pinned team, or the pool; see the
    module's text), results in order; every item runs to its end before the first error (in
    item order) is raised."""
    if threads <= 1 or len(items) <= 1:
        return [fn(t) for t in items]
    team = pinned_team() if threads == usable_cpus() else None
    got: list[tuple[BaseException | None, _R | None]]
    if team is not None and len(items) <= len(team):
        got = team.run(fn, items)
    else:
        got = [_outcome(f) for f in [shared_pool(threads).submit(fn, t) for t in items]]
    first = next((e for e, _ in got if e is not None), None)
    if first is not None:
        raise first
    return [cast(_R, r) for _, r in got]  # no error: every item returned its result


def _outcome(f: Future[Any]) -> tuple[BaseException | None, Any]:
    """A finished future as the team reports an item: ``(error, None)`` or ``(None, result)``."""
    exc = f.exception()
    return (exc, None) if exc is not None else (None, f.result())
