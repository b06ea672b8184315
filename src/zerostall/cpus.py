"""How many CPUs this process may run on: the one answer every thread pool sizes itself by,
and the process's threads for memory-bound passes (:func:`shared_pool`, :func:`pinned_team`).

A bottom-layer module (it imports nothing of zerostall) so that ``stage``, ``restore`` and
``persist``, which may not import one another, ask the same question the same way.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["usable_cpus", "shared_pool", "PinnedTeam", "pinned_team"]

_T = TypeVar("_T")
_R = TypeVar("_R")

_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)
_pool_lock = threading.Lock()


def usable_cpus() -> int:
    """The CPUs this process may run on (``sched_getaffinity``: a container's or ``taskset``'s
    limit, not the host's count), at least 1.

    Example::

        >>> usable_cpus() >= 1
        True
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def shared_pool(n: int) -> ThreadPoolExecutor:
    """One pool of at least ``n`` threads per process, made on first use, for the memory-bound
    passes of loads and copies: starting threads costs milliseconds per call on a busy machine.
    Its tasks must not wait on other tasks of the pool."""
    global _pool
    with _pool_lock:
        pid = os.getpid()  # a forked child has none of its parent's threads: a pool of its own
        if _pool is None or _pool[0] != pid or _pool[1] < n:
            if _pool is not None and _pool[0] == pid:
                _pool[2].shutdown(wait=False)  # outgrown (a cold pass asks for more threads): its idle threads exit
            _pool = (pid, n, ThreadPoolExecutor(max_workers=n, thread_name_prefix="zerostall-pass"))
        return _pool[2]


class PinnedTeam:
    """One daemon thread per CPU of ``cpus``, each pinned to its CPU (``sched_setaffinity``).

    For a memory-bound pass cut into one share per CPU: share *i* runs on CPU *i* from its first
    instruction. Handed to an ordinary pool, both shares of a two-core pass often ran on one core
    while the other stayed idle until the scheduler's balancing moved one (a warm 256 MiB
    all-or-nothing load after half a second idle, 15 pairs: 28.2-28.7 ms through the pool,
    24.6-25.0 ms pinned, measured by an A/B script kept in git history). A thread
    whose CPU cannot be pinned (taken offline since) runs unpinned.
    """

    def __init__(self, cpus: Sequence[int]) -> None:
        self.cpus = tuple(cpus)
        self._queues: list[queue.SimpleQueue[Any]] = []
        for cpu in self.cpus:
            q: queue.SimpleQueue[Any] = queue.SimpleQueue()
            threading.Thread(target=_team_member, args=(q, cpu), name=f"zerostall-pass-cpu{cpu}",
                             daemon=True).start()
            self._queues.append(q)

    def __len__(self) -> int:
        return len(self.cpus)

    def run(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[tuple[BaseException | None, _R | None]]:
        """``fn(items[i])`` on member ``i`` (at most one item per member), all at once; per item, in
        order, ``(error, None)`` or ``(None, result)``. Returns once every item has run."""
        if getattr(_member, "team", None) is not None:
            # called from a member's own item: queueing to the members (itself among them) could
            # wait forever, so the items run here, one after another
            return [_call(fn, item) for item in items]
        if len(items) > len(self._queues):
            raise ValueError(f"{len(items)} items for a team of {len(self._queues)}")
        done: list[queue.SimpleQueue[tuple[BaseException | None, Any]]] = []
        for q, item in zip(self._queues, items, strict=False):  # the first len(items) members
            out: queue.SimpleQueue[tuple[BaseException | None, Any]] = queue.SimpleQueue()
            q.put((fn, item, out))
            done.append(out)
        return [out.get() for out in done]

    def stop(self) -> None:
        """Let the members exit once they have finished what they were given."""
        for q in self._queues:
            q.put(None)


_member = threading.local()  # .team set in a team's own threads


def _call(fn: Callable[[_T], _R], item: _T) -> tuple[BaseException | None, _R | None]:
    try:
        return None, fn(item)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
        return exc, None


def _team_member(q: queue.SimpleQueue[Any], cpu: int) -> None:
    _member.team = True
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux affinity is per thread)
    except (AttributeError, OSError):
        pass
    while True:
        work = q.get()
        if work is None:
            return
        fn, item, out = work
        out.put(_call(fn, item))
        del work, fn, item, out  # nothing of a finished pass stays referenced while idle


_team: tuple[int, PinnedTeam] | None = None  # (pid, team)


def pinned_team() -> PinnedTeam | None:
    """This process's :class:`PinnedTeam`, one member per CPU it may run on (made on first use,
    remade when that set changes); None on a single CPU or where affinity is not available."""
    global _team
    try:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return None
    if len(cpus) < 2:
        return None
    with _pool_lock:
        pid = os.getpid()  # a forked child has none of its parent's threads
        if _team is None or _team[0] != pid or _team[1].cpus != cpus:
            if _team is not None and _team[0] == pid:
                _team[1].stop()
            _team = (pid, PinnedTeam(cpus))
        return _team[1]
