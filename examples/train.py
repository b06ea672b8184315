"""Train TinyLM with a zerostall Checkpointer saving asynchronously; resume from the latest step.

    python examples/train.py --dir /tmp/run --steps 300 --save-every 25 --out final.pt
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_lm import Loader, TinyLM, loss_fn, lr_lambda, make_corpus

import zerostall


class RNG:
    """Python, numpy and torch global RNG states as one Stateful object."""

    def state_dict(self) -> dict:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    def load_state_dict(self, sd: dict) -> None:
        random.setstate(sd["python"])
        np.random.set_state(sd["numpy"])
        torch.set_rng_state(sd["torch"])


def torch_save_seconds(state: dict) -> float:
    """How long a plain blocking torch.save (+fsync) of the same state takes."""
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR"), suffix=".pt") as f:
        t = time.perf_counter()
        torch.save({k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}, f)
        f.flush()
        os.fsync(f.fileno())
        return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="checkpoint directory (omit: no checkpointing)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-every", type=int, default=25)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--out", help="write the final parameters here (torch.save)")
    ap.add_argument("--timeline", help="write per-step times and save windows here (JSON)")
    ap.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)

    model = TinyLM()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(20, args.steps))
    loader = Loader(make_corpus(), batch=16, ctx=64, seed=1)
    rng = RNG()
    state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "rng": rng}

    ckpt = zerostall.Checkpointer(args.dir, keep_last=args.keep_last, save_interval_steps=args.save_every) \
        if args.dir else None
    start = 0
    if ckpt is not None and ckpt.latest_step() is not None:
        t = time.perf_counter()
        restored = ckpt.load_pytree(template={**state, "step": 0})
        start = restored["step"]
        print(f"resumed from step {start} in {time.perf_counter() - t:.2f} s", flush=True)

    nparams = sum(p.numel() for p in model.parameters())
    baseline = None
    timeline: dict = {"steps": [], "saves": [], "commits": []}
    pending: list[tuple[int, zerostall.Response]] = []  # saves not yet wholly in host memory
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        model.train()
        x, y = loader.next()
        loss = loss_fn(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()  # waits for the overlapped copy of the last save, if it is still running
        sched.step()
        timeline["steps"].append([step, t0, time.perf_counter() - t0])
        for s, r in [p for p in pending if p[1].staged()]:
            # Every byte of this save is in host memory and the writer process has it: from here
            # on, a crash of this process no longer loses it (README, "What it does").
            print(f"STAGED step {s}: handed to the writer process", flush=True)
            pending.remove((s, r))
        if ckpt is not None and step == start + 1:
            # The optimizer has its state now: allocate the staging buffers before the first save.
            ckpt.prepare(tree={**state, "step": step})
        if step % 25 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
        if ckpt is not None and ckpt.should_save(step):
            if baseline is None:
                baseline = torch_save_seconds({**state, "step": step})
            ts = time.perf_counter()
            r = ckpt.save_pytree_async(step, {**state, "step": step})
            blocked = time.perf_counter() - ts
            timeline["saves"].append([step, ts, blocked])
            r.add_done_callback(lambda _r, s=step: timeline["commits"].append([s, time.perf_counter()]))
            pending.append((step, r))
            mib = r.stats.nbytes / 2**20
            print(f"SAVED step {step}: training blocked {blocked * 1e3:.1f} ms for {mib:.1f} MiB "
                  f"({nparams / 1e6:.1f}M params + AdamW); a blocking torch.save takes {baseline * 1e3:.0f} ms",
                  flush=True)
    if ckpt is not None:
        ckpt.close()
        for s in ckpt.stats()[-3:]:
            print("  committed", s.summary(), flush=True)
    if args.out:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    if args.timeline:
        import json

        with open(args.timeline, "w") as f:
            json.dump(timeline, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
