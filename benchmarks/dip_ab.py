"""The training dip, A/B in one process: writer variants alternated window by window, with CPU accounting.

    python benchmarks/dip_ab.py --gib 1 --rounds 4 --dir /tmp/zsab \\
        --config current=ZEROSTALL_WRITER_PIPELINE=threads --config serial=ZEROSTALL_WRITER_PIPELINE=serial

Each ``--config NAME=VAR=VALUE[,VAR=VALUE...]`` is one :class:`zerostall.Checkpointer` whose writer
process was started with those environment variables (``NAME=`` alone: the defaults), all living
in this process; ``nosave`` (a window with no save, the method's noise) is always added. Every
round runs one window per config, in a rotating order, so drift and other users of a shared
machine hit every config alike. A window is ``benchmarks.dip``'s: train ``PRE_S``, save, keep
training until ``POST_S`` after the save is durable; training lost = window - iterations x t0.

Beside the wall-clock loss, each window records what timings on a shared machine cannot hide:

- the writer process's CPU time (user + system) during the window, per thread
  (``/proc/PID/task/*/stat``), and its minor faults and context switches;
- the trainer's own CPU time, involuntary context switches (a trainer thread preempted: with
  OpenMP, the whole parallel region waits for it) and minor faults;
- the VM's steal time during the window (``/proc/stat``): CPU the host took from the vCPUs, which
  on a VM with an emulated disk grows with every byte written (``benchmarks/steal_probe.py``).

Printed per config: medians of lost, stall, durable, writer CPU, trainer preemptions.
With ``--memory-tier K`` every config is a Checkpointer with ``MemoryTier(persist_interval_steps=K)``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRE_S = 1.0
POST_S = 1.0
BASE_S = 2.0
CLK = os.sysconf("SC_CLK_TCK")


def proc_threads(pid: int) -> dict[int, tuple[float, int]]:
    """CPU seconds (user + system) and minor faults of every thread of ``pid``."""
    out: dict[int, tuple[float, int]] = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{base}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the comm: state is fields[0]; minflt is stat field 10 -> index 7; utime 14 -> 11, stime 15 -> 12
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) / CLK, int(fields[7]))
    return out


def proc_total(pid: int) -> tuple[float, int]:
    """CPU seconds and minor faults of ``pid``, threads that have exited included."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0
    return (int(fields[11]) + int(fields[12])) / CLK, int(fields[7])


def proc_ctxt(pid: int) -> tuple[int, int]:
    """Voluntary and involuntary context switches of ``pid`` (all threads)."""
    vol = invol = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
    except OSError:
        pass
    return vol, invol


def _steal() -> float:
    """vCPU time the hypervisor took from this VM so far (``/proc/stat``), seconds."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8]) / CLK


class Config:
    def __init__(self, spec: str, root: Path, state: Any, memory_tier: int | None) -> None:
        import zerostall

        name, _, env = spec.partition("=")
        self.name = name
        pairs = dict(kv.split("=", 1) for kv in env.split(",") if kv) if env else {}
        # lower-case keys are SaveOptions fields (writer_sched=idle); upper-case ones environment variables
        self.options = {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in pairs.items() if k.islower()}
        self.env = {k: v for k, v in pairs.items() if not k.islower()}
        self.ck: Any = None
        self.step = 0
        if name == "nosave":
            return
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            tier = zerostall.MemoryTier(persist_interval_steps=memory_tier) if memory_tier else None
            self.ck = zerostall.Checkpointer(str(root / name), keep_last=1, memory_tier=tier,
                                             save_options=zerostall.SaveOptions(**self.options))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.ck.prepare(tree=state)
        for _ in range(2):  # first saves: buffers faulted, writer warm
            self.save(state).result()

    @property
    def pid(self) -> int | None:
        return None if self.ck is None else self.ck._engine.writer.pid

    def save(self, state: Any) -> Any:
        self.step += 1
        return self.ck.save_pytree_async(self.step, state)


def window(trainer: Any, cfg: Config, state: Any) -> dict[str, Any]:
    base = trainer.run_for(BASE_S)
    pid = cfg.pid
    w0 = proc_threads(pid) if pid else {}
    p0 = proc_total(pid) if pid else (0.0, 0)
    c0 = proc_ctxt(pid) if pid else (0, 0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    st0 = _steal()
    done = threading.Event()
    box: dict[str, Any] = {}
    iters = 0
    start = time.perf_counter()
    while time.perf_counter() - start < PRE_S:
        trainer.step()
        iters += 1
    save_at = time.perf_counter()
    if cfg.ck is None:
        stall = 0.0
        end_at: float | None = start + PRE_S + 2.0 + POST_S
        box["durable_at"] = save_at
    else:
        resp = cfg.save(state)
        stall = time.perf_counter() - save_at

        def waiter() -> None:
            resp.result()
            box["durable_at"] = time.perf_counter()
            box["tiers"] = list(getattr(resp.stats, "tiers", ()))
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        end_at = None
    while True:
        now = time.perf_counter()
        if end_at is None and done.is_set():
            end_at = box["durable_at"] + POST_S
        if end_at is not None and now >= end_at:
            break
        trainer.step()
        iters += 1
    end = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    st1 = _steal()
    w1 = proc_threads(pid) if pid else {}
    p1 = proc_total(pid) if pid else (0.0, 0)
    c1 = proc_ctxt(pid) if pid else (0, 0)
    base += trainer.run_for(BASE_S)
    t0 = statistics.fmean(base)
    per_thread = sorted((w1[t][0] - w0.get(t, (0.0, 0))[0] for t in w1), reverse=True)
    return {
        "config": cfg.name if "memory" not in box.get("tiers", ())
        else f"{cfg.name}/{'persisted' if 'storage' in box['tiers'] else 'memory-only'}",
        "lost_s": (end - start) - iters * t0, "stall_s": stall,
        "durable_s": box["durable_at"] - save_at, "t0_s": t0,
        "writer_cpu_s": p1[0] - p0[0], "writer_threads_cpu_s": [round(x, 3) for x in per_thread if x > 0],
        "writer_minflt": p1[1] - p0[1],
        "writer_vcsw": c1[0] - c0[0], "writer_ivcsw": c1[1] - c0[1],
        "trainer_cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
        "trainer_ivcsw": r1.ru_nivcsw - r0.ru_nivcsw, "trainer_vcsw": r1.ru_nvcsw - r0.ru_nvcsw,
        "trainer_minflt": r1.ru_minflt - r0.ru_minflt, "window_s": end - start,
        "steal_s": st1 - st0,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--memory-tier", type=int, default=None, help="persist every K-th save (MemoryTier)")
    ap.add_argument("--json", default=None, help="write every window here")
    args = ap.parse_args()

    import torch

    from benchmarks.dip import Trainer
    from benchmarks.state import build_state

    torch.set_num_threads(2)
    trainer = Trainer()
    trainer.run_for(1.0)
    state = build_state(int(args.gib * (1 << 30)))
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="dipab-"))
    configs = [Config("nosave", root, state, None)]
    configs += [Config(spec or "default=", root, state, args.memory_tier) for spec in (args.config or ["default="])]
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for cfg in order:
                row = window(trainer, cfg, state)
                rows.append(row)
                print(f"r{r} {row['config']:22} lost {row['lost_s']:.3f} stall {row['stall_s']:.3f} durable "
                      f"{row['durable_s']:.2f} writer cpu {row['writer_cpu_s']:.2f} {row['writer_threads_cpu_s']} "
                      f"flt {row['writer_minflt']} cs {row['writer_vcsw']}/{row['writer_ivcsw']} | trainer cpu "
                      f"{row['trainer_cpu_s']:.2f} ivcsw {row['trainer_ivcsw']} steal {row['steal_s']:.2f} t0 {row['t0_s'] * 1e3:.1f}ms "
                      f"load {row['load']:.1f}", flush=True)
    finally:
        for cfg in configs:
            if cfg.ck is not None:
                cfg.ck.close()
    print(f"\n{args.gib:g} GiB, {args.rounds} rounds; medians")
    for name in dict.fromkeys(x["config"] for x in rows):  # a memory tier's two kinds of save apart
        mine = [x for x in rows if x["config"] == name]
        med = {k: statistics.median(x[k] for x in mine) for k in
               ("lost_s", "stall_s", "durable_s", "writer_cpu_s", "writer_minflt", "writer_ivcsw", "trainer_ivcsw",
                "trainer_cpu_s", "steal_s")}
        losts = " ".join(f"{x['lost_s']:.2f}" for x in mine)
        print(f"  {name:22} lost {med['lost_s']:.3f} s ({losts})  "
              f"stall {med['stall_s']:.3f}  durable {med['durable_s']:.2f}  writer cpu {med['writer_cpu_s']:.2f} s "
              f"flt {med['writer_minflt']:.0f} ivcsw {med['writer_ivcsw']:.0f}  trainer ivcsw {med['trainer_ivcsw']:.0f} "
              f"cpu {med['trainer_cpu_s']:.2f}  steal in window {med['steal_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
