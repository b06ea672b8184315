"""Overlapped staging under torch.distributed: the scenarios of ``test_overlap_dist.py``.

Run by :func:`_dist_worker.launch` (``script=`` this file); adds its scenarios to the shared
worker and runs its ``main``.
"""

from __future__ import annotations

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(__file__))

import _dist_worker as worker
import torch

from zerostall import Checkpointer, SaveOptions, ZerostallError
from zerostall.distributed import DistributedOptions


def _gate(ck: Checkpointer, delay: float = 0.3) -> None:
    """Hold the copier for ``delay`` s: the save returns before its overlapped copy has started."""
    opened = threading.Event()
    ck._engine._copier._put(lambda: opened.wait(10))
    threading.Timer(delay, opened.set).start()


def scenario_overlap(rank: int, world: int, d: str) -> dict:
    """FSDP2-style DTensor parameters (Shard(0)) with SGD momentum, plus a DDP-style replica."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]))
    b = torch.nn.Parameter(torch.randn(5))  # identical on every rank
    opt = torch.optim.SGD([w, b], lr=0.1, momentum=0.9)

    def step() -> None:
        w.grad = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])
        b.grad = torch.ones(5)
        opt.step()

    step()
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=60))
    with Checkpointer(f"{d}/ck", save_options=opts) as ck:
        expected_w, expected_b = w.to_local().clone(), b.detach().clone()
        _gate(ck)
        r = ck.save_pytree_async(1, {"w": w, "b": b, "optim": opt})
        staged_at_return = r.staged()
        step()  # the guard holds it until the copy is done
        r.result(timeout=60)
        tmpl = {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]), "b": torch.zeros(5)}
        ck.load_pytree(1, tmpl)
        assert torch.equal(tmpl["w"].to_local(), expected_w)
        assert torch.equal(tmpl["b"], expected_b)

        # An in-place change outside step() on one rank fails the save on every rank.
        _gate(ck)
        r = ck.save_pytree_async(2, {"w": w, "b": b, "optim": opt})
        if rank == world - 1:
            with torch.no_grad():
                w.to_local().mul_(2)
        error = None
        try:
            r.result(timeout=60)
        except ZerostallError as exc:
            error = type(exc).__name__
        steps = ck.steps()
    return {"staged_at_return": staged_at_return, "error": error, "steps": steps}


if __name__ == "__main__":
    worker.scenario_overlap = scenario_overlap  # type: ignore[attr-defined]
    worker.main()
