"""``Checkpointer.wait()`` with a memory tier: it returns once the newest memory-only step is on
storage, or raises a typed error naming it; the keeper serves on afterwards.

Real processes: the Checkpointer in the test process starts a real keeper process; the failure
cases fail its persist with ``ZEROSTALL_FAULTS`` (inherited by the keeper) or SIGKILL it.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from memtier_procs import assert_state, running, storage_steps, wait_for

from zerostall import Checkpointer, MemoryTier
from zerostall.errors import KeeperLostError, KeeperPersistError
from zerostall.persist.faults import ENV as FAULTS_ENV

sys.path.insert(0, str(Path(__file__).parent))
from _memory_trainer import state


def test_wait_persists_the_newest_memory_only_step_and_the_keeper_serves_on(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=0)) as ck:
        keeper = ck._engine.writer.pid
        for step in range(1, 8):
            ck.save_pytree_async(step, state(step))
        ck.wait()
        assert [s.tiers for s in ck.stats()][-3:] == [("memory", "storage"), ("memory",), ("memory",)]
        assert storage_steps(d) == [5, 7]  # 7 lived in memory only until wait()
        assert ck._engine.writer.pid == keeper and running(keeper)  # the same keeper serves on
        assert ck.memory_step() == 7 and ck.keeper_failures == []
        ck.wait()  # nothing newer than storage's newest: nothing to do
        assert storage_steps(d) == [5, 7]
        # training and saving go on: to memory only again, then persisted by the next wait()
        ck.save_pytree(8, state(8))
        ck.save_pytree(9, state(9))
        assert storage_steps(d) == [5, 7] and ck.memory_step() == 9
        ck.wait()
        assert storage_steps(d) == [5, 7, 9]
        assert_state(ck.load_pytree(7), state(7))  # the persisted bytes load verified
        ck.save_pytree(10, state(10))  # persisted by the save itself
        ck.wait()
        assert storage_steps(d) == [5, 7, 9, 10]
    wait_for(lambda: not running(keeper), "the keeper to exit after close()")


def test_a_failed_persist_at_wait_is_raised_naming_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The keeper (started by this Checkpointer) inherits the fault: every persist of a held step fails.
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"keeper_persist": "raise:ENOSPC"}))
    d = tmp_path / "run"
    ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=0))
    keeper = ck._engine.writer.pid
    ck.save_pytree(5, state(5))  # persisted by the save itself
    ck.save_pytree(6, state(6))  # memory only
    with pytest.raises(KeeperPersistError) as got:
        ck.wait()
    assert got.value.step == 6 and got.value.errno == errno.ENOSPC and "step_00000006" in str(got.value.path)
    assert ck.keeper_failures == [got.value]
    # The keeper serves on: the step is still in memory, and saving goes on.
    assert running(keeper) and ck.memory_step() == 6
    ck.save_pytree(7, state(7))
    assert ck.memory_step() == 7 and storage_steps(d) == [5]
    with pytest.raises(KeeperPersistError) as again:  # close() asks again, for the newest step
        ck.close()
    assert again.value.step == 7 and again.value is not got.value
    assert storage_steps(d) == [5]


def test_wait_raises_keeper_lost_when_the_keeper_ended_with_the_step(tmp_path: Path) -> None:
    d = tmp_path / "run"
    ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=0))
    keeper = ck._engine.writer.pid
    assert keeper is not None
    ck.save_pytree(5, state(5))
    ck.save_pytree(6, state(6))  # memory only
    os.kill(keeper, signal.SIGKILL)
    with pytest.raises(KeeperLostError) as got:
        ck.wait()
    assert got.value.step == 6 and "step_00000006" in str(got.value.path)
    assert storage_steps(d) == [5]
    ck.close()  # raised once, by wait()
    assert [e.step for e in ck.keeper_failures] == [6]
