"""What a newcomer tripped over in round 4 (odd trees and templates, the CLI on damaged or
unreadable runs, the Checkpointer's lifecycle): docs/newcomer-run.md, "Round 4"."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import zerostall
from zerostall.errors import (
    ArgumentTypeError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MismatchError,
    MissingKeyError,
    UnsupportedFormatError,
    UnsupportedLeafError,
    WriterError,
    ZerostallError,
)


def _as_user_without_dac(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that file permissions apply to: as root, one without
    CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (so a mode-000 folder is unreadable to it too)."""
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ))


@pytest.fixture
def run_with_unreadable_newest(tmp_path: Path):  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    with zerostall.Checkpointer(run) as ckpt:
        ckpt.save_pytree(1, {"w": torch.ones(4)})
        ckpt.save_pytree(2, {"w": torch.full((4,), 2.0)})
    newest = run / "step_00000002"
    newest.chmod(0)
    yield run
    newest.chmod(0o755)


def test_a_step_whose_manifest_cannot_be_checked_is_an_error_not_an_older_latest_step(
        run_with_unreadable_newest: Path) -> None:
    # Permission denied on step 2's folder: latest_step() said 1 (os.path.lexists hides EACCES)
    # and a resume silently loaded the older step.
    code = ("import zerostall\n"
            f"c = zerostall.Checkpointer({str(run_with_unreadable_newest)!r}, read_only=True)\n"
            "try:\n    print('LATEST', c.latest_step())\n"
            "except zerostall.StorageError as e:\n    print('ERR', e.errno, e)\n")
    out = _as_user_without_dac(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR 13 "), out.stdout
    assert "step_00000002" in out.stdout and "Permission denied" in out.stdout


def test_cli_list_and_verify_show_an_unreadable_step_instead_of_calling_it_partial(
        run_with_unreadable_newest: Path) -> None:
    # list called it "PARTIAL: no manifest (in flight, crashed ...)", exit 0; verify DIR skipped it
    # and said "1 step(s) verified", OK.
    run = str(run_with_unreadable_newest)
    listing = _as_user_without_dac(f"from zerostall.cli import main; raise SystemExit(main(['list', {run!r}]))")
    assert listing.returncode == 1, listing.stdout + listing.stderr
    assert "PARTIAL" not in listing.stdout
    assert "step_00000002" in listing.stdout and "UNREADABLE" in listing.stdout and "EACCES" in listing.stdout
    verify = _as_user_without_dac(
        f"from zerostall.cli import main; raise SystemExit(main(['verify', {run!r}, '--json']))")
    assert verify.returncode == 1, verify.stdout + verify.stderr
    doc = json.loads(verify.stdout)
    assert [(s["step"], s["ok"]) for s in doc["steps"]] == [(1, True), (2, False)]
    assert "EACCES" in doc["steps"][1]["problems"][0]["message"]


def test_a_closed_checkpointer_says_so_naming_its_directory(tmp_path: Path) -> None:
    # was: WriterError "this saver is closed" (no path, nothing on what to do); prepare() after
    # close allocated buffers nobody would free.
    ckpt = zerostall.Checkpointer(tmp_path / "run")
    with ckpt:
        ckpt.save_pytree(1, {"w": torch.ones(2)})
    with pytest.raises(WriterError, match="Checkpointer is closed.*create a new") as info:
        ckpt.save_pytree_async(2, {"w": torch.ones(2)})
    assert info.value.path is not None and info.value.path.endswith("step_00000002")
    with pytest.raises(WriterError, match="Checkpointer is closed") as info:
        ckpt.prepare(tree={"w": torch.ones(2)})
    assert info.value.path == str(tmp_path / "run")
    assert ckpt.load_pytree()["w"].tolist() == [1.0, 1.0]  # loading still works, as the message says


def test_an_expanded_template_tensor_is_refused_naming_its_key(tmp_path: Path) -> None:
    # was: every byte read, then "restoring into the template failed: RuntimeError: unsupported
    # operation: more than one element ..." without the key.
    zerostall.save_pytree(tmp_path / "a", {"b": torch.arange(3.0), "c": torch.ones(2)})
    template = {"b": torch.zeros(1).expand(3), "c": torch.zeros(2)}
    with pytest.raises(MismatchError, match=r"expand\(\)ed .*t\.clone\(\)") as info:
        zerostall.load_pytree(tmp_path / "a", template)
    assert info.value.key == "pytree/b"
    assert template["c"].tolist() == [0.0, 0.0]  # refused before anything was read


def test_load_pytree_of_a_run_directory_or_a_misspelled_step_names_the_steps(tmp_path: Path) -> None:
    # was: "no committed checkpoint here (no manifest)", for the directory a Checkpointer writes
    # (the first thing a newcomer passes to load_pytree) and for run/step_1.
    run = tmp_path / "run"
    with zerostall.Checkpointer(run) as ckpt:
        ckpt.save_pytree(1, {"w": torch.ones(2)})
        ckpt.save_pytree(5, {"w": torch.ones(2)})
    with pytest.raises(CheckpointNotFoundError, match=r"run directory .* 2 committed step\(s\) \(1, 5\)") as info:
        zerostall.load_pytree(run)
    assert str(run / "step_00000005") in str(info.value) and "fallback=True" in str(info.value)
    with pytest.raises(CheckpointNotFoundError, match=r"no 'step_1' but holds committed steps 1, 5") as info:
        zerostall.load_pytree(run / "step_1")
    assert "step_00000005" in str(info.value)
    assert zerostall.load_pytree(run, fallback=True)["w"].tolist() == [1.0, 1.0]  # what the hint offers


@pytest.mark.parametrize("value, fix", [
    (np.zeros(2, dtype=">f4"), r"astype\(x\.dtype\.newbyteorder"),
    (np.array(["a", "b"]), r"x\.tolist\(\)"),
    (np.str_("a"), r"x\.item\(\)"),
])
def test_numpy_values_that_cannot_be_saved_say_how_to_store_them(tmp_path: Path, value: object, fix: str) -> None:
    # was: "numpy dtype >f4 cannot be saved (object, string or big-endian)", nothing on what to do;
    # np.str_ (a str subclass) got the same.
    with pytest.raises(ZerostallError, match=fix) as info:
        zerostall.save_pytree(tmp_path / "n", {"x": value})
    assert info.value.key == "pytree/x"


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_tensor_dtypes_that_cannot_be_saved_say_what_to_store(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedLeafError, match=r"t\.to\(torch\.complex64\)") as info:
        zerostall.save_pytree(tmp_path / "c", {"z": torch.ones(2, dtype=torch.complex32)})
    assert info.value.key == "pytree/z"


def test_lightning_plugin_options_of_the_wrong_type_are_refused_at_construction(tmp_path: Path) -> None:
    # was: AttributeError "'dict' object has no attribute 'distributed'" (save_options={...}), and
    # save_checkpoint of a non-dict: "'list' object has no attribute 'get'".
    from zerostall.lightning import ZerostallCheckpointIO

    with pytest.raises(ArgumentTypeError, match=r"save_options must be a zerostall\.SaveOptions") as info:
        ZerostallCheckpointIO(save_options={"max_in_flight": 2})  # type: ignore[arg-type]
    assert info.value.argument == "save_options"
    with pytest.raises(ArgumentTypeError, match=r"load_options must be a zerostall\.LoadOptions"):
        ZerostallCheckpointIO(load_options=zerostall.SaveOptions())  # type: ignore[arg-type]
    io = ZerostallCheckpointIO()
    with pytest.raises(ArgumentTypeError, match="checkpoint must be a dict"):
        io.save_checkpoint([1], tmp_path / "x.ckpt")  # type: ignore[arg-type]
    io.teardown()


def test_a_donated_jax_array_says_to_save_before_the_donating_step(tmp_path: Path) -> None:
    import jax.numpy as jnp

    gone = jnp.ones(4)
    gone.delete()
    with pytest.raises(UnsupportedLeafError, match=r"save the state before the jitted step .*wait_staged\(\)") as info:
        zerostall.save_pytree(tmp_path / "j", {"w": gone})
    assert info.value.key == "pytree/w"
    with pytest.raises(UnsupportedLeafError, match=r"astype\(jnp\.int8\)"):
        zerostall.save_pytree(tmp_path / "k", {"q": jnp.zeros(4, dtype=jnp.int4)})


def test_a_file_url_with_two_slashes_is_refused_instead_of_becoming_a_relative_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # was: Checkpointer("file://tmp/run") created ./tmp/run under the working directory.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"file:///tmp/run, three slashes") as info:
        zerostall.Checkpointer("file://tmp/run")
    assert info.value.path == "file://tmp/run"
    assert not (tmp_path / "tmp").exists()
    zerostall.save_pytree(f"file://localhost{tmp_path}/a", {"x": 1})  # the one host a file URL may name
    assert zerostall.load_pytree(f"file://{tmp_path}/a") == {"x": 1}


def test_cli_rm_with_one_mistyped_target_deletes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: `zerostall rm run/step_00000001 run/step_00000099` deleted step 1, then failed on 99,
    # exit 1, without a word about step 1.
    from zerostall.cli import main

    run = tmp_path / "run"
    with zerostall.Checkpointer(run) as ckpt:
        ckpt.save_pytree(1, {"w": torch.ones(2)})
    assert main(["rm", str(run / "step_00000001"), str(run / "step_00000099")]) == 1
    err = capsys.readouterr().err
    assert "nothing was deleted" in err and "step_00000099" in err
    assert zerostall.Checkpointer(run, read_only=True).steps() == [1]


def test_prepare_with_items_that_are_not_a_dict_names_the_argument(tmp_path: Path) -> None:
    # was: "TypeError: cannot convert dictionary update sequence element #0 to a sequence"
    with pytest.raises(ArgumentTypeError, match="items must be a dict") as info:
        zerostall.prepare(items=[torch.ones(2)])  # type: ignore[arg-type]
    assert info.value.argument == "items"
    with pytest.raises(ArgumentTypeError, match="options must be a SaveOptions"):
        zerostall.prepare({"w": torch.ones(2)}, options={"max_in_flight": 2})  # type: ignore[arg-type]
    with zerostall.Checkpointer(tmp_path / "run") as ckpt, pytest.raises(ArgumentTypeError, match="items must be a dict"):
        ckpt.prepare([torch.ones(2)])  # type: ignore[arg-type]


def test_a_load_state_dict_that_refuses_names_the_object_and_its_key(tmp_path: Path) -> None:
    # was: "restoring into the template failed: RuntimeError: Error(s) in loading state_dict ..."
    # with the checkpoint only: which of the model, optimizer, scheduler, ... refused it?
    model = torch.nn.Linear(3, 2)
    zerostall.save_pytree(tmp_path / "a", {"model": model, "step": 3})
    other = torch.nn.Sequential(torch.nn.Linear(3, 2))  # keys "0.weight", not "weight"
    with pytest.raises(MismatchError, match=r"Sequential\.load_state_dict refused") as info:
        zerostall.load_pytree(tmp_path / "a", {"model": other})
    assert info.value.key == "pytree/model"


class _Odd:
    def __init__(self, n: int) -> None:
        self.n = n


def _decode_odd(n: object) -> _Odd:
    if n == 2:
        raise ValueError("decoder bug for 2")
    return _Odd(int(n))  # type: ignore[call-overload]


def test_a_handler_that_fails_to_decode_is_not_corruption_and_fallback_does_not_skip_it(tmp_path: Path) -> None:
    # was: CorruptCheckpointError, so load_pytree(run, fallback=True) skipped the newest step for a
    # bug in the user's decode function and quietly loaded the step before it.
    zerostall.register_handler(_Odd, name="r4test.Odd", format="json", encode=lambda o: o.n, decode=_decode_odd)
    try:
        run = tmp_path / "run"
        with zerostall.Checkpointer(run) as ckpt:
            ckpt.save_pytree(1, {"o": _Odd(1)})
            ckpt.save_pytree(2, {"o": _Odd(2)})
        with pytest.raises(UnsupportedFormatError, match=r"'r4test\.Odd' could not decode .*decoder bug for 2") as info:
            zerostall.load_pytree(run, fallback=True)
        assert info.value.key == "pytree/o" and not isinstance(info.value, CorruptCheckpointError)
    finally:
        zerostall.unregister_handler(_Odd)


def test_load_metadata_of_a_run_directory_names_the_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with zerostall.Checkpointer(run) as ckpt:
        ckpt.save_pytree(3, {"w": torch.ones(1)}, metadata={"loss": 0.5})
    with pytest.raises(CheckpointNotFoundError, match=r"1 committed step\(s\) \(3\).*\.metadata\(\)"):
        zerostall.load_metadata(run)
    assert zerostall.load_metadata(run / "step_00000003") == {"loss": 0.5, "step": 3}


def test_an_empty_tensor_no_load_could_allocate_is_refused_at_save(tmp_path: Path) -> None:
    # was: torch.empty(0, 2**62) saved and committed; every load then raised CorruptCheckpointError
    # "malformed manifest: shape ... is too large for any array".
    with pytest.raises(UnsupportedLeafError, match="no load could allocate") as info:
        zerostall.save_pytree(tmp_path / "e", {"x": torch.empty(0, 2**62)})
    assert info.value.key == "pytree/x"
    assert not (tmp_path / "e").exists()
    zerostall.save_pytree(tmp_path / "ok", {"x": torch.empty(0, 2**40)})
    assert zerostall.load_pytree(tmp_path / "ok")["x"].shape == (0, 2**40)


@pytest.mark.parametrize("key, fix", [(np.int64(1), "int(key)"), (np.str_("a"), "str(key)")])
def test_numpy_dict_keys_say_how_to_convert(tmp_path: Path, key: object, fix: str) -> None:
    with pytest.raises(UnsupportedLeafError, match=re.escape(fix)):
        zerostall.save_pytree(tmp_path / "k", {key: 1})


def test_loading_with_the_other_kind_of_function_says_which_one_saved_it(tmp_path: Path) -> None:
    # was: "the checkpoint has no item 'pytree' (it has ['model', 'note'])": which function then?
    model = torch.nn.Linear(2, 2)
    zerostall.save_checkpointables(tmp_path / "items", {"model": model, "note": "x"})
    with pytest.raises(MissingKeyError, match=r"saved with save_checkpointables .*load_checkpointables\(path\)"):
        zerostall.load_pytree(tmp_path / "items")
    zerostall.save_pytree(tmp_path / "tree", {"model": model})
    with pytest.raises(MissingKeyError, match=r"saved with save_pytree: .*load_pytree\(path, \{'model': template"):
        zerostall.load_checkpointables(tmp_path / "tree", {"model": model})
    with zerostall.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save_checkpointables(1, {"model": model})
        with pytest.raises(MissingKeyError, match=r"ckpt\.load_checkpointables\(step, \{name: template\}\)"):
            ckpt.load_pytree()
        with pytest.raises(MissingKeyError, match="the template asks for a key") as info:  # nested: unchanged
            zerostall.load_pytree(tmp_path / "tree", {"model": {"nope": None}})
        assert info.value.key == "pytree/model/nope"


def test_a_checkpointer_on_a_checkpoint_is_refused_instead_of_nesting_steps_in_it(tmp_path: Path) -> None:
    # was: Checkpointer("run/step_00000001") listed nothing, and its saves wrote
    # run/step_00000001/step_00000001/ inside the committed checkpoint.
    run = tmp_path / "run"
    with zerostall.Checkpointer(run) as ckpt:
        ckpt.save_pytree(1, {"w": torch.ones(2)})
    for read_only in (False, True):
        with pytest.raises(InvalidArgumentError, match="itself a committed checkpoint.*load_pytree") as info:
            zerostall.Checkpointer(run / "step_00000001", read_only=read_only)
        assert info.value.path == str(run / "step_00000001")
    assert sorted(p.name for p in (run / "step_00000001").iterdir()) == ["data", "manifest.json"]


class _Unregistered:
    pass


def test_cli_export_to_torch_of_a_custom_leaf_says_what_the_command_line_can_do(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # was: "no handler named ... is registered; register it with zerostall.register_handler before
    # loading": not something a shell user can do.
    from zerostall.cli import main

    zerostall.register_handler(_Unregistered, name="r4test.U", format="json", encode=lambda u: 1,
                               decode=lambda v: _Unregistered())
    try:
        zerostall.save_pytree(tmp_path / "c", {"u": _Unregistered(), "w": torch.ones(2)})
    finally:
        zerostall.unregister_handler(_Unregistered)
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "c.pt")]) == 1
    err = capsys.readouterr().err
    assert "the command line registers no handlers" in err and ".safetensors" in err
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "c.safetensors")]) == 0


def test_a_save_into_a_directory_it_may_not_write_names_that_directory_not_the_lease_temp_file(
        tmp_path: Path) -> None:
    # was: "[EACCES] Permission denied: DIR/.zs-lease-vm~...-7f65a0329480.json.tmp-13829-7f65a0329480"
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        out = _as_user_without_dac(
            "import torch, zerostall\n"
            f"try:\n    zerostall.save_pytree({str(locked / 'a')!r}, {{'w': torch.ones(2)}})\n"
            "except zerostall.StorageError as e:\n    print('ERR', e.errno, e)\n")
    finally:
        locked.chmod(0o755)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR 13 "), out.stdout + out.stderr
    assert f"lease file in {locked}" in out.stdout and ".tmp-" not in out.stdout


def test_deleting_a_step_whose_save_is_in_flight_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # was: "no committed step to delete" for the step the user had just saved
    from zerostall.persist.faults import ENV as FAULTS_ENV

    go = tmp_path / "go"
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"begin": f"wait:{go}"}))  # the writer holds the save
    with zerostall.Checkpointer(tmp_path / "run") as ckpt:
        r = ckpt.save_pytree_async(1, {"w": torch.ones(2)})
        with pytest.raises(CheckpointNotFoundError, match=r"still in flight; wait for it") as info:
            ckpt.delete(1)
        assert info.value.path == str(tmp_path / "run" / "step_00000001")
        go.touch()
        r.result()
        ckpt.delete(1)
        assert ckpt.steps() == []


def test_cli_list_of_a_directory_of_runs_names_the_runs_below(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A Lightning ModelCheckpoint dirpath holds one zerostall run per checkpoint name: `zerostall
    # list ckpts` said only "no committed checkpoints in ckpts".
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
