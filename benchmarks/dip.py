"""The training dip: how much training work one checkpoint save costs a CPU-bound trainer.

A real small model (embedding, 4 transformer encoder layers of width 256, vocabulary 4096,
batch 4 x 128 tokens; forward, backward, AdamW step: ~80 ms per iteration with torch on two
threads on the development machine) trains in the measuring thread. The checkpoint is the
synthetic state of the chosen size (``benchmarks.state``), standing in for a large model whose
compute we cannot afford on two cores; what matters is that the trainer needs the CPU while
the checkpointer persists.

One window per repeat:

1. baseline: train ``BASE_S`` seconds without checkpointing right before and right after every
   window; ``t0`` = mean iteration time of both (bracketing the window, so that slow drift from
   other users of the shared machine cancels; bursts do not, hence the ``none`` control);
2. window: train ``PRE_S`` seconds, call ``save`` between two iterations (the stall is the time
   that call blocks), keep training while the checkpoint persists, and stop at the first
   iteration boundary ``POST_S`` seconds after it is durable (a waiter thread blocks on the
   save's completion, so polling costs the trainer nothing);
3. ``work lost = window wall time - iterations completed x t0``: the stall plus the iterations
   the background persist cost by slowing the trainer down.

The window therefore always spans the whole save; ``none`` runs a fixed ``PRE_S + 2 + POST_S``
second window with no save, and its "work lost" is the noise floor of the method.
A system's first save (buffer allocation, process start) happens before the windows, untimed.
Before every window the trainer waits (up to 5 s) until other users of the shared machine
leave it nearly idle, and the cores they used during the window are recorded with it.

``zerostall_memtier10`` is a ``Checkpointer`` with ``MemoryTier(persist_interval_steps=10)``: its
windows alternate between a memory-only save and a persisted one, and the run ends with both
kinds apart and the loss per save over a 10-save cycle (see :class:`ZerostallMemTier`).

Run alone: ``python -m benchmarks.dip --system zerostall --size 256M --dir /tmp/zsb``.
"""

from __future__ import annotations

import statistics
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from benchmarks import measure
from benchmarks.floors import child_args
from benchmarks.state import build_state, parse_size

BASE_S = 2.5
PRE_S = 1.0
POST_S = 1.0
NONE_WINDOW_S = PRE_S + 2.0 + POST_S

#: Any measured system can run here: the trainer is torch, but the checkpoint is the synthetic
#: state, handed to each system in its own array type (``System.native``: jax arrays for Orbax),
#: so a jax checkpointer competes with the torch trainer for the cores like any other.
SYSTEMS = ["none", "torch_save", "dcp_async", "dcp_async_stager", "orbax_save", "orbax_async", "zerostall",
           "zerostall_idle", "zerostall_memtier10"]
#: zerostall_memtier10 persists every MEMTIER_K-th step (the memory tier: a tenth of the persist per save)
MEMTIER_K = 10
DEFAULT = ["none", "torch_save", "dcp_async_stager", "zerostall"]


class Trainer:
    """A small transformer LM trained on a fixed random batch (the values do not matter)."""

    def __init__(self, d: int = 256, layers: int = 4, vocab: int = 4096, batch: int = 4, seq: int = 128):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.model = nn.Sequential(nn.Embedding(vocab, d), nn.TransformerEncoder(layer, layers), nn.Linear(d, vocab))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randint(0, vocab, (batch, seq))
        self.y = torch.randint(0, vocab, (batch, seq))
        self.vocab = vocab

    def step(self) -> None:
        out = self.model(self.x)
        loss = nn.functional.cross_entropy(out.view(-1, self.vocab), self.y.view(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def run_for(self, seconds: float) -> list[float]:
        """Train until ``seconds`` have passed (checked at iteration boundaries); iteration times."""
        times = []
        start = measure.now()
        while measure.now() - start < seconds:
            t = measure.now()
            self.step()
            times.append(measure.now() - t)
        return times


class ZerostallMemTier(measure.System):
    """A ``Checkpointer`` with ``MemoryTier(persist_interval_steps=10)``: every save commits to the
    host's memory tier, every 10th step also to storage.

    The windows alternate between a memory-only save and a persisted one (steps 11, 20, 21, 30,
    ...), so both kinds are measured in one run; a job's loss per save over a cycle of ten saves
    is ``(9 x memory-only + 1 x persisted) / 10`` (printed at the end). Retention keeps the newest
    persisted step (``keep_last=1``: deleting the previous one is part of a persisted save).
    """

    name = "zerostall_memtier10"
    in_place = True
    warmup_saves = 2  # one of each kind before the windows: buffers, writer, keeper

    def setup(self, directory: Path) -> None:
        import zerostall

        self.root = measure.scratch_path(directory, "dip-memtier")
        self.ck = zerostall.Checkpointer(str(self.root), keep_last=1,
                                         memory_tier=zerostall.MemoryTier(persist_interval_steps=MEMTIER_K))
        self.saves = 0

    def save(self, path: Path, state: Any) -> measure.Pending:
        from benchmarks.zs import _ZsPending

        self.saves += 1
        half = (self.saves + 1) // 2
        step = MEMTIER_K * half if self.saves % 2 else MEMTIER_K * half + 1
        return _ZsPending(self.ck.save_pytree_async(step, state))

    def close(self) -> None:
        self.ck.close()
        measure.remove(self.root)


def _make_system(name: str) -> measure.System | None:
    if name == "none":
        return None
    if name == "zerostall_memtier10":
        return ZerostallMemTier()
    if name in ("zerostall", "zerostall_idle"):
        from benchmarks.zs import Zerostall, ZerostallIdle, available

        why = available()
        if why:
            raise RuntimeError(why)
        return ZerostallIdle() if name == "zerostall_idle" else Zerostall()
    from benchmarks.peers import FACTORIES, orbax_missing

    why = orbax_missing() if name.startswith("orbax") else None
    if why:
        raise RuntimeError(why)
    return FACTORIES[name]()


def window(trainer: Trainer, system: measure.System | None, state: Any, directory: Path) -> dict[str, Any]:
    """One baseline + one save window; see the module docstring for the accounting."""
    quiet = measure.wait_for_quiet(max_wait_s=5.0)
    foreign = measure.ForeignLoad().__enter__()
    base = trainer.run_for(BASE_S)
    path = measure.scratch_path(directory, f"dip-{system.name if system else 'none'}")
    done = threading.Event()
    box: dict[str, Any] = {}

    def waiter(pending: measure.Pending) -> None:
        try:
            box["stats"] = pending.wait()
        except BaseException as e:  # surfaced below; a failed save is not a result
            box["error"] = e
        box["durable_at"] = measure.now()
        done.set()

    iters: list[tuple[float, float]] = []  # (start, end) of every iteration in the window
    start = measure.now()
    while measure.now() - start < PRE_S:
        t = measure.now()
        trainer.step()
        iters.append((t, measure.now()))
    save_at = measure.now()
    if system is None:
        stall = 0.0
        end_at = start + NONE_WINDOW_S
        box["durable_at"] = save_at
    else:
        pending = system.save(path, state)
        stall = measure.now() - save_at
        threading.Thread(target=waiter, args=(pending,), daemon=True).start()
        end_at = None
    resumed = measure.now()
    while True:
        now = measure.now()
        if end_at is None and done.is_set():
            end_at = box["durable_at"] + POST_S
        if end_at is not None and now >= end_at:
            break
        t = measure.now()
        trainer.step()
        iters.append((t, measure.now()))
    end = measure.now()
    if "error" in box:
        raise box["error"]
    durable_at = box["durable_at"]
    base += trainer.run_for(BASE_S)
    foreign.__exit__(None, None, None)
    t0 = statistics.fmean(base)
    measure.remove(path)

    during = [b - a for a, b in iters if a >= resumed and b <= durable_at]
    elapsed = end - start
    lost = elapsed - len(iters) * t0
    return {
        "t0_s": t0, "t0_median_s": statistics.median(base), "baseline_iters": len(base),
        "stall_s": stall, "durable_s": durable_at - save_at, "window_s": elapsed,
        "iters": len(iters), "lost_s": lost, "lost_iters": lost / t0,
        "iters_during_persist": len(during),
        "slowdown_during_persist": (statistics.fmean(during) / t0) if during else None,
        "foreign_cores": foreign.cores, **quiet,
        "tiers": list((box.get("stats") or {}).get("tiers") or ()),
    }


def run(system_name: str, state_size: int, directory: Path, repeats: int) -> dict[str, Any]:
    """All windows for one system; a failing system is recorded, not raised."""
    torch.set_num_threads(2)
    trainer = Trainer()
    trainer.run_for(1.0)  # warm-up: allocator, autograd graph caches, AdamW state
    state = build_state(state_size) if system_name != "none" else None
    out: dict[str, Any] = {"system": system_name, "torch_threads": torch.get_num_threads(), "windows": []}
    try:
        system = _make_system(system_name)
        if system is not None:
            system.setup(directory)
            state = system.native(state)
            first = measure.scratch_path(directory, f"dip-first-{system_name}")
            for _ in range(getattr(system, "warmup_saves", 1)):
                system.save(first, state).wait()  # first save: allocations and process start
                measure.remove(first)
        for r in range(repeats):
            w = window(trainer, system, state, directory)
            out["windows"].append(w)
            measure.log(f"dip {system_name} r{r}: t0 {w['t0_s'] * 1e3:.1f}ms stall {w['stall_s']:.3f}s "
                        f"durable {w['durable_s']:.2f}s lost {w['lost_s']:.2f}s "
                        f"({w['lost_iters']:.1f} iters), slowdown "
                        f"{w['slowdown_during_persist'] or float('nan'):.2f}x; others used {w['foreign_cores']:.1f} cores")
        if system is not None:
            system.close()
        if system_name == "zerostall_memtier10":
            out["memtier"] = memtier_summary(out["windows"])
    except Exception as e:
        measure.log(f"dip {system_name} failed: {type(e).__name__}: {e}")
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def memtier_summary(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Memory-only and persisted windows apart (medians), and the loss per save over a cycle of
    ``MEMTIER_K`` saves: ``((K - 1) x memory-only + persisted) / K``; stall and background apart."""
    kinds = {"memory_only": [w for w in windows if "storage" not in w["tiers"]],
             "persisted": [w for w in windows if "storage" in w["tiers"]]}
    out: dict[str, Any] = {"k": MEMTIER_K}
    for kind, ws in kinds.items():
        if ws:
            out[kind] = {f: statistics.median(w[f] for w in ws) for f in ("lost_s", "stall_s", "durable_s")}
            out[kind]["background_s"] = out[kind]["lost_s"] - out[kind]["stall_s"]
            out[kind]["windows"] = len(ws)
    if "memory_only" in out and "persisted" in out:
        m, p = out["memory_only"], out["persisted"]
        for f in ("lost_s", "stall_s", "background_s"):
            out[f"per_save_{f}"] = ((MEMTIER_K - 1) * m[f] + p[f]) / MEMTIER_K
        measure.log(f"dip zerostall_memtier10: memory-only lost {m['lost_s']:.2f}s (stall {m['stall_s']:.3f}s), "
                    f"persisted lost {p['lost_s']:.2f}s (stall {p['stall_s']:.3f}s); per save over {MEMTIER_K} saves "
                    f"{out['per_save_lost_s']:.2f}s (stall {out['per_save_stall_s']:.3f}s, background "
                    f"{out['per_save_background_s']:.2f}s)")
    return out


def main() -> None:
    p = child_args(__doc__.splitlines()[0])
    p.add_argument("--system", required=True, choices=SYSTEMS)
    args = p.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    measure.emit(run(args.system, parse_size(args.size), directory, args.repeats))


if __name__ == "__main__":
    main()
