"""States of many small leaves: the batched copy, the cached job text, the quick manifest
check, the planner's plain-tensor path and the collector's pause change no byte and no error."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from typing import Any

import numpy as np
import pytest
import torch

import zerostall
from zerostall.dtypes import ITEMSIZE
from zerostall.errors import CorruptCheckpointError, MismatchError, UnsupportedFormatError
from zerostall.format.manifest import FileEntry, _leaf, _plain_leaf, parse_manifest
from zerostall.gcpause import paused_gc
from zerostall.messages import FileRow, LeafRow, SaveJob, WriteOptions, decode, encode
from zerostall.stage import stager

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool,
          torch.complex64, torch.float64]
DTYPE_NAMES = ["F32", "BF16", "F16", "I64", "I8", "U8", "BOOL", "C64", "F64"]


def _raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes, in element order (a bit-for-bit comparison, NaNs and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _mixed_state(n: int, seed: int) -> dict[str, Any]:
    """``n`` small tensors of every dtype and odd shapes and strides (more than one batch of the
    stager's grouped copy), a few larger ones, numpy arrays and Python values."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (n * 64,), generator=g, dtype=torch.uint8)
    state: dict[str, Any] = {}
    for i in range(n):
        dt = DTYPES[i % len(DTYPES)]
        shape = [(3,), (), (2, 2), (1, 5), (7,)][i % 5]
        size = math.prod(shape) * ITEMSIZE[DTYPE_NAMES[i % len(DTYPES)]]
        bits = pool[64 * i:64 * i + size].clone()
        if dt is torch.bool:
            bits &= 1  # a bool byte other than 0 or 1 is no valid bool (a copy makes it 1)
        t = bits.view(dt).reshape(shape)  # every bit pattern: NaN payloads, -0.0, denormals
        if i % 7 == 3 and t.dim() == 2:
            t = t.t()  # a strided source: copied without a contiguous temporary
        state[f"m{i // 50}.p{i}"] = t
    state["big"] = torch.randn(300_000, generator=g)  # over the grouped copy's size limit
    state["big_strided"] = torch.randn(600, 600, generator=g)[:, ::3]
    state["param"] = torch.nn.Parameter(torch.randn(4, generator=g))
    state["np"] = [np.arange(i, dtype=np.int32) for i in range(5)]
    state["step"] = seed
    return state


def _template(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.nn.Parameter(torch.zeros_like(v.detach())) if isinstance(v, torch.nn.Parameter) \
                else torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, list):
            out[k] = [np.zeros_like(a) for a in v]
        else:
            out[k] = 0
    return out


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert _raw(got[k]) == _raw(v), k
        elif isinstance(v, list):
            assert all(a.tobytes() == b.tobytes() for a, b in zip(got[k], v, strict=True)), k
        else:
            assert got[k] == v, k


def test_many_small_leaves_of_mixed_dtypes_round_trip_bit_for_bit(tmp_path: Any) -> None:
    n = stager._BATCH_LEN + 700  # two batches of the grouped copy, the second one partial
    with zerostall.Checkpointer(tmp_path) as ck:
        for step in (1, 2):  # the second save reuses the plan, the buffers and the cached job text
            state = _mixed_state(n, seed=step)
            ck.save_pytree(step, state)
        for step in (1, 2):
            want = _mixed_state(n, seed=step)
            tmpl = _template(want)
            ptrs = {k: v.data_ptr() for k, v in tmpl.items() if isinstance(v, torch.Tensor)}
            out = ck.load_pytree(step, tmpl)
            _assert_same(out, want)
            _assert_same({k: v for k, v in tmpl.items() if k != "step"}, {k: v for k, v in want.items() if k != "step"})
            # in place: the template's own memory, the Parameter still a Parameter
            assert all(out[k].data_ptr() == p for k, p in ptrs.items())
            assert isinstance(out["param"], torch.nn.Parameter)
            _assert_same(ck.load_pytree(step), want)  # new tensors


def test_a_layout_change_between_saves_is_planned_again(tmp_path: Any) -> None:
    base = {f"p{i}": torch.full((3,), float(i)) for i in range(500)}
    reshaped = dict(base, p7=torch.arange(6, dtype=torch.float32).reshape(2, 3))
    retyped = dict(base, p8=torch.ones(3, dtype=torch.bfloat16))
    grown = dict(base, extra=torch.tensor([1, 2], dtype=torch.int16))
    shrunk = {k: v for k, v in base.items() if k != "p9"}
    states = [base, reshaped, retyped, base, grown, shrunk, base]
    with zerostall.Checkpointer(tmp_path) as ck:
        for step, st in enumerate(states):
            ck.save_pytree(step, st)
        for step, st in enumerate(states):
            m = json.loads((tmp_path / f"step_{step:08d}" / "manifest.json").read_bytes())
            assert len(m["leaves"]) == len(st)
            _assert_same(ck.load_pytree(step), st)
            _assert_same(ck.load_pytree(step, {k: torch.empty_like(v) for k, v in st.items()}), st)


def test_a_template_that_disagrees_is_still_refused_by_key_and_the_collector_is_back_on(tmp_path: Any) -> None:
    state = {f"p{i}": torch.zeros(3) for i in range(100)}
    with zerostall.Checkpointer(tmp_path) as ck:
        ck.save_pytree(0, state)
        for bad, what in ((torch.zeros(4), "shape"), (torch.zeros(3, dtype=torch.float64), "dtype"),
                          (torch.zeros(1).expand(3), "expand")):
            with pytest.raises(MismatchError, match=what) as info:
                ck.load_pytree(0, dict(state, p42=bad))
            assert info.value.key == "pytree/p42"
        with pytest.raises(MismatchError, match="meta device"):
            ck.load_pytree(0, dict(state, p5=torch.empty(3, device="meta")))
        assert gc.isenabled()  # the collector's pause ended with the failed loads
        with pytest.raises(zerostall.errors.UnsupportedLeafError):
            ck.save_pytree(1, {"a": object()})
        assert gc.isenabled()


# -- the job's leaf rows: encoded once per rows tuple ------------------------------------------

def _job(rows: tuple[LeafRow, ...], **kw: Any) -> SaveJob:
    return SaveJob(id=1, root="/r", name="s", path="/r/s", files=(FileRow(name="f", length=4096, buffer=0),),
                   leaves=rows, items={"pytree": {"type": "none"}}, metadata=kw.pop("metadata", {}), step=1,
                   retention=None, env={}, write=WriteOptions(direct_io=False, io_threads=1, chunk_bytes=1 << 20), **kw)


def test_a_save_job_round_trips_with_its_cached_rows_and_a_metadata_key_named_leaves() -> None:
    rows = tuple(LeafRow(key=f"k{i}", kind="torch", dtype="F32", shape=(3,), file=0, offset=64 * i, nbytes=12)
                 for i in range(50))
    job = _job(rows, metadata={"leaves": [], "x": '"leaves":[]'})
    first = encode(job)
    assert decode(first) == job
    later = _job(rows, metadata={"leaves": [1]})
    assert decode(encode(later)) == later  # the cached rows' text, with the new job's other fields
    other = rows[:-1] + (dataclasses.replace(rows[-1], shape=(2,), nbytes=8),)
    assert decode(encode(_job(other))).leaves == other  # another rows tuple: its own text


# -- the quick manifest check accepts exactly what the full one accepts -----------------------

GOOD = {"key": "a/b", "kind": "torch", "dtype": "F32", "shape": [2, 3], "file": 0, "offset": 64, "nbytes": 24,
        "crc32c": 7}
BAD = [
    {"key": 1}, {"kind": "tensor"}, {"kind": ["torch"]}, {"dtype": "F33"}, {"shape": [2, 3.0]}, {"shape": [2, True]},
    {"shape": [-1, 3]}, {"shape": [1] * 65}, {"shape": "23"}, {"nbytes": 25}, {"nbytes": True}, {"file": 1},
    {"file": -1}, {"offset": -64}, {"offset": 4096}, {"crc32c": 2**32}, {"crc32c": -1}, {"crc32c": "7"},
    {"shape": [2**62, 2, 0], "nbytes": 0},
]


def test_quick_leaf_check_agrees_with_the_full_one() -> None:
    files = [FileEntry("rank-00000.safetensors", 4096)]
    assert _plain_leaf(GOOD, [4096]) == _leaf(GOOD, 0, files, "/p")
    assert _plain_leaf(dict(GOOD, crc32c=None), [4096]) == _leaf(dict(GOOD, crc32c=None), 0, files, "/p")
    assert _plain_leaf([GOOD], [4096]) is None
    for change in BAD:
        lf = dict(GOOD, **change)
        assert _plain_leaf(lf, [4096]) is None, change
        with pytest.raises((CorruptCheckpointError, UnsupportedFormatError)):
            _leaf(lf, 0, files, "/p")


def test_a_malformed_leaf_among_many_is_named() -> None:
    leaves = [dict(GOOD, key=f"k{i}", offset=64 * i) for i in range(40)]
    leaves[33]["nbytes"] = 28
    doc = {"format": "zerostall", "format_version": 1, "files": [{"path": "rank-00000.safetensors", "size": 4096}],
           "leaves": leaves, "items": {}}
    with pytest.raises(CorruptCheckpointError, match="nbytes 28") as info:
        parse_manifest(json.dumps(doc).encode(), path="/p")
    assert info.value.key == "k33"


# -- the collector's pause ---------------------------------------------------------------------

def test_paused_gc_nests_and_restores_the_callers_setting() -> None:
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # disabled by the program: left so
    finally:
        gc.enable()
