"""Where one warm load spends its time, by phase, in this process (a diagnosis tool, not a verdict).

    PYTHONPATH=src:. python benchmarks/load_profile.py --size 256M [--stream] [--populate] [--loads 12]

Saves the benchmark's state (``benchmarks.state.build_state``) once, then loads it into a template
``--loads`` times with the file warm, timing the load whole and the phases of
``zerostall.restore.load`` (manifest, planning, the reads, assembling) and of the reader
(``verify_spans`` / ``copy_spans`` for an all-or-nothing load, ``stream_spans`` for a streaming
one) by wrapping them with ``time.perf_counter``; prints the medians. ``--populate`` maps the
data file with ``MAP_POPULATE`` (page tables built in the ``mmap`` call instead of by the
copies' faults), for the A/B in docs/performance.md ("Seventh round").
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zerostall
import zerostall.restore.load as load
import zerostall.restore.read as read
import zerostall.storage.local as local
from benchmarks.state import build_state, parse_size, template_like


def _timed(owner: Any, name: str, times: dict[str, list[float]]) -> None:
    f: Callable[..., Any] = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            times.setdefault(name, []).append(time.perf_counter() - t)

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256M")
    ap.add_argument("--stream", action="store_true", help="atomic=False (one verified pass)")
    ap.add_argument("--populate", action="store_true", help="map the data file with MAP_POPULATE")
    ap.add_argument("--loads", type=int, default=12)
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()
    d = tempfile.mkdtemp(dir=args.dir)
    try:
        state = build_state(parse_size(args.size))
        ck = f"{d}/zs"
        zerostall.save_pytree(ck, state)
        tmpl = template_like(state)
        if args.populate:
            plain = mmap.mmap

            def populated(fd: int, size: int, *a: Any, **k: Any) -> mmap.mmap:
                k["flags"] = mmap.MAP_SHARED | mmap.MAP_POPULATE
                return plain(fd, size, *a, **k)

            local.mmap.mmap = populated  # type: ignore[misc]
        times: dict[str, list[float]] = {}
        for name in ("read_manifest", "new_planner", "plan_items", "execute_reads", "assemble"):
            _timed(load, name, times)
        for name in ("mappable", "verify_spans", "copy_spans", "stream_spans"):
            _timed(read._Reader, name, times)
        opts = zerostall.LoadOptions(atomic=not args.stream)
        zerostall.load_pytree(ck, tmpl, options=opts)  # untimed: imports, pools
        times.clear()
        total = []
        for _ in range(args.loads):
            t = time.perf_counter()
            zerostall.load_pytree(ck, tmpl, options=opts)
            total.append(time.perf_counter() - t)
        print(f"{args.size} {'streaming' if args.stream else 'all-or-nothing'}{' MAP_POPULATE' if args.populate else ''}: "
              f"load median {statistics.median(total) * 1e3:.1f} ms over {args.loads}")
        for name, v in times.items():
            print(f"  {name:14s} {statistics.median(v) * 1e3:7.2f} ms")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
