"""``benchmarks/gpu.py`` (``make bench-gpu``) and ``gpu_restore.py`` run their whole logic on CPU with ``--cpu-dry-run``.

A GPU is rarely at hand, so nothing else would notice the scripts rotting before a run on one
spends its device time on them. This runs every system of
the script (floors, zerostall overlapped and blocking, DCP ``async_save`` with a persistent
stager, ``torch.save``) on a tiny model and checks that each produced a result and that the torn
check found nothing torn. No figure is asserted: timings belong to the benchmark itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--cpu-dry-run", "--dir", str(tmp_path / "w"),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("floor_d2h", "floor_disk", "zerostall_overlap", "zerostall_overlap_inline", "zerostall_blocking",
                 "dcp_async", "torch_save"):
        assert name in res["systems"] and "error" not in res["systems"][name], (name, res["systems"].get(name))
    for name in ("zerostall_overlap", "zerostall_blocking", "dcp_async"):
        assert res["torn"][name] == {"system": name, "saves": 3, "torn": 0}, res["torn"].get(name)


def test_gpu_restore_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    """``benchmarks/gpu_restore.py`` (restores into the trainer's CUDA tensors) on CPU: every system
    loads warm and cold and gives a time (none asserted)."""
    out = tmp_path / "restore.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_restore.py"), "--cpu-dry-run", "--dir",
                           str(tmp_path / "w"), "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["systems"]["floor_h2d"]["warm"]
    for name in ("floor_read", "zerostall", "zerostall_atomic", "safetensors", "dcp", "torch_load"):
        got = res["systems"][name]
        assert "error" not in got and len(got["warm"]) == len(got["cold"]) == 1, (name, got)
    assert not (tmp_path / "w").exists()  # the checkpoints are removed (4.7 GB each on the GPU machine)
