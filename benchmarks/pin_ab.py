"""A warm load's passes on the pinned team vs on the shared pool, paired in one process.

    PYTHONPATH=src:. python benchmarks/pin_ab.py [--size 256M] [--pairs 15] [--quiet 0.5] [--dir /tmp]

Saves the benchmark's state (``benchmarks.state.build_state``) once, then loads it in place into a
template ``--pairs`` times per variant: all-or-nothing (``atomic=True``) and streaming
(``atomic=False``), each with ``zerostall.restore.spans.PIN_PASSES`` on (one thread pinned to each CPU,
:func:`zerostall.cpus.pinned_team`) and off (the shared pool), in turn. As in ``make bench``,
the files are read into the page cache right before each load (``measure.warm_cache``) and the
process then sleeps ``--quiet`` seconds, so each load starts from idle cores. Prints medians and
minimums, and the paired ratio pool / pinned (above 1: pinned is faster). Nothing passes or fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zerostall
import zerostall.restore.spans as spans
from benchmarks import measure
from benchmarks.state import build_state, parse_size, template_like


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--quiet", type=float, default=0.5, help="seconds idle before each load")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="zspin-", dir=a.dir)
    out: dict[str, list[float]] = {}
    try:
        state = build_state(parse_size(a.size))
        path = os.path.join(d, "ck")
        zerostall.save_pytree_async(path, state).result()
        template = template_like(state)
        del state
        modes = {"atomic": zerostall.LoadOptions(atomic=True), "streaming": zerostall.LoadOptions(atomic=False)}
        for opts in modes.values():
            zerostall.load_pytree(path, template, options=opts)  # untimed: imports, the team's threads
        for _ in range(a.pairs):
            for mode, opts in modes.items():
                for pin in (False, True):
                    spans.PIN_PASSES = pin
                    measure.warm_cache(path)
                    time.sleep(a.quiet)
                    t0 = time.perf_counter()
                    zerostall.load_pytree(path, template, options=opts)
                    out.setdefault(f"{mode} {'pinned' if pin else 'pool'}", []).append(time.perf_counter() - t0)
    finally:
        spans.PIN_PASSES = True
        shutil.rmtree(d, ignore_errors=True)
    print(f"{a.size}, {a.pairs} pairs, {a.quiet:g} s idle before each load, {os.cpu_count()} CPUs")
    for name, xs in out.items():
        print(f"  {name:>18}: median {statistics.median(xs) * 1e3:6.1f} ms, min {min(xs) * 1e3:6.1f} ms")
    for mode in modes:
        ratios = [p / q for p, q in zip(out[f"{mode} pool"], out[f"{mode} pinned"], strict=True)]
        print(f"  {mode:>9} pool / pinned, median of pairs: {statistics.median(ratios):.2f}x")
    return out


if __name__ == "__main__":
    main()
