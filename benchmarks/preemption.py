"""Time from a preemption signal to the newest step being durable.

``python -m benchmarks.preemption [--mib 256] [--repeats 3] [--dir DIR]``

Each repeat starts a training loop in a child process (``--child``): a ``--mib`` MiB state (64
float32 leaves), ``Checkpointer(memory_tier=MemoryTier(...), preemption_signals=(SIGTERM,))``, a
memory-only save every step, steps of 100 ms of simulated compute (a sleep: the cores stay free
for the keeper, as they are for a GPU job). Once a few steps are in memory this process sends
SIGTERM and watches the directory (every 2 ms) for the steps that become committed:

* **signal to held durable**: until the memory-only step the keeper held at the signal is
  committed to storage (the persist zerostall starts at once);
* **signal to final durable**: until the final step (the first step after the signal, saved and
  persisted by the loop before it stops) is committed.

The floor, in the same run: writing the same number of bytes to one new file in the same
directory with ``O_DIRECT`` and ``fsync``-ing it (what any persist of the step costs on this disk). Prints each repeat, the medians and their
ratios to the floor, and a marked JSON line (``benchmarks.run``).

``--lag L`` (repeatable) measures instead a job whose ranks are not in step when the notice comes:
torchrun with 2 gloo ranks of ``--mib`` MiB each, a memory-only save every step and a persisted
one every 4th; rank 1 reaches its (persisted, collective) save of step 8 ``L`` seconds after rank
0, and SIGTERM goes to torchrun as soon as rank 0's ``save_pytree_async(8)`` returned. Reported:
signal to the final step durable, beside ``L`` and the floor (an ``O_DIRECT`` write + fsync of both
ranks' bytes): the final step can be durable no sooner than the lagging rank reaches it. The
job's ``DistributedOptions.timeout_s`` is the default 300 s: only ``preemption_grace_s`` (20 s)
bounds what the notice waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

LEAVES = 64
STEP_S = 0.1
SIGNAL_AT = 4  # steps in memory before the signal


def child(d: str, mib: int) -> None:
    import torch

    from zerostall import Checkpointer, MemoryTier

    n = mib * (1 << 20) // 4 // LEAVES
    state = {f"w{i}": torch.full((n,), float(i)) for i in range(LEAVES)}
    ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=1_000_000, linger_s=0.0),
                      preemption_signals=(signal.SIGTERM,))
    ck.prepare(tree=state)
    for step in range(1, 1_000_000):
        time.sleep(STEP_S)
        state["w0"] += 1.0
        if ck.should_save(step):
            r = ck.save_pytree_async(step, state)
            if step == SIGNAL_AT:
                r.result()
                print("READY", flush=True)
        if ck.preempted:
            break
    p = ck._preemption
    assert p is not None
    ck.close()
    print(json.dumps({"held": p.held_persisted, "final": p.final_step}), flush=True)


LAG_AT, LAG_PERSIST_EVERY = 8, 4


def worker(d: str, mib: int, lag: float) -> None:
    """One torchrun rank of a ``--lag`` trial (RANK, WORLD_SIZE, MASTER_* from torchrun)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from zerostall import Checkpointer, MemoryTier

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    n = mib * (1 << 20) // 4 // LEAVES
    state = {f"w{i}": torch.full((n,), float(i + rank)) for i in range(LEAVES)}
    ck = Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=LAG_PERSIST_EVERY, linger_s=0.0),
                      preemption_signals=(signal.SIGTERM,))
    ck.prepare(tree=state)
    x = torch.ones(1)
    for step in range(1, 1_000_000):
        time.sleep(STEP_S)
        dist.all_reduce(x)
        state["w0"] += 1.0
        if step == LAG_AT and rank == 1:
            time.sleep(lag)
        if ck.should_save(step):
            ck.save_pytree_async(step, state)
            if step == LAG_AT and rank == 0:
                os.write(1, b"SAVED\n")
        if ck.preempted:
            break
    p = ck._preemption
    assert p is not None
    ck.close()
    os.write(1, (json.dumps({"rank": rank, "final": p.final_step}) + "\n").encode())
    dist.destroy_process_group()


def lag_trial(d: Path, mib: int, lag: float) -> dict[str, Any]:
    """One ``--lag`` trial: seconds from the signal to the final step committed (None: never)."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "benchmarks.preemption", "--worker", "--dir", str(d), "--mib", str(mib),
                          "--lag-s", str(lag)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stderr is not None
    while (line := p.stdout.readline()) and line.strip() != "SAVED":
        pass
    if not line:
        p.kill()
        raise RuntimeError(f"the training job did not start: {p.stderr.read()[-2000:]}")
    seen: dict[int, float] = {}
    t0 = time.time()
    os.kill(p.pid, signal.SIGTERM)
    err: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    while p.poll() is None:
        now = time.time()
        for s in _committed(d) - seen.keys():
            seen[s] = now
        time.sleep(0.002)
    out = p.stdout.read().strip().splitlines()
    reader.join(timeout=10)
    now = time.time()
    for s in _committed(d) - seen.keys():
        seen[s] = now
    finals = {json.loads(ln)["final"] for ln in out if ln.startswith("{")}
    final = finals.pop() if len(finals) == 1 else None
    return {"lag_s": lag, "final_step": final, "final_s": seen[final] - t0 if final in seen else None,
            "killed": "forcefully exiting" in "".join(err), "exit_s": now - t0}


def _committed(d: Path) -> set[int]:
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return set()
    return {int(n[5:]) for n in names if n.startswith("step_") and os.path.exists(d / n / "manifest.json")}


def trial(d: Path, mib: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "benchmarks.preemption", "--child", "--dir", str(d), "--mib", str(mib)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if line.strip() != "READY":
        p.kill()
        raise RuntimeError(f"the training child did not start: {line!r}")
    seen: dict[int, float] = {}
    t0 = time.time()
    os.kill(p.pid, signal.SIGTERM)
    while p.poll() is None:
        now = time.time()
        for s in _committed(d) - seen.keys():
            seen[s] = now
        time.sleep(0.002)
    out = p.stdout.read().strip().splitlines()
    now = time.time()
    for s in _committed(d) - seen.keys():
        seen[s] = now
    if p.returncode != 0 or not out:
        raise RuntimeError(f"the training child exited {p.returncode}")
    got = json.loads(out[-1])
    held, final = got["held"], got["final"]
    return {"held_step": held, "final_step": final,
            "held_s": seen[held] - t0 if held in seen else None,
            "final_s": seen[final] - t0 if final in seen else None}


def floor(d: Path, mib: int) -> float:
    """Write ``mib`` MiB to one new file and fsync it (``O_DIRECT`` where the filesystem takes it,
    as zerostall's writer does; buffered otherwise): the disk's cost of any persist of the step."""
    import mmap

    from benchmarks.floors import _write_file, _write_file_direct

    buf = mmap.mmap(-1, mib << 20)  # page-aligned, as O_DIRECT needs
    buf.write(b"\1" * len(buf))  # faulted in before the clock starts
    path = d / "floor.bin"
    t0 = time.perf_counter()
    if not _write_file_direct(path, memoryview(buf), len(buf)):
        _write_file(path, memoryview(buf))
    took = time.perf_counter() - t0
    path.unlink()
    buf.close()
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--lag", type=float, action="append", default=[],
                    help="a job of 2 torchrun ranks, rank 1 this many seconds behind (repeatable)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lag-s", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.dir, a.mib)
        return 0
    if a.worker:
        worker(a.dir, a.mib, a.lag_s)
        return 0
    if a.lag:
        return lags(a)
    base = Path(tempfile.mkdtemp(prefix="zs-preempt-", dir=a.dir))
    trials, floors = [], []
    for i in range(a.repeats):
        floors.append(floor(base, a.mib))
        t = trial(base / f"run{i}", a.mib)
        trials.append(t)
        held_s = "not persisted early" if t["held_s"] is None else f"durable {t['held_s']:.3f} s after the signal"
        print(f"repeat {i}: held step {t['held_step']} {held_s}, final step {t['final_step']} {t['final_s']:.3f} s; "
              f"floor (O_DIRECT write+fsync of {a.mib} MiB) {floors[-1]:.3f} s", flush=True)
    fl = statistics.median(floors)
    helds = [t["held_s"] for t in trials if t["held_s"] is not None]
    if not helds or any(t["final_s"] is None for t in trials):
        print("no figure: a final step, or every held step, was never seen committed", flush=True)
        return 1
    held = statistics.median(helds)
    final = statistics.median(t["final_s"] for t in trials)
    lines = [f"preemption, {a.mib} MiB: signal to held step durable {held:.3f} s ({held / fl:.2f}x the O_DIRECT write+fsync "
             f"floor {fl:.3f} s), signal to final step durable {final:.3f} s ({final / fl:.2f}x); "
             f"median of {a.repeats} ({len(helds)} with a held step persisted early)"]
    print(lines[0], flush=True)
    from benchmarks.measure import RESULT_MARKER

    print(RESULT_MARKER + json.dumps({"mib": a.mib, "held_s": held, "final_s": final, "floor_s": fl,
                                      "trials": trials, "floors": floors, "lines": lines}), flush=True)
    import shutil

    shutil.rmtree(base, ignore_errors=True)
    return 0


def lags(a: argparse.Namespace) -> int:
    """``--lag``: signal to the final step durable with a rank behind, per lag (median of repeats)."""
    base = Path(tempfile.mkdtemp(prefix="zs-preempt-lag-", dir=a.dir))
    floors = [floor(base, 2 * a.mib) for _ in range(a.repeats)]
    fl = statistics.median(floors)
    per: dict[str, Any] = {}
    lines = []
    for lag in a.lag:
        trials = [lag_trial(base / f"lag{lag}-{i}", a.mib, lag) for i in range(a.repeats)]
        for i, t in enumerate(trials):
            print(f"lag {lag:g} s, repeat {i}: final step {t['final_step']} durable "
                  f"{'never' if t['final_s'] is None else format(t['final_s'], '.3f') + ' s'} after the signal; "
                  f"torchrun {'SIGKILLed its workers' if t['killed'] else 'ended'} {t['exit_s']:.1f} s after it",
                  flush=True)
        done = [t["final_s"] for t in trials if t["final_s"] is not None]
        final = statistics.median(done) if done else None
        per[f"{lag:g}"] = {"final_s": final, "trials": trials, "all_durable": len(done) == len(trials),
                           "killed": sum(t["killed"] for t in trials)}
        lines.append(f"preemption with rank 1 {lag:g} s behind, 2 ranks x {a.mib} MiB: signal to final step durable "
                     + ("never" if final is None else f"{final:.3f} s ({final - lag:.3f} s after the lagging rank "
                        f"could reach it; floor {fl:.3f} s)")
                     + f", {len(done)}/{len(trials)} durable, {per[f'{lag:g}']['killed']} SIGKILLed; median of "
                       f"{a.repeats}")
        print(lines[-1], flush=True)
    from benchmarks.measure import RESULT_MARKER

    print(RESULT_MARKER + json.dumps({"mib": a.mib, "floor_s": fl, "floors": floors, "lags": per, "lines": lines}),
          flush=True)
    import shutil

    shutil.rmtree(base, ignore_errors=True)
    return 0 if all(v["all_durable"] for v in per.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
