"""Replication rate of the memory tier's transport against a plain socket copy of the same bytes.

``python benchmarks/replica.py [--mib 1024] [--repeats 5] [--chunk-mib 16]``

One process stages ``--mib`` MiB in a memfd buffer (64 leaves, CRC32C of each taken as staging
takes it) and forks a sender and a receiver (hosts ``host-a`` and ``host-b``). Each repeat, in
turn:

* the floor: the sender ``sendall``\\ s the buffer over one TCP connection (loopback) and the
  receiver ``recv_into``\\ s it into a preallocated memfd buffer of its own;
* the transport: :meth:`ReplicaGroup.send_step` / :meth:`ReplicaGroup.recv_step` of the same
  bytes into the same kind of preallocated buffer, gloo underneath, with the link proof, the
  authenticated header and every leaf's CRC32C checked (the floor checks nothing).

Both are timed at the receiver, from the moment both ends are ready to the last byte (and, for
the transport, the last checksum). Prints each repeat, the medians, and the ratio of the
transport's rate to the floor's (target: at least 0.8x).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

from zerostall.buffers import HostBuffer  # noqa: E402
from zerostall.checksum import checksum  # noqa: E402
from zerostall.format.manifest import encode_manifest  # noqa: E402
from zerostall.memtier.replica import OutgoingStep, ReplicaGroup, ReplicaOf  # noqa: E402

SECRET = b"benchmark secret, 32 bytes long!"


def staged(n: int, leaves: int = 64) -> tuple[HostBuffer, bytes]:
    buf = HostBuffer(n)
    arr = np.frombuffer(buf.view, dtype=np.uint64)
    arr[:] = np.arange(len(arr), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    per = n // leaves
    rows = [{"key": f"leaf{i}", "kind": "bytes", "dtype": "U8", "shape": [per], "file": 0, "offset": i * per,
             "nbytes": per, "crc32c": checksum(buf.view[i * per:(i + 1) * per])} for i in range(leaves)]
    items = {r["key"]: {"type": "bytes", "leaf": i} for i, r in enumerate(rows)}
    return buf, encode_manifest(items=items, leaves=rows, files=[{"path": "data/file0", "size": n}])


def barrier(store: dist.TCPStore, name: str) -> None:
    store.add(name, 1)
    while int(store.add(name, 0)) < 2:
        time.sleep(0.0005)


def recv_exact(conn: socket.socket, view: memoryview, n: int) -> None:
    """The floor's receiving end: ``n`` bytes into ``view`` (a preallocated buffer), 16 MiB per call."""
    got = 0
    while got < n:
        k = conn.recv_into(view[got:n], min(n - got, 16 << 20))
        if not k:
            raise EOFError("the sender closed the floor's connection")
        got += k


def socket_floor_s(n: int, repeats: int) -> list[float]:
    """Seconds a plain socket copy of ``n`` bytes takes between two processes (loopback, one TCP
    connection, ``sendall`` from a staged buffer, ``recv_into`` a preallocated one), per repeat:
    the floor of moving a rank's bytes to another host, timed at the receiver."""
    lsock = socket.create_server(("127.0.0.1", 0))
    src = HostBuffer(n)
    np.frombuffer(src.view, dtype=np.uint8)[:] = 7
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the sender
        code = 0
        try:
            os.close(r)
            sock = socket.create_connection(lsock.getsockname())
            for _ in range(repeats):
                sock.recv(1)
                sock.sendall(src.view[:n])
            sock.close()
        except BaseException as exc:
            print(f"floor sender: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            code = 1
        os._exit(code)
    os.close(w)
    os.close(r)
    dst = HostBuffer(n)
    conn, _ = lsock.accept()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        conn.sendall(b"g")
        recv_exact(conn, dst.view, n)
        out.append(time.perf_counter() - t0)
    conn.close()
    lsock.close()
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]):
        raise RuntimeError("the floor's sender failed")
    return out


def sender(port: int, lsock_port: int, buf: HostBuffer, manifest: bytes, n: int, args: argparse.Namespace) -> None:
    os.environ["ZEROSTALL_HOST_ID"] = "host-a"
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    g = ReplicaGroup(store, job_id="bench", secret=SECRET, member=0, size=2, chunk_bytes=args.chunk_mib << 20,
                     timeout_s=120)
    sock = socket.create_connection(("127.0.0.1", lsock_port))
    step = OutgoingStep(ReplicaOf("run", 2, 0, 1), manifest, (("file0", buf.view[:n]),))
    for i in range(args.repeats):
        sock.recv(1)  # the receiver is ready
        sock.sendall(buf.view[:n])
        barrier(store, f"go{i}")
        g.send_step(1, step)
    sock.close()
    g.close()


def receiver(port: int, lsock: socket.socket, n: int, args: argparse.Namespace, w: int) -> None:
    os.environ["ZEROSTALL_HOST_ID"] = "host-b"
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    g = ReplicaGroup(store, job_id="bench", secret=SECRET, member=1, size=2, chunk_bytes=args.chunk_mib << 20,
                     timeout_s=120)
    spare = [HostBuffer(n)]
    conn, _ = lsock.accept()
    out = []
    for i in range(args.repeats):
        view = spare[0].view
        t0 = time.perf_counter()
        conn.sendall(b"g")
        recv_exact(conn, view, n)
        floor = time.perf_counter() - t0
        barrier(store, f"go{i}")
        t0 = time.perf_counter()
        r = g.recv_step(0, run_id="run", world=2, rank=0, step=1, reuse=spare)
        rep = time.perf_counter() - t0
        spare = r.release()  # received into again, as a keeper does
        out.append({"floor_s": floor, "replica_s": rep})
        print(f"repeat {i}: socket floor {n / floor / 1e9:.2f} GB/s, replica {n / rep / 1e9:.2f} GB/s, "
              f"ratio {floor / rep:.2f}", flush=True)
    os.write(w, json.dumps(out).encode())
    os.close(w)
    conn.close()
    g.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-mib", type=int, default=16)
    args = p.parse_args()
    n = args.mib << 20
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    lsock = socket.create_server(("127.0.0.1", 0))
    buf, manifest = staged(n)
    r, w = os.pipe()
    pids = []
    for role in ("receiver", "sender"):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                if role == "receiver":
                    os.close(r)
                    receiver(master.port, lsock, n, args, w)
                else:
                    sender(master.port, lsock.getsockname()[1], buf, manifest, n, args)
            except BaseException as exc:
                print(f"{role}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
        pids.append(pid)
    os.close(w)
    with os.fdopen(r) as f:
        raw = f.read()
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    if any(codes) or not raw:
        print(f"a child failed: {codes}", file=sys.stderr)
        return 1
    rows = json.loads(raw)
    floor = statistics.median(x["floor_s"] for x in rows)
    rep = statistics.median(x["replica_s"] for x in rows)
    paired = statistics.median(x["floor_s"] / x["replica_s"] for x in rows)
    print(f"{args.mib} MiB, {args.repeats} repeats, {args.chunk_mib} MiB pieces, {os.cpu_count()} CPUs")
    print(f"median socket floor: {n / floor / 1e9:.2f} GB/s ({floor:.3f} s)")
    print(f"median replica:      {n / rep / 1e9:.2f} GB/s ({rep:.3f} s)")
    print(f"replica / floor: {floor / rep:.2f}x (median of paired ratios {paired:.2f}x); target >= 0.8x: "
          f"{'met' if paired >= 0.8 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
