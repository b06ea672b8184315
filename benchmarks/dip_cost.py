"""What one save costs the machine, by CPU accounting rather than by training throughput.

    python benchmarks/dip_cost.py --gib 1 --saves 6 --dir /tmp

Timing the trainer's dip needs a quiet machine; CPU accounting does not. Two busy-loop processes
keep both cores busy (as a two-thread trainer does), and each save is accounted as:

- ``stall``: the time ``save_pytree_async`` blocked the caller;
- ``writer CPU``: user + system time of the writer process (the keeper, with the memory tier),
  threads that exited included (``/proc/PID/stat``);
- ``steal``: CPU time the hypervisor took from this VM's vCPUs while the save was persisting,
  beyond the rate measured in idle windows of the same run (``/proc/stat``'s steal column): the
  host's share of the disk write, invisible to every per-process figure in the guest;
- the two busy loops' lost progress is not measured: steal and writer CPU are what they lose.

Systems: ``zerostall`` (a Checkpointer persisting every save) and ``memtier10``
(``MemoryTier(persist_interval_steps=10)``; its memory-only and persisted saves reported apart,
and the cost per save over a cycle of ten: ``(9 x memory-only + persisted) / 10``).

``--breakdown``: what a memory-only save's background work is made of, without the busy loops:
the keeper's CPU per memory-only save over many saves (``/proc/PID/stat``, so summed over enough
saves to beat its 10 ms tick), at the full size and at a tiny size of the same 157-leaf layout
(the per-save part that does not scale with bytes: messages, manifest), beside the CRC32C pass
alone over the same bytes in this process (from DRAM), and over a cache-resident 4 MiB block
(the checksum's compute floor).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.dip_ab import proc_total  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def cpu_stat() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def account(ck: Any, step: int, state: Any, pid: int) -> dict[str, float]:
    w0, s0, t = proc_total(pid), cpu_stat(), time.perf_counter()
    resp = ck.save_pytree_async(step, state)
    stall = time.perf_counter() - t
    resp.result()
    durable = time.perf_counter() - t
    w1, s1 = proc_total(pid), cpu_stat()
    return {"stall_s": stall, "durable_s": durable, "writer_cpu_s": w1[0] - w0[0],
            "steal_s": (s1[7] - s0[7]) / CLK, "tiers": list(resp.stats.tiers)}  # type: ignore[dict-item]


def breakdown(gib: float, saves: int, root: str | None) -> None:
    import shutil

    import crc32c
    import torch

    import zerostall
    from benchmarks.state import build_state

    def keeper_cpu_per_save(nbytes: int, n: int) -> tuple[float, float]:
        state = build_state(nbytes)
        d = tempfile.mkdtemp(dir=root, prefix="dipcost-bd-")
        try:
            with zerostall.Checkpointer(d, memory_tier=zerostall.MemoryTier(persist_interval_steps=1 << 30,
                                                                            linger_s=0)) as ck:
                ck.prepare(tree=state)
                ck.save_pytree(1, state)
                ck.save_pytree(2, state)
                pid = ck._engine.writer.pid
                c0 = proc_total(pid)[0]
                for s in range(3, 3 + n):
                    ck.save_pytree(s, state)
                per_save = (proc_total(pid)[0] - c0) / n
                views = [memoryview(t.numpy()).cast("B") for t in torch.utils._pytree.tree_leaves(state)
                         if isinstance(t, torch.Tensor)]
                t = time.process_time()
                for v in views:
                    crc32c.crc32c(v)
                return per_save, time.process_time() - t
        finally:
            shutil.rmtree(d, ignore_errors=True)

    big, crc_big = keeper_cpu_per_save(int(gib * (1 << 30)), saves)
    small, _ = keeper_cpu_per_save(2 << 20, 200)
    block = memoryview(bytearray(4 << 20))
    crc32c.crc32c(block)
    t = time.process_time()
    for _ in range(256):
        crc32c.crc32c(block)
    floor = (time.process_time() - t) * gib
    print(f"{gib:g} GiB memory-only save, keeper CPU per save {big:.3f} s (x{saves}); 2 MiB same layout "
          f"{small * 1e3:.1f} ms (x200); the CRC32C pass alone over the same bytes {crc_big:.3f} s; "
          f"cache-resident CRC32C {floor:.3f} s per {gib:g} GiB; load average {os.getloadavg()[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=6, help="saves per system (memtier10: half of each kind)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--breakdown", action="store_true", help="only the memory-only save's breakdown (see above)")
    args = ap.parse_args()
    if args.breakdown:
        breakdown(args.gib, max(args.saves, 12), args.dir)
        return

    import zerostall
    from benchmarks.state import build_state

    state = build_state(int(args.gib * (1 << 30)))
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="dipcost-"))
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    rows: dict[str, list[dict[str, float]]] = {"idle": [], "zerostall": [], "memtier10 memory-only": [],
                                               "memtier10 persisted": []}
    try:
        plain = zerostall.Checkpointer(str(root / "plain"), keep_last=1)
        tier = zerostall.Checkpointer(str(root / "tier"), keep_last=1,
                                      memory_tier=zerostall.MemoryTier(persist_interval_steps=10))
        with plain, tier:
            for ck in (plain, tier):
                ck.prepare(tree=state)
            plain.save_pytree(1, state)
            tier.save_pytree(10, state)
            tier.save_pytree(11, state)
            for i in range(args.saves):
                s0, t = cpu_stat(), time.perf_counter()
                time.sleep(2.0)
                rows["idle"].append({"steal_rate": (cpu_stat()[7] - s0[7]) / CLK / (time.perf_counter() - t)})
                rows["zerostall"].append(account(plain, i + 2, state, plain._engine.writer.pid))
                step = 10 * (i + 2) + (1 if i % 2 else 0)  # alternately persisted (x10) and memory-only
                r = account(tier, step, state, tier._engine.writer.pid)
                rows["memtier10 persisted" if "storage" in r["tiers"] else "memtier10 memory-only"].append(r)
                print(f"save {i}: plain {rows['zerostall'][-1]} | tier {r}", flush=True)
    finally:
        for p in spin:
            p.kill()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    idle_rate = statistics.median(r["steal_rate"] for r in rows["idle"])
    print(f"\n{args.gib:g} GiB; both cores kept busy; idle steal rate {idle_rate:.3f} vCPU-s/s; medians")
    med: dict[str, dict[str, float]] = {}
    for name, rs in rows.items():
        if name == "idle" or not rs:
            continue
        m = {k: statistics.median(r[k] for r in rs) for k in ("stall_s", "durable_s", "writer_cpu_s")}
        m["steal_s"] = statistics.median(r["steal_s"] - idle_rate * r["durable_s"] for r in rs)
        m["total_s"] = m["writer_cpu_s"] + m["steal_s"]
        med[name] = m
        print(f"  {name:22} stall {m['stall_s']:.3f} s  durable {m['durable_s']:.2f} s  writer CPU "
              f"{m['writer_cpu_s']:.2f} s  steal beyond idle {m['steal_s']:.2f} s  background total "
              f"{m['total_s']:.2f} s  (n={len(rs)})")
    if "memtier10 memory-only" in med and "memtier10 persisted" in med:
        mo, pe = med["memtier10 memory-only"], med["memtier10 persisted"]
        cyc = {k: (9 * mo[k] + pe[k]) / 10 for k in ("stall_s", "total_s")}
        ratio = cyc["total_s"] / med["zerostall"]["total_s"] if med["zerostall"]["total_s"] > 0 else float("nan")
        print(f"  memtier10 per save over 10 saves: stall {cyc['stall_s']:.3f} s, background {cyc['total_s']:.2f} s "
              f"= {ratio:.2f}x of persisting every save (target <= 0.10x)")


if __name__ == "__main__":
    main()
