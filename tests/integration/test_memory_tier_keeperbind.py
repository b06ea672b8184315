"""The keeper's name and the keeper-failure markers, with real keeper processes.

* A trainer that loses the memory tier to another keeper (it raises ``InvalidArgumentError`` from
  its constructor) leaves the markers of failed keeper persists alone: only the trainer whose
  keeper serves it consumes (reports and removes) them.
* A keeper that cannot bind its name, or finds it held by another user's process (a squatter),
  still serves its trainer but cannot be adopted after a crash: the trainer hears it (a
  ``ZerostallWarning`` and an entry in ``Checkpointer.keeper_failures``), not only the keeper's stderr.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
from memtier_procs import (
    DEADLINE_S,
    TRAINER,
    assert_state,
    keeper_processes,
    keeper_sockets,
    running,
    squatter,
    storage_steps,
    wait_for,
)

from zerostall import Checkpointer, MemoryTier
from zerostall.commit import step_name
from zerostall.errors import InvalidArgumentError, KeeperPersistError, StorageError, ZerostallWarning
from zerostall.memtier.keeperfail import KeeperFailure, UnadoptableKeeper, marker_key, write_marker
from zerostall.memtier.spec import keeper_address
from zerostall.messages import to_wire
from zerostall.persist.faults import ENV as FAULTS_ENV
from zerostall.storage import open_storage

sys.path.insert(0, str(Path(__file__).parent))
from _memory_trainer import state

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
        assert_state(ck.load_pytree(1), state(1))


# -- a keeper that serves but cannot be adopted after a crash ---------------------------------


def _unadoptable(ck: Checkpointer, caught: list[warnings.WarningMessage], d: Path) -> UnadoptableKeeper:
    """The one warning and the one keeper failure a Checkpointer with an unadoptable keeper has."""
    (w,) = [x for x in caught if issubclass(x.category, ZerostallWarning)]
    assert w.filename == __file__  # raised on the training thread, pointing at the user's line
    (err,) = ck.keeper_failures
    assert isinstance(err, UnadoptableKeeper) and not isinstance(err, BaseException)  # a record: never raised
    assert str(w.message) == str(err)
    assert err.path == str(d) and err.rank == 0 and err.step is None
    assert f"pid {ck._engine.writer.pid}" in str(err) and "cannot be adopted after a crash" in str(err)
    return err


def _still_serves(ck: Checkpointer, d: Path) -> None:
    """Memory-only saves and loads work as with an adoptable keeper; no further warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZerostallWarning)
        r = ck.save_pytree_async(1, state(1))
        assert r.result().tiers == ("memory",)
        assert_state(ck.load_pytree(1), state(1))
        ck.save_pytree(2, state(2))
    assert len(ck.keeper_failures) == 1
    ck.close()
    assert storage_steps(d) == [2]  # the clean close persisted what only memory held


def test_a_keeper_that_cannot_bind_its_name_is_heard_by_its_trainer(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The keeper this Checkpointer starts inherits the fault: its bind fails with EACCES, as an LSM
    # or seccomp policy refusing it would (an abstract name cannot be refused otherwise here).
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"keeper_bind": "raise:EACCES"}))
    d = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = Checkpointer(d, memory_tier=TIER)
    monkeypatch.delenv(FAULTS_ENV)
    err = _unadoptable(ck, caught, d)
    assert err.errno == errno.EACCES and "[EACCES]" in str(err)
    assert keeper_address(str(d), 0) not in keeper_sockets()  # no restart could find it
    _still_serves(ck, d)


def test_an_unadoptable_keeper_still_persists_after_its_trainer_dies(tmp_path: Path) -> None:
    """What the warning promises: after a crash such a keeper persists the newest memory-only step
    and exits (it has no name to linger on), so the restart finds it on storage."""
    d = tmp_path / "run"
    env = dict(os.environ, **{FAULTS_ENV: json.dumps({"keeper_bind": "raise:EACCES"})})
    # (The keeper inherits the trainer's stderr and keeps it until its persist ends: run() returns then.)
    p = subprocess.run([sys.executable, TRAINER, str(d), "1", "2", "1000", "60", "kill"], capture_output=True,
                       text=True, env=env, timeout=DEADLINE_S)
    assert p.returncode == -signal.SIGKILL
    assert "ZerostallWarning" in p.stderr and "cannot be adopted after a crash" in p.stderr
    keeper = next(int(x.split()[1]) for x in p.stdout.splitlines() if x.startswith("KEEPER "))
    wait_for(lambda: not running(keeper), "the unadoptable keeper to exit after its persist")  # linger_s is 60
    assert storage_steps(d) == [2]
    with Checkpointer(d, memory_tier=TIER) as ck:
        assert not ck._engine.writer.adopted and ck.keeper_failures == []
        assert_state(ck.load_pytree(), state(2))


@pytest.mark.skipif(os.getuid() != 0, reason="starting another user's process (the squatter) needs root")
def test_a_keeper_whose_name_another_user_holds_is_heard_by_its_trainer(tmp_path: Path) -> None:
    d = tmp_path / "run"
    # this user's name for (d, rank 0), taken by someone else
    with squatter(keeper_address(str(d), 0)) as pid:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck = Checkpointer(d, memory_tier=TIER)
        err = _unadoptable(ck, caught, d)
        assert err.errno == errno.EADDRINUSE and f"pid {pid}, uid 65534" in str(err)
        _still_serves(ck, d)


def test_the_unadoptable_warning_as_an_error_leaves_nothing_running(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``filterwarnings("error")`` makes the warning fatal: the constructor raises it, and, as for any
    error it raises, the keeper it started is gone (no process left on the directory)."""
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"keeper_bind": "raise:EPERM"}))
    d = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZerostallWarning)
        with pytest.raises(ZerostallWarning, match=r"\[EPERM\]"):
            Checkpointer(d, memory_tier=TIER)
    monkeypatch.delenv(FAULTS_ENV)
    wait_for(lambda: keeper_processes(d) == [], "the keeper to exit")
