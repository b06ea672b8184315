"""The pure parts of torch.distributed support: owner assignment, report merging, manifest rules."""

from __future__ import annotations

import json

import pytest

from zerostall import LoadOptions
from zerostall.commit.agreement import attempt_names
from zerostall.distributed import DistributedOptions, Replicated
from zerostall.distributed.load import replicated_leaves
from zerostall.errors import CorruptCheckpointError
from zerostall.format.manifest import encode_manifest, parse_manifest
from zerostall.persist.collective import assign_owners, merge_reports
from zerostall.storage.memory import MemoryStorage


def _table(*leaves):
    return {"leaves": [[k, "torch", "F32", [n // 4], n, h] for k, n, h in leaves]}


def test_owners_one_per_shared_leaf_spread_by_bytes():
    shared = [("w0", 4000, "a"), ("w1", 3000, "b"), ("w2", 2000, "c"), ("w3", 1000, "d")]
    tables = [_table(*shared, ("rng", 40, f"r{r}")) for r in range(3)]
    owner = assign_owners(tables)
    assert owner == assign_owners(json.loads(json.dumps(tables)))  # deterministic from the tables alone
    for k, _, _ in shared:
        assert len({owner[(r, k)] for r in range(3)}) == 1  # one owner, named alike by every rank
    assert {owner[(0, k)] for k, _, _ in shared} == {0, 1, 2}  # spread, not all on rank 0
    assert all(owner[(r, "rng")] == r for r in range(3))  # differing bytes: each rank writes its own


def test_owners_only_among_ranks_with_equal_bytes():
    tables = [_table(("w", 400, "x")), _table(("w", 400, "x")), _table(("w", 400, "y")), _table(("w", 400, None))]
    owner = assign_owners(tables)
    assert owner[(0, "w")] == owner[(1, "w")] in (0, 1)
    assert owner[(2, "w")] == 2 and owner[(3, "w")] == 3


def _leaf(key, off, n=16):
    return {"key": key, "kind": "torch", "dtype": "F32", "shape": [n // 4], "offset": off, "nbytes": n, "crc32c": 1}


def test_merge_reports_remaps_leaves_and_unions_shards():
    def items(rng_leaf, shard_leaf, row):
        return {"pytree": {"type": "dict", "keys": ["w", "rng", "dt"], "values": [
            {"type": "array", "leaf": 0}, {"type": "array", "leaf": rng_leaf},
            {"type": "sharded", "kind": "torch", "dtype": "F32", "shape": [2, 4],
             "shards": [{"offset": [row, 0], "shape": [1, 4], "leaf": shard_leaf, "unique": True}]}]}}
    reports = [
        {"file_size": 256, "written": [_leaf("pytree/rng", 64), _leaf("pytree/dt", 128)],
         "items": items(1, 2, 0), "refs": [[1, "pytree/w"], [0, "pytree/rng"], [0, "pytree/dt"]]},
        {"file_size": 320, "written": [_leaf("pytree/w", 64), _leaf("pytree/rng", 128), _leaf("pytree/dt", 192)],
         "items": items(1, 2, 1), "refs": [[1, "pytree/w"], [1, "pytree/rng"], [1, "pytree/dt"]]},
    ]
    files, leaves, trees = merge_reports(reports, "data")
    assert [f["path"] for f in files] == ["data/rank-00000.safetensors", "data/rank-00001.safetensors"]
    w0 = trees[0]["pytree"]["values"][0]["leaf"]
    assert w0 == trees[1]["pytree"]["values"][0]["leaf"] and leaves[w0]["file"] == 1  # written once, by rank 1
    rng = [t["pytree"]["values"][1]["leaf"] for t in trees]
    assert [leaves[i]["file"] for i in rng] == [0, 1]
    for t in trees:  # every rank lists every shard, without the writer's hint
        shards = t["pytree"]["values"][2]["shards"]
        assert [s["offset"] for s in shards] == [[0, 0], [1, 0]] and all("unique" not in s for s in shards)
    m = parse_manifest(encode_manifest(items=trees[0], leaves=leaves, files=files, ranks=trees, attempt="x-1"),
                       path="/ck")
    assert len(m.ranks) == 2 and replicated_leaves(m) == {w0}


def _dist_doc(shard):
    items = {"p": {"type": "sharded", "kind": "torch", "dtype": "F32", "shape": [2, 4], "shards": [shard]}}
    return encode_manifest(items=items, leaves=[dict(_leaf("p", 64, 32), file=0)], files=[{"path": "data/r.safetensors",
                                                                            "size": 96}], ranks=[items], attempt="a")


def test_manifest_sharded_box_checked():
    parse_manifest(_dist_doc({"offset": [0, 0], "shape": [2, 4], "leaf": 0}), path="/ck")
    with pytest.raises(CorruptCheckpointError, match="inside the global shape"):
        parse_manifest(_dist_doc({"offset": [1, 0], "shape": [2, 4], "leaf": 0}), path="/ck")
    with pytest.raises(CorruptCheckpointError, match="out of range"):
        parse_manifest(_dist_doc({"offset": [0, 0], "shape": [2, 4], "leaf": 3}), path="/ck")


def test_manifest_ranks_checked():
    doc = json.loads(_dist_doc({"offset": [0, 0], "shape": [2, 4], "leaf": 0}))
    doc["ranks"] = [{"items": {"p": {"type": "array", "leaf": 9}}}]
    with pytest.raises(CorruptCheckpointError, match="out of range"):
        parse_manifest(json.dumps(doc).encode(), path="/ck")


def test_options():
    assert LoadOptions(replicated="every_rank").replicated is Replicated.EVERY_RANK
    with pytest.raises(ValueError, match="replicated"):
        LoadOptions(replicated="sometimes")
    with pytest.raises(ValueError, match="timeout_s"):
        DistributedOptions(timeout_s=0)


def test_attempt_names_are_derived_alike():
    a = attempt_names(MemoryStorage("memory://names"), "step_00000003", "run", 7)
    assert a.staging == ".step_00000003.zs-tmp-run-7" and a.data_file(2).endswith("data/rank-00002.safetensors")
    assert a.decision == ".step_00000003.zs-decision-run-7"
