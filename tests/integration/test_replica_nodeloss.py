"""A lost node costs no memory step: every rank's newest step is also in another host's keeper.

Four gloo ranks, each its own process, on hosts made as network namespaces (tests/support/nshosts.py:
each its own address, hostname, /dev/shm and /tmp; no ``ZEROSTALL_HOST_ID``): ranks 0 and 1 on
host a, 2 and 3 on host b; the job's store runs in host a (as torchrun's agent store, it outlives
the workers). ``MemoryTier(persist_interval_steps=4, replicas=1)``: steps 1..6 are saved, step 4
persisted, and each rank's step is replicated to the keeper of the rank one host over (rank 2's to
rank 0's keeper, 3's to 1's, 0's to 2's, 1's to 3's). Then host b is lost (every process in it
SIGKILLed) and host a's trainers die; the job restarts with ranks 2 and 3 on a new host c, whose
keepers are empty. Storage holds step 4 only. The fallbacks (a corrupted replica, both copies
lost) run the same job with a rank per host, hosts a and b, then a and c.

When the job never restarts, host a's keepers persist step 6 all the same: each stands in for
the lost rank whose replica it holds, once that rank's keeper lease has expired.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from hostjob import JobStore, lose_host, start_ranks

from zerostall.commit import committed_steps, step_name
from zerostall.format.layout import MANIFEST_NAME
from zerostall.format.manifest import parse_manifest
from zerostall.storage import open_storage

pytest.importorskip("torch")

WORKER = str(Path(__file__).parent / "_replica_host_trainer.py")
WORLD = 4
TIMEOUT_S = 20.0
#: the first job's bound: after host B is lost, host A's keepers try to persist step 6 and wait this
#: long for B's dead ranks before giving up; the restarted trainers adopting them wait that out
FIRST_TIMEOUT_S = 8.0
DEADLINE_S = 120.0
HOSTS_FIRST = ["a", "a", "b", "b"]
HOSTS_AFTER = ["a", "a", "c", "c"]


@pytest.fixture
def job_store() -> object:
    """A job's store hosted here (for the one-host refusal, which needs no other host)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    yield store
    del store


@pytest.fixture
def job(nshosts, tmp_path: Path) -> tuple[object, JobStore]:
    """Hosts a..d as namespaces sharing ``tmp_path``, and the job's store in host a."""
    hosts = nshosts(["a", "b", "c", "d"], shared=[tmp_path])
    return hosts, JobStore(hosts, "a")


def _start(job: tuple[object, JobStore], phase: str, d: Path, hosts: list[str], log: Path, replicas: int = 1,
           timeout: float | None = None, **env: object) -> list[subprocess.Popen[str]]:
    ns, store = job
    if timeout is None:
        timeout = FIRST_TIMEOUT_S if phase == "first" else TIMEOUT_S
    return start_ranks(ns, store, hosts, lambda r: [sys.executable, WORKER, phase, str(r), str(len(hosts)), str(d),  # type: ignore[arg-type]
                                                    str(timeout), str(d.parent / f"out-{r}.json"), str(replicas)], log,
                       **env)  # type: ignore[arg-type]


def _read_until(p: subprocess.Popen[str], word: str, log: Path) -> dict[str, str]:
    assert p.stdout is not None
    said: dict[str, str] = {}
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"rank exited ({p.poll()}) before {word}:\n{log.read_text()[-4000:]}")
        head, _, rest = line.strip().partition(" ")
        said[head] = rest
        if head == word:
            return said
    raise AssertionError(f"timed out waiting for {word}")


def _lose_host_b(job: tuple[object, JobStore], d: Path, log: Path, hosts: list[str] = HOSTS_FIRST, lost: str = "b",
                 replicas: int = 1, **env: object) -> list[dict[str, str]]:
    """Run the first job to step 6, lose host ``lost`` entirely, then the other hosts' trainers (not
    their keepers)."""
    procs = _start(job, "first", d, hosts, log, replicas, **env)
    said = [_read_until(p, "READY", log) for p in procs]
    lose_host(job[0], lost)  # type: ignore[arg-type]
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=DEADLINE_S)
    return said


def _resume(job: tuple[object, JobStore], d: Path, log: Path, hosts: list[str] = HOSTS_AFTER,
            replicas: int = 1, **env: object) -> list[dict]:
    procs = _start(job, "resume", d, hosts, log, replicas, **env)
    for p in procs:
        assert p.wait(timeout=DEADLINE_S) == 0, log.read_text()[-6000:]
    return [json.loads((d.parent / f"out-{r}.json").read_text()) for r in range(len(hosts))]


def _replica_memfds(keeper: int, trainer_inodes: set[int]) -> list[str]:
    """The keeper's shared-memory buffers that its trainer did not stage: the replicas it received."""
    out: dict[int, str] = {}  # one path per buffer (a buffer may be open under two descriptors)
    for fd in os.listdir(f"/proc/{keeper}/fd"):
        path = f"/proc/{keeper}/fd/{fd}"
        try:
            ino = os.stat(path).st_ino
            if "zerostall-stage" in os.readlink(path) and ino not in trainer_inodes:
                out.setdefault(ino, path)
        except OSError:
            pass
    return list(out.values())


@pytest.mark.parametrize("in_place", [False, True], ids=["two-copies", "in-place"])
def test_a_lost_host_resumes_every_rank_from_memory_through_the_replicas(tmp_path: Path, job, in_place) -> None:
    """Also with ``replicas_in_place`` (one copy per holder): the loss comes between transfers, so
    the holders' replicas of step 6 are whole."""
    d, log = tmp_path / "run", tmp_path / "log.txt"
    env = {"env": {"ZS_REPLICAS_IN_PLACE": "1"}} if in_place else {}
    said = _lose_host_b(job, d, log, **env)
    assert all(s["TIERS"] == "memory,peer" for s in said)  # result() returned once the replica held step 6
    assert committed_steps(open_storage(str(d))) == [4]  # step 6 is on no storage: only memory can give it
    outs = _resume(job, d, log, **env)
    assert [o["agreed"] for o in outs] == [6] * WORLD
    assert [o["loaded"] for o in outs] == [6] * WORLD  # ranks 2 and 3 from the replicas on host A
    assert [o["adopted"] for o in outs] == [True, True, False, False]
    assert all(o["restored_equal"] and o["final_equal"] for o in outs), outs
    assert all(o["tiers"] == ["memory", "peer"] for o in outs)  # step 7, replicated to host C's keepers too
    assert 7 in committed_steps(open_storage(str(d)))  # close() persisted it


def test_a_corrupted_replica_is_never_loaded_storage_is(tmp_path: Path, job) -> None:
    # A rank per host (the fallback does not depend on how many ranks a host has): rank 1's step
    # is held by rank 0's keeper only.
    d, log = tmp_path / "run", tmp_path / "log.txt"
    said = _lose_host_b(job, d, log, hosts=["a", "b"])
    keeper0 = int(said[0]["KEEPER"])
    bufs = _replica_memfds(keeper0, {int(i) for i in said[0]["INODES"].split()})
    assert bufs, "rank 0's keeper holds no replica"
    for path in bufs:  # a byte of rank 1's leaf "w" of step 6 (past any header padding), in its only other copy
        with open(path, "r+b") as f:
            f.seek(8192)
            b = f.read(1)
            f.seek(8192)
            f.write(bytes([b[0] ^ 0xFF]))
    outs = _resume(job, d, log, hosts=["a", "c"])
    assert [o["agreed"] for o in outs] == [6] * 2
    assert [o["loaded"] for o in outs] == [4] * 2  # every rank fell back to storage's newest step
    assert all(o["restored_equal"] and o["final_equal"] for o in outs), outs
    for o in outs:  # each rank was told, naming the step memory could not give
        assert any(step == 6 and "could not be restored from memory" in msg for step, msg in o["keeper_failures"])


def test_a_corrupted_replica_sends_the_rank_to_its_next_holder(tmp_path: Path, job,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Three hosts, a rank each, two replicas: rank 2's step is held by rank 0's and rank 1's keepers.
    # All-or-nothing loads: rank 2 receives its share into memfds, then loads from them (the other
    # tests' loads receive straight into the templates).
    monkeypatch.setenv("ZS_ATOMIC_LOADS", "1")
    d, log = tmp_path / "run", tmp_path / "log.txt"
    said = _lose_host_b(job, d, log, hosts=["a", "b", "c"], lost="c", replicas=2)
    assert all(s["TIERS"] == "memory,peer" for s in said)
    keeper0 = int(said[0]["KEEPER"])
    bufs = _replica_memfds(keeper0, {int(i) for i in said[0]["INODES"].split()})
    assert bufs, "rank 0's keeper holds no replica"
    for path in bufs:  # rank 0's keeper: every replica it holds has a changed byte in leaf "w"
        with open(path, "r+b") as f:
            f.seek(8192)
            b = f.read(1)
            f.seek(8192)
            f.write(bytes([b[0] ^ 0xFF]))
    outs = _resume(job, d, log, hosts=["a", "b", "d"], replicas=2)
    assert [o["agreed"] for o in outs] == [6] * 3
    assert [o["loaded"] for o in outs] == [6] * 3  # rank 2's share came from rank 1's keeper
    assert all(o["restored_equal"] and o["final_equal"] for o in outs), outs
    for o in outs:  # each rank was told of the replica that failed, and of the holder tried next
        assert any(step == 6 and "trying rank 1's keeper" in msg for step, msg in o["keeper_failures"])


def test_both_copies_lost_falls_back_to_storage_without_a_hang(tmp_path: Path, job) -> None:
    d, log = tmp_path / "run", tmp_path / "log.txt"
    said = _lose_host_b(job, d, log, hosts=["a", "b"])  # a rank per host
    os.kill(int(said[0]["KEEPER"]), signal.SIGKILL)  # host a's keeper too: no copy of step 6 is left anywhere
    outs = _resume(job, d, log, hosts=["a", "c"])
    assert [o["agreed"] for o in outs] == [4] * 2
    assert [o["loaded"] for o in outs] == [4] * 2
    assert all(o["restored_equal"] and o["final_equal"] for o in outs), outs


def test_a_holder_that_hangs_during_the_restore_is_passed_over_for_the_next_within_timeout_s(
        tmp_path: Path, job) -> None:
    """Three hosts, a rank each, two replicas; host c (rank 2) is lost. During the restore, rank 0's
    keeper, a holder of rank 2's share and of rank 0's own step, hangs (it stops itself, SIGSTOP,
    when its trainer asks it for rank 2's replica: alive, silent). Within ``timeout_s`` both shares
    it was to give come from the next holder, rank 1's keeper, each rank told (a WARNING naming
    rank 0's keeper), every rank restored from memory bit for bit; once the keeper goes on, the
    job trains and saves on with it."""
    d, log = tmp_path / "run", tmp_path / "log.txt"
    hang = {0: {"ZEROSTALL_FAULTS": json.dumps({"keeper_serve_replica": "stop"})}}  # rank 0's keeper only
    said = _lose_host_b(job, d, log, hosts=["a", "b", "c"], lost="c", replicas=2, rank_env=hang)
    keeper0 = int(said[0]["KEEPER"])
    timeout = 4.0
    procs = _start(job, "resume", d, ["a", "b", "d"], log, replicas=2, timeout=timeout,
                   env={"ZS_HOLD_AFTER_LOAD": "1"})
    try:
        for p in procs:
            _read_until(p, "LOADED", log)
        with open(f"/proc/{keeper0}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "T"  # it hung where the test made it
    finally:
        os.kill(keeper0, signal.SIGCONT)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
    for p in procs:
        assert p.wait(timeout=DEADLINE_S) == 0, log.read_text()[-6000:]
    outs = [json.loads((d.parent / f"out-{r}.json").read_text()) for r in range(3)]
    assert [o["loaded"] for o in outs] == [6] * 3  # from memory: rank 1's keeper gave ranks 0 and 2 their shares
    assert all(o["restored_equal"] and o["final_equal"] for o in outs), outs
    assert all(o["load_s"] < timeout + 6.0 for o in outs), [o["load_s"] for o in outs]  # one round waited it out
    for o in outs:  # each rank was told of the holder that did not answer, and of the one tried next
        assert any(step == 6 and "rank 0's keeper" in msg and "trying rank 1's keeper" in msg
                   for step, msg in o["keeper_failures"]), o["keeper_failures"]


def _leaf_indices(node: object) -> list[int]:
    if isinstance(node, dict):
        own = [node["leaf"]] if isinstance(node.get("leaf"), int) else []
        return own + [i for v in node.values() for i in _leaf_indices(v)]
    if isinstance(node, list):
        return [i for v in node for i in _leaf_indices(v)]
    return []


def test_a_lost_host_s_newest_memory_step_is_persisted_by_the_survivors_without_a_restart(
        tmp_path: Path, job, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from _replica_host_trainer import uninterrupted

    from zerostall.restore.verify import verify_checkpoint

    monkeypatch.setenv("ZEROSTALL_LEASE_S", "2")  # host B's keepers are proven gone 2 s after they die
    d, log = tmp_path / "run", tmp_path / "log.txt"
    said = _lose_host_b(job, d, log)  # host b's keepers and every trainer are gone; nothing restarts
    storage = open_storage(str(d))
    deadline = time.monotonic() + DEADLINE_S
    while 6 not in committed_steps(storage):
        assert time.monotonic() < deadline, f"step 6 never reached storage:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    for r in (0, 1):
        os.kill(int(said[r]["KEEPER"]), signal.SIGKILL)
    ck = d / step_name(6)
    assert verify_checkpoint(str(ck)).ok  # committed and complete: every leaf matches its CRC32C
    m = parse_manifest((ck / MANIFEST_NAME).read_bytes(), path=str(ck))
    assert len(m.ranks) == WORLD
    for r in range(WORLD):  # each rank's tensor, bit for bit as that rank saved it at step 6
        (w,) = [m.leaves[i] for i in _leaf_indices(m.ranks[r]) if m.leaves[i].shape == (64, 64)]
        with open(d / step_name(6) / m.files[w.file].path, "rb") as f:
            f.seek(w.offset)
            assert f.read(w.nbytes) == uninterrupted(r, 6).numpy().tobytes(), f"rank {r}"
    assert "standing in for it at step 6" in log.read_text()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_the_stand_in_goes_on_without_a_keeper_that_hangs_and_that_keeper_finds_the_step_stored_when_it_wakes(
        tmp_path: Path, job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three hosts, a rank each, two replicas. Host c (rank 2) is lost and every trainer dies;
    nothing restarts. Rank 1's keeper hangs (it stops itself, SIGSTOP, as it starts its persist
    after its trainer died: alive, silent; a stop sent before its trainer died would be undone by
    the kernel's SIGCONT to an orphaned process group). Rank 0's keeper persists step 6 alone: it
    stands in for rank 2 (lost) and for rank 1 (whose keeper lease lapsed while it hung), from
    their replicas, bit for bit. Woken after the commit, rank 1's keeper finds the step stored."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _replica_host_trainer import uninterrupted

    from zerostall.restore.verify import verify_checkpoint

    monkeypatch.setenv("ZEROSTALL_LEASE_S", "2")  # a keeper that stops renewing is proven gone 2 s later
    d, log = tmp_path / "run", tmp_path / "log.txt"
    hang = {1: {"ZEROSTALL_FAULTS": json.dumps({"keeper_persist": "stop"})}}  # rank 1's keeper only
    procs = _start(job, "first", d, ["a", "b", "c"], log, replicas=2, rank_env=hang)
    said = [_read_until(p, "READY", log) for p in procs]
    keeper1 = int(said[1]["KEEPER"])
    storage = open_storage(str(d))
    try:
        lose_host(job[0], "c")  # type: ignore[arg-type]
        for p in procs:
            p.kill()
            p.wait(timeout=DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while _state(keeper1) != "T":  # it hung where the test made it
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        while 6 not in committed_steps(storage):
            assert time.monotonic() < deadline, f"step 6 never reached storage:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        assert _state(keeper1) == "T"  # committed while it hung
    finally:
        os.kill(keeper1, signal.SIGCONT)
    text = log.read_text()
    assert "rank 2's keeper is gone: standing in for it at step 6" in text
    assert "rank 1's keeper is gone: standing in for it at step 6" in text
    ck = d / step_name(6)
    assert verify_checkpoint(str(ck)).ok
    m = parse_manifest((ck / MANIFEST_NAME).read_bytes(), path=str(ck))
    for r in range(3):  # each rank's tensor, bit for bit as that rank saved it at step 6
        (w,) = [m.leaves[i] for i in _leaf_indices(m.ranks[r]) if m.leaves[i].shape == (64, 64)]
        with open(ck / m.files[w.file].path, "rb") as f:
            f.seek(w.offset)
            assert f.read(w.nbytes) == uninterrupted(r, 6).numpy().tobytes(), f"rank {r}"
    deadline = time.monotonic() + DEADLINE_S  # woken, the keeper goes on: its persist finds step 6 there
    while _state(keeper1) == "T":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    assert committed_steps(storage) == [4, 6]  # nothing it did undid the commit
    assert "could not persist step 6" not in log.read_text()[len(text):]


ONE_HOST = """
import datetime, os, sys
sys.path.insert(0, {src!r})
import torch.distributed as dist
from zerostall import Checkpointer, MemoryTier
from zerostall.errors import InvalidArgumentError
rank = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
try:
    Checkpointer({d!r}, memory_tier=MemoryTier(replicas=1))
except InvalidArgumentError as exc:
    print("REFUSED", exc.argument, "one host gains nothing" in str(exc), flush=True)
"""


def test_replicas_on_one_host_are_refused_naming_the_argument(tmp_path: Path, job_store: object) -> None:
    port = job_store.port  # type: ignore[attr-defined]
    code = ONE_HOST.format(src=str(Path(__file__).parents[2] / "src"), port=port, d=str(tmp_path / "run"))
    env = dict(os.environ, OMP_NUM_THREADS="1", ZEROSTALL_HOST_ID="host-a", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=DEADLINE_S)[0] for p in procs]
    assert all(o.strip().splitlines()[-1] == "REFUSED replicas True" for o in outs), outs


def test_memory_tier_replicas_is_a_non_negative_int() -> None:
    from zerostall import MemoryTier
    from zerostall.errors import ArgumentTypeError, InvalidArgumentError

    assert MemoryTier().replicas == 0
    assert MemoryTier(replicas=2).replicas == 2
    with pytest.raises(InvalidArgumentError, match="replicas"):
        MemoryTier(replicas=-1)
    with pytest.raises(ArgumentTypeError, match="replicas"):
        MemoryTier(replicas=1.5)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="replicas"):
        MemoryTier(replicas=True)
