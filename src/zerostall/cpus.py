"""How many CPUs this process may run on: the one answer every thread pool sizes itself by.

A bottom-layer module (it imports nothing of zerostall) so that ``stage``, ``restore`` and
``persist``, which may not import one another, ask the same question the same way.
"""

from __future__ import annotations

import os

__all__ = ["usable_cpus"]


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
