"""Multi-host JAX for real: two processes joined by ``jax.distributed`` (coordinator on localhost,
gloo CPU collectives), 4 CPU devices each, one mesh over all 8.

Each process writes only the shards it owns (replica 0 of each box), the two files commit as one
checkpoint, and both processes load it into a mesh that orders and splits the devices differently.
A donation before the background copy on one process fails that save on both, committing nothing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import zerostall

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def test_two_processes_write_their_own_shards_and_load_into_another_mesh(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    port, path = _free_port(), tmp_path / "run"
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(2)]
    try:
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_jax_multihost.py"), str(r), str(port), str(path)],
                                  stdout=subprocess.PIPE, stderr=logs[r], text=True, env=env) for r in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for f in logs:
            f.close()
    for r, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"rank{r}.log").read_text()[-4000:]
    seen = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    for r in range(2):
        assert seen[r]["rank"] == r
        assert seen[r]["equal"] == {"both": True, "rows": True, "repl": True}  # other mesh, bit for bit
        assert seen[r]["steps"] == [1]  # the failed save 2 is committed nowhere
    # process 1 donated before its copy (the accelerator path); process 0 fails the same save
    assert seen[1]["failed"] == "DonatedArrayError"
    assert seen[0]["failed"] == "DonatedArrayError"  # the same class, through the collective decision

    m = seen[0]["manifest"]
    assert [f["path"] for f in m["files"]] == ["data/rank-00000.safetensors", "data/rank-00001.safetensors"]
    by_file: dict[int, list[str]] = {0: [], 1: []}
    for leaf in m["leaves"]:
        by_file[leaf["file"]].append(leaf["key"])
    # devices 0-3 (process 0) hold rows 0-7 of the 4x2 mesh, devices 4-7 (process 1) rows 8-15;
    # "rows" is held twice and "repl" eight times, and every box is written once, by its owner
    assert sorted(by_file[0]) == sorted(["pytree/both@0,0", "pytree/both@0,4", "pytree/both@4,0", "pytree/both@4,4",
                                         "pytree/rows@0,0", "pytree/rows@4,0", "pytree/repl@0"])
    assert sorted(by_file[1]) == sorted(["pytree/both@8,0", "pytree/both@8,4", "pytree/both@12,0",
                                         "pytree/both@12,4", "pytree/rows@8,0", "pytree/rows@12,0"])

    # one process, no jax.distributed: the whole arrays, assembled from both processes' files
    sys.path.insert(0, HERE)
    try:
        from _jax_multihost import GLOBAL
    finally:
        sys.path.remove(HERE)
    with zerostall.Checkpointer(path, read_only=True) as c:
        whole = c.load_pytree(1)
    assert sorted(whole) == sorted(GLOBAL)
    for k, v in GLOBAL.items():
        assert whole[k].dtype == v.dtype and np.asarray(whole[k]).tobytes() == v.tobytes(), k
