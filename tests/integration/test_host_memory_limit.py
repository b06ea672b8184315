"""Checkpointer(host_memory_limit=...): saves within the limit, in pieces when one staging slot
does not fit, committed and loaded exactly like saves staged whole (docs/guarantees.md, "Host
memory limit")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zerostall
from zerostall import MemoryTier, SaveOptions, WriterKind
from zerostall.errors import HostMemoryLimitError
from zerostall.format.layout import DATA_DIR, MANIFEST_NAME, data_file, step_name

LIMIT = 4 << 20  # a piece buffer pair of 2 MiB each; every state below is larger than one slot of it


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: larger than the limit, split across pieces
        "strided": torch.randn(700, 900, generator=g).t(),  # copied by rows, never made contiguous
        "half": torch.randn(4097, generator=g).to(torch.bfloat16),
        "flags": torch.rand(5000, generator=g) > 0.5,
        "np": np.arange(600_000, dtype=np.float64).reshape(600, 1000)[:, ::2],
        "np_small": np.array([1, 2, 3], dtype=np.int8),
        "empty": torch.zeros(0),
        "blob": b"x" * 10_000,
        "step": 7,
    }


def _check_equal(out: dict[str, Any], state: dict[str, Any]) -> None:
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
        elif isinstance(v, np.ndarray):
            assert out[k].dtype == v.dtype and np.array_equal(out[k], v), k
        else:
            assert out[k] == v, k


def _files(root: Path, step: int) -> tuple[bytes, dict[str, Any]]:
    d = root / step_name(step)
    manifest = json.loads((d / MANIFEST_NAME).read_bytes())
    return (d / DATA_DIR / data_file(0)).read_bytes(), manifest


@pytest.mark.parametrize("writer", [WriterKind.PROCESS, WriterKind.THREAD])
def test_pieces_round_trip_bit_for_bit(tmp_path: Path, writer: WriterKind) -> None:
    state = _state()
    opts = SaveOptions(writer=writer)
    with zerostall.Checkpointer(tmp_path / "limited", host_memory_limit=LIMIT, save_options=opts) as ck:
        stats = ck.save_pytree_async(1, state).result()
        ck.save_pytree(2, state)  # the piece buffers are reused
        pool = ck._engine.pool
        assert pool.peak_bytes <= LIMIT  # every buffer zerostall staged into, at its most
        assert pool.held_bytes() <= LIMIT
        _check_equal(ck.load_pytree(1), state)
        out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
               if k in ("big", "strided", "flags")}
        ck.load_pytree(2, template=out)  # in place
        _check_equal(out, {k: state[k] for k in out})
    assert stats.nbytes > 3 * LIMIT and stats.limit_wait_s >= 0.0
    with zerostall.Checkpointer(tmp_path / "whole", save_options=opts) as ck:
        ck.save_pytree(1, state)
    limited, whole = _files(tmp_path / "limited", 1), _files(tmp_path / "whole", 1)
    assert limited[0] == whole[0]  # the same data file, byte for byte
    assert limited[1]["leaves"] == whole[1]["leaves"]  # the same offsets and checksums
    assert zerostall.load_pytree(str(tmp_path / "limited" / step_name(1)))["step"] == 7  # the free loader too


def test_writer_process_holds_no_copy_of_the_state(tmp_path: Path) -> None:
    state = {"w": torch.randn(48 << 20)}  # 192 MiB, against a 4 MiB limit
    with zerostall.Checkpointer(tmp_path, host_memory_limit=LIMIT) as ck:
        stats = ck.save_pytree_async(1, state).result()
        assert ck._engine.pool.peak_bytes <= LIMIT
        assert torch.equal(ck.load_pytree(1)["w"], state["w"])
    # the writer's peak resident memory (its interpreter included) is far below one copy of the state
    assert stats.writer_peak_rss is not None and stats.writer_peak_rss < state["w"].nbytes // 2


def test_limit_of_whole_slots_allows_fewer_in_flight(tmp_path: Path) -> None:
    state = {"w": torch.randn(1 << 20)}  # 4 MiB: one slot fits 6 MiB, two do not
    with zerostall.Checkpointer(tmp_path, host_memory_limit=6 << 20) as ck:
        for step in range(1, 4):
            ck.save_pytree_async(step, state)
        ck.wait()
        assert ck._engine.pool.slots == 1 and ck._engine.pool.peak_bytes <= 6 << 20
        assert torch.equal(ck.load_pytree(3)["w"], state["w"])


def test_a_grown_layout_is_checked_again(tmp_path: Path) -> None:
    with zerostall.Checkpointer(tmp_path, host_memory_limit=10 << 20) as ck:
        ck.save_pytree(1, {"w": torch.ones(1 << 20)})  # 4 MiB: two slots
        big = {"w": torch.arange(6 << 20, dtype=torch.float32)}  # 24 MiB: pieces
        ck.save_pytree(2, big)
        assert ck._engine.pool.peak_bytes <= 10 << 20
        assert torch.equal(ck.load_pytree(2)["w"], big["w"])


def test_memory_tier_below_its_slots_is_refused_at_the_first_save(tmp_path: Path) -> None:
    state = {"w": torch.randn(1 << 20)}  # a 4 MiB slot: the tier needs 2 of them (1 in flight, the held step)
    with zerostall.Checkpointer(tmp_path, host_memory_limit=6 << 20, memory_tier=MemoryTier(linger_s=0)) as ck:
        with pytest.raises(HostMemoryLimitError) as info:
            ck.save_pytree_async(5, state)
        msg = str(info.value)
        assert "MemoryTier() needs 8.0 MiB per rank (1 staging slot 4.0 MiB, held step 4.0 MiB; " in msg
        assert "host_memory_limit is 6.0 MiB (6291456 bytes)" in msg and "saves persist to storage in pieces" in msg
        assert "step 5" in msg and "step_00000005" in msg
        assert ck._engine.pool.allocations == 0  # refused before any byte was staged
        assert ck.latest_step() is None


def test_the_advisor_measures_the_piece_waits(tmp_path: Path) -> None:
    """A save in pieces blocks the caller until its last piece is handed over: the cost on the
    training thread the advisor reads (Cadence's blocked time, from SaveStats.stall_s) holds the
    piece waits."""
    state = {"w": torch.randn(8 << 20)}  # 32 MiB in pieces of 2 MiB
    with zerostall.Checkpointer(tmp_path, host_memory_limit=LIMIT, save_interval="auto", mtbf_s=3600.0) as ck:
        r = ck.save_pytree_async(1, state)
        stats = r.result()
        assert stats.limit_wait_s > 0.0  # 16 pieces through 2 buffers: the writer had some in hand
        assert stats.stall_s >= stats.limit_wait_s
        ck.wait()
        recorded = [blocked for s, blocked, *_ in ck._cadence._durable if s == 1]
        assert recorded and recorded[0] >= stats.limit_wait_s
