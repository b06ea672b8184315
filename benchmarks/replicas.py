"""The memory tier's replicas end to end: 4 ranks on 2 simulated hosts, against socket floors.

``python -m benchmarks.replicas [--mib 256] [--saves 3] [--parity] [--out FILE]`` (``make bench`` runs it)

``--parity``: the second job has ``MemoryTier(parity=1)`` instead of ``replicas=1`` (two parity
groups of G = 2: ranks 0, 2 and 1, 3), and the restore rebuilds host B's shares from host A's
shares and parity.

Four gloo ranks, each its own process with its Checkpointer and keeper; ranks 0, 1 on host A and
2, 3 on host B (``ZEROSTALL_HOST_ID``); the job's store is this process's, as torchrun's agent
store. Each rank's state is one float32 tensor of ``--mib`` MiB. Two jobs run the same loop, one
with ``MemoryTier(replicas=0)``, one with ``replicas=1`` (each rank's step also held by the keeper
of the rank one host over):

* **replication**: ``--saves`` memory-only saves waited for with nothing else running; a save's
  ``result()`` latency with replicas minus the same without is the replication of one step, and
  ``--mib`` MiB over it the rate (each of the four ranks sends its step at the same time);
* **training lost per save**: rounds of two segments of fixed steps lasting ``--between-s``
  seconds (default 2: longer than a replicated save takes, as any interval the advisor gives),
  the first without a save, the second starting with an asynchronous memory-only save and
  ending with its ``result()`` (a save still running then would hold the next one, so that wait
  counts as lost); each segment starts with the "optimizer step" writing the state. The loss per
  save is the median over rounds of the second segment's time minus the first's (paired
  segments: this VM's speed drifts). Both jobs run the same rounds, twice: steps that compute on the CPU (matmuls), whose cores the
  keepers' replication takes (reported: keeper CPU seconds per save), and steps that wait as a
  training thread waits on its accelerator (a sleep of the measured step time), which leave the
  cores to the keepers as on a training host;
* **restore on a new host**: host B is lost (trainers and keepers killed), host A's trainers
  die; the job restarts with ranks 2, 3 on host C with empty memory. The time of
  ``latest_step()`` plus ``load_pytree`` on host C's ranks (the fetch from host A's keepers,
  verified, and the load into the template: the model's state, allocated and written before the
  timer, as a restarted job's model is before it loads).

The floor of both the replication and the restore is a plain socket copy of the same bytes
between two processes, measured in the same run (``benchmarks.replica.socket_floor_s``), before
and after the jobs. Since the four ranks' steps cross at once, the run also times four such
copies at once (four pairs of processes; a round lasts as long as its slowest copy): what the
cores of this machine allow the four transfers together, reported beside the target. Targets: replication >= 0.8x the floor's rate, training lost with replicas
<= 1.2x without, restore <= 1.5x the floor. The last line is the JSON summary (marked as
``benchmarks.measure.RESULT_MARKER``, as every benchmark child's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.measure import host_rank_env

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
#: rounds (one save each) of the training-lost loops
LOOP_SAVES = 6
TIMEOUT_S = 120.0


# -- one rank ------------------------------------------------------------------------------------


def _step(x: Any) -> Any:
    """A fixed amount of compute (a few milliseconds of matmuls), the same at every step."""
    import torch

    for _ in range(4):
        x = torch.tanh(x @ x) * 0.5
    return x


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rank_main(phase: str, rank: int, d: str, mib: int, replicas: int, saves: int, out: str,
              between_s: float, parity: bool = False) -> None:
    import torch
    import torch.distributed as dist

    from zerostall import Checkpointer, DistributedOptions, MemoryTier, SaveOptions

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"pg-{phase}-{replicas}", store), rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S))
    opts = SaveOptions(distributed=DistributedOptions(timeout_s=TIMEOUT_S))
    n = (mib << 20) // 4
    ck = Checkpointer(d, save_options=opts,
                      memory_tier=MemoryTier(persist_interval_steps=10**9, linger_s=600,
                                             replicas=0 if parity else replicas, parity=int(parity and replicas > 0)))
    res: dict[str, Any] = {"keeper": ck._engine.writer.pid}
    print("KEEPER", res["keeper"], flush=True)
    if phase == "resume":
        template = {"w": torch.zeros(n), "step": 0}  # the model's state: it exists before the load
        dist.barrier()
        t0 = time.perf_counter()
        start = ck.latest_step()
        t1 = time.perf_counter()
        got = ck.load_pytree(template=template)
        res["restore_s"] = time.perf_counter() - t0
        res["agree_s"], res["load_s"] = t1 - t0, res["restore_s"] - (t1 - t0)
        res["agreed"], res["loaded"], res["adopted"] = start, ck.last_loaded_step, ck._engine.writer.adopted
        res["equal"] = bool(torch.equal(got["w"], torch.full((n,), float(rank + got["step"]))))
        res["keeper_failures"] = [str(e) for e in ck.keeper_failures]
    else:
        w = torch.full((n,), float(rank))
        ck.save_pytree(1, {"w": w, "step": 1})  # the first save allocates the buffers and the links
        lat, step = [], 1
        for _ in range(saves):  # replication: saves waited for, nothing else running
            step += 1
            w.fill_(float(rank + step))
            dist.barrier()
            t0 = time.perf_counter()
            ck.save_pytree(step, {"w": w, "step": step})
            lat.append(time.perf_counter() - t0)
        res["save_latency_s"] = lat
        res["tiers"] = list(ck.stats()[-1].tiers)
        x = torch.randn(256, 256) * 0.05
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(8):
            x = _step(x)
        per_step = torch.tensor([(time.perf_counter() - t0) / 8])
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # every rank runs the same loop
        every = max(1, round(between_s / float(per_step)))
        res["steps_between_saves"] = every
        res["lost"] = {}
        for kind in ("cpu", "wait"):
            def work(x: Any, kind: str = kind, s: float = float(per_step)) -> Any:
                if kind == "wait":  # the step's time spent waiting, as a training thread waits on its accelerator
                    time.sleep(s)
                    return x
                return _step(x)

            dist.barrier()
            keeper_cpu = _cpu_s(res["keeper"])
            plain, saving, held = [], [], {"call": 0.0, "result": 0.0}
            for _ in range(LOOP_SAVES):  # rounds of a segment without a save, then one with
                t0 = time.perf_counter()
                w.fill_(float(rank + step))  # the "optimizer step": it writes the state, saved or not
                for _ in range(every):
                    x = work(x)
                plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                step += 1
                w.fill_(float(rank + step))
                t1 = time.perf_counter()
                pending = ck.save_pytree_async(step, {"w": w, "step": step})
                t2 = time.perf_counter()
                for _ in range(every):
                    x = work(x)
                t3 = time.perf_counter()
                pending.result()  # a save still running when the segment ends holds the next one
                saving.append(time.perf_counter() - t0)
                held["call"] += t2 - t1
                held["result"] += time.perf_counter() - t3
            res["lost"][kind] = {"plain_s": plain, "saving_s": saving,
                                 "keeper_cpu_per_save_s": (_cpu_s(res["keeper"]) - keeper_cpu) / LOOP_SAVES,
                                 "held_per_save_s": {k: v / LOOP_SAVES for k, v in held.items()}}
        res["last_step"] = step
        dist.barrier()
    with open(out, "w") as f:
        json.dump(res, f)
    print("READY", flush=True)
    sys.stdin.read()  # the bench kills this trainer (a lost host) or lets it go
    os._exit(0)  # no close(): nothing is persisted, the bench ends the keepers


# -- the bench -----------------------------------------------------------------------------------


def _start(phase: str, d: Path, hosts: list[str], port: int, a: argparse.Namespace, replicas: int,
           log: Any) -> list[subprocess.Popen[str]]:
    procs = []
    for r, host in enumerate(hosts):
        env = host_rank_env(host, port, ROOT)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.replicas", "--rank", phase, str(r), str(d), str(a.mib),
             str(replicas), str(a.saves), str(d.parent / f"{phase}-{replicas}-{r}.json"), str(a.between_s),
             str(int(a.parity))],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True))
    return procs


def _ready(procs: list[subprocess.Popen[str]]) -> list[int]:
    """Wait for every rank's READY; their keepers' pids."""
    keepers = []
    for p in procs:
        assert p.stdout is not None
        keeper = None
        while True:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a rank exited ({p.wait()}) before it was ready")
            head, _, rest = line.strip().partition(" ")
            if head == "KEEPER":
                keeper = int(rest)
            if head == "READY":
                break
        assert keeper is not None
        keepers.append(keeper)
    return keepers


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _end(procs: list[subprocess.Popen[str]], keepers: list[int]) -> None:
    for p in procs:
        p.kill()
        p.wait()
    _kill(keepers)


def _job(tmp: Path, port: int, a: argparse.Namespace, replicas: int, log: Any) -> dict[str, Any]:
    d = tmp / f"run-{replicas}"
    procs = _start("train", d, ["A", "A", "B", "B"], port, a, replicas, log)
    keepers = _ready(procs)
    ranks = [json.loads((tmp / f"train-{replicas}-{r}.json").read_text()) for r in range(WORLD)]
    out: dict[str, Any] = {"ranks": ranks}
    if not replicas:
        _end(procs, keepers)
        return out
    # host B is lost: its trainers and keepers; host A's trainers die, their keepers linger
    _kill([keepers[2], keepers[3]])
    for p in procs:
        p.kill()
        p.wait()
    time.sleep(1.0)
    procs = _start("resume", d, ["A", "A", "C", "C"], port, a, replicas, log)
    new_keepers = _ready(procs)
    out["resume"] = [json.loads((tmp / f"resume-{replicas}-{r}.json").read_text()) for r in range(WORLD)]
    _end(procs, keepers + new_keepers)
    return out


def concurrent_floor_s(n: int, repeats: int) -> list[float]:
    """Per round, the slowest of ``WORLD`` plain socket copies of ``n`` bytes run at once (each
    pair of processes as :func:`benchmarks.replica.socket_floor_s`)."""
    import multiprocessing

    from benchmarks.replica import socket_floor_s

    with multiprocessing.get_context("fork").Pool(WORLD) as pool:
        per_pair = pool.starmap(socket_floor_s, [(n, repeats)] * WORLD)
    return [max(r) for r in zip(*per_pair, strict=True)]


def summarize(mib: int, floors: list[float], jobs: dict[int, dict[str, Any]],
              together: list[float] | None = None) -> dict[str, Any]:
    n = mib << 20
    floor = statistics.median(floors)
    s: dict[str, Any] = {"mib_per_rank": mib, "ranks": WORLD, "hosts": 2, "floor_s": floor,
                         "floor_gbps": n / floor / 1e9, "floors_s": floors}
    if together:
        s["floor_together_s"] = statistics.median(together)
        s["floors_together_s"] = together
    lat = {k: statistics.median(x for r in j["ranks"] for x in r["save_latency_s"]) for k, j in jobs.items()}
    s["memory_save_s"], s["replicated_save_s"] = lat[0], lat[1]
    rep = max(lat[1] - lat[0], 1e-9)
    s["replication_s"] = rep
    s["replication_gbps"] = n / rep / 1e9
    s["replication_x_floor"] = floor / rep
    s["replication_all_ranks_x_floor"] = WORLD * floor / rep  # the four ranks' steps cross at once
    if together:
        s["replication_x_floor_together"] = s["floor_together_s"] / rep
    s["steps_between_saves"] = jobs[1]["ranks"][0]["steps_between_saves"]
    for kind, suffix in (("cpu", ""), ("wait", "_waiting_steps")):
        lost = {k: statistics.median(statistics.median(b - a for a, b in zip(r["lost"][kind]["plain_s"],
                                                                               r["lost"][kind]["saving_s"], strict=True))
                                     for r in j["ranks"]) for k, j in jobs.items()}
        s[f"lost_per_save_s{suffix}"] = {"replicas0": lost[0], "replicas1": lost[1]}
        s[f"keeper_cpu_per_save_s{suffix}"] = {
            f"replicas{k}": statistics.median(r["lost"][kind]["keeper_cpu_per_save_s"] for r in j["ranks"])
            for k, j in jobs.items()}
        s[f"held_per_save_s{suffix}"] = {
            f"replicas{k}": {h: statistics.median(r["lost"][kind]["held_per_save_s"][h] for r in j["ranks"])
                             for h in ("call", "result")} for k, j in jobs.items()}
        # a loss within a millisecond of none is no loss to divide by
        s[f"lost_x_without{suffix}"] = lost[1] / lost[0] if lost[0] > 1e-3 else None
    res = jobs[1]["resume"]
    s["resume"] = [{k: r[k] for k in ("agreed", "loaded", "adopted", "equal", "restore_s", "agree_s", "load_s")}
                   for r in res]
    s["restore_new_host_s"] = max(r["restore_s"] for r in res[2:])
    s["restore_x_floor"] = s["restore_new_host_s"] / floor
    # the job goes on when its slowest rank has loaded: the survivors send the new host's ranks
    # their shares and load their own
    s["restore_survivors_s"] = max(r["restore_s"] for r in res[:2])
    s["restore_job_s"] = max(r["restore_s"] for r in res)
    s["restore_job_x_floor"] = s["restore_job_s"] / floor
    s["restore_ok"] = all(r["equal"] and r["loaded"] == r["agreed"] == jobs[1]["ranks"][0]["last_step"] for r in res)
    s["tiers_with_replicas"] = jobs[1]["ranks"][0]["tiers"]
    return s


def lines(s: dict[str, Any]) -> list[str]:
    lost, cpu, wlost = s["lost_per_save_s"], s["keeper_cpu_per_save_s"], s["lost_per_save_s_waiting_steps"]
    red = s.get("redundancy", "replicas=1")
    return [
        f"{red}, {s['ranks']} ranks on {s['hosts']} hosts, {s['mib_per_rank']} MiB per rank: socket floor "
        f"{s['floor_gbps']:.2f} GB/s ({s['floor_s']:.3f} s, median of {len(s['floors_s'])})",
        f"  replication: {s['replication_gbps']:.2f} GB/s per rank (memory-only save {s['memory_save_s']:.3f} s, "
        f"with {red} {s['replicated_save_s']:.3f} s), {s['replication_x_floor']:.2f}x the floor (target >= 0.8x); "
        f"the {s['ranks']} ranks' steps cross at once: together {s['replication_all_ranks_x_floor']:.2f}x"
        + (f"; {s['ranks']} socket copies at once take {s['floor_together_s']:.3f} s, replication "
           f"{s['replication_x_floor_together']:.2f}x that" if "floor_together_s" in s else ""),
        f"  training lost per save, steps computing on the CPU: {lost['replicas1']:.3f} s with {red}, "
        f"{lost['replicas0']:.3f} s without: "
        + (f"{s['lost_x_without']:.2f}x (target <= 1.2x)" if s["lost_x_without"] is not None else "no loss measured")
        + f"; keeper CPU per save {cpu['replicas1']:.3f} s and {cpu['replicas0']:.3f} s (the cores the trainers use)",
        f"  training lost per save, steps waiting as on an accelerator: {wlost['replicas1']:.3f} s with {red}, "
        f"{wlost['replicas0']:.3f} s without: "
        + (f"{s['lost_x_without_waiting_steps']:.2f}x (target <= 1.2x)"
           if s["lost_x_without_waiting_steps"] is not None else "no loss to compare with"),
        f"  restore after the node loss: the job's (its slowest rank) {s['restore_job_s']:.3f} s, "
        f"{s['restore_job_x_floor']:.2f}x the floor; the new host's ranks {s['restore_new_host_s']:.3f} s, "
        f"{s['restore_x_floor']:.2f}x the floor (target <= 1.5x; of which latest_step() "
        f"{max(r['agree_s'] for r in s['resume'][2:]):.3f} s); the survivors' (sending the shares, loading their "
        f"own) {s['restore_survivors_s']:.3f} s; every rank loaded the newest step bit for bit: {s['restore_ok']}",
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:
        phase, rank, d, mib, replicas, saves, out, between, parity = argv[1:10]
        rank_main(phase, int(rank), d, int(mib), int(replicas), int(saves), out, float(between), parity == "1")
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of state per rank (default 256)")
    p.add_argument("--saves", type=int, default=3, help="saves timed for the replication rate (default 3)")
    p.add_argument("--between-s", type=float, default=2.0,
                   help="seconds of compute between saves in the training-lost loop (default 2)")
    p.add_argument("--floor-repeats", type=int, default=3)
    p.add_argument("--parity", action="store_true", help="MemoryTier(parity=1) instead of replicas=1")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import torch.distributed as dist

    from benchmarks.measure import job_scratch, report
    from benchmarks.replica import socket_floor_s

    n = a.mib << 20
    floors = socket_floor_s(n, a.floor_repeats)
    together = concurrent_floor_s(n, a.floor_repeats)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    with job_scratch("zerostall-replicas-") as (tmp, log):
        jobs = {k: _job(tmp, store.port, a, k, log) for k in (0, 1)}
    floors += socket_floor_s(n, a.floor_repeats)
    together += concurrent_floor_s(n, a.floor_repeats)
    s = summarize(a.mib, floors, jobs, together)
    s["redundancy"] = "parity=1" if a.parity else "replicas=1"
    report(s, lines(s), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
