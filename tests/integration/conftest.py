"""Fixtures shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerostall import Checkpointer, SaveOptions, WriterKind


@pytest.fixture
def run_dir(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A run directory holding committed steps 1 and 2, saved without faults.

    The states come from the requesting test module's own ``state(step)``.
    """
    state = request.module.state
    d = tmp_path / "run"
    with Checkpointer(d, save_options=SaveOptions(writer=WriterKind.THREAD)) as c:
        c.save_pytree(1, state(1))
        c.save_pytree(2, state(2))
    return d
