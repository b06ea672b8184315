"""What the memory tier's errors name: a step's path rather than the keeper's internal
``zsimage://`` URL, a step held only in a live keeper's memory, a writer it cannot work with.

Real processes: the trainers are ``python -c`` subprocesses with a memory tier; one is SIGKILLed
so that the test's ``Checkpointer`` adopts its keeper, the other stays alive holding its step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerostall
from zerostall import MemoryTier, SaveOptions, WriterKind
from zerostall.errors import CheckpointNotFoundError, InvalidArgumentError, MismatchError

_KILLED_TRAINER = """
import os, signal, sys, torch, zerostall
ck = zerostall.Checkpointer(sys.argv[1], memory_tier=zerostall.MemoryTier(persist_interval_steps=5, linger_s=60))
for s in (1, 2):
    ck.save_pytree_async(s, {"w": torch.full((4,), float(s))}).result()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_mismatch_loading_from_memory_names_the_step_path(tmp_path: Path) -> None:
    d = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", _KILLED_TRAINER, str(d)], timeout=120)
    assert p.returncode == -9
    with zerostall.Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=5)) as ck:
        assert ck.memory_step() == 2  # adopted: step 2 is read from memory
        with pytest.raises(MismatchError) as info:
            ck.load_pytree(2, template={"w": torch.zeros(5)})
        assert info.value.path == f"{d}/step_00000002" and info.value.key == "pytree/w"
        assert "memory tier" in str(info.value) and "zsimage" not in str(info.value)
        assert ck.load_pytree(2, template={"w": torch.zeros(4)})["w"].tolist() == [2.0] * 4


_LIVE_TRAINER = """
import sys, torch, zerostall
with zerostall.Checkpointer(sys.argv[1], memory_tier=zerostall.MemoryTier(persist_interval_steps=5)) as ck:
    for s in (1, 2):
        ck.save_pytree_async(s, {"w": torch.full((4,), float(s))}).result()
    print("HELD", ck.memory_step(), flush=True)
    sys.stdin.readline()
"""


def test_loading_a_step_a_live_trainers_keeper_holds_says_why_it_is_not_on_storage(tmp_path: Path) -> None:
    d = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", _LIVE_TRAINER, str(d)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().split() == ["HELD", "2"]
        ck = zerostall.Checkpointer(d, read_only=True)
        with pytest.raises(CheckpointNotFoundError, match="step 2 is held only in the memory of this host's "
                                                          "keeper of rank 0") as info:
            ck.load_pytree(2)
        assert info.value.path == f"{d}/step_00000002"
        with pytest.raises(CheckpointNotFoundError) as other:
            ck.load_pytree(3)  # held nowhere: no such hint
        assert "held only in the memory" not in str(other.value)
        with pytest.raises(CheckpointNotFoundError, match="step 2 is held only in the memory"):
            zerostall.load_pytree(d / "step_00000002")  # the free function too
        ck.close()
    finally:
        assert p.stdin is not None
        p.communicate("\n", timeout=120)
    assert p.returncode == 0
    assert zerostall.load_pytree(d / "step_00000002")["w"].tolist() == [2.0] * 4  # persisted at close()


def test_memory_tier_with_a_thread_writer_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="the memory tier needs the process writer") as info:
        zerostall.Checkpointer(tmp_path / "run", memory_tier=MemoryTier(),
                               save_options=SaveOptions(writer=WriterKind.THREAD))
    assert info.value.path == str(tmp_path / "run")
