"""A DDP worker for the torchrun memory-tier test (gloo, CPU).

``torchrun ... _memory_ddp.py DIR STEPS PERSIST_EVERY KILL_STEP``: trains STEPS steps, saving every
step with a memory tier. On the first attempt, once every rank has step KILL_STEP in memory, rank 1
SIGKILLs itself (KILL_STEP 0: never); torchrun restarts the group, which resumes from memory.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostall import Checkpointer, MemoryTier


class RankState:
    def __init__(self, rank: int) -> None:
        self.gen = torch.Generator().manual_seed(1234 + rank)
        self.position = 0

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        x = torch.randn(8, 16, generator=self.gen)
        return x, x.sum(dim=1, keepdim=True).sin()

    def state_dict(self) -> dict:
        return {"rng": self.gen.get_state(), "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.gen.set_state(sd["rng"])
        self.position = sd["position"]


def main() -> None:
    directory, steps, every, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mine = RankState(rank)
    state = {"model": model, "optim": opt, "rank": mine}
    with Checkpointer(directory, memory_tier=MemoryTier(persist_interval_steps=every, linger_s=120)) as ckpt:
        held = ckpt.memory_step()
        start = ckpt.latest_step() or 0
        print(f"RESUME rank={rank} attempt={attempt} start={start} held={held} "
              f"adopted={int(ckpt._engine.writer.adopted)}", flush=True)
        if start:
            ckpt.load_pytree(template=state)
        for step in range(start + 1, steps + 1):
            x, y = mine.batch()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.save_pytree_async(step, state).result()
            if step == kill_step and attempt == 0:
                dist.barrier()  # every rank has the step in memory
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.barrier()  # rank 0 waits here until torchrun stops the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
