"""Host memory zerostall holds, per configuration: PSS of the whole job against the same job without it.

``python -m benchmarks.hostmem [--mib 256] [--saves 3] [--configs ...] [--out FILE]`` (``make bench`` runs it)

Four gloo ranks, each its own process, ranks 0, 1 on host A and 2, 3 on host B
(``ZEROSTALL_HOST_ID``), the job's store in this process (as torchrun's agent's). Each rank's state
is one float32 tensor of ``--mib`` MiB. One job per configuration:

* ``plain``: the same ranks and state, no zerostall (the baseline every other job is measured against);
* ``storage``: ``Checkpointer(directory)``: every save persisted, no memory tier;
* ``tier``: ``MemoryTier()`` (memory-only saves: ``persist_interval_steps`` is far away);
* ``replicas``: ``MemoryTier(replicas=1)`` (each rank's step also in the keeper of the rank one host over);
* ``in-place``: ``MemoryTier(replicas=1, replicas_in_place=True)`` (that holder keeps one copy, not two);
* ``parity-2``: ``MemoryTier(parity=1)`` on the two hosts: groups of G = 2 (ranks 0, 2 and 1, 3),
  each keeper holding a parity the size of its share;
* ``parity-4``: ``MemoryTier(parity=1)`` with the four ranks on four hosts (A..D): one group of G = 4,
  each keeper holding about a third of its share as parity;
* ``limit``: one rank alone (no torch.distributed: a save in pieces is one rank's), a
  ``Checkpointer(directory, host_memory_limit=state / 4)``: every save in pieces, then a load in
  place; measured against ``solo``, the same process without zerostall, and beside the staging
  pool's own high-water mark (``BufferPool.peak_bytes``), which the limit bounds.

Each job saves ``--saves`` + 1 steps, each waited for (``result()``), then holds still. While it
runs, a sampler here reads the PSS (``/proc/PID/smaps_rollup``) of every process of the job: the
ranks, their keepers or writers, and their children; PSS divides a shared page among the processes
that map it, so the sum counts each page once (a staging buffer mapped by a trainer and its keeper
counts once). Reported per configuration, as bytes per byte of state (the four ranks' states
together): ``held`` = the job's PSS once it holds still minus the ``plain`` job's, and ``peak`` =
the highest PSS sampled during its saves minus the plain job's highest. Nothing passes or fails
but the targets line: ``in-place`` holds less than ``replicas``. The last line is the JSON summary
(``benchmarks.measure.RESULT_MARKER``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.measure import host_rank_env

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
HOSTS = ["A", "A", "B", "B"]
TIMEOUT_S = 120.0
CONFIGS = ("plain", "storage", "tier", "replicas", "in-place", "parity-2", "parity-4", "limit")
#: the four ranks' hosts, where a configuration needs other than HOSTS
CONFIG_HOSTS = {"parity-4": ["A", "B", "C", "D"]}
#: one-process configurations, measured against ``solo``
SOLO = ("solo", "limit")
#: seconds between PSS samples
SAMPLE_S = 0.05


def _limit_main(config: str, d: str, mib: int, saves: int) -> None:
    import torch

    w = torch.full(((mib << 20) // 4,), 1.0)
    if config == "limit":
        from zerostall import Checkpointer

        with Checkpointer(d, host_memory_limit=(mib << 20) // 4) as ck:
            print("WRITER", ck._engine.writer.pid, flush=True)
            for step in range(1, saves + 2):
                w.fill_(float(step))
                ck.save_pytree(step, {"w": w, "step": step})
            ck.load_pytree(template={"w": w, "step": 0})  # a restore, in place
            print("POOL", ck._engine.pool.peak_bytes, flush=True)
            print("READY", flush=True)
            sys.stdin.read()
        return
    print("READY", flush=True)
    sys.stdin.read()


def rank_main(config: str, rank: int, d: str, mib: int, saves: int) -> None:
    if config in SOLO:
        _limit_main(config, d, mib, saves)
        return
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"pg-{config}", store), rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S))
    w = torch.full(((mib << 20) // 4,), float(rank))
    ck = None
    if config != "plain":
        from zerostall import Checkpointer, DistributedOptions, MemoryTier, SaveOptions

        tier = {"storage": None, "tier": MemoryTier(persist_interval_steps=10**9, linger_s=0),
                "replicas": MemoryTier(persist_interval_steps=10**9, linger_s=0, replicas=1),
                "in-place": MemoryTier(persist_interval_steps=10**9, linger_s=0, replicas=1,
                                       replicas_in_place=True),
                "parity-2": MemoryTier(persist_interval_steps=10**9, linger_s=0, parity=1),
                "parity-4": MemoryTier(persist_interval_steps=10**9, linger_s=0, parity=1)}[config]
        ck = Checkpointer(d, save_options=SaveOptions(distributed=DistributedOptions(timeout_s=TIMEOUT_S)),
                          memory_tier=tier)
        print("WRITER", ck._engine.writer.pid, flush=True)
    for step in range(1, saves + 2):
        w.fill_(float(rank + step))
        dist.barrier()
        if ck is not None:
            ck.save_pytree(step, {"w": w, "step": step})
    dist.barrier()
    print("READY", flush=True)
    sys.stdin.read()  # held still until the parent has measured, then closed
    if ck is not None:
        ck.close()
    dist.destroy_process_group()


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def _tree(roots: set[int]) -> set[int]:
    """``roots`` and every process descended from one of them."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, grew = set(roots), True
    while grew:
        grew = False
        for pid, pp in parent.items():
            if pp in out and pid not in out:
                out.add(pid)
                grew = True
    return out


class _Sampler:
    """The job's PSS every :data:`SAMPLE_S` seconds until stopped; the highest seen."""

    def __init__(self, roots: set[int]) -> None:
        self.roots, self.peak = roots, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def now(self) -> int:
        return sum(_pss(p) for p in _tree(self.roots))

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, self.now())

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def _job(config: str, tmp: Path, port: int, a: argparse.Namespace, log: Any) -> dict[str, int]:
    procs = []
    for r, host in enumerate(HOSTS[:1] if config in SOLO else CONFIG_HOSTS.get(config, HOSTS)):
        env = host_rank_env(host, port, ROOT)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.hostmem", "--rank", config, str(r), str(tmp / f"run-{config}"),
             str(a.mib), str(a.saves)], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, text=True))
    roots = {p.pid for p in procs}
    sampler = _Sampler(roots)
    pool = None
    try:
        for p in procs:
            assert p.stdout is not None
            while True:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"{config}: a rank exited ({p.wait()}) before it was ready")
                head, _, rest = line.strip().partition(" ")
                if head == "WRITER":
                    roots.add(int(rest))  # a keeper in a session of its own: counted even if re-parented
                if head == "POOL":
                    pool = int(rest)
                if head == "READY":
                    break
        time.sleep(1.0)  # let the last transfer's buffers settle
        held = sorted(sampler.now() for _ in range(3))[1]
    finally:
        sampler.stop()
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return {"held": held, "peak": sampler.peak, **({"pool_peak": pool} if pool is not None else {})}


def summarize(mib: int, jobs: dict[str, dict[str, int]]) -> dict[str, Any]:
    per: dict[str, dict[str, float]] = {}
    for c, j in jobs.items():
        if c in ("plain", "solo"):
            continue
        solo = c in SOLO
        base, state = jobs["solo" if solo else "plain"], (1 if solo else WORLD) * (mib << 20)
        per[c] = {"held_x": (j["held"] - base["held"]) / state, "peak_x": (j["peak"] - base["peak"]) / state}
        if "pool_peak" in j:
            per[c]["pool_peak_x"] = j["pool_peak"] / state
            per[c]["limit_x"] = 0.25
    return {"mib": mib, "world": WORLD, "hosts": len(set(HOSTS)), "jobs": jobs, "extra_per_byte": per}


def lines(s: dict[str, Any]) -> list[str]:
    out = [f"host memory zerostall holds, {s['world']} ranks x {s['mib']} MiB on {s['hosts']} hosts "
           "(PSS of the whole job minus the same job without zerostall, per byte of state):"]
    for c, v in s["extra_per_byte"].items():
        line = f"  {c:10s} held {v['held_x']:5.2f}x   peak during saves {v['peak_x']:5.2f}x"
        if "limit_x" in v:
            line += (f"   (one rank; host_memory_limit {v['limit_x']:.2f}x, staging pool's peak "
                     f"{v['pool_peak_x']:.2f}x: {'within' if v['pool_peak_x'] <= v['limit_x'] else 'OVER'} the limit; "
                     "the rest is the writer process)")
        out.append(line)
    per = s["extra_per_byte"]
    if "replicas" in per and "in-place" in per:
        less = per["in-place"]["held_x"] < per["replicas"]["held_x"]
        out.append(f"  target: in-place holds less than replicas: {per['in-place']['held_x']:.2f}x vs "
                   f"{per['replicas']['held_x']:.2f}x: {'met' if less else 'NOT met'}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:
        config, rank, d, mib, saves = argv[1:6]
        rank_main(config, int(rank), d, int(mib), int(saves))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of state per rank (default 256)")
    p.add_argument("--saves", type=int, default=3, help="saves after the first (default 3)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {','.join(CONFIGS)}")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    a = p.parse_args(argv)
    asked = [c for c in a.configs.split(",") if c and c not in ("plain", "solo")]
    configs = ["plain", *(["solo"] if any(c in SOLO for c in asked) else []), *asked]
    bad = [c for c in configs if c not in (*CONFIGS, "solo")]
    if bad:
        p.error(f"unknown configuration(s) {bad}; known: {', '.join(CONFIGS)}")
    sys.path.insert(0, str(ROOT / "src"))
    import torch.distributed as dist

    from benchmarks.measure import job_scratch, report

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    with job_scratch("zerostall-hostmem-") as (tmp, log):
        jobs = {c: _job(c, tmp, store.port, a, log) for c in configs}
    s = summarize(a.mib, jobs)
    report(s, lines(s), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
