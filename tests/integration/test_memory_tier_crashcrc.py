"""The keeper's persist after a crash makes no checksum pass of its own.

After its trainer died the keeper checks every leaf of the held step against its manifest (on
every core); the persist that follows commits those verified CRC32Cs instead of checksumming the
same bytes again. Real processes: a trainer subprocess (``_memory_trainer.py``) is SIGKILLed after
a memory-only step; the test process then adopts the keeper.

How a checksum pass is seen: the writer's ``checksum`` fault phase (``persist.faults``) is hit
once at the start of every checksum pass a save makes (a trainer's save hits it even where its
staging copy checksummed every leaf: the phase stays a fault point), and with ``ZEROSTALL_FAULTS_MARK`` set a
``wait:`` action there leaves the file ``checksum-<pid>`` (its file to wait for exists, so it
never waits). The keeper's own check is held (``keeper_check``) until the test has removed the
marks the trainer's saves left; a persist that checksummed would leave one again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from memtier_procs import DEADLINE_S, TRAINER, assert_state, parse_trainer_output, running, storage_steps, wait_for

from zerostall import Checkpointer, MemoryTier
from zerostall.commit import step_name
from zerostall.persist.faults import ENV as FAULTS_ENV
from zerostall.persist.faults import MARK_ENV
from zerostall.restore import verify_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from _memory_trainer import state


def test_the_persist_after_a_crash_reuses_the_keepers_verified_checksums(tmp_path: Path) -> None:
    d, marks, go, check_go = tmp_path / "run", tmp_path / "marks", tmp_path / "go", tmp_path / "check-go"
    marks.mkdir()
    go.touch()
    env = dict(os.environ, **{FAULTS_ENV: json.dumps({"checksum": f"wait:{go}", "keeper_check": f"wait:{check_go}"}),
                              MARK_ENV: str(marks)})
    p = subprocess.run([sys.executable, TRAINER, str(d), "1", "4", "3", "60", "kill"], stdout=subprocess.PIPE,
                       text=True, env=env, timeout=DEADLINE_S)
    assert p.returncode == -signal.SIGKILL
    keeper, saved = parse_trainer_output(p.stdout.splitlines())
    assert saved == {1: "memory", 2: "memory", 3: "memory,storage", 4: "memory"}
    mark = marks / f"checksum-{keeper}"
    assert mark.exists()  # the trainer's saves checksummed (the hook is live in this keeper)
    # The keeper has started its check after the death and holds there; its persist waits for it.
    wait_for(lambda: (marks / f"keeper_check-{keeper}").exists(), "the keeper's check to start")
    mark.unlink()
    check_go.touch()
    wait_for(lambda: 4 in storage_steps(d), "step 4 on storage")
    assert not mark.exists(), "the keeper's persist checksummed the held step a second time"
    # What it committed verifies, leaf by leaf, and loads bit for bit from storage.
    report = verify_checkpoint(str(d / step_name(4)))
    assert report.ok and report.leaves > 0, report.problems
    with Checkpointer(d, read_only=True) as ro:
        assert_state(ro.load_pytree(4), state(4))
    # The restart adopts the keeper (and its close ends it).
    assert running(keeper)
    with Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=3, linger_s=60)) as ck:
        assert ck._engine.writer.adopted and ck.latest_step() == 4
        assert_state(ck.load_pytree(), state(4))
    wait_for(lambda: not running(keeper), "the keeper to exit")
