"""JAX for real: sharded arrays over 8 forced host devices, and examples/jax_train.py killed and resumed.

Both run in subprocesses: the device count is fixed when jax starts (``XLA_FLAGS``), and the kill
is a real SIGKILL of a trainer whose writer process then commits the save it was handed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from zerostall import Checkpointer

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "jax_train.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def test_sharded_save_writes_replica_zero_shards_and_loads_into_other_meshes(tmp_path: Path) -> None:
    env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    res = subprocess.run([sys.executable, os.path.join(HERE, "_jax_sharded.py"), str(tmp_path / "c")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    # P("x","y") on 4x2: 8 distinct shards; P("x"): 4 (each held twice); P(): 1 (held 8 times); P(None,"y"): 2
    assert seen["shards"] == {"both": 8, "rows": 4, "repl": 1, "cols": 2}
    everything = {"both": True, "rows": True, "repl": True, "cols": True}
    assert seen["equal"] == everything  # into a 2x4 mesh, other partitionings, one device
    assert seen["sharding_kept"] == everything
    assert seen["same_mesh"] == everything  # into concrete jax.Array templates
    assert seen["as_numpy"] == everything  # no template: assembled whole
    assert seen["as_torch"] == {"both": True, "cols": True}


def _wait_for_step(directory: Path, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with Checkpointer(directory, read_only=True) as c:
        while c.latest_step() != step:
            assert time.monotonic() < deadline, f"step {step} never committed; have {c.steps()}"
            time.sleep(0.1)


def test_example_killed_after_save_async_resumes_bit_for_bit(tmp_path: Path) -> None:
    args = [sys.executable, EXAMPLE, "--steps", "20", "--save-every", "5"]
    ref_out, out = tmp_path / "ref.npz", tmp_path / "resumed.npz"
    # files, not pipes: the killed trainer's orphaned writer inherits them and would hold a pipe open
    with open(tmp_path / "ref.log", "w") as ref_log, open(tmp_path / "killed.log", "w") as killed_log:
        ref = subprocess.Popen([*args, "--dir", str(tmp_path / "ref"), "--out", str(ref_out)],
                               stdout=ref_log, stderr=subprocess.STDOUT, env=ENV)
        killed = subprocess.Popen([*args, "--dir", str(tmp_path / "run"), "--kill-at", "10"],
                                  stdout=killed_log, stderr=subprocess.STDOUT, env=ENV)
        assert killed.wait(timeout=300) == -9, (tmp_path / "killed.log").read_text()[-3000:]
        assert ref.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    _wait_for_step(tmp_path / "run", 10)  # the save the trainer died right after is committed by its writer

    res = subprocess.run([*args, "--dir", str(tmp_path / "run"), "--out", str(out)],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from step 10" in res.stdout
    a, b = np.load(ref_out), np.load(out)
    assert sorted(a) == sorted(b) and len(a) > 1
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    assert int(b["step"]) == 20
