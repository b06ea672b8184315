import os
import sys

import pytest

# Tests import the package from src/ even without an editable install.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))


@pytest.fixture
def ckdir(tmp_path):
    """A fresh directory for checkpoints."""
    d = tmp_path / "ckpts"
    d.mkdir()
    return d
