"""The keepers of the replica transport tests (tests/integration/test_replica_transport.py).

``python _replica_worker.py ROLE STORE_ADDR STORE_PORT``, one process per role, each in a host of
its own (tests/support/nshosts.py: its own address and hostname, no ``ZEROSTALL_HOST_ID``): ``a``
sends (host a), ``b`` receives (host b), ``x`` is the intruder (wrong secret, then another job,
then another uid, on host c). Each prints one JSON line per scenario; the roles keep in step
through keys in the job's store, which runs in host a. In the ``hung`` scenario ``a`` stops itself
(SIGSTOP) mid-transfer: the test continues it once ``b`` has reported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from zerostall.buffers import HostBuffer
from zerostall.checksum import checksum
from zerostall.errors import ReplicaError
from zerostall.format.manifest import encode_manifest
from zerostall.memtier.replica import OutgoingStep, ReplicaGroup, ReplicaOf

SECRET = b"the job's secret, 32 bytes long!"
JOB = "job-1"
TIMEOUT = 20.0
#: the intruder can run as another user (nobody) only when this runs as root
AS_ROOT = os.getuid() == 0
role, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
store: dist.TCPStore
warned: list[str] = []


class _Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            warned.append(record.getMessage())


logging.getLogger("zerostall").addHandler(_Keep())


def out(**kw: object) -> None:
    os.write(1, (json.dumps({"role": role, **kw}) + "\n").encode())  # one write: lines of the roles never mix


def group(name: str, member: int, size: int, *, secret: bytes = SECRET, job: str = JOB,
          timeout_s: float = TIMEOUT) -> ReplicaGroup:
    return ReplicaGroup(store, job_id=job, secret=secret, member=member, size=size, group=name,
                        timeout_s=timeout_s, chunk_bytes=1 << 20)


def staged(seed: int = 7) -> tuple[list[HostBuffer], bytes, list[tuple[str, memoryview]]]:
    """Two data files of leaves (3.5 MiB and 1 MiB + 5 bytes), CRC32C taken at staging."""
    rng = np.random.default_rng(seed)
    sizes = [(3 << 20) + (1 << 19), (1 << 20) + 5]
    bufs = [HostBuffer(n + 4096) for n in sizes]
    leaves, files = [], []
    for fi, (b, n) in enumerate(zip(bufs, sizes, strict=True)):
        np.frombuffer(b.view, dtype=np.uint8)[:n] = rng.integers(0, 256, n, dtype=np.uint8)
        cuts = [0, 1000, 1 << 20, n - 5, n]
        for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            leaves.append({"key": f"f{fi}/leaf{i}", "kind": "bytes", "dtype": "U8", "shape": [hi - lo], "file": fi,
                           "offset": lo, "nbytes": hi - lo, "crc32c": checksum(b.view[lo:hi])})
        files.append({"path": f"data/file{fi}", "size": n})
    items = {lf["key"]: {"type": "bytes", "leaf": i} for i, lf in enumerate(leaves)}
    manifest = encode_manifest(items=items, leaves=leaves, files=files)
    return bufs, manifest, [(f"file{fi}", b.view[:n]) for fi, (b, n) in enumerate(zip(bufs, sizes, strict=True))]


def digest(views: list[memoryview]) -> str:
    h = hashlib.sha256()
    for v in views:
        h.update(v)
    return h.hexdigest()


def attempt(fn: object) -> dict[str, object]:
    try:
        got = fn()  # type: ignore[operator]
    except ReplicaError as exc:
        return {"error": "ReplicaError", "message": str(exc), "key": exc.key}
    return {"ok": got}


def sync(name: str) -> None:
    store.add(f"sync/{name}", 1)
    deadline = time.monotonic() + 60
    while int(store.add(f"sync/{name}", 0)) < 2:  # a and b
        if time.monotonic() > deadline:
            raise TimeoutError(name)
        time.sleep(0.01)


def intruder() -> None:
    for name, kw in (("wrong-secret", {"secret": b"not the job's secret at all....."}),
                     ("other-job", {"job": "job-2"})):
        warned.clear()
        out(scenario=name, **attempt(lambda kw=kw: group(name, 2, 3, **kw).members and None), warned=list(warned))
    if not AS_ROOT:
        return
    os.setgid(65534)
    os.setuid(65534)
    out(scenario="other-user", **attempt(lambda: group("other-user", 2, 3).members and None))


def both_ways(g: ReplicaGroup, peer: int, step: OutgoingStep) -> None:
    """Send ``step`` to ``peer`` on a thread while receiving the peer's step at the same time."""
    sent: dict[str, object] = {}
    t = threading.Thread(target=lambda: sent.update(attempt(lambda: g.send_step(peer, step))))
    t.start()

    def recv() -> object:
        r = g.recv_step(peer, run_id="run-1", world=8, rank=peer)
        try:
            return digest([r.view(i) for i in range(len(r.lengths))])
        finally:
            r.close()

    got = attempt(recv)
    t.join()
    out(scenario="both-ways", sent=sent, got=got, digest=digest([v for _, v in step.files]))
    sync("both-ways")


def run_a(g: ReplicaGroup) -> None:
    bufs, manifest, files = staged()
    of = ReplicaOf("run-1", 8, 0, 100)
    step = OutgoingStep(of, manifest, tuple(files))
    out(scenario="intact", digest=digest([v for _, v in files]), **attempt(lambda: g.send_step(1, step)))
    sync("intact")
    both_ways(g, 1, step)
    out(scenario="wrong-run", **attempt(lambda: g.send_step(1, step)))
    sync("wrong-run")
    flipped = files[1][1]
    flipped[(1 << 20) + 1] ^= 0x10  # after staging: the manifest keeps the CRC32C of the staged bytes
    out(scenario="flipped", **attempt(lambda: g.send_step(1, step)))
    flipped[(1 << 20) + 1] ^= 0x10
    sync("flipped")
    g._key = b"\0" * 32  # this end no longer holds the job's key: as a hijacked connection's sender
    warned.clear()
    out(scenario="link-proof", **attempt(lambda: g.send_step(1, step)), warned=list(warned))
    sync("link-proof")
    g.close()
    silent = group("silent", 0, 2, timeout_s=3.0)
    sync("silent")  # b's receive timed out meanwhile: this end never sent
    silent.close()
    h = group("hung", 0, 2, timeout_s=3.0)

    def hang(sent: int) -> None:
        if not hung:
            hung.append(sent)
            os.kill(os.getpid(), signal.SIGSTOP)  # after the first piece: alive, silent, until the test continues it

    hung: list[int] = []
    out(scenario="hung", **attempt(lambda: h.send_step(1, step, progress=hang)))
    sync("hung")
    h.close()
    d = group("kill", 0, 2)

    def die(sent: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)  # after the first piece: mid-transfer

    d.send_step(1, step, progress=die)


def run_b(g: ReplicaGroup) -> None:
    def recv(**kw: object) -> object:
        r = g.recv_step(0, **{"run_id": "run-1", "world": 8, "rank": 0, **kw})  # type: ignore[arg-type]
        try:
            return {"digest": digest([r.view(i) for i in range(len(r.lengths))]), "of": list(vars(r.of).values()),
                    "names": r.names, "lengths": r.lengths}
        finally:
            r.close()

    out(scenario="intact", **attempt(recv))
    sync("intact")
    bufs, manifest, files = staged(seed=8)
    both_ways(g, 0, OutgoingStep(ReplicaOf("run-1", 8, 1, 100), manifest, tuple(files)))
    out(scenario="wrong-run", **attempt(lambda: recv(run_id="run-2")))
    sync("wrong-run")
    out(scenario="flipped", **attempt(recv))
    sync("flipped")
    warned.clear()
    out(scenario="link-proof", **attempt(recv), warned=list(warned))
    sync("link-proof")
    g.close()
    silent = group("silent", 1, 2, timeout_s=3.0)
    out(scenario="silent", **attempt(recv_from(silent)))
    sync("silent")
    silent.close()
    h = group("hung", 1, 2, timeout_s=3.0)
    t0 = time.monotonic()
    out(scenario="hung", **attempt(recv_from(h)), seconds=time.monotonic() - t0)
    sync("hung")
    h.close()
    d = group("kill", 1, 2)
    t0 = time.monotonic()
    out(scenario="kill", **attempt(recv_from(d)), seconds=time.monotonic() - t0, timeout=TIMEOUT)


def recv_from(d: ReplicaGroup) -> object:
    return lambda: d.recv_step(0, run_id="run-1", world=8, rank=0) and None


def main() -> None:
    global store
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=60))
    if role == "x":
        intruder()
        return
    me = 0 if role == "a" else 1
    kept = None
    for name in ("wrong-secret", "other-job", "other-user") if AS_ROOT else ("wrong-secret", "other-job"):
        warned.clear()
        g = group(name, me, 3)
        out(scenario=name, members=sorted(g.members), refused=sorted(g.refused), warned=list(warned))
        if kept is None:
            kept = g
        else:
            g.close()
    assert kept is not None
    (run_a if role == "a" else run_b)(kept)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # reported, then the test fails on the missing scenario
        out(scenario="crash", error=f"{type(exc).__name__}: {exc}")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
