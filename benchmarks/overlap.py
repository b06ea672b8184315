"""Overlapped staging on CPU: what a save costs a trainer whose optimizer owns the checkpointed state.

    python -m benchmarks.overlap [--size 1G] [--saves 5] [--dir /tmp/zsov]
                                 [--systems overlap,overlap_idle,blocking] [--accum 1] [--threads 2]

The trainer is the small transformer of ``benchmarks.dip`` (its own forward, backward and AdamW
step each iteration). The checkpointed state is the synthetic state of ``--size``
(``benchmarks.state``) turned into what overlapped staging needs: its model tensors are the
parameters of a second AdamW whose ``state`` holds the moments, and that optimizer's
``step()`` runs every iteration (it has no gradients, so the step changes nothing and costs
microseconds, but zerostall's guard runs in it exactly as in a real step). ``--accum K`` runs K
of the small trainer's iterations before each step of the big optimizer (gradient accumulation):
the small trainer computes far less than a model whose state is ``--size`` would, so at 4 GiB one
of its iterations (about 160 ms) is shorter than the copy (about 400 ms), which then cannot be
hidden by any overlap; ``--accum`` gives the copy the forward/backward time a real model of that
size has (issue 14 states its GPU target for that case).

Systems (``overlap``: the default, ``stage.overlap.COPIER_POLICY`` as shipped (``normal``);
``overlap_idle`` / ``overlap_normal`` / ``overlap_auto`` / ``overlap_yield``: that copier policy forced;
``blocking``: ``SaveOptions(staging="blocking")``) take turns in one Checkpointer, one save each
per round, so they are paired against the same machine; per save:

* ``blocked_s``: the training thread's time blocked by the save: the call itself plus every
  guard wait (the extra time of the big optimizer's steps until the copy is done);
* ``memcpy_s``: a paired single-pass copy of the same bytes into warm buffers on the training
  thread right before the save (``torch.Tensor.copy_``), so ``blocked_s / memcpy_s`` is the
  target ratio (<= 0.25 for overlapped staging);
* ``iter_ratio_in_flight``: mean iteration time while the copy is in flight over the baseline's
  (1.0: the background copy does not slow training);
* ``lost_s``: training work lost from the call until the save is durable (``window -
  iterations x baseline iteration``), which also counts the writer's CPU;
* ``staging_lost_s``: the part lost to staging alone, up to the end of the iteration in which
  the copy finished (blocking: the call). The persist after it is the same for every system, so
  this compares them without the writer's and the VM host's noise.

The machine's other users make single numbers noisy; run ``--saves`` of at least 5 and compare
systems within one run: with ``blocking`` among the systems, each other system's ``lost_s``
minus blocking's in the same round is reported too (median and range). Prints one JSON line (``measure.emit``) and a table on stderr.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks import measure  # noqa: E402
from benchmarks.dip import Trainer  # noqa: E402
from benchmarks.state import build_state, format_size, parse_size  # noqa: E402

SYSTEMS = ["overlap", "overlap_idle", "blocking"]
BASE_ITERS = 8
POST_S = 0.5


def owned_state(size: int) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    """The synthetic state with its tensors owned by an AdamW (parameters + moments)."""
    raw = build_state(size)
    params = {name: torch.nn.Parameter(t, requires_grad=True) for name, t in raw["model"].items()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4)
    for name, p in params.items():
        m = raw["optim"]["state"][name]
        opt.state[p] = {"step": torch.tensor(1000.0), "exp_avg": m["exp_avg"], "exp_avg_sq": m["exp_avg_sq"]}
    return {"model": params, "optim": opt}, opt


#: forward/backward passes of the small trainer per step of the big optimizer (``--accum``)
ACCUM = 1


def _iteration(trainer: Trainer, big: torch.optim.Optimizer) -> tuple[float, float]:
    """One training iteration; returns (its duration, the big optimizer's step duration)."""
    t = time.perf_counter()
    for _ in range(ACCUM):
        trainer.step()
    s = time.perf_counter()
    big.step()
    e = time.perf_counter()
    return e - t, e - s


def _default_policy() -> str:
    from zerostall.stage import overlap

    return overlap.COPIER_POLICY


_DEFAULT_POLICY = _default_policy()


def _configure(name: str, ckpt: Any) -> None:
    """Make the next save of ``ckpt`` one of system ``name`` (interleaved in one Checkpointer)."""
    import dataclasses

    import zerostall
    from zerostall.stage import overlap

    overlap.COPIER_POLICY = {"overlap_idle": "idle", "overlap_normal": "normal",  # type: ignore[assignment]
                             "overlap_auto": "auto", "overlap_yield": "yield"}.get(name, _DEFAULT_POLICY)
    staging = "blocking" if name == "blocking" else "overlap"
    engine = ckpt._engine  # the benchmark switches staging per save so the systems are paired
    engine.options = dataclasses.replace(engine.options, staging=zerostall.SaveOptions(staging=staging).staging)


def one_save(name: str, i: int, ckpt: Any, trainer: Trainer, state: dict[str, Any], big: torch.optim.Optimizer,
             flat: list[torch.Tensor], scratch: list[torch.Tensor]) -> dict[str, Any]:
    """One save of system ``name``: baseline iterations, paired memcpy, the save, training until durable."""
    _configure(name, ckpt)
    base = [_iteration(trainer, big) for _ in range(BASE_ITERS)]
    t0 = statistics.fmean(b[0] for b in base)
    step0 = statistics.median(b[1] for b in base)
    m = time.perf_counter()
    for d, s in zip(scratch, flat):
        d.copy_(s)
    memcpy_s = time.perf_counter() - m
    start = time.perf_counter()
    r = ckpt.save_pytree_async(i, state)
    call_s = time.perf_counter() - start
    in_flight: list[float] = []
    guard_s = 0.0
    iters = 0
    # training lost to staging alone: up to the end of the iteration in which the copy finished
    # (blocking: the call). The persist that follows is the same for every system, so this part
    # compares the systems without the writer's (and the host's) noise.
    staged_lost = call_s if r.staged() else None
    while not r.done():
        was_staged = r.staged()
        it, st = _iteration(trainer, big)
        iters += 1
        if not was_staged:
            in_flight.append(it)
            guard_s += max(0.0, st - step0)
            if staged_lost is None and r.staged():
                staged_lost = (time.perf_counter() - start) - iters * t0
    durable = time.perf_counter()
    while time.perf_counter() - durable < POST_S:
        _iteration(trainer, big)
        iters += 1
    window = time.perf_counter() - start
    r.result()
    row = {
        "t0_s": t0, "memcpy_s": memcpy_s, "call_s": call_s, "guard_s": guard_s,
        "blocked_s": call_s + guard_s, "blocked_over_memcpy": (call_s + guard_s) / memcpy_s,
        "staged_s": r.stats.staged_s, "durable_s": durable - start,
        "iters_in_flight": len(in_flight),
        "iter_ratio_in_flight": (statistics.fmean(in_flight) / t0) if in_flight else None,
        "lost_s": window - iters * t0,
        "staging_lost_s": staged_lost,
    }
    measure.log(f"{name} save {i}: blocked {row['blocked_s'] * 1e3:.1f} ms (call {call_s * 1e3:.1f} + "
                f"guard {guard_s * 1e3:.1f}) = {row['blocked_over_memcpy']:.2f}x memcpy "
                f"({memcpy_s * 1e3:.0f} ms); staged after {row['staged_s'] or 0:.3f} s; iterations in "
                f"flight {len(in_flight)} at {row['iter_ratio_in_flight'] or float('nan'):.2f}x; "
                f"lost {row['lost_s']:.3f} s (to staging {staged_lost if staged_lost is not None else float('nan'):.3f} s)")
    return row


def run_systems(names: list[str], trainer: Trainer, state: dict[str, Any], big: torch.optim.Optimizer, saves: int,
                directory: Path) -> list[dict[str, Any]]:
    """``saves`` rounds; each round saves once per system, in turn, so every system sees the same
    machine (the systems' medians and the per-round differences are paired)."""
    import zerostall

    flat = [t for t in state["model"].values()] + [v for st in big.state.values() for v in st.values()]
    scratch = [torch.empty_like(t) for t in flat]  # warm destination of the paired memcpy
    for d, s in zip(scratch, flat):
        d.copy_(s)
    rows: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    shutil.rmtree(directory / "run", ignore_errors=True)  # this benchmark's own scratch from an earlier run
    step = 0
    with zerostall.Checkpointer(directory / "run", keep_last=1) as ckpt:
        ckpt.prepare(tree=state)
        for name in names:  # first save of each kind: buffers, writer, ownership learned
            _configure(name, ckpt)
            ckpt.save_pytree(step, state)
            step += 1
        for _ in range(saves):
            for name in names:
                rows[name].append(one_save(name, step, ckpt, trainer, state, big, flat, scratch))
                step += 1
    shutil.rmtree(directory / "run", ignore_errors=True)
    out = []
    for name in names:
        rs = rows[name]
        med = {k: statistics.median(r[k] for r in rs if r[k] is not None)
               for k in ("blocked_s", "memcpy_s", "blocked_over_memcpy", "lost_s", "staging_lost_s", "staged_s",
                         "iter_ratio_in_flight")
               if any(r[k] is not None for r in rs)}
        out.append({"system": name, "saves": rs, "median": med})
    if "blocking" in rows:
        for name in names:
            if name == "blocking":
                continue
            for key in ("lost_s", "staging_lost_s"):
                diffs = [a[key] - b[key] for a, b in zip(rows[name], rows["blocking"])
                         if a[key] is not None and b[key] is not None]
                if diffs:
                    out[names.index(name)][f"{key}_minus_blocking"] = {
                        "per_round": diffs, "median": statistics.median(diffs), "min": min(diffs), "max": max(diffs)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/zsov")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--accum", type=int, default=1,
                    help="forward/backward passes per step of the checkpointed state's optimizer (gradient "
                         "accumulation): the time a real model of that state's size would compute between steps")
    ap.add_argument("--threads", type=int, default=2,
                    help="the trainer's torch intra-op threads (2: every core of this machine; 1 leaves the "
                         "copier a core of its own, as a GPU trainer or one waiting on its data would)")
    args = ap.parse_args(argv)
    global ACCUM
    ACCUM = max(1, args.accum)
    torch.set_num_threads(max(1, args.threads))
    size = parse_size(args.size)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    trainer = Trainer()
    for _ in range(5):
        trainer.step()
    state, big = owned_state(size)
    measure.log(f"state {format_size(size)}; trainer on {torch.get_num_threads()} thread(s); trainer iteration ({ACCUM} forward/backward per step) "
                f"~{statistics.fmean(_iteration(trainer, big)[0] for _ in range(5)) * 1e3:.0f} ms")
    results = run_systems([n for n in args.systems.split(",") if n], trainer, state, big, args.saves, directory)
    for res in results:
        med = res["median"]
        line = (f"{res['system']:>15}: blocked {med['blocked_s'] * 1e3:7.1f} ms = {med['blocked_over_memcpy']:.2f}x "
                f"memcpy, lost {med['lost_s']:.3f} s per save (to staging {med.get('staging_lost_s', float('nan')):.3f} s), "
                f"iteration in flight {med.get('iter_ratio_in_flight', float('nan')):.2f}x (medians)")
        for key, what in (("lost_s", "lost"), ("staging_lost_s", "lost to staging")):
            d = res.get(f"{key}_minus_blocking")
            if d:
                line += f"; {what} minus blocking's, paired: median {d['median']:+.3f} s ({d['min']:+.3f} .. {d['max']:+.3f})"
        measure.log(line)
    measure.emit({"size": size, "results": results})


if __name__ == "__main__":
    main()
