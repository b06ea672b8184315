"""Every environment variable the package reads is in zerostall.envvars and in the README; the A/B
switches read on and off and warn about anything else, once."""

from __future__ import annotations

import ast
import contextlib
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from zerostall import envvars
from zerostall.errors import ZerostallWarning

SRC = Path(envvars.__file__).resolve().parent
README = SRC.parent.parent / "README.md"


def _code_strings(tree: ast.AST) -> list[str]:
    """String constants that are not docstrings."""
    docs: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_module_but_envvars_names_a_variable():
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "envvars.py":
            continue
        for text in _code_strings(ast.parse(path.read_text())):
            if re.search(r"\bZEROSTALL_[A-Z]", text):
                offenders.append(f"{path.relative_to(SRC)}: {text[:60]!r}")
    assert not offenders, offenders


def test_the_readme_lists_every_variable():
    readme = README.read_text()
    section = readme[readme.index("## Environment variables"):]
    missing = [v.name for v in envvars.VARIABLES if f"`{v.name}`" not in section]
    assert not missing, missing


@pytest.mark.parametrize("value, on, warned", [
    ("0", False, False), ("off", False, False), ("False", False, False), ("1", True, False), ("yes", True, False),
    ("of", True, True),
])
def test_a_switch_reads_on_and_off_and_warns_about_anything_else(monkeypatch: pytest.MonkeyPatch, value: str,
                                                                 on: bool, warned: bool) -> None:
    monkeypatch.setenv(envvars.DEVICE_LOADS.name, value)
    with contextlib.ExitStack() as stack:
        if warned:
            stack.enter_context(pytest.warns(ZerostallWarning, match="ZEROSTALL_DEVICE_LOADS='of'"))
        else:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("error")
        assert envvars.switch(envvars.DEVICE_LOADS, "device loads") is on


def test_a_bad_switch_is_warned_about_once_not_again_by_the_writer_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = (
        "import torch, zerostall\n"
        f"with zerostall.Checkpointer({str(tmp_path / 'c')!r}) as ck:\n"
        "    ck.save_pytree(1, {'w': torch.ones(1 << 18)})\n"
        "print('saved')\n"
    )
    env = {**os.environ, "ZEROSTALL_DEVICE_LOADS": "bogus"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "saved" in out.stdout
    assert out.stderr.count("ZEROSTALL_DEVICE_LOADS='bogus'") == 1, out.stderr  # the trainer's, not the writer's too
    assert envvars.settled_switches({"ZEROSTALL_DEVICE_LOADS": "off", "OTHER": "x"}) == {
        "ZEROSTALL_DEVICE_LOADS": "off", "OTHER": "x"}
