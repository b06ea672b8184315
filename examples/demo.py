"""`make demo`: train, get SIGKILLed in the middle of a save, resume, and match an uninterrupted run bit for bit.

1. An uninterrupted reference run (no checkpointing) writes its final parameters.
2. A checkpointed run saves asynchronously every 25 steps; this driver SIGKILLs it right after
   a save returned, while the background writer is still persisting that save.
3. A new process resumes from the latest committed step and trains to the end.
4. The final parameters must equal the reference's exactly.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, SAVE_EVERY, KILL_AFTER_SAVE = 150, 25, 3


def train(args: list[str], kill_after_saves: int | None = None, on_kill=None) -> int:
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *args]
    # Bit-exact comparison across processes needs the same reduction order in every run: fix the
    # thread counts and stop MKL/OpenMP from shrinking them when the machine is busy.
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", MKL_DYNAMIC="FALSE", OMP_DYNAMIC="FALSE")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
    saves = 0
    assert p.stdout is not None
    for line in p.stdout:
        print("   ", line.rstrip(), flush=True)
        if line.startswith("SAVED"):
            saves += 1
            if kill_after_saves is not None and saves == kill_after_saves:
                p.send_signal(signal.SIGKILL)  # the writer is still persisting this save
                if on_kill is not None:
                    on_kill()
                print(f"    >>> SIGKILL sent to the trainer (pid {p.pid}) right after save #{saves} returned",
                      flush=True)
                break
    return p.wait()


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


def main() -> int:
    work = tempfile.mkdtemp(prefix="zerostall-demo-")
    ckdir = os.path.join(work, "checkpoints")
    try:
        t0 = time.time()
        print("== 1. uninterrupted reference run (no checkpointing)", flush=True)
        assert train(["--out", os.path.join(work, "reference.pt")]) == 0

        print("== 2. checkpointed run, killed during a save", flush=True)
        killed_step = KILL_AFTER_SAVE * SAVE_EVERY
        manifest = os.path.join(ckdir, f"step_{killed_step:08d}", "manifest.json")
        at_kill: list[bool] = []
        rc = train(["--dir", ckdir], kill_after_saves=KILL_AFTER_SAVE,
                   on_kill=lambda: at_kill.append(os.path.exists(manifest)))
        print(f"    trainer exit status {rc} (SIGKILL); step {killed_step} was "
              f"{'already committed' if at_kill and at_kill[0] else 'still being persisted'} at the kill", flush=True)
        deadline = time.time() + 60  # the orphaned writer commits the save it had, then exits
        while not os.path.exists(manifest) and time.time() < deadline:
            time.sleep(0.01)
        print(f"    committed steps after the crash: "
              f"{sorted(d for d in os.listdir(ckdir) if d.startswith('step_'))}", flush=True)

        print("== 3. resume from the latest committed step", flush=True)
        timeline = os.path.join(work, "timeline.json")
        assert train(["--dir", ckdir, "--out", os.path.join(work, "resumed.pt"), "--timeline", timeline]) == 0
        png = draw_timeline(timeline, os.path.join(REPO, "out", "demo-timeline.png"))
        if png:
            print(f"    timeline of the resumed run (step times, save windows): {png}", flush=True)

        print("== 4. compare with the reference", flush=True)
        ref = torch.load(os.path.join(work, "reference.pt"), weights_only=True)
        res = torch.load(os.path.join(work, "resumed.pt"), weights_only=True)
        bad = [k for k in ref if not torch.equal(ref[k], res[k])]
        if bad or ref.keys() != res.keys():
            print(f"FAIL: {len(bad)} tensors differ from the uninterrupted run: {bad[:5]}", flush=True)
            return 1
        n = sum(v.numel() for v in ref.values())
        print(f"OK: all {len(ref)} tensors ({n / 1e6:.2f}M values) equal the uninterrupted run bit for bit "
              f"(the killed run resumed from step {killed_step}); demo took {time.time() - t0:.0f} s", flush=True)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
