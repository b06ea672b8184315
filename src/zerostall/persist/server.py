"""The writer: a loop that maps staged buffers and runs save jobs, one at a time, in order.

Messages are JSON over a socket; buffer descriptors travel as SCM_RIGHTS. In process mode this
module is the writer's ``__main__``; it exits when the trainer closes the connection (also when
the trainer is killed), after finishing every job it had already received, so a save whose
``save_*_async`` returned is committed even if the trainer dies right after.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import sys
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

from zerostall.errors import to_wire
from zerostall.persist.job import run_job

__all__ = ["serve", "main"]


def _send(conn: Connection, msg: dict[str, Any]) -> None:
    try:
        conn.send_bytes(json.dumps(msg).encode())
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass  # the trainer is gone; the job still completes


def _close(m: mmap.mmap) -> None:
    """Unmap a buffer. The traceback of a failed job can keep a slice of its view alive in a
    reference cycle (frame -> future -> exception -> traceback -> frame) until the cycle
    collector runs; collect first rather than die on BufferError."""
    try:
        m.close()
    except BufferError:
        gc.collect()
        try:
            m.close()
        except BufferError:
            pass  # still referenced: unmapped when the last reference goes, or at exit


def serve(conn: Connection) -> None:
    maps: dict[int, mmap.mmap] = {}
    views: dict[int, memoryview] = {}
    try:
        while True:
            try:
                msg = json.loads(conn.recv_bytes())
            except (EOFError, ConnectionResetError, OSError):
                return
            op = msg.get("op")
            if op == "map":
                fd = recv_handle(conn)
                try:
                    maps[msg["buffer"]] = mmap.mmap(fd, msg["size"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                views[msg["buffer"]] = memoryview(maps[msg["buffer"]])
            elif op == "unmap":
                v = views.pop(msg["buffer"], None)
                if v is not None:
                    v.release()
                m = maps.pop(msg["buffer"], None)
                if m is not None:
                    _close(m)
            elif op == "save":
                sid = msg["id"]
                try:
                    stats = run_job(msg, views, lambda: _send(conn, {"op": "released", "id": sid}))
                except BaseException as exc:  # every failure goes back to the caller's result()
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    if os.environ.get("ZEROSTALL_DEBUG"):
                        traceback.print_exc()
                    _send(conn, {"op": "error", "id": sid, "error": to_wire(exc, path=msg.get("path"))})
                else:
                    _send(conn, {"op": "done", "id": sid, "stats": stats})
            elif op == "ping":
                _send(conn, {"op": "pong", "pid": os.getpid()})
            elif op == "close":
                return
    finally:
        for v in views.values():
            v.release()
        for m in maps.values():
            _close(m)
        conn.close()


def main(argv: list[str]) -> int:
    fd = int(argv[1])
    nice = int(argv[2]) if len(argv) > 2 else 0
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
        # SCHED_BATCH: a woken writer thread (an I/O completed) does not preempt the trainer's
        # threads; with OpenMP spin-waiting, preempting one trainer thread stalls all of them.
        if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH"):
            try:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            except OSError:
                pass
    serve(Connection(fd))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
