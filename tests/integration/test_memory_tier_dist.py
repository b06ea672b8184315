"""The memory tier under torch.distributed: the keepers persist a dead job's memory-only step together.

Real processes: two gloo ranks (``_memory_dist_trainer.py``) save with a memory tier and are
SIGKILLed with nobody to restart them; their keepers persist the newest memory-only step through
the collective protocol, or abort it when they do not all hold it (docs/distributed.md, "The memory
tier's keepers"). A fresh job without any keeper then finds what storage holds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from memtier_procs import DEADLINE_S, keeper_sockets, running, wait_for

pytest.importorskip("torch")

from zerostall.commit import step_name
from zerostall.memtier.instance import INSTANCE_KEY
from zerostall.memtier.keeperfail import MARKER_PREFIX, read_markers
from zerostall.memtier.spec import keeper_address
from zerostall.persist.gc import collect_garbage
from zerostall.storage import open_storage

sys.path.insert(0, str(Path(__file__).parent))

WORKER = str(Path(__file__).parent / "_memory_dist_trainer.py")
WORLD = 2
LAST = 12  # step 10 is persisted (every 10th), steps 11 and 12 live in memory only


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _start(mode: str, d: Path, linger: float, timeout: float, log: Path) -> list[subprocess.Popen[str]]:
    port = _port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ZEROSTALL_FAULTS", None)
    # stderr to a file: a keeper writing to a pipe we read would keep it open while it works
    with open(log, "a") as err:
        return [subprocess.Popen([sys.executable, WORKER, mode, str(r), str(WORLD), str(port), str(d), str(LAST),
                                  str(linger), str(timeout)], stdout=subprocess.PIPE, stderr=err,
                                 stdin=subprocess.PIPE, text=True, env=env) for r in range(WORLD)]


def _parse(lines: list[str]) -> tuple[int, dict[int, str]]:
    keeper, saved = -1, {}
    for line in lines:
        parts = line.split()  # a SIGKILL can cut the last line short: only whole lines count
        if len(parts) == 2 and parts[0] == "KEEPER":
            keeper = int(parts[1])
        elif len(parts) == 3 and parts[0] == "SAVED" and parts[2] in ("memory", "storage", "memory,storage"):
            saved[int(parts[1])] = parts[2]
    return keeper, saved


def _died(procs: list[subprocess.Popen[str]]) -> list[tuple[int, dict[int, str]]]:
    """Wait for every rank to die; (keeper pid, {step: tiers}) per rank."""
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=DEADLINE_S)
        assert p.returncode == -signal.SIGKILL, (p.returncode, stdout)
        out.append(_parse(stdout.splitlines()))
    return out


def _storage(d: Path) -> list[str]:
    """What the directory holds, less the keepers' markers of failed persists (see :func:`_failed`) and
    the directory's instance marker."""
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(MARKER_PREFIX) and p.name != INSTANCE_KEY)


def _failed(d: Path) -> dict[int, list[tuple[int | None, str]]]:
    """The failed persists the keepers left markers of, by rank: (step, error class)."""
    out: dict[int, list[tuple[int | None, str]]] = {}
    for f in read_markers(open_storage(str(d)), str(d)):
        out.setdefault(f.rank, []).append((f.step, f.error.cls))
    return out


def _keepers_gone(d: Path, keepers: list[int]) -> None:
    """Every keeper has exited, and nothing of the job is left running or listening anywhere."""
    for k in keepers:
        wait_for(lambda k=k: not running(k), f"keeper {k} to exit")
    for r in range(WORLD):
        assert keeper_address(str(d), r) not in keeper_sockets()
    assert _holders(d) == [], "a process that names the run (and so holds its memfds) is left"


def _holders(d: Path) -> list[int]:
    """Running processes whose command line names ``d`` (trainers and keepers both do)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if str(d).encode() in cmd.split(b"\0") and running(int(proc.name)):
            out.append(int(proc.name))
    return out


def _fresh_load(d: Path, log: Path) -> list[dict]:
    """A new job on other nodes (no keeper, no memory tier) loads the newest step from storage."""
    import json

    procs = _start("load", d, 0, 60, log)
    for p in procs:
        p.communicate(timeout=DEADLINE_S)
        assert p.returncode == 0, log.read_text()[-4000:]
    return [json.loads((d / f"load-{r}.json").read_text()) for r in range(WORLD)]


def _assert_rank0(d: Path, step: int) -> None:
    """Step ``step`` on storage loads, verified, with rank 0's state (the per-rank loads are
    checked across real ranks in the first test)."""
    import torch
    from _memory_dist_trainer import state

    import zerostall

    got, want = zerostall.load_pytree(d / step_name(step)), state(0, step)
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["rank"]["rng"], want["rank"]["rng"])
    assert got["model"]["b"].dtype == torch.bfloat16 and torch.equal(got["model"]["b"], want["model"]["b"])
    assert got["rank"]["position"] == step and got["rank"]["name"] == "shard-0"


def test_keepers_persist_the_memory_only_step_after_every_trainer_died(tmp_path: Path) -> None:
    d, log = tmp_path / "run", tmp_path / "stderr.log"
    ranks = _died(_start("both", d, 1.0, 60, log))
    for _, saved in ranks:
        # step 10 went to storage (a persisted collective step is not held: storage has it)
        assert saved == {s: ("storage" if s == 10 else "memory") for s in range(1, LAST + 1)}
    keepers = [k for k, _ in ranks]
    # Nobody restarts the job: the keepers persist step 12 together, linger 1 s, and exit.
    _keepers_gone(d, keepers)
    # Only the two committed steps: no attempt directory, decision file, lease or coordination file.
    assert _storage(d) == [step_name(10), step_name(LAST)], log.read_text()[-4000:]
    assert sorted(p.name for p in (d / step_name(LAST)).iterdir()) == ["data", "manifest.json"]
    for r, res in enumerate(_fresh_load(d, log)):
        assert res["step"] == LAST and res["equal"], (r, res)


def test_wait_on_every_rank_persists_the_memory_only_step_collectively(tmp_path: Path) -> None:
    import json

    d, log = tmp_path / "run", tmp_path / "stderr.log"
    procs = _start("persist", d, 0, 60, log)
    for p in procs:
        p.communicate(timeout=DEADLINE_S)
        assert p.returncode == 0, log.read_text()[-4000:]
    for r in range(WORLD):
        res = json.loads((d / f"persist-{r}.json").read_text())
        # step 12 lived in memory only until every rank's wait(); the keepers then served on
        assert res == {"after_wait": [10, LAST], "same_keeper": True, "held": LAST + 1,
                       "after_close": [10, LAST, LAST + 1], "failures": []}, (r, res)
    assert _storage(d) == sorted([step_name(10), step_name(LAST), step_name(LAST + 1)]
                                 + [f"persist-{r}.json" for r in range(WORLD)]), log.read_text()[-4000:]
    _assert_rank0(d, LAST)


def test_keepers_holding_different_steps_commit_nothing(tmp_path: Path) -> None:
    d, log = tmp_path / "run", tmp_path / "stderr.log"
    # A collective timeout far beyond the test's deadline: the keepers must not need it, since each
    # aborts the attempt of the step it does not hold as soon as its trainer is dead.
    ranks = _died(_start("split", d, 1.0, 3600, log))
    (k0, saved0), (k1, saved1) = ranks
    assert max(saved0) == LAST and max(saved1) == LAST - 1  # rank 1 died before its save of 12
    _keepers_gone(d, [k0, k1])
    # Neither 11 (rank 0's keeper no longer holds it) nor 12 (rank 1's never had it) is committed,
    # and nothing of either attempt is left; step 10 is intact.
    assert _storage(d) == [step_name(10)], log.read_text()[-4000:]
    assert "nothing of this save was committed" in log.read_text()
    # No trainer adopted the keepers: each left a marker naming the step it could not persist.
    assert _failed(d) == {0: [(LAST, "WriterError")], 1: [(LAST - 1, "WriterError")]}
    _assert_rank0(d, 10)


def test_a_byte_changed_in_one_ranks_memory_aborts_the_keepers_persist(tmp_path: Path) -> None:
    d, log = tmp_path / "run", tmp_path / "stderr.log"
    # Rank 1's keeper, whose check after the crash finds the changed byte, does not take part in the
    # persist of step 12: rank 0's keeper aborts it on the collective timeout (3 s here).
    ranks = _died(_start("corrupt", d, 1.0, 3, log))
    _keepers_gone(d, [k for k, _ in ranks])
    # Step 12 is not committed with the changed byte under a fresh checksum (nor at all); step 10 is intact.
    assert _storage(d) == [step_name(10)], log.read_text()[-4000:]
    assert "changed in memory after its save" in log.read_text()
    assert _failed(d) == {0: [(LAST, "WriterError")], 1: [(LAST, "ChecksumMismatchError")]}
    _assert_rank0(d, 10)


def test_a_keeper_whose_peer_never_joins_gives_up_after_the_collective_timeout(tmp_path: Path) -> None:
    d, log = tmp_path / "run", tmp_path / "stderr.log"
    procs = _start("wait", d, 0.5, 5, log)
    keepers = []
    for p in procs:
        assert p.stdout is not None
        lines = []
        while not lines or lines[-1].strip() != "READY":
            line = p.stdout.readline()
            assert line, log.read_text()[-4000:]
            lines.append(line)
        keepers.append(_parse(lines)[0])
    os.kill(keepers[1], signal.SIGKILL)  # rank 1's keeper (and its memory) is gone: a node lost
    wait_for(lambda: not running(keepers[1]), "rank 1's keeper to die")
    for p in procs:
        p.kill()
        p.communicate(timeout=DEADLINE_S)
    # Rank 0's keeper waits for rank 1's part of step 12 up to timeout_s, aborts, cleans up, exits.
    # While it waits, its lease makes it a live writer to any collector: its attempt stays.
    wait_for(lambda: any(".zs-tmp-" in n for n in _storage(d)), "rank 0's keeper to start its attempt")
    report = collect_garbage(open_storage(str(d)))
    assert report.kept_live and not report.removed, report
    _keepers_gone(d, keepers)
    assert _storage(d) == [step_name(10)], log.read_text()[-4000:]
    assert "did not publish" in log.read_text()
    assert _failed(d) == {0: [(LAST, "WriterError")]}


def test_a_restart_beside_keepers_holding_different_steps_resumes_from_storage(tmp_path: Path) -> None:
    import json

    d, log = tmp_path / "run", tmp_path / "stderr.log"
    ranks = _died(_start("split", d, 60.0, 3600, log))
    keepers = [k for k, _ in ranks]
    # Restarted at once, while the keepers abort their attempts in the background: the ranks do not
    # all hold one step in memory, so every rank restores step 10 from storage, bit for bit.
    procs = _start("resume", d, 60.0, 3600, log)
    for p in procs:
        p.communicate(timeout=DEADLINE_S)
        assert p.returncode == 0, log.read_text()[-4000:]
    res = [json.loads((d / f"resume-{r}.json").read_text()) for r in range(WORLD)]
    assert [(r["adopted"], r["held"], r["start"], r["equal"]) for r in res] == [
        (True, LAST, 10, True), (True, LAST - 1, 10, True)]
    # Each restarted rank heard that its keeper's persist of the dead run's step was aborted.
    assert [r["keeper_failed"] for r in res] == [[[LAST, "WriterError"]], [[LAST - 1, "WriterError"]]]
    # The new run saved 11 and 12 again (memory only) and close() persisted 12 through the same keepers;
    # neither keeper committed its own 11 or 12 of the dead run.
    _keepers_gone(d, keepers)
    assert [n for n in _storage(d) if not n.startswith("resume-")] == [step_name(10), step_name(LAST)], \
        log.read_text()[-4000:]
    _assert_rank0(d, LAST)


@pytest.mark.parametrize("rename", [True, False], ids=["posix", "object-store"])
def test_a_dead_ranks_keeper_aborts_only_the_other_live_attempts_of_its_run(tmp_path: Path, rename: bool) -> None:
    """What a keeper aborts, found through the writers' leases on both kinds of storage, and what it sweeps."""
    from zerostall.commit.agreement import AttemptNames, attempt_names, decide, read_decision
    from zerostall.lease import Lease
    from zerostall.persist.collective import abort_attempts_except, sweep_aborted_decisions
    from zerostall.storage.local import LocalStorage

    class NoRename(LocalStorage):
        atomic_rename = False

    storage = LocalStorage(str(tmp_path)) if rename else NoRename(str(tmp_path))
    run, other = "0123456789ab", "ba9876543210"
    names = {(r, c): attempt_names(storage, step_name(c), r, c) for r in (run, other) for c in (3, 4, 5)}

    def targets(n: AttemptNames) -> list[str]:  # what CollectiveStep.lease_targets names
        return [n.staging, n.decision] if n.rename else [f"{n.staging}/{n.data_dir}", n.coord, n.decision]

    leases = {k: Lease(storage, targets(n)).acquire() for k, n in names.items()}  # every attempt in progress
    decide(storage, names[(run, 5)], {"decision": "commit", "by": 0})
    try:
        # Rank 1's keeper holds save 4 of `run`: 3 is aborted, 4 (its own) and 5 (decided) are not,
        # and another run's attempts are not its business.
        assert abort_attempts_except(storage, run, 4, 1, "rank 1's trainer died") == [3]
        dec = read_decision(storage, names[(run, 3)])
        assert dec is not None and dec["decision"] == "abort" and dec["by"] == 1
        assert read_decision(storage, names[(run, 4)]) is None
        assert read_decision(storage, names[(run, 5)]) == {"decision": "commit", "by": 0}
        assert all(read_decision(storage, names[(other, c)]) is None for c in (3, 4, 5))
        # The abort decision stays while its writer's lease lives (that writer has yet to read it).
        assert sweep_aborted_decisions(storage, run) == []
        leases.pop((run, 3)).release()
        assert sweep_aborted_decisions(storage, run) == [names[(run, 3)].decision]
        assert read_decision(storage, names[(run, 5)]) is not None  # a commit decision is never swept here
    finally:
        for ls in leases.values():
            ls.release()
