"""A save while another thread's load still copies from the pre-mapped step.

The restarted trainer's ``Checkpointer`` adopts its keeper and maps the held step in the background
(:mod:`zerostall.memtier.premap`). A save releases that mapping (the keeper lets go of the step
once the new one is in memory). If a load on another thread is copying out of it at that moment,
the load must still return the step bit for bit, and once both have ended nothing of the step may
stay mapped or open in this process.
"""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from memtier_procs import (
    DEADLINE_S,
    assert_state,
    fds_of,
    held_inodes,
    killed_trainer,
    mappings_of,
    memory_tier,
    running,
    wait_for,
)

from zerostall import Checkpointer
from zerostall.memtier import image as image_mod

sys.path.insert(0, str(Path(__file__).parent))
from _memory_trainer import state


def _gate_copies(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Hold the first copy a load makes out of a memory-tier image, right after it copied its
    piece (the load is then in the middle of its copy, its views of the mapping alive), until
    ``go`` is set; ``copying`` says it got there. The copies themselves are the real ones."""
    copying, go = threading.Event(), threading.Event()
    lock = threading.Lock()

    def gated(real: Any) -> Any:
        def copy(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            with lock:
                first = not copying.is_set()
                copying.set()
            if first:
                assert go.wait(DEADLINE_S), "the save never let the load go on"
            return out
        return copy

    monkeypatch.setattr(image_mod.ImageStorage, "read_into", gated(image_mod.ImageStorage.read_into))
    monkeypatch.setattr(image_mod.ImageStorage, "scan", gated(image_mod.ImageStorage.scan))
    monkeypatch.setattr(image_mod.ImageMap, "copy_into", gated(image_mod.ImageMap.copy_into))
    return copying, go


def _load_on_thread(ck: Checkpointer, step: int, got: dict[str, Any]) -> threading.Thread:
    """Start ``ck.load_pytree(step)`` into a fresh template on a thread; its result or error goes to
    ``got["out"]`` / ``got["err"]`` (asserted on the main thread)."""

    def load() -> None:
        try:
            got["out"] = ck.load_pytree(step, template=state(0))
        except BaseException as exc:  # asserted on the main thread
            got["err"] = exc

    loader = threading.Thread(target=load)
    loader.start()
    return loader


def test_a_save_while_another_thread_loads_from_the_premapped_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "run"
    keeper = killed_trainer(d)
    ck = Checkpointer(d, memory_tier=memory_tier(every=1000))
    premap = ck._memory.premap
    assert ck._engine.writer.pid == keeper and premap is not None
    inodes = held_inodes(ck)
    copying, go = _gate_copies(monkeypatch)
    got: dict[str, Any] = {}
    loader = _load_on_thread(ck, 3, got)
    try:
        assert copying.wait(DEADLINE_S), "the load never copied from the memory tier"
        assert premap.reused == 1  # it copies out of the mapping made at adoption
        ck.save_pytree(4, state(4))  # releases that mapping while the load still uses it
        assert ck._memory.premap is None
    finally:
        go.set()
        loader.join(DEADLINE_S)
    assert not loader.is_alive()
    assert "err" not in got, got.get("err")
    assert_state(got["out"], state(3))  # bit for bit, though the save released the mapping meanwhile
    monkeypatch.undo()
    got.clear()  # the loaded arrays: the load holds nothing of the mapping after this
    gc.collect()
    # The load has let go of its views: the step is unmapped and no descriptor of it is open here.
    assert mappings_of(inodes) == {} and fds_of(inodes) == []
    assert ck.latest_step() == 4
    assert_state(ck.load_pytree(4), state(4))
    ck.close()
    wait_for(lambda: not running(keeper), "the keeper to exit after close()")


def test_a_save_while_another_thread_loads_this_trainers_own_step_from_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a restart the step the keeper holds is this trainer's own staging slot. A save on
    another thread makes the keeper let go of it (once the new step is in memory), and the save
    after that would stage into the very bytes the load copies from: the load then read a mix of
    two steps (its checksum pass, when it made one, reported the held step corrupt). The slot now
    goes back to the pool only when the load has ended; that next save waits for it meanwhile."""
    ck = Checkpointer(tmp_path / "run", memory_tier=memory_tier(every=1000))  # 2 slots: one held, one free
    ck.save_pytree(1, state(1))
    copying, go = _gate_copies(monkeypatch)
    got: dict[str, Any] = {}

    def save_more() -> None:
        try:
            ck.save_pytree(3, state(3))  # the slot step 1 was staged in is the only one left
        except BaseException as exc:  # asserted on the main thread
            got["save_err"] = exc

    loader = _load_on_thread(ck, 1, got)
    saver = threading.Thread(target=save_more)
    try:
        assert copying.wait(DEADLINE_S), "the load never copied from the memory tier"
        ck.save_pytree(2, state(2))  # in the free slot; on its commit the keeper lets go of step 1's
        saver.start()
        # Either that slot came back and the save of 3 is done (staged into the bytes being loaded),
        # or it is kept for the load, and the save of 3 waits for it.
        wait_for(lambda: not saver.is_alive() or getattr(ck._memory.keeper, "_deferred", []),
              "the save of 3 to stage or to wait")
    finally:
        go.set()
        loader.join(DEADLINE_S)
    saver.join(DEADLINE_S)
    assert not loader.is_alive() and not saver.is_alive()
    assert "err" not in got and "save_err" not in got, got
    assert_state(got["out"], state(1))  # bit for bit: nothing was staged into it meanwhile
    monkeypatch.undo()
    assert ck.latest_step() == 3
    assert_state(ck.load_pytree(3), state(3))
    ck.close()
