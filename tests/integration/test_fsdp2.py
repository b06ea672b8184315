"""FSDP2 (``fully_shard``, DTensor parameters and moments) under real torchrun, gloo on CPU: a resume
on another world size into a fresh optimizer, and ``zerostall inspect`` of the sharded checkpoint.

Each rank runs ``_fsdp2_trainer.py``; the model's first layer (37x13) splits unevenly over 2 ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).parents[2] / "src")
FSDP = Path(__file__).parent / "_fsdp2_trainer.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(n: int, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(FSDP), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_fsdp2_resume_into_a_fresh_optimizer_on_another_world_size_gets_sharded_moments(tmp_path: Path) -> None:
    # docs/distributed.md: DTensors (FSDP2) reshard N -> M. A freshly built optimizer has no state
    # yet, so the load makes its moments: they must be DTensors sharded like their parameters, not
    # the whole global moments as plain tensors, on which the next step() fails ("aten.lerp_.Scalar
    # got mixed torch.Tensor and DTensor").
    _torchrun(2, str(tmp_path), "save")
    _torchrun(3, str(tmp_path), "resume")
    for rank in range(3):
        res = json.loads((tmp_path / f"result-resume-{rank}.json").read_text())
        assert "error" not in res, res.get("tb")
        assert res == {"moments_are_dtensors": True, "moments_equal_saved": True, "stepped": True}


def test_inspect_of_an_fsdp2_checkpoint_shows_where_each_shard_lies(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # The two rows of pytree/model/0.weight (19x13 and 18x13) are the halves of one 37x13 tensor:
    # inspect says where each box lies in it and which rank saved it.
    from zerostall.cli import main

    _torchrun(2, str(tmp_path), "save")
    step = str(tmp_path / "run" / "step_00000003")
    assert main(["inspect", "--json", step]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["leaves"]
            if r["key"] == "pytree/model/0.weight"]
    assert sorted((r["shard"]["offset"], r["shape"]) for r in rows) == [([0, 0], [19, 13]), ([19, 0], [18, 13])]
    assert all(r["shard"]["global"] == [37, 13] for r in rows)
    # Each box was saved by one rank; every rank's tree lists both boxes, yet neither is "all".
    assert sorted((r["shard"]["offset"], r["ranks"]) for r in rows) == [([0, 0], [0]), ([19, 0], [1])]
    assert main(["inspect", step]) == 0
    out = capsys.readouterr().out
    assert "19x13 @0,0 of 37x13" in out and "18x13 @19,0 of 37x13" in out, out
