"""The memory tier after a crash: a restarted process's restore from its keeper vs a memcpy.

    python benchmarks/memory_restart.py [--gib 1 4] [--repeats 3]

A child process saves a memory-only step of ``--gib`` (64 float32 tensors) and is SIGKILLed.
A fresh process, as a torchrun restart is (imports torch, opens the Checkpointer, which adopts
the keeper), times its first load from memory into a template of touched tensors, then pairs
each of ``--repeats`` memcpys of the same tensors (the faster of torch ``copy_`` and
``numpy.copyto`` per tensor, as benchmarks/memory_tier.py) with a load right after it. It prints
both, the ratios, and whether the keeper had verified the image (its check after the crash; the
load then only copies). For comparison each repeat also pairs a memcpy with a load of the same
image that checksums it itself, as every load from memory did before (r2preverify). Target
(issue 13): restore <= 1.2x the memcpy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

N_TENSORS = 64


def _state(gib: float) -> dict[str, object]:
    import torch

    g = torch.Generator().manual_seed(0)
    n = int(gib * (1 << 30)) // 4 // N_TENSORS
    return {f"p{i}": torch.randn(n, generator=g) for i in range(N_TENSORS)}


def _save_and_die(d: str, gib: float) -> None:
    from zerostall import Checkpointer, MemoryTier

    ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=1000, linger_s=300))
    ck.save_pytree(1, _state(gib))
    assert ck.stats()[-1].tiers == ("memory",)
    print("SAVED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _restore(d: str, gib: float, repeats: int, ab_repeats: int = 0, open_first: bool = False) -> None:
    t_start = time.perf_counter()
    import numpy as np
    import torch

    import zerostall.memcopy as memcopy
    from zerostall import Checkpointer, LoadOptions, MemoryTier
    from zerostall.restore import load_items
    from zerostall.storage.image import open_image

    torch.set_num_threads(2)
    t_import = time.perf_counter() - t_start
    if open_first:  # as a trainer that opens its Checkpointer before it builds its model
        t0 = time.perf_counter()
        ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=1000, linger_s=0))
        t_open = time.perf_counter() - t0
    t_built = time.perf_counter()
    want = _state(gib)
    tmpl = {k: torch.zeros_like(v) for k, v in want.items()}  # type: ignore[arg-type]
    t_built = time.perf_counter() - t_built
    nbytes = sum(v.numel() * 4 for v in tmpl.values())
    if not open_first:
        t0 = time.perf_counter()
        ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=1000, linger_s=0))
        t_open = time.perf_counter() - t0
    adopted = ck._engine.writer.adopted
    t0 = time.perf_counter()
    ck.load_pytree(1, template=tmpl)  # the restart's load: waits for the keeper's check if still running
    t_first = time.perf_counter() - t0
    premap = getattr(ck, "_premap", None)  # r4premap: the adopted keeper's step, mapped at adoption
    premap_line = (f"    opened {'before' if open_first else 'after'} building the state and template "
                   f"({t_built:.2f} s); pre-mapped at adoption: "
                   + (f"{premap.populated / (1 << 30):.2f} GiB pre-faulted when the first load returned, "
                      f"mapping reused by {premap.reused} load(s)" if premap is not None else "no"))
    got = ck._engine.writer.query_image()
    assert got is not None
    img, fds = got
    for fd in fds:
        os.close(fd)
    assert all(torch.equal(tmpl[k], v) for k, v in want.items()), "restored bytes differ"  # type: ignore[arg-type]
    pairs = [(tmpl[k].numpy(), v.numpy()) for k, v in want.items()]  # type: ignore[union-attr]

    def memcpy() -> float:
        best = float("inf")
        for fn in (lambda: [tmpl[k].copy_(v) for k, v in want.items()],  # type: ignore[arg-type]
                   lambda: [np.copyto(a, b) for a, b in pairs]):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    items = [(a.ctypes.data, b.ctypes.data, a.nbytes) for a, b in pairs]

    def streaming_copy() -> float:  # the same bytes with zerostall.memcopy's streaming stores, every core
        t = time.perf_counter()
        memcopy.copy_many(items)
        return time.perf_counter() - t

    def load_verifying() -> None:  # Checkpointer._load_from_memory with the trainer's own checksum pass
        got = ck._engine.writer.query_image()
        assert got is not None
        img, fds = got
        files = [(f.name, f.length, f.size, fd) for f, fd in zip(img.files, fds, strict=True)]
        with open_image(img.name, img.manifest.encode(), files) as image:
            load_items(image.url, img.name, {"pytree": tmpl}, LoadOptions())

    memcpys, loads, memcpys_v, loads_v, streamed = [], [], [], [], []
    for _ in range(repeats):
        memcpys.append(memcpy())
        streamed.append(streaming_copy())
        t0 = time.perf_counter()
        ck.load_pytree(1, template=tmpl)
        loads.append(time.perf_counter() - t0)
        memcpys_v.append(memcpy())
        t0 = time.perf_counter()
        load_verifying()
        loads_v.append(time.perf_counter() - t0)
    ab = _ab(ck, tmpl, memcpy, ab_repeats) if ab_repeats else None
    ck.close()
    ratios = [b / a for a, b in zip(memcpys, loads, strict=True)]
    ratios_v = [b / a for a, b in zip(memcpys_v, loads_v, strict=True)]
    gb = nbytes / 1e9
    print(f"{gib:g} GiB restart: adopted keeper {adopted}, image verified by the keeper {img.verified}; "
          f"import torch+zerostall {t_import:.2f} s, open {t_open:.3f} s")
    print(f"    first load after restart {t_first:.3f} s ({t_first / min(memcpys):.2f}x the best memcpy "
          f"{min(memcpys):.3f} s, {gb / min(memcpys):.2f} GB/s)")
    print(f"    the same bytes by zerostall.memcopy (streaming stores: {memcopy.STREAMING}, every core): best "
          f"{min(streamed):.3f} s; first load / it {t_first / min(streamed):.2f}x, later loads / it median "
          f"{statistics.median(loads) / min(streamed):.2f}x")
    print(f"    paired (memcpy, then load) x{repeats}: memcpy {', '.join(f'{t:.3f}' for t in memcpys)} s; "
          f"load {', '.join(f'{t:.3f}' for t in loads)} s; load/memcpy median {statistics.median(ratios):.2f}x "
          f"({', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"    the same image checksummed by the trainer's load instead (before r2preverify): load "
          f"{', '.join(f'{t:.3f}' for t in loads_v)} s; load/memcpy median {statistics.median(ratios_v):.2f}x "
          f"({', '.join(f'{r:.2f}' for r in ratios_v)})", flush=True)
    print(premap_line, flush=True)
    for name, got in (ab or {}).items():
        print(f"    A/B {name}: load/memcpy median {statistics.median(got):.2f}x ({', '.join(f'{r:.2f}' for r in got)})",
              flush=True)


def _ab(ck: object, tmpl: object, memcpy: object, repeats: int) -> dict[str, list[float]]:
    """Paired, in turn: the keeper-verified load (``verify=False``) group by group on a fresh
    4-thread pool, as it is, and by byte ranges on the pooled threads (restore.read's one-pass
    path, which r3restore tried for it and did not keep); each right after its own memcpy, with
    this process's CPU seconds per load."""
    from zerostall.restore import read as restore_read

    by_groups = restore_read._Reader.copy_by_groups

    def by_ranges() -> None:
        restore_read._Reader.copy_by_groups = lambda self, reqs: False  # type: ignore[method-assign]
        try:
            ck.load_pytree(1, template=tmpl)  # type: ignore[attr-defined]
        finally:
            restore_read._Reader.copy_by_groups = by_groups  # type: ignore[method-assign]

    variants = {"group by group on a 4-thread pool (the default)": lambda: ck.load_pytree(1, template=tmpl),  # type: ignore[attr-defined]
                "by byte ranges on the pooled threads (tried, not kept)": by_ranges}
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    out: dict[str, list[float]] = {k: [] for k in variants}
    cpus: dict[str, list[float]] = {k: [] for k in variants}
    copy_cpu: list[float] = []
    for _ in range(repeats):
        for k, fn in variants.items():
            c0 = cpu()
            t_copy = memcpy()  # type: ignore[operator]  # the faster of two copies: its CPU is that of both
            copy_cpu.append(cpu() - c0)
            c0, t0 = cpu(), time.perf_counter()
            fn()
            out[k].append((time.perf_counter() - t0) / t_copy)
            cpus[k].append(cpu() - c0)
    return {f"{k} [CPU {statistics.median(cpus[k]):.3f} s; both memcpys {statistics.median(copy_cpu):.3f} s]": v
            for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--ab", type=int, default=0, metavar="N",
                    help="also N paired rounds of the load paths compared in docs/performance.md (r3restore)")
    ap.add_argument("--open-first", action="store_true",
                    help="the restarted process opens its Checkpointer (adopts the keeper) before it builds "
                         "the state and template, not right before its first load")
    ap.add_argument("--child", choices=("save", "restore"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--at", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "save":
        _save_and_die(args.at, args.gib[0])
        return
    if args.child == "restore":
        _restore(args.at, args.gib[0], args.repeats, args.ab, args.open_first)
        return
    for gib in args.gib:
        d = tempfile.mkdtemp(dir=args.dir)
        try:
            me = [sys.executable, os.path.abspath(__file__), "--gib", str(gib), "--at", d]
            saver = subprocess.run([*me, "--child", "save"], capture_output=True, text=True, check=False)
            if saver.returncode != -signal.SIGKILL or "SAVED" not in saver.stdout:
                raise SystemExit(f"the saving child failed ({saver.returncode}): {saver.stderr[-2000:]}")
            subprocess.run([*me, "--child", "restore", "--repeats", str(args.repeats), "--ab", str(args.ab),
                            *(["--open-first"] if args.open_first else [])], check=True)
        finally:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
