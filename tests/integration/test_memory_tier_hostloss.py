"""A restarted job beside keepers still persisting for the dead run: nothing delays it, nothing is lost.

Four gloo ranks, each its own process; two hosts simulated with ``ZEROSTALL_HOST_ID`` (ranks 0
and 1 on host A, ranks 2 and 3 on host B). Each rank saves every step with
``MemoryTier(persist_interval_steps=4)``. After step 6, host B is lost (its trainers and keepers
SIGKILLed), then host A's trainers; host A's keepers live on and start a collective persist of
step 6 that cannot complete (host B's keepers are gone). The job restarts: ranks 0 and 1 on host A
(they adopt host A's keepers), ranks 2 and 3 on a new host C. Every rank resumes from step 4,
trains to step 10 and closes: ``close()`` returns once step 10 is on storage, without waiting for
the dead run's attempt, and the old keepers exit once that attempt has given up (bounded by
``DistributedOptions(timeout_s)``). When host A's keepers are killed while the new job runs,
``close()`` raises on every rank, naming step 10.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from memtier_procs import DEADLINE_S, running, wait_for

pytest.importorskip("torch")

from zerostall.commit import committed_steps
from zerostall.storage import open_storage

sys.path.insert(0, str(Path(__file__).parent))

WORKER = str(Path(__file__).parent / "_memory_host_trainer.py")
WORLD = 4
#: the first job's collective timeout: longer than the test, so the dead run's attempt at step 6 is
#: still waiting for host B's keepers when the restarted job closes (unless it is abandoned)
FIRST_TIMEOUT_S = 300.0
#: the restarted job's: its close() persists step 10 well within it when every keeper takes part
TIMEOUT_S = 10.0
HOSTS_FIRST = ["A", "A", "B", "B"]
HOSTS_AFTER = ["A", "A", "C", "C"]


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _start(phase: str, d: Path, hosts: list[str], log: Path, timeout: float = TIMEOUT_S) -> list[subprocess.Popen[str]]:
    port = _port()
    procs = []
    with open(log, "a") as err:  # stderr to a file: a keeper keeps a pipe open while it persists
        for r in range(WORLD):
            env = dict(os.environ, OMP_NUM_THREADS="1", ZEROSTALL_HOST_ID=f"host-{hosts[r]}")
            env.pop("ZEROSTALL_FAULTS", None)
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, phase, str(r), str(WORLD), str(port), str(d), str(timeout),
                 str(d.parent / f"out-{r}.json")], stdout=subprocess.PIPE, stderr=err, stdin=subprocess.PIPE,
                text=True, env=env))
    return procs


def _read_until(p: subprocess.Popen[str], word: str, log: Path) -> list[str]:
    assert p.stdout is not None
    lines = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"rank exited ({p.poll()}) before {word}:\n{log.read_text()[-4000:]}")
        lines.append(line.strip())
        if line.strip() == word:
            return lines
    raise AssertionError(f"timed out waiting for {word}")


def _keeper_of(lines: list[str]) -> int:
    return next(int(x.split()[1]) for x in lines if x.startswith("KEEPER "))


def _lose_hosts(d: Path, log: Path) -> list[int]:
    """Run the first job to step 6, lose host B entirely, then host A's trainers: host A's keepers' pids."""
    procs = _start("first", d, HOSTS_FIRST, log, FIRST_TIMEOUT_S)
    keepers = [_keeper_of(_read_until(p, "READY", log)) for p in procs]
    for r in (2, 3):  # host B: every process
        os.kill(keepers[r], signal.SIGKILL)
        procs[r].kill()
    for r in (0, 1):
        procs[r].kill()
    for p in procs:
        p.wait(timeout=DEADLINE_S)
    assert committed_steps(open_storage(str(d))) == [4]
    # Host A's keepers persist step 6 together, an attempt host B's keepers will never join.
    wait_for(lambda: any(n.startswith(".step_00000006.") for n in os.listdir(d)), "host A's keepers' attempt at step 6")
    assert all(running(keepers[r]) for r in (0, 1))
    return keepers[:2]


def _outs(d: Path) -> list[dict]:
    return [json.loads((d.parent / f"out-{r}.json").read_text()) for r in range(WORLD)]


def test_a_restart_beside_keepers_persisting_for_a_lost_host_stores_its_last_step(tmp_path: Path) -> None:
    d, log = tmp_path / "run", tmp_path / "log"
    old = _lose_hosts(d, log)

    procs = _start("resume", d, HOSTS_AFTER, log)
    for p in procs:
        p.communicate(timeout=DEADLINE_S)
        assert p.returncode == 0, log.read_text()[-6000:]
    outs = _outs(d)
    assert [o["start"] for o in outs] == [4] * WORLD and all(o["restored"] for o in outs)
    assert [o["adopted"] for o in outs] == [True, True, False, False]
    assert [o["keeper"] for o in outs[:2]] == old
    assert [o["error"] for o in outs] == [None] * WORLD, outs
    # close() stored the newest memory-only step; the dead run's step 6 never committed.
    assert committed_steps(open_storage(str(d))) == [4, 8, 10]
    # close() did not wait for the dead run's attempt (it would have given up only after
    # FIRST_TIMEOUT_S): the adopted keepers abandoned it once step 10 was stored, removed their
    # parts and exited.
    for k in old:
        wait_for(lambda k=k: not running(k), f"old keeper {k} to exit")
    left = [n for n in os.listdir(d) if n.startswith(".step_00000006.")]
    assert left == [], left


def test_close_raises_naming_the_last_step_when_the_adopted_keepers_die(tmp_path: Path) -> None:
    d, log = tmp_path / "run", tmp_path / "log"
    old = _lose_hosts(d, log)

    procs = _start("resume-hold", d, HOSTS_AFTER, log)
    for p in procs:
        _read_until(p, "HOLDING", log)
    for k in old:  # host A's keepers, adopted by ranks 0 and 1, die while the new job runs
        os.kill(k, signal.SIGKILL)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        p.communicate(timeout=DEADLINE_S)
        assert p.returncode == 0, log.read_text()[-6000:]
    outs = _outs(d)
    assert [o["adopted"] for o in outs] == [True, True, False, False]
    # Every rank's close() raises a typed error naming step 10, which only memory held.
    assert [o.get("error_step") for o in outs] == [10] * WORLD, outs
    assert [o["error"] for o in outs[:2]] == ["KeeperLostError"] * 2, outs
    assert [o["error"] for o in outs[2:]] == ["KeeperPersistError"] * 2, outs
    assert all("step 10" in o["message"] for o in outs)
    assert committed_steps(open_storage(str(d))) == [4, 8]
