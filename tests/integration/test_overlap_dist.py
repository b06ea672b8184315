"""Collective saves use overlapped staging and its guard too (gloo, two real processes)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import _dist_worker as worker  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def test_dtensor_and_replicated_params_overlap_and_fail_together(tmp_path):
    results = worker.launch(["overlap"], 2, str(tmp_path), script=os.path.join(HERE, "_overlap_worker.py"))
    for rank, res in enumerate(results):
        got = res["overlap"]
        assert got["ok"], f"rank {rank}: {got.get('error')}\n{got.get('tb')}"
        assert got["staged_at_return"] is False  # the parameters were copied after the call
        assert got["error"] == "TornSnapshotError"  # rank 1's change fails the save everywhere
        assert got["steps"] == [1]  # the torn save never committed
