"""The everyday operations of the command line, run as real subprocesses: ``rm``, ``--version``,
``python -m zerostall``, ``list`` on broken runs (unreadable steps, keeper-failure markers),
``verify`` on a run directory, ``inspect``'s values and rank column (a real two-rank gloo save)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from _permissions import as_user_without_dac

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind

THREAD = SaveOptions(writer=WriterKind.THREAD)


def zs(*args: str | os.PathLike[str], module: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "zerostall"] if module else [sys.executable, "-c",
                                                             "import sys, zerostall.cli; sys.exit(zerostall.cli.main())"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=120)


def zs_json(*args: str | os.PathLike[str]) -> tuple[int, Any]:
    p = zs(*args, "--json")
    return p.returncode, json.loads(p.stdout)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    with Checkpointer(d, save_options=THREAD) as c:
        for step in (1, 2, 3):
            c.save_pytree(step, {"w": torch.full((4,), float(step)), "lr": 0.125, "opt": {"betas": (0.9, 0.999),
                                 "name": "adam", "eps": None, "warm": True, "n": 7}}, metadata={"loss": 1.0 / step})
    return d


def test_version_and_python_m() -> None:
    for module in (True, False):
        p = zs("--version", module=module)
        assert p.returncode == 0 and p.stdout.strip() == f"zerostall {zerostall.__version__}", p.stdout + p.stderr
    p = zs()  # no command: the same usage error as the console script
    assert p.returncode == 2 and "usage: zerostall" in p.stderr


def test_rm_a_step_and_by_step_number(run: Path) -> None:
    p = zs("rm", run / "step_00000001")
    assert p.returncode == 0 and "removed" in p.stdout, p.stderr
    rc, doc = zs_json("rm", run, "--step", "2")
    assert rc == 0 and doc["removed"] == [str(run / "step_00000002")]
    assert Checkpointer(run, read_only=True).steps() == [3]
    assert sorted(os.listdir(run)) == ["step_00000003"]  # nothing left behind
    p = zs("rm", run / "step_00000001")  # already gone: an error, not silence
    assert p.returncode == 1 and "no committed checkpoint" in p.stderr and "Traceback" not in p.stderr
    assert zs("rm", run, "--step", "-1").returncode == 2
    p = zs("rm", run)  # a run directory without --step is not deleted wholesale
    assert p.returncode == 1 and "1 committed step(s)" in p.stderr
    assert Checkpointer(run, read_only=True).steps() == [3]


def test_cli_rm_with_one_mistyped_target_deletes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # rm checks every target before it deletes any: one mistyped step among them must not leave
    # the others deleted behind an error about that one.
    from zerostall.cli import main

    run = tmp_path / "run"
    with zerostall.Checkpointer(run) as ckpt:
        ckpt.save_pytree(1, {"w": torch.ones(2)})
    assert main(["rm", str(run / "step_00000001"), str(run / "step_00000099")]) == 1
    err = capsys.readouterr().err
    assert "nothing was deleted" in err and "step_00000099" in err
    assert zerostall.Checkpointer(run, read_only=True).steps() == [1]


def test_checkpointer_delete(run: Path) -> None:
    with Checkpointer(run, save_options=THREAD) as c:
        c.delete(2)
        assert c.steps() == [1, 3]
        with pytest.raises(zerostall.errors.CheckpointNotFoundError):
            c.delete(2)
        with pytest.raises(zerostall.errors.InvalidArgumentError):
            c.delete(-1)
    with pytest.raises(zerostall.errors.ReadOnlyError):
        Checkpointer(run, read_only=True).delete(1)


def test_list_fails_on_an_unreadable_manifest_and_shows_partial_steps(run: Path) -> None:
    os.mkdir(run / "step_00000009")  # a step folder without a manifest
    p = zs("list", run)
    assert p.returncode == 0, p.stderr
    assert "step_00000009" in p.stdout and "PARTIAL" in p.stdout
    (run / "step_00000002" / "manifest.json").write_text("{not json")
    p = zs("list", run)
    assert p.returncode == 1 and "UNREADABLE" in p.stdout and "step_00000003" in p.stdout
    rc, doc = zs_json("list", run)
    assert rc == 1 and doc["ok"] is False and doc["partial"] == ["step_00000009"]


def test_cli_list_and_verify_show_an_unreadable_step_instead_of_calling_it_partial(
        run_with_unreadable_newest: Path) -> None:
    # A step folder that cannot be read may hold a committed step: list must not call it
    # "PARTIAL" (in flight or crashed) and exit 0, nor may verify skip it and report the run OK.
    run = str(run_with_unreadable_newest)
    listing = as_user_without_dac(f"from zerostall.cli import main; raise SystemExit(main(['list', {run!r}]))")
    assert listing.returncode == 1, listing.stdout + listing.stderr
    assert "PARTIAL" not in listing.stdout
    assert "step_00000002" in listing.stdout and "UNREADABLE" in listing.stdout and "EACCES" in listing.stdout
    verify = as_user_without_dac(
        f"from zerostall.cli import main; raise SystemExit(main(['verify', {run!r}, '--json']))")
    assert verify.returncode == 1, verify.stdout + verify.stderr
    doc = json.loads(verify.stdout)
    assert [(s["step"], s["ok"]) for s in doc["steps"]] == [(1, True), (2, False)]
    assert "EACCES" in doc["steps"][1]["problems"][0]["message"]


def _failure(d: Path, step: int, rank: int) -> object:
    from zerostall.commit import step_name
    from zerostall.errors import StorageError
    from zerostall.memtier.keeperfail import KeeperFailure
    from zerostall.messages import to_wire

    return KeeperFailure(step=step, path=f"{d}/{step_name(step)}", rank=rank, time=1.0,
                         error=to_wire(StorageError("No space left on device", errno=28, path=str(d))))


def test_list_says_where_a_keeper_failure_is_recorded_and_what_clears_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zerostall.cli import main as cli_main
    from zerostall.memtier.keeperfail import marker_key, write_marker
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
    from zerostall.memtier.keeperfail import local_marker, marker_key, write_marker
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


def test_verify_a_run_directory(run: Path) -> None:
    p = zs("verify", run)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("OK ") == 4 and "3 step(s) verified" in p.stdout
    rc, doc = zs_json("verify", run, "--latest")
    assert rc == 0 and [d["step"] for d in doc["steps"]] == [3]
    # a flipped byte in step 2 and a broken manifest in step 1: both named, the run fails
    m = json.loads((run / "step_00000002" / "manifest.json").read_bytes())
    f = run / "step_00000002" / m["files"][0]["path"]
    raw = bytearray(f.read_bytes())
    raw[m["leaves"][0]["offset"]] ^= 1
    f.write_bytes(bytes(raw))
    (run / "step_00000001" / "manifest.json").write_text("[]")
    rc, doc = zs_json("verify", run)
    assert rc == 1 and [d["ok"] for d in doc["steps"]] == [False, False, True]
    assert doc["steps"][1]["bad_keys"] == ["pytree/w"]
    p = zs("verify", run)
    assert p.returncode == 1 and "2 bad: 1, 2" in p.stdout
    assert zs("verify", run, "--latest").returncode == 0  # step 3 is fine
    empty = run.parent / "empty"
    empty.mkdir()
    p = zs("verify", empty, "--latest")
    assert p.returncode == 1 and "no committed step" in p.stderr


def test_inspect_shows_python_values(run: Path) -> None:
    p = zs("inspect", run / "step_00000002")
    assert p.returncode == 0, p.stderr
    for line in ("pytree/lr", "= 0.125", "pytree/opt/betas/1", "= 0.999", "= 'adam'", "= None", "= True", "= 7"):
        assert line in p.stdout, line
    rc, doc = zs_json("inspect", run / "step_00000002")
    values = {v["key"]: v["value"] for v in doc["values"]}
    assert values == {"pytree/lr": 0.125, "pytree/opt/betas/0": 0.9, "pytree/opt/betas/1": 0.999,
                      "pytree/opt/name": "adam", "pytree/opt/eps": None, "pytree/opt/warm": True, "pytree/opt/n": 7}
    assert doc["metadata"] == {"loss": 0.5, "step": 2}
    head = next(line for line in p.stdout.splitlines() if line.strip().startswith("key"))
    assert doc["saving_ranks"] is None and "ranks" not in head  # no rank column for a one-process save


_COLLECTIVE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, zerostall
    rank = int(sys.argv[2])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank, world_size=2)
    state = {"shared": torch.ones(4), "mine": torch.full((2 + rank,), float(rank)), "lr": 0.5, "seed": 100 + rank}
    zerostall.save_pytree(sys.argv[1], state, options=zerostall.SaveOptions(writer=zerostall.WriterKind.THREAD))
    dist.barrier()
    dist.destroy_process_group()
""")


def test_inspect_rank_column_of_a_collective_save(tmp_path: Path) -> None:
    ckpt, rdv = tmp_path / "c", tmp_path / "rdv"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _COLLECTIVE, str(ckpt), str(r), str(rdv)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    for pr in procs:
        out, _ = pr.communicate(timeout=300)
        assert pr.returncode == 0, out
    rc, doc = zs_json("inspect", ckpt)
    assert rc == 0 and doc["saving_ranks"] == 2
    by_ranks = sorted((lf["key"], tuple(lf["ranks"])) for lf in doc["leaves"])
    assert ("pytree/shared", (0, 1)) in by_ranks  # replicated: written once, used by both
    assert sorted(r for k, r in by_ranks if k == "pytree/mine") == [(0,), (1,)]
    p = zs("inspect", ckpt)
    head = next(line for line in p.stdout.splitlines() if line.strip().startswith("key"))
    assert head.rstrip().endswith("ranks")
    shared = next(line for line in p.stdout.splitlines() if "pytree/shared" in line)
    assert shared.rstrip().endswith("all")
    values = sorted((v["key"], v["value"], tuple(v["ranks"])) for v in doc["values"])
    assert values == [("pytree/lr", 0.5, (0, 1)), ("pytree/seed", 100, (0,)), ("pytree/seed", 101, (1,))]
    assert "= 0.5  (rank all)" in p.stdout and "= 101  (rank 1)" in p.stdout
    shutil.rmtree(rdv, ignore_errors=True)


def test_verify_draws_progress_on_a_terminal_only(run: Path) -> None:
    """stderr a terminal (a pty) and no delay: the progress line is drawn, then erased; piped: never."""
    import pty
    import select

    master, slave = pty.openpty()
    env = dict(os.environ, ZEROSTALL_PROGRESS_DELAY_S="0")
    p = subprocess.Popen([sys.executable, "-m", "zerostall", "verify", str(run)], stdout=subprocess.PIPE,
                         stderr=slave, text=True, env=env)
    os.close(slave)
    drawn = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the pty
            break
        if not chunk:
            break
        drawn += chunk
    out, _ = p.communicate(timeout=60)
    os.close(master)
    assert p.returncode == 0 and "3 step(s) verified" in out
    assert b"verify " in drawn and b"(3/3)" in drawn and b"\r" in drawn, drawn
    assert "verify " not in out  # the result on stdout stands alone
    piped = zs("verify", run)
    assert "\r" not in piped.stderr and piped.stderr == ""


def test_verify_checkpoint_reports_progress(run: Path) -> None:
    from zerostall.restore import verify_checkpoint

    calls: list[tuple[str, int, int]] = []
    report = verify_checkpoint(str(run / "step_00000001"), progress=lambda *a: calls.append(a))
    assert report.ok and calls and calls[-1] == ("verify", 16, 16)
    assert [c[1] for c in calls] == sorted(c[1] for c in calls)
