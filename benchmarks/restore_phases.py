"""Where a verified in-place restore spends its time, phase by phase, from the memory tier and
from a local file (warm or cold), and how it compares with a raw read of the same file.

    PYTHONPATH=src:. python benchmarks/restore_phases.py [--gib 1] [--loads 4] [--dir /tmp]

Each load is timed whole and by phase -- the keeper query, the checksum pass
(``_Reader.verify_spans``), the copy pass (``_Reader.copy_spans``), the page-cache fills, the
residency questions, closing the image -- by wrapping those methods with ``time.perf_counter``;
"other" is the rest (manifest, planning, assembling). Fills and residency questions run inside
the pass's threads and are summed over them, so on a cold load "other" goes negative. Also printed: this process's CPU seconds
and minor page faults per load, and a paired memcpy of the same tensors right before each load
(the faster of torch ``copy_`` and ``numpy.copyto``). Each local load is also paired with the
read floor (this merges the former ``restore_probe.py``): a sequential read of the data file, 32 MiB
``preadv`` calls into a touched buffer, right after the load and in the same state (warm, or
cold again after ``POSIX_FADV_DONTNEED``); ``floor/load`` above 1 means faster than the floor.
Local loads run with the default options, then warm with ``verify=False``. A diagnosis tool,
not a verdict: compare phases within one run.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import zerostall
from benchmarks import measure
from zerostall import Checkpointer, MemoryTier
from zerostall.restore import read as restore_read
from zerostall.storage import image as storage_image
from zerostall.storage import local as storage_local
from zerostall.storage.release import wait_unmapped

PHASES: dict[str, float] = {}


def _timed(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PHASES[label] = PHASES.get(label, 0.0) + time.perf_counter() - t0

    setattr(owner, name, wrapper)


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _raw_read(path: Path, buf: memoryview) -> float:
    """Seconds to read ``path`` sequentially into ``buf`` (32 MiB ``preadv`` calls): the floor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        off = 0
        while off < len(buf):
            got = os.preadv(fd, [buf[off:off + (32 << 20)]], off)
            if not got:
                break
            off += got
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _report(what: str, load: Callable[[], Any], memcpy: Callable[[], float], loads: int,
            before: Callable[[], None] | None = None, floor: Callable[[], float] | None = None) -> None:
    for _ in range(loads):
        t_copy = memcpy()
        if before is not None:
            wait_unmapped()
            before()
        PHASES.clear()
        c0, f0 = _usage()
        t0 = time.perf_counter()
        load()
        t = time.perf_counter() - t0
        c1, f1 = _usage()
        parts = " ".join(f"{k} {v:.3f}" for k, v in PHASES.items())
        floor_s = ""
        if floor is not None:
            if before is not None:
                wait_unmapped()  # a page the load still maps would survive the cache drop
                before()
            t_floor = floor()
            floor_s = f"; read floor {t_floor:.3f} s (floor/load {t_floor / t:.2f}x)"
        print(f"{what}: load {t:.3f} s = {t / t_copy:.2f}x memcpy ({t_copy:.3f}); CPU {c1 - c0:.3f} s; "
              f"{f1 - f0} minor faults; {parts}; other {t - sum(PHASES.values()):.3f}{floor_s}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    _timed(restore_read._Reader, "verify_spans", "verify")
    _timed(restore_read._Reader, "copy_spans", "copy")
    _timed(restore_read._Reader, "stream_spans", "stream")
    _timed(storage_image.ImageStorage, "close", "close_image")
    _timed(storage_local.LocalStorage, "fill_cache", "fill")
    _timed(storage_local.MappedFile, "cached", "residency")
    d = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        n = int(args.gib * (1 << 30)) // 4 // 64
        state = {f"p{i}": torch.randn(n) for i in range(64)}
        tmpl = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}
        pairs = [(tmpl[k].numpy(), v.numpy()) for k, v in state.items()]

        def memcpy() -> float:
            best = float("inf")
            for copy in (lambda: [tmpl[k].copy_(v) for k, v in state.items()],
                         lambda: [np.copyto(a, b) for a, b in pairs]):
                t0 = time.perf_counter()
                copy()
                best = min(best, time.perf_counter() - t0)
            return best

        ck = Checkpointer(d / "run", memory_tier=MemoryTier(persist_interval_steps=2, linger_s=0))
        try:
            ck.prepare(tree=state)
            for step in (1, 2, 3):  # 2 persisted, 3 held in memory only
                ck.save_pytree_async(step, state).result()
            _timed(ck._engine.writer, "query_image", "query")
            _report("memory tier", lambda: ck.load_pytree(3, template=tmpl), memcpy, args.loads)
        finally:
            ck.close()
        step2 = d / "run" / "step_00000002"
        data = next((step2 / "data").iterdir())
        mem = mmap.mmap(-1, (os.path.getsize(data) + 4095) // 4096 * 4096)
        buf = memoryview(mem)[:os.path.getsize(data)]
        buf[:] = b"\1" * len(buf)  # touched, not timed

        def floor() -> float:
            return _raw_read(data, buf)
        noverify = zerostall.LoadOptions(verify=False)
        _report("local warm", lambda: zerostall.load_pytree(step2, tmpl), memcpy, args.loads,
                lambda: measure.warm_cache(step2), floor)
        _report("local warm verify=False", lambda: zerostall.load_pytree(step2, tmpl, options=noverify), memcpy,
                args.loads, lambda: measure.warm_cache(step2), floor)
        _report("local cold", lambda: zerostall.load_pytree(step2, tmpl), memcpy, args.loads,
                lambda: measure.drop_cache(step2), floor)
        assert all(torch.equal(tmpl[k], state[k]) for k in state)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
