"""The memory tier's keepers are per host: ``ZEROSTALL_HOST_ID`` namespaces their names, so a
process of one simulated host never finds (adopts, lists, restores from) another host's keeper."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SRC = str(Path(__file__).parents[2] / "src")

SAVE = """
import sys, torch
sys.path.insert(0, {src!r})
from zerostall import Checkpointer, MemoryTier
ck = Checkpointer({d!r}, memory_tier=MemoryTier(persist_interval_steps=100, linger_s=60))
ck.save_pytree(1, {{"w": torch.arange(8.0)}})
print(ck._engine.writer.pid, flush=True)
sys.stdin.read()
"""

LOOK = """
import json, sys
sys.path.insert(0, {src!r})
from zerostall import Checkpointer, MemoryTier
from zerostall.memtier.spec import held_steps
held = [r for r, _ in held_steps({d!r})]
ck = Checkpointer({d!r}, memory_tier=MemoryTier(persist_interval_steps=100, linger_s=0))
print(json.dumps({{"held": held, "adopted": ck._engine.writer.adopted, "memory": ck.memory_step()}}), flush=True)
ck.close()
"""


def _env(host: str) -> dict[str, str]:
    env = dict(os.environ, ZEROSTALL_HOST_ID=host, OMP_NUM_THREADS="1")
    env.pop("ZEROSTALL_FAULTS", None)
    return env


def _look(d: Path, host: str) -> dict:
    out = subprocess.run([sys.executable, "-c", LOOK.format(src=SRC, d=str(d))], env=_env(host),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_keeper_is_invisible_to_another_hosts_processes(tmp_path: Path) -> None:
    d = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", SAVE.format(src=SRC, d=str(d))], env=_env("host-a"),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout is not None
    keeper = int(p.stdout.readline())
    p.kill()  # the trainer dies; its keeper lingers, holding step 1 (memory only)
    p.wait()
    try:
        other = _look(d, "host-b")
        assert other == {"held": [], "adopted": False, "memory": None}  # host b: no keeper, nothing in memory
        same = _look(d, "host-a")
        assert same == {"held": [0], "adopted": True, "memory": 1}  # host a: its keeper, holding step 1
    finally:
        try:
            os.kill(keeper, signal.SIGKILL)
        except ProcessLookupError:
            pass
