"""What the spine must show: staging semantics, crash safety, integrity, and flat memory."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors import safe_open

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import WriterError

sys.path.insert(0, os.path.dirname(__file__))
from _helpers import assert_equal_state, make_state

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("writer", [WriterKind.PROCESS, WriterKind.THREAD])
def test_mutation_right_after_async_return_saves_old_value(ckdir, writer):
    state = make_state(8, seed=1)
    expect = {k: v.clone() for k, v in state["model"].items()}
    r = zerostall.save_pytree_async(ckdir / "c", state, options=SaveOptions(writer=writer))
    for t in state["model"].values():
        t.mul_(-1).add_(7)  # in place, at once
    state["small"].zero_()
    r.result()
    out = zerostall.load_pytree(ckdir / "c")
    for k in expect:
        assert torch.equal(out["model"][k], expect[k])
    assert torch.equal(out["small"], torch.arange(10, dtype=torch.bfloat16))


def _wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still running")


def test_trainer_sigkill_after_async_return_still_commits(ckdir):
    # The writer is held in its write phase until the gate exists, so the trainer dies mid-save
    # (an ordering, not a timing: a slow kill cannot let the save commit first).
    gate = ckdir.parent / "gate"
    env = dict(os.environ, ZEROSTALL_FAULTS=json.dumps({"write": f"wait:{gate}"}))
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "_trainer.py"), str(ckdir), "7", "16"],
                         stdout=subprocess.PIPE, env=env, text=True)
    line = p.stdout.readline()
    assert line.startswith("RETURNED"), line
    writer_pid = int(line.split()[1])
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (ckdir / "step_00000007" / "manifest.json").exists()  # still being written
    gate.touch()
    _wait_gone(writer_pid)  # the writer finishes the save, then exits on its own
    with Checkpointer(ckdir) as ck:
        assert ck.steps() == [7]
        assert_equal_state(ck.load_pytree(), make_state(16, seed=7))


def test_writer_sigkill_mid_save(ckdir, monkeypatch):
    monkeypatch.setenv("ZEROSTALL_FAULTS", json.dumps({"commit": "sleep:5"}))
    ck = Checkpointer(ckdir)  # its writer inherits the fault: every commit waits 5 s
    monkeypatch.delenv("ZEROSTALL_FAULTS")
    try:
        first = make_state(8, seed=1)
        ck.save_pytree(1, first)
        r = ck.save_pytree_async(2, make_state(8, seed=2))
        deadline = time.time() + 30
        while not glob.glob(str(ckdir / ".step_00000002.zs-tmp-*" / "data" / "*")) and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(ck._engine.writer.pid, signal.SIGKILL)
        with pytest.raises(WriterError, match="killed by signal 9"):
            r.result(timeout=30)
        assert ck.steps() == [1]
        assert not (ckdir / "step_00000002").exists()
        assert_equal_state(ck.load_pytree(), first)
        # the next save starts a new writer (without the fault) and succeeds
        ck.save_pytree(3, make_state(8, seed=3))
        assert ck.steps() == [1, 3]
        assert_equal_state(ck.load_pytree(3), make_state(8, seed=3))
    finally:
        ck.close()
    # the dead writer's partial directory is hidden, and removed by the next Checkpointer
    assert glob.glob(str(ckdir / ".step_00000002.zs-tmp-*"))
    with Checkpointer(ckdir) as ck2:
        assert not glob.glob(str(ckdir / ".step_00000002.zs-tmp-*"))
        assert ck2.steps() == [1, 3]


def test_flipped_byte_fails_naming_key_and_safetensors_reads_data(ckdir):
    state = make_state(4, seed=3)
    zerostall.save_pytree(ckdir / "c", state)
    data = glob.glob(str(ckdir / "c" / "data" / "*.safetensors"))
    assert len(data) == 1
    with safe_open(data[0], framework="pt") as f:
        for k, v in state["model"].items():
            assert torch.equal(f.get_tensor(f"pytree/model/{k}"), v)
        assert torch.equal(f.get_tensor("pytree/small"), state["small"])
    man = json.loads((ckdir / "c" / "manifest.json").read_text())
    leaf = next(lf for lf in man["leaves"] if lf["key"] == "pytree/model/layer2.weight")
    with open(data[0], "r+b") as fh:
        fh.seek(leaf["offset"] + leaf["nbytes"] // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(zerostall.errors.ChecksumMismatchError) as ei:
        zerostall.load_pytree(ckdir / "c")
    assert ei.value.key == "pytree/model/layer2.weight"
    assert "layer2.weight" in str(ei.value) and str(ckdir / "c") in str(ei.value)
    # verification can be turned off explicitly
    out = zerostall.load_pytree(ckdir / "c", options=zerostall.LoadOptions(verify=False))
    assert not torch.equal(out["model"]["layer2.weight"], state["model"]["layer2.weight"])


def _rss(pids):
    total = 0
    for pid in pids:
        total += psutil.Process(pid).memory_info().rss
    return total


def test_rss_flat_over_100_async_saves(ckdir):
    state = make_state(16, seed=5)
    with Checkpointer(ckdir, keep_last=2) as ck:
        pids = [os.getpid(), ck._engine.writer.pid]
        samples = []
        for step in range(1, 101):
            for t in state["model"].values():
                t.add_(1)
            ck.save_pytree_async(step, state).result()
            if step in (10, 100):
                samples.append(_rss(pids))
        assert ck._engine.writer.pid == pids[1]  # one writer for all saves
        assert ck.steps() == [99, 100]
    growth = samples[1] - samples[0]
    assert growth < 8 << 20, f"RSS grew by {growth / 2**20:.1f} MiB between save 10 and save 100"


def test_in_flight_limit_two_slots(ckdir):
    opts = SaveOptions(max_in_flight=2)
    with Checkpointer(ckdir, save_options=opts) as ck:
        rs = [ck.save_pytree_async(s, make_state(2, seed=s)) for s in range(1, 6)]
        for r in rs:
            r.result()
        assert ck.steps() == [1, 2, 3, 4, 5]
        assert len(ck._engine.pool._all) == 2


def test_forked_child_does_not_hold_the_writer_socket(ckdir):
    """A fork of the trainer (a DataLoader worker, say) closes its copy of the writer socket, so
    when the trainer is SIGKILLed the writer still sees EOF and exits while the child lives on."""
    script = f"""
import os, sys, time
sys.path.insert(0, {os.path.join(HERE, "..", "..", "src")!r})
import torch, zerostall
ck = zerostall.Checkpointer({str(ckdir)!r})
ck.save_pytree(1, {{"w": torch.ones(4)}})
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(ck._engine.writer.pid, child, flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    writer_pid, child_pid = map(int, p.stdout.readline().split())
    try:
        p.send_signal(signal.SIGKILL)
        p.wait()
        _wait_gone(writer_pid, timeout=30)
        assert psutil.pid_exists(child_pid)  # the child was alive all along
    finally:
        try:
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_writer_runs_niced_and_batch_scheduled(ckdir):
    with Checkpointer(ckdir) as ck:
        ck.save_pytree(1, {"w": torch.ones(4)})
        pid = ck._engine.writer.pid
        assert os.sched_getscheduler(pid) == os.SCHED_BATCH
        assert psutil.Process(pid).nice() >= min(19, psutil.Process().nice() + 10)  # nice caps at 19


def test_writer_sched_idle_is_applied(ckdir):
    with Checkpointer(ckdir, save_options=SaveOptions(writer_sched="idle")) as ck:
        ck.save_pytree(1, {"w": torch.ones(4)})
        assert os.sched_getscheduler(ck._engine.writer.pid) == os.SCHED_IDLE


def test_writer_sched_rejects_unknown_policy():
    with pytest.raises(ValueError, match="writer_sched"):
        SaveOptions(writer_sched="fifo")
