"""An optional dependency that is not installed (boto3, lightning, jax): using what needs it raises
``MissingDependencyError``, a ZerostallError and an ImportError that names the extra to install,
and it crosses the writer's wire with its type."""

from __future__ import annotations

import sys

import pytest

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind, ZerostallError
from zerostall.errors import MissingDependencyError
from zerostall.messages import from_wire, to_wire
from zerostall.storage import open_storage

THREAD = SaveOptions(writer=WriterKind.THREAD)


def test_s3_without_boto3_is_a_zerostall_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError, as where it is not installed
    monkeypatch.delitem(sys.modules, "zerostall.storage.s3", raising=False)
    with pytest.raises(MissingDependencyError, match=r"pip install 'zerostall\[s3\]'") as info:
        open_storage("s3://bucket/run")
    assert isinstance(info.value, ZerostallError) and isinstance(info.value, ImportError)
    assert info.value.name == "boto3" and info.value.path == "s3://bucket/run"
    with pytest.raises(MissingDependencyError, match="boto3"):
        zerostall.load_pytree("s3://bucket/run/step_1")
    with pytest.raises(MissingDependencyError, match=r"zerostall\[s3\]"):
        Checkpointer("s3://bucket/run", save_options=THREAD)


def test_missing_dependency_error_crosses_the_writer_wire() -> None:
    exc = MissingDependencyError("needs boto3", path="s3://b/r", name="boto3")
    back = from_wire(to_wire(exc))
    assert type(back) is MissingDependencyError and back.path == "s3://b/r" and "needs boto3" in str(back)


def test_lightning_without_lightning_is_a_zerostall_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # As where lightning is not installed. Its submodules too: the suite's collection may have
    # imported them already, and an import finds a submodule in sys.modules without its parent.
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")] + ["lightning"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "zerostall.lightning", raising=False)
    monkeypatch.delitem(sys.modules, "zerostall.integrations.lightning", raising=False)
    with pytest.raises(MissingDependencyError, match=r"pip install 'zerostall\[lightning\]'") as info:
        import zerostall.lightning  # noqa: F401
    assert info.value.name == "lightning" and isinstance(info.value, ImportError)


def test_jax_integration_without_jax_is_a_zerostall_error_naming_the_extra() -> None:
    # In a fresh interpreter: this one may have the integration loaded (and registered) already.
    import subprocess

    code = ("import sys; sys.modules['jax'] = None\n"
            "from zerostall.errors import MissingDependencyError\n"
            "try:\n    import zerostall.integrations.jax\n"
            "except MissingDependencyError as e:\n    print('MISSING', e.name, isinstance(e, ImportError), e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("MISSING jax True") and "pip install 'zerostall[jax]'" in out.stdout
