"""Writers killed at every phase on "another host": what a later collector removes and keeps.

Shared by the POSIX test (tests/integration/test_orphans.py) and the S3 one
(tests/storage/test_s3_orphans.py). A trainer subprocess (numpy state: no torch start-up) runs
with ``ZEROSTALL_HOST_ID=other-host`` and a 3 s lease (renewed every 0.75 s: slack for a loaded
machine), its writer held at one phase; the test
kills writer and trainer (the host is gone), so this host can prove nothing from process ids
and must wait for the leases to expire.

Run as a script, it is that trainer: ``_orphans.py URL STEP`` saves ``STEP`` and prints
``WRITER <pid>`` then ``COMMITTED <step>``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")
OTHER = "other-host"


def state(step: int) -> dict[str, Any]:
    import numpy as np

    return {"w": np.arange(1 << 15, dtype=np.float32) + step, "b": np.full(100, step, dtype=np.int64)}


class Trainer:
    def __init__(self, url: str, step: int, env: dict[str, str]) -> None:
        self.step = step
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), url, str(step)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **env})
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("WRITER"):
            self.proc.kill()
            raise AssertionError(f"trainer for step {step} said {line!r}: {self.proc.communicate()[1]}")
        self.writer = int(line.split()[1])

    def kill(self) -> None:
        for pid in (self.writer, self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.communicate()
        wait_dead(self.writer)

    def finish(self) -> str:
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err
        return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} survived SIGKILL"
        time.sleep(0.02)


def wait_mark(mark: Path, phase: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(p.name.startswith(phase + "-") for p in mark.iterdir()):
        assert time.monotonic() < deadline, f"the writer never reached {phase!r}"
        time.sleep(0.02)


def start_held(url: str, tmp: Path, step: int, phase: str, action: str) -> Trainer:
    """A trainer of "another host" whose writer is held at ``phase`` (``sleep:..`` or ``wait:..``)."""
    from zerostall.lease import HOST_ENV, LEASE_ENV
    from zerostall.persist.faults import ENV, MARK_ENV

    mark = tmp / f"mark-{step}"
    mark.mkdir()
    t = Trainer(url, step, {HOST_ENV: OTHER, LEASE_ENV: "3", ENV: json.dumps({phase: action}),
                            MARK_ENV: str(mark), "ZEROSTALL_TEST_KEEP_LAST": "3"})
    t.mark = mark  # type: ignore[attr-defined]
    return t


def main() -> None:
    sys.path.insert(0, SRC)
    import zerostall

    url, step = sys.argv[1], int(sys.argv[2])
    keep = os.environ.get("ZEROSTALL_TEST_KEEP_LAST")
    ck = zerostall.Checkpointer(url, keep_last=int(keep) if keep else None)
    r = ck.save_pytree_async(step, state(step))
    print(f"WRITER {ck._engine.writer.pid}", flush=True)
    r.result(timeout=300)
    print(f"COMMITTED {step}", flush=True)
    ck.close()


if __name__ == "__main__":
    main()
