"""Loads into accelerator templates (``restore.device``), their logic run on the CPU.

CI has no GPU, so these tests send CPU templates through the same pass (``plan.DEVICE_TYPES``
gains "cpu"): the pieces, the rings, the checksums, the scratch the bytes are held in until
every leaf has verified, the commit, and the fallbacks. On the CPU there are no streams and
no page-locked memory; ``gputests/test_cuda.py`` runs the pass on a real device where one is lent.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zerostall
from zerostall import CorruptCheckpointError, LoadOptions
from zerostall.errors import ChecksumMismatchError
from zerostall.restore import device, plan
from zerostall.restore import read as restore_read

ATOMIC = LoadOptions(atomic=True)


@pytest.fixture(autouse=True)
def cpu_as_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(plan, "DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(device, "PIECE", 64 << 10)  # small pieces: leaves cut, neighbours packed
    yield


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(100_000, generator=g),  # 400 KB: several pieces
        "half": torch.randn(300, 40, generator=g).to(torch.bfloat16),
        "small": [torch.randn(10 + i, generator=g) for i in range(40)],  # neighbours, one piece
        "ints": torch.arange(1000, dtype=torch.int64),
        "flag": torch.tensor(True),
        "cplx": torch.randn(64, dtype=torch.complex64, generator=g),
    }


def sentinel() -> dict[str, Any]:
    """A template of the state's layout holding values the checkpoint does not have."""
    def other(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if t.dtype == torch.bool else torch.full_like(t, 7)
    return {k: ([other(t) for t in v] if isinstance(v, list) else other(v)) for k, v in state().items()}


def tensors(tree: dict[str, Any]) -> list[torch.Tensor]:
    return [t for v in tree.values() for t in (v if isinstance(v, list) else [v])]


def untouched(tmpl: dict[str, Any]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(tensors(tmpl), tensors(sentinel()), strict=True))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    zerostall.save_pytree(path, state())
    return path


def leaf_of(path: Path, key: str) -> dict[str, Any]:
    m = json.loads((path / "manifest.json").read_bytes())
    return next(lf for lf in m["leaves"] if lf["key"] == key)


def flip(path: Path, key: str, where: float) -> None:
    leaf = leaf_of(path, key)
    f = next((path / "data").iterdir())
    with open(f, "r+b") as fh:
        fh.seek(leaf["offset"] + int(leaf["nbytes"] * where))
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x10]))


def test_templates_are_planned_as_device_requests(ckpt: Path) -> None:
    from zerostall.restore.files import read_manifest
    from zerostall.restore.load import new_planner, plan_items
    from zerostall.storage import open_storage

    st = open_storage(str(ckpt.parent))
    m = read_manifest(st, ckpt.name, path=str(ckpt))
    planner = new_planner(st, ckpt.name, m, str(ckpt))
    tmpl = sentinel()
    plan_items(planner, m.items, {"pytree": tmpl})
    assert planner.reads and all(q.device is not None and len(q.dest) == 0 for q in planner.reads)
    assert {id(q.device) for q in planner.reads} == {id(t) for t in tensors(tmpl)}


@pytest.mark.parametrize("atomic", [True, "auto", False])
def test_round_trip_bit_for_bit_in_place(ckpt: Path, atomic: Any) -> None:
    tmpl = sentinel()
    out = zerostall.load_pytree(ckpt, tmpl, options=LoadOptions(atomic=atomic))
    for got, want, t in zip(tensors(out), tensors(state()), tensors(tmpl), strict=True):
        assert got is t  # in place
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


def test_rings_are_allocated_once_and_reused(ckpt: Path) -> None:
    device._RINGS.clear()
    zerostall.load_pytree(ckpt, sentinel())
    first = [id(r) for rings in device._RINGS.values() for r in rings]
    assert first
    zerostall.load_pytree(ckpt, sentinel())
    assert sorted(id(r) for rings in device._RINGS.values() for r in rings) == sorted(first)


@pytest.mark.parametrize("key", ["pytree/big", "pytree/half", "pytree/small/0", "pytree/small/39", "pytree/cplx"])
@pytest.mark.parametrize("where", [0.0, 0.99])
def test_a_bad_leaf_leaves_every_template_as_it_was(ckpt: Path, key: str, where: float) -> None:
    flip(ckpt, key, where)
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError) as ei:
        zerostall.load_pytree(ckpt, tmpl, options=ATOMIC)
    assert ei.value.key == key
    assert untouched(tmpl)


def test_held_in_host_memory_where_the_device_has_no_room(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(device, "_device_scratch", lambda *a: None)
    caplog.set_level(logging.INFO, logger="zerostall")
    out = zerostall.load_pytree(ckpt, sentinel(), options=ATOMIC)
    assert all(torch.equal(a, b) for a, b in zip(tensors(out), tensors(state()), strict=True))
    assert "held in host memory instead" in caplog.text
    flip(ckpt, "pytree/small/20", 0.5)
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError):
        zerostall.load_pytree(ckpt, tmpl, options=ATOMIC)
    assert untouched(tmpl)


def test_straight_in_without_room_anywhere(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(device, "_device_scratch", lambda *a: None)
    monkeypatch.setattr(restore_read, "available_memory", lambda: 1000)  # auto: too big to hold back
    caplog.set_level(logging.INFO, logger="zerostall")
    out = zerostall.load_pytree(ckpt, sentinel(), options=LoadOptions(atomic="auto"))
    assert all(torch.equal(a, b) for a, b in zip(tensors(out), tensors(state()), strict=True))
    assert "not all-or-nothing" in caplog.text
    # atomic=True still holds back (in host memory) however little is available
    flip(ckpt, "pytree/big", 0.5)
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError):
        zerostall.load_pytree(ckpt, tmpl, options=LoadOptions(atomic=True))
    assert untouched(tmpl)


def test_an_interrupt_mid_pass_changes_no_template_and_keeps_its_rings_out(ckpt: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from zerostall.storage.local import LocalStorage

    device._RINGS.clear()
    real = LocalStorage.read_into
    calls = [0]

    def interrupted(self: Any, key: str, offset: int, buf: memoryview) -> None:
        calls[0] += 1
        if calls[0] == 3:  # a few pieces already sent to the scratch
            raise KeyboardInterrupt
        real(self, key, offset, buf)
    monkeypatch.setattr(LocalStorage, "read_into", interrupted)
    tmpl = sentinel()
    with pytest.raises(KeyboardInterrupt):
        zerostall.load_pytree(ckpt, tmpl, options=ATOMIC)
    assert calls[0] > 3 and untouched(tmpl)
    # a piece may still have held a ring when the pass was interrupted: none is handed out again
    assert not any(device._RINGS.values())


@pytest.mark.parametrize("options", [None, LoadOptions(atomic=False)], ids=["default", "False"])
def test_not_atomic_still_raises_for_a_bad_leaf(ckpt: Path, options: LoadOptions | None) -> None:
    flip(ckpt, "pytree/ints", 0.5)
    with pytest.raises(ChecksumMismatchError) as ei:
        zerostall.load_pytree(ckpt, sentinel(), options=options)
    assert ei.value.key == "pytree/ints" and "partly overwritten" in str(ei.value)


def test_unverified_load_reads_a_bad_leaf_as_it_is(ckpt: Path) -> None:
    flip(ckpt, "pytree/ints", 0.0)
    out = zerostall.load_pytree(ckpt, sentinel(), options=LoadOptions(verify=False))
    assert not torch.equal(out["ints"], state()["ints"])
    assert torch.equal(out["big"], state()["big"])


def test_a_short_data_file_names_the_leaf_and_changes_nothing(ckpt: Path) -> None:
    f = next((ckpt / "data").iterdir())
    big = leaf_of(ckpt, "pytree/big")
    os.truncate(f, big["offset"] + big["nbytes"] // 2)
    tmpl = sentinel()
    with pytest.raises(CorruptCheckpointError) as ei:
        zerostall.load_pytree(ckpt, tmpl)
    assert ei.value.key is not None
    assert untouched(tmpl)


def test_a_non_contiguous_template_is_copied_into(ckpt: Path) -> None:
    tmpl = sentinel()
    tmpl["half"] = torch.full((40, 300), 7, dtype=torch.bfloat16).t()  # a transposed view
    out = zerostall.load_pytree(ckpt, tmpl)
    assert out["half"] is tmpl["half"] and not out["half"].is_contiguous()
    assert torch.equal(out["half"], state()["half"])


def test_switched_off_plans_the_way_before(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zerostall.restore.files import read_manifest
    from zerostall.restore.load import new_planner, plan_items
    from zerostall.storage import open_storage

    monkeypatch.setattr(plan, "DEVICE_LOADS", False)
    st = open_storage(str(ckpt.parent))
    m = read_manifest(st, ckpt.name, path=str(ckpt))
    planner = new_planner(st, ckpt.name, m, str(ckpt))
    plan_items(planner, m.items, {"pytree": sentinel()})
    assert all(q.device is None and len(q.dest) == q.leaf.nbytes for q in planner.reads)
    out = zerostall.load_pytree(ckpt, sentinel())
    assert all(torch.equal(a, b) for a, b in zip(tensors(out), tensors(state()), strict=True))
