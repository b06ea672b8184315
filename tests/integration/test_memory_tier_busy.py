"""Two memory tiers of one directory and rank on one host: the second is refused, not silently
left without a keeper a restart could find."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from memtier_procs import DEADLINE_S as TRAINER_DEADLINE_S
from memtier_procs import TRAINER, keeper_processes, keeper_sockets, running, wait_for

from zerostall import Checkpointer, MemoryTier
from zerostall.commit import step_name
from zerostall.errors import InvalidArgumentError
from zerostall.memtier.messages import KeeperBusy
from zerostall.memtier.spec import KeeperSpec, busy_error, keeper_address
from zerostall.messages import decode

sys.path.insert(0, str(Path(__file__).parent))

TIER = MemoryTier(persist_interval_steps=3, linger_s=5)


def test_a_second_checkpointer_of_the_same_directory_in_this_process_is_refused(tmp_path):
    with Checkpointer(tmp_path, memory_tier=TIER) as first:
        first.save_pytree(1, {"w": torch.ones(4)})
        with pytest.raises(InvalidArgumentError) as info:
            second = Checkpointer(tmp_path, memory_tier=TIER)
            second.save_pytree(1, {"w": torch.zeros(4)})
        assert str(tmp_path) in str(info.value) and "this process" in str(info.value)
        first.save_pytree(2, {"w": torch.full((4,), 2.0)})  # the first one is untouched
    with Checkpointer(tmp_path, memory_tier=TIER) as again:  # once closed, the directory is free
        assert again.steps() == [2]
        assert torch.equal(again.load_pytree(2)["w"], torch.full((4,), 2.0))


def test_a_live_trainer_in_another_process_holds_the_directory(tmp_path):
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import pathlib, time, torch, zerostall
        with zerostall.Checkpointer({str(tmp_path / 'run')!r},
                                    memory_tier=zerostall.MemoryTier(persist_interval_steps=3, linger_s=5)) as c:
            c.save_pytree(1, {{"w": torch.ones(4)}})
            pathlib.Path({str(ready)!r}).touch()
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the other trainer did not save"
        with pytest.raises(InvalidArgumentError, match=f"pid {proc.pid}"):
            c = Checkpointer(tmp_path / "run", memory_tier=TIER)
            c.save_pytree(2, {"w": torch.zeros(4)})
    finally:
        proc.kill()
        proc.wait()


# -- two trainers started at the same instant, before either keeper exists ---------------------
#
# Both find no keeper to adopt and both start one; only one keeper can bind the name. The other
# could serve its trainer only unadoptably (its memory-only steps lost at a crash), so it tells
# its trainer (KeeperBusy instead of its Hello), which raises as above, rather than only its stderr.

_RACER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from zerostall import Checkpointer, MemoryTier
    from zerostall.errors import InvalidArgumentError
    tier = MemoryTier(persist_interval_steps=1000, linger_s=5)
    ck = None
    print("PID", os.getpid(), flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "open":
            try:
                ck = Checkpointer(arg, memory_tier=tier)
                ck.save_pytree(1, {"w": np.arange(1000, dtype=np.float32) + os.getpid()})
                print("OK", flush=True)
            except InvalidArgumentError as exc:
                print("BUSY " + json.dumps(str(exc)), flush=True)
        elif cmd == "close":
            if ck is not None:
                ck.close()
            ck = None
            print("CLOSED", flush=True)
""")
ROUNDS = 6
DEADLINE_S = 60.0


def _lines(p: subprocess.Popen[str]) -> queue.Queue[str]:
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            q.put(line.strip())
        q.put("EOF")

    threading.Thread(target=pump, daemon=True).start()
    return q


def _send_all(procs: list[subprocess.Popen[str]], line: str) -> None:
    for p in procs:  # both lines written, then both flushed: the two are released microseconds apart
        assert p.stdin is not None
        p.stdin.write(line + "\n")
    for p in procs:
        assert p.stdin is not None
        p.stdin.flush()


def _stage_memfds(pid: int) -> list[str]:
    """The staging buffers (memfds) process ``pid`` still holds open or mapped."""
    fd_dir = Path(f"/proc/{pid}/fd")
    held = []
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if "zerostall-stage" in target:
            held.append(target)
    held += [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "zerostall-stage" in line]
    return held


def test_two_trainers_started_at_once_one_is_refused_never_both(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _RACER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        outs = [_lines(p) for p in procs]
        pids = [int(q.get(timeout=DEADLINE_S).split()[1]) for q in outs]
        assert pids == [p.pid for p in procs]
        for r in range(ROUNDS):
            d = tmp_path / f"round{r}"
            _send_all(procs, f"open {d}")
            got = [q.get(timeout=DEADLINE_S) for q in outs]
            kinds = [g.split(" ", 1)[0] for g in got]
            assert sorted(kinds) == ["BUSY", "OK"], (r, got)  # exactly one: never both, never neither
            winner, loser = (0, 1) if kinds[0] == "OK" else (1, 0)
            msg = json.loads(got[loser].split(" ", 1)[1])
            assert str(d) in msg and "rank 0" in msg and f"pid {pids[winner]}" in msg, msg
            _send_all(procs, "close")
            assert [q.get(timeout=DEADLINE_S) for q in outs] == ["CLOSED", "CLOSED"]
            # The winner's close persisted its memory-only step; nothing of either is left behind.
            assert (d / step_name(1) / "manifest.json").exists()
            assert keeper_processes(d) == []
            assert keeper_address(str(d), 0) not in keeper_sockets()
            assert _stage_memfds(pids[0]) == [] and _stage_memfds(pids[1]) == []
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_keeper_that_finds_a_lingering_keeper_on_its_name_names_it_and_leaves_it_adoptable(tmp_path):
    """The rarer side of the race: the name's holder serves no live trainer (it lingers). The new
    keeper names that keeper (not a trainer) to its own trainer, and its look claims nothing: the
    lingering keeper is still adopted next, with its step."""
    d = tmp_path / "run"
    p = subprocess.run([sys.executable, TRAINER, str(d), "1", "2", "3", "60", "kill"], stdout=subprocess.PIPE,
                       text=True, timeout=TRAINER_DEADLINE_S)
    lingering = int(next(x.split()[1] for x in p.stdout.splitlines() if x.startswith("KEEPER ")))
    # A keeper started the way WriterClient starts one, on the same directory and rank; this
    # test is its trainer, at the socket level.
    spec = KeeperSpec(root=str(d), rank=0, linger_s=5.0)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, "-m", "zerostall.memtier.keeper", str(theirs.fileno()), "0", "normal",
                             *spec.argv()], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                            start_new_session=True)
    theirs.close()
    conn = Connection(ours.detach())
    try:
        assert conn.poll(DEADLINE_S)
        msg = decode(conn.recv_bytes())  # instead of a Hello
        assert msg == KeeperBusy(pid=lingering, pid_is_keeper=True)
        assert proc.wait(timeout=DEADLINE_S) == 0  # it served nothing and exited
        err = busy_error(spec, msg)
        assert str(d) in str(err) and f"pid {lingering}" in str(err) and "retry" in str(err)
    finally:
        conn.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with Checkpointer(d, memory_tier=TIER) as ck:  # the retry adopts the lingering keeper
        assert ck._engine.writer.adopted and ck._engine.writer.pid == lingering
        assert ck.latest_step() == 2
    wait_for(lambda: not running(lingering), "the adopted keeper to exit at close")
