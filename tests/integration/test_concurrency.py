"""Several savers and loaders on one directory at once.

* two processes saving different steps: all commit;
* two processes saving the same step: exactly one commits, the other gets
  CheckpointExistsError, and the winner's bytes are intact;
* loads racing saves and retention: a load returns a complete checkpoint or raises
  CheckpointNotFoundError, never a torn one;
* ``close()`` with saves in flight waits for them to commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import CheckpointNotFoundError
from zerostall.persist.faults import ENV

STATE_SRC = '''
import numpy as np

def state(step, tag=0, n=4096):
    return {"w": np.arange(n, dtype=np.float32) * (step + 1) + tag, "tag": tag, "step": step,
            "b": np.full(33, tag * 1000 + step, dtype=np.int64)}
'''
_ns: dict[str, Any] = {}
exec(STATE_SRC, _ns)
state = _ns["state"]

SAVER = STATE_SRC + textwrap.dedent('''
import os, sys, time
from zerostall import Checkpointer
from zerostall.errors import CheckpointExistsError

directory, tag, start = sys.argv[1], int(sys.argv[2]), sys.argv[3]
steps = [int(s) for s in sys.argv[4].split(",")]
ckpt = Checkpointer(directory)
print("READY", flush=True)
while not os.path.exists(start):
    time.sleep(0.001)
for step in steps:
    try:
        ckpt.save_pytree_async(step, state(step, tag)).result()
        print("COMMITTED", step, flush=True)
    except CheckpointExistsError as exc:
        print("EXISTS", step, flush=True)
ckpt.close()
''')


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k
        else:
            assert got[k] == v, k


def run_savers(directory: Path, tmp_path: Path, plans: list[tuple[int, list[int]]],
               env: dict[str, str] | None = None) -> list[list[str]]:
    """Start one saver process per (tag, steps), release them together, return their output lines."""
    start = tmp_path / f"start-{time.monotonic_ns()}"
    procs = [subprocess.Popen([sys.executable, "-c", SAVER, str(directory), str(tag), str(start),
                               ",".join(map(str, steps))], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **(env or {})}) for tag, steps in plans]
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "READY", p.stderr.read() if p.stderr else ""
    start.touch()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        out.append(stdout.split("\n"))
    return out


def test_two_processes_different_steps(tmp_path: Path) -> None:
    d = tmp_path / "run"
    out = run_savers(d, tmp_path, [(1, [1, 3, 5, 7]), (2, [2, 4, 6, 8])])
    assert all(line.startswith("COMMITTED") for lines in out for line in lines if line)
    with Checkpointer(d, save_options=SaveOptions(writer=WriterKind.THREAD)) as c:
        assert c.steps() == list(range(1, 9))
        for s in c.steps():
            same(c.load_pytree(s), state(s, 1 if s % 2 else 2))
    assert not [n for n in os.listdir(d) if n.startswith(".")]


@pytest.mark.parametrize("race", ["at-rename", "natural"])
def test_two_processes_same_step(tmp_path: Path, race: str) -> None:
    """One winner per step. ``at-rename`` holds both writers just before the commit, so both
    pass the early existence check and meet at the atomic rename."""
    d = tmp_path / "run"
    env = {ENV: json.dumps({"commit": "sleep:0.5"})} if race == "at-rename" else None
    steps = [10, 11, 12]
    out = run_savers(d, tmp_path, [(1, steps), (2, steps)], env=env)
    results = [dict((int(line.split()[1]), line.split()[0]) for line in lines if line) for lines in out]
    with Checkpointer(d, save_options=SaveOptions(writer=WriterKind.THREAD)) as c:
        assert c.steps() == steps
        for s in steps:
            outcomes = sorted(r[s] for r in results)
            assert outcomes == ["COMMITTED", "EXISTS"], (s, outcomes)
            winner = 1 if results[0][s] == "COMMITTED" else 2
            same(c.load_pytree(s), state(s, winner))
    # the loser cleaned up its attempt
    assert not [n for n in os.listdir(d) if n.startswith(".")]


def test_loads_racing_saves_and_retention(tmp_path: Path) -> None:
    """A loader hammers the newest step (and the one retention is about to delete) while steps
    are saved with keep_last=1: each load is complete or CheckpointNotFoundError."""
    d = tmp_path / "run"
    stop = threading.Event()
    outcomes: dict[str, int] = {"ok": 0, "not_found": 0}
    errors: list[BaseException] = []

    def loader() -> None:
        while not stop.is_set():
            names = sorted(n for n in os.listdir(d) if n.startswith("step_")) if d.exists() else []
            for n in names[-2:]:
                step = int(n.split("_")[1])
                try:
                    got = zerostall.load_pytree(d / n)
                except CheckpointNotFoundError:
                    outcomes["not_found"] += 1
                    continue
                except BaseException as exc:  # the failure being hunted
                    errors.append(exc)
                    return
                try:
                    same(got, state(step, 0, 1 << 16))
                    outcomes["ok"] += 1
                except AssertionError as exc:
                    errors.append(exc)
                    return

    d.mkdir()
    th = threading.Thread(target=loader)
    th.start()
    try:
        with Checkpointer(d, keep_last=1) as c:
            for step in range(40):
                c.save_pytree_async(step, state(step, 0, 1 << 16))
            c.wait()
        deadline = time.monotonic() + 20  # on a loaded machine the loader may not have won yet
        while outcomes["ok"] == 0 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        th.join()
    assert not errors, errors[0]
    assert outcomes["ok"] > 0


def test_load_of_a_step_being_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While step 5 is written (held in the write phase), loading it says not found; afterwards
    it loads complete."""
    d = tmp_path / "run"
    gate = tmp_path / "gate"  # the writer stays in its write phase until this exists
    monkeypatch.setenv(ENV, json.dumps({"write": f"wait:{gate}"}))
    with Checkpointer(d) as c:
        r = c.save_pytree_async(5, state(5))
        seen_not_found = 0
        while not r.done() and seen_not_found < 3:
            try:
                same(c.load_pytree(5), state(5))
                break
            except CheckpointNotFoundError:
                seen_not_found += 1
            time.sleep(0.01)
        gate.touch()
        r.result()
        assert seen_not_found == 3
        same(c.load_pytree(5), state(5))


def test_close_waits_for_saves_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "run"
    monkeypatch.setenv(ENV, json.dumps({"write": "sleep:0.3"}))
    c = Checkpointer(d, save_options=SaveOptions(max_in_flight=2))
    responses = [c.save_pytree_async(s, state(s)) for s in (1, 2, 3)]
    c.close()
    assert all(r.done() and r.exception() is None for r in responses)
    monkeypatch.delenv(ENV)
    with Checkpointer(d, save_options=SaveOptions(writer=WriterKind.THREAD)) as c2:
        assert c2.steps() == [1, 2, 3]
        for s in (1, 2, 3):
            same(c2.load_pytree(s), state(s))


def test_close_twice_and_save_after_close(tmp_path: Path) -> None:
    c = Checkpointer(tmp_path / "run", save_options=SaveOptions(writer=WriterKind.THREAD))
    c.save_pytree(1, state(1))
    c.close()
    c.close()
    with pytest.raises(zerostall.errors.WriterError):
        c.save_pytree_async(2, state(2))
    assert c.steps() == [1]


def test_same_step_twice_in_one_checkpointer(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "run", save_options=SaveOptions(writer=WriterKind.THREAD, max_in_flight=2)) as c:
        first = c.save_pytree_async(3, state(3, 1))
        try:
            second = c.save_pytree_async(3, state(3, 2))
        except zerostall.errors.CheckpointExistsError:
            second = None
        first.result()
        if second is not None:
            with pytest.raises(zerostall.errors.CheckpointExistsError):
                second.result()
        same(c.load_pytree(3), state(3, 1))
        assert c.steps() == [3]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _partial(d: Path, tag: str, files: int = 1, mark: str = "tmp") -> Path:
    """A partial save (``tmp``) or deletion (``del``) directory as a writer with ``tag``
    (host-pid) would leave it."""
    p = d / f".step_00000009.zs-{mark}-{tag}-{os.urandom(6).hex()}"
    (p / "data").mkdir(parents=True)
    for i in range(files):
        (p / "data" / f"f{i}").write_bytes(b"x")
    return p


def test_stale_attempts_only_of_dead_writers_in_this_pid_namespace(tmp_path: Path) -> None:
    from zerostall.commit.protocol import _host_id

    d = tmp_path / "run"
    d.mkdir()
    dead = _dead_pid()
    mine_dead = _partial(d, f"{_host_id()}-{dead}")
    mine_alive = _partial(d, f"{_host_id()}-{os.getpid()}")
    # same hostname, another PID namespace (a container sharing the host's network): its pids
    # mean nothing here, so its partial save must be left alone
    other_ns = _partial(d, f"{_host_id().split('~')[0]}~1-{dead}")
    other_host = _partial(d, f"some-other-host-{dead}")
    interrupted_delete = _partial(d, f"{_host_id()}-{dead}", mark="del")
    with Checkpointer(d, save_options=SaveOptions(writer=WriterKind.THREAD)):
        pass
    assert not mine_dead.exists() and not interrupted_delete.exists()
    assert mine_alive.exists() and other_ns.exists() and other_host.exists()


def test_two_checkpointers_cleaning_at_once(tmp_path: Path) -> None:
    """Ranks restarting together all clean the same stale directories: none of them fails."""
    from zerostall.commit import remove_stale_attempts
    from zerostall.commit.protocol import _host_id
    from zerostall.storage import open_storage

    d = tmp_path / "run"
    d.mkdir()
    dead = _dead_pid()
    for _ in range(20):
        _partial(d, f"{_host_id()}-{dead}", files=50)
    errors: list[BaseException] = []

    def clean() -> None:
        try:
            remove_stale_attempts(open_storage(str(d)))
        except BaseException as exc:  # pragma: no cover - the failure being hunted
            errors.append(exc)

    threads = [threading.Thread(target=clean) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    remove_stale_attempts(open_storage(str(d)))  # whatever a lost race left, the next pass removes
    assert os.listdir(d) == []
