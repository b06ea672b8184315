"""DDP training with a collective zerostall Checkpointer; run it again to resume.

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --dir /tmp/zs-ddp --steps 60

Every rank calls the same Checkpointer methods with the same step. The model and optimizer
are identical on every rank (DDP): zerostall writes them once in total, spread over the ranks'
writers. Each rank's own state (its RNG, its data position) is kept per rank and comes back to
the same rank. Saves are asynchronous: ``save_pytree_async`` returns once the state is copied,
and no rank talks to another on the training thread to save.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import zerostall


class RankState:
    """This rank's RNG and position in its data shard."""

    def __init__(self, rank: int) -> None:
        self.gen = torch.Generator().manual_seed(1234 + rank)
        self.position = 0

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        x = torch.randn(32, 16, generator=self.gen)
        return x, x.sum(dim=1, keepdim=True).sin()

    def state_dict(self) -> dict:
        return {"rng": self.gen.get_state(), "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.gen.set_state(sd["rng"])
        self.position = sd["position"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/zs-ddp")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=10)
    a = ap.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mine = RankState(rank)
    state = {"model": model, "optim": opt, "rank": mine}

    with zerostall.Checkpointer(a.dir, keep_last=3, save_interval_steps=a.save_every) as ckpt:
        start = ckpt.latest_step() or 0
        if start:
            ckpt.load_pytree(template=state)  # collective; replicated tensors read once and broadcast
            print(f"rank {rank}: resumed at step {start}, data position {mine.position}", flush=True)
        for step in range(start + 1, a.steps + 1):
            x, y = mine.batch()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ckpt.should_save(step):
                ckpt.save_pytree_async(step, state)  # every rank, same step
        ckpt.wait()
        on_disk = ckpt.steps()  # collective: every rank calls it, every rank gets the same list
        if rank == 0:
            # These toy steps take microseconds, so a save can find the previous one still holding
            # the staging buffer (max_in_flight=1) and wait for it; with real steps it does not.
            stalls = ", ".join(f"{s.stall_s * 1e3:.0f}" for s in ckpt.stats())
            print(f"steps on disk: {on_disk}; last loss {loss.item():.4f}; "
                  f"rank 0's save stalls (ms): {stalls}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
