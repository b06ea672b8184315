"""What each part of a background persist costs a CPU-bound trainer, measured one part at a time.

    python benchmarks/dip_parts.py [--gib 1] [--repeats 6] [--dir /tmp] [--sched batch|idle]

The trainer of ``benchmarks.dip`` (two torch threads) runs while a helper process, started once
with the writer's priority (nice +10, ``SCHED_BATCH``) and holding a pre-filled shared buffer of
the given size, does one thing per window:

- ``sleep``: nothing for 0.8 s (the method's noise);
- ``crc``: CRC32C of the whole buffer, as the writer checksums a save (one pass over DRAM);
- ``write``: ``O_DIRECT`` write + fsync of the buffer in 64 MiB calls, as the writer persists it;
- ``crc+write``: both, one after the other.

Training lost per window = window wall time - iterations x the mean iteration time of the
no-load blocks on both sides. Together with the stall (a memcpy of the state), these are the
floors of zerostall's "training work lost per save": the bytes must be copied once, read once
to be checksummed, and written once. Medians over the repeats are printed.

The ``write`` line depends on the host: on a VM whose virtio disk the host emulates on CPUs it
shares with the vCPUs, the host's copy of the written bytes is taken from the trainer as steal
time, which no guest process's CPU time shows; ``benchmarks/steal_probe.py`` measures it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_HELPER = r"""
import mmap, os, sys, time
import crc32c
n, d, sched = int(sys.argv[1]), sys.argv[2], sys.argv[3]
m = mmap.mmap(-1, n)
block = os.urandom(1 << 20)
for off in range(0, n, 1 << 20):
    m[off:off + (1 << 20)] = block
view = memoryview(m)
os.nice(10)
try:
    os.sched_setscheduler(0, {"batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}[sched], os.sched_param(0))
except (AttributeError, OSError):
    pass
k = 0
print("ready", flush=True)
for line in sys.stdin:
    op = line.strip()
    t = time.perf_counter()
    if op == "sleep":
        time.sleep(0.8)
    if "crc" in op:
        for off in range(0, n, 4 << 20):
            crc32c.crc32c(view[off:off + (4 << 20)])
    if "write" in op:
        p = os.path.join(d, f"part{k}")
        k += 1
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        for off in range(0, n, 64 << 20):
            os.pwrite(fd, view[off:off + (64 << 20)], off)
        os.fsync(fd)
        os.close(fd)
        os.unlink(p)
    print(f"{time.perf_counter() - t:.4f}", flush=True)
"""

OPS = ["sleep", "crc", "write", "crc+write"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--sched", choices=["batch", "idle"], default="batch",
                    help="the helper's scheduling class (the writer's SaveOptions.writer_sched)")
    args = ap.parse_args()

    import torch

    from benchmarks.dip import Trainer

    torch.set_num_threads(2)
    trainer = Trainer()
    trainer.run_for(1.0)
    n = int(args.gib * (1 << 30)) // (64 << 20) * (64 << 20)
    d = tempfile.mkdtemp(dir=args.dir)
    helper = subprocess.Popen([sys.executable, "-c", _HELPER, str(n), d, args.sched], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert helper.stdin is not None and helper.stdout is not None
    try:
        assert helper.stdout.readline().strip() == "ready"
        # One timed memcpy of the same size: the stall floor, for the total below.
        src = torch.empty(n // 4).normal_()
        dst = torch.empty_like(src)
        dst.copy_(src)
        t = time.perf_counter()
        dst.copy_(src)
        memcpy_s = time.perf_counter() - t
        del src, dst
        lost: dict[str, list[float]] = {op: [] for op in OPS}
        took: dict[str, list[float]] = {op: [] for op in OPS}
        for _ in range(args.repeats):
            for op in OPS:
                base = trainer.run_for(1.5)
                done = threading.Event()
                box: dict[str, float] = {}

                def go(op: str = op) -> None:
                    helper.stdin.write(op + "\n")  # type: ignore[union-attr]
                    helper.stdin.flush()  # type: ignore[union-attr]
                    box["s"] = float(helper.stdout.readline())  # type: ignore[union-attr]
                    done.set()

                start = time.perf_counter()
                iters = 0
                threading.Thread(target=go, daemon=True).start()
                while not done.is_set():
                    trainer.step()
                    iters += 1
                elapsed = time.perf_counter() - start
                base += trainer.run_for(1.5)
                lost[op].append(elapsed - iters * statistics.fmean(base))
                took[op].append(box["s"])
        print(f"{n / 2**30:.2f} GiB, helper {args.sched}, {args.repeats} repeats, trainer iteration "
              f"{statistics.fmean(base) * 1e3:.0f} ms; memcpy (the stall floor) {memcpy_s:.3f} s")
        for op in OPS:
            print(f"  {op:10} training lost median {statistics.median(lost[op]):6.3f} s "
                  f"(helper busy {statistics.median(took[op]):.2f} s)  "
                  + " ".join(f"{x:.2f}" for x in lost[op]))
        floor = memcpy_s + statistics.median(lost["crc+write"]) - statistics.median(lost["sleep"])
        print(f"  floor of work lost per save = memcpy + (crc+write) - noise = {floor:.3f} s")
    finally:
        if helper.stdin:
            helper.stdin.close()
        helper.wait(timeout=60)
        os.rmdir(d)


if __name__ == "__main__":
    main()
