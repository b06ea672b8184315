"""Run the zerostall benchmark suite: floors, zerostall, peers and the training dip per size.

    python benchmarks/run.py [--sizes 256M,1G,4G] [--repeats 3] [--dir DIR]
                             [--out benchmarks/results] [--quick]

Every measurement runs in its own child process (``python -m benchmarks.<module>``) so that one
system's memory, threads and first-save costs never show up in another's numbers. The floors
run twice per size, before and after the systems, and their samples are pooled, because the
machine is shared and drifts. Results: a table on stdout, ``results.json`` (raw samples and the
summary), ``table.txt`` and ``chart.png`` in ``--out``. Partial results are written after every
size so an interrupted run keeps what it measured. A finished run appends its figures to
``benchmarks/reference/history.csv`` (``--history``; ``--quick`` appends nothing): see
``benchmarks/history.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))

from benchmarks import dip, history, peers, report  # noqa: E402
from benchmarks.measure import log, parse_child_output  # noqa: E402
from benchmarks.state import format_size, parse_size  # noqa: E402

HISTORY = ROOT / "benchmarks" / "reference" / "history.csv"


def child_env() -> dict[str, str]:
    """Children import ``benchmarks`` from the repo root and ``zerostall`` from ``src`` unless it
    is installed; torch gets both cores (the dip is defined with two threads)."""
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "src")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def run_child(module: str, args: list[str], timeout: float) -> dict[str, Any]:
    """Run ``python -m benchmarks.<module> args``; its marked stdout line is the result."""
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout:.0f}s", "cmd": cmd,
                "stdout_tail": (e.stdout or "")[-2000:] if isinstance(e.stdout, str) else ""}
    res = parse_child_output(p.stdout)
    if res is None:
        return {"error": f"child exited {p.returncode} without a result", "cmd": cmd, "stdout_tail": p.stdout[-2000:]}
    res["child_wall_s"] = time.perf_counter() - t0
    return res


def run_hf_trainer(out: Path, scratch: Path, timeout: float) -> dict[str, Any]:
    """``benchmarks/hf_trainer.py`` in its own process: its summary and printed lines, or an error."""
    out.mkdir(parents=True, exist_ok=True)
    dest = out / "hf_trainer.json"
    cmd = [sys.executable, "-m", "benchmarks.hf_trainer", "--out", str(dest), "--dir", str(scratch / "hf")]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s", "cmd": cmd}
    if p.returncode != 0 or not dest.exists():
        return {"error": f"exited {p.returncode} without a result", "cmd": cmd, "stdout_tail": p.stdout[-2000:]}
    summary = json.loads(dest.read_text())["summary"]
    return {"summary": summary, "lines": p.stdout.strip().splitlines()}


def machine() -> dict[str, Any]:
    import psutil

    info: dict[str, Any] = {
        "cpus": os.cpu_count(), "mem_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(), "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                 if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def fs_of(path: Path) -> str | None:
    try:
        import psutil

        best = max((p for p in psutil.disk_partitions(all=True) if str(path).startswith(p.mountpoint)),
                   key=lambda p: len(p.mountpoint))
        return f"{best.fstype} on {best.device} ({best.mountpoint})"
    except (ValueError, OSError):
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256M,1G,4G", help="comma-separated state sizes (default 256M,1G,4G)")
    p.add_argument("--repeats", type=int, default=3, help="measured repetitions per measurement (default 3)")
    p.add_argument("--dir", default=None, help="scratch directory on the disk under test (default: a new dir in /tmp)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where results go")
    p.add_argument("--quick", action="store_true", help="256M only, 1 repeat: a smoke test of the whole suite")
    p.add_argument("--peers", default=",".join(peers.DEFAULT),
                   help=f"peers to measure (default {','.join(peers.DEFAULT)}; all: {','.join(peers.ALL)})")
    p.add_argument("--dip", default=",".join(dip.DEFAULT),
                   help=f"systems for the training dip (default {','.join(dip.DEFAULT)}; 'none' is the noise "
                        f"control; all: {','.join(dip.SYSTEMS)}); empty string skips the dip")
    p.add_argument("--no-zerostall", action="store_true", help="skip zerostall (e.g. before it is importable)")
    p.add_argument("--only-dip", action="store_true", help="floors and the training dip only (no save/restore runs)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face Trainer benchmark")
    p.add_argument("--no-replicas", action="store_true",
                   help="skip the memory tier's replicas and host memory benchmarks (4 ranks on 2 simulated hosts)")
    p.add_argument("--replicas-mib", type=int, default=256,
                   help="MiB of state per rank in the replicas and host memory benchmarks (default 256)")
    p.add_argument("--timeout", type=float, default=1800, help="per child process, seconds")
    p.add_argument("--history", default=str(HISTORY),
                   help="CSV the run's figures are appended to (default benchmarks/reference/history.csv; "
                        "empty: none; --quick: none)")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.repeats, a.history = "256M", 1, ""
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    for s in sizes:
        parse_size(s)  # fail before measuring anything
    peer_names = [s for s in a.peers.split(",") if s]
    dip_names = [s for s in a.dip.split(",") if s]
    bad = [n for n in peer_names if n not in peers.ALL] + [n for n in dip_names if n not in dip.SYSTEMS]
    if bad:
        print(f"unknown system(s): {', '.join(bad)}", file=sys.stderr)
        return 2
    if a.dir:
        Path(a.dir).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="zerostall-bench-", dir=a.dir or "/tmp"))
    out = Path(a.out)
    results: dict[str, Any] = {
        "meta": {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                 "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": history.git_commit(ROOT),
                 "repeats": a.repeats, "scratch": str(scratch),
                 "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ}, "filesystem": fs_of(scratch), "machine": machine()},
        "sizes": {},
    }
    try:
        for size in sizes:
            label = format_size(parse_size(size))
            common = ["--size", size, "--repeats", str(a.repeats), "--dir", str(scratch)]
            res: dict[str, Any] = {"floors": [], "systems": {}, "dip": {}}
            results["sizes"][label] = res
            log(f"== {label}: floors")
            res["floors"].append(run_child("floors", common, a.timeout))
            if not a.no_zerostall and not a.only_dip:
                log(f"== {label}: zerostall")
                res["systems"]["zerostall"] = run_child("zs", common, a.timeout)
                log(f"== {label}: warm restore, zerostall and safetensors paired")
                res["warm_pair"] = run_child("warm_pair", common, a.timeout)
            for name in ([] if a.only_dip else peer_names):
                log(f"== {label}: {name}")
                res["systems"][name] = run_child("peers", [*common, "--system", name], a.timeout)
            for name in dip_names:
                if name == "zerostall" and a.no_zerostall:
                    continue
                log(f"== {label}: dip {name}")
                res["dip"][name] = run_child("dip", [*common, "--system", name], a.timeout)
            log(f"== {label}: floors again")
            res["floors"].append(run_child("floors", common, a.timeout))
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.partial.json").write_text(json.dumps(results, indent=1))
        if not a.no_zerostall and not a.only_dip:
            # the save call of an unchanged tree of many leaves against the work any checkpointer
            # must do (benchmarks/many_leaves.py --targets): printed, and kept in results.json
            log("== save call of an unchanged tree (many_leaves --targets)")
            res_leaves = run_child("many_leaves", ["--targets", "--dir", str(scratch)], a.timeout)
            results["leaf_call"] = res_leaves
            for line in res_leaves.get("lines", [f"no result: {res_leaves.get('error')}"]):
                log(line)
        if not a.no_zerostall and not a.only_dip and not a.no_hf:
            # a Hugging Face Trainer's checkpoint stall, HF's own save against zerostall's, with the
            # memcpy floor of the same bytes in the same run (benchmarks/hf_trainer.py)
            log("== Hugging Face Trainer: HF's own save vs zerostall's")
            results["hf_trainer"] = run_hf_trainer(out, scratch, a.timeout)
            for line in results["hf_trainer"].get("lines", [f"no result: {results['hf_trainer'].get('error')}"]):
                log(line)
        if not a.no_zerostall and not a.only_dip and not a.no_replicas:
            # replication, training lost per save and restore on a new host, 4 ranks on 2 simulated
            # hosts, against a socket copy of the same bytes in the same run (benchmarks/replicas.py)
            log(f"== memory tier replicas: 4 ranks on 2 hosts, {a.replicas_mib} MiB per rank")
            results["replicas"] = run_child("replicas", ["--mib", str(a.replicas_mib)], a.timeout)
            for line in results["replicas"].get("lines", [f"no result: {results['replicas'].get('error')}"]):
                log(line)
        if not a.no_zerostall and not a.only_dip and not a.no_replicas:
            # host memory held per configuration, PSS of the whole job against the same job without
            # zerostall (benchmarks/hostmem.py)
            log(f"== host memory: 4 ranks on 2 hosts, {a.replicas_mib} MiB per rank, PSS against no zerostall")
            results["hostmem"] = run_child("hostmem", ["--mib", str(a.replicas_mib)], a.timeout)
            for line in results["hostmem"].get("lines", [f"no result: {results['hostmem'].get('error')}"]):
                log(line)
        if not a.no_zerostall and not a.only_dip:
            # the parity codec's encode and rebuild rates against a memcpy and a plain XOR of the
            # same bytes in the same run (benchmarks/parity.py)
            log("== parity codec: G = 4 and 8, 256 MiB shares, against memcpy and XOR")
            results["parity"] = run_child("parity", ["--mib", "256"], a.timeout)
            for line in results["parity"].get("lines", [f"no result: {results['parity'].get('error')}"]):
                log(line)
            # signal to durable after a preemption notice, against an O_DIRECT write + fsync of the
            # same bytes in the same directory (benchmarks/preemption.py)
            log("== preemption: signal to durable, 256 MiB")
            results["preemption"] = run_child("preemption", ["--dir", str(scratch)], a.timeout)
            for line in results["preemption"].get("lines", [f"no result: {results['preemption'].get('error')}"]):
                log(line)
            # the same with a rank 0.5 s and 3 s behind at the notice: 2 torchrun ranks of 64 MiB
            log("== preemption with a rank behind: signal to durable, 2 ranks x 64 MiB")
            results["preemption_lag"] = run_child("preemption", ["--dir", str(scratch), "--lag", "0.5", "--lag", "3",
                                                                 "--mib", "64", "--repeats", "2"], a.timeout)
            for line in results["preemption_lag"].get("lines",
                                                      [f"no result: {results['preemption_lag'].get('error')}"]):
                log(line)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary = report.write(results, out)
    (out / "results.partial.json").unlink(missing_ok=True)
    log(f"results in {out}/results.json, table.txt, chart.png")
    if a.history:
        meta = results["meta"]
        n = history.append(Path(a.history), history.rows(meta["started"], meta["git"],
                                                         history.machine_label(meta["machine"]),
                                                         history.cpu_figures(summary)
                                                         + history.extra_figures(results)))
        log(f"{n} figures appended to {a.history}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
