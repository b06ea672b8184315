"""Where the training thread's time goes in an overlapped save call on CUDA.

    python benchmarks/cuda_call_probe.py [--layers 26] [--d 1024] [--cpu-dry-run]

The trainer of ``benchmarks/gpu.py`` (about 1,270 tensors, 4.7 GB of fp32 weights and AdamW
moments at the defaults). Prints, on the host:

* the overlapped ``save_pytree_async`` call, median of a few saves, and a ``cProfile`` of one;
* the same tensors enqueued device-to-host into page-locked buffers on a side stream, one
  ``copy_`` per tensor from Python versus one ``torch._foreach_copy_`` call (host time to enqueue,
  then the time until the copies are done);
* the per-tensor bookkeeping alone (version counter, storage, data pointer).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # the benchmark's trainer


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms (of {', '.join(f'{x * 1e3:.1f}' for x in xs)})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--cpu-dry-run", action="store_true")
    a = ap.parse_args()
    if a.cpu_dry_run:
        gpu.DEV = "cpu"
        a.d = 128
    elif not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    args = argparse.Namespace(layers=a.layers, d=a.d, vocab=32000 if not a.cpu_dry_run else 1000,
                              batch=8 if not a.cpu_dry_run else 1, seq=2048 if not a.cpu_dry_run else 16)
    tr = gpu.Trainer(args)
    gpu.timed_iterations(tr, 3)
    src = tr.tensors()
    print(f"{len(src)} tensors, {sum(t.numel() * t.element_size() for t in src) / 1e9:.2f} GB on {gpu.DEV}")

    import zerostall
    from zerostall.options import DistributedOptions

    opts = zerostall.SaveOptions(staging="overlap", distributed=DistributedOptions(enabled=False))
    with tempfile.TemporaryDirectory(prefix="zsprobe-") as d:
        ck = zerostall.Checkpointer(d, keep_last=1, save_options=opts)
        ck.prepare(tree=tr.tree())
        calls = []
        for step in range(1, 5):
            t = time.perf_counter()
            r = ck.save_pytree_async(step, tr.tree())
            calls.append(time.perf_counter() - t)
            tr.step()
            r.result()
        print("overlapped save call:", _ms(calls))
        pr = cProfile.Profile()
        pr.enable()
        r = ck.save_pytree_async(9, tr.tree())
        pr.disable()
        tr.step()
        r.result()
        ck.close()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)

    pin = gpu.DEV == "cuda"
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in src]
    side = torch.cuda.Stream() if pin else None
    for name in ("python loop", "_foreach_copy_"):
        enq, done = [], []
        for _ in range(4):
            gpu._sync()
            t = time.perf_counter()
            ctx = torch.cuda.stream(side) if side is not None else torch.no_grad()
            with ctx, torch.no_grad():
                if name == "python loop":
                    for s_, d_ in zip(src, dst):
                        d_.copy_(s_, non_blocking=pin)
                else:
                    torch._foreach_copy_(dst, src, non_blocking=pin)
            enq.append(time.perf_counter() - t)
            gpu._sync()
            done.append(time.perf_counter() - t)
        print(f"{name:>15}: enqueue {_ms(enq[1:])}; done {_ms(done[1:])}")
    book = []
    for _ in range(4):
        t = time.perf_counter()
        for s_ in src:
            int(s_._version)
            s_.untyped_storage()
            s_.data_ptr()
            s_.is_cuda  # noqa: B018
        book.append(time.perf_counter() - t)
    print("bookkeeping    :", _ms(book[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
