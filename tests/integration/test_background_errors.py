"""A save that fails in the background reaches the caller even if it never calls ``result()``.

The failures are real: the run directory is replaced by a regular file after the Checkpointer
opened it, so the writer process's first ``mkdir`` under it fails with ``ENOTDIR`` (which holds
for root too, unlike a ``chmod``). Each test checks one way the error surfaces: the next save,
``wait()``, ``close()``, the end of the ``with`` block, ``on_error``, the free functions' next
call and the warning at interpreter exit, and that an error already received is not raised twice.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import zerostall
from zerostall import Checkpointer, Response, SaveOptions
from zerostall.errors import BackgroundSaveError, StorageError, WriterError, ZerostallError
from zerostall.persist.faults import ENV as FAULTS_ENV

SRC = str(Path(__file__).resolve().parents[2] / "src")


def state(seed: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(seed)), "step": seed}


def break_dir(d: Path) -> None:
    """Make every later save under ``d`` fail in the writer: ``d`` becomes a regular file."""
    shutil.rmtree(d)
    d.write_bytes(b"not a directory")


def finished(r: Response, timeout: float = 60.0) -> Response:
    """Wait until ``r`` has failed or committed, without receiving its error."""
    deadline = time.monotonic() + timeout
    while not r.done():
        assert time.monotonic() < deadline, "the save did not finish"
        time.sleep(0.01)
    return r


def assert_names_failure(err: BackgroundSaveError, step: int | None, path: str) -> None:
    assert isinstance(err, WriterError) and isinstance(err, ZerostallError)
    assert err.step == step
    assert isinstance(err.cause, StorageError) and err.cause.errno == errno.ENOTDIR
    assert err.errno == errno.ENOTDIR
    assert err.__cause__ is err.cause
    assert err.path is not None and path in err.path
    text = str(err)
    assert (f"step {step}" if step is not None else path) in text
    assert "StorageError" in text


def test_next_save_raises_a_background_failure(tmp_path: Path) -> None:
    d = tmp_path / "run"
    ck = Checkpointer(d)
    try:
        ck.save_pytree(1, state(1))
        break_dir(d)
        finished(ck.save_pytree_async(2, state(2)))
        with pytest.raises(BackgroundSaveError) as ei:
            ck.save_pytree_async(3, state(3))
        assert_names_failure(ei.value, 2, str(d))
        # Reported once: the next save is attempted again (and fails again, in the background).
        finished(ck.save_pytree_async(3, state(3)))
        with pytest.raises(BackgroundSaveError) as ei:
            ck.save_checkpointables_async(4, {"x": state(4)})
        assert ei.value.step == 3
    finally:
        ck._engine.close()


def test_wait_raises_once(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with Checkpointer(d) as ck:
        break_dir(d)
        ck.save_pytree_async(1, state(1))
        with pytest.raises(BackgroundSaveError) as ei:
            ck.wait()
        assert_names_failure(ei.value, 1, str(d))
        ck.wait()  # already reported
    # leaving the block raised nothing: the failure was received from wait()


def test_close_raises(tmp_path: Path) -> None:
    d = tmp_path / "run"
    ck = Checkpointer(d)
    break_dir(d)
    ck.save_pytree_async(7, state(7))
    with pytest.raises(BackgroundSaveError) as ei:
        ck.close()
    assert_names_failure(ei.value, 7, str(d))
    ck.close()  # closed, nothing left to report


def test_leaving_the_with_block_raises(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with pytest.raises(BackgroundSaveError) as ei, Checkpointer(d) as ck:
        break_dir(d)
        ck.save_pytree_async(1, state(1))  # the quickstart's loop: nobody keeps the response
    assert_names_failure(ei.value, 1, str(d))


def test_every_failure_is_reported_in_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The writer holds each job at its start until `go` exists, so that all three saves are
    # staged before the first fails (three slots: none waits for another).
    go = tmp_path / "go"
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"begin": f"wait:{go}"}))
    d = tmp_path / "run"
    ck = Checkpointer(d, save_options=SaveOptions(max_in_flight=3))
    break_dir(d)
    for step in (1, 2, 3):
        ck.save_pytree_async(step, state(step))
    go.touch()
    with pytest.raises(BackgroundSaveError) as ei:
        ck.close()
    err = ei.value
    assert_names_failure(err, 1, str(d))
    assert [s for s, _, _ in err.errors] == [1, 2, 3]
    assert all(isinstance(e, StorageError) and e.errno == errno.ENOTDIR for _, _, e in err.errors)
    assert "2 later save(s) failed too (step 2, step 3)" in str(err)


def test_with_block_error_is_not_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "run"
    with (caplog.at_level(logging.ERROR, logger="zerostall"), pytest.raises(KeyError, match="from the loop"),
          Checkpointer(d) as ck):
        break_dir(d)
        ck.save_pytree_async(5, state(5))
        raise KeyError("from the loop")
    assert any("step 5" in r.getMessage() and "KeyError" in r.getMessage() for r in caplog.records)


def test_an_error_received_from_the_response_is_not_raised_again(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with Checkpointer(d) as ck:
        break_dir(d)
        r = ck.save_pytree_async(1, state(1))
        with pytest.raises(StorageError) as ei:
            r.result()
        assert ei.value.errno == errno.ENOTDIR
        with pytest.raises(StorageError):  # the synchronous save raises its own error at once
            ck.save_pytree(2, state(2))
        r3 = finished(ck.save_pytree_async(3, state(3)))
        assert isinstance(r3.exception(), StorageError)  # exception() hands it over too
        ck.wait()
    # close() on leaving raised nothing either


def test_on_error_receives_failures_instead(tmp_path: Path) -> None:
    d = tmp_path / "run"
    seen: list[BackgroundSaveError] = []
    with Checkpointer(d, on_error=seen.append) as ck:
        break_dir(d)
        for step in (1, 2):
            finished(ck.save_pytree_async(step, state(step)))
        ck.save_pytree_async(3, state(3))  # not raised: on_error had them
        ck.wait()
    assert [e.step for e in seen] == [1, 2, 3]
    for e in seen:
        assert_names_failure(e, e.step, str(d))


def test_on_error_that_raises_keeps_the_failure(tmp_path: Path) -> None:
    d = tmp_path / "run"

    def broken(err: BackgroundSaveError) -> None:
        raise RuntimeError("the logging callback itself failed")

    ck = Checkpointer(d, on_error=broken)
    break_dir(d)
    ck.save_pytree_async(1, state(1))
    with pytest.raises(BackgroundSaveError) as ei:
        ck.close()
    assert ei.value.step == 1


def test_free_functions_raise_on_their_next_call(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    bad = blocker / "ckpt"  # its parent is a regular file: the writer fails with ENOTDIR
    finished(zerostall.save_pytree_async(bad, state(1)))
    with pytest.raises(BackgroundSaveError) as ei:
        zerostall.save_pytree_async(tmp_path / "good", state(2))
    assert_names_failure(ei.value, None, str(bad))
    assert not (tmp_path / "good").exists()  # the raising call saved nothing
    zerostall.save_pytree(tmp_path / "good", state(2))  # reported once; saving goes on
    assert zerostall.load_pytree(tmp_path / "good")["step"] == 2


def test_free_function_error_received_is_not_raised_again(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(StorageError):
        zerostall.save_pytree(blocker / "ckpt", state(1))
    zerostall.save_pytree(tmp_path / "good", state(2))


SCRIPT = """
import sys, time, torch, zerostall
blocker = sys.argv[1]
open(blocker, "wb").close()
r = zerostall.save_pytree_async(blocker + "/ckpt", {"w": torch.zeros(8)})
if sys.argv[2] == "receive":
    try:
        r.result()
    except zerostall.errors.StorageError:
        pass
print("exiting")
"""


@pytest.mark.parametrize("receive", [False, True])
def test_unreceived_failure_is_warned_at_exit(tmp_path: Path, receive: bool) -> None:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path / "file"),
                           "receive" if receive else "ignore"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "exiting" in proc.stdout
    warned = [line for line in proc.stderr.splitlines() if "RuntimeWarning:" in line]
    if receive:
        assert warned == [], proc.stderr
    else:
        assert len(warned) == 1, proc.stderr
        assert "background save" in warned[0] and str(tmp_path / "file" / "ckpt") in warned[0]
        assert "ENOTDIR" in warned[0] or "Not a directory" in warned[0]
