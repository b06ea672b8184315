"""``benchmarks/history.py``: every benchmark run appends its figures to one CSV (date, commit,
machine, figure, value), so the figures over time are one file and not a directory per run."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from benchmarks import history, report, run


def _summary() -> dict[str, Any]:
    """A one-size summary as ``report.summarize`` makes it: zerostall, two peers and the dip."""
    zs = {"stall_s": 0.1, "stall_x_memcpy_paired": 0.8, "memcpy_paired_s": 0.125, "stall_x_memcpy_floor": 1.0,
          "persist_x_write": 2.5, "persist_gbps": 2.0, "restore_warm_s": 0.2, "restore_warm_x_read": 1.5,
          "restore_cold_s": 1.0, "restore_cold_x_read": 1.25, "first_x_later_stall": 10.0,
          "first_x_later_commit": 2.0, "first_stall_s": 1.0, "first_commit_s": 2.0, "commit_s": 1.0}
    systems = {"zerostall": zs, "safetensors": {"stall_s": 0.5, "commit_s": 0.5, "restore_warm_s": 0.16,
                                                "restore_cold_s": 3.0},
               "dcp_save": {"stall_s": 1.0, "commit_s": 1.0, "restore_warm_s": 2.0, "restore_cold_s": 1.5}}
    dip = {"none": {"lost_s": 0.01}, "zerostall": {"lost_s": 0.1}, "dcp_async_stager": {"lost_s": 0.8}}
    summary: dict[str, Any] = {"sizes": {"4G": {"floors": {}, "systems": systems, "dip": dip,
                                                "vs_peers": report._vs_peers(systems, dip)}}}
    summary["targets"] = report.targets(summary)
    return summary


def _read(path: Path) -> list[list[str]]:
    with path.open(newline="") as f:
        return list(csv.reader(f))


def test_a_run_appends_its_figures_under_one_header(tmp_path: Path) -> None:
    figures = dict(history.cpu_figures(_summary()))
    assert figures["lost_x_best_peer@4G"] == pytest.approx(0.1 / 0.8)
    assert figures["stall_x_memcpy@4G"] == pytest.approx(0.8)
    assert figures["warm_restore_x_read@4G"] == pytest.approx(1.5)
    assert figures["cold_restore_x_read@4G"] == pytest.approx(1.25)
    assert figures["warm_safetensors_x_zerostall_unpaired@4G"] == pytest.approx(0.8)
    assert figures["cold_fastest_peer_x_zerostall@4G"] == pytest.approx(1.5)  # dcp_save, not safetensors
    assert not any(f.startswith("first_save") for f in figures)  # not measured: no row, not an empty one

    path = tmp_path / "h" / "history.csv"
    machine = history.machine_label({"cpus": 2, "cpu_model": "AMD EPYC", "mem_bytes": 24 << 30})
    assert machine == "2 CPUs, AMD EPYC, 24 GiB"
    first = history.rows("2026-11-28T05:50:54Z", "866f76a", machine, figures.items())
    assert history.append(path, first) == len(figures)
    assert history.append(path, history.rows("2026-11-29T00:00:00Z", None, machine, figures.items())) == len(figures)
    lines = _read(path)
    assert lines[0] == list(history.COLUMNS)
    assert len(lines) == 1 + 2 * len(figures)  # one header, then the two runs' rows
    row = dict(zip(lines[0], lines[1 + list(figures).index("lost_x_best_peer@4G")]))
    assert row == {"date": "2026-11-28T05:50:54Z", "commit": "866f76a", "machine": machine,
                   "figure": "lost_x_best_peer@4G", "value": "0.125"}
    assert {r[1] for r in lines[1 + len(figures):]} == {"unknown"}  # no commit: said, not left blank


def test_a_file_with_other_columns_is_not_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    path.write_text("when,what\n2026-11-28,1\n")
    with pytest.raises(ValueError, match="not appending"):
        history.append(path, history.rows("d", "c", "m", [("stall_x_memcpy@1G", 1.0)]))
    assert path.read_text() == "when,what\n2026-11-28,1\n"


def _gpu_save() -> dict[str, Any]:
    med = {"host_blocked_s": 0.0175, "step_increase_s": -0.0022, "durable_s": 2.14, "call_s": 0.017}
    return {"device": "NVIDIA H200", "systems": {
        "floor_d2h": {"seconds": 0.0875}, "zerostall_overlap": {"median": med},
        "zerostall_blocking": {"median": {**med, "host_blocked_s": 0.105}},
        "dcp_async": {"error": "KeyError: <class 'type'>"}}}


def test_gpu_figures_are_ratios_to_the_floors_of_the_same_run() -> None:
    restore = {"systems": {"floor_read": {"warm_median_s": 0.99, "cold_median_s": 3.03},
                           "zerostall": {"warm_median_s": 1.125, "cold_median_s": 3.40},
                           "safetensors": {"warm_median_s": 0.833, "cold_median_s": 3.59}}}
    got = dict(history.gpu_figures(_gpu_save(), restore))
    assert got["gpu_host_blocked_x_d2h[zerostall_overlap]"] == pytest.approx(0.2)
    assert got["gpu_host_blocked_x_d2h[zerostall_blocking]"] == pytest.approx(1.2)
    assert "gpu_host_blocked_x_d2h[dcp_async]" not in got  # it failed: no figure
    assert got["gpu_step_increase_x_d2h[zerostall_overlap]"] == pytest.approx(-0.0022 / 0.0875)
    assert got["gpu_durable_s[zerostall_overlap]"] == pytest.approx(2.14)
    assert got["gpu_load_warm_x_read"] == pytest.approx(0.88)
    assert got["gpu_load_cold_x_read"] == pytest.approx(3.03 / 3.40)
    assert got["gpu_load_warm_safetensors_x_zerostall"] == pytest.approx(0.833 / 1.125)


def test_make_bench_gpu_records_nothing_without_a_gpu_run(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    assert history.main(["gpu", str(tmp_path / "missing.json"), "--history", str(path)]) == 0
    dry = tmp_path / "dry.json"
    dry.write_text(json.dumps({**_gpu_save(), "device": "cpu (dry run: no figures)"}))
    assert history.main(["gpu", str(dry), "--history", str(path)]) == 0
    assert not path.exists()
    real = tmp_path / "gpu.json"
    real.write_text(json.dumps(_gpu_save()))
    assert history.main(["gpu", str(real), str(tmp_path / "no_restore.json"), "--history", str(path),
                         "--commit", "0e6ae43", "--date", "2026-11-27T20:43:27Z", "--machine", "NVIDIA H200, 16 CPUs"]) == 0
    rows = [dict(zip(history.COLUMNS, r)) for r in _read(path)[1:]]
    assert {r["figure"] for r in rows} == {"gpu_host_blocked_x_d2h[zerostall_overlap]",
                                           "gpu_host_blocked_x_d2h[zerostall_blocking]",
                                           "gpu_step_increase_x_d2h[zerostall_overlap]", "gpu_durable_s[zerostall_overlap]"}
    assert all(r["commit"] == "0e6ae43" and r["date"] == "2026-11-27T20:43:27Z" for r in rows)


def test_a_standalone_replicas_run_is_recorded_under_make_bench_names_with_its_size(tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    assert history.main(["replicas", str(tmp_path / "missing.json"), "--history", str(path)]) == 0
    assert not path.exists()
    run = tmp_path / "replicas.json"
    run.write_text(json.dumps({"mib_per_rank": 1024, "replication_x_floor": 0.91, "lost_x_without": None,
                               "lost_x_without_waiting_steps": 1.1, "restore_x_floor": 1.4}))
    assert history.main(["replicas", str(run), "--history", str(path), "--commit", "04a475b",
                         "--date", "2026-11-29T01:00:00Z", "--machine", "16 CPUs"]) == 0
    got = {r[3]: r[4] for r in _read(path)[1:]}
    assert got == {"replicas_replication_x_floor@1024MiB": "0.91", "replicas_lost_x_without_waiting_steps@1024MiB": "1.1",
                   "replicas_restore_x_floor@1024MiB": "1.4"}  # a figure not measured (None) is not recorded


def test_make_bench_appends_to_the_reference_history_and_a_quick_run_does_not() -> None:
    assert Path(run.parse_args([]).history) == run.HISTORY
    assert run.HISTORY.is_file() and _read(run.HISTORY)[0] == list(history.COLUMNS)
    assert run.parse_args(["--quick"]).history == ""
    assert run.parse_args(["--history", ""]).history == ""


def test_the_reference_history_holds_the_figures_the_docs_quote() -> None:
    rows = [dict(zip(history.COLUMNS, r)) for r in _read(run.HISTORY)[1:]]
    assert all(len(r) == len(history.COLUMNS) and r["figure"] and float(r["value"]) == float(r["value"]) for r in rows)
    latest = {r["figure"]: r["value"] for r in rows if r["date"] == "2026-11-28T06:20:12Z"}
    assert latest["lost_x_best_peer@4G"] == "0.2357" and latest["warm_safetensors_x_zerostall@4G"] == "1.226"
    gpu = [r for r in rows if r["figure"] == "gpu_host_blocked_x_d2h[zerostall_overlap]" and r["commit"] == "0e6ae43"]
    assert sorted(r["value"] for r in gpu) == ["0.1982", "0.2398"]


def test_the_once_per_run_benchmarks_add_their_figures_and_a_failed_one_adds_none():
    results = {"leaf_call": {"ratios": {"call": 1.2, "free": 1.4}, "speedup_20k": 2.5},
               "hf_trainer": {"summary": {"stall_ratio": 0.02, "zerostall_stall_s": 0.07, "floor_memcpy_s": 0.5}},
               "replicas": {"replication_x_floor": 0.3, "lost_x_without": 2.0, "restore_x_floor": None,
                            "restore_job_x_floor": 1.7},
               "preemption": {"held_s": 0.3, "final_s": 0.9, "floor_s": 0.2},
               "preemption_lag": {"lags": {"0.5": {"final_s": 0.7}, "3": {"final_s": None}}},
               "hostmem": {"extra_per_byte": {"tier": {"held_x": 2.1, "peak_x": 2.2},
                                              "in-place": {"held_x": 3.6, "peak_x": None}}}}
    assert dict(history.extra_figures(results)) == {
        "leaf_call_x_floor_checkpointer": 1.2, "leaf_call_x_floor_free": 1.4, "leaf_call_20k_speedup": 2.5,
        "hf_trainer_stall_zerostall_x_hf": 0.02, "hf_trainer_stall_zerostall_x_memcpy": 0.07 / 0.5,
        "replicas_replication_x_floor": 0.3, "replicas_lost_x_without": 2.0,  # no loss without: no ratio
        "preemption_held_durable_x_floor": 0.3 / 0.2, "preemption_final_durable_x_floor": 0.9 / 0.2,
        "preemption_lag0.5_final_durable_after_lag_s": 0.7 - 0.5,  # a lag whose final step was never seen: none
        "replicas_restore_job_x_floor": 1.7,
        "hostmem_tier_held_x": 2.1, "hostmem_tier_peak_x": 2.2, "hostmem_in_place_held_x": 3.6}
    assert history.extra_figures({"leaf_call": {"error": "timed out"}, "hf_trainer": {"error": "exited 1"},
                                  "replicas": {"error": "timed out"}, "preemption": {"error": "exited 1"},
                                  "preemption_lag": {"error": "exited 1"}, "hostmem": {"error": "timed out"}}) == []


def test_the_host_memory_benchmark_reports_bytes_held_per_byte_of_state_against_the_job_without_zerostall():
    from benchmarks import hostmem

    mib = 256
    state = hostmem.WORLD * (mib << 20)
    jobs = {"plain": {"held": 10 << 30, "peak": 11 << 30},
            "replicas": {"held": (10 << 30) + 4 * state, "peak": (11 << 30) + 5 * state},
            "in-place": {"held": (10 << 30) + 3 * state, "peak": (11 << 30) + 3 * state}}
    s = hostmem.summarize(mib, jobs)
    assert s["extra_per_byte"] == {"replicas": {"held_x": 4.0, "peak_x": 5.0}, "in-place": {"held_x": 3.0, "peak_x": 3.0}}
    assert hostmem.lines(s)[-1].endswith("3.00x vs 4.00x: met")
    # the limit's job is one rank, measured against one process without zerostall
    one = mib << 20
    jobs |= {"solo": {"held": 1 << 30, "peak": 1 << 30},
             "limit": {"held": (1 << 30) + one // 2, "peak": (1 << 30) + one, "pool_peak": one // 4}}
    s = hostmem.summarize(mib, jobs)
    assert s["extra_per_byte"]["limit"] == {"held_x": 0.5, "peak_x": 1.0, "pool_peak_x": 0.25, "limit_x": 0.25}
    assert "staging pool's peak 0.25x: within the limit" in " ".join(hostmem.lines(s))
