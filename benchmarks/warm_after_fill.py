"""Warm loads depend on how the page cache was filled: a probe (docs/performance.md, "Seventh round").

    PYTHONPATH=src:. python benchmarks/warm_after_fill.py --size 1G --fills read,load,read,load

For each fill in ``--fills`` (one process, one saved state), the data file is dropped from the
page cache and read back one way, then ``--loads`` warm streaming loads are timed (median; the
previous load's mapping is unmapped before each):

- ``read``: one sequential ``read()`` of 64 MiB calls (one descriptor, one thread);
- ``load``: zerostall's own cold load (``fill_cache`` front to back on one reader thread, 8 MiB pieces);
- ``write``: the same bytes written again through the page cache (a buffered copy renamed over the
  file), as a file written without ``O_DIRECT`` (safetensors', ``torch.save``'s) is cached;
- ``read-pop`` / ``load-pop``: the same fills, then loads whose mapping is made with ``MAP_POPULATE``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import zerostall
import zerostall.storage.local as local
from benchmarks import measure
from benchmarks.state import build_state, parse_size, template_like
from zerostall.storage.release import wait_unmapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--fills", default="read,load,read,load,read,load")
    ap.add_argument("--loads", type=int, default=8)
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()
    d = tempfile.mkdtemp(dir=args.dir)
    plain = mmap.mmap

    def populated(fd: int, size: int, *a: Any, **k: Any) -> mmap.mmap:
        if k.get("prot") == mmap.PROT_READ:  # the load's mapping of a data file
            k["flags"] = mmap.MAP_SHARED | mmap.MAP_POPULATE
        return plain(fd, size, *a, **k)

    try:
        state = build_state(parse_size(args.size))
        ck = f"{d}/zs"
        zerostall.save_pytree(ck, state)
        tmpl = template_like(state)
        data = next(os.scandir(f"{ck}/data")).path
        opts = zerostall.LoadOptions(atomic=False)
        for fill in args.fills.split(","):
            local.mmap.mmap = plain  # type: ignore[misc]
            wait_unmapped()
            measure.drop_cache(data)
            if fill.startswith("read"):
                with open(data, "rb") as fh:
                    while fh.read(64 << 20):
                        pass
            elif fill == "write":
                shutil.copyfile(data, data + ".tmp")
                os.replace(data + ".tmp", data)
                os.sync()
            else:
                zerostall.load_pytree(ck, tmpl, options=opts)
            if fill.endswith("-pop"):
                local.mmap.mmap = populated  # type: ignore[misc]
            times = []
            for _ in range(args.loads):
                wait_unmapped()
                t = time.perf_counter()
                zerostall.load_pytree(ck, tmpl, options=opts)
                times.append(time.perf_counter() - t)
            print(f"filled by {fill:9s}: warm streaming load median {statistics.median(times) * 1e3:.1f} ms "
                  f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}) over {args.loads}", flush=True)
    finally:
        local.mmap.mmap = plain  # type: ignore[misc]
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
