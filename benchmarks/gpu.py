"""Checkpointing a bf16 transformer training loop on one GPU: overlapped vs blocking staging vs peers.

    python benchmarks/gpu.py [--layers 26] [--d 1024] [--batch 8] [--seq 2048] [--saves 5]
                             [--torn-saves 50] [--dir /tmp/zsgpu] [--systems ...] [--out FILE]

(``make bench-gpu``.) Exits with a message and status 0 where no CUDA device is present.

The trainer: a GPT-like decoder (fp32 master weights, ``torch.autocast`` bf16, fused AdamW);
with the defaults about 360 M parameters, so parameters plus AdamW moments are >= 4 GB. Each
iteration is forward, backward, ``optimizer.step()``, then ``torch.cuda.synchronize()`` so that
an iteration's wall time is its GPU time.

Systems (``--systems``, comma-separated):

* ``floor_d2h``: the state copied device-to-host into page-locked buffers (one ``copy_`` per
  tensor, ``non_blocking``, one synchronize): what a blocking stager cannot beat;
* ``floor_disk``: the same bytes written from host memory to a file in ``--dir`` and ``fsync``ed;
* ``zerostall_overlap``: ``Checkpointer.save_pytree_async`` with ``SaveOptions(staging="overlap")``
  (default): parameters and optimizer state are copied on a side stream behind the call;
  zerostall's guard makes the next ``optimizer.step()``'s kernels wait for that copy;
* ``zerostall_overlap_inline``: the same with the CUDA copies enqueued in the call, on the
  training thread (``ZEROSTALL_CUDA_ENQUEUE_THREAD=0``), not by zerostall's enqueuer thread;
* ``zerostall_blocking``: the same with ``staging="blocking"``;
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` with one persistent ``DefaultStager``
  (pinned memory, async staging, non-blocking copies) and, as torchtitan does, a wait on
  ``staging_completion`` right before the next ``optimizer.step()``;
* ``torch_save``: ``torch.save`` of both state dicts, ``fsync``ed, on the training thread.

Per save (between ``--saves`` saves, every ``--every`` iterations), medians reported:

* ``host_blocked_s``: time the training thread spent in the save call plus any wait it needed
  before the next ``step()`` (DCP's ``staging_completion``) or inside it (zerostall's guard:
  ``optimizer.step()``'s host time over its baseline median, ``step_wait_s``; on CUDA the guard
  waits on the host only until its enqueuer thread has enqueued the copies);
* ``step_increase_s``: the iterations from the save call until the copy is in host memory, their
  wall time minus as many baseline iterations;
* ``durable_s``: from the call until the checkpoint is committed.

Torn check (``--torn-saves``, per zerostall system and DCP): the state is cloned on the GPU just
before the call, ``step()`` runs right after the call, and the committed checkpoint is loaded
and compared bit for bit with the clone. Prints a table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

#: "cuda"; "cpu" only for ``--cpu-dry-run`` (runs this script's own logic on a tiny model, no figures)
DEV = "cuda"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _pin() -> bool:
    return DEV == "cuda"


SYSTEMS = ["floor_d2h", "floor_disk", "zerostall_overlap", "zerostall_overlap_inline", "zerostall_blocking", "dcp_async",
           "torch_save"]
TORN_SYSTEMS = ["zerostall_overlap", "zerostall_blocking", "dcp_async"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.model = GPT(args.vocab, args.d, args.layers, args.seq).to(DEV)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.x = torch.randint(0, args.vocab, (args.batch, args.seq), device=DEV)
        self.y = torch.randint(0, args.vocab, (args.batch, args.seq), device=DEV)
        self.vocab = args.vocab
        #: called right before optimizer.step() (DCP's staging wait goes here)
        self.before_step: Any = None
        #: host seconds the last ``optimizer.step()`` call took (see ``step_wait_s`` of measure_system)
        self.step_host_s = 0.0
        #: its median over the baseline iterations (set by main)
        self.step_host_base_s = 0.0

    def forward_backward(self) -> None:
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = F.cross_entropy(self.model(self.x).view(-1, self.vocab).float(), self.y.view(-1))
        loss.backward()

    def step(self) -> float:
        """One iteration; returns the host seconds spent waiting in ``before_step``."""
        self.forward_backward()
        waited = 0.0
        if self.before_step is not None:
            t = time.perf_counter()
            self.before_step()
            waited = time.perf_counter() - t
            self.before_step = None
        t = time.perf_counter()
        self.opt.step()  # host time: launching the step, plus any wait of zerostall's guard
        self.step_host_s = time.perf_counter() - t
        self.opt.zero_grad(set_to_none=True)
        _sync()
        return waited

    def tree(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}

    def tensors(self) -> list[torch.Tensor]:
        out = [p.detach() for p in self.model.parameters()]
        for st in self.opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def state_dicts(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


def timed_iterations(trainer: Trainer, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        trainer.step()
        out.append(time.perf_counter() - t)
    return out


# -- floors -------------------------------------------------------------------------------------

def floor_d2h(trainer: Trainer, repeats: int) -> dict[str, Any]:
    src = trainer.tensors()
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=_pin()) for t in src]
    times = []
    for _ in range(repeats + 1):
        _sync()
        t = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        _sync()
        times.append(time.perf_counter() - t)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    med = statistics.median(times[1:])
    return {"seconds": med, "gbps": nbytes / med / 1e9, "samples": times[1:]}


def floor_disk(trainer: Trainer, directory: Path, repeats: int) -> dict[str, Any]:
    nbytes = sum(t.numel() * t.element_size() for t in trainer.tensors())
    chunk = 64 << 20
    buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=_pin()).numpy()
    times = []
    for i in range(repeats):
        path = directory / f"floor-{i}.bin"
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, memoryview(buf)[: min(chunk, left)])
            os.fsync(fd)
        finally:
            os.close(fd)
        times.append(time.perf_counter() - t)
        path.unlink()
    med = statistics.median(times)
    return {"seconds": med, "gbps": nbytes / med / 1e9, "samples": times}


# -- systems ------------------------------------------------------------------------------------

class Zerostall:
    def __init__(self, directory: Path, staging: str, enqueue_thread: bool = True) -> None:
        import zerostall
        import zerostall.stage.overlap as overlap
        from zerostall.options import DistributedOptions

        # zerostall_overlap_inline: the CUDA copies enqueued in the call, on the training thread
        # (ZEROSTALL_CUDA_ENQUEUE_THREAD=0), for an A/B in one run
        overlap.CUDA_ENQUEUE_THREAD = enqueue_thread

        self.zs = zerostall
        opts = zerostall.SaveOptions(staging=staging, distributed=DistributedOptions(enabled=False))
        self.ckpt = zerostall.Checkpointer(directory, keep_last=2, save_options=opts)
        self.step = 0

    def prepare(self, trainer: Trainer) -> None:
        self.ckpt.prepare(tree=trainer.tree())

    def save(self, trainer: Trainer) -> tuple[Any, Any, Any]:
        """Start a save; returns (is staged?, wait until durable, load the checkpoint)."""
        self.step += 1
        step = self.step
        r = self.ckpt.save_pytree_async(step, trainer.tree())
        return r.staged, r.result, lambda: self.ckpt.load_pytree(step)

    def close(self) -> None:
        self.ckpt.close()


class Dcp:
    def __init__(self, directory: Path) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if not dist.is_initialized():
            store = tempfile.NamedTemporaryFile(prefix="zsgpu-pg-", delete=False).name
            os.unlink(store)
            dist.init_process_group("cpu:gloo,cuda:nccl" if DEV == "cuda" else "gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
        self.dcp = dcp
        self.dir = directory
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=_pin(), use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=_pin()))
        # torch 2.11's DefaultStager._stage() closes its StateDictStager after every stage (read in
        # 2.11's staging.py): that drops the cached pinned storages and clears the copy dispatch
        # table, so the next save fails with KeyError: <class 'type'> (and a working one would
        # allocate its pinned buffers again at every save). 2.13 keeps both for the stager's life,
        # which is the persistent stager torchtitan's recipe relies on: that is what is measured.
        inner = getattr(self.stager, "_state_dict_stager", None)
        self._inner_close = inner.close if inner is not None else None
        if inner is not None:
            inner.close = lambda: None
        self.n = 0

    def prepare(self, trainer: Trainer) -> None:
        self.save(trainer)[1]()  # the stager allocates its pinned buffers at the first save

    def save(self, trainer: Trainer) -> tuple[Any, Any, Any]:
        self.n += 1
        path = str(self.dir / f"dcp-{self.n}")
        # keep the last two, as the zerostall systems do (keep_last=2): 4.8 GB saves fill a small disk
        shutil.rmtree(self.dir / f"dcp-{self.n - 2}", ignore_errors=True)
        sd = trainer.state_dicts()
        resp = self.dcp.async_save(sd, checkpoint_id=path, async_stager=self.stager)
        staging = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        if staging is not None:
            trainer.before_step = staging.result  # torchtitan's recipe: wait before optimizer.step()

        def staged() -> bool:
            return staging is None or staging.done()

        def load() -> Any:
            template = {"model": {k: torch.empty_like(v, device="cpu") for k, v in sd["model"].items()},
                        "optim": _cpu_like(sd["optim"])}
            self.dcp.load(template, checkpoint_id=path)
            return template

        return staged, upload.result, load

    def close(self) -> None:
        if self._inner_close is not None:
            self._inner_close()
        self.stager.close()


def _cpu_like(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree, device="cpu")
    if isinstance(tree, dict):
        return {k: _cpu_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cpu_like(v) for v in tree]
    return tree


class TorchSave:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.n = 0

    def prepare(self, trainer: Trainer) -> None:
        return None

    def save(self, trainer: Trainer) -> tuple[Any, Any, Any]:
        self.n += 1
        path = self.dir / f"torch-{self.n}.pt"
        (self.dir / f"torch-{self.n - 2}.pt").unlink(missing_ok=True)
        with open(path, "wb") as f:
            torch.save(trainer.state_dicts(), f)
            f.flush()
            os.fsync(f.fileno())
        return (lambda: True), (lambda: None), (lambda: torch.load(path, map_location="cpu"))

    def close(self) -> None:
        return None


def make_system(name: str, directory: Path) -> Any:
    d = directory / name
    d.mkdir(parents=True, exist_ok=True)
    if name == "zerostall_overlap":
        return Zerostall(d, "overlap")
    if name == "zerostall_blocking":
        return Zerostall(d, "blocking")
    if name == "zerostall_overlap_inline":
        return Zerostall(d, "overlap", enqueue_thread=False)
    if name == "dcp_async":
        return Dcp(d)
    if name == "torch_save":
        return TorchSave(d)
    raise ValueError(name)


def measure_system(name: str, trainer: Trainer, directory: Path, saves: int, every: int, t0: float) -> dict[str, Any]:
    system = make_system(name, directory)
    system.prepare(trainer)
    rows = []
    for i in range(saves):
        timed_iterations(trainer, every)
        start = time.perf_counter()
        staged, durable, _ = system.save(trainer)
        call_s = time.perf_counter() - start
        waited = 0.0
        step_wait = 0.0
        in_flight = []
        while True:
            was_staged = staged()
            t = time.perf_counter()
            waited += trainer.step()
            in_flight.append(time.perf_counter() - t)
            step_wait += max(0.0, trainer.step_host_s - trainer.step_host_base_s)
            if was_staged or staged():
                break
        durable()
        durable_s = time.perf_counter() - start
        row = {"call_s": call_s, "host_blocked_s": call_s + waited + step_wait, "step_wait_s": step_wait,
               "step_increase_s": sum(in_flight) - len(in_flight) * t0, "iterations_in_flight": len(in_flight),
               "durable_s": durable_s}
        rows.append(row)
        log(f"{name} save {i + 1}: blocked {row['host_blocked_s'] * 1e3:.1f} ms (call {call_s * 1e3:.1f}, "
            f"in step() {step_wait * 1e3:.1f}), step +{row['step_increase_s'] * 1e3:.1f} ms "
            f"over {len(in_flight)} iterations, durable {durable_s:.2f} s")
    system.close()
    shutil.rmtree(directory / name, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("host_blocked_s", "call_s", "step_wait_s", "step_increase_s", "durable_s")}
    return {"system": name, "saves": rows, "median": med}


def torn_check(name: str, trainer: Trainer, directory: Path, saves: int) -> dict[str, Any]:
    """Clone, save, step at once, then compare the committed checkpoint with the clone."""
    system = make_system(name, directory / "torn")
    system.prepare(trainer)
    torn = 0
    for i in range(saves):
        snap_model = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        _, durable, load = system.save(trainer)
        trainer.step()  # mutate right after the call
        durable()
        got = load()
        model = got["model"]
        bad = [k for k, v in snap_model.items() if not torch.equal(model[k].to(v.device), v)]
        if bad:
            torn += 1
            log(f"{name} torn save {i + 1}: {len(bad)} tensors differ, e.g. {bad[0]}")
    system.close()
    shutil.rmtree(directory / "torn" / name, ignore_errors=True)
    return {"system": name, "saves": saves, "torn": torn}


def model_args(ap: argparse.ArgumentParser) -> None:
    """The trainer's size options (this script's and ``gpu_restore.py``'s)."""
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(ap)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--every", type=int, default=3, help="iterations between saves")
    ap.add_argument("--torn-saves", type=int, default=50)
    ap.add_argument("--dir", default="/tmp/zsgpu")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--torn-systems", default=",".join(TORN_SYSTEMS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run this script's logic on CPU with a tiny model (no figures): checks it before a GPU is lent")
    args = ap.parse_args(argv)
    global DEV
    if args.cpu_dry_run:
        DEV = "cpu"
        args.layers, args.d, args.vocab, args.batch, args.seq = 2, 128, 1000, 2, 64
        args.saves, args.torn_saves = 2, 3
    elif not torch.cuda.is_available():
        print("bench-gpu: no CUDA device on this machine; nothing measured. Run it where "
              "torch.cuda.is_available() is true (one GPU, >= 16 GB).")
        return 0
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(args)
    timed_iterations(trainer, 3)  # AdamW state, cuBLAS handles, autotuning
    nbytes = sum(t.numel() * t.element_size() for t in trainer.tensors())
    base = []
    step_host = []
    for _ in range(10):
        base += timed_iterations(trainer, 1)
        step_host.append(trainer.step_host_s)
    t0 = statistics.median(base)
    trainer.step_host_base_s = statistics.median(step_host)
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run: no figures)"
    log(f"{device}: state {nbytes / 1e9:.2f} GB, iteration {t0 * 1e3:.1f} ms")
    out: dict[str, Any] = {"device": device, "state_bytes": nbytes, "iteration_s": t0,
                           "args": vars(args), "systems": {}, "torn": {}}
    systems = [s for s in args.systems.split(",") if s]
    if "floor_d2h" in systems:
        out["systems"]["floor_d2h"] = floor_d2h(trainer, args.saves)
    if "floor_disk" in systems:
        out["systems"]["floor_disk"] = floor_disk(trainer, directory, min(args.saves, 3))
    for name in systems:
        if name.startswith("floor"):
            continue
        try:
            out["systems"][name] = measure_system(name, trainer, directory, args.saves, args.every, t0)
        except Exception as exc:
            log(f"{name} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            out["systems"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    for name in (s for s in args.torn_systems.split(",") if s and args.torn_saves > 0):
        try:
            out["torn"][name] = torn_check(name, trainer, directory, args.torn_saves)
        except Exception as exc:
            log(f"torn check {name} failed:\n{traceback.format_exc()}")
            out["torn"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    d2h = out["systems"].get("floor_d2h", {}).get("seconds", math.nan)
    print(f"state {nbytes / 1e9:.2f} GB on {out['device']}; iteration {t0 * 1e3:.1f} ms; pinned D2H floor "
          f"{d2h * 1e3:.1f} ms")
    print(f"{'system':>24} {'blocked ms':>11} {'x D2H':>7} {'(call':>7} {'step())':>8} {'step+ ms':>9} {'x D2H':>7} "
          f"{'durable s':>10} {'torn':>8}")
    for name, res in out["systems"].items():
        if "median" not in res:
            continue
        m = res["median"]
        torn = out["torn"].get(name, {})
        torn_s = f"{torn['torn']}/{torn['saves']}" if "torn" in torn else "-"
        print(f"{name:>24} {m['host_blocked_s'] * 1e3:11.1f} {m['host_blocked_s'] / d2h:7.2f} "
              f"{m['call_s'] * 1e3:7.1f} {m['step_wait_s'] * 1e3:8.1f} "
              f"{m['step_increase_s'] * 1e3:9.1f} {m['step_increase_s'] / d2h:7.2f} {m['durable_s']:10.2f} {torn_s:>8}")
    for name, res in out["torn"].items():
        print(f"torn check {name}: " + (f"{res['torn']} torn of {res['saves']}" if "torn" in res else res["error"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
