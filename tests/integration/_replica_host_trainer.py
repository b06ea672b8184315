"""One rank of the node-loss and partition tests of replicas (gloo; each rank its own process, in
a namespace host of tests/support/nshosts.py; the job's store is the test's, at
``MASTER_ADDR:MASTER_PORT``, as torchrun's agent store outlives its workers).

``python _replica_host_trainer.py PHASE RANK WORLD DIR TIMEOUT_S OUT [REPLICAS]`` with PHASE:

- ``first``: train and save steps 1..6 with ``MemoryTier(persist_interval_steps=4, replicas=REPLICAS)``
  (default 1; 0: ``MemoryTier(parity=1)`` instead, one group of every host),
  each save waited for; print ``KEEPER <pid>``, ``TIERS <tiers of step 6>``, ``INODES <the
  inodes of this trainer's staging memfds>`` and ``READY``, then wait to be killed;
- ``resume``: restore the step the ranks agree on, train on to step ``LAST`` and ``close()``;
  write ``OUT`` (JSON: the agreed step, the step loaded, whether the state after the load and at
  the end equals an uninterrupted run's, bit for bit, the keeper failures reported, and how long
  the load took); with ``ZS_HOLD_AFTER_LOAD=1``, print ``LOADED`` after the load and wait for a
  line on stdin before training on;
- ``partition``: steps 1..5 (each with an all-reduce), waiting before step 5's save until the
  file ``DIR/../cut`` exists (the test cuts a host off first); print ``RESULT5 <tiers>
  <seconds result() took>``, then call ``latest_step()`` and print ``UNREACHABLE <seconds>
  <JSON: ranks, message>`` when it raises ``PeerUnreachableError``, which then ends the process
  through ``with ck`` (a failing job: its keepers persist what they hold).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch
import torch.distributed as dist

from zerostall import Checkpointer, DistributedOptions, LoadOptions, MemoryTier, SaveOptions

LAST = 7
PERSIST_EVERY = 4


def train(rank: int, w: torch.Tensor, step: int) -> torch.Tensor:
    """One step: depends on the state before it, so a wrong restore shows at the end."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return w * 0.5 + torch.randn(64, 64, generator=g)


def uninterrupted(rank: int, step: int) -> torch.Tensor:
    w = torch.zeros(64, 64)
    for s in range(1, step + 1):
        w = train(rank, w, s)
    return w


def partition(ck: Checkpointer, rank: int, d: str, timeout: float) -> None:
    """Steps 1..5 (step 4 persisted), each with the training step's all-reduce; before step 5's
    save, wait for the test to cut a host off (``DIR/../cut``); then ``ck.latest_step()``, a
    zerostall collective, which the partition must end within ``timeout``: leave as a failing
    job does (an exception out of ``with ck``)."""
    from zerostall.errors import PeerUnreachableError

    cut = os.path.join(os.path.dirname(d), "cut")
    w, x = torch.zeros(64, 64), torch.ones(1)
    with ck:
        for step in range(1, 6):
            w = train(rank, w, step)
            dist.all_reduce(x)  # the training step's own collective
            if step == 5:
                print("REDUCED 5", flush=True)
                while not os.path.exists(cut):
                    time.sleep(0.01)
            t0 = time.monotonic()
            ck.save_pytree(step, {"w": w, "step": step})
            if step == 5:
                print("RESULT5", ",".join(ck.stats()[-1].tiers), f"{time.monotonic() - t0:.2f}", flush=True)
        t0 = time.monotonic()
        try:
            ck.latest_step()
        except PeerUnreachableError as exc:
            print("UNREACHABLE", f"{time.monotonic() - t0:.2f}", json.dumps({"ranks": list(exc.ranks), "message": str(exc)}),
                  flush=True)
            raise
        print("NOT CUT OFF", flush=True)


def main() -> None:
    phase, rank, world, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    timeout, out = float(sys.argv[5]), sys.argv[6]
    replicas = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"pg-{phase}", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=timeout, poll_s=0.05))
    # ZS_ATOMIC_LOADS=1: all-or-nothing loads, whose shares from a holder arrive in memfds, not in the templates
    load_opts = LoadOptions(atomic=True) if os.environ.get("ZS_ATOMIC_LOADS") == "1" else None
    ck = Checkpointer(d, save_options=opts, load_options=load_opts,
                      memory_tier=MemoryTier(persist_interval_steps=PERSIST_EVERY, linger_s=120, replicas=replicas,
                                             replicas_in_place=os.environ.get("ZS_REPLICAS_IN_PLACE") == "1",
                                             parity=1 if replicas == 0 else 0))
    print("KEEPER", ck._engine.writer.pid, flush=True)
    if phase == "first":
        w = torch.zeros(64, 64)
        for step in range(1, 7):
            w = train(rank, w, step)
            ck.save_pytree(step, {"w": w, "step": step})
        dist.barrier()  # step 6 has returned result() on every rank
        print("TIERS", ",".join(ck.stats()[-1].tiers), flush=True)
        inodes = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                if "zerostall-stage" in os.readlink(f"/proc/self/fd/{fd}"):
                    inodes.append(os.stat(f"/proc/self/fd/{fd}").st_ino)
            except OSError:
                pass
        print("INODES", " ".join(map(str, inodes)), flush=True)
        print("READY", flush=True)
        sys.stdin.read()
        return
    if phase == "partition":
        partition(ck, rank, d, timeout)
        return
    res: dict = {"adopted": ck._engine.writer.adopted}
    start = ck.latest_step()
    assert start is not None
    t0 = time.monotonic()
    got = ck.load_pytree(template={"w": torch.zeros(64, 64), "step": 0})
    res["load_s"] = time.monotonic() - t0
    if os.environ.get("ZS_HOLD_AFTER_LOAD") == "1":  # the test lets a hung keeper go on first
        print("LOADED", flush=True)
        sys.stdin.readline()
    loaded = ck.last_loaded_step
    assert loaded is not None
    res["agreed"], res["loaded"] = start, loaded
    res["restored_equal"] = bool(torch.equal(got["w"], uninterrupted(rank, loaded))) and got["step"] == loaded
    w = got["w"]
    for step in range(loaded + 1, LAST + 1):
        w = train(rank, w, step)
        ck.save_pytree(step, {"w": w, "step": step})
    res["tiers"] = list(ck.stats()[-1].tiers)
    res["final_equal"] = bool(torch.equal(w, uninterrupted(rank, LAST)))
    res["keeper_failures"] = [[e.step, str(e)] for e in ck.keeper_failures]
    ck.close()
    with open(out, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
