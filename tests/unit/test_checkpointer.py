"""The ``Checkpointer``'s lifecycle and step arguments: each misuse is refused with an error that
names its directory or step and says what to do instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerostall
from zerostall import SaveOptions, WriterKind
from zerostall.errors import ArgumentTypeError, CheckpointNotFoundError, InvalidArgumentError, WriterError

THREAD = SaveOptions(writer=WriterKind.THREAD)


def test_a_closed_checkpointer_says_so_naming_its_directory(tmp_path: Path) -> None:
    # A save after close() would have no writer to run it, and a prepare() after close() would
    # allocate buffers nobody frees: both are refused, naming the directory; loads still work.
    ckpt = zerostall.Checkpointer(tmp_path / "run")
    with ckpt:
        ckpt.save_pytree(1, {"w": torch.ones(2)})
    with pytest.raises(WriterError, match="Checkpointer is closed.*create a new") as info:
        ckpt.save_pytree_async(2, {"w": torch.ones(2)})
    assert info.value.path is not None and info.value.path.endswith("step_00000002")
    with pytest.raises(WriterError, match="Checkpointer is closed") as info:
        ckpt.prepare(tree={"w": torch.ones(2)})
    assert info.value.path == str(tmp_path / "run")
    assert ckpt.load_pytree()["w"].tolist() == [1.0, 1.0]  # loading still works, as the message says


def test_a_checkpointer_on_a_checkpoint_is_refused_instead_of_nesting_steps_in_it(tmp_path: Path) -> None:
    # A Checkpointer on run/step_00000001 would list no steps, and its saves would write
    # run/step_00000001/step_00000001/ inside the committed checkpoint.
    run = tmp_path / "run"
    with zerostall.Checkpointer(run) as ckpt:
        ckpt.save_pytree(1, {"w": torch.ones(2)})
    for read_only in (False, True):
        with pytest.raises(InvalidArgumentError, match="itself a committed checkpoint.*load_pytree") as info:
            zerostall.Checkpointer(run / "step_00000001", read_only=read_only)
        assert info.value.path == str(run / "step_00000001")
    assert sorted(p.name for p in (run / "step_00000001").iterdir()) == ["data", "manifest.json"]


def test_deleting_a_step_whose_save_is_in_flight_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The step is not committed yet, but "no committed step to delete" would deny the save the
    # user just made: the error says it is still in flight.
    from zerostall.persist.faults import ENV as FAULTS_ENV

    go = tmp_path / "go"
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"begin": f"wait:{go}"}))  # the writer holds the save
    with zerostall.Checkpointer(tmp_path / "run") as ckpt:
        r = ckpt.save_pytree_async(1, {"w": torch.ones(2)})
        with pytest.raises(CheckpointNotFoundError, match=r"still in flight; wait for it") as info:
            ckpt.delete(1)
        assert info.value.path == str(tmp_path / "run" / "step_00000001")
        go.touch()
        r.result()
        ckpt.delete(1)
        assert ckpt.steps() == []


def test_checkpointer_step_mistakes_say_what_to_do(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    with zerostall.Checkpointer(tmp_path / "run", save_interval_steps=5, save_options=THREAD) as ck:
        with pytest.raises(ArgumentTypeError, match="step must be a non-negative int"):
            ck.should_save("10")  # type: ignore[arg-type]  # a typed error, not str % int's TypeError
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
