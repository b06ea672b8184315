"""A torch.distributed job across the namespace hosts of :mod:`nshosts`: the job's store in one
host (as torchrun's agent store: it outlives the workers), ranks started in the hosts a
placement names, each with ``MASTER_ADDR``/``MASTER_PORT`` pointing at the store's host.

No ``ZEROSTALL_HOST_ID``: each host is told apart by its own hostname, as on separate machines,
and gloo finds its interface by resolving it (the hosts' /etc/hosts maps every name to its veth
address). tests/conftest.py puts tests/support on ``sys.path``, so tests import it as ``hostjob``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nshosts import Hosts

__all__ = ["JobStore", "start_ranks", "lose_host"]

_STORE = ("import datetime, sys, torch.distributed as d\n"
          "s = d.TCPStore('0.0.0.0', 0, is_master=True, timeout=datetime.timedelta(seconds=300))\n"
          "print(s.port, flush=True)\nsys.stdin.read()\n")


class JobStore:
    """The job's ``TCPStore`` server, run in host ``host`` until :meth:`close` (or the hosts close)."""

    def __init__(self, hosts: Hosts, host: str) -> None:
        self.hosts, self.host = hosts, host
        self.proc = hosts.popen(host, [sys.executable, "-c", _STORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=_env())
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the job's store did not start in host {host}: {line!r}")
        self.port = int(line)
        self.addr = hosts.addr(host)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ZEROSTALL_HOST_ID", None)
    env.pop("ZEROSTALL_FAULTS", None)  # a fault a test injects is given to the rank it is for
    env.update(extra or {})
    return env


def start_ranks(hosts: Hosts, store: JobStore, placement: Sequence[str], argv: Callable[[int], list[str]],
                log: Path, env: dict[str, str] | None = None, rank_env: dict[int, dict[str, str]] | None = None,
                **popen: Any) -> list[subprocess.Popen[str]]:
    """Start rank ``r`` in host ``placement[r]`` as ``argv(r)``, stderr appended to ``log`` (a
    keeper keeps a pipe open while it persists), stdout piped (text), stdin piped; ``env`` added
    to every rank's environment, ``rank_env[r]`` to rank ``r``'s."""
    procs = []
    with open(log, "a") as err:
        for r, host in enumerate(placement):
            e = _env({"MASTER_ADDR": store.addr, "MASTER_PORT": str(store.port), **(env or {}),
                      **(rank_env or {}).get(r, {})})
            procs.append(hosts.popen(host, argv(r), stdout=subprocess.PIPE, stderr=err, stdin=subprocess.PIPE,
                                     text=True, env=e, **popen))
    return procs


def lose_host(hosts: Hosts, host: str) -> None:
    """Every process of host ``host`` (its trainers and their keepers, in their own sessions) dies
    at once: SIGKILL by namespace membership, as a machine that loses power."""
    import signal
    import time

    deadline = time.monotonic() + 30.0
    while pids := hosts.pids(host):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of host {host} did not die")
        time.sleep(0.02)
