"""What a newcomer tripped over in round 3 (memory tier, failure reporting): docs/newcomer-run.md."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerostall
from zerostall import MemoryTier, SaveOptions, WriterKind
from zerostall.errors import ArgumentTypeError, InvalidArgumentError, ZerostallError

EXAMPLE = Path(__file__).parents[1] / "examples" / "torchrun_ddp.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _example(d: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The DDP example as one rank of a world of one (what torchrun would set), real gloo."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    return subprocess.run([sys.executable, str(EXAMPLE), "--dir", str(d), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_ddp_example_run_again_at_its_last_step_says_so_instead_of_crashing(tmp_path: Path) -> None:
    # README's memory-tier command reused the plain run's default directory, which already held
    # step --steps: the example resumed there, trained nothing, and died on an unbound `loss`.
    first = _example(tmp_path, "--steps", "4", "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _example(tmp_path, "--steps", "4", "--save-every", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step 4 from storage" in again.stdout
    assert "already at step 4, nothing to train" in again.stdout, again.stdout


# -- MemoryTier: a value of the wrong type is a TypeError too (ArgumentTypeError) ------------------

@pytest.mark.parametrize(("field", "value"), [
    ("persist_interval_steps", "10"), ("persist_interval_steps", 2.0), ("persist_interval_steps", True),
    ("persist_interval_s", "5"), ("persist_interval_s", True),
    ("linger_s", "600"), ("linger_s", None), ("linger_s", True),
])
def test_memory_tier_refuses_a_wrong_type_as_a_type_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ArgumentTypeError, match=field) as info:
        MemoryTier(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError) and isinstance(info.value, ZerostallError)


@pytest.mark.parametrize(("field", "value"), [
    ("persist_interval_steps", 0), ("persist_interval_steps", -3), ("persist_interval_s", 0),
    ("persist_interval_s", float("nan")), ("linger_s", -1.0), ("linger_s", float("nan")),
])
def test_memory_tier_out_of_range_stays_a_value_error(field: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=field) as info:
        MemoryTier(**{field: value})  # type: ignore[arg-type]
    assert not isinstance(info.value, TypeError)


def test_memory_tier_linger_zero_is_allowed() -> None:
    assert MemoryTier(linger_s=0).linger_s == 0  # exit right after persisting: no adoption


# -- Response.wait_staged / result: a bad timeout is refused, a timeout says what timed out ---------

@pytest.fixture
def response(tmp_path: Path) -> zerostall.Response:
    return zerostall.save_pytree_async(tmp_path / "a", {"w": torch.ones(3)},
                                       options=SaveOptions(writer=WriterKind.THREAD))


@pytest.mark.parametrize("timeout", ["5", True, float("nan"), float("inf")])
def test_wait_staged_refuses_a_timeout_that_is_not_a_finite_number(response: zerostall.Response,
                                                                    timeout: object) -> None:
    with pytest.raises(InvalidArgumentError, match="timeout"):
        response.wait_staged(timeout=timeout)  # type: ignore[arg-type]
    response.result()


def test_wait_staged_refuses_a_negative_timeout(response: zerostall.Response) -> None:
    # It used to raise TimeoutError "staging did not finish within -1 s" while the copy went on.
    with pytest.raises(InvalidArgumentError, match="timeout must be >= 0"):
        response.wait_staged(timeout=-1)
    response.wait_staged(timeout=60.0)  # a valid one still works
    response.result()


def test_result_timeout_names_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # concurrent.futures' TimeoutError has no message: the user saw a bare "TimeoutError".
    go = tmp_path / "go"
    monkeypatch.setenv("ZEROSTALL_FAULTS", json.dumps({"commit": f"wait:{go}"}))
    r = zerostall.save_pytree_async(tmp_path / "held", {"w": torch.ones(3)},
                                    options=SaveOptions(writer=WriterKind.THREAD))
    with pytest.raises(TimeoutError, match=r"held.*not committed within 0\.1 s \(the save goes on\)"):
        r.result(timeout=0.1)
    go.touch()
    assert r.result().nbytes > 0


# -- zerostall list with a keeper-failed marker: where it is and what clears it --------------------

def _failure(d: Path, step: int, rank: int) -> object:
    from zerostall.commit import step_name
    from zerostall.errors import StorageError, to_wire
    from zerostall.persist.keeperfail import KeeperFailure

    return KeeperFailure(step=step, path=f"{d}/{step_name(step)}", rank=rank, time=1.0,
                         error=to_wire(StorageError("No space left on device", errno=28, path=str(d))))


def test_list_says_where_a_keeper_failure_is_recorded_and_what_clears_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zerostall.cli import main as cli_main
    from zerostall.persist.keeperfail import marker_key, write_marker
    from zerostall.storage import open_storage

    d = tmp_path / "run"
    d.mkdir()
    write_marker(open_storage(str(d)), str(d), 0, [_failure(d, 7, 0)])  # type: ignore[list-item]
    assert cli_main(["list", str(d)]) == 0
    out = capsys.readouterr().out
    assert "KEEPER PERSIST FAILED: step 7 (rank 0)" in out
    assert f"recorded in {d}/{marker_key(0)}" in out and "delete it once read" in out
    assert cli_main(["list", str(d), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["keeper_failed"]
    assert row["marker"] == f"{d}/{marker_key(0)}" and row["step"] == 7


def test_list_names_this_hosts_fallback_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from zerostall.cli import main as cli_main
    from zerostall.persist.keeperfail import local_marker, marker_key, write_marker
    from zerostall.storage import open_storage

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    d = tmp_path / "run"
    d.mkdir()
    (d / marker_key(1)).mkdir()  # storage cannot take the marker (a directory in the way, even for root)
    where = write_marker(open_storage(str(d)), str(d), 1, [_failure(d, 9, 1)])  # type: ignore[list-item]
    (d / marker_key(1)).rmdir()
    assert where == local_marker(str(d), 1)
    assert cli_main(["list", str(d)]) == 0
    assert f"recorded in {where}" in capsys.readouterr().out


# -- a load from the memory tier names the step's path, not the keeper's internal zsimage:// URL ----

_KILLED_TRAINER = """
import os, signal, sys, torch, zerostall
ck = zerostall.Checkpointer(sys.argv[1], memory_tier=zerostall.MemoryTier(persist_interval_steps=5, linger_s=60))
for s in (1, 2):
    ck.save_pytree_async(s, {"w": torch.full((4,), float(s))}).result()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_mismatch_loading_from_memory_names_the_step_path(tmp_path: Path) -> None:
    from zerostall.errors import MismatchError

    d = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", _KILLED_TRAINER, str(d)], timeout=120)
    assert p.returncode == -9
    with zerostall.Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=5)) as ck:
        assert ck.memory_step() == 2  # adopted: step 2 is read from memory
        with pytest.raises(MismatchError) as info:
            ck.load_pytree(2, template={"w": torch.zeros(5)})
        assert info.value.path == f"{d}/step_00000002" and info.value.key == "pytree/w"
        assert "memory tier" in str(info.value) and "zsimage" not in str(info.value)
        assert ck.load_pytree(2, template={"w": torch.zeros(4)})["w"].tolist() == [2.0] * 4


_LIVE_TRAINER = """
import sys, torch, zerostall
with zerostall.Checkpointer(sys.argv[1], memory_tier=zerostall.MemoryTier(persist_interval_steps=5)) as ck:
    for s in (1, 2):
        ck.save_pytree_async(s, {"w": torch.full((4,), float(s))}).result()
    print("HELD", ck.memory_step(), flush=True)
    sys.stdin.readline()
"""


def test_loading_a_step_a_live_trainers_keeper_holds_says_why_it_is_not_on_storage(tmp_path: Path) -> None:
    from zerostall.errors import CheckpointNotFoundError

    d = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", _LIVE_TRAINER, str(d)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().split() == ["HELD", "2"]
        ck = zerostall.Checkpointer(d, read_only=True)
        with pytest.raises(CheckpointNotFoundError, match="step 2 is held only in the memory of this host's "
                                                          "keeper of rank 0") as info:
            ck.load_pytree(2)
        assert info.value.path == f"{d}/step_00000002"
        with pytest.raises(CheckpointNotFoundError) as other:
            ck.load_pytree(3)  # held nowhere: no such hint
        assert "held only in the memory" not in str(other.value)
        with pytest.raises(CheckpointNotFoundError, match="step 2 is held only in the memory"):
            zerostall.load_pytree(d / "step_00000002")  # the free function too
        ck.close()
    finally:
        assert p.stdin is not None
        p.communicate("\n", timeout=120)
    assert p.returncode == 0
    assert zerostall.load_pytree(d / "step_00000002")["w"].tolist() == [2.0] * 4  # persisted at close()


def test_memory_tier_with_a_thread_writer_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="the memory tier needs the process writer") as info:
        zerostall.Checkpointer(tmp_path / "run", memory_tier=MemoryTier(),
                               save_options=SaveOptions(writer=WriterKind.THREAD))
    assert info.value.path == str(tmp_path / "run")
