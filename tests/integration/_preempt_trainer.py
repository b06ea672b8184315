"""A training loop with ``Checkpointer(preemption_signals=(SIGTERM,))`` for the preemption tests.

``python _preempt_trainer.py solo DIR PAUSE``, ``python _preempt_trainer.py RANK WORLD PORT DIR PAUSE``
(gloo ranks; each step all-reduces, as DDP does) or, under torchrun, ``_preempt_trainer.py env DIR PAUSE``. Every step is saved to the memory tier only
(``persist_interval_steps`` is far away). With ``PAUSE > 0``, after the save of step PAUSE is in
memory the loop prints ``HELD PAUSE`` and rank 0 waits for ``DIR/go`` inside that step (a long
step); the other ranks go on into the next step's all-reduce and wait there, inside a C call where
no Python signal handler runs. The test can then see what a signal does before the next step. With ``PAUSE == 0`` it runs on (a step
every 20 ms). It stops when ``ckpt.preempted`` says so, printing ``FINAL <step>`` and, after
``close()``, ``CLOSED <memory-only step persisted at once or -1> <handler restored>``.

The solo loop installs its own SIGTERM handler first (printing ``USER HANDLER``): zerostall must chain to it.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch

from zerostall import Checkpointer, DistributedOptions, MemoryTier, SaveOptions

STEPS = 100_000  # far more than any test waits for: the loop ends only when preempted


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit("no go file")
        time.sleep(0.01)


def main() -> None:
    solo = sys.argv[1] == "solo"
    if solo:
        rank, world, d, pause = 0, 1, sys.argv[2], int(sys.argv[3])

        def user(signum: int, frame: object) -> None:
            print("USER HANDLER", signum, flush=True)

        signal.signal(signal.SIGTERM, user)
        previous = user
    elif sys.argv[1] == "env":  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        import torch.distributed as dist

        d, pause = sys.argv[2], int(sys.argv[3])
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        rank, world = dist.get_rank(), dist.get_world_size()
        previous = signal.getsignal(signal.SIGTERM)
    else:
        import torch.distributed as dist

        rank, world, port, d, pause = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                       int(sys.argv[5]))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        previous = signal.getsignal(signal.SIGTERM)
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=30.0, poll_s=0.02))
    ck = Checkpointer(d, save_options=opts, memory_tier=MemoryTier(persist_interval_steps=1_000_000, linger_s=0.0),
                      preemption_signals=(signal.SIGTERM,))
    w = torch.zeros(256, 64)
    for step in range(1, STEPS):
        w += 1.0
        if not solo:
            dist.all_reduce(w)
            w /= world
        if ck.should_save(step):
            r = ck.save_pytree_async(step, {"w": w, "rank": rank})
            if step == pause:
                r.result()
                print("HELD", step, flush=True)
                if rank == 0:
                    _wait_for(os.path.join(d, "go"))
        if ck.preempted:
            print("FINAL", step, flush=True)
            break
        if pause == 0:
            time.sleep(0.02)
        print("STEP", step, flush=True)
    held = ck._preemption.held_persisted if ck._preemption is not None else None
    ck.close()
    print("CLOSED", -1 if held is None else held, signal.getsignal(signal.SIGTERM) == previous, flush=True)
    if not solo:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
