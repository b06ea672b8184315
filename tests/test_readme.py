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
