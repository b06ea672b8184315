"""DDP training with a collective zerostall Checkpointer; run it again to resume.

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --dir /tmp/zs-ddp --steps 60

With ``--persist-every K`` every step is checkpointed into host memory (the memory tier) and every
K-th is also persisted; ``--fail-at-step N`` makes rank 1 SIGKILL itself once step N is in memory,
on the first attempt only, so that torchrun restarts the group and it resumes from memory:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 1 \
        examples/torchrun_ddp.py --dir /tmp/zs-ddp-mem --steps 60 --persist-every 10 --fail-at-step 25

(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it torch 2.13's restarted gloo workers often fail
in ``init_process_group`` with "Connection refused", zerostall or not; docs/distributed.md.)
The first attempt ends with rank 0's traceback from ``dist.barrier()`` ("Connection reset by
peer") and torchrun's "failed (exitcode: -9) local_rank: 1": that is the injected failure. Give
the memory-tier run its own ``--dir``: a directory that already holds step ``--steps`` resumes
there and has nothing left to train.

Meanwhile the ranks' keepers persist step 25 to ``--dir`` together, in the background, so that a
restart on other nodes would find it too (with ``--max-restarts 0`` that is all that happens).

Every rank calls the same Checkpointer methods with the same step. The model and optimizer
are identical on every rank (DDP): zerostall writes them once in total, spread over the ranks'
writers. Each rank's own state (its RNG, its data position) is kept per rank and comes back to
the same rank. Saves are asynchronous: ``save_pytree_async`` returns once the state is copied,
and no rank talks to another on the training thread to save.
"""

from __future__ import annotations

import argparse
import os
import signal
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
    ap.add_argument("--persist-every", type=int, default=0,
                    help="use the memory tier: save every step to memory, persist every this many")
    ap.add_argument("--fail-at-step", type=int, default=0,
                    help="rank 1 SIGKILLs itself once this step is saved (first attempt only)")
    a = ap.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mine = RankState(rank)
    state = {"model": model, "optim": opt, "rank": mine}

    memory = zerostall.MemoryTier(persist_interval_steps=a.persist_every) if a.persist_every else None
    with zerostall.Checkpointer(a.dir, keep_last=3, save_interval_steps=1 if memory else a.save_every,
                                memory_tier=memory) as ckpt:
        held = ckpt.memory_step()  # this host's memory tier (a keeper left by a crashed attempt)
        start = ckpt.latest_step() or 0  # with a memory tier: agreed by all ranks
        if start:
            ckpt.load_pytree(template=state)  # collective; replicated tensors read once and broadcast
            where = "memory" if held == start and memory else "storage"
            # One write per line: torchrun's workers run unbuffered, so print()'s text and its newline
            # would be two writes, and two ranks' lines could interleave on the shared pipe.
            sys.stdout.write(f"rank {rank}: resumed at step {start} from {where}, data position {mine.position}\n")
            sys.stdout.flush()
        loss = None  # stays None when the run already reached --steps (run it with a larger --steps)
        for step in range(start + 1, a.steps + 1):
            x, y = mine.batch()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ckpt.should_save(step):
                r = ckpt.save_pytree_async(step, state)  # every rank, same step
                if step == a.fail_at_step and attempt == 0:
                    r.result()
                    dist.barrier()  # every rank has the step (in memory at least)
                    if rank == 1:
                        os.kill(os.getpid(), signal.SIGKILL)  # the injected failure
                    dist.barrier()  # the other ranks wait here until torchrun stops the group
        ckpt.wait()
        on_disk = ckpt.steps()  # collective: every rank calls it, every rank gets the same list
        if rank == 0:
            # These toy steps take microseconds, so a save can find the previous one still holding
            # the staging buffer (max_in_flight=1) and wait for it; with real steps it does not.
            stalls = ", ".join(f"{s.stall_s * 1e3:.0f}" for s in ckpt.stats())
            if loss is None:
                print(f"steps on disk: {on_disk}; already at step {start}, nothing to train "
                      f"(pass --steps above {start}, or another --dir)", flush=True)
            else:
                print(f"steps on disk: {on_disk}; last loss {loss.item():.4f}; "
                      f"rank 0's save stalls (ms): {stalls}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
