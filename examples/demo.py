"""`make demo`: train, get SIGKILLed right after a save reached the writer, resume, and match an uninterrupted run bit for bit.

1. An uninterrupted reference run (no checkpointing) writes its final parameters.
2. A checkpointed run saves asynchronously every 25 steps. With overlapped staging (the default) a
   save returns before the parameters and optimizer state are copied; the next `optimizer.step()`
   waits for that copy, and the trainer prints `STAGED step N` once every byte of save N is in
   host memory and the writer process has it. This driver SIGKILLs the trainer right after the
   third such line: the guarantee says the writer still commits that step.
3. The driver waits (bounded) for that step's manifest, then lists what is committed.
4. A new process resumes from the newest committed step and trains to the end; the driver reads the
   step it resumed from off its output.
5. The final parameters must equal the reference's exactly, and every claim printed is checked
   against the checkpoint directory (`tests/test_demo.py` runs the same logic, shorter).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, SAVE_EVERY, KILL_AFTER_SAVE = 150, 25, 3
#: how long the orphaned writer may take to commit the save it was handed (it is a few MiB)
COMMIT_WAIT_S = 60.0


@dataclasses.dataclass
class Run:
    rc: int
    lines: list[str]
    killed_after: int | None = None  # the step whose STAGED line triggered the kill
    committed_at_kill: bool | None = None  # that step's manifest existed at the kill


def train(args: list[str], steps: int, save_every: int, kill_after_staged: int | None = None,
          manifest_of=None) -> Run:
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--steps", str(steps), "--save-every", str(save_every),
           "--threads", "1", *args]
    # Bit-exact comparison across processes needs the same floating-point results in every run.
    # With two compute threads they are not: on a busy machine a trainer once computed its first
    # four steps a few ULPs away from the reference (same batches, same RNG states: only the
    # arithmetic differed), although every thread count was fixed. One thread leaves nothing to
    # the scheduler; MKL_CBWR=AUTO is MKL's own reproducibility mode (CNR) on top.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MKL_DYNAMIC="FALSE", OMP_DYNAMIC="FALSE",
               MKL_CBWR="AUTO")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
    run = Run(rc=0, lines=[])
    staged = 0
    assert p.stdout is not None
    for line in p.stdout:
        run.lines.append(line)
        print("   ", line.rstrip(), flush=True)
        m = re.match(r"STAGED step (\d+)", line)
        if m:
            staged += 1
            if kill_after_staged is not None and staged == kill_after_staged:
                p.send_signal(signal.SIGKILL)
                run.killed_after = int(m.group(1))
                run.committed_at_kill = os.path.exists(manifest_of(run.killed_after))
                print(f"    >>> SIGKILL sent to the trainer (pid {p.pid}) right after step {run.killed_after} "
                      f"was handed to the writer", flush=True)
                break
    p.stdout.close()
    run.rc = p.wait()
    return run


REPO = os.path.dirname(HERE)


def draw_timeline(src: str, dst: str) -> str | None:
    """Step durations over wall time, each save's stall and background persist window marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import json

    with open(src) as f:
        tl = json.load(f)
    t0 = tl["steps"][0][1]
    commits = {s: t for s, t in tl["commits"]}
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.plot([t - t0 for _, t, _ in tl["steps"]], [d * 1e3 for _, _, d in tl["steps"]], ".-", lw=0.8, ms=3,
            label="training step time")
    for i, (step, ts, blocked) in enumerate(tl["saves"]):
        end = commits.get(step, ts + blocked)
        ax.axvspan(ts - t0, end - t0, color="tab:orange", alpha=0.25,
                   label="save: staged -> committed (background)" if i == 0 else None)
        ax.axvspan(ts - t0, ts + blocked - t0, color="tab:red", alpha=0.8,
                   label="save: training blocked (stage)" if i == 0 else None)
    ax.set_xlabel("seconds since the first step of the resumed run")
    ax.set_ylabel("ms")
    ax.set_title("zerostall: training step times with checkpoint windows")
    ax.legend(loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    fig.savefig(dst, dpi=110)
    plt.close(fig)
    return dst


@dataclasses.dataclass
class DemoResult:
    killed_after: int  # the step handed to the writer right before the kill
    committed_at_kill: bool  # its manifest already existed when the trainer was killed
    committed: list[int]  # committed steps once the writer was done
    resumed_from: int  # the step the resumed trainer loaded
    equal: bool  # the resumed run's final parameters equal the reference's bit for bit
    tensors: int
    values: int


def committed_steps(ckdir: str) -> list[int]:
    return sorted(int(d[5:]) for d in os.listdir(ckdir)
                  if re.fullmatch(r"step_\d+", d) and os.path.exists(os.path.join(ckdir, d, "manifest.json")))


def run_demo(work: str, steps: int = STEPS, save_every: int = SAVE_EVERY, kill_after: int = KILL_AFTER_SAVE,
             timeline_png: str | None = None) -> DemoResult:
    """Run the four phases in ``work``; raise AssertionError where the guarantee does not hold."""
    ckdir = os.path.join(work, "checkpoints")

    def manifest_of(step: int) -> str:
        return os.path.join(ckdir, f"step_{step:08d}", "manifest.json")

    print("== 1. uninterrupted reference run (no checkpointing)", flush=True)
    assert train(["--out", os.path.join(work, "reference.pt")], steps, save_every).rc == 0

    print("== 2. checkpointed run, killed right after a save was handed to the writer", flush=True)
    run = train(["--dir", ckdir], steps, save_every, kill_after_staged=kill_after, manifest_of=manifest_of)
    assert run.killed_after is not None, "the trainer ended before the save to kill after was staged"
    assert run.committed_at_kill is not None
    killed = run.killed_after
    print(f"    trainer exit status {run.rc} (SIGKILL); step {killed} was "
          f"{'already committed' if run.committed_at_kill else 'still being persisted by the writer'} at the kill",
          flush=True)
    if not run.committed_at_kill:
        # The writer process outlives the trainer and commits what it was handed, then exits.
        deadline = time.monotonic() + COMMIT_WAIT_S
        while not os.path.exists(manifest_of(killed)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(manifest_of(killed)), (
            f"step {killed} was handed to the writer before the kill but is not committed after {COMMIT_WAIT_S:.0f} s")
        print(f"    the orphaned writer committed step {killed} after the kill", flush=True)
    committed = committed_steps(ckdir)
    print(f"    committed steps after the crash: {committed}", flush=True)
    assert committed and committed[-1] == killed, f"newest committed step {committed[-1:]} is not {killed}"

    print("== 3. resume from the newest committed step", flush=True)
    timeline = os.path.join(work, "timeline.json")
    resumed = train(["--dir", ckdir, "--out", os.path.join(work, "resumed.pt"), "--timeline", timeline],
                    steps, save_every)
    assert resumed.rc == 0, f"the resumed trainer exited with {resumed.rc}"
    found = [int(m.group(1)) for line in resumed.lines if (m := re.match(r"resumed from step (\d+)", line))]
    assert found, "the resumed trainer did not report a step to resume from"
    if timeline_png:
        png = draw_timeline(timeline, timeline_png)
        if png:
            print(f"    timeline of the resumed run (step times, save windows): {png}", flush=True)

    print("== 4. compare with the reference", flush=True)
    ref = torch.load(os.path.join(work, "reference.pt"), weights_only=True)
    res = torch.load(os.path.join(work, "resumed.pt"), weights_only=True)
    bad = [k for k in ref if k not in res or not torch.equal(ref[k], res[k])]
    return DemoResult(killed_after=killed, committed_at_kill=run.committed_at_kill, committed=committed,
                      resumed_from=found[0], equal=not bad and ref.keys() == res.keys(), tensors=len(ref),
                      values=sum(v.numel() for v in ref.values()))


def main() -> int:
    work = tempfile.mkdtemp(prefix="zerostall-demo-")
    t0 = time.time()
    try:
        r = run_demo(work, timeline_png=os.path.join(REPO, "out", "demo-timeline.png"))
    except AssertionError as e:
        print(f"FAIL: {e}", flush=True)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not r.equal:
        print("FAIL: the resumed run's parameters differ from the uninterrupted run", flush=True)
        return 1
    if r.resumed_from != r.killed_after:
        print(f"FAIL: resumed from step {r.resumed_from}, not from step {r.killed_after}, the step handed to the "
              f"writer before the kill", flush=True)
        return 1
    print(f"OK: all {r.tensors} tensors ({r.values / 1e6:.2f}M values) equal the uninterrupted run bit for bit; "
          f"the killed run resumed from step {r.resumed_from}, the save it had handed to the writer "
          f"({'committed before' if r.committed_at_kill else 'committed after'} the kill); "
          f"demo took {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
