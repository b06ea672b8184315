"""Paired A/B, in one process: the stall of a memory-only save vs a persisted one (issue 13).

    python benchmarks/memtier_stall_ab.py [--gib 1 4] [--saves 12 6] [--interval 2 3] [--dir /tmp]

One ``Checkpointer`` with ``MemoryTier(persist_interval_steps=K)`` (K=2: the kinds alternate),
the synthetic GPT-like state of ``benchmarks/state.py``, ``prepare()``-d, two warm-up saves. Each
save's ``result()`` is waited for before the next one starts, so every stall is taken on a writer
that is idle (apart from the machine's other load). Per save it records the stall
(``SaveStats.stall_s``), the training thread's own CPU during it (``time.thread_time``) and this
process's minor page faults during it; then it reports, per kind, the median and range, and the
**paired differences** (each memory-only save against the persisted save right after it): their
median and interquartile range. Differences that change sign within that range are noise.

Why K=3 too: the pool has ``max_in_flight + 1`` slots and the keeper holds the newest step's slot,
so with K=2 every memory-only save stages into one slot and every persisted save into the other:
kind and slot are confounded. K=3 (M, M, P, ...) puts each kind into both slots; the per-slot
line tells a slot effect (its pages, its mapping) from a kind effect.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


CLK = os.sysconf("SC_CLK_TCK")


def _steal_s() -> float:
    """CPU time the hypervisor took from this VM's vCPUs so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8]) / CLK


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run(gib: float, saves: int, interval: int, root: str | None) -> dict[str, Any]:
    import zerostall
    from benchmarks.state import build_state

    state = build_state(int(gib * (1 << 30)))
    d = tempfile.mkdtemp(dir=root, prefix="stall-ab-")
    rows: list[dict[str, Any]] = []
    try:
        ck = zerostall.Checkpointer(d, keep_last=1,
                                    memory_tier=zerostall.MemoryTier(persist_interval_steps=interval, linger_s=0))
        with ck:
            ck.prepare(tree=state)
            for s in (1, 2):  # first touches of both slots, the keeper's mappings, plan caches
                ck.save_pytree(s, state)
            for i in range(saves):
                step = 3 + i
                f0, c0, s0 = _minflt(), time.thread_time(), _steal_s()
                r = ck.save_pytree_async(step, state)
                cpu, flt, steal = time.thread_time() - c0, _minflt() - f0, _steal_s() - s0
                st = r.result()
                rows.append({"step": step, "kind": "persisted" if "storage" in st.tiers else "memory-only",
                             "slot": step % 2, "stall_s": st.stall_s, "cpu_s": cpu, "minflt": flt,
                             "steal_s": steal, "after": rows[-1]["kind"] if rows else "warm-up"})
    finally:
        shutil.rmtree(d, ignore_errors=True)
    la = os.getloadavg()[0]
    print(f"\n{gib:g} GiB, persist_interval_steps={interval}, {saves} saves (load average {la:.2f} at the end)")
    for kind in ("memory-only", "persisted"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        st = [r["stall_s"] * 1e3 for r in rs]
        print(f"  {kind:11}  stall median {statistics.median(st):6.1f} ms (min {min(st):.1f}, max {max(st):.1f}, "
              f"n={len(rs)})  training-thread CPU {statistics.median(r['cpu_s'] for r in rs) * 1e3:.1f} ms  "
              f"minor faults {statistics.median(r['minflt'] for r in rs):.0f}  "
              f"steal {statistics.median(r['steal_s'] for r in rs) * 1e3:.0f} ms")
        for after in ("memory-only", "persisted"):
            st = [r["stall_s"] * 1e3 for r in rs if r["after"] == after]
            if st:
                print(f"    right after a {after:11} save: stall median {statistics.median(st):6.1f} ms (n={len(st)})")
    pairs = [(a, b) for a, b in zip(rows, rows[1:], strict=False)
             if a["kind"] == "memory-only" and b["kind"] == "persisted"]
    diffs = [(a["stall_s"] - b["stall_s"]) * 1e3 for a, b in pairs]
    if diffs:
        lo, hi = _quartiles(diffs)
        print(f"  paired (memory-only - the persisted save after it): median {statistics.median(diffs):+.1f} ms, "
              f"IQR [{lo:+.1f}, {hi:+.1f}] ms, n={len(diffs)}: {', '.join(f'{x:+.0f}' for x in diffs)}")
    if interval != 2:
        for slot in (0, 1):
            for kind in ("memory-only", "persisted"):
                st = [r["stall_s"] * 1e3 for r in rows if r["slot"] == slot and r["kind"] == kind]
                if st:
                    print(f"  slot {slot} {kind:11} stall median {statistics.median(st):6.1f} ms (n={len(st)})")
    return {"rows": rows, "diffs_ms": diffs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--saves", type=int, nargs="+", default=[12, 6], help="per size (the last one repeats)")
    ap.add_argument("--interval", type=int, nargs="+", default=[2])
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    for i, gib in enumerate(args.gib):
        for interval in args.interval:
            run(gib, args.saves[min(i, len(args.saves) - 1)], interval, args.dir)


if __name__ == "__main__":
    main()
