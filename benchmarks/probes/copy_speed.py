"""How fast this machine copies memory, process by process: why ``make bench`` pairs the first save
after ``prepare()`` with a copy floor taken around it (docs/performance.md, "What limits each figure").

    python -m benchmarks.probes.copy_speed [--size 4G] [--processes 4] [--copies 4]

Each process (a fresh interpreter) fills a source and a destination of ``--size`` bytes, then
copies the source into the destination ``--copies`` times with ``zerostall.memcopy.copy_many``
(streaming stores, every core: the copy a save's stall makes). It then pre-faults a staging
``HostBuffer`` of the same size, as ``prepare()`` does, and copies into the old destination and
the new buffer in turn. Each copy is printed with its seconds, the CPUs its threads ran on
(``sched_getcpu()`` at every 16 MiB piece) and the steal ticks ``/proc/stat`` counted over it.

What it showed on the 2-vCPU VM of the reference runs (``benchmarks/reference/cpu/copy_speed.txt``): a 4 GiB copy
takes 0.11 s in some processes and 0.17 s in others, mostly steady within each, though one
process went from 0.177 s to 0.111 s halfway; in some runs the copies right after the pre-fault
ran slower into every buffer alike. Both threads ran on their own cores throughout, with no steal.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

_CHILD = "--child"


def _child(size: int, copies: int) -> None:
    import numpy as np

    from zerostall import memcopy
    from zerostall.buffers import HostBuffer

    libc = ctypes.CDLL("libc.so.6")
    cpus: Counter[tuple[str, int]] = Counter()
    plain = memcopy.copy

    def traced(*args: Any, **kwargs: Any) -> Any:
        cpus[(threading.current_thread().name, int(libc.sched_getcpu()))] += 1
        return plain(*args, **kwargs)

    memcopy.copy = traced  # copy_many looks it up at each piece

    def steal() -> int:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])

    src = np.full(size, 1, np.uint8)
    old = np.full(size, 2, np.uint8)

    def copy(name: str, dst: int) -> str:
        cpus.clear()
        s0, t0 = steal(), time.perf_counter()
        memcopy.copy_many([(dst, src.ctypes.data, size)])
        took, stole = time.perf_counter() - t0, steal() - s0
        where = ", ".join(f"{thread} on CPU {cpu}: {n}" for (thread, cpu), n in sorted(cpus.items()))
        return f"  {name:5s} {took:.3f}s  steal {stole} ticks  pieces: {where}"

    print("\n".join(copy("old", old.ctypes.data) for _ in range(copies)))
    t0 = time.perf_counter()
    new = HostBuffer(size)
    print(f"  HostBuffer({size >> 20} MiB) pre-faulted in {time.perf_counter() - t0:.2f}s")
    address = ctypes.addressof(ctypes.c_char.from_buffer(new.mmap))
    print("\n".join(copy(name, dst) for _ in range(2) for name, dst in (("old", old.ctypes.data), ("new", address))))
    new.close()


def main(argv: list[str] | None = None) -> None:
    from benchmarks.state import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="4G")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument(_CHILD, action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(parse_size(a.size), a.copies)
        return
    for i in range(a.processes):
        print(f"process {i}:", flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.probes.copy_speed", _CHILD, "--size", a.size,
                        "--copies", str(a.copies)], check=True)


if __name__ == "__main__":
    main()
