"""The command line answering a user's mistakes (a mistyped step or option, a checkpoint where a run
directory goes, a file that is no checkpoint, a missing extra) with one line that says what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerostall import Checkpointer, SaveOptions, WriterKind

THREAD = SaveOptions(writer=WriterKind.THREAD)


def zs(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerostall", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)


def one_error_line(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli_errors") / "run"
    with Checkpointer(d, save_options=THREAD) as c:
        for step in (10, 20):
            c.save_pytree(step, {"w": torch.ones(3)})
    return d


def test_list_of_a_checkpoint_says_to_inspect_it(run: Path) -> None:
    p = zs("list", run / "step_00000010")
    assert p.returncode == 0
    assert "is itself a checkpoint: zerostall inspect" in p.stdout


def test_a_mistyped_step_lists_the_steps_there(run: Path) -> None:
    for cmd in ("inspect", "verify", "rm"):
        line = one_error_line(zs(cmd, run / "step_0000010"))
        assert "no such file or directory" in line and "step_00000010, step_00000020" in line, line
    line = one_error_line(zs("export", run / "step_1", run.parent / "x.pt"))
    assert "step_00000010, step_00000020" in line


def test_a_path_that_does_not_exist_says_so(tmp_path: Path) -> None:
    line = one_error_line(zs("inspect", tmp_path / "nope"))
    assert "no such file or directory" in line and "manifest.json" in line and str(tmp_path / "nope") in line


def test_cli_given_a_file_says_what_it_is_and_what_to_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `inspect model.pt` or `verify CKPT/data/rank-00000.safetensors` gets more than ENOTDIR on
    # manifest.json: what the file is, and the command that takes it.
    import zerostall
    from zerostall.cli import main

    ckpt = tmp_path / "ck"
    zerostall.save_pytree(ckpt, {"w": torch.ones(2)})
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    data = next((ckpt / "data").iterdir())
    assert main(["verify", str(data)]) == 1
    err = capsys.readouterr().err
    assert "is a file, not a checkpoint" in err and f"data file of the checkpoint {ckpt}" in err, err
    assert main(["inspect", str(tmp_path / "model.pt")]) == 1
    err = capsys.readouterr().err
    assert "is a file, not a checkpoint" in err and "zerostall import FILE DST" in err, err
    assert main(["inspect", "--json", str(tmp_path / "model.pt")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["class"] == "StorageError" and doc["error"]["errno"] == 20


def test_export_without_a_suffix_names_the_cli_option(run: Path, tmp_path: Path) -> None:
    line = one_error_line(zs("export", run / "step_00000010", tmp_path / "out"))
    assert "--format safetensors" in line and "format='" not in line
    assert zs("export", run / "step_00000010", tmp_path / "out", "--format", "torch").returncode == 0


def test_import_onto_an_existing_checkpoint_says_what_to_do(run: Path, tmp_path: Path) -> None:
    src = tmp_path / "w.pt"
    torch.save({"a": torch.ones(2)}, src)
    line = one_error_line(zs("import", src, run / "step_00000010"))
    assert "never overwrites" in line and "zerostall rm DST" in line


def test_a_mistyped_option_gets_a_suggestion(run: Path) -> None:
    p = zs("verify", run, "--lastest")
    assert p.returncode == 2 and "unrecognized arguments: --lastest (did you mean --latest?)" in p.stderr
    p = zs("inspect", run / "step_00000010", "--jsn")
    assert p.returncode == 2 and "(did you mean --json?)" in p.stderr


def test_a_raw_os_error_of_a_backend_is_a_storage_error(tmp_path: Path) -> None:
    """An S3 listing without credentials: boto's PermissionError reaches ``list`` as a StorageError."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL="http://127.0.0.1:9")
    p = zs("list", "s3://bucket/run", "--json", env=env)
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)["error"]
    assert doc["class"] == "StorageError" and doc["errno"] == 13 and "credentials" in doc["message"]
    assert doc["path"].startswith("s3://bucket/run")


def test_s3_without_boto3_on_the_command_line(tmp_path: Path) -> None:
    """Where boto3 is not installed (blocked here by a meta-path finder), the one line names the extra."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('boto3', 'botocore'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    p = zs("list", "s3://bucket/run", "--json", env=env)
    doc = json.loads(p.stdout)["error"]
    assert p.returncode == 1 and doc["class"] == "MissingDependencyError", p.stdout + p.stderr
    assert "pip install 'zerostall[s3]'" in doc["message"] and doc["path"] == "s3://bucket/run"

