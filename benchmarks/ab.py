"""A/B: zerostall's save path from two source trees, alternated in one run.

    python benchmarks/ab.py --base DIR [--new DIR] [--size 1G] [--repeats 3] [--rounds 2]

Runs the zerostall benchmark child (``python -m benchmarks.zs``) of each tree in turn, in its own
process, each tree's own ``benchmarks`` and ``src`` on the path, alternating the order every
round so that neither tree always runs on a warmer or quieter machine. For every save it takes
the stall over the memcpy of the same state measured right before it in the same process (the
paired floor), and the persist time (from the call's return to durable). It prints the medians
per tree and new ÷ base: a refactor that leaves the data path alone shows ratios near 1.

``--base`` is typically a worktree of the commit before a change
(``git worktree add /tmp/zs-base <commit>``); ``--new`` defaults to this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MARKER = "@@ZS-BENCH-RESULT "


def run_child(tree: Path, size: str, repeats: int, scratch: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "src")]))
    env.setdefault("OMP_NUM_THREADS", "2")
    p = subprocess.run([sys.executable, "-m", "benchmarks.zs", "--size", size, "--repeats", str(repeats),
                        "--dir", scratch], cwd=tree, env=env, stdout=subprocess.PIPE, text=True, timeout=3600)
    for line in p.stdout.splitlines():
        if line.startswith(MARKER):
            return dict(json.loads(line[len(MARKER):]))
    raise RuntimeError(f"{tree}: child exited {p.returncode} without a result:\n{p.stdout[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--new", default=ROOT, type=Path)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", type=Path, default=None, help="write the raw samples here (JSON)")
    args = ap.parse_args()
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    samples: dict[str, dict[str, list[float]]] = {k: {"stall_x_memcpy": [], "persist_s": []} for k in trees}
    for rnd in range(args.rounds):
        order = ["base", "new"] if rnd % 2 == 0 else ["new", "base"]
        for name in order:
            res = run_child(trees[name], args.size, args.repeats, args.dir)
            for s in res["saves"]:
                samples[name]["stall_x_memcpy"].append(s["stall_s"] / s["memcpy_s"])
                samples[name]["persist_s"].append(s["persist_s"])
            print(f"round {rnd + 1} {name}: stall/memcpy "
                  + " ".join(f"{s['stall_s'] / s['memcpy_s']:.2f}" for s in res["saves"])
                  + "  persist s " + " ".join(f"{s['persist_s']:.3f}" for s in res["saves"]), flush=True)
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in samples.items()}
    print(f"\n{args.size}, {args.rounds} rounds x {args.repeats} saves per tree (medians)")
    print(f"{'':8} {'stall/memcpy':>13} {'persist s':>10}")
    for k in trees:
        print(f"{k:8} {med[k]['stall_x_memcpy']:13.3f} {med[k]['persist_s']:10.3f}")
    print(f"{'new/base':8} {med['new']['stall_x_memcpy'] / med['base']['stall_x_memcpy']:13.3f} "
          f"{med['new']['persist_s'] / med['base']['persist_s']:10.3f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "size": args.size,
                                        "samples": samples, "medians": med}, indent=1))


if __name__ == "__main__":
    main()
