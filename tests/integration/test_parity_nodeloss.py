"""A lost host costs no memory step with ``MemoryTier(parity=1)``: its ranks' shares are rebuilt
from the other hosts' memory, for a third of a copy of the state per host (a group of four).

Four gloo ranks, a rank per host, hosts a..d made as network namespaces (tests/support/nshosts.py);
the job's store runs in host a. ``MemoryTier(persist_interval_steps=4, parity=1)``: one parity
group of the four hosts; steps 1..6 are saved, step 4 persisted, and after each save every keeper
holds its stripe's XOR parity of that step. Then a host is lost (every process in it SIGKILLed)
and the other hosts' trainers die; the job restarts with the lost rank on a new host e, whose
keeper is empty. Storage holds step 4 only: step 6 can come from memory alone.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from tests.integration.test_replica_nodeloss import _lose_host_b, _replica_memfds, _resume

from zerostall.commit import committed_steps
from zerostall.storage import open_storage

pytest.importorskip("torch")

FIRST = ["a", "b", "c", "d"]


@pytest.fixture
def job(nshosts, tmp_path: Path) -> tuple[object, object]:
    """Hosts a..e as namespaces sharing ``tmp_path``, and the job's store in host a."""
    from hostjob import JobStore

    hosts = nshosts(["a", "b", "c", "d", "e"], shared=[tmp_path])
    return hosts, JobStore(hosts, "a")


def test_a_lost_host_resumes_its_rank_from_memory_rebuilt_from_the_parity_group(tmp_path: Path, job) -> None:
    d, log = tmp_path / "run", tmp_path / "log.txt"
    said = _lose_host_b(job, d, log, hosts=FIRST, replicas=0)
    assert all(s["TIERS"] == "memory,peer" for s in said)  # result() returned once the group's parity held step 6
    assert committed_steps(open_storage(str(d))) == [4]
    outs = _resume(job, d, log, hosts=["a", "e", "c", "d"], replicas=0)
    assert [o["agreed"] for o in outs] == [6] * 4
    assert [o["loaded"] for o in outs] == [6] * 4  # rank 1 from the shares and parity on hosts a, c and d
    assert [o["adopted"] for o in outs] == [True, False, True, True]
    assert all(o["restored_equal"] and o["final_equal"] for o in outs), outs
    assert all(not o["keeper_failures"] for o in outs), outs
    assert all(o["tiers"] == ["memory", "peer"] for o in outs)  # step 7's parity, host e's keeper in the group
    assert 7 in committed_steps(open_storage(str(d)))


def test_two_hosts_of_one_group_lost_fall_back_to_storage_without_a_hang(tmp_path: Path, job) -> None:
    d, log = tmp_path / "run", tmp_path / "log.txt"
    said = _lose_host_b(job, d, log, hosts=FIRST, replicas=0)
    os.kill(int(said[2]["KEEPER"]), signal.SIGKILL)  # host c's keeper too: two members of the group gone
    outs = _resume(job, d, log, hosts=["a", "e", "c", "d"], replicas=0)
    assert [o["agreed"] for o in outs] == [4] * 4
    assert [o["loaded"] for o in outs] == [4] * 4
    assert all(o["restored_equal"] and o["final_equal"] for o in outs), outs


def _flip(path: str, start: int = 0, n: int | None = None) -> None:
    with open(path, "r+b") as f:
        f.seek(start)
        data = f.read() if n is None else f.read(n)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize("what", ["parity", "data"])
def test_a_corrupted_parity_or_data_share_is_never_loaded_storage_is(tmp_path: Path, job, what: str) -> None:
    d, log = tmp_path / "run", tmp_path / "log.txt"
    said = _lose_host_b(job, d, log, hosts=FIRST, replicas=0)
    if what == "parity":
        for r in (0, 2, 3):  # every survivor's parity, every byte: each of rank 1's rebuilt chunks is wrong
            bufs = _replica_memfds(int(said[r]["KEEPER"]), {int(i) for i in said[r]["INODES"].split()})
            assert len(bufs) == 1, f"rank {r}'s keeper holds {len(bufs)} buffers beside its trainer's, not one parity"
            _flip(bufs[0])
    else:  # rank 2's own share: the bytes of leaf "w" (past any header padding) in the slots its keeper maps
        keeper, staged = said[2]["KEEPER"], {int(i) for i in said[2]["INODES"].split()}
        slots = {os.stat(p).st_ino: p for p in (f"/proc/{keeper}/fd/{fd}" for fd in os.listdir(f"/proc/{keeper}/fd"))
                 if os.path.exists(p) and os.stat(p).st_ino in staged}
        assert slots, "rank 2's keeper maps none of its trainer's staging buffers"
        for path in slots.values():
            _flip(path, 8192, 16384)
    outs = _resume(job, d, log, hosts=["a", "e", "c", "d"], replicas=0)
    assert [o["agreed"] for o in outs] == [6] * 4
    assert [o["loaded"] for o in outs] == [4] * 4  # every rank fell back to storage's newest step
    assert all(o["restored_equal"] and o["final_equal"] for o in outs), outs
    for o in outs:  # each rank was told that rank 1's share did not come from its parity group
        assert any(step == 6 and "could not be restored from memory" in msg and "rank 1" in msg
                   and "parity group" in msg for step, msg in o["keeper_failures"]), o["keeper_failures"]
