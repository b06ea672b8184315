"""torch.distributed (gloo, real processes): collective save and load, written-once replicated
state, DTensor resharding, and all ranks failing together when one rank's writer dies.

Every scenario runs in one launch per world size (see ``_dist_worker.py``): starting torch in
a process costs seconds on a small machine, the checkpoints themselves are tiny.
"""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest
import torch

import zerostall
from zerostall.tree import flatten

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import _dist_worker as worker  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("four"))
    return d, worker.launch(["roundtrip", "dtensor_save", "grow", "views"], 4, d)


@pytest.fixture(scope="module")
def two(tmp_path_factory, four):
    d = str(tmp_path_factory.mktemp("two"))
    dt = os.path.join(four[0], "dtensor_save", "dt")
    return d, worker.launch(["roundtrip", "dtensor_load", "kill", "sigkill0", "slow", "objstore", "faults", "views", "atomic", "atomic_device"], 2, d,
                         env={"ZS_DTENSOR_CKPT": dt})


def _ok(results: list[dict], scenario: str) -> list[dict]:
    for r, res in enumerate(results):
        got = res.get(scenario)
        assert got is not None, f"rank {r} did not run {scenario}"
        assert got["ok"], f"rank {r}: {got.get('error')}\n{got.get('tb')}"
    return [res[scenario] for res in results]


def _header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return {k: v for k, v in head.items() if not k.startswith("__zerostall_pad_")}


def _replicated_nbytes() -> tuple[int, set[str]]:
    model, opt = worker.ddp_model()
    worker.train_step(model, opt, 1)
    worker.train_step(model, opt, 2)
    flat = flatten({"pytree": {"model": model, "optim": opt}})
    return sum(leaf.nbytes for leaf in flat.leaves), {leaf.key for leaf in flat.leaves}


def _check_written_once(d: str, world: int) -> None:
    ckpt = os.path.join(d, "roundtrip", "ck", "step_00000002")
    heads = [_header(os.path.join(ckpt, "data", f"rank-{r:05d}.safetensors")) for r in range(world)]
    rep_bytes, rep_keys = _replicated_nbytes()
    per_rank_bytes = 17 * 8  # the rank's RNG tensor (int64[17])
    # Bytes written once, by counting: the data sections hold one copy of the replicated state
    # plus each rank's own part, nothing more.
    data = sum(v["data_offsets"][1] - v["data_offsets"][0] for h in heads for v in h.values())
    assert data == rep_bytes + world * per_rank_bytes
    owners: dict[str, list[int]] = {}
    for r, h in enumerate(heads):
        for k in h:
            owners.setdefault(k, []).append(r)
    for k in rep_keys:
        assert len(owners[k]) == 1, (k, owners[k])  # each replicated key in exactly one rank's file
    assert owners["pytree/rank_state/rng"] == list(range(world))
    # The write work is spread: more than one rank owns replicated leaves.
    assert len({owners[k][0] for k in rep_keys}) > 1
    # Retention ran once, on rank 0's writer: keep_last=2 keeps both steps.
    assert sorted(os.listdir(os.path.join(d, "roundtrip", "ck"))) == ["step_00000001", "step_00000002"]
    m = json.load(open(os.path.join(ckpt, "manifest.json")))
    assert len(m["ranks"]) == world and len(m["files"]) == world


def test_roundtrip_4_ranks_replicated_written_once(four):
    d, results = four
    res = _ok(results, "roundtrip")
    assert all(r["latest"] == 2 for r in res)
    _check_written_once(d, 4)


def test_roundtrip_2_ranks_replicated_written_once(two):
    d, results = two
    _ok(results, "roundtrip")
    _check_written_once(d, 2)


def test_dtensor_saved_on_4_loads_on_2_and_on_1(four, two):
    _ok(four[1], "dtensor_save")
    res = _ok(two[1], "dtensor_load")  # 2 ranks: values checked against the global tensors there
    assert all(r["bytes_read"] == 5 * 6 * 4 for r in res)  # each rank read only its 5 rows
    # 1 rank, no process group, no template: the full global tensors.
    got = zerostall.load_pytree(os.path.join(four[0], "dtensor_save", "dt"))
    for k, v in worker._dtensor_globals().items():
        assert torch.equal(got[k], v), k
    assert got["rank"] == 0  # per-rank values: rank 0's tree
    # The Replicate DTensor was written once, not four times.
    heads = [_header(os.path.join(four[0], "dtensor_save", "dt", "data", f"rank-{r:05d}.safetensors"))
             for r in range(4)]
    assert sum("pytree/rep" in h for h in heads) == 1
    assert all("pytree/rows" in h and "pytree/cols" in h for h in heads)


def test_killed_writer_fails_every_rank_naming_it(two):
    d, results = two
    res = _ok(results, "kill")
    errors = [r["error"] for r in res]
    assert all(e is not None for e in errors), errors
    assert len({e["msg"] for e in errors}) == 1  # the same error on every rank
    assert errors[0]["type"] == "WriterError" and errors[0]["rank"] == 1 and "rank 1" in errors[0]["msg"]
    assert all(r["elapsed"] < 20 for r in res)  # within the (20 s) timeout: nobody waited it out
    assert all(r["steps"] == [1] for r in res)  # nothing committed; the previous step loaded intact
    ck = os.path.join(d, "kill", "ck")
    assert not [n for n in os.listdir(ck) if "zs-tmp" in n or n == "step_00000002"]


def test_sigkilled_committer_fails_every_rank_naming_it(two):
    d, results = two
    res = _ok(results, "sigkill0")
    errors = [r["error"] for r in res]
    assert all(e is not None for e in errors), errors
    assert len({e["msg"] for e in errors}) == 1
    assert errors[0]["rank"] == 0 and "rank 0" in errors[0]["msg"] and "signal 9" in errors[0]["msg"]
    assert all(r["elapsed"] < 20 for r in res)
    assert all(r["steps"] == [1] for r in res)
    ck = os.path.join(d, "sigkill0", "ck")
    assert not [n for n in os.listdir(ck) if "zs-tmp" in n or n == "step_00000002"]


def test_slow_rank_does_not_stall_the_others(two):
    d, results = two
    res = _ok(results, "slow")
    # Every save_*_async returned while the slow rank's writer was still held (it is released
    # only once every rank has returned), and the save committed once it finished.
    assert not any(r["done_at_return"] for r in res)
    assert not res[0]["slow_report_seen"]
    assert all(r["steps"] == [3] for r in res)


def test_backend_without_rename_commits_manifest_last(two):
    d, results = two
    res = _ok(results, "objstore")
    assert all(r["steps"] == [2] for r in res)  # keep_last=1: step 1 removed by rank 0 only after 2
    files = res[0]["files"]
    assert "manifest.json" in files and len([f for f in files if f.startswith("data-")]) == 1
    assert not [f for f in files if f.startswith("zs-coord")]  # coordination files removed


def test_saved_by_a_subgroup_loaded_by_more_ranks(four):
    _ok(four[1], "grow")  # process_group= on save; ranks beyond the saving world get rank 0's tree


@pytest.mark.parametrize("i", range(len(worker.FAULT_TABLE)))
def test_injected_fault_per_phase_and_rank(two, i):
    phase, bad = worker.FAULT_TABLE[i]
    res = _ok(two[1], "faults")
    errs = [r["errors"][i] for r in res]
    assert all(e is not None for e in errs), (phase, errs)
    assert len({json.dumps(e, sort_keys=True) for e in errs}) == 1, errs  # the same error everywhere
    assert errs[0]["type"] == "StorageError" and errs[0]["errno"] == 28 and errs[0]["rank"] == bad
    assert all(r["leftovers"] == [] for r in res)


def test_refused_save_keeps_ranks_in_step(two):
    res = _ok(two[1], "faults")
    assert all(r["exists"] == "CheckpointExistsError" and r["after"] == [0, 9] for r in res)


@pytest.mark.parametrize("world", [2, 4])
def test_steps_latest_and_retention_agree_when_views_differ(two, four, world):
    res = _ok((two if world == 2 else four)[1], "views")
    assert all(r["steps_same_view"] == [2, 3] for r in res)
    # the last rank lost step 3 from its view; the others still see it
    assert [r["local_view"] for r in res] == [[2, 3]] * (world - 1) + [[2]]
    # every rank gets the same answer: the steps every rank sees, and resumes from the same one
    assert all(r["steps"] == [2] and r["latest"] == 2 and r["loaded"] == 2 for r in res)
    assert all(r["should_save"] == [True] * 4 for r in res)
    # keep_last=2 after step 4: step 2 is the only older step every rank has, so it stays (deleting
    # it by rank 0's view alone, [2, 3, 4], would have left the last rank one loadable step)
    assert all(r["on_disk_after_4"] == ["step_00000002", "step_00000003", "step_00000004"] for r in res)
    assert all(r["steps_after_4"] == [2, 4] for r in res)
    # views agree again: step 5 commits and retention keeps the two newest everywhere
    assert all(r["on_disk_after_5"] == ["step_00000004", "step_00000005"] for r in res)
    assert all(r["steps_after_5"] == [4, 5] for r in res)


@pytest.mark.parametrize("scenario", ["atomic", "atomic_device"])
def test_corrupt_leaf_on_one_rank_leaves_every_rank_untouched_and_fallback_agrees(two, scenario):
    """LoadOptions(atomic=True) across the group: no rank writes until every rank verified (also
    with the templates loaded through restore.device's pass); the default streaming load raises
    on every rank too, and the fallback then overwrites what it left."""
    for res in _ok(two[1], scenario):
        got = {k: res[k] for k in ("error", "untouched", "streamed", "loaded", "good", "valid")}
        assert got == {"error": "ChecksumMismatchError", "untouched": True, "streamed": "ChecksumMismatchError",
                       "loaded": 1, "good": True, "valid": 1}


def test_collective_saves_of_an_unchanged_layout_reuse_it(tmp_path):
    """DDP model, AdamW and DTensor shards on 2 ranks: saves of an unchanged layout reuse the
    previous save's work on every rank and load back as saved; resharding and a new optimizer
    state key take the full path (scenario_reuse)."""
    got = _ok(worker.launch(["reuse"], 2, str(tmp_path)), "reuse")
    assert [g["hits"] for g in got] == [2, 2]
