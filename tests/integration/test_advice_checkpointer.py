"""The interval advisor wired into the Checkpointer: ``advice()`` and ``save_interval="auto"``,
with a real writer process. Costs are either given (deterministic intervals, compared with the
Young/Daly closed forms) or measured on the loop (structural checks only: no timing asserted)."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch

from zerostall import Checkpointer, ZerostallError
from zerostall.advice import Advice, MeasuredCosts, Model, SaveCost, advise
from zerostall.errors import AdviceError

HOUR = 3600.0
COSTS = MeasuredCosts(step_s=1.0, persisted=SaveCost(blocked_s=0.1, background_s=1.9, durable_s=4.0))


def state(i: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(i)), "step": i}


def test_advice_on_given_costs_matches_young_and_daly(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, mtbf_s=HOUR) as ck:
        young = ck.advice(costs=COSTS, model=Model.YOUNG)
        daly = ck.advice(costs=COSTS)
        other = ck.advice(2 * HOUR, costs=COSTS, model=Model.YOUNG)
    c = COSTS.persisted.cost_s
    tau = math.sqrt(2 * c * HOUR)  # Young: sqrt(2 C M) training seconds between saves
    assert isinstance(young, Advice) and young.model is Model.YOUNG
    assert young.interval_steps in (math.floor(tau), math.ceil(tau))
    assert young.interval_s == pytest.approx(young.interval_steps * COSTS.step_s + c)
    r = c / (2 * HOUR)
    tau_daly = math.sqrt(2 * c * HOUR) * (1 + math.sqrt(r) / 3 + r / 9) - c
    assert daly.model is Model.DALY and daly.interval_steps in (math.floor(tau_daly), math.ceil(tau_daly))
    assert other.interval_steps in (math.floor(tau * math.sqrt(2)), math.ceil(tau * math.sqrt(2)))
    assert young.costs is COSTS and young.mtbf_s == HOUR
    assert 0 < young.save_overhead < young.overhead < 1 and young.work_lost_s > COSTS.persisted.durable_s
    with pytest.raises(dataclasses.FrozenInstanceError):
        young.interval_steps = 1  # type: ignore[misc]


def test_advice_errors_name_what_is_missing(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(AdviceError) as e:
            ck.advice(costs=COSTS)
        assert e.value.key == "mtbf_s" and isinstance(e.value, ValueError)
        with pytest.raises(AdviceError) as e:
            ck.advice(HOUR)  # nothing measured yet
        assert e.value.key == "costs" and isinstance(e.value, ZerostallError)
        assert "should_save" in str(e.value)
    with pytest.raises(AdviceError):
        Checkpointer(tmp_path / "x", save_interval="auto")  # no mtbf_s
    with pytest.raises(ValueError):
        Checkpointer(tmp_path / "y", save_interval="auto", mtbf_s=HOUR, save_interval_steps=5)
    with pytest.raises(ValueError):
        Checkpointer(tmp_path / "z", save_interval="hourly")  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()  # refused before anything was created


def test_auto_with_given_costs_saves_at_the_advised_cadence(tmp_path: Path) -> None:
    mtbf = 600.0
    expected = advise(COSTS, mtbf_s=mtbf).interval_steps
    assert expected > 2
    saved = []
    with Checkpointer(tmp_path, save_interval="auto", mtbf_s=mtbf, costs=COSTS, keep_last=2) as ck:
        for step in range(1, 4 * expected + 1):
            if ck.should_save(step):
                ck.save_pytree(step, state(step))  # committed before the next step: nothing in flight
                saved.append(step)
        assert ck.advice().interval_steps == expected
    # the advice holds from the first step: the first save is due at once, then every `expected` steps
    assert saved == list(range(1, 4 * expected + 1, expected))


def test_auto_measures_then_follows_the_advice(tmp_path: Path) -> None:
    """Measured costs: warm-up saves measured alone, then saves spaced as the advice in force says.

    The MTBF is tiny so that the advised interval is tens of steps whatever this machine's speed;
    the loop runs until three saves have followed the advice (bounded)."""
    decisions: list[tuple[int, int | None]] = []  # (step, interval advised at that save)
    x = torch.randn(64, 64)
    with Checkpointer(tmp_path, save_interval="auto", mtbf_s=0.5, keep_last=1) as ck:
        auto = ck._cadence.auto
        assert auto is not None
        for step in range(1, 5001):
            time.sleep(0.002)  # the "training step"
            x = torch.tanh(x @ x.T * 1e-2)
            if ck.should_save(step):
                decisions.append((step, auto.advice.interval_steps if auto.advice else None))
                ck.save_pytree(step, {"x": x})
                if sum(i is not None for _, i in decisions) >= 3:
                    break
        a = ck.advice()  # measured costs are in by now
    warm = [s for s, i in decisions if i is None]
    assert len(warm) >= 3 and warm[0] == 9  # the first save after 8 clean steps
    assert all(b - a_ > 8 for a_, b in zip(warm, warm[1:]))  # each warm-up save measured alone
    followed = [(s, i) for s, i in decisions if i is not None]
    assert len(followed) == 3, decisions
    prev = warm[-1]
    for s, interval in followed:
        # nothing in flight (each save committed before the next step), and the advice changes only
        # on the step after a save: exactly the interval advised
        assert s - prev == interval, decisions
        prev = s
    assert a.costs.step_s > 0 and a.costs.persisted.durable_s > 0 and a.interval_steps >= 1
    assert a.costs.persisted.blocked_s <= a.costs.persisted.durable_s


RANK_SCRIPT = """
import datetime, json, sys, time
import torch, torch.distributed as dist
from zerostall import Checkpointer, SaveOptions
from zerostall.options import DistributedOptions
rank, port, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
saved, advised = [], []
opts = SaveOptions(distributed=DistributedOptions(timeout_s=30))
with Checkpointer(f"{d}/ck", save_interval="auto", mtbf_s=0.5, keep_last=1, save_options=opts) as ck:
    for step in range(1, 1001):
        time.sleep(0.002 if rank == 0 else 0.006)  # the ranks measure different iteration times
        if ck.should_save(step):
            ck.save_pytree(step, {"w": torch.full((1000,), float(step)), "rank": rank})
            saved.append(step)
            if len(saved) == 5:  # the same step on every rank, as the decisions are the same
                break
    a = ck._cadence.auto.advice
    advised = a.interval_steps if a is not None else None
json.dump({"saved": saved, "advised": advised}, open(f"{d}/out-{rank}.json", "w"))
dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_auto_under_torch_distributed_every_rank_saves_the_same_steps(tmp_path: Path) -> None:
    """Two gloo ranks whose own measurements differ: rank 0's decisions are followed by both."""
    import json
    import os
    import socket
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(port), str(tmp_path)], env=env)
             for r in range(2)]
    try:
        rcs = [p.wait(240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert rcs == [0, 0]
    out = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(2)]
    # warm-up saves fall on the same steps anyway (9, 18, 27); the later ones follow measured costs
    assert out[0]["saved"] == out[1]["saved"] and len(out[0]["saved"]) == 5
    assert out[0]["saved"][0] == 9  # warm-up as on one process


def test_auto_with_the_memory_tier_persists_every_kth_save(tmp_path: Path) -> None:
    """Given two-level costs: memory-only saves every advised interval, every persist_every-th persisted."""
    from zerostall.options import MemoryTier

    costs = MeasuredCosts(step_s=1.0,
                          persisted=SaveCost(blocked_s=0.1, background_s=3.9, durable_s=4.0, restore_s=60.0),
                          memory=SaveCost(blocked_s=0.1, background_s=0.1, durable_s=0.5, restore_s=10.0))
    mtbf = 900.0
    a = advise(costs, mtbf_s=mtbf)
    assert a.model is Model.TWO_LEVEL and a.persist_every > 1  # the case worth testing
    with Checkpointer(tmp_path, save_interval="auto", mtbf_s=mtbf, costs=costs,
                      memory_tier=MemoryTier(linger_s=0)) as ck:
        steps = []
        for step in range(1, 3 * a.persist_every * a.interval_steps + 1):
            if ck.should_save(step):
                ck.save_pytree(step, state(step))
                steps.append(step)
        tiers = [s.tiers for s in ck.stats()]
        assert ck.advice() == a
    assert steps == list(range(1, 3 * a.persist_every * a.interval_steps + 1, a.interval_steps))
    persisted = [i for i, t in enumerate(tiers) if "storage" in t]
    assert all(t[0] == "memory" for t in tiers)
    assert persisted == list(range(a.persist_every - 1, len(tiers), a.persist_every))
    with pytest.raises(AdviceError):  # two-level costs are needed with the memory tier
        Checkpointer(tmp_path / "x", save_interval="auto", mtbf_s=mtbf, costs=COSTS, memory_tier=MemoryTier())


REPLICA_RANK = """
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from zerostall import Checkpointer, DistributedOptions, MemoryTier, SaveOptions
from zerostall.advice import FailureMix, MeasuredCosts, ReplicaCost, SaveCost
from zerostall.errors import AdviceError
rank, d = int(sys.argv[1]), sys.argv[2]
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
opts = SaveOptions(distributed=DistributedOptions(timeout_s=30))
given = MeasuredCosts(step_s=1.0, persisted=SaveCost(blocked_s=0.1, background_s=3.9, durable_s=4.0),
                      memory=SaveCost(blocked_s=0.1, background_s=0.1, durable_s=0.5))
out = {}
with Checkpointer(d, save_options=opts, save_interval="auto", mtbf_s=0.5,
                  memory_tier=MemoryTier(linger_s=0, replicas=1,
                                         replicas_in_place=os.environ.get("ZS_IN_PLACE") == "1")) as ck:
    # the keeper took the replica setup (torch imported, receivers up) before the constructor returned
    out["keeper_ready"] = "libtorch" in open(f"/proc/{ck._engine.writer.pid}/maps").read()
    saved = []
    for step in range(1, 2001):
        time.sleep(0.003)
        if ck.should_save(step):  # rank 0's decision, on every rank
            ck.save_pytree(step, {"w": torch.full((4096,), float(step + rank))})
            saved.append(step)
            if len(saved) == 9:  # warm-up (3 saves of each kind) measured, then the advice followed
                break
    auto = ck._cadence.auto
    out["auto"] = [auto.replicas, auto.advice.replicas if auto.advice is not None else None]
    out["nbytes"] = ck.stats()[-1].nbytes
    out["peer"] = any("peer" in s.tiers for s in ck.stats())  # memory-only saves waited for the replica
    for name, kw in (("measured", {}), ("given", {"costs": given.__class__(**{**given.__dict__,
                     "replica": ReplicaCost(send_s=0.5)})}), ("unmeasured", {"costs": given}),
                     ("mix", {"failure_mix": FailureMix(crash=0.4, node_loss=0.5)})):
        a = ck.advice(3600.0, **kw)
        out[name] = {"replicas": a.replicas, "host_bytes": a.replica_host_bytes,
                     "tiers": [t.tier for t in a.tiers], "shares": [t.failure_share for t in a.tiers],
                     "caveats": list(a.caveats)}
    try:
        ck.advice(3600.0, costs=given, memory_fraction=0.5)
    except AdviceError as e:
        out["fraction_refused"] = e.key
json.dump(out, open(f"{d}-out-{rank}.json", "w"))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("in_place", [False, True], ids=["two-copies", "in-place"])
def test_advice_of_a_checkpointer_with_replicas_has_the_peer_tier_and_its_host_memory(tmp_path: Path,
                                                                                      in_place: bool) -> None:
    """Two gloo ranks on two simulated hosts, ``MemoryTier(replicas=1)``: the constructor returns
    with its keeper ready to replicate, ``advice()`` models three tiers, the replica's host memory
    is twice the bytes each rank's save staged (once with ``replicas_in_place``), and "auto"
    advises with the replicas."""
    import json
    import os
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    src = str(Path(__file__).resolve().parents[2] / "src")
    procs = []
    with open(tmp_path / "log.txt", "w") as log:
        for r, host in enumerate(("a", "b")):
            env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1", ZEROSTALL_HOST_ID=f"host-{host}",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), ZS_IN_PLACE="1" if in_place else "0")
            procs.append(subprocess.Popen([sys.executable, "-c", REPLICA_RANK, str(r), str(tmp_path / "run")],
                                          env=env, stderr=log))
        try:
            rcs = [p.wait(240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert rcs == [0, 0], (tmp_path / "log.txt").read_text()[-4000:]
    for r in range(2):
        out = json.loads((tmp_path / f"run-out-{r}.json").read_text())
        assert out["keeper_ready"] and out["peer"] and out["nbytes"] >= 4096 * 4
        assert out["auto"][0] == 1 and out["auto"][1] in (1, None if r else 1)  # "auto" follows rank 0's advice
        for name in ("measured", "given", "mix"):  # the memory tier's replicas reach the advice
            assert out[name]["replicas"] == 1 and out[name]["tiers"] == ["memory", "peer", "storage"], out
            # the held replica and the next one's buffers, or the one replica received in place
            assert out[name]["host_bytes"] == (1 if in_place else 2) * out["nbytes"], out
        assert not any("not measured" in c for c in out["measured"]["caveats"])  # counted in the memory saves
        assert out["mix"]["shares"] == pytest.approx([0.4, 0.5, 0.1])
        # given costs without a replica: replication unmeasured, said, its host memory unknown
        assert out["unmeasured"]["host_bytes"] is None and out["unmeasured"]["replicas"] == 1
        assert any("not measured" in c for c in out["unmeasured"]["caveats"])
        assert out["fraction_refused"] == "memory_fraction"  # says nothing of node losses
    del store


def test_advice_without_replicas_is_the_two_level_advice(tmp_path: Path) -> None:
    from zerostall.advice import DEFAULT_MEMORY_FRACTION
    from zerostall.options import MemoryTier

    costs = MeasuredCosts(step_s=1.0, persisted=SaveCost(blocked_s=0.1, background_s=3.9, durable_s=4.0),
                          memory=SaveCost(blocked_s=0.1, background_s=0.1, durable_s=0.5))
    with Checkpointer(tmp_path, memory_tier=MemoryTier(linger_s=0)) as ck:
        ck.save_pytree(1, state(1))
        a = ck.advice(HOUR, costs=costs)
        assert ck.advice(HOUR, costs=costs, memory_fraction=0.5) == advise(costs, mtbf_s=HOUR, memory_fraction=0.5)
    assert a == advise(costs, mtbf_s=HOUR, memory_fraction=DEFAULT_MEMORY_FRACTION)
    assert a.replicas == 0 and a.replica_host_bytes == 0 and [t.tier for t in a.tiers] == ["memory", "storage"]
