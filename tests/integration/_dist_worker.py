"""One rank of a multi-process test: ``_dist_worker.py SCENARIO[,SCENARIO...] RANK WORLD PORT DIR``.

Scenarios run in order in the same processes (torch's start-up is the expensive part on a small
machine), each in ``DIR/<scenario>/``. Writes ``DIR/result-RANK.json``:
``{scenario: {"ok": true, ...} or {"ok": false, "error": ..., "tb": ...}}``.
The DTensor load reads the checkpoint named by ``ZS_DTENSOR_CKPT``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch
import torch.distributed as dist

import zerostall
from zerostall import Checkpointer, LoadOptions, SaveOptions, ZerostallError
from zerostall.distributed import DistributedOptions


def ddp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # identical on every rank, as DDP makes it
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32),
                                torch.nn.Linear(32, 48))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # the same batch everywhere
    x = torch.randn(8, 64, generator=g)
    model(x).square().mean().backward()
    if dist.is_initialized():
        # Identical gradients on every rank, bit for bit, as DDP's all-reduce makes them. Two
        # processes computing the same backward need not agree to the last bit.
        for p in model.parameters():
            dist.broadcast(p.grad, src=0)
    opt.step()
    opt.zero_grad()


def per_rank(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + rank)
    return {"rng": torch.randint(0, 1 << 30, (17,), generator=g) + step, "step": step,
            "loader": {"position": rank * 100 + step, "name": f"shard-{rank}"}}


def scenario_roundtrip(rank: int, world: int, d: str) -> dict:
    model, opt = ddp_model()
    train_step(model, opt, 1)
    out: dict = {}
    with Checkpointer(f"{d}/ck", keep_last=2) as ck:
        ck.save_pytree(1, {"model": model, "optim": opt, "rank_state": per_rank(rank, 1)})
        train_step(model, opt, 2)
        expect_model = {k: v.clone() for k, v in model.state_dict().items()}
        r = ck.save_pytree_async(2, {"model": model, "optim": opt, "rank_state": per_rank(rank, 2)})
        train_step(model, opt, 3)  # mutate right after the async return
        stats = r.result()
        out["leaves_written"] = stats.nbytes
        for mode in ("broadcast", "every_rank"):
            fresh, fopt = ddp_model()
            tmpl = {"model": fresh, "optim": fopt, "rank_state": per_rank(rank, 0)}
            ck.load_options = LoadOptions(replicated=mode)
            got = ck.load_pytree(template=tmpl)
            for k, v in expect_model.items():
                assert torch.equal(fresh.state_dict()[k], v), (mode, k)
            assert torch.equal(got["rank_state"]["rng"], per_rank(rank, 2)["rng"]), mode
            assert got["rank_state"]["step"] == 2
            assert got["rank_state"]["loader"] == {"position": rank * 100 + 2, "name": f"shard-{rank}"}
            st = fopt.state_dict()["state"]
            assert int(st[0]["step"]) == 2 and len(st) == 6, mode
        # Without a template: this rank's tree as saved.
        raw = ck.load_pytree()
        assert raw["rank_state"]["loader"]["position"] == rank * 100 + 2
        out["latest"] = ck.latest_step()
    return out


def scenario_dtensor_save(rank: int, world: int, d: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _dtensor_globals()
    tree = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
            "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
            "rank": rank}
    zerostall.save_pytree(f"{d}/dt", tree, options=SaveOptions(distributed=DistributedOptions(timeout_s=60)))
    return {}


def _dtensor_globals() -> dict:
    return {"rows": torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6),
            "cols": torch.arange(7 * 10, dtype=torch.int64).reshape(7, 10) * 3,
            "rep": torch.linspace(0, 1, 33, dtype=torch.float64)}


def scenario_dtensor_load(rank: int, world: int, d: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _dtensor_globals()
    tmpl = {"rows": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]),
            # saved as Shard(1) on 4 ranks, loaded as Shard(0) on 2: boxes cross the saved shards
            "cols": distribute_tensor(torch.zeros(7, 10, dtype=torch.int64), mesh, [Shard(0)]),
            "rep": distribute_tensor(torch.zeros(33, dtype=torch.float64), mesh, [Replicate()])}
    src = os.environ["ZS_DTENSOR_CKPT"]
    got = zerostall.load_pytree(src, tmpl)
    for k in tmpl:
        assert got[k] is tmpl[k]
        assert torch.equal(tmpl[k].full_tensor(), full[k]), k
    # a Shard(1) template of the Shard(0)-saved tensor: covering row ranges
    t2 = {"rows": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(1)])}
    zerostall.load_pytree(src, t2)
    assert torch.equal(t2["rows"].full_tensor(), full["rows"])
    # Only the rows this rank needs are read: 5 of the 10 rows (saved as 3+3+3+1 on 4 ranks).
    from zerostall.storage.local import LocalStorage

    sizes: list[int] = []
    orig = LocalStorage.read_into
    orig_seq = LocalStorage.read_sequential

    def counting(self, key, offset, buf):  # type: ignore[no-untyped-def]
        sizes.append(len(buf))
        return orig(self, key, offset, buf)

    def counting_seq(self, key, offset, buf, **kw):  # type: ignore[no-untyped-def]
        sizes.append(len(buf))
        return orig_seq(self, key, offset, buf, **kw)
    orig_vec = LocalStorage.read_vectored

    def counting_vec(self, key, offset, bufs, **kw):  # type: ignore[no-untyped-def]
        sizes.append(sum(len(b) for b in bufs))
        return orig_vec(self, key, offset, bufs, **kw)
    from zerostall.storage.local import MappedFile
    orig_copy = MappedFile.copy_into

    def counting_copy(self, offset, dest, **kw):  # type: ignore[no-untyped-def]  # out of the page cache's pages
        sizes.append(len(dest))
        return orig_copy(self, offset, dest, **kw)
    LocalStorage.read_into = counting  # type: ignore[method-assign]
    LocalStorage.read_sequential = counting_seq  # type: ignore[method-assign]
    LocalStorage.read_vectored = counting_vec  # type: ignore[method-assign]
    MappedFile.copy_into = counting_copy  # type: ignore[method-assign]
    try:
        t3 = {"rows": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)])}
        zerostall.load_pytree(src, t3)
    finally:
        LocalStorage.read_into = orig  # type: ignore[method-assign]
        LocalStorage.read_sequential = orig_seq  # type: ignore[method-assign]
        LocalStorage.read_vectored = orig_vec  # type: ignore[method-assign]
        MappedFile.copy_into = orig_copy  # type: ignore[method-assign]
    assert torch.equal(t3["rows"].full_tensor(), full["rows"])
    return {"bytes_read": sum(sizes)}


def scenario_grow(rank: int, world: int, d: str) -> dict:
    """Saved by ranks 0-1 (a sub-group), loaded by all ranks: ranks >= 2 get rank 0's tree."""
    sub = dist.new_group([0, 1])
    if rank < 2:
        with Checkpointer(f"{d}/ck", process_group=sub) as ck:
            ck.save_pytree(1, {"w": torch.arange(8.0), "rank_state": per_rank(rank, 1)})
    dist.barrier()
    with Checkpointer(f"{d}/ck") as ck:
        got = ck.load_pytree()
    src = rank if rank < 2 else 0
    assert torch.equal(got["w"], torch.arange(8.0))
    assert got["rank_state"]["loader"]["position"] == src * 100 + 1
    assert torch.equal(got["rank_state"]["rng"], per_rank(src, 1)["rng"])
    return {}


def scenario_kill(rank: int, world: int, d: str) -> dict:
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=20))
    state = {"w": torch.arange(1000.0), "rank": per_rank(rank, 1)}
    with Checkpointer(f"{d}/ck", save_options=opts) as ck:
        ck.save_pytree(1, state)
    if rank == 1:  # this rank's next writer dies in its write phase
        os.environ["ZEROSTALL_FAULTS"] = json.dumps({"write": "exit"})
    t0 = time.monotonic()
    with Checkpointer(f"{d}/ck", save_options=opts) as ck:
        os.environ.pop("ZEROSTALL_FAULTS", None)
        state["w"].add_(1)
        r = ck.save_pytree_async(2, state)
        try:
            r.result(timeout=60)
        except Exception as exc:  # expected
            err = {"type": type(exc).__name__, "msg": str(exc), "rank": getattr(exc, "rank", None)}
        else:
            err = None
        elapsed = time.monotonic() - t0
        steps = ck.steps()
        back = ck.load_pytree(1)
        assert torch.equal(back["w"], torch.arange(1000.0))
    return {"error": err, "elapsed": elapsed, "steps": steps}


def scenario_sigkill0(rank: int, world: int, d: str) -> dict:
    """Rank 0's writer (the committer) is SIGKILLed while it is held in its write phase."""
    import glob
    import signal

    opts = SaveOptions(distributed=DistributedOptions(timeout_s=20))
    state = {"w": torch.arange(1000.0), "rank": per_rank(rank, 1)}
    with Checkpointer(f"{d}/ck", save_options=opts) as ck:
        ck.save_pytree(1, state)
    if rank == 0:
        os.environ["ZEROSTALL_FAULTS"] = json.dumps({"write": f"wait:{d}/never"})
    t0 = time.monotonic()
    with Checkpointer(f"{d}/ck", save_options=opts) as ck:
        os.environ.pop("ZEROSTALL_FAULTS", None)
        state["w"].add_(1)
        r = ck.save_pytree_async(2, state)
        if rank == 0:  # its table is published only once its writer runs the save: kill it then
            while not glob.glob(f"{d}/ck/.step_00000002.zs-tmp-*/zs-coord/tables/rank-00000.json"):
                time.sleep(0.01)
            os.kill(ck._engine.writer.pid, signal.SIGKILL)
        try:
            r.result(timeout=60)
            err = None
        except Exception as exc:
            err = {"type": type(exc).__name__, "msg": str(exc), "rank": getattr(exc, "rank", None)}
        elapsed = time.monotonic() - t0
        steps = ck.steps()
        assert torch.equal(ck.load_pytree(1)["w"], torch.arange(1000.0))
    return {"error": err, "elapsed": elapsed, "steps": steps}


def scenario_objstore(rank: int, world: int, d: str) -> dict:
    """A backend without rename (as object stores): data under <name>/data-<attempt>/, manifest last."""
    from zerostall import WriterKind
    from zerostall.storage import register_scheme
    from zerostall.storage.local import LocalStorage

    class NoRename(LocalStorage):
        atomic_rename = False

        def __init__(self, url: str) -> None:
            super().__init__(url.split("://", 1)[1])
            self.url = url

    register_scheme("norename", NoRename)  # in this process: the writer runs as a thread here
    opts = SaveOptions(writer=WriterKind.THREAD, distributed=DistributedOptions(timeout_s=30))
    model, opt = ddp_model()
    train_step(model, opt, 1)
    with Checkpointer(f"norename://{d}/ck", save_options=opts, keep_last=1) as ck:
        ck.save_pytree(1, {"model": model, "rank": per_rank(rank, 1)})
        train_step(model, opt, 2)
        ck.save_pytree(2, {"model": model, "rank": per_rank(rank, 2)})
        fresh, _ = ddp_model()
        got = ck.load_pytree(template={"model": fresh, "rank": per_rank(rank, 0)})
        for k, v in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), k
        assert torch.equal(got["rank"]["rng"], per_rank(rank, 2)["rng"])
        steps = ck.steps()
    return {"steps": steps, "files": sorted(os.listdir(f"{d}/ck/step_00000002"))}


def scenario_s3env(rank: int, world: int, d: str) -> dict:
    """A collective save to S3 uses the trainer's credentials as they are at the save, not the
    ones its writer process inherited when it started: a wrong secret set after the start fails
    the save on every rank; the right one set back commits it, on the same writers."""
    url = os.environ["ZS_S3_URL"]
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=60))
    model, opt = ddp_model()
    train_step(model, opt, 1)
    errors = []
    with Checkpointer(url, keep_last=1, save_options=opts) as ck:
        writer = ck._engine.writer.pid  # started here, with the good credentials in its environment
        good = os.environ["AWS_SECRET_ACCESS_KEY"]
        os.environ["AWS_SECRET_ACCESS_KEY"] = "wrong-" + good
        try:
            ck.save_pytree(1, {"model": model, "rank": per_rank(rank, 1)})
            errors.append(None)
        except ZerostallError as exc:
            errors.append({"type": type(exc).__name__, "errno": getattr(exc, "errno", None), "msg": str(exc)})
        os.environ["AWS_SECRET_ACCESS_KEY"] = good
        train_step(model, opt, 2)
        ck.save_pytree(2, {"model": model, "rank": per_rank(rank, 2)})
        fresh, _ = ddp_model()
        got = ck.load_pytree(template={"model": fresh, "rank": per_rank(rank, 0)})
        for k, v in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), k
        assert torch.equal(got["rank"]["rng"], per_rank(rank, 2)["rng"])
        same_writer = ck._engine.writer.pid == writer
        steps = ck.steps()
    return {"errors": errors, "steps": steps, "same_writer": same_writer}


_HIDDEN: set[str] = set()  # step folders missing from this rank's view of the storage


def scenario_views(rank: int, world: int, d: str) -> dict:
    """Ranks whose views of the storage differ (the last rank does not see some step folders):
    steps() / latest_step() / load(step=None) agree on what every rank sees, and retention keeps
    keep_last steps that every rank can load."""
    from zerostall import WriterKind
    from zerostall.storage import register_scheme
    from zerostall.storage.local import LocalStorage

    class RankView(LocalStorage):
        def __init__(self, url: str) -> None:
            super().__init__(url.split("://", 1)[1])
            self.url = url

        def list(self, prefix: str) -> list[str]:
            return [n for n in super().list(prefix) if prefix or n not in _HIDDEN]

        def exists(self, key: str) -> bool:
            return key.split("/", 1)[0] not in _HIDDEN and super().exists(key)

    register_scheme("rankview", RankView)  # in this process: the writer runs as a thread here
    opts = SaveOptions(writer=WriterKind.THREAD, distributed=DistributedOptions(timeout_s=60))
    real = f"{d}/ck"
    out: dict = {}
    with Checkpointer(f"rankview://{real}", save_options=opts, keep_last=2) as ck:
        for step in (1, 2, 3):
            ck.save_pytree(step, {"w": torch.full((64,), float(step)), "rank": per_rank(rank, step)})
        out["steps_same_view"] = ck.steps()
        if rank == world - 1:
            _HIDDEN.add("step_00000003")  # gone from this rank's view only
        out["local_view"] = sorted(int(n[5:]) for n in ck._storage.list("") if n.startswith("step_"))
        out["steps"] = ck.steps()
        out["latest"] = ck.latest_step()
        out["should_save"] = [ck.should_save(s) for s in range(4)]
        got = ck.load_pytree()
        out["loaded"] = int(got["w"][0])
        ck.save_pytree(4, {"w": torch.full((64,), 4.0), "rank": per_rank(rank, 4)})
        dist.barrier()
        out["on_disk_after_4"] = sorted(n for n in os.listdir(real) if not n.startswith("."))
        out["steps_after_4"] = ck.steps()
        _HIDDEN.clear()
        ck.save_pytree(5, {"w": torch.full((64,), 5.0), "rank": per_rank(rank, 5)})
        dist.barrier()
        out["on_disk_after_5"] = sorted(n for n in os.listdir(real) if not n.startswith("."))
        out["steps_after_5"] = ck.steps()
    return out


FAULT_TABLE = [("begin", 1), ("write", 1), ("checksum", 0), ("manifest", 0), ("commit", 0)]


def scenario_faults(rank: int, world: int, d: str) -> dict:
    """An injected ENOSPC per (phase, rank): every rank raises the same StorageError, nothing commits."""
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=20))
    state = {"w": torch.arange(100.0), "rank": per_rank(rank, 0)}
    with Checkpointer(f"{d}/ck", save_options=opts) as ck:
        ck.save_pytree(0, state)
    out = []
    for step, (phase, bad) in enumerate(FAULT_TABLE, start=1):
        if rank == bad:
            os.environ["ZEROSTALL_FAULTS"] = json.dumps({phase: "raise:ENOSPC"})
        with Checkpointer(f"{d}/ck", save_options=opts) as ck:
            os.environ.pop("ZEROSTALL_FAULTS", None)
            try:
                ck.save_pytree(step, state)
                out.append(None)
            except Exception as exc:
                out.append({"type": type(exc).__name__, "errno": getattr(exc, "errno", None),
                            "rank": getattr(exc, "rank", None), "msg": str(exc)})
            steps = ck.steps()
        assert steps == [0], (phase, steps)
    # A save refused on the training thread (the step exists) still counts on every rank: the
    # next save's attempt names agree and it commits.
    with Checkpointer(f"{d}/ck", save_options=opts) as ck:
        try:
            ck.save_pytree(0, state)
            exists = None
        except zerostall.errors.CheckpointExistsError as exc:
            exists = type(exc).__name__
        ck.save_pytree(9, state)
        steps = ck.steps()
    return {"errors": out, "leftovers": sorted(n for n in os.listdir(f"{d}/ck") if "zs-tmp" in n),
            "exists": exists, "after": steps}


def scenario_slow(rank: int, world: int, d: str) -> dict:
    gate = f"{d}/gate"
    if rank == world - 1:  # the slow rank: its writer waits for the gate file
        os.environ["ZEROSTALL_FAULTS"] = json.dumps({"write": f"wait:{gate}"})
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=60))
    with Checkpointer(f"{d}/ck", save_options=opts) as ck:
        state = {"w": torch.full((4096,), float(rank)), "shared": torch.arange(5000.0)}
        r = ck.save_pytree_async(3, state)
        # Returned while the slow writer is still held: an ordering, not a timing threshold.
        # Its report (<coord>/ranks/), not its hash table (<coord>/tables/), which the slow writer
        # may already have put before the held write phase.
        slow_report_seen = any(os.path.basename(root) == "ranks" and "rank-%05d.json" % (world - 1) in fs
                               for root, _, fs in os.walk(d))
        done_at_return = r.done()
        with open(f"{d}/returned-{rank}", "w"):
            pass
        if rank == world - 1:
            while not all(os.path.exists(f"{d}/returned-{i}") for i in range(world)):
                time.sleep(0.01)
            with open(gate, "w"):
                pass
        r.result(timeout=60)
        return {"done_at_return": done_at_return, "slow_report_seen": slow_report_seen, "steps": ck.steps()}


def scenario_atomic(rank: int, world: int, d: str) -> dict:
    """A corrupt leaf only the last rank reads: every rank raises, no rank's template changes;
    then the fallback load and latest_valid_step agree on the older step everywhere."""
    def state(step: int) -> dict:
        return {"mine": torch.full((200_000,), float(rank * 10 + step)), "shared": torch.arange(3000.0) * step}

    with Checkpointer(f"{d}/ck") as ck:
        ck.save_pytree(1, state(1))
        ck.save_pytree(2, state(2))
    dist.barrier()
    if rank == world - 1:  # flip a byte of this rank's own leaf in step 2
        step2 = f"{d}/ck/step_00000002"
        m = json.load(open(f"{step2}/manifest.json"))
        leaf = next(lf for lf in m["leaves"] if lf["key"] == "pytree/mine" and m["files"][lf["file"]]["path"].endswith(
            f"rank-{rank:05d}.safetensors"))
        with open(f"{step2}/data/{m['files'][leaf['file']]['path'].split('/')[-1]}", "r+b") as f:
            f.seek(leaf["offset"] + 1000)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 1]))
    dist.barrier()
    tmpl = {"mine": torch.full((200_000,), -1.0), "shared": torch.full((3000,), -1.0)}
    with Checkpointer(f"{d}/ck", load_options=LoadOptions(atomic=True)) as ck:
        try:
            ck.load_pytree(2, tmpl)
            err = None
        except ZerostallError as exc:
            err = type(exc).__name__
        untouched = bool((tmpl["mine"] == -1).all() and (tmpl["shared"] == -1).all())
    with Checkpointer(f"{d}/ck") as ck:  # the default load streams: every rank still raises
        try:
            ck.load_pytree(2, tmpl)
            streamed = None
        except ZerostallError as exc:
            streamed = type(exc).__name__
        ck.load_pytree(template=tmpl, fallback=True)
        loaded = ck.last_loaded_step
        good = torch.equal(tmpl["mine"], state(1)["mine"]) and torch.equal(tmpl["shared"], state(1)["shared"])
        valid = ck.latest_valid_step()
    return {"error": err, "untouched": untouched, "streamed": streamed, "loaded": loaded, "good": good,
            "valid": valid}


def scenario_atomic_device(rank: int, world: int, d: str) -> dict:
    """``scenario_atomic`` with the templates loaded by the device pass (``restore.device``; CPU
    templates sent through it, as tests/unit/test_device_load.py does): the bytes held back in its
    scratch until every rank verified, the replicated leaf read by each rank itself."""
    from zerostall.restore import plan

    plan.DEVICE_TYPES.add("cpu")
    try:
        return scenario_atomic(rank, world, d)
    finally:
        plan.DEVICE_TYPES.discard("cpu")


def _step_files(step_dir: str) -> dict[str, bytes]:
    """A committed step's files by path, its manifest without its creation time and the name of
    the collective attempt that wrote it (run id and save number: another Checkpointer's differ)."""
    out = {}
    for root, _, names in os.walk(step_dir):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                data = f.read()
            if n == "manifest.json":
                doc = json.loads(data)
                doc.pop("created_unix")
                doc.pop("attempt")
                data = json.dumps(doc, sort_keys=True).encode()
            out[os.path.relpath(p, step_dir)] = data
    return out


def scenario_reuse(rank: int, world: int, d: str) -> dict:
    """Collective saves of an unchanged layout (a DDP model, its AdamW, DTensor shards) reuse the
    previous save's work on every rank and save what a full save does; a resharded DTensor and a
    new optimizer state key take the full path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _dtensor_globals()
    model, opt = ddp_model()
    train_step(model, opt, 1)
    dts = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
           "rep": distribute_tensor(full["rep"], mesh, [Replicate()])}
    mine = per_rank(rank, 1)
    tree = {"model": model, "optim": opt, "dt": dts, "rank_state": mine}
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=60))

    def check(ck: Checkpointer, step: int, rows: torch.Tensor) -> None:
        fresh, fopt = ddp_model()
        tmpl = {"model": fresh, "optim": fopt, "rank_state": per_rank(rank, 0),
                "dt": {"rows": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]),
                       "rep": distribute_tensor(torch.zeros(33, dtype=torch.float64), mesh, [Replicate()])}}
        ck.load_pytree(step, template=tmpl)
        for k, v in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), (step, k)
        assert torch.equal(tmpl["rank_state"]["rng"], mine["rng"]), step
        assert torch.equal(tmpl["dt"]["rows"].full_tensor(), rows), step
        want, got = opt.state_dict()["state"], fopt.state_dict()["state"]
        for pid, st in want.items():
            for k, v in st.items():
                assert torch.equal(got[pid][k], v), (step, pid, k)

    from zerostall.distributed import dtensor

    boxes = [0]
    real_box = dtensor.local_box

    def counted_box(dt: object) -> tuple[tuple[int, ...], tuple[int, ...]]:
        boxes[0] += 1
        return real_box(dt)

    dtensor.local_box = counted_box
    with Checkpointer(f"{d}/ck", keep_last=4, save_options=opts) as ck:
        cache = ck._engine._layouts
        ck.save_pytree(1, tree)
        assert boxes[0] == 2, boxes  # the first save flattens each DTensor
        train_step(model, opt, 2)
        mine["rng"].add_(1)
        mine["step"] = 2
        dts["rows"].to_local().add_(100)  # in place: the same shard
        ck.save_pytree(2, tree)
        assert (cache.hits, cache.deferrals_reused) == (1, 1), (cache.hits, cache.deferrals_reused)
        assert boxes[0] == 2, boxes  # the kept layout's DTensors: their keys, no box computed again
        check(ck, 2, full["rows"] + 100)
        # the cached collective save wrote what a full save of the same state writes
        with Checkpointer(f"{d}/full", save_options=opts) as fresh:
            fresh.save_pytree(2, tree)
            assert fresh._engine._layouts.hits == 0
        if rank == 0:
            cached_files, full_files = _step_files(f"{d}/ck/step_00000002"), _step_files(f"{d}/full/step_00000002")
            assert cached_files.keys() == full_files.keys() and cached_files, (cached_files.keys(), full_files.keys())
            for name, data in cached_files.items():
                assert data == full_files[name], name
        # resharded: each rank's box changes (Shard(0) -> Replicate)
        dts["rows"] = dts["rows"].redistribute(mesh, [Replicate()])
        ck.save_pytree(3, tree)
        assert cache.hits == 1
        check(ck, 3, full["rows"] + 100)
        opt.state[next(iter(model.parameters()))]["extra"] = torch.full((3,), float(rank == 0))
        ck.save_pytree(4, tree)
        assert cache.hits == 1
        assert torch.equal(ck.load_pytree(4)["optim"]["state"][0]["extra"], torch.full((3,), float(rank == 0)))
        ck.save_pytree(5, tree)
        assert cache.hits == 2
        check(ck, 5, full["rows"] + 100)
    return {"hits": cache.hits, "misses": cache.misses}


def launch(scenarios: list[str], world: int, d: str, env: dict | None = None, timeout: float = 240,
           script: str | None = None) -> list[dict]:
    """Run ``scenarios`` in ``world`` real processes (gloo); return each rank's results.

    ``script``: a worker of another test module that adds scenarios and then calls :func:`main`.
    """
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    e = dict(os.environ, **(env or {}))
    e.pop("ZEROSTALL_FAULTS", None)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(script or __file__), ",".join(scenarios), str(r),
                               str(world), str(port), d], env=e) for r in range(world)]
    try:
        for p in procs:
            p.wait(timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for r in range(world):
        with open(os.path.join(d, f"result-{r}.json")) as f:
            out.append(json.load(f))
    return out



def main() -> None:
    import datetime

    scenarios, rank, world, port, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    results: dict = {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    for scenario in scenarios.split(","):
        sd = os.path.join(d, scenario)
        os.makedirs(sd, exist_ok=True)
        t0 = time.monotonic()
        try:
            res = {"ok": True, **globals()[f"scenario_{scenario}"](rank, world, sd)}
        except BaseException as exc:
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
        res["seconds"] = time.monotonic() - t0
        results[scenario] = res
        with open(f"{d}/result-{rank}.json", "w") as f:
            json.dump(results, f)
        dist.barrier()
    try:
        dist.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    main()
