"""``zerostall export`` / ``zerostall import`` run as subprocesses, and the progress line of
verify / export / import: drawn on a terminal (a real pseudo-terminal here), never when piped or
under ``--json``."""

from __future__ import annotations

import fcntl
import io
import json
import os
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.progress import Progress

THREAD = SaveOptions(writer=WriterKind.THREAD)
NOW = {"ZEROSTALL_PROGRESS_DELAY_S": "0"}  # draw at once: the test checkpoints take milliseconds


def zs(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerostall.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def zs_pty(*args: str | os.PathLike[str]) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (stdout piped); return (status, stdout, terminal output)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 400, 0, 0))  # wide: lines are not cut
    p = subprocess.Popen([sys.executable, "-m", "zerostall.cli", *map(str, args)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=slave, env={**os.environ, **NOW})
    os.close(slave)
    seen = bytearray()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal's other end is gone
                    break
                if not data:
                    break
                seen += data
            elif p.poll() is not None:
                break
        out = p.stdout.read().decode() if p.stdout else ""
        rc = p.wait(120)
    finally:
        os.close(master)
    return rc, out, seen.decode(errors="replace")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli-interop") / "ck"
    zerostall.save_pytree(path, {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
                                 "step": 5}, options=THREAD)
    return path


def test_export_safetensors_and_torch(ckpt: Path, tmp_path: Path) -> None:
    p = zs("export", ckpt, tmp_path / "m.safetensors")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("exported ") and "2 tensors" in p.stdout and p.stderr == ""
    got = load_file(tmp_path / "m.safetensors")
    assert torch.equal(got["model/w"], torch.arange(12.0).reshape(3, 4))
    p = zs("export", ckpt, tmp_path / "model.bin", "--format", "torch", "--item", "pytree", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["format"] == "torch" and doc["tensors"] == 2 and doc["values"] == 1
    assert torch.load(tmp_path / "model.bin", weights_only=True)["step"] == 5


def test_export_failures_are_one_line(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "taken.safetensors").write_bytes(b"x")
    p = zs("export", ckpt, tmp_path / "taken.safetensors")
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert "refusing to overwrite" in p.stderr and (tmp_path / "taken.safetensors").read_bytes() == b"x"
    assert zs("export", ckpt, tmp_path / "taken.safetensors", "--force").returncode == 0
    p = zs("export", tmp_path / "nothing", tmp_path / "x.pt", "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["error"]["class"] == "CheckpointNotFoundError"


def test_export_of_a_run_directory_names_its_steps(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "run", save_options=THREAD) as c:
        c.save_pytree(3, {"w": torch.ones(1)})
    p = zs("export", tmp_path / "run", tmp_path / "x.safetensors")
    assert p.returncode == 1 and "step_00000003" in p.stderr


class _Unregistered:
    pass


def test_cli_export_to_torch_of_a_custom_leaf_says_what_the_command_line_can_do(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "register it with zerostall.register_handler before loading" is nothing a shell user can
    # do: the message says the command line registers no handlers and offers .safetensors.
    from zerostall.cli import main

    zerostall.register_handler(_Unregistered, name="exporttest.U", format="json", encode=lambda u: 1,
                               decode=lambda v: _Unregistered())
    try:
        zerostall.save_pytree(tmp_path / "c", {"u": _Unregistered(), "w": torch.ones(2)})
    finally:
        zerostall.unregister_handler(_Unregistered)
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "c.pt")]) == 1
    err = capsys.readouterr().err
    assert "the command line registers no handlers" in err and ".safetensors" in err
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "c.safetensors")]) == 0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_import_torch_file_and_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    torch.save({"w": torch.arange(4), "epoch": 2}, tmp_path / "old.pt")
    p = zs("import", tmp_path / "old.pt", tmp_path / "ck")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("imported ") and "(torch)" in p.stdout
    got = zerostall.load_pytree(tmp_path / "ck")
    assert torch.equal(got["w"], torch.arange(4)) and got["epoch"] == 2
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"))
    p = zs("import", tmp_path / "dcp", tmp_path / "ck2", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["format"] == "dcp"
    assert torch.equal(zerostall.load_pytree(tmp_path / "ck2")["w"], torch.ones(3))


class Opaque:
    pass


def test_import_failures_are_one_line(tmp_path: Path) -> None:
    torch.save({"o": Opaque()}, tmp_path / "evil.pt")
    p = zs("import", tmp_path / "evil.pt", tmp_path / "ck")
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "weights_only" in p.stderr
    p = zs("import", tmp_path / "evil.pt", tmp_path / "ck", "--json")
    assert json.loads(p.stdout)["error"]["class"] == "UnsupportedFormatError"
    assert not (tmp_path / "ck").exists()


# -- progress -----------------------------------------------------------------------------------


def test_progress_on_a_terminal_only(ckpt: Path, tmp_path: Path) -> None:
    rc, out, tty = zs_pty("export", ckpt, tmp_path / "a.safetensors")
    assert rc == 0 and out.startswith("exported ")
    assert f"\rexport {tmp_path / 'a.safetensors'}" in tty
    assert tty.endswith("\r")  # erased before the command ended

    rc, out, tty = zs_pty("verify", ckpt)
    assert rc == 0 and out.startswith("OK ") and f"\rverify {ckpt}" in tty

    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    rc, out, tty = zs_pty("import", tmp_path / "w.pt", tmp_path / "imported")
    assert rc == 0 and out.startswith("imported ") and f"\rimport {tmp_path / 'w.pt'}" in tty

    rc, out, tty = zs_pty("export", ckpt, tmp_path / "b.safetensors", "--json")
    assert rc == 0 and json.loads(out)["tensors"] == 2 and tty == ""  # quiet under --json

    p = zs("export", ckpt, tmp_path / "c.safetensors", env=NOW)  # stderr piped: quiet
    assert p.returncode == 0 and p.stderr == ""


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_draws_after_its_delay_and_erases_itself() -> None:
    stream = FakeTty()
    with Progress("export x", stream=stream, delay_s=0) as p:
        p("copy", 3 << 20, 12 << 20)
        assert p.line().startswith("export x  copy  3.0/12.0 MiB (25%)")
    text = stream.getvalue()
    assert text.startswith("\rexport x") and text.endswith("\r") and text.rstrip("\r").endswith(" ")
    stream = FakeTty()
    with Progress("export x", stream=stream, delay_s=60) as p:  # a quick operation shows nothing
        p("copy", 1, 2)
    assert stream.getvalue() == ""
    for quiet in (Progress("x", stream=io.StringIO(), delay_s=0), Progress("x", stream=FakeTty(), enabled=False,
                                                                           delay_s=0)):
        with quiet:
            pass
        assert quiet.stream.getvalue() == ""  # type: ignore[attr-defined]


def test_progress_label_cannot_drive_the_terminal() -> None:
    stream: Any = FakeTty()
    with Progress("export \x1b[31mred\n", stream=stream, delay_s=0):
        pass
    assert "\x1b" not in stream.getvalue() and "\n" not in stream.getvalue()


# -- export --hf: a save_pretrained directory ------------------------------------------------------


def _hf_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(40, 25, generator=g) for i in range(4)}  # 4000 bytes each
    sd["embed.weight"] = torch.randn(10, 8, generator=g).to(torch.bfloat16)
    zerostall.save_checkpointables(path, {"model": sd, "hf_config": json.dumps({"model_type": "tiny"})},
                                   options=THREAD)
    return sd


def test_export_hf_writes_config_and_one_file_below_the_shard_size(tmp_path):
    sd = _hf_checkpoint(tmp_path / "ck")
    r = zs("export", tmp_path / "ck", tmp_path / "out", "--hf", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["format"] == "hf" and report["tensors"] == 5
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "tiny"}
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


def test_export_hf_shards_above_the_size_with_an_index_and_refuses_to_overwrite(tmp_path):
    sd = _hf_checkpoint(tmp_path / "ck")
    out = tmp_path / "out"
    r = zs("export", tmp_path / "ck", out, "--hf", "--max-shard-size", "8KB")
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # 8 kB: two 4 kB tensors each
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors.index.json", *shards])
    for key, name in index["weight_map"].items():
        assert torch.equal(load_file(out / name)[key], sd[key])
    from safetensors import safe_open

    with safe_open(out / shards[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what from_pretrained checks
    r = zs("export", tmp_path / "ck", out, "--hf")
    assert r.returncode == 1 and "exists" in r.stderr
    r = zs("export", tmp_path / "ck", out, "--hf", "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.")]  # no temporary left beside it


@pytest.mark.parametrize("extra, message", [
    (["--format", "torch"], "cannot be combined with --format torch"),
    (["--max-shard-size", "5XB"], "--max-shard-size: expected a size"),
])
def test_export_hf_argument_errors_name_the_option(tmp_path, extra, message):
    _hf_checkpoint(tmp_path / "ck")
    r = zs("export", tmp_path / "ck", tmp_path / "out", "--hf", *extra)
    assert r.returncode != 0 and message in r.stderr
    assert not os.path.exists(tmp_path / "out")


def test_export_hf_refuses_a_model_item_with_non_tensor_values(tmp_path):
    zerostall.save_checkpointables(tmp_path / "ck", {"model": {"w": torch.ones(2), "step": 3},
                                                     "hf_config": "{}"}, options=THREAD)
    r = zs("export", tmp_path / "ck", tmp_path / "out", "--hf")
    assert r.returncode == 1 and "tensors only" in r.stderr and "step" in r.stderr
    assert not os.path.exists(tmp_path / "out")
