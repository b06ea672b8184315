"""The writer's intake: read the trainer's messages on a thread of their own, while jobs run.

A ``SaveJob`` message grows with the number of leaves (~170 bytes each), so a few thousand leaves
overflow a unix socket's buffer (~208 KB). A writer that read only between jobs left the trainer
blocked in ``send`` — on its training thread — until the previous save had committed. The intake
drains the socket as messages arrive and queues them, in order, for the job loop.

A :class:`~zerostall.messages.MapBuffer` is followed on the socket by its descriptor
(SCM_RIGHTS); the intake receives it at once, so it travels with its message. The end of the
stream (the trainer closed or died) is queued *after* every message that preceded it: the job
loop still runs every job the trainer sent, then sees the end. :class:`~zerostall.messages.Close`
is the last message a trainer sends, so the intake stops reading there.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from zerostall.messages import Close, MapBuffer, Message, decode

__all__ = ["Intake"]

#: one queued item: a message with its descriptor (MapBuffer only), the end (None), or the
#: error that ended reading (a message that could not be decoded), raised in the job loop
_Item = tuple[Message, int | None] | BaseException | None


class Intake:
    """Reads ``conn`` on a daemon thread; :meth:`get` hands the messages over in order.

    Example::

        intake = Intake(conn)
        try:
            while (got := intake.get()) is not None:
                msg, fd = got
                ...
        finally:
            intake.stop()
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, name="zerostall-writer-intake", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        item: _Item = None
        try:
            while True:
                try:
                    raw = self._conn.recv_bytes()
                except (EOFError, OSError):
                    break  # the trainer closed or died: the end, after what it sent
                msg = decode(raw)
                fd: int | None = None
                if isinstance(msg, MapBuffer):
                    try:
                        fd = recv_handle(self._conn)
                    except (EOFError, OSError):
                        break  # died between the message and its descriptor: nothing to map
                self._queue.put((msg, fd))
                if isinstance(msg, Close):
                    break
        except BaseException as exc:  # noqa: BLE001 - the job loop raises it, in order
            item = exc
        self._queue.put(item)

    def get(self) -> tuple[Message, int | None] | None:
        """The next message and its descriptor (the caller owns and closes it), or None at the end.

        Raises:
            ProtocolMismatchError: the trainer speaks another protocol version.
            ZerostallError: a malformed message.
        """
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Stop reading (the job loop is leaving) and close the descriptors never taken."""
        if self._thread.is_alive():
            try:  # wakes a recv blocked on the socket; the connection is being closed anyway
                with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._thread.join(timeout=10)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple) and item[1] is not None:
                os.close(item[1])
