"""Mistakes a newcomer makes through the Python API, each answered by a ZerostallError that says
what to do (docs/newcomer-run.md logs how they were found)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import zerostall
from zerostall import (
    ArgumentTypeError,
    Checkpointer,
    CheckpointNotFoundError,
    InvalidArgumentError,
    MismatchError,
    SaveOptions,
    WriterKind,
    ZerostallError,
)
from zerostall.errors import MissingDependencyError, from_wire, to_wire
from zerostall.storage import open_storage

THREAD = SaveOptions(writer=WriterKind.THREAD)


# -- optional dependencies missing -------------------------------------------------------------


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


# -- memory:// with the default writer process: the save would vanish -------------------------


def test_memory_url_with_the_writer_process_is_refused_before_anything_starts() -> None:
    with pytest.raises(InvalidArgumentError, match=r"SaveOptions\(writer=WriterKind.THREAD\)") as info:
        zerostall.save_pytree("memory://newcomer/a", {"w": torch.ones(2)})
    assert info.value.path == "memory://newcomer/a" and info.value.argument == "options"
    with pytest.raises(InvalidArgumentError, match="memory://"):
        Checkpointer("memory://newcomer/run")
    # what the message says to do works, and a read-only Checkpointer needs no writer at all
    zerostall.save_pytree("memory://newcomer/b", {"w": torch.ones(2)}, options=THREAD)
    assert torch.equal(zerostall.load_pytree("memory://newcomer/b")["w"], torch.ones(2))
    with Checkpointer("memory://newcomer/run2", save_options=THREAD) as ck:
        ck.save_pytree(1, {"w": torch.ones(2)})
    with Checkpointer("memory://newcomer/run2", read_only=True) as ro:
        assert ro.latest_step() == 1


# -- templates on the meta device: loading would hand them back empty -------------------------


def test_meta_template_is_refused_naming_the_key(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    zerostall.save_pytree(tmp_path / "a", {"w": torch.ones(3), "model": model}, options=THREAD)
    with pytest.raises(MismatchError, match=r"meta device.*to_empty") as info:
        zerostall.load_pytree(tmp_path / "a", {"w": torch.zeros(3, device="meta")})
    assert info.value.key == "pytree/w"
    meta_model = torch.nn.Linear(4, 2, device="meta")
    with pytest.raises(MismatchError, match="meta device") as info:
        zerostall.load_pytree(tmp_path / "a", {"model": meta_model})
    assert info.value.key == "pytree/model/weight"
    # the way out the message gives: materialize, then load in place
    meta_model.to_empty(device="cpu")
    zerostall.load_pytree(tmp_path / "a", {"model": meta_model})
    assert torch.equal(meta_model.weight, model.weight)


# -- a Checkpointer's step arguments --------------------------------------------------------


def test_checkpointer_step_mistakes_say_what_to_do(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    with Checkpointer(tmp_path / "run", save_interval_steps=5, save_options=THREAD) as ck:
        with pytest.raises(ArgumentTypeError, match="step must be a non-negative int"):
            ck.should_save("10")  # type: ignore[arg-type]  # was a raw TypeError from str % int
        ck.save_pytree(5, {"model": model})
        ck.save_pytree(10, {"model": model})
        with pytest.raises(ArgumentTypeError, match=r"first argument of load_pytree is the step.*template=") as info:
            ck.load_pytree({"model": model})
        assert info.value.argument == "step"
        with pytest.raises(ArgumentTypeError, match=r"load_checkpointables\(items=\.\.\.\)"):
            ck.load_checkpointables({"pytree": None})  # type: ignore[arg-type]
        with pytest.raises(CheckpointNotFoundError, match="committed steps here: 5, 10") as nf:
            ck.load_pytree(7, template={"model": model})
        assert nf.value.path is not None and nf.value.path.endswith("step_00000007")
        with pytest.raises(CheckpointNotFoundError, match="committed steps here: 5, 10"):
            ck.metadata(7)
        assert ck.load_pytree(10, template={"model": model})["model"] is model


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
