"""``metadata=``: checked on the caller's thread before staging, stored as JSON, read back."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import CheckpointNotFoundError, MetadataError, MetadataTypeError

THREAD = SaveOptions(writer=WriterKind.THREAD)


def test_numpy_scalars_are_converted_and_read_back(tmp_path: Path) -> None:
    meta = {"loss": np.float32(0.5), "n": np.int64(7), "ok": np.bool_(True), "nested": {"t": (1, np.float64(2.5))},
            "arr0": np.array(3.0)}
    zerostall.save_pytree(tmp_path / "a", {"w": torch.ones(2)}, metadata=meta, options=THREAD)
    got = zerostall.load_metadata(tmp_path / "a")
    assert got == {"loss": 0.5, "n": 7, "ok": True, "nested": {"t": [1, 2.5]}, "arr0": 3.0}
    assert type(got["n"]) is int and type(got["ok"]) is bool


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -math.inf, np.float32("nan")])
def test_non_finite_is_refused_naming_the_key(tmp_path: Path, bad: object) -> None:
    with pytest.raises(MetadataError) as info:
        zerostall.save_pytree(tmp_path / "a", {"w": torch.ones(2)}, metadata={"m": {"loss": [1.0, bad]}},
                              options=THREAD)
    assert info.value.key == "m/loss/1" and isinstance(info.value, ValueError)
    assert not (tmp_path / "a").exists()  # refused before anything was staged or written


@pytest.mark.parametrize(("meta", "key"), [
    ({"t": torch.ones(2)}, "t"), ({"o": object()}, "o"), ({1: "int key"}, "1"), ({"a": {"b": {3, 4}}}, "a/b"),
    ({"arr": np.ones(3)}, "arr"),
])
def test_non_json_types_are_type_errors(tmp_path: Path, meta: dict[object, object], key: str) -> None:
    with pytest.raises(MetadataTypeError) as info:
        zerostall.save_pytree(tmp_path / "a", {"w": torch.ones(2)}, metadata=meta, options=THREAD)  # type: ignore[arg-type]
    assert info.value.key == key and isinstance(info.value, TypeError)


def test_not_a_dict_and_cycles(tmp_path: Path) -> None:
    with pytest.raises(MetadataTypeError):
        zerostall.save_pytree(tmp_path / "a", {"w": 1}, metadata=[1, 2], options=THREAD)  # type: ignore[arg-type]
    cyc: dict[str, object] = {}
    cyc["self"] = cyc
    with pytest.raises(MetadataError, match="nested"):
        zerostall.save_pytree(tmp_path / "a", {"w": 1}, metadata=cyc, options=THREAD)


def test_checkpointer_reserves_step_and_reads_metadata(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, save_options=THREAD) as ck:
        with pytest.raises(MetadataError) as info:
            ck.save_pytree(5, {"w": torch.ones(2)}, metadata={"step": 999})
        assert info.value.key == "step"
        assert ck.steps() == []
        ck.save_pytree(5, {"w": torch.ones(2)}, metadata={"loss": np.float32(0.25)})
        ck.save_pytree(6, {"w": torch.ones(2)})
        assert ck.metadata(5) == {"loss": 0.25, "step": 5}
        assert ck.metadata() == {"step": 6}
        with pytest.raises(zerostall.errors.CheckpointNotFoundError):
            ck.metadata(7)
    assert zerostall.load_metadata(tmp_path / "step_00000005") == {"loss": 0.25, "step": 5}


def test_load_metadata_of_a_run_directory_names_the_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        ckpt.save_pytree(3, {"w": torch.ones(1)}, metadata={"loss": 0.5})
    with pytest.raises(CheckpointNotFoundError, match=r"1 committed step\(s\) \(3\).*\.metadata\(\)"):
        zerostall.load_metadata(run)
    assert zerostall.load_metadata(run / "step_00000003") == {"loss": 0.5, "step": 3}


def test_metadata_of_a_memory_only_step(tmp_path: Path) -> None:
    from zerostall.options import MemoryTier

    with Checkpointer(tmp_path, memory_tier=MemoryTier(persist_interval_steps=2, linger_s=0)) as ck:
        for step in (1, 2, 3):
            ck.save_pytree(step, {"w": torch.ones(2)}, metadata={"loss": 1.0 / step})
        assert not (tmp_path / "step_00000003").exists()  # only in this host's memory
        assert ck.metadata(3) == {"loss": 1 / 3, "step": 3}
        assert ck.metadata() == {"loss": 1 / 3, "step": 3}
        assert ck.metadata(2) == {"loss": 0.5, "step": 2}
        with pytest.raises(zerostall.errors.InvalidArgumentError, match="memory tier"):
            ck.delete(3)  # it would stay listed (and loadable) from memory
        ck.delete(2)
        assert ck.steps() == [3]  # step 1 was never persisted (every 2nd is), step 2 is gone
