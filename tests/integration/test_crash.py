"""SIGKILL the trainer or the writer at every phase and at random moments.

After each crash: the newest committed step loads bit-exact, no partial step is visible,
``latest_step()`` names a committed step, retention never deleted the newest committed step,
and a new Checkpointer on the same directory saves the next step.

The trainers are subprocesses using numpy state only (importing torch costs seconds on a
shared machine). ``ZEROSTALL_STRESS=1`` (``make stress``) runs many more random kills.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.commit import step_name
from zerostall.persist.faults import ENV, MARK_ENV, PHASES

STRESS = bool(os.environ.get("ZEROSTALL_STRESS"))
RANDOM_RUNS = int(os.environ.get("ZEROSTALL_CRASH_RUNS", 40 if STRESS else 4))
KEEP_LAST = 2

STATE_SRC = '''
import numpy as np

def state(step, big=False):
    n = 1 << (19 if big else 10)  # 2 MiB or 4 KiB of float32
    return {
        "w": (np.arange(n, dtype=np.float32) + step) / 3,
        "i": np.full(17, step, dtype=np.int64),
        "flags": (np.arange(9) % (step % 3 + 2)) == 0,
        "step": step,
        "tag": ("run-%d" % step).encode(),
        "nested": {"half": np.float16(step) / 8, "list": [step, float(step) / 7, None]},
    }
'''
_ns: dict[str, Any] = {}
exec(STATE_SRC, _ns)
state = _ns["state"]

TRAINER = STATE_SRC + textwrap.dedent('''
import json, os, sys
from zerostall import Checkpointer, ZerostallError
from zerostall.errors import WriterError
from zerostall.persist.faults import ENV

directory, first, last, big = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
ckpt = Checkpointer(directory, keep_last=%d)
print("WRITER", ckpt._engine.writer.pid, flush=True)
for step in range(first, last + 1):
    r = ckpt.save_pytree_async(step, state(step, big))
    print("STAGED", step, flush=True)
    try:
        r.result()
        print("COMMITTED", step, flush=True)
    except ZerostallError as exc:
        print("FAILED", step, type(exc).__name__, flush=True)
    # The fault is for the first save's writer: a replacement writer (the test killed the first,
    # whether its save failed or was already committed) starts without it.
    os.environ.pop(ENV, None)
    print("WRITER", ckpt._engine.writer.pid, flush=True)
ckpt.close()
print("CLOSED", flush=True)
''' % KEEP_LAST)


def assert_same(got: Any, want: Any, key: str = "") -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.tobytes() == want.tobytes(), key
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), key
    elif isinstance(want, dict):
        assert list(got) == list(want), key
        for k in want:
            assert_same(got[k], want[k], f"{key}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), key
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{key}/{i}")
    else:
        assert type(got) is type(want) and got == want, key


class Trainer:
    """A trainer subprocess and what it printed."""

    def __init__(self, directory: Path, first: int, last: int, *, env: dict[str, str] | None = None,
                 big: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(directory), str(first), str(last), "1" if big else "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.writer_pids: set[int] = set()

    def read_until(self, prefix: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"trainer ended before {prefix!r}: {self.lines} {self.stderr()}")
            line = line.strip()
            self.lines.append(line)
            if line.startswith("WRITER"):
                self.writer_pids.add(int(line.split()[1]))
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no {prefix!r} within {timeout}s: {self.lines}")

    def finish(self, timeout: float = 120) -> None:
        out, err = self.proc.communicate(timeout=timeout)
        for line in out.splitlines():
            self.lines.append(line.strip())
            if line.startswith("WRITER"):
                self.writer_pids.add(int(line.split()[1]))
        self._err = err

    def stderr(self) -> str:
        return getattr(self, "_err", "")

    def kill(self) -> None:
        self.proc.kill()
        self.finish()

    def committed(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("COMMITTED")]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"writer {pid} still running after {timeout}s")
        time.sleep(0.05)


def wait_for_mark(mark: Path, phase: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(p.name.startswith(phase + "-") for p in mark.iterdir()):
        if time.monotonic() > deadline:
            raise AssertionError(f"the writer never reached phase {phase!r}")
        time.sleep(0.02)


def check_directory(directory: Path, *, newest_at_least: int | None = None, big: bool = False) -> list[int]:
    """The invariants after any crash; returns the committed steps."""
    names = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    for n in names:  # no partial step is visible: every visible step is complete
        assert (directory / n / "manifest.json").is_file(), f"{n} is visible but not committed"
    hidden = [n for n in os.listdir(directory) if n.startswith(".")]
    # partial attempts, doomed steps, and the leases of the writers that made them (zerostall.lease)
    assert all(".zs-tmp-" in n or ".zs-del-" in n or n.startswith(".zs-lease-") for n in hidden), hidden
    with Checkpointer(directory, save_options=SaveOptions(writer=WriterKind.THREAD), keep_last=KEEP_LAST) as c:
        steps = c.steps()
        assert [step_name(s) for s in steps] == names
        assert steps, "a crash deleted every committed step"
        latest = c.latest_step()
        assert latest == steps[-1]
        if newest_at_least is not None:
            assert latest >= newest_at_least, (latest, newest_at_least)
        for s in steps:  # every listed step loads bit-exact (the newest above all)
            assert_same(c.load_pytree(s), state(s, big), step_name(s))
        # life goes on: the next save commits and retention keeps the newest
        nxt = latest + 1
        c.save_pytree(nxt, state(nxt))
        after = c.steps()
        assert after[-1] == nxt and latest in after, after
    return steps



@pytest.mark.parametrize("phase", PHASES)
def test_kill_writer_at_phase(run_dir: Path, tmp_path: Path, phase: str) -> None:
    """The writer dies mid-save: that save fails with WriterError (or, killed after the rename,
    succeeds: it is committed), nothing partial appears, and the next save (on a fresh writer)
    commits."""
    mark = tmp_path / "mark"
    mark.mkdir()
    t = Trainer(run_dir, 3, 4, env={ENV: json.dumps({phase: "sleep:60"}), MARK_ENV: str(mark)})
    try:
        pid = int(t.read_until("WRITER").split()[1])
        wait_for_mark(mark, phase)
        os.kill(pid, signal.SIGKILL)
        if phase == "retention":
            # Killed after the rename: the save is committed, and result() says so.
            t.read_until("COMMITTED 3")
        else:
            assert t.read_until("FAILED").split()[1:] == ["3", "WriterError"]
        t.finish()
    finally:
        if t.proc.poll() is None:
            t.kill()
    assert t.proc.returncode == 0, t.stderr()
    assert t.committed() == ([3, 4] if phase == "retention" else [4])
    leftovers = [n for n in os.listdir(run_dir) if n.startswith(".")]
    if phase in ("checksum", "manifest", "commit"):  # (at "write" no file exists yet)
        assert any(n.startswith(".step_00000003.zs-tmp-") for n in leftovers), leftovers
    steps = check_directory(run_dir, newest_at_least=4)
    # Before the rename nothing of step 3 exists; at retention it was already committed.
    assert steps == ([3, 4] if phase == "retention" else [2, 4])
    # The Checkpointer opened by check_directory removed the dead writer's partial directory.
    assert not [n for n in os.listdir(run_dir) if n.startswith(".")]


def test_live_writers_partial_directory_is_not_removed(run_dir: Path, tmp_path: Path) -> None:
    """Opening a Checkpointer removes partial saves of dead writers only: a save in progress in
    another process survives it and commits."""
    mark = tmp_path / "mark"
    mark.mkdir()
    gate = tmp_path / "gate"  # the writer stays in its manifest phase until this exists
    t = Trainer(run_dir, 3, 3, env={ENV: json.dumps({"manifest": f"wait:{gate}"}), MARK_ENV: str(mark)})
    try:
        t.read_until("WRITER")
        wait_for_mark(mark, "manifest")
        partial = [n for n in os.listdir(run_dir) if ".zs-tmp-" in n]
        assert len(partial) == 1
        with Checkpointer(run_dir, save_options=SaveOptions(writer=WriterKind.THREAD)):
            assert (run_dir / partial[0]).is_dir()
        gate.touch()
        t.read_until("COMMITTED 3")
        t.finish()
    finally:
        if t.proc.poll() is None:
            t.kill()
    check_directory(run_dir, newest_at_least=3)


@pytest.mark.parametrize("phase", PHASES)
def test_kill_trainer_at_phase(run_dir: Path, tmp_path: Path, phase: str) -> None:
    """The trainer dies after handing a save off: the writer still commits it, then exits."""
    mark = tmp_path / "mark"
    mark.mkdir()
    t = Trainer(run_dir, 3, 3, env={ENV: json.dumps({phase: "sleep:1"}), MARK_ENV: str(mark)})
    pid = int(t.read_until("WRITER").split()[1])
    t.read_until("STAGED")
    wait_for_mark(mark, phase)
    t.kill()
    wait_dead(pid)
    steps = check_directory(run_dir, newest_at_least=3)
    assert steps == [2, 3]  # committed, and retention (keep_last=2) ran too


@pytest.mark.parametrize("victim", ["trainer", "writer"])
def test_kill_during_a_large_write(run_dir: Path, victim: str) -> None:
    """A kill in the middle of the data write (2 MiB state, many saves in a row)."""
    t = Trainer(run_dir, 3, 12, big=True)
    try:
        pid = int(t.read_until("WRITER").split()[1])
        t.read_until("STAGED 5")
        if victim == "trainer":
            t.kill()
            wait_dead(pid)
        else:
            os.kill(pid, signal.SIGKILL)
            t.finish()
            assert t.proc.returncode == 0, t.stderr()
    finally:
        if t.proc.poll() is None:
            t.kill()
    committed = t.committed()
    check_directory(run_dir, newest_at_least=max(committed, default=2), big=True)


def _random_runs() -> list[int]:
    return list(range(RANDOM_RUNS))


@pytest.mark.parametrize("seed", _random_runs())
def test_kill_at_random_moments(tmp_path: Path, seed: int) -> None:
    """SIGKILL the trainer or the writer at a random moment of a saving loop."""
    rng = random.Random(seed)
    d = tmp_path / "run"
    big = rng.random() < 0.5
    t = Trainer(d, 1, 30, big=big)
    try:
        pid = int(t.read_until("WRITER").split()[1])
        t.read_until("COMMITTED 1")  # a committed step to protect
        time.sleep(rng.uniform(0.0, 1.5))
        victim = rng.choice(["trainer", "writer", "both"])
        if victim in ("writer", "both"):
            current = max(t.writer_pids)
            if alive(current):
                os.kill(current, signal.SIGKILL)
        if victim in ("trainer", "both"):
            t.kill()
            for p in t.writer_pids:
                wait_dead(p)
        else:
            t.finish()
    finally:
        if t.proc.poll() is None:
            t.kill()
    committed = t.committed()
    steps = check_directory(d, newest_at_least=max(committed), big=big)
    assert len(steps) <= KEEP_LAST + 1  # retention ran after every commit but maybe the last
    assert pid in t.writer_pids


def test_commit_order_survives_power_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The storage calls of a save come in the order that makes a power loss at any point safe:
    every data file durable, its directory synced, then the manifest durable, the temp directory
    synced, one rename, the parent synced; retention only after that, invisible-first."""
    from zerostall.storage.local import LocalStorage

    calls: list[tuple[str, str]] = []
    for op in ("write_from_buffer", "put", "sync", "rename", "delete"):
        real = getattr(LocalStorage, op)

        def spy(self: Any, key: str, *a: Any, _real: Any = real, _op: str = op, **k: Any) -> Any:
            calls.append((_op, key if _op != "rename" else f"{key} -> {a[0]}"))
            return _real(self, key, *a, **k)
        monkeypatch.setattr(LocalStorage, op, spy)

    d = tmp_path / "run"
    with Checkpointer(d, keep_last=1, save_options=SaveOptions(writer=WriterKind.THREAD)) as c:
        c.save_pytree(1, state(1))
        calls.clear()
        c.save_pytree(2, state(2))
    # The writer's lease (zerostall.lease) is put before anything of the attempt exists and
    # deleted once the rename is durable, before retention.
    lease = [c for c in calls if c[1].startswith(".zs-lease-")]
    assert [op for op, _ in lease] == ["put", "delete"] and lease[0][1] == lease[1][1], lease
    assert calls[0] == lease[0] and calls[7] == lease[1], calls
    calls = [c for c in calls if c not in lease]
    ops = [op for op, _ in calls]
    keys = [k for _, k in calls]
    tmp = keys[0].split("/")[0]
    assert tmp.startswith(".step_00000002.zs-tmp-")
    assert calls[:6] == [
        ("write_from_buffer", f"{tmp}/data/rank-00000.safetensors"),  # written and fsynced
        ("sync", f"{tmp}/data"),
        ("put", f"{tmp}/manifest.json"),                             # written and fsynced
        ("sync", tmp),
        ("rename", f"{tmp} -> step_00000002"),                        # the commit
        ("sync", ""),                                                 # the rename is durable
    ], calls
    # retention after the commit: step 1 renamed away (invisible), synced, then deleted
    rest = calls[6:]
    assert [op for op, _ in rest] == ["rename", "sync", "delete"], rest
    assert rest[0][1].startswith("step_00000001 -> .step_00000001.zs-del-")
    assert ops.count("rename") == 2
