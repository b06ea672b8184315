"""One rank of an FSDP2 training run for tests/integration/test_fsdp2.py (under torchrun, gloo, CPU).

``_fsdp2_trainer.py DIR save``: train 3 steps of an FSDP2 model (uneven shards), save step 3
with zerostall; rank 0 writes the full optimizer moments to ``DIR/ref.pt``.
``_fsdp2_trainer.py DIR resume``: build the model and a *fresh* AdamW (no state yet, as a
restarted job does), load step 3 into them and take one step.
Either mode writes what it found (or the error it met) to ``DIR/result-MODE-RANK.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import zerostall


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.ReLU(), torch.nn.Linear(37, 7))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(16, 13, generator=torch.Generator().manual_seed(i))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    root, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model, opt = build()
    result: dict[str, object] = {}
    try:
        with zerostall.Checkpointer(os.path.join(root, "run")) as ckpt:
            if mode == "save":
                for i in range(1, 4):
                    step(model, opt, i)
                ckpt.save_pytree(3, {"model": model, "optim": opt})
                ref = {"exp_avg": [full(opt.state[p]["exp_avg"]) for p in model.parameters()]}
                if rank == 0:
                    torch.save(ref, os.path.join(root, "ref.pt"))
            else:
                ckpt.load_pytree(3, template={"model": model, "optim": opt})
                ref = torch.load(os.path.join(root, "ref.pt"))
                states = [opt.state[p] for p in model.parameters()]
                result["moments_are_dtensors"] = all(isinstance(s["exp_avg"], DTensor) for s in states)
                result["moments_equal_saved"] = all(
                    torch.equal(full(s["exp_avg"]), r) for s, r in zip(states, ref["exp_avg"], strict=True))
                step(model, opt, 4)  # DTensor dispatch refuses plain-tensor moments beside DTensor parameters
                result["stepped"] = True
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["tb"] = traceback.format_exc()
    with open(os.path.join(root, f"result-{mode}-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
