"""zerostall's own collectives end within ``DistributedOptions.timeout_s`` and name the ranks that
did not answer (zerostall.distributed.exchange), in real gloo processes: rank 1 answers the first
exchange, then stops answering (SIGSTOP: alive, silent) while rank 0 waits in the second."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from memtier_procs import stop

from zerostall.distributed.exchange import decode, encode

RANK = """
import datetime, json, os, sys, time
sys.path.insert(0, {src!r})
import torch.distributed as dist
from zerostall import DistributedOptions
from zerostall.distributed.exchange import broadcast, gather
from zerostall.errors import PeerUnreachableError
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=600))
opts = DistributedOptions(timeout_s=2.0)
got = gather((rank, {{rank: [rank, None]}}), opts, what="the first")
first = broadcast({{"from": rank}}, opts, what="the answer")
print(json.dumps({{"gathered": repr(got), "broadcast": first}}), flush=True)
if rank == 1:
    print("STOP ME", flush=True)
    time.sleep(600)
t0 = time.monotonic()
try:
    gather(rank, opts, what="listing the steps", step=7)
except PeerUnreachableError as exc:
    print(json.dumps({{"error": str(exc), "ranks": list(exc.ranks), "step": exc.step,
                       "took": time.monotonic() - t0}}), flush=True)
"""


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def test_plain_data_round_trips_with_tuples_and_int_keys() -> None:
    value = ([4, 6], None, {2: 6, 3: (1, "x")}, ("a", 1.5, True), [])
    assert decode(encode(value)) == value
    with pytest.raises(TypeError, match="plain data"):
        encode(object())


def test_an_exchange_a_rank_stops_answering_ends_at_timeout_s_naming_that_rank(tmp_path: Path) -> None:
    code = RANK.format(src=str(Path(__file__).parents[2] / "src"), port=_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        assert procs[1].stdout is not None and procs[0].stdout is not None
        first1 = json.loads(procs[1].stdout.readline())
        assert procs[1].stdout.readline().strip() == "STOP ME"
        stop(procs[1].pid)
        first0 = json.loads(procs[0].stdout.readline())
        out = json.loads(procs[0].stdout.readline())
        assert procs[0].wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()
    assert first0 == first1 == {"gathered": "[(0, {0: [0, None]}), (1, {1: [1, None]})]", "broadcast": {"from": 0}}
    assert out["ranks"] == [1] and out["step"] == 7, out
    assert "listing the steps of step 7: rank(s) [1] did not answer" in out["error"], out
    assert out["took"] < 2.0 + 2.0 + 2.0, out  # timeout_s, then the roll call's wait, and a margin
