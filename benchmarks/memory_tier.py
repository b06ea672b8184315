"""The memory tier: restore from memory vs a memcpy of the same bytes vs a cold restore from disk,
and the stall of a memory-only save vs a persisted one, in one process and one run.

    python benchmarks/memory_tier.py [--gib 1 4] [--repeats 3] [--dir /tmp]

Target (issue 13): restore from memory <= 1.2x the memcpy, at 1 GiB and 4 GiB; a memory-only
save stalls no longer than a persisted one. The memcpy copies the same tensors into preallocated,
already touched tensors: the faster of torch ``copy_`` and ``numpy.copyto`` per tensor; the restore from memory loads into a template of
existing tensors with verification on (every CRC32C checked) and off. Cold = after fsync +
POSIX_FADV_DONTNEED on the persisted step's data file. A second line pairs each repeat's memcpy
with a verified restore right after it (median of the ratios, and the restore's CPU seconds):
steadier than best-of times on a shared machine. Host memory: the pool's slots (state the
figure printed).
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

import zerostall
from benchmarks import measure
from zerostall import Checkpointer, LoadOptions, MemoryTier


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _best(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return min(times)


def run(gib: float, repeats: int, root: str | None) -> None:
    d = tempfile.mkdtemp(dir=root)
    try:
        n = int(gib * (1 << 30)) // 4 // 64
        state = {f"p{i}": torch.randn(n) for i in range(64)}
        tmpl = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}
        nbytes = sum(v.numel() * 4 for v in state.values())

        def torch_copy() -> None:
            for k, v in state.items():
                tmpl[k].copy_(v)

        pairs = [(tmpl[k].numpy(), v.numpy()) for k, v in state.items()]

        def numpy_copy() -> None:  # one C-library memmove per tensor, no OpenMP team to wait on
            for dst, src in pairs:
                np.copyto(dst, src)

        def memcpy() -> None:
            """The faster of the two copies, timed inside: the reference the target is against.
            On a busy 2-core machine torch's 2-thread copy can be several times slower."""
            memcpy_times.append(min(_best(torch_copy, 1), _best(numpy_copy, 1)))

        memcpy_times: list[float] = []

        for _ in range(repeats):
            memcpy()
        t_memcpy = min(memcpy_times)
        ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=2, linger_s=0))
        slots = ck.prepare(tree=state)
        stalls: dict[str, list[float]] = {"memory": [], "persisted": []}
        for step in range(1, 2 * repeats + 2):
            st = ck.save_pytree_async(step, state).result()
            if step > 1:  # the first save of a layout allocates
                stalls["persisted" if step % 2 == 0 else "memory"].append(st.stall_s)
        last = 2 * repeats + 1  # odd: memory only
        assert ck.memory_step() == last
        # Paired: each repeat times a memcpy and then the verified restore, so that what other
        # processes do to the machine's memory bandwidth lands on both; the ratio is the median of
        # the repeats' ratios. CPU: this process's, every thread, for the restore.
        ratios, cpus = [], []
        for _ in range(repeats):
            memcpy()
            t_pair = memcpy_times[-1]
            c0 = _cpu()
            t_load = _best(lambda: ck.load_pytree(last, template=tmpl), 1)
            cpus.append(_cpu() - c0)
            ratios.append(t_load / t_pair)
        t_mem = _best(lambda: ck.load_pytree(last, template=tmpl), repeats)
        ck.load_options = LoadOptions(verify=False)
        t_mem_nv = _best(lambda: ck.load_pytree(last, template=tmpl), repeats)
        ck.load_options = None
        persisted = last - 1
        f = glob.glob(os.path.join(d, f"step_{persisted:08d}", "data", "*"))[0]

        def cold() -> None:
            measure.drop_cache(f)
            zerostall.load_pytree(os.path.join(d, f"step_{persisted:08d}"), tmpl)

        t_cold = _best(cold, repeats)
        ck.close()
        gb = nbytes / 1e9
        print(f"{gib:g} GiB: memcpy {t_memcpy:.3f} s ({gb / t_memcpy:.2f} GB/s); "
              f"memory restore {t_mem:.3f} s ({t_mem / t_memcpy:.2f}x memcpy), unverified {t_mem_nv:.3f} s "
              f"({t_mem_nv / t_memcpy:.2f}x); cold disk restore {t_cold:.3f} s ({t_cold / t_memcpy:.2f}x)")
        print(f"    paired (memcpy, then restore) x{repeats}: restore/memcpy median {statistics.median(ratios):.2f}x "
              f"({', '.join(f'{r:.2f}' for r in ratios)}); restore CPU {statistics.median(cpus):.3f} s")
        print(f"    stall: memory-only save {statistics.median(stalls['memory']) * 1e3:.1f} ms, persisted save "
              f"{statistics.median(stalls['persisted']) * 1e3:.1f} ms (medians); host memory for staging "
              f"{slots / (1 << 30):.2f} GiB = (max_in_flight + 1) x the state")
        print("    (here each kind stages into its own slot and memory-only saves follow persisted ones: "
              "benchmarks/memtier_stall_ab.py --interval 3 separates kind from slot)")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    for gib in args.gib:
        run(gib, args.repeats, args.dir)


if __name__ == "__main__":
    main()
