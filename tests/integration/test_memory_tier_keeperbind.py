"""The keeper's name and the keeper-failure markers, with real keeper processes (r5keeper).

* A trainer that loses the memory tier to another keeper (it raises ``InvalidArgumentError`` from
  its constructor) leaves the markers of failed keeper persists alone: only the trainer whose
  keeper serves it consumes (reports and removes) them.
* A keeper that cannot bind its name, or finds it held by another user's process (a squatter),
  still serves its trainer but cannot be adopted after a crash: the trainer hears it (a
  ``ZerostallWarning`` and an entry in ``Checkpointer.keeper_failures``), not only the keeper's stderr.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from zerostall import Checkpointer, InvalidArgumentError, MemoryTier
from zerostall.commit import step_name
from zerostall.errors import KeeperPersistError, StorageError, to_wire
from zerostall.persist.keeper import keeper_address
from zerostall.persist.keeperfail import KeeperFailure, marker_key, write_marker
from zerostall.storage import open_storage

sys.path.insert(0, str(Path(__file__).parent))
from _memory_trainer import state
from test_memory_tier import _assert_state

TIER = MemoryTier(persist_interval_steps=1000, linger_s=5)


class _ClosingHolder:
    """A process of this user holding the keeper name of ``(d, rank 0)``: it accepts every
    connection and closes it unanswered (a keeper exiting, say). An adopting trainer finds no
    keeper there and starts its own, which finds the name held and tells its trainer (KeeperBusy)."""

    def __init__(self, d: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(keeper_address(str(d), 0))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join()


def _marker(d: Path, step: int) -> KeeperFailure:
    f = KeeperFailure(step=step, path=f"{d}/{step_name(step)}", rank=0, time=1.0,
                      error=to_wire(StorageError("disk full", errno=errno.ENOSPC, path=str(d))))
    write_marker(open_storage(str(d)), str(d), 0, [f])
    assert (d / marker_key(0)).exists()
    return f


def test_a_trainer_refused_the_memory_tier_leaves_the_keeper_failure_markers(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    _marker(d, 7)
    holder = _ClosingHolder(d)
    try:
        with pytest.raises(InvalidArgumentError, match=f"pid {os.getpid()}"):
            Checkpointer(d, memory_tier=TIER)
        # The refused trainer is not the keeper's owner: the failure is still there for the one that is.
        assert (d / marker_key(0)).exists()
    finally:
        holder.close()
    with Checkpointer(d, memory_tier=TIER) as ck:  # the name is free now: this one's keeper serves it
        (failure,) = ck.keeper_failures
        assert isinstance(failure, KeeperPersistError) and failure.step == 7 and failure.errno == errno.ENOSPC
        assert not (d / marker_key(0)).exists()  # reported once
        ck.save_pytree(1, state(1))
        _assert_state(ck.load_pytree(1), state(1))
