"""What ordering ``Tensor.data`` after overlapped copies costs (stage.overlap's ``_DataAccess``).

    python -m benchmarks.probes.data_access [--repeats 16]

Prints, in one process:

* the stall of ``save_pytree_async`` for about 254 MiB of parameters and AdamW state (eight
  ``Linear(1664, 1664)``), with the interception installed as shipped and with its install made
  a no-op, the two alternating save by save (``--repeats`` saves each, medians);
* the cost of one ``.data`` access: torch's own getter, the intercepted property with no copy in
  flight, and with a copy in flight (held back) of memory the tensor does not share, in
  interleaved batches (medians of 15 batches of 20,000 accesses);
* what installing and removing the property costs (once per overlapped save);
* the time of the first ``.data`` access of a parameter whose copy has not started: it copies
  what is left on the calling thread, as the next ``step()``'s guard otherwise would.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import timeit
from collections.abc import Callable

import torch

from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.stage import overlap


def _held(ck: Checkpointer) -> threading.Event:
    """Hold the engine's copier until the returned event is set."""
    opened = threading.Event()
    ck._engine._copier._put(lambda: opened.wait(60))
    return opened


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1664, 1664) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1664)).square().mean().backward()
    opt.step()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    print(f"state: {nbytes / 2**20:.0f} MiB (parameters, exp_avg, exp_avg_sq)")
    install = overlap.DATA.install
    modes: dict[str, Callable[[], None]] = {"intercepted": install, "install a no-op": lambda: None}
    stall: dict[str, list[float]] = {m: [] for m in modes}
    other = torch.ones(4)
    with tempfile.TemporaryDirectory() as d, \
            Checkpointer(d, save_options=SaveOptions(writer=WriterKind.THREAD)) as ck:
        step = 0

        def save() -> float:
            nonlocal step
            t0 = time.perf_counter()
            r = ck.save_pytree_async(step, {"model": model, "optim": opt})
            took = time.perf_counter() - t0
            r.result()
            step += 1
            return took

        for i in range(args.repeats + 1):  # the first round warms both up
            order = list(modes) if i % 2 == 0 else list(reversed(modes))
            for m in order:
                overlap.DATA.install = modes[m]  # type: ignore[method-assign]
                took = save()
                if i > 0:
                    stall[m].append(took)
        overlap.DATA.install = install  # type: ignore[method-assign]
        for m, xs in stall.items():
            print(f"save_pytree_async stall, {m}: median {statistics.median(xs) * 1e3:.2f} ms "
                  f"(min {min(xs) * 1e3:.2f}, max {max(xs) * 1e3:.2f}, n={len(xs)})")

        n = 20000
        per: dict[str, list[float]] = {"torch's getter": [], "intercepted, no copy in flight": [],
                                       "a copy in flight, no shared memory": []}
        for _ in range(15):
            per["torch's getter"].append(timeit.timeit(lambda: other.data, number=n) / n)
            with overlap.GUARD._lock:
                overlap.DATA.install()
            per["intercepted, no copy in flight"].append(timeit.timeit(lambda: other.data, number=n) / n)
            with overlap.GUARD._lock:
                overlap.DATA.remove()
            opened = _held(ck)
            r = ck.save_pytree_async(step, {"model": model, "optim": opt})
            step += 1
            per["a copy in flight, no shared memory"].append(timeit.timeit(lambda: other.data, number=n) / n)
            opened.set()
            r.result()
        print(".data access: " + "; ".join(f"{k} {statistics.median(v) * 1e6:.2f} us" for k, v in per.items()))

        def toggle() -> None:
            with overlap.GUARD._lock:
                overlap.DATA.install()
                overlap.DATA.remove()

        print(f"installing and removing the property: {timeit.timeit(toggle, number=n) / n * 1e6:.2f} us")

        p = next(model.parameters())
        opened = _held(ck)
        r = ck.save_pytree_async(step, {"model": model, "optim": opt})
        t0 = time.perf_counter()
        _ = p.data
        first = time.perf_counter() - t0
        opened.set()
        r.result()
        print(f"first .data access of a parameter whose copy had not started: {first * 1e3:.1f} ms "
              "(copies what is left of the save on the calling thread)")


if __name__ == "__main__":
    main()
