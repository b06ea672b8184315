"""The memory tier's persist after a crash: time from the trainer's SIGKILL to the step on storage.

    python benchmarks/crash_persist.py [--gib 1] [--repeats 2]

A child process saves one memory-only step of ``--gib`` (16 float32 numpy arrays) and SIGKILLs
itself; its keeper then checks the held step (every core) and persists it. Printed: seconds from
the child's death to the step's manifest on storage, and the keeper's CPU seconds meanwhile (from
``/proc``: the checksum passes show there even when the disk hides them in the wall time). Since
r4keeper the persist reuses the CRCs the check verified (one checksum pass, not two); run it with
``PYTHONPATH`` pointing at an older tree to compare.
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

N_ARRAYS = 16


def _save_and_die(d: str, gib: float) -> None:
    import numpy as np

    from zerostall import Checkpointer, MemoryTier

    n = int(gib * (1 << 30)) // 4 // N_ARRAYS
    rng = np.random.default_rng(0)
    state = {f"p{i}": rng.standard_normal(n, dtype=np.float32) for i in range(N_ARRAYS)}
    ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=1000, linger_s=0))
    ck.save_pytree(1, state)
    print("KEEPER", ck._engine.writer.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _once(gib: float, base: str) -> tuple[float, float]:
    d = tempfile.mkdtemp(dir=base)
    try:
        p = subprocess.run([sys.executable, __file__, "--child", d, "--gib", str(gib)], stdout=subprocess.PIPE,
                           text=True, check=False)
        t0 = time.perf_counter()
        keeper = int(next(x.split()[1] for x in p.stdout.splitlines() if x.startswith("KEEPER")))
        cpu0 = _cpu_s(keeper)
        manifest = os.path.join(d, "step_00000001", "manifest.json")
        cpu = cpu0
        while not os.path.exists(manifest):
            cpu = _cpu_s(keeper)
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        cpu = max(cpu, _cpu_s(keeper))
        while os.path.exists(f"/proc/{keeper}"):  # linger_s=0: it exits once persisted
            time.sleep(0.01)
        return wall, cpu - cpu0
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _save_and_die(a.child, a.gib)
        return
    base = a.dir or tempfile.gettempdir()
    runs = [_once(a.gib, base) for _ in range(a.repeats)]
    for wall, cpu in runs:
        print(f"{a.gib:g} GiB: death -> committed {wall:.2f} s, keeper CPU {cpu:.2f} s")
    print(f"median: {statistics.median(w for w, _ in runs):.2f} s wall, {statistics.median(c for _, c in runs):.2f} s CPU")


if __name__ == "__main__":
    main()
