"""Helpers for the tests that drive real memory-tier trainers and keepers.

One home for what several test files need: starting ``tests/integration/_memory_trainer.py`` and
reading what it printed, waiting for a process or a condition, listing the committed steps of a
local directory and the keepers' socket names, comparing restored state bit for bit, another
user's process squatting a keeper's name, and finding a keeper's memfds in this process. tests/conftest.py puts tests/support on ``sys.path``, so test
files import it as ``memtier_procs``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from zerostall import Checkpointer, MemoryTier
from zerostall.memtier.spec import keeper_address
from zerostall.storage.release import wait_unmapped

__all__ = ["TRAINER", "DEADLINE_S", "start_trainer", "run_trainer", "parse_trainer_output", "killed_trainer",
           "running", "stop", "wait_for", "storage_steps", "keeper_sockets", "keeper_processes", "assert_state",
           "memory_tier", "squatter", "held_inodes", "mappings_of", "fds_of"]

#: the trainer subprocess: ``TRAINER DIR FIRST LAST EVERY LINGER MODE``, numpy state only; prints
#: ``KEEPER <pid>`` and ``SAVED <step> <tiers>`` lines
TRAINER = str(Path(__file__).parents[1] / "integration" / "_memory_trainer.py")
DEADLINE_S = 120.0  # generous: only a hung keeper takes this long


def start_trainer(d: Path, first: int, last: int, every: int, linger: float, mode: str,
                  env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, TRAINER, str(d), str(first), str(last), str(every), str(linger), mode],
                            stdout=subprocess.PIPE, text=True, env=env)


def run_trainer(d: Path, first: int, last: int, every: int, linger: float,
                mode: str) -> tuple[int, int, dict[int, str]]:
    """Run a trainer to its end: (return code, keeper pid, {step: tiers})."""
    p = start_trainer(d, first, last, every, linger, mode)
    out, _ = p.communicate(timeout=DEADLINE_S)
    keeper, saved = parse_trainer_output(out.splitlines())
    return p.returncode, keeper, saved


def parse_trainer_output(lines: list[str]) -> tuple[int, dict[int, str]]:
    """The keeper pid and ``{step: tiers}`` a trainer printed (-1: no keeper line)."""
    keeper = -1
    saved: dict[int, str] = {}
    for line in lines:
        parts = line.split()  # a SIGKILL can cut the last line short: only whole lines count
        if len(parts) == 2 and parts[0] == "KEEPER":
            keeper = int(parts[1])
        elif len(parts) == 3 and parts[0] == "SAVED" and parts[2] in ("memory", "memory,storage"):
            saved[int(parts[1])] = parts[2]
    return keeper, saved


def killed_trainer(d: Path, last: int = 3, mode: str = "kill") -> int:
    """A trainer that saved steps 1..last to memory only and was SIGKILLed; its keeper's pid."""
    rc, keeper, saved = run_trainer(d, 1, last, 1000, 60, mode)
    assert rc == -signal.SIGKILL and saved == dict.fromkeys(range(1, last + 1), "memory")
    return keeper


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def stop(pid: int, timeout: float = 10.0) -> None:
    """Stop process ``pid`` (SIGSTOP: alive, silent) and return once every thread of it is stopped.

    ``kill`` only marks the stop pending: a thread already running, or woken by a request, may
    still answer that request before it stops (seen on a loaded two-core machine), so a test that
    sends its first request to the stopped process right after ``kill`` waits here first."""
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that ended
        return bool(states) and all(s in ("T", "t") for s in states)

    wait_for(all_stopped, f"process {pid} to stop", timeout)


def wait_for(cond: Callable[[], object], what: str, timeout: float = DEADLINE_S) -> None:
    """Poll ``cond`` until it is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def storage_steps(d: Path) -> list[int]:
    """The steps of local directory ``d`` whose manifest is written (committed)."""
    return sorted(int(p.name[5:]) for p in d.iterdir() if p.name.startswith("step_") and (p / "manifest.json").exists())


def keeper_sockets() -> set[bytes]:
    """The abstract socket names of every keeper on this host."""
    names = set()
    with open("/proc/net/unix") as f:
        for line in f:
            parts = line.split()
            if parts and parts[-1].startswith("@zerostall-keeper-"):
                names.add(b"\0" + parts[-1][1:].encode())
    return names


def keeper_processes(d: Path) -> list[int]:
    """Processes whose command line names the keeper of ``d`` (rank 0)."""
    tag = keeper_address(str(d), 0).hex().encode()
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if tag in (proc / "cmdline").read_bytes():
                    out.append(int(proc.name))
            except OSError:
                pass
    return out


def assert_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit for bit: same keys, dtypes, shapes and bytes."""
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        if isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray) and g.dtype == w.dtype and g.shape == w.shape, k
            assert g.tobytes() == w.tobytes(), k
        elif isinstance(w, dict):
            assert_state(g, w)
        else:
            assert list(g) == list(w) if isinstance(w, list) else g == w, k


def memory_tier(every: int = 3, linger: float = 60.0) -> MemoryTier:
    return MemoryTier(persist_interval_steps=every, linger_s=linger)


@contextlib.contextmanager
def squatter(address: str) -> Iterator[int]:
    """Another user's process (nobody, uid 65534; needs root) listening on ``address`` while the
    block runs; yields its pid and checks that it ended cleanly."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            os.close(ready_r)
            os.close(stop_w)
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(address)
            s.listen(8)
            os.write(ready_w, b"x")
            os.read(stop_r, 1)  # until the block ends
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(stop_r)
    try:
        assert os.read(ready_r, 1) == b"x", "the squatter did not start"
        yield pid
    finally:
        os.close(stop_w)
        os.close(ready_r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def held_inodes(ck: Checkpointer) -> set[tuple[int, int]]:
    """The (device, inode) of each memfd of the step the keeper holds."""
    got = ck._memory.keeper.query_image()
    assert got is not None
    img, fds = got
    try:
        return {(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in fds}
    finally:
        for fd in fds:
            os.close(fd)


def mappings_of(inodes: set[tuple[int, int]]) -> dict[str, int]:
    """This process's mappings of those memfds: address range -> resident KiB in this process's
    page tables (``Rss`` in /proc/self/smaps: the pages a read through that mapping faulted in)."""
    wait_unmapped(DEADLINE_S)  # a load hands large unmaps to a background thread
    out: dict[str, int] = {}
    current: str | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:  # a mapping's header
                current = None
                if len(parts) >= 6 and "memfd:" in parts[5]:
                    dev_major, dev_minor = (int(x, 16) for x in parts[3].split(":"))
                    if (os.makedev(dev_major, dev_minor), int(parts[4])) in inodes:
                        current = parts[0]
                        out[current] = 0
            elif current is not None and parts and parts[0] == "Rss:":
                out[current] = int(parts[1])
    return out


def fds_of(inodes: set[tuple[int, int]]) -> list[int]:
    """This process's file descriptors open on those memfds."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in inodes:
            out.append(int(name))
    return out
