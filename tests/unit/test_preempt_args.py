"""``Checkpointer(preemption_signals=...)``: its arguments, and the handlers it chains to and restores.

Real signals to this process (SIGUSR1, whose default action would end it): the handler installed
before the Checkpointer still runs, ``should_save`` answers true at the next step and
``preempted`` follows; ``close()`` puts the previous handler back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import ArgumentTypeError, InvalidArgumentError


@pytest.mark.parametrize("bad", ["SIGTERM", signal.SIGTERM, (1.5,), (True,), {signal.SIGTERM}, ("SIGTERM",)])
def test_preemption_signals_of_the_wrong_type_raise_argument_type_error_naming_it(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ArgumentTypeError) as ei:
        Checkpointer(tmp_path / "run", preemption_signals=bad)  # type: ignore[arg-type]
    assert ei.value.argument == "preemption_signals"


@pytest.mark.parametrize("bad", [(signal.SIGKILL,), (signal.SIGSTOP,), (0,), (10_000,)])
def test_uncatchable_or_unknown_signals_raise_invalid_argument_error(tmp_path: Path, bad: tuple[int, ...]) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        Checkpointer(tmp_path / "run", preemption_signals=bad)
    assert ei.value.argument == "preemption_signals"
    assert not isinstance(ei.value, ArgumentTypeError)


def test_preemption_signals_on_a_read_only_checkpointer_are_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(InvalidArgumentError) as ei:
        Checkpointer(tmp_path / "run", read_only=True, preemption_signals=(signal.SIGUSR1,))
    assert ei.value.argument == "preemption_signals"


def test_preemption_signals_off_the_main_thread_are_refused(tmp_path: Path) -> None:
    got: list[BaseException] = []

    def make() -> None:
        try:
            Checkpointer(tmp_path / "run", save_options=SaveOptions(writer=WriterKind.THREAD),
                         preemption_signals=(signal.SIGUSR1,)).close()
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert len(got) == 1 and isinstance(got[0], InvalidArgumentError)
    assert got[0].argument == "preemption_signals"
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def _until(cond: object) -> None:
    deadline = time.monotonic() + 30
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_the_previous_handler_is_chained_then_restored_and_the_next_step_is_the_final_save(tmp_path: Path) -> None:
    calls: list[int] = []

    def mine(signum: int, frame: object) -> None:
        calls.append(signum)

    before = signal.signal(signal.SIGUSR1, mine)
    try:
        ck = Checkpointer(tmp_path / "run", save_interval_steps=100, preemption_signals=(signal.SIGUSR1,))
        assert signal.getsignal(signal.SIGUSR1) != mine  # zerostall's handler is installed
        assert not ck.should_save(1) and not ck.preempted
        ck.save_pytree(1, {"x": 1})
        os.kill(os.getpid(), signal.SIGUSR1)
        _until(lambda: calls)  # the handler runs on this (the main) thread
        assert calls == [signal.SIGUSR1]
        _until(lambda: ck._preemption is not None and ck._preemption.final_step is not None)
        assert not ck.preempted  # not before should_save answered the final step
        assert ck.should_save(2)  # not on the interval (100), but the step after the signal
        assert ck.preempted
        ck.save_pytree(2, {"x": 2})
        assert not ck.should_save(3)  # the final save is answered once
        ck.close()
        assert signal.getsignal(signal.SIGUSR1) == mine
        assert ck.latest_step() == 2
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_default_action_is_restored_at_close(tmp_path: Path) -> None:
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    with Checkpointer(tmp_path / "run", preemption_signals=[signal.SIGUSR2]) as ck:
        os.kill(os.getpid(), signal.SIGUSR2)  # would end this process without zerostall's handler
        _until(lambda: ck._preemption is not None and ck._preemption.final_step is not None)
        assert ck.should_save(0) and ck.preempted
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_without_preemption_signals_no_handler_is_installed(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with Checkpointer(tmp_path / "run") as ck:
        assert signal.getsignal(signal.SIGTERM) == before
        assert not ck.preempted


def test_a_forked_child_gets_the_previous_handler_and_wakeup_fd_back(tmp_path: Path) -> None:
    """A child forked while the handlers are installed (a DataLoader worker) must neither swallow
    the signal nor write it into the parent's pipe (the wakeup fd it inherited)."""
    with Checkpointer(tmp_path / "run", preemption_signals=(signal.SIGUSR1,)) as ck:
        assert signal.set_wakeup_fd(-1) != -1  # the parent's is zerostall's pipe (put back below)
        wake = ck._preemption._wfd if ck._preemption is not None else -1
        signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
        pid = os.fork()
        if pid == 0:  # the child: report what it has, then take the signal as before zerostall
            ok = signal.set_wakeup_fd(-1) == -1 and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
            if not ok:
                os._exit(3)
            os.kill(os.getpid(), signal.SIGUSR1)
            os._exit(4)  # not reached: SIGUSR1's default action ends the child
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGUSR1, status
        assert ck._preemption is not None and ck._preemption.final_step is None and not ck._preemption._noticed
