"""Turn raw benchmark results into medians, ratios, target verdicts, a table, JSON and a chart.

Everything here is arithmetic on what the children measured; nothing is timed. Re-render a
saved run with ``python -m benchmarks.report benchmarks/results/results.json``.

Conventions: a "x floor" ratio for a duration is ``system time / floor time`` (1.0 = at the
floor, lower is better); for a throughput it is ``system GB/s / floor GB/s`` (1.0 = at the floor,
higher is better). Restores are compared as throughput: ``floor read time / restore time``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.measure import median

GB = 1e9
MiB = 1 << 20

#: The targets each run is judged against (docs/performance.md, "What is measured").
STALL_MAX_X_MEMCPY = 1.2
PERSIST_MIN_X_WRITE = 0.9
RESTORE_MIN_X_READ = 0.8
LOST_MAX_X_BEST_PEER = 1 / 3
FIRST_MAX_X_LATER = 2.0
#: "Cost per byte flat" has no stated bound; we call it flat if the per-byte cost at
#: the largest size, relative to the floor at that size, is within this factor of the smallest
#: size's (either direction).
FLAT_TOLERANCE = 1.25

ASYNC_PEERS = ("dcp_async", "dcp_async_stager", "dcp_async_cached", "dcp_async_process", "orbax_async")


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def summarize_floors(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the samples of every floors child of one size (run before and after the systems)."""
    runs = [r for r in runs if r and "error" not in r]
    if not runs:
        return {}
    pool: dict[str, list[float]] = {}
    for r in runs:
        for k, v in r.items():
            if k.endswith("_s") and isinstance(v, list):
                pool.setdefault(k, []).extend(v)
    nbytes = runs[0]["nbytes"]
    out: dict[str, Any] = {"nbytes": nbytes, "samples": {k: len(v) for k, v in pool.items()}}
    for k, v in pool.items():
        out[k] = median(v)
    out["write_gbps"] = _div(nbytes / GB, out.get("write_fsync_s"))
    out["write_direct_gbps"] = _div(nbytes / GB, out.get("write_direct_fsync_s"))
    out["read_warm_gbps"] = _div(nbytes / GB, out.get("read_warm_s"))
    out["read_cold_gbps"] = _div(nbytes / GB, out.get("read_cold_s"))
    out["memcpy_gbps"] = _div(nbytes / GB, out.get("memcpy_s"))
    return out


def summarize_system(r: dict[str, Any], floors: dict[str, Any]) -> dict[str, Any]:
    """Medians and floor ratios of one system's save/restore measurements."""
    s: dict[str, Any] = {"system": r.get("system")}
    for k in ("error", "skipped"):
        if k in r:
            s[k] = r[k]
    if "saves" not in r:
        return s
    nbytes = r["nbytes"]
    saves = r["saves"]
    blocking = all(x["persist_s"] < 1e-3 for x in saves)
    s["blocking"] = blocking
    s["stall_s"] = median(x["stall_s"] for x in saves)
    s["commit_s"] = median(x["commit_s"] for x in saves)
    s["persist_s"] = None if blocking else median(x["persist_s"] for x in saves)
    s["memcpy_paired_s"] = median(x["memcpy_s"] for x in saves)
    s["stall_x_memcpy_paired"] = median(x["stall_s"] / x["memcpy_s"] for x in saves)
    s["stall_x_memcpy_floor"] = _div(s["stall_s"], floors.get("memcpy_s"))
    s["persist_gbps"] = _div(nbytes / GB, s["persist_s"])
    s["durable_gbps"] = _div(nbytes / GB, s["commit_s"])
    s["persist_x_write"] = _div(s["persist_gbps"], floors.get("write_gbps"))
    s["durable_x_write"] = _div(s["durable_gbps"], floors.get("write_gbps"))
    s["first_stall_s"] = r["first_save"]["stall_s"]
    s["first_commit_s"] = r["first_save"]["commit_s"]
    s["first_x_later_stall"] = _div(s["first_stall_s"], s["stall_s"])
    s["first_x_later_commit"] = _div(s["first_commit_s"], s["commit_s"])
    ck = r.get("checkpointer_first_save") or {}
    if ck.get("saves") and len(ck["saves"]) >= 2:
        s["ckpt_prepare_s"] = ck.get("prepare_s")
        s.update(_first_vs_later("ckpt", ck["saves"]))
    elif ck.get("error"):
        s["ckpt_error"] = ck["error"]
    fp = r.get("free_prepared_first_save") or {}
    if fp.get("saves") and len(fp["saves"]) >= 2:
        s["free_prepare_s"] = fp.get("prepare_s")
        s.update(_first_vs_later("free_prep", fp["saves"]))
    b2b = ck.get("back_to_back_stall_s") or []
    if len(b2b) >= 3:  # the first two saves after Checkpointer() vs the warm ones after them
        s["ckpt_open_s"] = ck.get("open_s")
        s["ckpt_b2b_early_s"] = max(b2b[:2])
        s["ckpt_b2b_warm_s"] = median(b2b[2:])
        s["ckpt_b2b_x_warm"] = _div(s["ckpt_b2b_early_s"], s["ckpt_b2b_warm_s"])
    s["trainer_rss_extra"] = max(x["trainer_rss_extra"] for x in [r["first_save"], *saves])
    # Steady state: the first save's children peak can include a process start (kept apart).
    s["children_rss_peak"] = max(x["children_rss_peak"] for x in saves)
    s["children_rss_peak_first"] = r["first_save"]["children_rss_peak"]
    s["disk_bytes"] = saves[-1].get("disk_bytes")
    s["restore_warm_s"] = median(r.get("restore_warm_s", []))
    s["restore_cold_s"] = median(r.get("restore_cold_s", []))
    s["restore_warm_x_read"] = _div(floors.get("read_warm_s"), s["restore_warm_s"])
    s["restore_cold_x_read"] = _div(floors.get("read_cold_s"), s["restore_cold_s"])
    s["read_warm_paired_s"] = median(r.get("read_warm_paired_s", []))
    s["restore_warm_x_paired_read"] = median(
        p / w for p, w in zip(r.get("read_warm_paired_s", []), r.get("restore_warm_s", [])))
    s["read_cold_paired_s"] = median(r.get("read_cold_paired_s", []))
    s["restore_cold_x_paired_read"] = median(
        p / c for p, c in zip(r.get("read_cold_paired_s", []), r.get("restore_cold_s", [])))
    s["restore_correct"] = r.get("restore_correct")
    s["restore_first_s"] = r.get("restore_first_s")
    extras = [x.get("extra") for x in saves if x.get("extra")]
    if extras and "persist_gbps" in extras[0]:  # zerostall's own SaveStats
        s["lib_stats"] = {k: median(e.get(k) for e in extras)
                          for k in ("stall_s", "staging_gbps", "persist_s", "persist_gbps", "commit_s", "writer_peak_rss")
                          if any(e.get(k) is not None for e in extras)}
    for vname, v in (r.get("restore_variants") or {}).items():
        s.setdefault("restore_variants", {})[vname] = {
            "warm_s": median(v["warm_s"]), "cold_s": median(v["cold_s"]),
            "warm_x_read": _div(floors.get("read_warm_s"), median(v["warm_s"])),
            "cold_x_read": _div(floors.get("read_cold_s"), median(v["cold_s"]))}
    s["foreign_cores"] = median(x.get("foreign_cores") for x in saves)
    if extras and "call_returned_s" in extras[0]:
        s["call_returned_s"] = median(e["call_returned_s"] for e in extras)
    s["samples"] = len(saves)
    return s


def _first_vs_later(prefix: str, saves: list[dict[str, Any]]) -> dict[str, Any]:
    """The first save after ``prepare()`` against the later ones: raw, and each stall over the
    copy floor paired with it (the mean of the copies right before the save and right after its
    commit, where both were taken: ``benchmarks.zs._paired_saves``). ``<prefix>_first_x_later``
    is the judged figure: the paired stall ratio (the raw one where no pair was taken) or the
    commit ratio, whichever is worse."""
    first, later = saves[0], saves[1:]

    def floor(x: dict[str, Any]) -> float | None:
        # Results without the copy after the save have no floor: their only copy was torch's,
        # before the save, and the first of those faulted its buffer in (seconds at 4 GiB).
        if not (x.get("floor_s") and x.get("floor_after_s")):
            return None
        return (x["floor_s"] + x["floor_after_s"]) / 2

    out: dict[str, Any] = {
        f"{prefix}_first_stall_s": first["stall_s"], f"{prefix}_first_commit_s": first["commit_s"],
        f"{prefix}_later_stall_s": median(x["stall_s"] for x in later),
        f"{prefix}_later_commit_s": median(x["commit_s"] for x in later),
    }
    raw = _div(first["stall_s"], out[f"{prefix}_later_stall_s"])
    commit = _div(first["commit_s"], out[f"{prefix}_later_commit_s"])
    out[f"{prefix}_first_x_later_raw"] = raw
    paired = None
    if all(floor(x) for x in saves):
        out[f"{prefix}_first_floor_s"] = floor(first)
        out[f"{prefix}_later_floor_s"] = median(floor(x) for x in later)
        paired = _div(first["stall_s"] / floor(first), median(x["stall_s"] / floor(x) for x in later))
        out[f"{prefix}_first_x_later_paired"] = paired
    out[f"{prefix}_first_x_later"] = max(paired if paired is not None else raw or 0, commit or 0)
    return out


def summarize_warm_pair(r: dict[str, Any]) -> dict[str, Any]:
    """zerostall's and safetensors' warm loads, alternating in one process (``benchmarks.warm_pair``)."""
    if not r or "warm_s" not in r:
        return {"error": (r or {}).get("error", "not run")}
    w = r["warm_s"]
    return {"zerostall_s": median(w["zerostall"]), "safetensors_s": median(w["safetensors"]),
            "read_s": median(w["read"]), "st_x_zs": r["st_x_zs_median"], "pairs": r["pairs"],
            "st_x_zs_min": min(r["st_x_zs"]), "correct": r.get("correct")}


def summarize_dip(r: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"system": r.get("system")}
    if "error" in r:
        s["error"] = r["error"]
    w = r.get("windows") or []
    if not w:
        return s
    for k in ("lost_s", "lost_iters", "stall_s", "durable_s", "t0_s", "slowdown_during_persist", "window_s",
              "foreign_cores"):
        s[k] = median(x.get(k) for x in w)
    s["samples"] = len(w)
    return s


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per size: floors, systems, dip, and zerostall's ratios to each peer."""
    out: dict[str, Any] = {"meta": results.get("meta", {}), "sizes": {}}
    for size, res in results["sizes"].items():
        floors = summarize_floors(res.get("floors", []))
        systems = {name: summarize_system(r, floors) for name, r in res.get("systems", {}).items()}
        dip = {name: summarize_dip(r) for name, r in res.get("dip", {}).items()}
        out["sizes"][size] = {"floors": floors, "systems": systems, "dip": dip,
                              "vs_peers": _vs_peers(systems, dip)}
        if "warm_pair" in res:
            out["sizes"][size]["warm_pair"] = summarize_warm_pair(res["warm_pair"])
    out["targets"] = targets(out)
    return out


def _vs_peers(systems: dict[str, Any], dip: dict[str, Any]) -> dict[str, Any]:
    """How many times zerostall is better than each peer (peer value / zerostall value)."""
    zs, zd = systems.get("zerostall", {}), dip.get("zerostall", {})
    out: dict[str, Any] = {}
    for name, p in systems.items():
        if name == "zerostall" or "stall_s" not in p or "stall_s" not in zs:
            continue
        out[name] = {
            "stall": _div(p["stall_s"], zs["stall_s"]),
            "commit": _div(p["commit_s"], zs["commit_s"]),
            "restore_warm": _div(p["restore_warm_s"], zs["restore_warm_s"]),
            "restore_cold": _div(p["restore_cold_s"], zs["restore_cold_s"]),
            # a ratio of losses means something only when both are positive
            "lost": _div(dip.get(name, {}).get("lost_s"), zd.get("lost_s"))
            if (dip.get(name, {}).get("lost_s") or 0) > 0 and (zd.get("lost_s") or 0) > 0 else None,
        }
    return out


def _first_detail(zs: dict[str, Any], prefix: str) -> str:
    """The numbers a first-save verdict was judged on."""
    text = (f"first stall {zs[f'{prefix}_first_stall_s']:.3f}s / commit {zs[f'{prefix}_first_commit_s']:.3f}s "
            f"vs later {zs[f'{prefix}_later_stall_s']:.3f}s / {zs[f'{prefix}_later_commit_s']:.3f}s "
            f"(raw stall ratio {_f(zs.get(f'{prefix}_first_x_later_raw'), '{:.2f}')})")
    if zs.get(f"{prefix}_first_x_later_paired") is not None:
        text += (f"; over the paired copy floor ({zs[f'{prefix}_first_floor_s']:.3f}s for the first, "
                 f"{zs[f'{prefix}_later_floor_s']:.3f}s later): {zs[f'{prefix}_first_x_later_paired']:.2f}")
    return text


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the numbers it was judged on."""
    rows: list[dict[str, Any]] = []
    sizes = summary["sizes"]

    def add(name: str, size: str | None, value: float | None, limit: str, ok: bool | None, detail: str) -> None:
        rows.append({"target": name, "size": size, "value": value, "limit": limit,
                     "verdict": _verdict(ok), "detail": detail})

    for size, s in sizes.items():
        zs = s["systems"].get("zerostall", {})
        fl = s["floors"]
        zd = s["dip"].get("zerostall", {})
        peers = {n: d for n, d in s["dip"].items() if n not in ("zerostall", "none") and d.get("lost_s") is not None}
        if zd.get("lost_s") is not None and peers:
            best = min(peers, key=lambda n: peers[n]["lost_s"])
            noise = abs(s["dip"].get("none", {}).get("lost_s") or 0.0)
            v = _div(zd["lost_s"], peers[best]["lost_s"])
            # A ratio to a loss that is not above the method's noise says nothing.
            ok = None if peers[best]["lost_s"] <= 2 * noise or peers[best]["lost_s"] <= 0 else v <= LOST_MAX_X_BEST_PEER
            add("work lost <= 1/3 best peer", size, v, "<= 0.33", ok,
                f"zerostall {zd['lost_s']:.2f}s vs best peer {best} {peers[best]['lost_s']:.2f}s "
                f"(noise control 'none': {s['dip'].get('none', {}).get('lost_s') or float('nan'):.2f}s"
                f"{'; best peer within 2x noise: inconclusive' if ok is None else ''}"
                f"{'; zerostall loss not above the noise' if ok is not None and zd['lost_s'] <= 2 * noise else ''})")
        if "stall_s" not in zs:
            continue
        v = zs["stall_x_memcpy_paired"]
        add("stall <= 1.2x memcpy", size, v, "<= 1.2", v <= STALL_MAX_X_MEMCPY,
            f"stall {zs['stall_s']:.3f}s vs paired memcpy {zs['memcpy_paired_s']:.3f}s "
            f"(vs floors-child memcpy {fl.get('memcpy_s', float('nan')):.3f}s: {zs['stall_x_memcpy_floor'] or float('nan'):.2f}x)")
        v = zs["persist_x_write"]
        add("persist >= 0.9x write+fsync", size, v, ">= 0.9", None if v is None else v >= PERSIST_MIN_X_WRITE,
            f"persist {zs['persist_gbps'] or float('nan'):.2f} GB/s vs buffered write+fsync {fl.get('write_gbps') or float('nan'):.2f} GB/s"
            f" (O_DIRECT floor {fl.get('write_direct_gbps') or float('nan'):.2f} GB/s)")
        # Judged, as the cold one below, against a read of the same files right after each warm
        # restore, under the same conditions (warmed, a quiet wait); the floors child's read of a
        # file it has just written is shown beside it.
        v = zs.get("restore_warm_x_paired_read") or zs["restore_warm_x_read"]
        add("warm restore >= 0.8x warm read", size, v, ">= 0.8", None if v is None else v >= RESTORE_MIN_X_READ,
            f"restore {zs['restore_warm_s']:.3f}s vs read of the same files {_f(zs.get('read_warm_paired_s'))}s "
            f"(vs the floors child's read {fl.get('read_warm_s', float('nan')):.3f}s: "
            f"{_f(zs['restore_warm_x_read'], '{:.2f}')}x)")
        # Judged against a raw read of the same files right after each cold restore (paired, as
        # the stall is): the floors child's file was written buffered, zerostall's with O_DIRECT,
        # and on this VM the host below the virtio disk serves those two differently.
        v = zs.get("restore_cold_x_paired_read") or zs["restore_cold_x_read"]
        add("cold restore >= 0.8x cold read", size, v, ">= 0.8", None if v is None else v >= RESTORE_MIN_X_READ,
            f"restore {zs['restore_cold_s']:.3f}s vs raw read of the same files {_f(zs.get('read_cold_paired_s'))}s "
            f"(vs the floors child's read {fl.get('read_cold_s', float('nan')):.3f}s: "
            f"{_f(zs['restore_cold_x_read'], '{:.2f}')}x)")
        for vname, rv in (zs.get("restore_variants") or {}).items():
            rows.append({"target": f"(info) restore {vname}", "size": size, "value": rv["warm_x_read"],
                         "limit": "-", "verdict": "info",
                         "detail": f"warm {rv['warm_s']:.3f}s ({_f(rv['warm_x_read'], '{:.2f}')}x read), "
                                   f"cold {rv['cold_s']:.3f}s ({_f(rv['cold_x_read'], '{:.2f}')}x read)"})
        if "ckpt_first_x_later" in zs:
            v = zs["ckpt_first_x_later"]
            add("first save <= 2x later", size, v, "<= 2", v <= FIRST_MAX_X_LATER,
                f"Checkpointer + prepare() ({zs['ckpt_prepare_s']:.2f}s, before training): " + _first_detail(zs, "ckpt"))
        if zs.get("ckpt_b2b_x_warm") is not None:
            v = zs["ckpt_b2b_x_warm"]
            add("saves right after Checkpointer() <= 2x warm", size, v, "<= 2", v <= FIRST_MAX_X_LATER,
                f"back to back, no result() between: worst of the first two stalls {zs['ckpt_b2b_early_s']:.3f}s "
                f"vs warm {zs['ckpt_b2b_warm_s']:.3f}s (Checkpointer() itself {_f(zs.get('ckpt_open_s'))}s, "
                "writer start-up included)")
        if zs.get("free_prep_first_x_later") is not None:
            v = zs["free_prep_first_x_later"]
            add("first save <= 2x later (free functions + prepare())", size, v, "<= 2", v <= FIRST_MAX_X_LATER,
                f"zerostall.prepare(state) ({_f(zs.get('free_prepare_s'))}s): " + _first_detail(zs, "free_prep"))
        wp = s.get("warm_pair") or {}
        if wp.get("error"):  # the child ran and failed: said in the table, not left out
            add("warm restore faster than safetensors", size, None, "> 1", None,
                f"the paired child gave no result: {wp['error']}")
        elif "st_x_zs" in wp:
            v = wp["st_x_zs"]
            cross = _div(s["systems"].get("safetensors", {}).get("restore_warm_s"), zs.get("restore_warm_s"))
            add("warm restore faster than safetensors", size, v, "> 1", v > 1 and bool(wp["correct"]),
                f"paired in one process, {wp['pairs']} alternating pairs: zerostall {wp['zerostall_s']:.3f}s vs "
                f"safetensors.load_file + copy_ {wp['safetensors_s']:.3f}s (median of the per-pair ratios; "
                f"worst pair {wp['st_x_zs_min']:.2f}; read of the same files {wp['read_s']:.3f}s); the two "
                f"children's medians, minutes apart: {_f(cross, '{:.2f}')}x"
                + ("" if wp["correct"] else "; the template did NOT hold the state afterwards"))
        peers_cold = {n: p["restore_cold_s"] for n, p in s["systems"].items()
                      if n != "zerostall" and p.get("restore_cold_s") is not None}
        if peers_cold and zs.get("restore_cold_s"):
            fastest = min(peers_cold, key=lambda n: peers_cold[n])
            v = _div(peers_cold[fastest], zs["restore_cold_s"])
            add("cold restore faster than every peer", size, v, "> 1", None if v is None else v > 1,
                f"zerostall {zs['restore_cold_s']:.3f}s vs fastest peer {fastest} {peers_cold[fastest]:.3f}s "
                "(each in its own child; cold reads are disk-bound, and the disk varies less than memory)")
        v = max(zs["first_x_later_stall"] or 0, zs["first_x_later_commit"] or 0)
        rows.append({"target": "(info) first save, free functions (no prepare)", "size": size, "value": v,
                     "limit": "-", "verdict": "info",
                     "detail": f"first stall {zs['first_stall_s']:.3f}s / commit {zs['first_commit_s']:.3f}s vs "
                               f"later {zs['stall_s']:.3f}s / {zs['commit_s']:.3f}s (allocates and faults the "
                               "buffers, starts the writer)"})
    # Cost per byte across sizes. On a shared machine the raw ns/B mostly tracks how busy the
    # machine was at each size, so the verdict uses the ratio to the floor measured at the same
    # size (stall / paired memcpy, commit / O_DIRECT write+fsync); raw ns/B is shown with it.
    pts = [(s["floors"]["nbytes"], s["systems"]["zerostall"], s["floors"]) for s in sizes.values()
           if "stall_s" in s["systems"].get("zerostall", {}) and s["floors"]]
    if len(pts) >= 2:
        pts.sort(key=lambda p: p[0])
        for metric, norm, floor_name in (("stall_s", lambda z, f: z["stall_x_memcpy_paired"], "paired memcpy"),
                                         ("commit_s", lambda z, f: _div(z["commit_s"], f.get("write_direct_fsync_s")),
                                          "O_DIRECT write+fsync")):
            raw = [(n, z[metric] / n * 1e9) for n, z, _ in pts]  # ns per byte
            rel = [(n, norm(z, f)) for n, z, f in pts]
            v = _div(rel[-1][1], rel[0][1])
            add(f"{metric[:-2]} cost per byte flat", None, v, f"x{floor_name} within {FLAT_TOLERANCE}x",
                None if v is None else 1 / FLAT_TOLERANCE <= v <= FLAT_TOLERANCE,
                "x floor: " + ", ".join(f"{n / MiB:.0f} MiB {_f(c, '{:.2f}')}" for n, c in rel)
                + "; raw: " + ", ".join(f"{n / MiB:.0f} MiB {c:.2f} ns/B" for n, c in raw))
    return rows


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def table(summary: dict[str, Any]) -> str:
    """Plain-text tables: floors, systems with floor ratios, dip, zerostall vs peers, targets."""
    lines: list[str] = [
        "columns: xmemcpy = stall / memcpy floor paired with each save; persist = GB/s from the",
        "caller's release to durable; xwrite = that / buffered write+fsync floor (blocking systems:",
        "whole save); 1st/ltr = first commit time / later; rest.1st = first restore in the process;",
        "xread = floor read time / restore time;",
        "+RSS = trainer peak RSS above its pre-save level (first save included); child = peak RSS of",
        "child processes during later saves (shared staging memory counts in both); ok = restored bytes equal; others = CPU cores other",
        "users of the machine kept busy during the measurement (noise flag).",
        "",
    ]
    for size, s in summary["sizes"].items():
        fl = s["floors"]
        lines.append(f"=== state {size}: {fl.get('nbytes', 0) / MiB:.0f} MiB ===")
        if fl:
            lines.append(
                f"floors: memcpy {_f(fl.get('memcpy_s'))}s ({_f(fl.get('memcpy_gbps'), '{:.1f}')} GB/s; fresh "
                f"{_f(fl.get('memcpy_fresh_s'))}s) | write+fsync {_f(fl.get('write_fsync_s'))}s "
                f"({_f(fl.get('write_gbps'), '{:.2f}')} GB/s; O_DIRECT {_f(fl.get('write_direct_gbps'), '{:.2f}')} GB/s) | "
                f"read warm {_f(fl.get('read_warm_s'))}s cold {_f(fl.get('read_cold_s'))}s")
        hdr = (f"{'system':<18}{'stall s':>9}{'xmemcpy':>9}{'commit s':>9}{'persist':>9}{'xwrite':>8}"
               f"{'1st/ltr':>8}{'rest.1st':>9}{'rest.warm':>10}{'xread':>7}{'rest.cold':>10}{'xread':>7}"
               f"{'+RSS MiB':>9}{'child MiB':>10}{'ok':>4}{'others':>7}")
        lines.append(hdr)
        lines.append("-" * len(hdr))
        for name, r in s["systems"].items():
            if "stall_s" not in r:
                lines.append(f"{name:<18}{r.get('error') or r.get('skipped') or 'no result'}")
                continue
            persist = "blocking" if r["blocking"] else _f(r["persist_gbps"], "{:.2f}G")
            lines.append(
                f"{name:<18}{_f(r['stall_s']):>9}{_f(r['stall_x_memcpy_paired'], '{:.2f}'):>9}"
                f"{_f(r['commit_s']):>9}{persist:>9}"
                f"{_f(r['persist_x_write'] if not r['blocking'] else r['durable_x_write'], '{:.2f}'):>8}"
                f"{_f(r['first_x_later_commit'], '{:.2f}'):>8}{_f(r.get('restore_first_s')):>9}"
                f"{_f(r['restore_warm_s']):>10}{_f(r['restore_warm_x_read'], '{:.2f}'):>7}"
                f"{_f(r['restore_cold_s']):>10}{_f(r['restore_cold_x_read'], '{:.2f}'):>7}"
                f"{r['trainer_rss_extra'] / MiB:>9.0f}{r['children_rss_peak'] / MiB:>10.0f}"
                f"{'y' if r.get('restore_correct') else 'NO':>4}{_f(r.get('foreign_cores'), '{:.1f}'):>7}")
        if s["dip"]:
            lines.append("")
            lines.append("training dip (one save during training; lost = stall + slowed iterations):")
            h2 = (f"{'system':<18}{'iter ms':>8}{'stall s':>9}{'durable s':>10}{'slowdown':>9}{'lost s':>8}"
                  f"{'lost it':>8}{'others':>7}")
            lines.append(h2)
            lines.append("-" * len(h2))
            for name, d in s["dip"].items():
                if "lost_s" not in d:
                    lines.append(f"{name:<18}{d.get('error', 'no result')}")
                    continue
                lines.append(
                    f"{name:<18}{_f(d['t0_s'] * 1e3, '{:.0f}'):>8}{_f(d['stall_s']):>9}{_f(d['durable_s'], '{:.2f}'):>10}"
                    f"{_f(d['slowdown_during_persist'], '{:.2f}x'):>9}{_f(d['lost_s'], '{:.2f}'):>8}{_f(d['lost_iters'], '{:.1f}'):>8}"
                    f"{_f(d.get('foreign_cores'), '{:.1f}'):>7}")
        if s["vs_peers"]:
            lines.append("")
            lines.append("zerostall vs each peer (peer / zerostall; >1 means zerostall is better):")
            for name, v in s["vs_peers"].items():
                lines.append(f"  {name:<18} stall {_f(v['stall'], '{:.1f}x')}  commit {_f(v['commit'], '{:.2f}x')}  "
                             f"restore warm {_f(v['restore_warm'], '{:.2f}x')} cold {_f(v['restore_cold'], '{:.2f}x')}  "
                             f"lost/save {_f(v['lost'], '{:.1f}x')}")
        lines.append("")
    if summary["targets"]:
        lines.append("targets:")
        for t in summary["targets"]:
            lines.append(f"  [{t['verdict']:>7}] {t['target']:<32} {t['size'] or 'all':<5} "
                         f"{_f(t['value'], '{:.2f}')} ({t['limit']}): {t['detail']}")
    return "\n".join(lines)


def chart(summary: dict[str, Any], png: Path) -> None:
    """Bar chart per size: stall and training work lost per save, per system (linear scale,
    values printed on the bars; a negative loss is noise and is drawn below zero as measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(summary["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        s = summary["sizes"][size]
        names = [n for n, r in s["systems"].items() if "stall_s" in r]
        names += [n for n, d in s["dip"].items() if n not in names and n != "none" and "lost_s" in d]
        stall = [s["systems"].get(n, {}).get("stall_s") for n in names]
        lost = [s["dip"].get(n, {}).get("lost_s") for n in names]
        x = list(range(len(names)))
        b1 = ax.bar([i - 0.2 for i in x], [v or 0 for v in stall], width=0.4, label="stall per save (s)")
        b2 = ax.bar([i + 0.2 for i in x], [v or 0 for v in lost], width=0.4, label="training work lost per save (s)")
        for bars, vals in ((b1, stall), (b2, lost)):
            for bar, v in zip(bars, vals):
                ax.annotate("n/m" if v is None else f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, max(v or 0, 0)),
                            ha="center", va="bottom", fontsize=6)
        memcpy = s["floors"].get("memcpy_s")
        if memcpy:
            ax.axhline(memcpy, color="gray", ls="--", lw=1, label=f"memcpy floor {memcpy:.2f}s")
        noise = s["dip"].get("none", {}).get("lost_s")
        if noise is not None:
            ax.axhline(noise, color="red", ls=":", lw=1, label=f"'none' control loss {noise:.2f}s (noise)")
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"state {size}  (n/m = not measured)", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("zerostall benchmark: stall and training work lost per save (median, lower is better)", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write(results: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Summarize, print the table, write ``results.json`` (raw + summary) and ``chart.png``."""
    summary = summarize(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"raw": results, "summary": summary}, indent=1))
    text = table(summary)
    (out_dir / "table.txt").write_text(text + "\n")
    chart(summary, out_dir / "chart.png")
    print(text)
    return summary


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/results.json")
    data = json.loads(path.read_text())
    write(data.get("raw", data), path.parent)


if __name__ == "__main__":
    main()
