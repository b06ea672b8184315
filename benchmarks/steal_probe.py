"""How much CPU the hypervisor takes from this VM while it writes 1 GiB: the dip's hidden part.

    python benchmarks/steal_probe.py [--gib 1] [--repeats 3] [--dir /tmp]

Two busy loops keep both vCPUs busy (as a two-thread trainer does). Then, in turns, nothing
happens for 2.5 s (``idle``), or this process writes the size from a shared-memory buffer
(``memfd``, like the staging buffers) in one of the ways a checkpointer can:

- ``direct``: ``O_DIRECT`` in 64 MiB calls + fsync (zerostall's writer);
- ``direct_16M`` / ``direct_1G``: the same with 16 MiB / one 1 GiB call;
- ``paced``: ``O_DIRECT`` 64 MiB calls, sleeping 3x each call's time after it (a write-rate cap);
- ``buffered``: through the page cache + fsync (what torch.save and DCP do);
- ``crc``: a CRC32C pass over the buffer, no I/O.

For each, ``/proc/stat``'s steal column (time the host ran something else on a vCPU while the
guest wanted it) beyond the idle windows' rate, the guest system time beyond idle, and this
process's own CPU. On a virtio disk the host does the copy of every written byte on CPUs it
shares with the vCPUs, so steal, not any guest process, is where most of a write's cost shows.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

import crc32c

CLK = os.sysconf("SC_CLK_TCK")


def _stat() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // (64 << 20) * (64 << 20)
    fd = os.memfd_create("zs-probe")
    os.ftruncate(fd, n)
    buf = mmap.mmap(fd, n)
    block = os.urandom(1 << 20)
    for o in range(0, n, 1 << 20):
        buf[o:o + (1 << 20)] = block
    view = memoryview(buf)
    d = tempfile.mkdtemp(dir=args.dir)

    def write(chunk: int, direct: bool = True, pace: float = 0.0) -> None:
        p = os.path.join(d, "probe")
        f = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
        for o in range(0, n, chunk):
            t = time.perf_counter()
            os.pwrite(f, view[o:o + chunk], o)
            if pace:
                time.sleep((time.perf_counter() - t) * pace)
        os.fsync(f)
        os.close(f)
        os.unlink(p)

    def crc() -> None:
        for o in range(0, n, 4 << 20):
            crc32c.crc32c(view[o:o + (4 << 20)])

    ops = {"idle": lambda: time.sleep(2.5), "direct": lambda: write(64 << 20), "direct_16M": lambda: write(16 << 20),
           "direct_1G": lambda: write(n), "paced": lambda: write(64 << 20, pace=3.0),
           "buffered": lambda: write(64 << 20, direct=False), "crc": crc}
    rows: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in ops}
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(1.0)
        for _ in range(args.repeats):
            for name, op in ops.items():
                s0, c0, t = _stat(), time.process_time(), time.perf_counter()
                op()
                s1, c1, w = _stat(), time.process_time(), time.perf_counter() - t
                rows[name].append(((s1[7] - s0[7]) / CLK, (s1[2] - s0[2]) / CLK, c1 - c0, w))
    finally:
        for p in spin:
            p.kill()
        os.rmdir(d)
    steal_rate = statistics.median(s / w for s, _, _, w in rows["idle"])
    sys_rate = statistics.median(y / w for _, y, _, w in rows["idle"])
    print(f"{n / 2**30:g} GiB, {args.repeats} repeats, both vCPUs kept busy; idle: steal {steal_rate:.3f} vCPU-s/s")
    for name, rs in rows.items():
        steal = [s - steal_rate * w for s, _, _, w in rs]
        print(f"  {name:10} steal beyond idle {statistics.median(steal):5.2f} s ({' '.join(f'{x:.2f}' for x in steal)})  "
              f"guest sys beyond idle {statistics.median(y - sys_rate * w for _, y, _, w in rs):5.2f} s  "
              f"own CPU {statistics.median(c for _, _, c, _ in rs):.2f} s  wall {statistics.median(w for *_, w in rs):.2f} s")


if __name__ == "__main__":
    main()
