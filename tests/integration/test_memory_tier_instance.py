"""A keeper's steps belong to the directory they were saved into, not to its path.

A trainer with a memory tier saves, is SIGKILLed, and its keeper lingers. The directory is then
deleted: a new trainer on the same path starts fresh (nothing from the keeper is offered to it),
the keeper persists nothing into the new directory, and it exits. Real processes: the trainers are
``_memory_trainer.py`` subprocesses, the test process plays the new trainer. (The S3 prefix deleted
and written again: ``tests/storage/test_s3_keeper_instance.py``.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from memtier_procs import DEADLINE_S, TRAINER, keeper_sockets, running, storage_steps, wait_for

from zerostall import Checkpointer, MemoryTier
from zerostall.errors import DirectoryReplacedError, KeeperPersistError
from zerostall.memtier.instance import INSTANCE_KEY
from zerostall.memtier.spec import keeper_address, query_held
from zerostall.persist.faults import ENV as FAULTS_ENV
from zerostall.persist.faults import MARK_ENV

LINGER_S = 300.0  # longer than DEADLINE_S: a keeper that merely expires fails the tests


def _kill_after(d: str, last: int, every: int, env: dict[str, str] | None = None) -> int:
    """Run a trainer that saves steps 1..last and SIGKILLs itself; its keeper's pid."""
    # stderr is not captured: a keeper still persisting keeps the dead trainer's stderr open
    p = subprocess.run([sys.executable, TRAINER, d, "1", str(last), str(every), str(LINGER_S), "kill"],
                       stdout=subprocess.PIPE, text=True, timeout=DEADLINE_S, env=env)
    assert p.returncode == -signal.SIGKILL
    keeper = next(int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("KEEPER "))
    assert f"SAVED {last} memory" in p.stdout
    return keeper


def _rm_rf(d: Path) -> None:
    """``rm -rf d``: a file the keeper removes meanwhile (its lease, released) is no error."""
    while d.exists():
        shutil.rmtree(d, ignore_errors=True)


def _memory() -> MemoryTier:
    return MemoryTier(persist_interval_steps=5, linger_s=LINGER_S)


def _stop(pid: int) -> None:
    if running(pid):
        os.kill(pid, signal.SIGKILL)


def test_a_new_trainer_on_a_deleted_directorys_path_starts_fresh(tmp_path: Path) -> None:
    d = tmp_path / "run"
    keeper = _kill_after(str(d), 7, 5)
    try:
        # The keeper holds step 7 (and persists it after the crash): the directory is still its own.
        wait_for(lambda: 7 in storage_steps(d), "the keeper's persist of step 7")
        held = query_held(str(d), 0)
        assert held is not None and held.step == 7
        old_instance = json.loads((d / INSTANCE_KEY).read_bytes())["instance"]
        _rm_rf(d)

        with Checkpointer(d, memory_tier=_memory()) as ckpt:
            assert ckpt.latest_step() is None and ckpt.steps() == [] and ckpt.memory_step() is None
            assert not ckpt._engine.writer.adopted and ckpt._engine.writer.pid != keeper
            assert json.loads((d / INSTANCE_KEY).read_bytes())["instance"] != old_instance
            wait_for(lambda: not running(keeper), "the old keeper to exit")
            ckpt.save_pytree(1, {"x": np.arange(4)})
        assert storage_steps(d) == [1]  # nothing of the deleted directory's steps
        assert query_held(str(d), 0) is None  # the new keeper closed with its trainer
    finally:
        _stop(keeper)


def test_a_keepers_persist_never_writes_into_a_new_directory_at_its_path(tmp_path: Path) -> None:
    d, mark, go = tmp_path / "run", tmp_path / "mark", tmp_path / "go"
    mark.mkdir()
    env = dict(os.environ, **{FAULTS_ENV: json.dumps({"keeper_persist": f"wait:{go}"}), MARK_ENV: str(mark)})
    keeper = _kill_after(str(d), 7, 5, env)
    try:
        # The keeper's persist of step 7 has started; the directory is deleted and a new run begins.
        wait_for(lambda: any(p.name.startswith("keeper_persist-") for p in mark.iterdir()), "the keeper's persist")
        assert storage_steps(d) == [5]
        _rm_rf(d)
        with Checkpointer(d, memory_tier=_memory()) as ckpt:
            assert ckpt.latest_step() is None and ckpt.memory_step() is None
            go.touch()  # the old keeper's persist goes on now
            wait_for(lambda: not running(keeper), "the old keeper to exit")
            assert storage_steps(d) == []  # step 7 did not go into the new directory
            ckpt.save_pytree(1, {"x": np.arange(4)})
        assert storage_steps(d) == [1]
        assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".zs-instance")) == ["step_00000001"]
    finally:
        _stop(keeper)


def test_a_lingering_keeper_exits_once_its_directory_is_deleted(tmp_path: Path) -> None:
    d, mark, go = tmp_path / "run", tmp_path / "mark", tmp_path / "go"
    mark.mkdir()
    env = dict(os.environ, **{FAULTS_ENV: json.dumps({"keeper_persist": f"wait:{go}"}), MARK_ENV: str(mark)})
    keeper = _kill_after(str(d), 7, 5, env)
    try:
        wait_for(lambda: any(p.name.startswith("keeper_persist-") for p in mark.iterdir()), "the keeper's persist")
        _rm_rf(d)
        go.touch()
        # No new trainer comes: the keeper finds its directory gone, persists nothing and exits
        # (long before its linger would expire).
        wait_for(lambda: not running(keeper), "the keeper to exit")
        assert not d.exists()
        assert keeper_address(str(d), 0) not in keeper_sockets()
    finally:
        _stop(keeper)


def test_a_directory_without_a_marker_gets_one_and_resumes_as_before(tmp_path: Path) -> None:
    d = tmp_path / "run"
    keeper = _kill_after(str(d), 7, 5)
    try:
        wait_for(lambda: 7 in storage_steps(d), "the keeper's persist of step 7")
        # A directory an older version wrote: no marker. A new Checkpointer writes one; it resumes
        # from storage, as before (the lingering keeper's step is another instance's now).
        (d / INSTANCE_KEY).unlink()
        with Checkpointer(d, memory_tier=_memory()) as ckpt:
            assert (d / INSTANCE_KEY).exists()
            assert ckpt.latest_step() == 7 and ckpt.steps() == [5, 7]
            got = ckpt.load_pytree(7)
            assert int(got["step"]) == 7
            ckpt.save_pytree(8, {"x": np.arange(4)})
        assert storage_steps(d) == [5, 7, 8]
        wait_for(lambda: not running(keeper), "the old keeper to exit")
        # The marker stays the same for as long as the directory exists.
        first = (d / INSTANCE_KEY).read_bytes()
        with Checkpointer(d, memory_tier=_memory()) as ckpt:
            assert ckpt.latest_step() == 8
        assert (d / INSTANCE_KEY).read_bytes() == first
    finally:
        _stop(keeper)


def test_close_raises_when_the_directory_was_deleted_under_a_live_trainer(tmp_path: Path) -> None:
    d = tmp_path / "run"
    ckpt = Checkpointer(d, memory_tier=_memory())
    ckpt.save_pytree(5, {"x": np.arange(4)})
    ckpt.save_pytree(6, {"x": np.arange(4) + 1})
    _rm_rf(d)
    with pytest.raises(KeeperPersistError) as info:
        ckpt.close()
    assert info.value.step == 6 and isinstance(info.value.cause, DirectoryReplacedError)
    assert "step 6" in str(info.value)
    assert not (d / "step_00000006").exists()


