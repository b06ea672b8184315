"""Helpers shared by the tests that drive real trainer and keeper processes (tests/support is on
``sys.path`` and ``PYTHONPATH`` for every test: see tests/conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_until(cond: Callable[[], object], what: str, timeout: float, poll: float = 0.05) -> None:
    """Poll ``cond`` until it is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def committed_dirs(d: Path) -> list[int]:
    """The steps of local directory ``d`` whose manifest is written."""
    return sorted(int(p.name[5:]) for p in d.iterdir() if p.name.startswith("step_") and (p / "manifest.json").exists())
