import os
import sys

import pytest

# Tests import the package from src/ even without an editable install.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))
# The fault injector (ZEROSTALL_FAULTS) is not part of the package: this process and every process
# the tests start (writers, keepers, trainers, torchrun workers) find it in tests/support.
_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
sys.path.insert(0, _SUPPORT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SUPPORT, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture
def ckdir(tmp_path):
    """A fresh directory for checkpoints."""
    d = tmp_path / "ckpts"
    d.mkdir()
    return d


@pytest.fixture
def run_with_unreadable_newest(tmp_path):
    """A run directory with committed steps 1 and 2, step 2's folder mode 000 (restored afterwards)."""
    import torch

    import zerostall

    run = tmp_path / "run"
    with zerostall.Checkpointer(run) as ckpt:
        ckpt.save_pytree(1, {"w": torch.ones(4)})
        ckpt.save_pytree(2, {"w": torch.full((4,), 2.0)})
    newest = run / "step_00000002"
    newest.chmod(0)
    yield run
    newest.chmod(0o755)
