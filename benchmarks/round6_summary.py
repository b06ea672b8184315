"""The figures docs/performance.md ("Sixth round", "Seventh round", "Eighth round") quotes, read
back from a ``round6.sh``, ``round7.sh`` or ``round8.sh`` output folder.

    python benchmarks/round6_summary.py benchmarks/reference/round6/run1

One line per benchmark log that is there: restart restore from the memory tier, the stall of
blocking and overlapped staging, warm and cold restore ratios, and the training dip (each
window's loss, medians, and zerostall's loss over the best peer's).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from typing import Any


def _read(out: str, name: str) -> str:
    try:
        with open(f"{out}/{name}.log") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def _result(out: str, name: str) -> dict[str, Any] | None:
    for line in _read(out, name).splitlines():
        if line.startswith("@@ZS-BENCH-RESULT"):
            return dict(json.loads(line.split(" ", 1)[1]))
    return None


def _restart(out: str) -> None:
    for m in re.finditer(r"(\d) GiB restart.*?first load after restart ([\d.]+) s \(([\d.]+)x the best memcpy ([\d.]+) s"
                         r".*?best ([\d.]+) s; first load / it ([\d.]+)x, later loads / it median ([\d.]+)x"
                         r".*?load/memcpy median ([\d.]+)x", _read(out, "restart"), re.DOTALL):
        print(f"restart {m[1]} GiB: first load {m[2]} s = {m[3]}x the best memcpy ({m[4]} s); streaming-copy floor "
              f"{m[5]} s: first {m[6]}x, later {m[7]}x; paired load/memcpy {m[8]}x")
    for m in re.finditer(r"(\d) GiB restart.*?first load after restart ([\d.]+) s \(([\d.]+)x the best memcpy ([\d.]+) s"
                         r".*?load/memcpy median ([\d.]+)x", _read(out, "restart_memmove"), re.DOTALL):
        print(f"restart {m[1]} GiB, memmove control: first load {m[3]}x the best memcpy; paired {m[5]}x")


def _overlap(out: str) -> None:
    for name in ("overlap_1G", "overlap_1G_memmove", "overlap_1G_nocrc", "overlap_1G_nofold", "overlap_4G"):
        d = _result(out, name)
        if d is None:
            continue
        by = {x["system"]: x for x in d["results"]}
        bl, ov = by["blocking"], by["overlap"]
        st = ov["staging_lost_s_minus_blocking"]
        print(f"{name}: blocking {bl['median']['blocked_s'] * 1e3:.1f} ms = {bl['median']['blocked_over_memcpy']:.2f}x "
              f"memcpy; overlapped {ov['median']['blocked_over_memcpy']:.2f}x; lost to staging minus blocking's "
              f"{st['median']:+.3f} s ({st['min']:+.3f} .. {st['max']:+.3f})")


def _restore(out: str) -> None:
    for name in ("restore_256M", "restore_256M_nofold", "restore_1G", "restore_1G_memmove", "restore_1G_nofold",
                 "restore_4G"):
        t = _read(out, name)
        if not t:
            continue

        def ratio(key: str, t: str = t) -> str:
            m = re.search(re.escape(key) + r": ([\d.]+)x", t)
            return m[1] if m else "-"
        print(f"{name}: warm floor/atomic {ratio('warm floor/zs_atomic')}, floor/stream {ratio('warm floor/zs_stream')}, "
              f"floor/noverify {ratio('warm floor/zs_noverify')}; safetensors/atomic {ratio('safetensors/zs_atomic')}, "
              f"/stream {ratio('safetensors/zs_stream')}, /stream_two_pass {ratio('safetensors/zs_stream_two_pass')}; "
              f"cold raw/atomic {ratio('cold paired raw/zs_atomic')}, raw/stream {ratio('cold paired raw/zs_stream')}")


def _dip(out: str) -> None:
    for prefix in ("dip", "dip4G"):
        lost: dict[str, float] = {}
        for system in ("none", "zerostall", "zerostall_nocrc", "zerostall_nofold", "dcp_async_stager",
                       "zerostall_memtier10", "zerostall_memtier10_nocrc"):
            d = _result(out, f"{prefix}_{system}")
            if d is None or not d.get("windows"):
                continue
            mt = d.get("memtier")
            if mt:
                print(f"{prefix} {system}: memory-only lost {mt['memory_only']['lost_s']:.3f} s (background "
                      f"{mt['memory_only']['background_s']:.3f}), persisted lost {mt['persisted']['lost_s']:.3f} s "
                      f"(background {mt['persisted']['background_s']:.3f}); per save over {mt['k']} saves "
                      f"{mt['per_save_lost_s']:.3f} s (stall {mt['per_save_stall_s']:.3f}, background "
                      f"{mt['per_save_background_s']:.3f})")
            ws = d["windows"]
            lost[system] = statistics.median(w["lost_s"] for w in ws)
            slow = [w["slowdown_during_persist"] for w in ws if w.get("slowdown_during_persist")]
            each = ", ".join(f"{w['lost_s']:.2f}" for w in ws)
            print(f"{prefix} {system}: lost {each} s (median {lost[system]:.2f}); "
                  f"stall {statistics.median(w['stall_s'] for w in ws):.3f} s; durable after "
                  f"{statistics.median(w['durable_s'] for w in ws):.2f} s; slowdown while persisting "
                  f"{', '.join(f'{x:.2f}' for x in slow) or '-'}")
        if "zerostall" in lost and "dcp_async_stager" in lost:
            print(f"{prefix}: zerostall / DCP = {lost['zerostall'] / lost['dcp_async_stager']:.2f}x "
                  f"(2 x |none| = {2 * abs(lost.get('none', 0.0)):.2f} s)")


def main() -> None:
    out = sys.argv[1]
    _restart(out)
    _overlap(out)
    _restore(out)
    _dip(out)


if __name__ == "__main__":
    main()
