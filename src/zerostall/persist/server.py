"""The writer: a loop that maps staged buffers and runs save jobs, one at a time, in order.

Messages are JSON over a socket; buffer descriptors travel as SCM_RIGHTS. In process mode this
module is the writer's ``__main__``; it exits when the trainer closes the connection (also when
the trainer is killed), after finishing every job it had already received, so a save whose
``save_*_async`` returned is committed even if the trainer dies right after.
"""

from __future__ import annotations

import gc
import mmap
import os
import sys
import traceback
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Protocol

from zerostall import envvars
from zerostall._version import __version__
from zerostall.errors import WriterError
from zerostall.messages import (
    PROTOCOL,
    Close,
    Done,
    Failed,
    ForgetLayout,
    Hello,
    LeafLayout,
    MapBuffer,
    Message,
    ProtocolMismatchError,
    Released,
    SaveJob,
    SavePiece,
    UnmapBuffer,
    WireError,
    WriterStats,
    encode,
    resolve_layout,
    to_wire,
)
from zerostall.persist.intake import Intake
from zerostall.persist.job import run_save
from zerostall.storage import import_scheme

__all__ = ["serve", "main", "lower_priority", "HeldSteps"]


class HeldSteps(Protocol):
    """What the loop hands a writer that is more than a writer (the memory tier's keeper,
    :class:`zerostall.memtier.keeper.Keeper`): its memory jobs, the buffers it maps, and the
    messages of its own kinds (:mod:`zerostall.memtier.messages`); the writer itself knows
    nothing more of it. The trainer's side has the mirror seam
    (:class:`zerostall.persist.client.WriterSide`)."""

    @property
    def unadoptable(self) -> WireError | None: ...

    def report_failed(self, conn: Connection) -> None:
        """Tell the trainer on ``conn`` of what failed in the background and it has not heard of."""

    def on_map(self, buffer: int, fd: int, size: int) -> None: ...

    def on_unmap(self, buffer: int) -> None: ...

    def run(self, job: SaveJob, views: dict[int, memoryview], send: Callable[[Message], None]) -> WriterStats:
        """Run a memory job (``job.memory``)."""

    def handle(self, msg: Message, conn: Connection, send: Callable[[Message], None]) -> bool:
        """A message of its own kinds (an image query, a persist request, its replication's
        setup): True once handled, False for a kind it does not know either."""

    def closing(self, conn: Connection, send: Callable[[Message], None]) -> None:
        """The trainer said :class:`Close`: what must happen before the writer's loop ends (the
        keeper persists what only its memory holds, and says so)."""


def _send(conn: Connection, msg: Message) -> None:
    try:
        conn.send_bytes(encode(msg))
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


_Got = tuple[Message, int | None] | None


class _PieceFeed:
    """A piecewise job's pieces, read from the trainer's connection while the job runs
    (:class:`zerostall.persist.job.Pieces`). Buffers mapped or unmapped meanwhile are handled at
    once; any other message waits in ``deferred`` for the loop, in order."""

    def __init__(self, intake: Intake, views: dict[int, memoryview], on_buffer: Callable[[Message, int | None], None],
                 send: Callable[[Message], None], deferred: deque[_Got]) -> None:
        self._intake, self._views, self._on_buffer, self._send = intake, views, on_buffer, send
        self._deferred = deferred

    def next(self) -> tuple[SavePiece, memoryview]:
        while True:
            got = self._intake.get()
            if got is None:
                self._deferred.append(None)  # the loop ends once the job has failed
                raise WriterError("the trainer's connection ended before the save's last piece; nothing of the save "
                                  "was committed")
            msg, fd = got
            if isinstance(msg, SavePiece) and msg.abort:
                raise WriterError("the trainer could not stage the rest of this save in pieces; nothing of it was "
                                  "committed")
            if isinstance(msg, SavePiece):
                view = self._views.get(msg.buffer)
                if view is None:
                    raise WriterError(f"a piece names buffer {msg.buffer}, which is not mapped")
                return msg, view
            if isinstance(msg, (MapBuffer, UnmapBuffer)):
                self._on_buffer(msg, fd)
            else:
                self._deferred.append(got)

    def release(self, piece: SavePiece) -> None:
        self._send(Released(job=piece.id))


def serve(conn: Connection, keeper: HeldSteps | None = None, *, own_process: bool = True) -> bool:
    """Run jobs from ``conn`` until it closes or says :class:`Close`; introduce itself first.

    Returns True when the trainer said :class:`Close`, False when the connection ended. With a
    ``keeper`` (the memory tier), memory jobs and image queries go to it. ``own_process=False``:
    a writer thread in the trainer's process, which leaves the trainer's environment alone
    (:func:`~zerostall.persist.job.run_save`'s ``mirror_env``).

    The leaf layouts the trainer sends (:class:`LeafLayout`) are kept for this connection only: a
    trainer that adopts a keeper starts a new one and sends them again. A job naming a layout not
    held fails with :class:`~zerostall.errors.UnknownLayoutError`.
    """
    maps: dict[int, mmap.mmap] = {}
    views: dict[int, memoryview] = {}
    layouts: dict[int, LeafLayout] = {}
    _send(conn, Hello(protocol=PROTOCOL, library=__version__, pid=os.getpid(),
                      unadoptable=keeper.unadoptable if keeper is not None else None))
    if keeper is not None:  # an adopting trainer hears first of what its predecessor's step lacks
        keeper.report_failed(conn)
    # Read on a thread of its own: a trainer sending while a job runs must never block (see intake).
    intake = Intake(conn)

    def on_buffer(msg: Message, fd: int | None) -> None:
        if isinstance(msg, MapBuffer):
            assert fd is not None  # the intake receives a MapBuffer's descriptor with it
            try:
                maps[msg.buffer] = mmap.mmap(fd, msg.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                if keeper is not None:
                    keeper.on_map(msg.buffer, fd, msg.size)
            finally:
                os.close(fd)
            views[msg.buffer] = memoryview(maps[msg.buffer])
        elif isinstance(msg, UnmapBuffer):
            v = views.pop(msg.buffer, None)
            if v is not None:
                v.release()
            m = maps.pop(msg.buffer, None)
            if m is not None:
                _close(m)
            if keeper is not None:
                keeper.on_unmap(msg.buffer)

    #: what arrived while a piecewise job read its pieces, handled next
    deferred: deque[_Got] = deque()
    feed = _PieceFeed(intake, views, on_buffer, lambda m: _send(conn, m), deferred)
    try:
        while True:
            try:
                got = deferred.popleft() if deferred else intake.get()
            except ProtocolMismatchError as exc:
                print(f"zerostall writer: {exc}", file=sys.stderr, flush=True)
                return False  # the trainer sees its writer exit; its listener names the mismatch from our Hello
            if got is None:
                return False
            msg, fd = got
            if isinstance(msg, (MapBuffer, UnmapBuffer)):
                on_buffer(msg, fd)
            elif isinstance(msg, SavePiece):
                # a piece of a job that failed before reading it: nothing reads its buffer
                _send(conn, Released(job=msg.id))
            elif isinstance(msg, LeafLayout):
                layouts[msg.id] = msg
            elif isinstance(msg, ForgetLayout):
                layouts.pop(msg.id, None)
            elif isinstance(msg, SaveJob):
                _run(conn, msg, views, keeper, layouts, own_process, feed)
                if keeper is not None:  # a persist after a crash may have failed meanwhile
                    keeper.report_failed(conn)
            elif isinstance(msg, Close):
                if keeper is not None:  # the trainer's close() returns once nothing lives in memory only
                    keeper.closing(conn, lambda m: _send(conn, m))
                return True
            elif keeper is None or not keeper.handle(msg, conn, lambda m: _send(conn, m)):
                raise WriterError(f"the writer does not take {type(msg).__name__} messages")
    finally:
        intake.stop()
        for v in views.values():
            v.release()
        for m in maps.values():
            _close(m)
        conn.close()


def _run(conn: Connection, job: SaveJob, views: dict[int, memoryview], keeper: HeldSteps | None = None,
         layouts: dict[int, LeafLayout] | None = None, own_process: bool = True, feed: _PieceFeed | None = None) -> None:
    try:
        job = resolve_layout(job, layouts or {})
        import_scheme(job.root, job.storage_ref)  # a scheme the trainer registered opens here too
        if keeper is not None and job.memory:
            stats = keeper.run(job, views, lambda m: _send(conn, m))
        else:
            stats = run_save(job, views, lambda: _send(conn, Released(job=job.id)), mirror_env=own_process,
                             pieces=feed if job.pieces else None)
    except BaseException as exc:  # every failure goes back to the caller's result()
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        if envvars.get(envvars.DEBUG):
            traceback.print_exc()
        _send(conn, Failed(job=job.id, error=to_wire(exc, path=job.path)))
    else:
        _send(conn, Done(job=job.id, stats=stats))


def lower_priority(nice: int, sched: str) -> None:
    """Give the trainer the cores: niceness plus a scheduling class (``batch`` or ``idle``).

    ``batch``: a woken writer thread (an I/O completed) does not preempt the trainer's threads;
    with OpenMP spin-waiting, preempting one trainer thread stalls all of them. ``idle``: the
    writer runs only on cores the trainer leaves idle (it can starve while training saturates
    every core; the memory tier makes a slow persist cheap). Failures to lower priority are
    ignored: the writer still works, only less politely.
    """
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    policy = {"batch": getattr(os, "SCHED_BATCH", None), "idle": getattr(os, "SCHED_IDLE", None)}.get(sched)
    if policy is not None and hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))
        except OSError:
            pass


def main(argv: list[str]) -> int:
    """``python -m zerostall.persist.server FD NICE SCHED``: serve the trainer on descriptor FD.
    (The memory tier's keeper has its own entry point: :mod:`zerostall.memtier.keeper`.)"""
    nice = int(argv[2]) if len(argv) > 2 else 0
    # Older trainers pass no policy: niceness alone then implied SCHED_BATCH.
    lower_priority(nice, argv[3] if len(argv) > 3 else ("batch" if nice else "normal"))
    serve(Connection(int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
