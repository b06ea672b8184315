"""Walking back to the newest step that loads: ``fallback=True`` and ``Checkpointer.latest_valid_step()``.

Real damaged files: a flipped byte in a data file, a truncated data file, a deleted manifest, a
deleted data file. The walk is logged on the ``zerostall`` logger; nothing valid is a typed error.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zerostall
from zerostall import Checkpointer, CorruptCheckpointError, SaveOptions, WriterKind
from zerostall.commit import step_name
from zerostall.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    MismatchError,
    NoValidCheckpointError,
    UnsupportedFormatError,
)


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((300_000,), float(step)), "b": torch.arange(10) * step, "step": step}


def template() -> dict[str, Any]:
    return {"w": torch.full((300_000,), -1.0), "b": torch.zeros(10, dtype=torch.int64), "step": 0}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    with Checkpointer(d, save_options=SaveOptions(writer=WriterKind.THREAD)) as c:
        for s in (1, 2, 3):
            c.save_pytree(s, state(s))
    return d


def data_file(run_dir: Path, step: int) -> Path:
    return next((run_dir / step_name(step) / "data").iterdir())


def flip(run_dir: Path, step: int, key: str = "pytree/w") -> None:
    m = json.loads((run_dir / step_name(step) / "manifest.json").read_bytes())
    leaf = next(lf for lf in m["leaves"] if lf["key"] == key)
    f = data_file(run_dir, step)
    with open(f, "r+b") as fh:
        fh.seek(leaf["offset"] + leaf["nbytes"] // 3)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x08]))


def truncate(run_dir: Path, step: int) -> None:
    f = data_file(run_dir, step)
    os.truncate(f, os.path.getsize(f) - 100)


def assert_is(tree: Any, step: int) -> None:
    want = state(step)
    assert torch.equal(tree["w"], want["w"]) and torch.equal(tree["b"], want["b"]) and tree["step"] == step


def test_corrupt_latest_falls_back_and_says_so(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    flip(run_dir, 3)
    with Checkpointer(run_dir) as ckpt:
        with pytest.raises(ChecksumMismatchError):  # without fallback: the error, as before
            ckpt.load_pytree(template=template())
        tmpl = template()
        with caplog.at_level(logging.WARNING, logger="zerostall"):
            out = ckpt.load_pytree(template=tmpl, fallback=True)
        assert_is(out, 2)
        assert out["w"] is tmpl["w"]  # filled in place, with step 2's values only
        assert ckpt.last_loaded_step == 2
        msgs = [r.getMessage() for r in caplog.records if r.name == "zerostall"]
        assert any(step_name(3) in m and "ChecksumMismatchError" in m for m in msgs)
        assert any("loaded" in m and step_name(2) in m and "instead of" in m for m in msgs)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zerostall"):
            assert ckpt.latest_valid_step() == 2
        assert any("step 3" in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)
        ckpt.load_pytree(1, template())
        assert ckpt.last_loaded_step == 1


def test_truncated_and_missing_manifest_walk_back_further(run_dir: Path) -> None:
    truncate(run_dir, 3)
    (run_dir / step_name(2) / "manifest.json").unlink()  # step 2 is no longer committed
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.steps() == [1, 3]
        assert_is(ckpt.load_pytree(template=template(), fallback=True), 1)
        assert ckpt.latest_valid_step() == 1
        # an explicit step without a manifest falls back to the older committed ones
        assert_is(ckpt.load_pytree(2, template(), fallback=True), 1)
        with pytest.raises(CheckpointNotFoundError):
            ckpt.load_pytree(2, template())


def test_nothing_valid_is_a_typed_error_naming_every_step(run_dir: Path) -> None:
    flip(run_dir, 3)
    truncate(run_dir, 2)
    data_file(run_dir, 1).unlink()
    with Checkpointer(run_dir) as ckpt:
        with pytest.raises(NoValidCheckpointError) as info:
            ckpt.load_pytree(template=template(), fallback=True)
        assert isinstance(info.value, CorruptCheckpointError)
        assert all(step_name(s) in str(info.value) for s in (1, 2, 3))
        with pytest.raises(NoValidCheckpointError) as info2:
            ckpt.latest_valid_step()
        assert all(f"step {s}" in str(info2.value) for s in (1, 2, 3))


def test_empty_run(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "empty") as ckpt:
        assert ckpt.latest_valid_step() is None
        with pytest.raises(CheckpointNotFoundError):
            ckpt.load_pytree(fallback=True)


def test_a_template_mismatch_is_not_skipped(run_dir: Path) -> None:
    flip(run_dir, 3)
    bad = {"w": torch.zeros(5), "b": torch.zeros(10, dtype=torch.int64), "step": 0}
    with Checkpointer(run_dir) as ckpt, pytest.raises(MismatchError):
        ckpt.load_pytree(template=bad, fallback=True)


class _Odd:
    def __init__(self, n: int) -> None:
        self.n = n


def _decode_odd(n: object) -> _Odd:
    if n == 2:
        raise ValueError("decoder bug for 2")
    return _Odd(int(n))  # type: ignore[call-overload]


def test_a_handler_that_fails_to_decode_is_not_corruption_and_fallback_does_not_skip_it(tmp_path: Path) -> None:
    # A bug in the user's decode function is not a damaged step: were it a CorruptCheckpointError,
    # fallback=True would skip the newest step and quietly load the one before it.
    zerostall.register_handler(_Odd, name="fallbacktest.Odd", format="json", encode=lambda o: o.n,
                               decode=_decode_odd)
    try:
        run = tmp_path / "run"
        with zerostall.Checkpointer(run) as ckpt:
            ckpt.save_pytree(1, {"o": _Odd(1)})
            ckpt.save_pytree(2, {"o": _Odd(2)})
        with pytest.raises(UnsupportedFormatError,
                           match=r"'fallbacktest\.Odd' could not decode .*decoder bug for 2") as info:
            zerostall.load_pytree(run, fallback=True)
        assert info.value.key == "pytree/o" and not isinstance(info.value, CorruptCheckpointError)
    finally:
        zerostall.unregister_handler(_Odd)


def test_free_function_on_a_run_directory_and_on_a_step(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    flip(run_dir, 3)
    with caplog.at_level(logging.WARNING, logger="zerostall"):
        assert_is(zerostall.load_pytree(run_dir, template(), fallback=True), 2)
    assert any(step_name(3) in r.getMessage() for r in caplog.records)
    assert_is(zerostall.load_pytree(run_dir / step_name(3), fallback=True), 2)
    assert_is(zerostall.load_pytree(run_dir / step_name(2), fallback=True), 2)
    with pytest.raises(ChecksumMismatchError):
        zerostall.load_pytree(run_dir / step_name(3))


def test_free_function_on_a_lone_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    zerostall.save_pytree(path, state(5), options=SaveOptions(writer=WriterKind.THREAD))
    assert_is(zerostall.load_pytree(path, fallback=True), 5)
    f = next((path / "data").iterdir())
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(NoValidCheckpointError, match="truncated"):
        zerostall.load_pytree(path, fallback=True)


def test_nothing_there_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        zerostall.load_pytree(tmp_path / "nothing", fallback=True)
    with pytest.raises(CheckpointNotFoundError):
        zerostall.load_pytree(tmp_path / "run" / step_name(4), fallback=True)
