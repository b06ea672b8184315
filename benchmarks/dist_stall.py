"""Per-rank stall of collective saves at 1, 2 and 4 ranks, with fixed bytes per rank.

    python benchmarks/dist_stall.py [--mib 32] [--saves 6] [--ranks 1,2,4]

Each rank holds a DDP-style state: ``--mib`` MiB replicated (identical on every rank: written
once in total, its writes spread over the ranks) plus ``--mib / 4`` MiB of its own. It saves
``--saves`` times with ``save_pytree_async`` (after one warm-up save, which also runs the one
collective) and waits for each commit. Stall is what ``save_*_async`` cost the training thread;
it should not grow with the number of ranks, since after the first save no rank talks to
another on the training thread. Ranks are local processes on loopback (gloo), so on a small
machine they share its cores and memory bandwidth: the "copy" column (the staging memcpy)
grows with contention there; "other" (flatten, buffer, hand-off: the part a protocol could
add to) is the one to compare across rank counts. The "independent" rows are the control: the
same number of processes saving the same state on their own, without a process group; the
collective rows should match them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rank_main(rank: int, world: int, port: int, d: str, mib: int, saves: int, collective: bool) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
    import torch
    import torch.distributed as dist

    import zerostall

    if collective:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:  # the control: the same processes saving on their own, each to its own directory
        d = os.path.join(d, f"solo-{rank}")
    g = torch.Generator().manual_seed(0)
    n = mib * (1 << 20) // 4
    state = {"model": {f"w{i}": torch.randn(n // 8, generator=g) for i in range(8)},
             "own": torch.full((n // 4,), float(rank)), "step": 0}
    array_bytes = sum(t.nbytes for t in state["model"].values()) + state["own"].nbytes
    stalls, copies, persists, written = [], [], [], []
    with zerostall.Checkpointer(os.path.join(d, "ck"), keep_last=2) as ck:
        ck.save_pytree(0, state)  # warm-up: writer, buffers, the run id
        for step in range(1, saves + 1):
            state["step"] = step
            state["own"].add_(1)
            r = ck.save_pytree_async(step, state)
            s = r.result()
            stalls.append(s.stall_s)
            copies.append(array_bytes / (s.staging_gbps * 1e9) if s.staging_gbps else 0.0)
            persists.append(s.persist_s or 0.0)
            written.append(s.nbytes)
    out = os.path.dirname(d) if not collective else d
    with open(os.path.join(out, f"bench-{rank}.json"), "w") as f:
        json.dump({"stall": stalls, "copy": copies, "persist": persists, "written": written}, f)
    if collective:
        dist.barrier()
        dist.destroy_process_group()


def run(world: int, mib: int, saves: int, collective: bool) -> list[dict]:
    d = tempfile.mkdtemp(prefix=f"zs-dist-bench-{world}-")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port", str(port),
                               "--dir", d, "--mib", str(mib), "--saves", str(saves)]
                              + ([] if collective else ["--solo"])) for r in range(world)]
    for p in procs:
        if p.wait(600) != 0:
            raise SystemExit(f"rank process failed ({p.returncode})")
    out = []
    for r in range(world):
        with open(os.path.join(d, f"bench-{r}.json")) as f:
            out.append(json.load(f))
    subprocess.run(["rm", "-rf", d], check=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--dir")
    ap.add_argument("--solo", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        rank_main(a.rank, a.world, a.port, a.dir, a.mib, a.saves, not a.solo)
        return
    own = a.mib // 4
    print(f"per rank: {a.mib} MiB replicated + {own} MiB own; {a.saves} saves after a warm-up; {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'mode':>11} {'stall median ms':>16} {'of which copy':>14} {'other':>7} {'stall max ms':>13} "
          f"{'persist median s':>17} {'written/rank MiB':>17} {'written total MiB':>18}")
    for world, collective in ((int(x), c) for x in a.ranks.split(",") for c in (True, False)):
        if world == 1 and not collective:
            continue
        t0 = time.time()
        res = run(world, a.mib, a.saves, collective)
        stalls = [s * 1e3 for r in res for s in r["stall"]]
        copies = [c * 1e3 for r in res for c in r["copy"]]
        other = [s - c for s, c in zip(stalls, copies)]
        persists = [p for r in res for p in r["persist"]]
        per_rank = [statistics.median(r["written"]) / (1 << 20) for r in res]
        mode = "collective" if collective else "independent"
        print(f"{world:>5} {mode:>11} {statistics.median(stalls):>16.1f} {statistics.median(copies):>14.1f} "
              f"{statistics.median(other):>7.1f} {max(stalls):>13.1f} {statistics.median(persists):>17.2f} "
              f"{statistics.mean(per_rank):>17.1f} {sum(per_rank):>18.1f}   ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
