"""One rank of the distributed memory-tier tests (gloo): saves, then dies, or loads.

``python _memory_dist_trainer.py MODE RANK WORLD PORT DIR LAST LINGER_S TIMEOUT_S`` with MODE:

- ``both``: save steps 1..LAST (each waited for; every 10th is persisted), then every rank SIGKILLs
  itself at once (after a barrier: every keeper holds step LAST);
- ``split``: rank 1 SIGKILLs itself after step LAST-1, before its save of step LAST; the other
  ranks save step LAST, then SIGKILL themselves: the keepers hold different steps;
- ``corrupt``: as ``both``, but rank 1 first flips a byte of leaf ``w`` in the step its keeper
  holds (``_memory_trainer._corrupt_held``);
- ``wait``: save 1..LAST, print ``READY`` and wait to be killed;
- ``persist``: save 1..LAST, ``wait()`` (the keepers persist step LAST together), save LAST+1 and
  close; writes ``DIR/persist-RANK.json`` (the steps on storage after ``wait()`` and after close,
  whether the keeper served on, the step it held);
- ``resume``: adopt the keeper, restore the step the ranks agree on, save on to LAST and close;
  writes ``DIR/resume-RANK.json``;
- ``load``: no memory tier, no keeper: load the newest step from storage into a template and
  write ``DIR/load-RANK.json`` (``{"step": ..., "equal": ...}``).

Prints ``KEEPER <pid>`` and ``SAVED <step> <tiers>`` lines.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch
import torch.distributed as dist

from zerostall import Checkpointer, MemoryTier, SaveOptions
from zerostall.distributed import DistributedOptions

PERSIST_EVERY = 10


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)  # the same "model" on every rank, as DDP keeps it
    mine = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    return {"model": {"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g).to(torch.bfloat16)},
            "rank": {"rng": torch.randint(0, 1 << 30, (33,), generator=mine), "position": rank * 100 + step,
                     "name": f"shard-{rank}"}}


def _same(a: object, b: object) -> bool:
    """Bit for bit: same dtype, shape and bytes (or equal plain values)."""
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _resume(ck: Checkpointer, rank: int, last: int) -> dict:
    """Adopt this rank's keeper, restore the step the ranks agree on, save on to ``last``, close."""
    held = ck.memory_step()
    start = ck.latest_step()
    assert start is not None
    tmpl = state(rank, 0)
    out = ck.load_pytree(template=tmpl)
    want = state(rank, start)
    equal = all(_same(out[a][b], want[a][b]) for a, b in (("model", "w"), ("model", "b"), ("rank", "rng"),
                                                            ("rank", "position"), ("rank", "name")))
    for step in range(start + 1, last + 1):
        ck.save_pytree(step, state(rank, step))
    return {"adopted": ck._engine.writer.adopted, "held": held, "start": start, "equal": equal}


def _persist_at_wait(ck: Checkpointer, rank: int, last: int, d: str) -> None:
    """Save 1..``last`` (``last`` in memory only), ``wait()``, save ``last + 1``, close."""
    from zerostall.commit import committed_steps
    from zerostall.storage import open_storage

    keeper = ck._engine.writer.pid
    for step in range(1, last + 1):
        ck.save_pytree_async(step, state(rank, step))
    ck.wait()
    after_wait = committed_steps(open_storage(d))
    ck.save_pytree(last + 1, state(rank, last + 1))
    res = {"after_wait": after_wait, "same_keeper": ck._engine.writer.pid == keeper, "held": ck.memory_step()}
    ck.close()
    res["after_close"] = committed_steps(open_storage(d))
    res["failures"] = [e.step for e in ck.keeper_failures]
    with open(os.path.join(d, f"persist-{rank}.json"), "w") as f:
        json.dump(res, f)


def main() -> None:
    mode, rank, world, port, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    last, linger, timeout = int(sys.argv[6]), float(sys.argv[7]), float(sys.argv[8])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=timeout, poll_s=0.02))
    if mode == "load":
        with Checkpointer(d, save_options=opts) as ck:
            step = ck.latest_step()
            tmpl = state(rank, 0)
            w = tmpl["model"]["w"]
            into = ck.load_pytree(template=tmpl) if step is not None else tmpl  # tensors in place
            want = state(rank, step or 0)
            got = ck.load_pytree() if step is not None else tmpl  # and into new tensors
            equal = {k: _same(into[a][b], want[a][b]) and _same(got[a][b], want[a][b])
                     for a, b in (("model", "w"), ("model", "b"), ("rank", "rng"), ("rank", "position"),
                                  ("rank", "name")) for k in [f"{a}/{b}"]}
            equal["in place"] = into["model"]["w"] is w
        with open(os.path.join(d, f"load-{rank}.json"), "w") as f:
            json.dump({"step": step, "equal": all(equal.values()), "fields": equal}, f)
        dist.destroy_process_group()
        return
    ck = Checkpointer(d, save_options=opts,
                      memory_tier=MemoryTier(persist_interval_steps=PERSIST_EVERY, linger_s=linger))
    if mode == "resume":
        with ck:
            res = _resume(ck, rank, last)
        # what the keeper's persist of the dead run's step reported (by close() at the latest)
        res["keeper_failed"] = [[e.step, type(e.cause).__name__] for e in ck.keeper_failures]
        with open(os.path.join(d, f"resume-{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()
        return
    print("KEEPER", ck._engine.writer.pid, flush=True)
    if mode == "persist":
        _persist_at_wait(ck, rank, last, d)
        dist.destroy_process_group()
        return
    for step in range(1, last + 1):
        if mode == "split" and step == last and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # before its save of LAST reached the keeper
        r = ck.save_pytree_async(step, state(rank, step))
        r.result()
        print("SAVED", step, ",".join(r.stats.tiers), flush=True)
        if mode == "split" and step == last - 1:
            dist.barrier()  # every keeper holds LAST-1
    if mode == "wait":
        print("READY", flush=True)
        sys.stdin.read()
    if mode in ("both", "corrupt"):
        dist.barrier()  # every keeper holds LAST
    if mode == "corrupt" and rank == 1:
        from _memory_trainer import _corrupt_held  # a stray write into the held step, after its save

        _corrupt_held(ck)
    if mode == "corrupt":
        dist.barrier()  # rank 1's byte is flipped before any trainer dies
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
