"""Restore in place vs a raw read of the same file, warm and cold, in one process and one run.

    python benchmarks/restore_probe.py [--gib 1] [--repeats 2] [--dir /tmp]

The floor reads the data file sequentially (32 MiB preadv) into a preallocated, already touched
buffer; zerostall loads into a template of existing tensors, with and without verification.
Cold = after fsync + POSIX_FADV_DONTNEED on the data file. Prints ratios floor / zerostall
(> 1: zerostall is faster than the floor).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
import time

import torch

import zerostall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    d = tempfile.mkdtemp(dir=args.dir)
    try:
        n = int(args.gib * (1 << 30)) // 4 // 64
        state = {f"p{i}": torch.randn(n) for i in range(64)}
        path = os.path.join(d, "c")
        zerostall.save_pytree(path, state)
        tmpl = {k: torch.empty_like(v) for k, v in state.items()}
        f = glob.glob(os.path.join(path, "data", "*"))[0]
        size = os.path.getsize(f)
        warm_buf = bytearray(size)

        def drop() -> None:
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

        def raw() -> float:
            mv = memoryview(warm_buf)
            fd = os.open(f, os.O_RDONLY)
            t = time.perf_counter()
            off = 0
            while off < size:
                off += os.preadv(fd, [mv[off:off + (32 << 20)]], off)
            os.close(fd)
            return time.perf_counter() - t

        def zs(verify: bool = True) -> float:
            t = time.perf_counter()
            zerostall.load_pytree(path, tmpl, options=zerostall.LoadOptions(verify=verify))
            return time.perf_counter() - t

        print(f"state {size / 2**30:.2f} GiB, {len(state)} tensors")
        for _ in range(args.repeats):
            drop()
            rc = raw()
            drop()
            zc = zs()
            raw()  # warm: the cold zerostall load read with O_DIRECT and cached nothing
            rw = raw()
            zw = zs()
            zn = zs(False)
            print(f"cold: floor {rc:.3f}s zerostall {zc:.3f}s ({rc / zc:.2f}x) | warm: floor {rw:.3f}s "
                  f"zerostall {zw:.3f}s ({rw / zw:.2f}x), verify=False {zn:.3f}s ({rw / zn:.2f}x)")
        assert all(torch.equal(tmpl[k], state[k]) for k in state)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
