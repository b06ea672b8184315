"""The GPU tests need CUDA: without it they stop at once (they are never collected by ``make test``).

``ZEROSTALL_GPUTEST_DEVICE=cpu`` dry-runs the file's own logic on CPU; deselect what only CUDA has:
``-k "not page_locked and not cuda_graph"``.
"""

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("ZEROSTALL_GPUTEST_DEVICE", "cuda") == "cuda" and not torch.cuda.is_available():
        pytest.exit("gputests need a CUDA device (scripts/gpu-session.sh run, on a machine with one)", returncode=2)
