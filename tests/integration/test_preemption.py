"""Preemption notices (``Checkpointer(preemption_signals=(signal.SIGTERM,))``) in real processes.

A training loop (``_preempt_trainer.py``) saves every step to the memory tier only. A SIGTERM sent
with ``os.kill`` must make the newest memory-only step durable at once (while the loop is still
inside a long step), then have ``should_save`` true at one final step (the same on every rank),
saved to storage, after which ``ckpt.preempted`` stops the loop. Without the option the SIGTERM
ends the process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from memtier_procs import stop

TRAINER = str(Path(__file__).parent / "_preempt_trainer.py")
DEADLINE_S = 90.0  # generous: only a hang takes this long


class Proc:
    """A trainer process (or ``launcher`` + the trainer) whose stdout lines are collected as they come."""

    def __init__(self, args: list[str], log: Path, launcher: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
        env.pop("ZEROSTALL_FAULTS", None)
        with open(log, "a") as err:  # a keeper writing to a pipe we read would keep it open
            self.p = subprocess.Popen([sys.executable, *launcher, TRAINER, *args], stdout=subprocess.PIPE,
                                      stderr=err, text=True, env=env)
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.strip())

    def seen(self, prefix: str) -> list[str]:
        return [ln for ln in list(self.lines) if ln.startswith(prefix)]

    def finish(self) -> int:
        rc = self.p.wait(timeout=DEADLINE_S)
        self._t.join(timeout=DEADLINE_S)
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def _wait(cond: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _committed(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.iterdir() if p.name.startswith("step_") and (p / "manifest.json").exists())


def _one(proc: Proc, prefix: str) -> list[str]:
    got = proc.seen(prefix)
    assert len(got) == 1, (prefix, proc.lines[-20:])
    return got[0].split()[1:]


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def test_sigterm_persists_the_memory_only_step_at_once_then_a_final_durable_step(tmp_path: Path) -> None:
    d = tmp_path / "run"
    proc = Proc(["solo", str(d), "3"], tmp_path / "stderr.log")
    try:
        _wait(lambda: proc.seen("HELD"), "step 3 in memory")
        assert _committed(d) == []  # every step so far lives in memory only
        os.kill(proc.p.pid, signal.SIGTERM)
        # The loop is still inside step 3 (waiting for the go file): step 3 reaches storage now.
        _wait(lambda: _committed(d) == [3], "step 3, held only in memory, on storage")
        assert proc.p.poll() is None and not proc.seen("STEP 3")
        (d / "go").touch()
        assert proc.finish() == 0, proc.lines[-20:]
    finally:
        proc.kill()
    assert proc.seen("USER HANDLER")  # the handler installed before zerostall's still ran
    assert _one(proc, "FINAL") == ["4"]  # the first step after the signal
    held, restored = _one(proc, "CLOSED")
    assert held == "3" and restored == "True"
    assert _committed(d) == [3, 4]


def _ranks(tmp_path: Path, pause: int) -> tuple[Path, list[Proc]]:
    d, port = tmp_path / "run", _port()
    return d, [Proc([str(r), "2", str(port), str(d), str(pause)], tmp_path / f"stderr-{r}.log") for r in range(2)]


def test_sigterm_to_one_rank_both_ranks_persist_the_held_step_and_save_the_same_final_step(tmp_path: Path) -> None:
    d, procs = _ranks(tmp_path, pause=3)
    try:
        _wait(lambda: all(p.seen("HELD") for p in procs), "step 3 in memory on both ranks")
        assert _committed(d) == []
        # Only rank 1 is told, while it waits in the all-reduce of step 4 for rank 0 (which waits
        # for the go file): its Python handler cannot run until then, the notice goes out at once.
        os.kill(procs[1].p.pid, signal.SIGTERM)
        _wait(lambda: _committed(d) == [3], "step 3, held only in memory, persisted by both keepers")
        (d / "go").touch()
        assert [p.finish() for p in procs] == [0, 0], [p.lines[-10:] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [_one(p, "FINAL") for p in procs] == [["4"], ["4"]]
    assert [_one(p, "CLOSED") for p in procs] == [["3", "True"], ["3", "True"]]
    assert _committed(d) == [3, 4]


def test_sigterm_to_both_ranks_saves_one_final_step(tmp_path: Path) -> None:
    d, procs = _ranks(tmp_path, pause=0)
    try:
        _wait(lambda: all(p.seen("STEP 5") for p in procs), "five steps on both ranks")
        os.kill(procs[0].p.pid, signal.SIGTERM)  # each rank posts a notice; one agreement follows
        os.kill(procs[1].p.pid, signal.SIGTERM)
        assert [p.finish() for p in procs] == [0, 0], [p.lines[-10:] for p in procs]
    finally:
        for p in procs:
            p.kill()
    finals = [_one(p, "FINAL") for p in procs]
    assert finals[0] == finals[1], finals
    final = int(finals[0][0])
    assert _committed(d)[-1] == final  # the final step is on storage, and nothing newer was saved
    for p in procs:
        assert not p.seen(f"STEP {final}")  # the loop stopped at it


def test_sigterm_to_torchrun_reaches_its_workers_and_both_save_the_same_final_step(tmp_path: Path) -> None:
    """The preemption a scheduler sends: SIGTERM to torchrun, which passes it on to every worker
    and SIGKILLs them 30 s later; the workers persist, save the final step and exit in time."""
    d = tmp_path / "run"
    run = Proc(["env", str(d), "0"], tmp_path / "stderr.log",
               launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
    try:
        _wait(lambda: len(run.seen("STEP 5")) == 2, "five steps on both ranks")
        os.kill(run.p.pid, signal.SIGTERM)
        run.finish()  # torchrun itself reports the signal (SignalException): its code says nothing here
    finally:
        run.kill()
    finals = run.seen("FINAL")
    assert len(finals) == 2 and finals[0] == finals[1], run.lines[-10:]
    final = int(finals[0].split()[1])
    assert _committed(d)[-1] == final
    assert [ln.split()[2] for ln in run.seen("CLOSED")] == ["True", "True"]  # each worker's handler restored


@pytest.mark.parametrize("lag,where", [(0.5, "save"), (3.0, "save"), (3.0, "collective")])
def test_sigterm_to_torchrun_with_a_rank_behind_saves_the_final_step_before_the_kill(
        tmp_path: Path, lag: float, where: str) -> None:
    """Rank 1 is ``lag`` seconds behind when the notice comes: with ``where="save"`` rank 0's
    (persisted, collective) save of step 8 is in flight and needs rank 1's share; with
    ``"collective"`` rank 0 waits inside the training loop's all-reduce for rank 1. No zerostall
    thread waits for another rank while it holds anything, and the notice bounds its waits by
    ``preemption_grace_s`` (20 s), not by the job's ``timeout_s`` (300 s here): both ranks save the
    same final step, persisted, leave through ``ckpt.preempted`` and exit before torchrun's
    SIGKILL (30 s after its SIGTERM); step 8 is durable too."""
    d = tmp_path / "run"
    log = tmp_path / "stderr.log"
    run = Proc(["env", str(d), "0", str(lag), where], log,
               launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
    try:
        _wait(lambda: run.seen("SAVED 8" if where == "save" else "ENTER 9"), "rank 0 at step 8 or 9")
        if where == "collective":
            time.sleep(0.3)  # rank 0 inside the all-reduce, rank 1 still asleep before it
        t0 = time.monotonic()
        os.kill(run.p.pid, signal.SIGTERM)
        run.finish()
        took = time.monotonic() - t0
    finally:
        run.kill()
    finals = run.seen("FINAL")
    assert len(finals) == 2 and finals[0] == finals[1], (run.lines[-10:], log.read_text()[-3000:])
    final = int(finals[0].split()[1])
    assert final >= 9 and final in _committed(d), (final, _committed(d))
    assert 8 in _committed(d)  # the save in flight at the notice committed too
    assert [ln.split()[2] for ln in run.seen("CLOSED")] == ["True", "True"]  # both left the loop and closed
    text = log.read_text()
    assert "forcefully exiting" not in text and took < 25.0, (took, text[-3000:])


def test_a_hung_rank_at_the_notice_is_named_within_half_the_grace_and_the_keepers_persist_the_held_step(
        tmp_path: Path) -> None:
    """Rank 1 is stopped (SIGSTOP: alive, silent) when rank 0 is signalled: rank 0's watcher gives
    up the agreement at half of ``preemption_grace_s`` (not ``timeout_s``); rank 0's next
    ``should_save`` raises ``PreemptionError`` naming rank 1 and the step its memory holds. Rank 1,
    continued later, hears that the agreement was given up and raises too, instead of going on
    alone. Both leave as a crash, and their keepers persist the step both hold (3) together."""
    d, port = tmp_path / "run", _port()
    env = {"ZS_GRACE_S": "6", "ZS_STORE_OUTLIVES": "1"}
    procs = [Proc([str(r), "2", str(port), str(d), "3"], tmp_path / f"stderr-{r}.log", extra_env=env)
             for r in range(2)]
    try:
        _wait(lambda: all(p.seen("HELD") for p in procs), "step 3 in memory on both ranks")
        stop(procs[1].p.pid)
        t0 = time.monotonic()
        os.kill(procs[0].p.pid, signal.SIGTERM)
        log0 = tmp_path / "stderr-0.log"
        _wait(lambda: "did not answer" in log0.read_text(), "rank 0 giving up the agreement")
        gave_up = time.monotonic() - t0
        os.kill(procs[1].p.pid, signal.SIGCONT)
        (d / "go").touch()
        assert [p.finish() for p in procs] == [3, 3], [p.lines[-5:] for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.p.pid, signal.SIGCONT)
            p.kill()
    assert gave_up < 3.0 + 2.0, gave_up  # half of the 6 s grace, plus a margin
    err0 = _one(procs[0], "PREEMPTION_ERROR")
    assert "rank(s) [1] did not answer" in " ".join(err0) and "holds step 3" in " ".join(err0), err0
    assert "gave up the agreement" in " ".join(_one(procs[1], "PREEMPTION_ERROR"))
    _wait(lambda: _committed(d) == [3], "the keepers' persist of step 3 after both trainers ended")
