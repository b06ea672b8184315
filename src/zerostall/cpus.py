"""How many CPUs this process may run on: the one answer every thread pool sizes itself by.

A bottom-layer module (it imports nothing of zerostall) so that ``stage``, ``restore`` and
``persist``, which may not import one another, ask the same question the same way.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["usable_cpus", "shared_pool"]

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
