"""Per-leaf overhead of saves and loads for states of many small tensors.

    python benchmarks/many_leaves.py [--leaves 1000 5000 20000] [--saves 5] [--loads 3] [--dir /tmp]
                                     [--big 256M] [--profile save|load --profile-leaves 20000]

For each N: a state of N three-element float32 tensors, and (``mixed``) the same plus four large
tensors totalling ``--big`` bytes, and a ``torch.nn.Sequential`` of ``--model-layers`` tiny
``Linear`` layers with its ``AdamW`` after one step (saved as Stateful objects, so the
optimizer's tensors take the overlapped-staging path; loaded into themselves). Through a ``Checkpointer`` (a warm-up save first, so the
buffers are allocated and the layout planned), each save's call on the training thread
(``save_pytree_async`` returning: wall and CPU time of this process's threads during the call),
then its time to durable (``result()`` returning, from the call). Then the load of the last step
in place into a template of the same layout, and a load with no template (new tensors). The
table gives medians and microseconds per leaf. Nothing passes or fails.

``--profile save`` / ``--profile load`` runs cProfile over the save calls (or the in-place
loads) at ``--profile-leaves`` leaves and prints the top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import zerostall
from benchmarks.state import parse_size


def small_state(n: int, big: int = 0) -> dict[str, Any]:
    """``n`` float32 tensors of three elements in one dict (keys like an optimizer's), plus ``big``
    bytes split over four float32 tensors."""
    state: dict[str, Any] = {f"layer{i // 3}.p{i % 3}": torch.full((3,), float(i)) for i in range(n)}
    for j in range(4 if big else 0):
        state[f"big{j}"] = torch.randn(big // 4 // 4)
    return state


def model_state(layers: int) -> dict[str, Any]:
    """A model of ``layers`` tiny ``Linear`` layers, in blocks of 8 as a transformer's are, and its
    AdamW after one step: 2 parameters a layer, 3 optimizer leaves a parameter (exp_avg,
    exp_avg_sq, step): 8 leaves a layer. (Blocks: torch's ``Module.load_state_dict`` filters the
    state dict once per child, so one flat Sequential of 1,000 children costs it ~1 s by itself.)"""
    blocks = [torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(min(8, layers - b))])
              for b in range(0, layers, 8)]
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(1, 2)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


def template_of(state: dict[str, Any]) -> Any:
    if "optim" in state:
        return state  # Stateful objects: loaded into their own state dicts
    return {k: torch.empty_like(v) for k, v in state.items()}


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall and process CPU seconds of ``fn()`` (CPU: every thread of this process)."""
    c, t = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t, time.process_time() - c, out


def measure(n: int, big: int, saves: int, loads: int, base: str | None, layers: int = 0) -> dict[str, float]:
    state = model_state(layers) if layers else small_state(n, big)
    leaves = layers * 8 if layers else len(state)
    d = tempfile.mkdtemp(dir=base)
    try:
        with zerostall.Checkpointer(d, keep_last=2) as ck:
            ck.save_pytree(0, state)  # warm-up: plan, buffers, writer
            call, call_cpu, durable = [], [], []
            for step in range(1, saves + 1):
                t0 = time.perf_counter()
                wall, cpu, r = timed(lambda s=step: ck.save_pytree_async(s, state))
                r.result()
                durable.append(time.perf_counter() - t0)
                call.append(wall)
                call_cpu.append(cpu)
            tmpl = template_of(state)
            ck.load_pytree(saves, tmpl)  # warm-up: page cache, imports
            inp, inp_cpu, new, new_cpu = [], [], [], []
            for _ in range(loads):
                wall, cpu, _out = timed(lambda: ck.load_pytree(saves, tmpl))
                inp.append(wall)
                inp_cpu.append(cpu)
                wall, cpu, _out = timed(lambda: ck.load_pytree(saves))
                new.append(wall)
                new_cpu.append(cpu)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    med = statistics.median
    return {"leaves": leaves, "call": med(call), "call_cpu": med(call_cpu), "durable": med(durable),
            "load": med(inp), "load_cpu": med(inp_cpu), "new": med(new), "new_cpu": med(new_cpu)}


def profile(what: str, n: int, base: str | None, top: int) -> None:
    state = small_state(n)
    d = tempfile.mkdtemp(dir=base)
    prof = cProfile.Profile()
    try:
        with zerostall.Checkpointer(d, keep_last=2) as ck:
            ck.save_pytree(0, state)
            if what == "save":
                for step in range(1, 6):
                    prof.enable()
                    r = ck.save_pytree_async(step, state)
                    prof.disable()
                    r.result()
            else:
                tmpl = template_of(state)
                ck.load_pytree(0, tmpl)
                for _ in range(3):
                    prof.enable()
                    ck.load_pytree(0, tmpl)
                    prof.disable()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", type=int, nargs="+", default=[1000, 5000, 20000])
    ap.add_argument("--big", default="256M", help="bytes of large tensors in the mixed case (0: no mixed case)")
    ap.add_argument("--mixed-leaves", type=int, default=5000, help="small tensors in the mixed case")
    ap.add_argument("--model-layers", type=int, default=1000,
                    help="a model of this many Linear(2, 2) layers + AdamW (8 leaves a layer; 0: no such case)")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--profile", choices=["save", "load"], default=None)
    ap.add_argument("--profile-leaves", type=int, default=20000)
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.profile:
        profile(args.profile, args.profile_leaves, args.dir, args.top)
        return
    print(f"zerostall {zerostall.__file__}  loadavg {open('/proc/loadavg').read().split()[:3]}  "
          f"cpus {len(os.sched_getaffinity(0))}")
    cases = [(n, 0) for n in args.leaves]
    big = parse_size(args.big)
    if big:
        cases.append((args.mixed_leaves, big))
    hdr = (f"{'case':>16} {'leaves':>7} | {'call ms':>8} {'cpu ms':>7} {'us/leaf':>7} | {'durable ms':>10} | "
           f"{'load ms':>8} {'cpu ms':>7} {'us/leaf':>7} | {'new ms':>8} {'cpu ms':>7} {'us/leaf':>7}")
    print(hdr)
    print("-" * len(hdr))
    cases += [(-args.model_layers, 0)] if args.model_layers else []
    for n, b in cases:
        m = measure(max(n, 0), b, args.saves, args.loads, args.dir, layers=max(-n, 0))
        k = m["leaves"]
        name = f"AdamW {-n} layers" if n < 0 else f"{n} x 12B" + (f" + {b >> 20}MiB" if b else "")
        print(f"{name:>16} {k:7d} | {m['call'] * 1e3:8.1f} {m['call_cpu'] * 1e3:7.1f} {m['call'] / k * 1e6:7.2f} | "
              f"{m['durable'] * 1e3:10.1f} | {m['load'] * 1e3:8.1f} {m['load_cpu'] * 1e3:7.1f} "
              f"{m['load'] / k * 1e6:7.2f} | {m['new'] * 1e3:8.1f} {m['new_cpu'] * 1e3:7.1f} {m['new'] / k * 1e6:7.2f}",
              flush=True)


if __name__ == "__main__":
    main()
