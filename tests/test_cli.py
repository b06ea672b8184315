"""The ``zerostall`` command line, run as a subprocess the way a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind

THREAD = SaveOptions(writer=WriterKind.THREAD)


def zs(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerostall.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def zs_json(*args: str | os.PathLike[str]) -> tuple[int, Any]:
    p = zs(*args, "--json")
    return p.returncode, json.loads(p.stdout)


def no_traceback(p: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in p.stderr + p.stdout, p.stderr


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli") / "run"
    with Checkpointer(d, save_options=THREAD) as c:
        for step in (10, 20):
            c.save_pytree(step, {
                "w": torch.randn(8, 4), "h": torch.ones(3, dtype=torch.bfloat16), "mask": torch.zeros(5, dtype=torch.bool),
                "opt": {"lr": 0.1, "m": [np.arange(6, dtype=np.int16)]}, "blob": b"xyz",
            }, metadata={"loss": 0.5})
    os.mkdir(d / ".step_00000030.zs-tmp-deadbeef0000")  # what a crashed writer leaves behind
    os.mkdir(d / "step_00000040")  # an uncommitted directory (no manifest)
    return d


@pytest.fixture
def copy_of(cli_run: Path, tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "step"
    shutil.copytree(cli_run / "step_00000020", dst)
    return dst


def test_list(cli_run: Path) -> None:
    p = zs("list", cli_run)
    assert p.returncode == 0, p.stderr
    assert "step_00000010" in p.stdout and "step_00000020" in p.stdout
    assert "step_00000040" in p.stdout and "PARTIAL" in p.stdout  # not committed: shown as such
    assert "1 unfinished" in p.stdout
    rc, doc = zs_json("list", cli_run)
    assert rc == 0
    assert [c["step"] for c in doc["checkpoints"]] == [10, 20]
    assert doc["latest_step"] == 20
    assert doc["unfinished"] == [".step_00000030.zs-tmp-deadbeef0000"]
    assert all(c["ok"] and c["leaves"] == 5 for c in doc["checkpoints"])


def test_list_empty_and_missing(tmp_path: Path) -> None:
    p = zs("list", tmp_path)
    assert p.returncode == 0 and "no committed checkpoints" in p.stdout
    p = zs("list", tmp_path / "missing")
    assert p.returncode == 1
    no_traceback(p)
    assert p.stderr.count("\n") == 1 and "no such directory" in p.stderr
    rc, doc = zs_json("list", tmp_path / "missing")
    assert rc == 1 and doc["ok"] is False and doc["error"]["class"] == "StorageError"


def test_cli_list_of_a_directory_of_runs_names_the_runs_below(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A Lightning ModelCheckpoint dirpath holds one zerostall run per checkpoint name: list of it
    # names those runs rather than only "no committed checkpoints".
    from zerostall.cli import main

    ckpts = tmp_path / "ckpts"
    for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
        zerostall.save_pytree(ckpts / name / "step_00000001", {"w": torch.ones(2)})
    (ckpts / "notes").mkdir()
    assert main(["list", str(ckpts)]) == 0
    out = capsys.readouterr().out
    assert "no committed checkpoints" in out
    assert "epoch=0-step=4.ckpt (1 step(s)), last.ckpt (1 step(s))" in out and "notes" not in out
    assert main(["list", str(ckpts), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [b["name"] for b in doc["runs_below"]] == ["epoch=0-step=4.ckpt", "last.ckpt"]


def test_inspect(cli_run: Path) -> None:
    path = cli_run / "step_00000020"
    p = zs("inspect", path)
    assert p.returncode == 0, p.stderr
    for word in ("pytree/w", "F32", "8x4", "BF16", "BOOL", "I16", "pytree/blob", "zerostall v1", '"loss": 0.5'):
        assert word in p.stdout, word
    rc, doc = zs_json("inspect", path)
    assert rc == 0
    assert doc["format_version"] == 1
    leaves = {lf["key"]: lf for lf in doc["leaves"]}
    assert leaves["pytree/w"]["shape"] == [8, 4] and leaves["pytree/w"]["nbytes"] == 128
    assert leaves["pytree/h"]["dtype"] == "BF16"
    assert leaves["pytree/opt/m/0"]["dtype"] == "I16"
    assert doc["totals"]["leaves"] == 5
    assert doc["totals"]["by_dtype"]["F32"] == 128
    assert doc["metadata"] == {"loss": 0.5, "step": 20}


def test_verify_ok(cli_run: Path) -> None:
    p = zs("verify", cli_run / "step_00000010")
    assert p.returncode == 0 and p.stdout.startswith("OK "), p.stdout + p.stderr
    rc, doc = zs_json("verify", cli_run / "step_00000010")
    assert rc == 0 and doc["ok"] and doc["bad_keys"] == [] and doc["leaves"] == 5


def _flip(ckpt: Path, key: str) -> None:
    m = json.loads((ckpt / "manifest.json").read_bytes())
    lf = next(lf for lf in m["leaves"] if lf["key"] == key)
    f = ckpt / m["files"][lf["file"]]["path"]
    raw = bytearray(f.read_bytes())
    raw[lf["offset"]] ^= 0x80
    f.write_bytes(bytes(raw))


def test_verify_names_every_bad_key(copy_of: Path) -> None:
    for key in ("pytree/w", "pytree/mask", "pytree/blob"):
        _flip(copy_of, key)
    p = zs("verify", copy_of)
    assert p.returncode == 1
    no_traceback(p)
    for key in ("pytree/w", "pytree/mask", "pytree/blob"):
        assert f"BAD {key}: checksum mismatch" in p.stdout
    assert "pytree/h" not in p.stdout
    rc, doc = zs_json("verify", copy_of)
    assert rc == 1 and doc["ok"] is False
    assert doc["bad_keys"] == ["pytree/w", "pytree/mask", "pytree/blob"]
    assert {p["kind"] for p in doc["problems"]} == {"checksum"}


def test_verify_truncated_file_checks_what_remains(copy_of: Path) -> None:
    m = json.loads((copy_of / "manifest.json").read_bytes())
    last = max(m["leaves"], key=lambda lf: lf["offset"])
    f = copy_of / m["files"][0]["path"]
    f.write_bytes(f.read_bytes()[:last["offset"]])
    rc, doc = zs_json("verify", copy_of)
    assert rc == 1
    assert doc["bad_keys"] == [last["key"]]
    assert any(p["kind"] == "file" and "truncated" in p["message"] for p in doc["problems"])


def test_verify_missing_data_file(copy_of: Path) -> None:
    (copy_of / "data" / "rank-00000.safetensors").unlink()
    rc, doc = zs_json("verify", copy_of)
    assert rc == 1 and len(doc["bad_keys"]) == 5
    assert any("missing" in p["message"] for p in doc["problems"])


def test_verify_catches_a_relabelled_dtype(copy_of: Path) -> None:
    """Same-size dtype swap: checksums pass, the data file's own header disagrees."""
    m = json.loads((copy_of / "manifest.json").read_bytes())
    next(lf for lf in m["leaves"] if lf["key"] == "pytree/w")["dtype"] = "I32"
    (copy_of / "manifest.json").write_text(json.dumps(m))
    rc, doc = zs_json("verify", copy_of)
    assert rc == 1 and doc["bad_keys"] == ["pytree/w"]
    assert doc["problems"][0]["kind"] == "header" and "dtype" in doc["problems"][0]["message"]


def test_verify_symlinked_data_file(copy_of: Path, tmp_path: Path) -> None:
    f = copy_of / "data" / "rank-00000.safetensors"
    outside = tmp_path / "outside"
    os.rename(f, outside)
    f.symlink_to(outside)
    rc, doc = zs_json("verify", copy_of)
    assert rc == 1 and "symbolic link" in json.dumps(doc)


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"format": "zerostall", "format_version": 9}'])
def test_malformed_manifest_is_one_line(copy_of: Path, content: bytes) -> None:
    (copy_of / "manifest.json").write_bytes(content)
    for cmd in ("inspect", "verify"):
        p = zs(cmd, copy_of)
        assert p.returncode == 1
        no_traceback(p)
        assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"zerostall {cmd}: error: "), p.stderr
        rc, doc = zs_json(cmd, copy_of)
        assert rc == 1 and doc["error"]["class"] in ("CorruptCheckpointError", "UnsupportedFormatError")


def test_not_a_checkpoint(tmp_path: Path) -> None:
    for cmd in ("inspect", "verify"):
        p = zs(cmd, tmp_path)
        assert p.returncode == 1 and "no committed checkpoint" in p.stderr
        no_traceback(p)


def test_usage_errors_exit_2() -> None:
    assert zs().returncode == 2
    assert zs("frobnicate", ".").returncode == 2
    assert zs("verify").returncode == 2


def test_console_script_is_installed(cli_run: Path) -> None:
    exe = Path(sys.executable).with_name("zerostall")
    if not exe.exists():
        pytest.skip("console script not installed in this environment")
    p = subprocess.run([str(exe), "list", str(cli_run)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "step_00000020" in p.stdout


def test_cli_does_not_import_torch() -> None:
    code = "import sys, zerostall.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_verify_in_process_reports_all_problems(copy_of: Path) -> None:
    from zerostall.restore import verify_checkpoint

    _flip(copy_of, "pytree/h")
    _flip(copy_of, "pytree/opt/m/0")
    report = verify_checkpoint(str(copy_of))
    assert not report.ok
    assert report.bad_keys == ["pytree/h", "pytree/opt/m/0"]
    with pytest.raises(zerostall.errors.ChecksumMismatchError):
        zerostall.load_pytree(copy_of)


def test_text_output_escapes_control_characters(tmp_path: Path) -> None:
    """Keys come from the checkpoint: a hostile one must not drive the terminal."""
    evil = "\x1b[2J\x1b[31mevil\nkey\r"
    path = tmp_path / "evil"
    zerostall.save_pytree(path, {evil: torch.ones(3)}, options=THREAD)
    p = zs("inspect", path)
    assert p.returncode == 0
    assert "\x1b" not in p.stdout and "\r" not in p.stdout
    assert "\\x1b[2J\\x1b[31mevil\\nkey\\r" in p.stdout
    _flip(path, f"pytree/{evil}")
    p = zs("verify", path)
    assert p.returncode == 1 and "\x1b" not in p.stdout
    assert len(p.stdout.splitlines()) == 2  # one BAD line, one FAILED line: no injected newlines
    rc, doc = zs_json("verify", path)
    assert doc["bad_keys"] == [f"pytree/{evil}"]  # JSON keeps the key exact


def test_cli_run_directory_instead_of_a_step_gets_a_hint(cli_run: Path) -> None:
    for cmd in ("inspect",):  # verify takes a run directory (tests/test_cli_ops.py)
        p = zs(cmd, cli_run)
        assert p.returncode == 1
        no_traceback(p)
        assert "2 committed step(s)" in p.stderr and "step_00000020" in p.stderr, p.stderr
