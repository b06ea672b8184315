"""Fault injection for tests: ``ZEROSTALL_FAULTS='{"phase": "action"}'`` in the writer's environment.

Phases: ``begin``, ``write``, ``checksum``, ``manifest``, ``commit``, ``retention``.
Actions: ``sleep:<seconds>``, ``raise:<ERRNO NAME>`` (an ``OSError``), ``exit`` (the writer process
dies at once, as if killed), ``wait:<path>`` (block until the file ``path`` exists: lets a test
order events without timing thresholds). Unset in production: the variable is read at each phase, costs one
dictionary lookup, and does nothing when absent.
"""

from __future__ import annotations

import errno
import json
import os
import time

__all__ = ["hit", "ENV"]

ENV = "ZEROSTALL_FAULTS"


def hit(phase: str, path: str = "") -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    action = json.loads(spec).get(phase)
    if not action:
        return
    verb, _, arg = str(action).partition(":")
    if verb == "sleep":
        time.sleep(float(arg))
    elif verb == "raise":
        code = getattr(errno, arg, errno.EIO)
        raise OSError(code, f"injected {arg} at {phase}", path or None)
    elif verb == "exit":
        os._exit(137)
    elif verb == "wait":
        deadline = time.monotonic() + 600
        while not os.path.exists(arg) and time.monotonic() < deadline:
            time.sleep(0.01)
