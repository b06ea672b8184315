"""The memory tier's keeper holds a trainer's leaf layouts for that trainer's connection only: a
trainer that adopts it, or that starts a new keeper after its own died, sends its layouts again,
and the saves that name them commit what that trainer staged."""

from __future__ import annotations

import json
import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zerostall import Checkpointer, MemoryTier
from zerostall.memtier.spec import query_held

sys.path.insert(0, str(Path(__file__).parent))
from _memory_trainer import state
from memtier_procs import assert_state, running, storage_steps, wait_for


def _sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The op of every message this process sends on a connection from now on (the keeper is
    another process: these are the trainer's)."""
    ops: list[str] = []
    real = Connection.send_bytes

    def send_bytes(self: Connection, buf: Any, *args: Any) -> None:
        try:
            ops.append(json.loads(bytes(buf))["op"])
        except (ValueError, KeyError, TypeError):
            ops.append("?")
        real(self, buf, *args)

    monkeypatch.setattr(Connection, "send_bytes", send_bytes)
    return ops


def _other(step: int) -> dict[str, Any]:
    """Another layout than :func:`state`'s: one key more, one array of another shape."""
    s = state(step)
    s["extra"] = np.arange(7, dtype=np.int16) * step
    s["w"] = s["w"][:100].copy()
    return s


def test_an_adopting_trainer_sends_the_keeper_its_layout_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = MemoryTier(persist_interval_steps=5, linger_s=60)
    with pytest.raises(RuntimeError, match="boom"), Checkpointer(tmp_path, memory_tier=tier) as ck:
        ck.save_pytree(1, state(1))
        ck.save_pytree(2, state(2))  # names the layout the keeper holds for this connection
        keeper = ck._engine.writer.pid
        raise RuntimeError("boom")  # left as after a crash: the keeper lingers
    assert keeper is not None and running(keeper)

    def lingering() -> bool:  # the keeper has seen its trainer's connection end
        img = query_held(str(tmp_path), 0)
        return img is not None and img.trainer_pid is None

    wait_for(lingering, "the keeper to linger")
    ops = _sent(monkeypatch)
    with Checkpointer(tmp_path, memory_tier=tier) as ck:
        assert ck._engine.writer.adopted and ck._engine.writer.pid == keeper
        # a new trainer's layout ids start again: the keeper must not take them for its predecessor's
        ck.save_pytree(3, _other(3))
        ck.save_pytree(4, _other(4))
        assert [op for op in ops if op in ("layout", "save")] == ["layout", "save", "save"]
        assert ck.memory_step() == 4
        assert_state(ck.load_pytree(4), _other(4))
    assert 4 in storage_steps(tmp_path)  # the close persisted the memory-only step, with these rows
    with Checkpointer(tmp_path) as ck:
        assert_state(ck.load_pytree(4), _other(4))


def test_a_trainer_whose_keeper_died_sends_the_new_keeper_its_layout(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tier = MemoryTier(persist_interval_steps=1, linger_s=60)
    with Checkpointer(tmp_path, memory_tier=tier) as ck:
        ck.save_pytree(1, state(1))
        ck.save_pytree(2, state(2))
        first = ck._engine.writer.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not ck._engine.writer.alive(), "the trainer to see its keeper end")
        ops = _sent(monkeypatch)
        ck.save_pytree(3, state(3))  # a new keeper: the layout goes first, the save is not refused
        assert ck._engine.writer.pid not in (None, first)
        assert [op for op in ops if op in ("layout", "save")] == ["layout", "save"]
        assert_state(ck.load_pytree(3), state(3))
    assert storage_steps(tmp_path) == [1, 2, 3]
