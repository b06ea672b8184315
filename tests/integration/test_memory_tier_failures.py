"""The keeper's persist after a crash fails: the failure reaches the next trainer, never silently.

Real processes: a trainer subprocess (``_memory_trainer.py``) with a memory tier is SIGKILLed; its
keeper's persist of the memory-only step fails (``ZEROSTALL_FAULTS`` ``keeper_persist``: ENOSPC,
as a full disk reports it; the trainer's own saves never reach that phase). The test process
plays the restarted trainer.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from memtier_procs import DEADLINE_S, TRAINER, assert_state, running, storage_steps, wait_for

from zerostall import Checkpointer, MemoryTier
from zerostall.cli import main as cli_main
from zerostall.commit import step_name
from zerostall.errors import KeeperPersistError, StorageError
from zerostall.memtier.keeperfail import (
    KeeperFailure,
    local_marker,
    marker_key,
    read_markers,
    take_markers,
    write_marker,
)
from zerostall.messages import to_wire
from zerostall.persist.faults import ENV as FAULTS_ENV
from zerostall.persist.faults import MARK_ENV
from zerostall.storage import open_storage

sys.path.insert(0, str(Path(__file__).parent))
from _memory_trainer import state


def _killed_trainer(d: Path, last: int, every: int, linger: float, err: Path) -> int:
    """Run a trainer whose keeper cannot persist after the crash; SIGKILLed after ``last``.
    Returns the keeper's pid. The keeper inherits ``err`` as its stderr."""
    env = dict(os.environ, **{FAULTS_ENV: json.dumps({"keeper_persist": "raise:ENOSPC"})})
    with open(err, "w") as e:
        p = subprocess.run([sys.executable, TRAINER, str(d), "1", str(last), str(every), str(linger), "kill"],
                           stdout=subprocess.PIPE, stderr=e, text=True, env=env, timeout=DEADLINE_S)
    assert p.returncode == -signal.SIGKILL
    keeper = next(int(x.split()[1]) for x in p.stdout.splitlines() if x.startswith("KEEPER "))
    return keeper


def _check(err: KeeperPersistError, d: Path, step: int) -> None:
    assert isinstance(err, KeeperPersistError) and err.step == step
    assert err.errno == errno.ENOSPC and err.path is not None and err.path.endswith(step_name(step))
    assert f"step {step}" in str(err) and step_name(step) in str(err)


def test_failed_persist_reaches_the_adopting_trainer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d, err = tmp_path / "run", tmp_path / "keeper.err"
    keeper = _killed_trainer(d, 4, 3, 60, err)
    # The keeper's persist of step 4 has failed (it says so on the stderr it inherited) before we adopt.
    wait_for(lambda: "failed" in err.read_text(), "the keeper's persist to fail")
    assert running(keeper) and storage_steps(d) == [3]
    with caplog.at_level(logging.WARNING, logger="zerostall"), \
            Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=3, linger_s=60)) as ck:
        assert ck._engine.writer.adopted
        # Nothing committed is lost: step 4 is still in memory, loaded bit for bit.
        assert ck.latest_step() == 4
        assert_state(ck.load_pytree(), state(4))
        (failure,) = ck.keeper_failures
        _check(failure, d, 4)
        ck.save_pytree(6, state(6))  # persisted by the trainer's own save: the fault never fires
        assert ck.keeper_failures == [failure]  # reported once
    assert any(r.levelno == logging.WARNING and "step 4" in r.getMessage() and "ENOSPC" in r.getMessage()
               for r in caplog.records)
    assert storage_steps(d) == [3, 6]
    assert not (d / marker_key(0)).exists()


def test_failed_persist_with_nobody_adopting_leaves_a_marker(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    d, err = tmp_path / "run", tmp_path / "keeper.err"
    keeper = _killed_trainer(d, 2, 5, 0.5, err)
    wait_for(lambda: not running(keeper), "the keeper to exit after linger_s")
    assert storage_steps(d) == []
    assert (d / marker_key(0)).exists()
    # zerostall list shows it (and leaves it for the next trainer).
    assert cli_main(["list", str(d)]) == 0
    out = capsys.readouterr().out
    assert "KEEPER PERSIST FAILED: step 2" in out and "ENOSPC" in out
    assert (d / marker_key(0)).exists()
    with caplog.at_level(logging.WARNING, logger="zerostall"), \
            Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=60)) as ck:
        assert not ck._engine.writer.adopted
        (failure,) = ck.keeper_failures
        _check(failure, d, 2)
    assert any("step 2" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert not (d / marker_key(0)).exists()  # reported once
    with Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=60)) as ck:
        assert ck.keeper_failures == []


def test_marker_falls_back_to_this_host_when_storage_refuses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    d = tmp_path / "run"
    d.mkdir()
    storage = open_storage(str(d))
    f = KeeperFailure(step=9, path=f"{d}/{step_name(9)}", rank=1, time=1.0,
                      error=to_wire(StorageError("read-only", errno=errno.EROFS, path=str(d))))
    os.chmod(d, 0o555)
    blocker = d / marker_key(1)
    blocker.mkdir()  # storage cannot put the marker (a directory is in the way, even for root)
    try:
        where = write_marker(storage, str(d), 1, [f])
    finally:
        os.chmod(d, 0o755)
    assert where == local_marker(str(d), 1) and Path(where).exists()
    blocker.rmdir()
    assert [(x.step, x.rank) for x in read_markers(storage, str(d))] == [(9, 1)]
    assert [x.step for x in take_markers(storage, str(d), 1)] == [9]
    assert not Path(where).exists() and read_markers(storage, str(d)) == []


def test_a_failed_persist_at_close_is_raised_by_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The keeper (started by this Checkpointer) inherits the fault: its persist at close fails.
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"keeper_persist": "raise:ENOSPC"}))
    d = tmp_path / "run"
    ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=60))
    ck.save_pytree(5, state(5))  # persisted by the save itself
    ck.save_pytree(6, state(6))  # memory only
    with pytest.raises(KeeperPersistError) as got:
        ck.close()
    _check(got.value, d, 6)
    assert ck.keeper_failures == [got.value]
    assert storage_steps(d) == [5] and not (d / marker_key(0)).exists()


def test_a_persist_failing_after_the_adoption_reaches_the_trainer_after_its_next_save(tmp_path: Path) -> None:
    d, err, go, marks = tmp_path / "run", tmp_path / "keeper.err", tmp_path / "go", tmp_path / "marks"
    marks.mkdir()
    # The keeper's check after the crash (which its persist waits for) is held until ``go`` exists.
    env = dict(os.environ, **{FAULTS_ENV: json.dumps({"keeper_check": f"wait:{go}", "keeper_persist": "raise:ENOSPC"}),
                              MARK_ENV: str(marks)})
    with open(err, "w") as e:
        p = subprocess.run([sys.executable, TRAINER, str(d), "1", "2", "5", "60", "kill"], stdout=subprocess.PIPE,
                           stderr=e, text=True, env=env, timeout=DEADLINE_S)
    assert p.returncode == -signal.SIGKILL
    ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=60))
    assert ck._engine.writer.adopted and ck.keeper_failures == []  # nothing has failed yet
    go.touch()
    wait_for(lambda: "failed" in err.read_text(), "the keeper's persist to fail")
    ck.save_pytree(3, state(3))  # memory only: the keeper tells us after this job
    wait_for(lambda: ck.keeper_failures, "the failure to reach the trainer")
    (failure,) = ck.keeper_failures
    _check(failure, d, 2)
    assert_state(ck.load_pytree(), state(3))
    # The keeper still cannot write: close()'s own persist of step 3 fails too, and close() raises it
    # (the keeper exits with the step), while step 2's crash-time failure stayed a warning.
    with pytest.raises(KeeperPersistError) as got:
        ck.close()
    _check(got.value, d, 3)
    assert [e.step for e in ck.keeper_failures] == [2, 3]
