"""torch alone, no zerostall: does torchrun restart a gloo group on this machine?

    for i in 1 2 3 4 5 6; do torchrun --nproc-per-node 2 --max-restarts 1 examples/torchrun_restart_probe.py; done
    for i in 1 2 3 4 5 6; do TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 \\
        examples/torchrun_restart_probe.py; done

Rank 1 SIGKILLs itself on the first attempt; the restarted group must initialise gloo again. See
docs/distributed.md, "torchrun restarts".
"""
import os
import signal

import torch
import torch.distributed as dist

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.all_reduce(torch.ones(4))
if attempt == 0:
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits here until torchrun stops the group
print(f"rank {rank} attempt {attempt} ok", flush=True)
dist.destroy_process_group()
