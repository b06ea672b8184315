"""``benchmarks/report.py``'s verdicts that pair a figure with a floor taken in the same moment:
the first save after ``prepare()`` against a copy right before and right after it, and warm
restore against safetensors alternating in one process (``benchmarks/warm_pair.py``).

On this VM a copy into memory runs 1.5-4x slower for a while, every copy in the process alike;
the raw figures counted such a while against zerostall's first save, and compared two children's
loads taken minutes apart.
"""

from __future__ import annotations

from typing import Any

from benchmarks import report


def _saves(rows: list[tuple[float, float, float | None, float | None]]) -> list[dict[str, Any]]:
    out = []
    for stall, commit, before, after in rows:
        x: dict[str, Any] = {"stall_s": stall, "commit_s": commit}
        if after is not None:
            x["floor_s"], x["floor_after_s"] = before, after
        else:
            x["memcpy_s"] = before
        out.append(x)
    return out


def test_a_first_save_slow_with_its_floor_is_judged_on_the_ratio_to_the_floor() -> None:
    # the machine ran every copy 2.5x slower around the first save: the stall did not cost more
    saves = _saves([(0.30, 2.2, 0.60, 0.60), (0.12, 2.1, 0.24, 0.24), (0.12, 2.0, 0.24, 0.24)])
    got = report._first_vs_later("ckpt", saves)
    assert got["ckpt_first_x_later_raw"] == 0.30 / 0.12
    assert abs(got["ckpt_first_x_later_paired"] - 1.0) < 1e-9
    assert abs(got["ckpt_first_x_later"] - 2.2 / 2.05) < 1e-9  # the commit ratio, now the worse one
    assert got["ckpt_first_x_later"] <= report.FIRST_MAX_X_LATER


def test_a_first_save_slow_against_a_steady_floor_still_fails() -> None:
    saves = _saves([(0.30, 2.0, 0.24, 0.25), (0.12, 2.0, 0.24, 0.24), (0.12, 2.0, 0.25, 0.24)])
    got = report._first_vs_later("free_prep", saves)
    assert got["free_prep_first_x_later"] > report.FIRST_MAX_X_LATER
    assert abs(got["free_prep_first_x_later_paired"] - 2.5) < 0.1


def test_without_the_copy_after_the_save_the_raw_ratio_is_judged() -> None:
    # earlier results: their only copy (torch's) was taken before the save, and the first one
    # faulted its buffer in, so it is no floor
    saves = _saves([(0.31, 2.4, 2.23, None), (0.12, 2.1, 0.60, None), (0.13, 2.2, 0.60, None)])
    got = report._first_vs_later("ckpt", saves)
    assert "ckpt_first_x_later_paired" not in got
    assert abs(got["ckpt_first_x_later"] - 0.31 / 0.125) < 1e-9


def _summary(warm_pair: dict[str, Any] | None) -> dict[str, Any]:
    zs = {"stall_s": 0.1, "stall_x_memcpy_paired": 1.0, "memcpy_paired_s": 0.1, "stall_x_memcpy_floor": 1.0,
          "persist_x_write": 1.0, "persist_gbps": 1.0, "restore_warm_s": 0.2, "restore_warm_x_read": 1.5,
          "restore_cold_s": 1.0, "restore_cold_x_read": 1.0, "first_x_later_stall": 10.0,
          "first_x_later_commit": 2.0, "first_stall_s": 1.0, "first_commit_s": 2.0, "commit_s": 1.0}
    size: dict[str, Any] = {"floors": {}, "dip": {}, "systems": {
        "zerostall": zs, "safetensors": {"restore_warm_s": 0.16, "restore_cold_s": 3.0},
        "dcp_save": {"restore_warm_s": 2.0, "restore_cold_s": 0.9}}}
    if warm_pair is not None:
        size["warm_pair"] = report.summarize_warm_pair(warm_pair)
    return {"sizes": {"4G": size}}


def _row(rows: list[dict[str, Any]], target: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["target"] == target), None)


def test_warm_restore_against_safetensors_is_judged_on_the_pairs() -> None:
    # the children's medians say safetensors won (0.16 s against 0.20 s); the pairs say otherwise
    pair = {"pairs": 3, "warm_s": {"zerostall": [0.18, 0.13, 0.19], "safetensors": [0.24, 0.16, 0.25],
                                  "read": [0.3, 0.3, 0.3]},
            "st_x_zs": [0.24 / 0.18, 0.16 / 0.13, 0.25 / 0.19], "st_x_zs_median": 0.24 / 0.18, "correct": True}
    row = _row(report.targets(_summary(pair)), "warm restore faster than safetensors")
    assert row is not None and row["verdict"] == "met", row
    assert "0.80x" in row["detail"]  # the unpaired figure is shown beside it
    slower = {**pair, "st_x_zs": [0.9, 1.2, 0.95], "st_x_zs_median": 0.95}
    assert _row(report.targets(_summary(slower)), "warm restore faster than safetensors")["verdict"] == "NOT met"
    wrong = {**pair, "correct": False}
    assert _row(report.targets(_summary(wrong)), "warm restore faster than safetensors")["verdict"] == "NOT met"
    assert _row(report.targets(_summary(None)), "warm restore faster than safetensors") is None
    failed = _row(report.targets(_summary({"error": "timed out after 1800s"})), "warm restore faster than safetensors")
    assert failed is not None and failed["verdict"] == "n/a" and "timed out" in failed["detail"], failed


def test_cold_restore_is_judged_against_the_fastest_peer() -> None:
    row = _row(report.targets(_summary(None)), "cold restore faster than every peer")
    assert row is not None and row["verdict"] == "NOT met" and "dcp_save" in row["detail"], row
