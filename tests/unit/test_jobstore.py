"""Every request on the job's store ends within its bound (zerostall.jobstore), against a real
``TCPStore`` server in another process that stops answering (SIGSTOP: alive, silent), then answers
again: torch's own client would wait for it until TCP gives up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

pytest.importorskip("torch")

from memtier_procs import stop

from zerostall.errors import PeerUnreachableError
from zerostall.jobstore import SLACK_S, bounded

SERVER = ("import datetime, sys, torch.distributed as d\n"
          "s = d.TCPStore('127.0.0.1', 0, is_master=True, timeout=datetime.timedelta(seconds=30))\n"
          "print(s.port, flush=True)\nsys.stdin.read()\n")


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    p = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    port = int(p.stdout.readline())
    yield p, port
    os.kill(p.pid, signal.SIGCONT)
    p.kill()
    p.wait()


def _client(port: int, bound_s: float, prefix: str = "") -> object:
    import torch.distributed as dist

    return bounded(lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=bound_s)),
                   bound_s, what="the test's store", prefix=prefix)


def test_requests_to_a_store_that_stops_answering_end_within_their_bound_and_work_again_after(server) -> None:
    p, port = server
    store = _client(port, 1.0)
    store.set("a", "1")  # type: ignore[attr-defined]
    assert store.add("n", 2) == 2  # type: ignore[attr-defined]
    stop(p.pid)
    for name, call, bound in [("add", lambda: store.add("n", 1), 1.0),  # type: ignore[attr-defined]
                              ("get", lambda: store.get("a"), 1.0 + SLACK_S),  # type: ignore[attr-defined]
                              ("wait", lambda: store.wait(["a"], timedelta(seconds=0.5)), 0.5 + SLACK_S)]:  # type: ignore[attr-defined]
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachableError, match=f"did not answer its {name} request"):
            call()
        assert time.monotonic() - t0 < bound + 1.0, name
    os.kill(p.pid, signal.SIGCONT)
    assert store.get("a") == b"1"  # type: ignore[attr-defined]  # a new connection once it answers again


def test_a_deadline_bounds_several_requests_together_and_a_prefix_names_the_keys(server) -> None:
    import torch.distributed as dist

    p, port = server
    store = _client(port, 30.0, prefix="job-1")
    store.set("k", "v")  # type: ignore[attr-defined]
    plain = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    assert plain.get("job-1/k") == b"v"
    dist.PrefixStore("x", store).set("k", "w")  # C++ callers go through the bounds too
    assert plain.get("job-1/x/k") == b"w"
    stop(p.pid)
    store.deadline = time.monotonic() + 1.0  # type: ignore[attr-defined]
    t0 = time.monotonic()
    for _ in range(3):  # three requests, one deadline: the 30 s per request never applies
        with pytest.raises(PeerUnreachableError):
            store.add("n", 1)  # type: ignore[attr-defined]
    assert time.monotonic() - t0 < 2.5
