"""Golden checkpoints: files written by format version 1 must load, bit for bit, forever.

The files under ``v1/`` were made once by ``make_golden.py``; they are never regenerated for
the same version. A change to the reader that breaks them breaks every checkpoint users have.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zerostall
from zerostall.restore import verify_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden

V1 = Path(__file__).resolve().parent / "v1"


@pytest.fixture(scope="module", autouse=True)
def handlers() -> Any:
    make_golden.register_handlers()
    yield
    import datetime
    import decimal

    zerostall.unregister_handler(datetime.date)
    zerostall.unregister_handler(decimal.Decimal)


def same(got: Any, want: Any, key: str = "", *, namedtuple_as_tuple: bool = True) -> None:
    """Bit-exact equality, types included (a namedtuple loads as a tuple without a template)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), key
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, key
        assert got.tobytes() == want.tobytes(), key
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got.tobytes() == want.tobytes(), key
    elif isinstance(want, float):
        assert type(got) is float and struct.pack("<d", got) == struct.pack("<d", want), key
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), key
        for k in want:
            same(got[k], want[k], f"{key}/{k}", namedtuple_as_tuple=namedtuple_as_tuple)
    elif isinstance(want, (list, tuple)):
        if isinstance(want, tuple) and hasattr(want, "_fields") and namedtuple_as_tuple:
            assert type(got) is tuple, key
        else:
            assert type(got) is type(want), key
        assert len(got) == len(want), key
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{key}/{i}", namedtuple_as_tuple=namedtuple_as_tuple)
    else:
        assert type(got) is type(want) and got == want, f"{key}: {got!r} != {want!r}"


@pytest.mark.parametrize("name", sorted(make_golden.expected()))
def test_golden_loads_bit_exact(name: str) -> None:
    want = make_golden.expected()[name]
    got = zerostall.load_checkpointables(V1 / name)
    same(got, want)


@pytest.mark.parametrize("name", sorted(make_golden.expected()))
def test_golden_loads_into_templates(name: str) -> None:
    want = make_golden.expected()[name]
    template = make_golden.expected()[name]
    for t in _tensors(template):
        if t.numel():
            t.fill_(0) if t.dtype != torch.bool else t.logical_not_()
    got = zerostall.load_checkpointables(V1 / name, template)
    same(got, want, namedtuple_as_tuple=False)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def test_golden_manifest_is_format_version_1() -> None:
    for m in V1.rglob("manifest.json"):
        doc = json.loads(m.read_bytes())
        assert doc["format"] == "zerostall" and doc["format_version"] == 1, m


def test_golden_metadata() -> None:
    from zerostall.restore import read_manifest
    from zerostall.storage import open_storage

    m = read_manifest(open_storage(str(V1)), "checkpointables", path="golden")
    assert m.metadata == make_golden.METADATA["checkpointables"]


def test_golden_run_directory() -> None:
    ckpt = zerostall.Checkpointer(V1 / "run", save_options=zerostall.SaveOptions(writer=zerostall.WriterKind.THREAD))
    try:
        assert ckpt.steps() == [100, 200]
        assert ckpt.latest_step() == 200
        same(ckpt.load_pytree(), make_golden.run_state(200))
        same(ckpt.load_pytree(100), make_golden.run_state(100))
    finally:
        ckpt.close()


def test_golden_verifies() -> None:
    for m in V1.rglob("manifest.json"):
        report = verify_checkpoint(str(m.parent))
        assert report.ok, report.problems


def test_golden_data_files_are_safetensors() -> None:
    """Other tools read the data files: the safetensors library loads every leaf."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    name = "pytree_all_types"
    doc = json.loads((V1 / name / "manifest.json").read_bytes())
    tensors = safetensors_torch.load_file(str(V1 / name / "data" / "rank-00000.safetensors"))
    want = make_golden.expected()[name]["pytree"]["tensors"]
    for k, w in want.items():
        got = tensors[f"pytree/tensors/{k}"]
        assert got.dtype == w.dtype and torch.equal(got.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), k
    assert {lf["key"] for lf in doc["leaves"]} <= set(tensors)


def test_expected_values_are_deterministic() -> None:
    a, b = make_golden.expected(), make_golden.expected()
    same(a, b, namedtuple_as_tuple=False)
    assert math.isinf(a["pytree_all_types"]["pytree"]["plain"]["inf"])
