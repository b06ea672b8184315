"""Hugging Face Trainer: how long each checkpoint stops the training loop, HF's own save vs zerostall's.

One process, one GPT-2-shaped model on CPU (default: about 1 GiB of parameters and AdamW state),
three runs of the same steps with fresh trainers, one after the other:

* ``none``: ``save_strategy="no"``: the step time without checkpoints (the baseline);
* ``hf``: the stock ``Trainer``, saving every ``--save-every`` steps (``checkpoint-N`` folders:
  ``model.safetensors``, ``optimizer.pt``, ...; synchronous);
* ``zerostall``: the same with ``ZerostallCheckpointing(trainer)`` (asynchronous, overlapped).

Per checkpoint, the **stall** is the time the training thread spent in ``Trainer._save_checkpoint``
plus the time the next ``optimizer.step()`` waited before running (zerostall's guard waits there
for the background copy of the parameters and optimizer state; measured between a global
optimizer pre-hook registered before zerostall's and the optimizer's own pre-hook, which torch
runs after every global one). **Training lost per save** is the save call plus how much longer
the step after it took (the guard's wait, and the writer process competing for the CPU) than the
median step of the same run that does not follow a save; the ``none`` run's median step is
reported beside it. On a shared machine whose load changes between runs, only the same-run
comparison means anything.
zerostall allocates its staging buffers once, after the first step (``prepare``), so that no
checkpoint pays for it; that one-off time is reported apart (``prepare_s``).
The **floor** is a memcpy of the same bytes (every parameter and optimizer-state tensor) into a
preallocated, faulted-in buffer, median of three, in the same process.

Usage: ``python benchmarks/hf_trainer.py --out result.json [--layers 9 --embd 768 --steps 10 --save-every 3]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import numpy as np
import torch
from datasets import Dataset
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from zerostall.integrations.transformers import ZerostallCheckpointing

SEQ = 32
BATCH = 1


class _Timer(TrainerCallback):
    """Per step: wall time from on_step_begin to on_step_end (forward, backward, optimizer step)."""

    def __init__(self) -> None:
        self.steps: dict[int, float] = {}
        self._t0 = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps[state.global_step] = time.perf_counter() - self._t0


class _GuardClock:
    """Time each optimizer step waited in global pre-hooks registered after this one (zerostall's guard)."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self._t = 0.0
        self._global = register_optimizer_step_pre_hook(self._first)
        self._local: Any = None

    def attach(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self._local = inner.register_step_pre_hook(self._last)

    def _first(self, *a: Any) -> None:
        self._t = time.perf_counter()

    def _last(self, *a: Any) -> None:
        self.waits.append(time.perf_counter() - self._t)

    def close(self) -> None:
        self._global.remove()
        if self._local is not None:
            self._local.remove()


class _Attach(TrainerCallback):
    def __init__(self, clock: _GuardClock) -> None:
        self.clock = clock

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
        self.clock.attach(optimizer)


def make_model(layers: int, embd: int, vocab: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=embd, n_layer=layers, n_head=max(1, embd // 64))
    return GPT2LMHeadModel(cfg)


def make_dataset(vocab: int, rows: int) -> Dataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def state_bytes(trainer: Any) -> int:
    n = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    for st in trainer.optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n


def memcpy_floor(trainer: Any, repeats: int = 3) -> float:
    """Median time to copy every parameter and optimizer-state tensor into a faulted-in buffer."""
    tensors = [p.detach() for p in trainer.model.parameters()]
    for st in trainer.optimizer.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    srcs = [t.contiguous().view(-1).view(torch.uint8).numpy() for t in tensors]
    buf = np.ones(sum(s.size for s in srcs), dtype=np.uint8)  # ones: every page faulted in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        off = 0
        for s in srcs:
            np.copyto(buf[off:off + s.size], s)
            off += s.size
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(mode: str, out: str, a: argparse.Namespace) -> dict[str, Any]:
    timer, clock = _Timer(), _GuardClock()
    args = TrainingArguments(
        output_dir=out, max_steps=a.steps, per_device_train_batch_size=BATCH, learning_rate=1e-4,
        save_strategy="no" if mode == "none" else "steps", save_steps=a.save_every, logging_steps=10**6,
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=make_model(a.layers, a.embd, a.vocab), args=args,
                      train_dataset=make_dataset(a.vocab, BATCH * a.steps), callbacks=[timer, _Attach(clock)])
    prepare_s: list[float] = []
    if mode == "zerostall":
        zs = ZerostallCheckpointing(trainer)
        prepare = zs._prepare_now

        def timed_prepare() -> None:  # once, after the first step: allocates and faults in the staging buffers
            t0 = time.perf_counter()
            prepare()
            if zs._prepared and not prepare_s:
                prepare_s.append(time.perf_counter() - t0)

        zs._prepare_now = timed_prepare  # type: ignore[method-assign]
    saves: list[tuple[int, float]] = []
    inner = trainer._save_checkpoint

    def timed(model: Any, trial: Any) -> None:
        t0 = time.perf_counter()
        inner(model, trial)
        saves.append((trainer.state.global_step, time.perf_counter() - t0))

    trainer._save_checkpoint = timed
    t0 = time.perf_counter()
    trainer.train()  # returns once every zerostall save has committed
    wall = time.perf_counter() - t0
    clock.close()
    result: dict[str, Any] = {"mode": mode, "wall_s": wall, "step_s": timer.steps, "saves": [],
                              "prepare_s": prepare_s[0] if prepare_s else None}
    for step, call_s in saves:
        guard = clock.waits[step] if step < len(clock.waits) else 0.0  # waits[i]: the step after global step i
        result["saves"].append({"step": step, "call_s": call_s, "guard_s": guard, "stall_s": call_s + guard})
    result["state_bytes"] = state_bytes(trainer)
    result["floor_memcpy_s"] = memcpy_floor(trainer)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the JSON result to write")
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the runs write (default: a temporary directory)")
    a = p.parse_args()
    hf_logging.set_verbosity_error()
    root = a.dir or tempfile.mkdtemp(prefix="zs-hf-bench-")
    try:
        runs = {}
        for m in ("none", "hf", "zerostall"):
            runs[m] = run(m, os.path.join(root, m), a)
            gc.collect()  # the previous run's model and optimizer state (the trainer is in a cycle)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    base = statistics.median(runs["none"]["step_s"].values())
    for m in ("hf", "zerostall"):
        steps = runs[m]["step_s"]
        after = {s["step"] + 1 for s in runs[m]["saves"]}
        quiet = [t for k, t in steps.items() if k not in after and k != 1]  # step 1: warm-up (and prepare)
        runs[m]["quiet_step_s"] = own = statistics.median(quiet) if quiet else base
        for s in runs[m]["saves"]:
            nxt = steps.get(s["step"] + 1)
            s["lost_s"] = s["call_s"] + (nxt - own if nxt is not None else s["guard_s"])
    floor = statistics.median(r["floor_memcpy_s"] for r in runs.values())

    def med(m: str, key: str, skip_first: bool = False) -> float:
        vals = [s[key] for s in runs[m]["saves"]][1 if skip_first else 0:]
        return statistics.median(vals) if vals else float("nan")

    summary = {
        "state_bytes": runs["hf"]["state_bytes"], "baseline_step_s": base, "floor_memcpy_s": floor,
        "hf_stall_s": med("hf", "stall_s"), "zerostall_stall_s": med("zerostall", "stall_s"),
        "zerostall_stall_after_first_s": med("zerostall", "stall_s", skip_first=True),
        "hf_lost_s": med("hf", "lost_s"), "zerostall_lost_s": med("zerostall", "lost_s"),
    }
    summary["stall_ratio"] = summary["zerostall_stall_s"] / summary["hf_stall_s"]
    summary["target_met"] = summary["stall_ratio"] <= 1 / 20
    result = {"benchmark": "hf_trainer", "args": vars(a), "summary": summary, "runs": runs,
              "torch_threads": torch.get_num_threads()}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    gib = summary["state_bytes"] / 2**30
    print(f"HF Trainer checkpoint stall, {gib:.2f} GiB of parameters + AdamW state, {a.steps} steps, "
          f"save every {a.save_every}; median step without saves {base:.3f} s; memcpy floor {floor:.3f} s")
    print(f"{'':12} {'stall/save (median)':>20} {'x floor':>8} {'lost/save (median)':>20} {'stalls (s)':>30}")
    for m in ("hf", "zerostall"):
        stalls = ", ".join(f"{s['stall_s']:.3f}" for s in runs[m]["saves"])
        print(f"{m:12} {med(m, 'stall_s'):20.3f} {med(m, 'stall_s') / floor:8.2f} {med(m, 'lost_s'):20.3f} "
              f"{stalls:>30}")
    print(f"zerostall's prepare() after the first step (once, not a checkpoint): {runs['zerostall']['prepare_s']} s")
    print(f"zerostall / HF stall: {summary['stall_ratio']:.4f} (target <= 0.05: "
          f"{'met' if summary['target_met'] else 'NOT met'}); result in {a.out}")


if __name__ == "__main__":
    main()
