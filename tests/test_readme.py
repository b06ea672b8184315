"""The README's examples in doctest form run as written (in a scratch directory)."""

from __future__ import annotations

import doctest
import os
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_doctests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the examples save to relative paths
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted >= 6, "the README lost its doctest block"
    assert result.failed == 0
    assert os.path.isdir(tmp_path / "ckpt" / "a")


def _python_block_after(heading: str) -> str:
    """The first ```python block after ``heading`` in the README, as written."""
    text = README.read_text()
    start = text.index("```python\n", text.index(heading)) + len("```python\n")
    return text[start:text.index("```", start)]


def test_readme_quickstart_runs_as_written_and_resumes(tmp_path: Path) -> None:
    """The Quickstart loop (not a doctest: it trains) runs as written, only in a scratch
    directory, then again: the second run resumes, loading the last step into the model."""
    import torch

    import zerostall

    code = _python_block_after("## Quickstart")
    assert code.count('"/tmp/run1"') == 1, "the Quickstart changed its directory: update this test"
    code = code.replace('"/tmp/run1"', repr(str(tmp_path / "run1")))
    first: dict[str, object] = {}
    exec(compile(code, "README.md#quickstart", "exec"), first)
    with zerostall.Checkpointer(tmp_path / "run1", read_only=True) as ck:
        assert ck.steps() == [800, 900, 1000]  # keep_last=3, every 100 steps
    again: dict[str, object] = {}
    exec(compile(code, "README.md#quickstart", "exec"), again)  # start = 1000: loads, trains no further
    model = again["model"]
    assert isinstance(model, torch.nn.Linear) and isinstance(first["model"], torch.nn.Linear)
    assert torch.equal(model.weight, first["model"].weight)  # restored in place from step 1000
