"""examples/torchrun_ddp.py as one rank of a world of one (what torchrun would set), real gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "torchrun_ddp.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _example(d: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    return subprocess.run([sys.executable, str(EXAMPLE), "--dir", str(d), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_ddp_example_run_again_at_its_last_step_says_so_instead_of_crashing(tmp_path: Path) -> None:
    # A second run in a directory that already holds step --steps resumes there with nothing left
    # to train: it must say so and exit 0, not fail on a loss no step computed.
    first = _example(tmp_path, "--steps", "4", "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _example(tmp_path, "--steps", "4", "--save-every", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step 4 from storage" in again.stdout
    assert "already at step 4, nothing to train" in again.stdout, again.stdout
