"""Deterministic states shared by the integration tests and the subprocess trainers they spawn."""

from __future__ import annotations

import torch


def make_state(mib: int = 8, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = mib * (1 << 20) // 4 // 4
    return {
        "model": {f"layer{i}.weight": torch.randn(n // 1024, 1024, generator=g) for i in range(4)},
        "small": torch.arange(10, dtype=torch.bfloat16),
        "step": seed,
    }


def assert_equal_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert torch.equal(a["small"], b["small"])
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
