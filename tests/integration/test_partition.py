"""A host cut off from the others (its link down, its processes alive) during memory-only saves
with replicas, on hosts made as network namespaces (tests/support/nshosts.py).

Four gloo ranks, 0 and 1 on host ``a`` (which also runs the job's store, as torchrun's agent
does), 2 and 3 on host ``d``; ``MemoryTier(persist_interval_steps=4, replicas=1)``, every save
waited for; storage (a shared directory) reachable from both. Host ``d``'s link goes down after
step 5's all-reduce, before its save. What holds, on both sides of the cut:

* step 5's ``result()`` returns within ``timeout_s`` (its replica cannot reach the other side:
  tiers ``memory``, no ``peer``), and the next zerostall collective (``latest_step()``) raises
  ``PeerUnreachableError``: on ``a`` naming ranks 2 and 3, on ``d`` saying its host is cut off.
  That exchange follows each rank's question to its own keeper (bounded by ``timeout_s``), so a
  rank waits for the others' answers until then and ``timeout_s`` more, plus the roll call;
* the ranks leave as a failing job does, and the keepers, which still reach storage, commit step 5
  together (nothing torn: every leaf verifies);
* once the link is back, the restarted job resumes every rank from step 5, bit for bit.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hostjob import JobStore, start_ranks

from zerostall.commit import committed_steps
from zerostall.restore.verify import verify_checkpoint
from zerostall.storage import open_storage

WORKER = str(Path(__file__).parent / "_replica_host_trainer.py")
PLACEMENT = ["a", "a", "d", "d"]
TIMEOUT_S = 4.0
#: the roll call that names the ranks (2 s), and this VM's scheduling
MARGIN_S = 4.0
DEADLINE_S = 120.0


def _lines(p, log: Path) -> dict[str, str]:
    assert p.stdout is not None
    out, _ = p.communicate(timeout=DEADLINE_S)
    said = {}
    for line in out.splitlines():
        head, _, rest = line.strip().partition(" ")
        said[head] = rest
    assert "RESULT5" in said, (said, log.read_text()[-4000:])
    return said


def test_a_cut_off_host_every_rank_returns_or_raises_within_timeout_s_and_the_job_resumes_step_5(
        nshosts, tmp_path: Path) -> None:
    hosts = nshosts(["a", "d"], shared=[tmp_path])
    store = JobStore(hosts, "a")
    d, log = tmp_path / "run", tmp_path / "log.txt"

    def argv(phase: str) -> object:
        return lambda r: [sys.executable, WORKER, phase, str(r), "4", str(d), str(TIMEOUT_S),
                          str(tmp_path / f"out-{r}.json")]

    procs = start_ranks(hosts, store, PLACEMENT, argv("partition"), log)  # type: ignore[arg-type]
    for p in procs:
        assert p.stdout is not None
        while (line := p.stdout.readline()) and not line.startswith("REDUCED 5"):
            pass
        assert line.startswith("REDUCED 5"), log.read_text()[-4000:]
    hosts.cut("d")
    (tmp_path / "cut").touch()
    said = [_lines(p, log) for p in procs]
    assert [p.returncode for p in procs] == [1] * 4  # each left through its exception
    for r, s in enumerate(said):
        tiers, took = s["RESULT5"].split()
        assert tiers == "memory", (r, s)  # in memory; its replica could not cross the cut
        assert float(took) < TIMEOUT_S + MARGIN_S, (r, s)
        secs, _, doc = s["UNREACHABLE"].partition(" ")
        assert float(secs) < 2 * TIMEOUT_S + MARGIN_S, (r, s)
        err = json.loads(doc)
        if PLACEMENT[r] == "a":
            assert err["ranks"] == [2, 3] and "rank(s) [2, 3] did not answer" in err["message"], (r, err)
        else:
            assert err["ranks"] == [] and "this rank's host is cut off" in err["message"], (r, err)
    # The keepers of both sides reach storage: step 5, which each holds, is committed by all four.
    storage = open_storage(str(d))
    deadline = time.monotonic() + DEADLINE_S
    while 5 not in committed_steps(storage):
        assert time.monotonic() < deadline, f"step 5 never reached storage:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    assert verify_checkpoint(str(d / "step_00000005")).ok
    hosts.restore("d")
    procs = start_ranks(hosts, store, PLACEMENT, argv("resume"), log)  # type: ignore[arg-type]
    for p in procs:
        assert p.wait(timeout=DEADLINE_S) == 0, log.read_text()[-6000:]
    outs = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(4)]
    assert [o["agreed"] for o in outs] == [5] * 4
    assert [o["loaded"] for o in outs] == [5] * 4
    assert [o["adopted"] for o in outs] == [True] * 4  # from each host's own memory
    assert all(o["restored_equal"] and o["final_equal"] for o in outs), outs
