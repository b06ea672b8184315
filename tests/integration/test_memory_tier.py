"""The memory tier with real processes: a SIGKILLed trainer resumes from its keeper's memory.

The trainers are subprocesses (``_memory_trainer.py``, numpy state only); the test process
itself plays the restarted trainer, so it adopts the keeper the dead trainer left behind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from memtier_procs import (
    DEADLINE_S,
    assert_state,
    keeper_sockets,
    memory_tier,
    parse_trainer_output,
    run_trainer,
    running,
    squatter,
    start_trainer,
    storage_steps,
    wait_for,
)

from zerostall import Checkpointer, LoadOptions, MemoryTier, SaveOptions, WriterKind
from zerostall.commit import step_name
from zerostall.errors import ChecksumMismatchError, MismatchError, MissingKeyError, ZerostallWarning
from zerostall.memtier.instance import INSTANCE_KEY
from zerostall.memtier.messages import Image
from zerostall.memtier.spec import ADDRESS_PREFIX, keeper_address, query_held
from zerostall.persist.faults import ENV as FAULTS_ENV
from zerostall.persist.faults import MARK_ENV

sys.path.insert(0, str(Path(__file__).parent))
from _memory_trainer import state

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "torchrun_ddp.py")


def test_resume_from_memory_after_sigkill(tmp_path: Path) -> None:
    d = tmp_path / "run"
    rc, keeper, saved = run_trainer(d, 1, 7, 3, 60, "kill")
    assert rc == -signal.SIGKILL
    assert saved == {s: ("memory,storage" if s % 3 == 0 else "memory") for s in range(1, 8)}
    # Once its trainer is gone the keeper persists the newest memory-only step.
    wait_for(lambda: 7 in storage_steps(d), "step 7 on storage")
    assert storage_steps(d) == [3, 6, 7]
    assert running(keeper)  # lingering
    # Remove step 7 from storage: what the new trainer restores can only come from memory.
    shutil.rmtree(d / step_name(7))
    with Checkpointer(d, memory_tier=memory_tier()) as ck:
        assert ck._engine.writer.adopted and ck._engine.writer.pid == keeper
        assert ck.memory_step() == 7 and ck.latest_step() == 7 and ck.steps() == [3, 6, 7]
        assert_state(ck.load_pytree(), state(7))
        tmpl = state(0)
        w = tmpl["w"]
        out = ck.load_pytree(template=tmpl)
        assert out["w"] is w and w.tobytes() == state(7)["w"].tobytes()  # in place
        ck.save_pytree(8, state(8))
        assert ck.stats()[-1].tiers == ("memory",)
        assert ck.memory_step() == 8 and 8 not in storage_steps(d)
    # A clean close persists what only memory holds, and the keeper exits without lingering.
    assert 8 in storage_steps(d)
    wait_for(lambda: not running(keeper), "the keeper to exit after close()")
    assert keeper_address(str(d), 0) not in keeper_sockets()
    with Checkpointer(d) as ck:
        assert_state(ck.load_pytree(8), state(8))


def test_linger_expiry_leaves_nothing_behind(tmp_path: Path) -> None:
    d = tmp_path / "run"
    rc, keeper, saved = run_trainer(d, 1, 2, 5, 0.5, "kill")
    assert rc == -signal.SIGKILL and saved == {1: "memory", 2: "memory"}
    wait_for(lambda: not running(keeper), "the keeper to exit after linger_s")
    assert not Path(f"/proc/{keeper}/fd").exists() or not running(keeper)
    assert keeper_address(str(d), 0) not in keeper_sockets()
    # persisted before it left; no temp dirs (the directory's instance marker stays)
    assert sorted(p.name for p in d.iterdir()) == sorted([INSTANCE_KEY, step_name(2)])
    with Checkpointer(d, memory_tier=memory_tier()) as ck:  # no keeper to adopt: a fresh writer
        assert not ck._engine.writer.adopted and ck.memory_step() is None and ck.latest_step() == 2
        assert_state(ck.load_pytree(), state(2))


@pytest.mark.parametrize("run", range(20 if os.environ.get("ZEROSTALL_STRESS") else 3))
def test_kill_during_saves_restores_a_complete_verified_step(tmp_path: Path, run: int) -> None:
    rng = random.Random(run)
    d = tmp_path / "run"
    p = start_trainer(d, 1, 0, 3, 60, "loop")
    assert p.stdout is not None
    lines: list[str] = []
    want = rng.randint(1, 8)
    while sum(1 for x in lines if x.startswith("SAVED")) < want:
        line = p.stdout.readline()
        assert line, "the trainer ended early"
        lines.append(line)
    time.sleep(rng.random() * 0.05)  # a random moment: staging, checksumming or persisting
    p.send_signal(signal.SIGKILL)
    rest, _ = p.communicate(timeout=DEADLINE_S)
    keeper, saved = parse_trainer_output(lines + rest.splitlines())
    newest_saved = max(saved)
    with Checkpointer(d, memory_tier=memory_tier()) as ck:
        assert ck._engine.writer.pid == keeper
        latest = ck.latest_step()
        assert latest is not None and latest >= newest_saved
        assert_state(ck.load_pytree(), state(latest, big=True))
    assert not any(".zs-tmp-" in x.name for x in d.iterdir())


def test_another_user_cannot_connect(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    d = tmp_path / "run"
    os.chmod(tmp_path, 0o755)
    rc, keeper, _ = run_trainer(d, 1, 1, 5, 60, "kill")
    assert rc == -signal.SIGKILL and running(keeper)
    address = keeper_address(str(d), 0)
    # A process of another user finds the keeper's name but is refused: no Hello, no image.
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            import socket
            from multiprocessing.connection import Connection

            from zerostall.memtier.messages import Adopt, ImageQuery
            from zerostall.messages import encode
            os.setgid(65534)
            os.setuid(65534)
            for first in (Adopt(root=str(d), rank=0), ImageQuery()):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(address)
                c = Connection(s.detach())
                try:
                    c.send_bytes(encode(first))
                    got = c.recv_bytes() if c.poll(30) else b"timeout"
                except (EOFError, ConnectionResetError, BrokenPipeError):  # closed on us (unread: a reset)
                    got = b""
                assert got == b"", got
            code = 0
        except BaseException as exc:
            print("child:", repr(exc), file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # ...and the keeper is still ours to adopt.
    with Checkpointer(d, memory_tier=memory_tier()) as ck:
        assert ck._engine.writer.pid == keeper and ck.memory_step() == 1


def test_a_trainer_does_not_adopt_another_users_socket(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    d = tmp_path / "run"
    # (the trainer is told; test_memory_tier_keeperbind.py checks what it is told)
    with (squatter(keeper_address(str(d), 0)), pytest.warns(ZerostallWarning, match="cannot be adopted"),
          Checkpointer(d, memory_tier=memory_tier()) as ck):
        assert not ck._engine.writer.adopted
        ck.save_pytree(1, state(1))
        assert ck.memory_step() == 1  # the memory tier works; only adoption after a crash is lost


def test_memory_tier_options_are_checked(tmp_path: Path) -> None:
    for bad in ({"persist_interval_steps": 0}, {"persist_interval_steps": 1.5}, {"persist_interval_s": 0},
                {"linger_s": -1}):
        with pytest.raises(ValueError):
            MemoryTier(**bad)
    with pytest.raises(ValueError, match="process writer"):
        Checkpointer(tmp_path, memory_tier=MemoryTier(), save_options=SaveOptions(writer=WriterKind.THREAD))
    with pytest.raises(TypeError):
        Checkpointer(tmp_path, memory_tier=3)  # type: ignore[arg-type]
    assert keeper_address(str(tmp_path), 0).startswith(ADDRESS_PREFIX)


def test_persist_interval_s_persists_the_first_save_after_it(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, memory_tier=MemoryTier(persist_interval_steps=1000, persist_interval_s=3600,
                                                      linger_s=0)) as ck:
        ck.save_pytree(1, state(1))
        ck._last_persist -= 3600  # as if an hour had passed
        ck.save_pytree(2, state(2))
        ck.save_pytree(3, state(3))
        assert [s.tiers for s in ck.stats()] == [("memory",), ("memory", "storage"), ("memory",)]
        assert storage_steps(tmp_path) == [2]
        assert ck.latest_step() == 3


def test_cli_list_marks_memory_only_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from zerostall.cli import main

    with Checkpointer(tmp_path, memory_tier=MemoryTier(persist_interval_steps=2, linger_s=0)) as ck:
        ck.save_pytree(1, state(1))
        ck.save_pytree(2, state(2))
        ck.save_pytree(3, state(3))
        assert main(["list", "--json", str(tmp_path)]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert [r["step"] for r in doc["checkpoints"]] == [2]
        assert doc["memory_only"] == [{"name": step_name(3), "step": 3, "rank": 0, "persisted": False}]
        assert main(["list", str(tmp_path)]) == 0
        assert "in memory only" in capsys.readouterr().out
    assert main(["list", "--json", str(tmp_path)]) == 0  # closed: step 3 persisted, the keeper gone
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["checkpoints"]] == [2, 3] and doc["memory_only"] == []


def test_cli_list_does_not_call_a_persisted_step_gone_from_storage_memory_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A lingering keeper holds step 6, which was persisted and later removed by retention: `zerostall
    # list` must not call it "step_00000006 in memory only", as if it had never been saved.
    import shutil

    from zerostall.cli import main

    with Checkpointer(tmp_path, memory_tier=MemoryTier(persist_interval_steps=1, linger_s=0)) as ck:
        ck.save_pytree(1, state(1))
        assert [s.tiers for s in ck.stats()] == [("memory", "storage")]
        shutil.rmtree(tmp_path / step_name(1))  # what retention does to it later
        assert main(["list", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "in memory only" not in out and "was persisted" in out and "retention" in out, out


def _torchrun(d: Path, steps: int, every: int, kill_step: int) -> list[str]:
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "1", EXAMPLE, "--dir", str(d), "--steps", str(steps),
                        "--persist-every", str(every), "--fail-at-step", str(kill_step)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if "resumed" in line]
    if kill_step and len(lines) != 2:  # say what happened instead of a bare count
        raise AssertionError(f"expected one 'resumed' line per rank:\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return lines


def test_torchrun_restart_resumes_from_memory_bit_for_bit(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import zerostall

    plain, crashed = tmp_path / "plain", tmp_path / "crashed"
    _torchrun(plain, 12, 4, 0)
    lines = _torchrun(crashed, 12, 4, 6)
    # Step 6 was in memory only (storage had step 4): both ranks adopted their keepers and resumed there.
    assert sorted(line.split(", data")[0] for line in lines) == [
        "rank 0: resumed at step 6 from memory", "rank 1: resumed at step 6 from memory"]
    for name in ("step_00000012",):
        a = zerostall.load_pytree(plain / name)
        b = zerostall.load_pytree(crashed / name)
        flat_a, flat_b = _flatten(a), _flatten(b)
        assert flat_a.keys() == flat_b.keys()
        for k, v in flat_a.items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == flat_b[k].dtype and torch.equal(v, flat_b[k]), k
            else:
                assert v == flat_b[k], k
    for d in (plain, crashed):
        for rank in (0, 1):
            wait_for(lambda d=d, rank=rank: keeper_address(str(d), rank) not in keeper_sockets(), "keepers to exit")
    # Meanwhile the crashed group's keepers persisted step 6 together, in the background (the
    # restarted trainers did not wait for it), and left no attempt, decision or lease behind.
    assert 6 in storage_steps(crashed) and 6 not in storage_steps(plain)
    assert not [p.name for p in crashed.iterdir() if p.name.startswith(".") and p.name != INSTANCE_KEY]
    stored = _flatten(zerostall.load_pytree(crashed / step_name(6)))  # verified: every CRC32C checked
    assert [v for k, v in stored.items() if k.endswith("position")] == [6], stored.keys()


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}/{k}"))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}/{i}"))
        return out
    return {prefix: tree}


def test_keeper_crash_leaves_storage_only(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, memory_tier=MemoryTier(persist_interval_steps=3, linger_s=0)) as ck:
        for s in range(1, 5):
            ck.save_pytree(s, state(s))
        keeper = ck._engine.writer.pid
        assert keeper is not None and ck.memory_step() == 4
        os.kill(keeper, signal.SIGKILL)
        wait_for(lambda: not ck._engine.writer.alive(), "the trainer to see its keeper die")
        # Step 4 lived only in the dead keeper's memory: storage's newest is what is left.
        assert ck.memory_step() is None and ck.latest_step() == 3
        assert_state(ck.load_pytree(), state(3))
        ck.save_pytree(5, state(5))  # a new keeper takes the next save
        assert ck._engine.writer.pid != keeper and ck.memory_step() == 5
    assert ck.memory_step() is None and ck.steps() == [3, 5]


def test_leaving_with_on_an_error_leaves_the_memory_to_a_restart(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), \
            Checkpointer(tmp_path, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=60)) as ck:
        ck.save_pytree(1, state(1))
        keeper = ck._engine.writer.pid
        raise RuntimeError("boom")
    assert keeper is not None and running(keeper)  # lingering, as after a crash
    wait_for(lambda: 1 in storage_steps(tmp_path), "step 1 persisted by the keeper")
    with Checkpointer(tmp_path, memory_tier=MemoryTier(persist_interval_steps=5, linger_s=60)) as ck:
        assert ck._engine.writer.pid == keeper and ck.memory_step() == 1
        assert_state(ck.load_pytree(), state(1))
    wait_for(lambda: not running(keeper), "the keeper to exit after close()")


# -- the keeper's check after a crash: a restart's load only copies ----------------------------


def _image(ck: Checkpointer) -> Image:
    """What the keeper answers this trainer's query (the Image a load from memory gets)."""
    got = ck._memory.keeper.query_image()
    assert got is not None
    img, fds = got
    for fd in fds:
        os.close(fd)
    return img


def test_restart_loads_the_image_its_keeper_verified(tmp_path: Path) -> None:
    d = tmp_path / "run"
    rc, keeper, saved = run_trainer(d, 1, 2, 5, 60, "kill")
    assert rc == -signal.SIGKILL and saved == {1: "memory", 2: "memory"}
    with Checkpointer(d, memory_tier=memory_tier(every=5)) as ck:
        assert ck._engine.writer.pid == keeper
        img = _image(ck)
        assert img.step == 2 and img.verified  # every leaf checked by the keeper after the trainer died
        tmpl = state(0)
        w = tmpl["w"]
        out = ck.load_pytree(2, template=tmpl)
        assert_state(out, state(2))
        assert out["w"] is w  # in place, bit for bit
        # Still all or nothing with the checksum pass skipped: a template that does not match is
        # refused before any of its bytes changes.
        for change in ({"h": np.zeros(5, dtype=np.float16)},  # shape
                       {"i": np.zeros(17, dtype=np.int32)},  # dtype
                       {"extra": np.zeros(3)}):  # a key the step lacks
            bad = state(0) | change
            with pytest.raises((MismatchError, MissingKeyError)):
                ck.load_pytree(2, template=bad)
            for k in ("w", "h", "i", "flags"):
                if k not in change:
                    assert bad[k].tobytes() == state(0)[k].tobytes(), (change.keys(), k)
        # A step this live trainer saves is not verified by the keeper: its load checks it itself.
        ck.save_pytree(3, state(3))
        img = _image(ck)
        assert img.step == 3 and not img.verified
        assert_state(ck.load_pytree(3), state(3))


def test_a_byte_changed_in_memory_after_the_save_is_never_loaded(tmp_path: Path) -> None:
    d = tmp_path / "run"
    p = start_trainer(d, 1, 2, 5, 60, "corrupt")
    out, _ = p.communicate(timeout=DEADLINE_S)
    keeper, saved = parse_trainer_output(out.splitlines())
    assert p.returncode == -signal.SIGKILL and saved == {1: "memory", 2: "memory"}
    keys = [line.split()[1] for line in out.splitlines() if line.startswith("CORRUPTED ")]
    assert len(keys) == 1
    with Checkpointer(d, memory_tier=memory_tier(every=5), load_options=LoadOptions(atomic=True)) as ck:
        assert ck._engine.writer.pid == keeper
        img = _image(ck)
        assert img.step == 2 and not img.verified  # the keeper's check found it
        # ...and the load verifies as it always did, failing as a corrupt image fails from storage.
        tmpl = state(0)
        with pytest.raises(ChecksumMismatchError) as err:
            ck.load_pytree(2, template=tmpl)
        assert err.value.key == keys[0]
        assert tmpl["w"].tobytes() == state(0)["w"].tobytes()  # all or nothing
    wait_for(lambda: not running(keeper), "the keeper to exit after close()")
    # The keeper never persisted the changed bytes (under checksums taken afresh they would verify).
    assert 2 not in storage_steps(d)


def test_a_query_during_the_keepers_check_waits_for_it(tmp_path: Path) -> None:
    d, marks, go = tmp_path / "run", tmp_path / "marks", tmp_path / "go"
    marks.mkdir()
    env = dict(os.environ, **{FAULTS_ENV: json.dumps({"keeper_check": f"wait:{go}"}), MARK_ENV: str(marks)})
    p = start_trainer(d, 1, 2, 5, 60, "kill", env=env)
    out, _ = p.communicate(timeout=DEADLINE_S)
    keeper, saved = parse_trainer_output(out.splitlines())
    assert p.returncode == -signal.SIGKILL and saved == {1: "memory", 2: "memory"}
    wait_for(lambda: (marks / f"keeper_check-{keeper}").exists(), "the keeper's check to start")
    look = query_held(str(d), 0)  # a look (zerostall list) does not wait: not verified yet
    assert look is not None and look.step == 2 and not look.verified
    with Checkpointer(d, memory_tier=memory_tier(every=5)) as ck:
        assert ck._engine.writer.pid == keeper  # adopting does not wait for the check
        got: list[Image] = []
        asker = threading.Thread(target=lambda: got.append(_image(ck)))
        asker.start()
        asker.join(0.5)
        assert asker.is_alive() and not got  # held until the check ends (it cannot before `go`)
        go.touch()
        asker.join(DEADLINE_S)
        assert len(got) == 1 and got[0].step == 2 and got[0].verified
        assert_state(ck.load_pytree(2), state(2))
