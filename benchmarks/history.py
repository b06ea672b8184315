"""The figures of every benchmark run, one row each, in ``benchmarks/reference/history.csv``.

Columns: ``date`` (the run's start, UTC), ``commit`` (``git rev-parse --short HEAD`` of the
measured tree), ``machine`` (CPUs, CPU model and memory; the GPU's name for a GPU run),
``figure`` and ``value``. A figure is ``name@size`` for the CPU suite (``make bench``) and
``gpu_name`` for the GPU one (``make bench-gpu``); every value is a ratio against a floor or a
peer measured in the same run (dimensionless), except names ending in ``_s`` (seconds). Rows are
only ever appended, so the file is the figures over time; ``docs/performance.md`` says what each
figure measures.

Nothing here is timed or imports torch: this is bookkeeping on what ``report`` and ``gpu``
computed.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

COLUMNS = ("date", "commit", "machine", "figure", "value")

#: The report's target rows that go into the history, each under a short figure name.
TARGET_FIGURES = {
    "work lost <= 1/3 best peer": "lost_x_best_peer",
    "stall <= 1.2x memcpy": "stall_x_memcpy",
    "persist >= 0.9x write+fsync": "persist_x_write",
    "warm restore >= 0.8x warm read": "warm_restore_x_read",
    "cold restore >= 0.8x cold read": "cold_restore_x_read",
    "first save <= 2x later": "first_save_x_later",
    "first save <= 2x later (free functions + prepare())": "first_save_x_later_free",
    "warm restore faster than safetensors": "warm_safetensors_x_zerostall",
}

#: The GPU suite's save systems whose host-blocked time goes into the history.
GPU_SAVE_SYSTEMS = ("zerostall_overlap", "zerostall_blocking", "dcp_async")


def git_commit(root: Path) -> str | None:
    """The short commit of the tree at ``root``, or None outside a git checkout."""
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_label(machine: Mapping[str, Any]) -> str:
    """``2 CPUs, AMD EPYC, 24 GiB`` from ``run.machine()``'s description."""
    parts = []
    if machine.get("cpus"):
        parts.append(f"{machine['cpus']} CPUs")
    if machine.get("cpu_model"):
        parts.append(str(machine["cpu_model"]))
    if machine.get("mem_bytes"):
        parts.append(f"{machine['mem_bytes'] / (1 << 30):.0f} GiB")
    return ", ".join(parts) or "unknown"


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _ok(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def cpu_figures(summary: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``(figure, value)`` for one ``make bench`` summary (``report.summarize``'s output).

    The target rows named in ``TARGET_FIGURES``, and two comparisons with the peers that every
    summary has: safetensors' warm load over zerostall's, each in its own child
    (``warm_safetensors_x_zerostall_unpaired``), and the fastest peer's cold load over
    zerostall's (``cold_fastest_peer_x_zerostall``). A figure without a value (a system that
    failed, a dip inside the noise with no peer above it) is left out, not written as empty.
    """
    out: list[tuple[str, float]] = []
    for t in summary.get("targets", []):
        name = TARGET_FIGURES.get(t.get("target", ""))
        if name and t.get("size") and _ok(t.get("value")):
            out.append((f"{name}@{t['size']}", float(t["value"])))
    for size, s in summary.get("sizes", {}).items():
        vs = s.get("vs_peers") or {}
        warm = (vs.get("safetensors") or {}).get("restore_warm")
        if _ok(warm):
            out.append((f"warm_safetensors_x_zerostall_unpaired@{size}", float(warm)))
        cold = [v["restore_cold"] for v in vs.values() if _ok(v.get("restore_cold"))]
        if cold:
            out.append((f"cold_fastest_peer_x_zerostall@{size}", min(cold)))
    return out


def extra_figures(results: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``(figure, value)`` of the benchmarks ``make bench`` runs once, not per size: the save call of
    an unchanged tree of many leaves (``benchmarks/many_leaves.py --targets``), a Hugging Face
    Trainer's checkpoint stall (``benchmarks/hf_trainer.py``), the memory tier's replicas against
    their socket floors (``benchmarks/replicas.py``), the host memory each configuration holds
    (``benchmarks/hostmem.py``) and the signal to durable of a preemption, alone and with a rank
    behind (``benchmarks/preemption.py``). A benchmark that failed adds none."""
    out: list[tuple[str, float]] = []
    leaves = results.get("leaf_call") or {}
    for key, name in (("call", "leaf_call_x_floor_checkpointer"), ("free", "leaf_call_x_floor_free")):
        value = (leaves.get("ratios") or {}).get(key)
        if _ok(value):
            out.append((name, float(value)))
    if _ok(leaves.get("speedup_20k")):
        out.append(("leaf_call_20k_speedup", float(leaves["speedup_20k"])))
    hf = (results.get("hf_trainer") or {}).get("summary") or {}
    if _ok(hf.get("stall_ratio")):
        out.append(("hf_trainer_stall_zerostall_x_hf", float(hf["stall_ratio"])))
    if _ok(hf.get("zerostall_stall_s")) and _ok(hf.get("floor_memcpy_s")) and hf["floor_memcpy_s"] > 0:
        out.append(("hf_trainer_stall_zerostall_x_memcpy", float(hf["zerostall_stall_s"]) / float(hf["floor_memcpy_s"])))
    rep = results.get("replicas") or {}
    for key in ("replication_x_floor", "replication_x_floor_together", "lost_x_without", "lost_x_without_waiting_steps",
                "restore_x_floor"):
        if _ok(rep.get(key)):
            out.append((f"replicas_{key}", float(rep[key])))
    pre = results.get("preemption") or {}
    for key in ("held_s", "final_s"):
        if _ok(pre.get(key)) and _ok(pre.get("floor_s")) and pre["floor_s"] > 0:
            out.append((f"preemption_{key[:-2]}_durable_x_floor", float(pre[key]) / float(pre["floor_s"])))
    # with a rank behind: seconds from the moment the lagging rank could reach the final step
    for lag, fig in ((results.get("preemption_lag") or {}).get("lags") or {}).items():
        if _ok(fig.get("final_s")):
            out.append((f"preemption_lag{lag}_final_durable_after_lag_s", float(fig["final_s"]) - float(lag)))
    rep_job = (results.get("replicas") or {}).get("restore_job_x_floor")
    if _ok(rep_job):
        out.append(("replicas_restore_job_x_floor", float(rep_job)))
    for config, fig in ((results.get("hostmem") or {}).get("extra_per_byte") or {}).items():
        for key in ("held_x", "peak_x"):
            if _ok(fig.get(key)):
                out.append((f"hostmem_{config.replace('-', '_')}_{key}", float(fig[key])))
    return out


def gpu_figures(save: Mapping[str, Any] | None, restore: Mapping[str, Any] | None) -> list[tuple[str, float]]:
    """``(figure, value)`` for one ``make bench-gpu`` run: ``benchmarks/gpu.py``'s and
    ``benchmarks/gpu_restore.py``'s ``--out`` JSON (either may be None).

    Saves: each system's median host-blocked time over the pinned device-to-host copy floor
    (``gpu_host_blocked_x_d2h[system]``), overlapped staging's median step increase over the same
    floor and its time to durable. Loads: zerostall's warm and cold loads over the one-thread read
    floor, and safetensors' warm load over zerostall's.
    """
    out: list[tuple[str, float]] = []
    systems = (save or {}).get("systems") or {}
    d2h = (systems.get("floor_d2h") or {}).get("seconds")
    for name in GPU_SAVE_SYSTEMS:
        m = (systems.get(name) or {}).get("median") or {}
        if _ok(d2h) and d2h > 0 and _ok(m.get("host_blocked_s")):
            out.append((f"gpu_host_blocked_x_d2h[{name}]", m["host_blocked_s"] / d2h))
        if name == "zerostall_overlap":
            if _ok(d2h) and d2h > 0 and _ok(m.get("step_increase_s")):
                out.append((f"gpu_step_increase_x_d2h[{name}]", m["step_increase_s"] / d2h))
            if _ok(m.get("durable_s")):
                out.append((f"gpu_durable_s[{name}]", m["durable_s"]))
    loads = (restore or {}).get("systems") or {}
    zs, read, st = (loads.get(n) or {} for n in ("zerostall", "floor_read", "safetensors"))
    for kind in ("warm", "cold"):
        z, r = zs.get(f"{kind}_median_s"), read.get(f"{kind}_median_s")
        if _ok(z) and _ok(r) and z > 0:
            out.append((f"gpu_load_{kind}_x_read", r / z))
    z, s = zs.get("warm_median_s"), st.get("warm_median_s")
    if _ok(z) and _ok(s) and z > 0:
        out.append(("gpu_load_warm_safetensors_x_zerostall", s / z))
    return out


def rows(date: str, commit: str | None, machine: str, figures: Iterable[tuple[str, float]]) -> list[dict[str, str]]:
    """One CSV row per figure of one run."""
    return [{"date": date, "commit": commit or "unknown", "machine": machine, "figure": f, "value": _fmt(v)}
            for f, v in figures]


def append(path: Path, new_rows: list[dict[str, str]]) -> int:
    """Append ``new_rows`` to the CSV at ``path`` (the header first if the file is new or empty);
    returns how many rows were written. Refuses a file whose header is not ``COLUMNS``, so a
    run never appends under someone else's columns."""
    if not new_rows:
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = not path.exists() or path.stat().st_size == 0
    if not fresh:
        with path.open(newline="") as f:
            header = next(csv.reader(f), None)
        if tuple(header or ()) != COLUMNS:
            raise ValueError(f"{path}: header {header} is not {list(COLUMNS)}; not appending")
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        if fresh:
            w.writeheader()
        w.writerows(new_rows)
        f.flush()
        os.fsync(f.fileno())
    return len(new_rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.history gpu SAVE.json [RESTORE.json]``: append a GPU run's figures
    (``make bench-gpu`` runs it after ``gpu.py`` and ``gpu_restore.py``). A file that is missing,
    or a dry run on CPU, records nothing: ``make bench-gpu`` measures nothing without CUDA.

    ``python -m benchmarks.history replicas REPLICAS.json``: append the figures of a standalone
    ``benchmarks/replicas.py --out`` run (``scripts/gpu-session.sh replicas`` on a lent machine),
    under ``make bench``'s names with ``@<MiB per rank>`` added."""
    import argparse
    import json
    import time

    root = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("kind", choices=["gpu", "replicas"])
    p.add_argument("save", type=Path, help="benchmarks/gpu.py --out (benchmarks/replicas.py --out for replicas)")
    p.add_argument("restore", type=Path, nargs="?", help="benchmarks/gpu_restore.py --out")
    p.add_argument("--history", type=Path, default=root / "benchmarks" / "reference" / "history.csv")
    p.add_argument("--commit", default=None, help="the measured commit (default: this checkout's HEAD)")
    p.add_argument("--date", default=None, help="the run's date (default: the save file's modification time, UTC)")
    p.add_argument("--machine", default=None, help="default: the GPU's name and this machine's CPU count")
    a = p.parse_args(argv)
    docs = [json.loads(f.read_text()) if f and f.is_file() else None for f in (a.save, a.restore)]
    if a.kind == "replicas":
        if docs[0] is None:
            print(f"history: no replicas figures in {a.save}; nothing appended")
            return 0
        date = a.date or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.save.stat().st_mtime))
        machine = a.machine or f"{os.cpu_count()} CPUs"
        figures = [(f"{name}@{docs[0]['mib_per_rank']}MiB", value) for name, value in extra_figures({"replicas": docs[0]})]
        n = append(a.history, rows(date, a.commit or git_commit(root), machine, figures))
        print(f"history: {n} replicas figures appended to {a.history}")
        return 0
    if docs[0] is None or str(docs[0].get("device", "cpu")).startswith("cpu"):
        print(f"history: no GPU figures in {a.save}; nothing appended")
        return 0
    date = a.date or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.save.stat().st_mtime))
    machine = a.machine or f"{docs[0]['device']}, {os.cpu_count()} CPUs"
    n = append(a.history, rows(date, a.commit or git_commit(root), machine, gpu_figures(docs[0], docs[1])))
    print(f"history: {n} GPU figures appended to {a.history}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
