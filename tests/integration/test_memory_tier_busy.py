"""Two memory tiers of one directory and rank on one host: the second is refused, not silently
left without a keeper a restart could find (found in the round-3 newcomer run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from zerostall import Checkpointer, InvalidArgumentError, MemoryTier

TIER = MemoryTier(persist_interval_steps=3, linger_s=5)


def test_a_second_checkpointer_of_the_same_directory_in_this_process_is_refused(tmp_path):
    with Checkpointer(tmp_path, memory_tier=TIER) as first:
        first.save_pytree(1, {"w": torch.ones(4)})
        with pytest.raises(InvalidArgumentError) as info:
            second = Checkpointer(tmp_path, memory_tier=TIER)
            second.save_pytree(1, {"w": torch.zeros(4)})
        assert str(tmp_path) in str(info.value) and "this process" in str(info.value)
        first.save_pytree(2, {"w": torch.full((4,), 2.0)})  # the first one is untouched
    with Checkpointer(tmp_path, memory_tier=TIER) as again:  # once closed, the directory is free
        assert again.steps() == [2]
        assert torch.equal(again.load_pytree(2)["w"], torch.full((4,), 2.0))


def test_a_live_trainer_in_another_process_holds_the_directory(tmp_path):
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import pathlib, time, torch, zerostall
        with zerostall.Checkpointer({str(tmp_path / 'run')!r},
                                    memory_tier=zerostall.MemoryTier(persist_interval_steps=3, linger_s=5)) as c:
            c.save_pytree(1, {{"w": torch.ones(4)}})
            pathlib.Path({str(ready)!r}).touch()
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the other trainer did not save"
        with pytest.raises(InvalidArgumentError, match=f"pid {proc.pid}"):
            c = Checkpointer(tmp_path / "run", memory_tier=TIER)
            c.save_pytree(2, {"w": torch.zeros(4)})
    finally:
        proc.kill()
        proc.wait()
