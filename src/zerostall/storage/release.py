"""Unmapping large read-only mappings off the caller's thread.

Tearing down the page tables of a mapping costs about 25 ms per GiB here (one entry per 4 KiB
page), and nothing a load returns depends on it: a load hands its mappings of data files and of
memory-tier images to one background thread per process and returns. Small mappings are
unmapped at once.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading

__all__ = ["unmap_later", "wait_unmapped"]

_LATER_MIN = 64 << 20  # below this the unmap costs less than handing it over
_queue: queue.SimpleQueue[mmap.mmap | threading.Event] = queue.SimpleQueue()
_started: int | None = None  # pid that started the thread (a forked child starts its own)
_lock = threading.Lock()


def _close(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with it
        pass


def _drain() -> None:
    while True:
        m = _queue.get()
        if isinstance(m, threading.Event):
            m.set()
        else:
            _close(m)


def unmap_later(m: mmap.mmap) -> None:
    """Close ``m`` soon, on a background thread when it is large; the caller must hold no view of it."""
    if len(m) < _LATER_MIN:
        _close(m)
        return
    global _started
    with _lock:
        if _started != os.getpid():
            threading.Thread(target=_drain, name="zerostall-unmap", daemon=True).start()
            _started = os.getpid()
    _queue.put(m)


def wait_unmapped(timeout: float | None = None) -> bool:
    """Wait until every mapping handed to :func:`unmap_later` so far is unmapped; False on timeout.

    For measurements: ``POSIX_FADV_DONTNEED`` leaves a page in the page cache while any process
    still maps it, so a benchmark that drops a file's pages right after a load must wait for
    the load's mappings to go first.
    """
    with _lock:
        if _started != os.getpid():
            return True  # no thread in this process: nothing was handed over
    done = threading.Event()
    _queue.put(done)
    return done.wait(timeout)
