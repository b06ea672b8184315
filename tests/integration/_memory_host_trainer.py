"""One rank of the host-loss tests of the memory tier (gloo; each rank its own process, its host
given by ``ZEROSTALL_HOST_ID``).

``python _memory_host_trainer.py PHASE RANK WORLD PORT DIR TIMEOUT_S OUT`` with PHASE:

- ``first``: save steps 1..6 (every 4th persisted), each waited for on every rank, print
  ``KEEPER <pid>`` and ``READY``, and wait to be killed;
- ``resume``: adopt this host's keeper if one lingers, restore the step the ranks agree on, save
  on to step 10 and ``close()``; write ``OUT`` (JSON: the step resumed from, whether a keeper was
  adopted, the keeper's pid, what ``close()`` raised, if anything, and the step it names);
- ``resume-hold``: as ``resume``, but after step 10 print ``HOLDING`` and wait for a line on stdin
  before ``close()`` (the test kills keepers meanwhile).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch
import torch.distributed as dist

from zerostall import Checkpointer, DistributedOptions, MemoryTier, SaveOptions

LAST = 10
PERSIST_EVERY = 4


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 16, generator=g), "rank": rank, "step": step}


def main() -> None:
    phase, rank, world, port, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    timeout, out = float(sys.argv[6]), sys.argv[7]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=timeout, poll_s=0.05))
    ck = Checkpointer(d, save_options=opts,
                      memory_tier=MemoryTier(persist_interval_steps=PERSIST_EVERY, linger_s=180))
    print("KEEPER", ck._engine.writer.pid, flush=True)
    if phase == "first":
        for step in range(1, 7):
            ck.save_pytree(step, state(rank, step))
        dist.barrier()  # step 6 has returned result() on every rank
        print("READY", flush=True)
        sys.stdin.read()
        return
    res: dict = {"adopted": ck._engine.writer.adopted, "keeper": ck._engine.writer.pid}
    start = ck.latest_step()
    assert start is not None
    got = ck.load_pytree(template=state(rank, 0))
    res["start"] = start
    res["restored"] = bool(torch.equal(got["w"], state(rank, start)["w"])) and got["step"] == start
    for step in range(start + 1, LAST + 1):
        ck.save_pytree(step, state(rank, step))
    dist.barrier()  # step 10 is in every rank's memory
    if phase == "resume-hold":
        print("HOLDING", flush=True)
        sys.stdin.readline()
    t0 = time.monotonic()
    try:
        ck.close()
        res["error"] = None
    except Exception as exc:  # the test checks what it is
        res["error"] = type(exc).__name__
        res["error_step"] = getattr(exc, "step", None)
        res["message"] = str(exc)
    res["close_s"] = time.monotonic() - t0
    res["keeper_failures"] = [[e.step, type(e).__name__] for e in ck.keeper_failures]
    with open(out, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
