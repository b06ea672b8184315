"""ZerostallCheckpointIO with a real Lightning Trainer (CPU), and the plugin's error paths.

The kill test runs a trainer subprocess that SIGKILLs itself right after a save returned, while
zerostall's writer is held before that save's commit (``ZEROSTALL_FAULTS={"commit": "wait:..."}``):
the save is provably in flight when the trainer dies, commits afterwards, and ``fit(ckpt_path="last")``
resumes from it to the same parameters, bit for bit, as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import collections
import enum
import errno
import json
import os
import pathlib
import pickle
import subprocess
import sys
import threading
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities import AttributeDict

import zerostall
from zerostall import SaveOptions, WriterKind, ZerostallError
from zerostall.errors import (
    ArgumentTypeError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
    UnsupportedLeafError,
)
from zerostall.lightning import ZerostallCheckpointIO

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import _lightning_trainer as lt  # noqa: E402

EPOCHS = 5
KILL_EPOCH = 2
THREAD = SaveOptions(writer=WriterKind.THREAD)  # in-process writer: reads ZEROSTALL_FAULTS as each phase runs


def committed(path: str) -> list[str]:
    """The committed zerostall checkpoints inside a Lightning checkpoint directory."""
    return sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n, "manifest.json")))


def visible(ckpt_dir: str) -> set[str]:
    return {n for n in os.listdir(ckpt_dir) if not n.startswith(".")}


def assert_same_tensors(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}/{i}")
    else:
        assert a == b, where


class LoadedStep(pl.Callback):
    def __init__(self) -> None:
        self.global_step: int | None = None

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.global_step = checkpoint["global_step"]


def fit(ckpt_dir: str, ckpt_path: str | None = None) -> tuple[pl.Trainer, pl.LightningModule, LoadedStep]:
    loaded = LoadedStep()
    trainer = lt.make_trainer(ckpt_dir, EPOCHS, ZerostallCheckpointIO(), [loaded])
    module = lt.make_module()
    trainer.fit(module, lt.make_data(), ckpt_path=ckpt_path)
    return trainer, module, loaded


def wait_for(predicate: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout  # a bound on a hang, not a verdict on speed
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------
# real Trainer


def test_sigkill_after_save_returned_then_resume_from_last_matches_uninterrupted_run(tmp_path):
    killed_dir = str(tmp_path / "killed")
    release = str(tmp_path / "release")
    open(release, "w").close()
    env = dict(os.environ, ZEROSTALL_FAULTS=json.dumps({"commit": f"wait:{release}"}))
    # files, not pipes: the orphaned writer inherits them and would hold a pipe open
    out_path, err_path = tmp_path / "trainer.out", tmp_path / "trainer.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_lightning_trainer.py"), killed_dir, str(EPOCHS), str(KILL_EPOCH),
             release], env=env, stdout=out, stderr=err)
    try:
        # meanwhile, in this process: the uninterrupted run
        ref_trainer, reference, _ = fit(str(tmp_path / "reference"))
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.returncode == -9, err_path.read_text()[-3000:]
        killed_at = json.loads(out_path.read_text().strip().splitlines()[-1])["global_step"]
        assert killed_at == (KILL_EPOCH + 1) * lt.BATCHES

        # The trainer is dead and this epoch's two saves are in flight: the paths exist (Lightning
        # saw them), nothing of them is committed, and last.ckpt still loads the previous epoch.
        top_k = f"epoch={KILL_EPOCH}-step={killed_at}.ckpt"
        assert visible(killed_dir) == {f"epoch={KILL_EPOCH - 1}-step={killed_at - lt.BATCHES}.ckpt", top_k,
                                       "last.ckpt"}
        assert committed(os.path.join(killed_dir, top_k)) == []
        reader = ZerostallCheckpointIO()
        last_path = os.path.join(killed_dir, "last.ckpt")
        assert reader.load_checkpoint(last_path)["global_step"] == killed_at - lt.BATCHES
    finally:
        open(release, "w").close()  # the orphaned writer commits what it holds, then exits

    wait_for(lambda: reader.load_checkpoint(last_path)["global_step"] == killed_at,
             "the writer to commit the save the trainer died after")
    wait_for(lambda: committed(os.path.join(killed_dir, top_k)) != [], "the top-k save to commit")

    trainer, resumed, loaded = fit(killed_dir, ckpt_path="last")
    assert loaded.global_step == killed_at
    assert trainer.global_step == EPOCHS * lt.BATCHES
    assert_same_tensors(reference.state_dict(), resumed.state_dict())
    assert_same_tensors(ref_trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict())
    assert_same_tensors(ref_trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                        trainer.lr_scheduler_configs[0].scheduler.state_dict())

    # ModelCheckpoint's view and the directory agree: the top 2 and last.ckpt, each loadable.
    mc = trainer.checkpoint_callback
    assert visible(killed_dir) == {os.path.basename(p) for p in mc.best_k_models} | {"last.ckpt"}
    for p in mc.best_k_models:
        epoch = int(os.path.basename(p).split("-")[0].split("=")[1])
        assert reader.load_checkpoint(p)["epoch"] == epoch
    last = reader.load_checkpoint(mc.last_model_path)
    assert last["global_step"] == EPOCHS * lt.BATCHES
    assert last["hyper_parameters"]["options"] == argparse.Namespace(width=16, tags=("a", "b"))
    assert last["hyper_parameters"]["data_dir"] == pathlib.Path("/data/tiny")
    assert type(last["hyper_parameters"]["data_dir"]) is type(pathlib.Path("/data/tiny"))
    assert_same_tensors(last["state_dict"], {k: v for k, v in resumed.state_dict().items()})


def test_paths_of_saves_in_flight_exist_for_modelcheckpoint(tmp_path, monkeypatch):
    """Every save is held before its commit; ModelCheckpoint still names them ep, ep-v1, ep-v2
    (as with synchronous saves), because each path exists as soon as save_checkpoint returns."""
    release = tmp_path / "release"
    monkeypatch.setenv("ZEROSTALL_FAULTS", json.dumps({"commit": f"wait:{release}"}))
    ckpt_dir = str(tmp_path / "ck")
    seen: dict[str, Any] = {}

    class Release(pl.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            seen["names"] = visible(ckpt_dir)
            seen["committed"] = [c for n in seen["names"] for c in committed(os.path.join(ckpt_dir, n))]
            release.touch()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            release.touch()  # else teardown would wait for the held saves

    mc = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="ep", monitor="step", mode="max", save_top_k=-1,
                                      every_n_train_steps=1)
    plugin = ZerostallCheckpointIO(SaveOptions(writer=WriterKind.THREAD, max_in_flight=3))
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Release(), mc], plugins=[plugin])
    trainer.fit(lt.make_module(), lt.make_data())  # teardown waits for the three commits

    assert seen == {"names": {"ep.ckpt", "ep-v1.ckpt", "ep-v2.ckpt"}, "committed": []}
    reader = ZerostallCheckpointIO()
    steps = {n: reader.load_checkpoint(os.path.join(ckpt_dir, n))["global_step"] for n in seen["names"]}
    assert steps == {"ep.ckpt": 1, "ep-v1.ckpt": 2, "ep-v2.ckpt": 3}
    assert {os.path.basename(p) for p in mc.best_k_models} == seen["names"]


def test_save_last_link_resumes_through_the_symlink(tmp_path):
    ckpt_dir = str(tmp_path / "ck")
    mc = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, monitor="epoch", mode="max", save_top_k=1,
                                      every_n_epochs=1, save_last="link")
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[mc], plugins=[ZerostallCheckpointIO()])
    trainer.fit(lt.make_module(), lt.make_data())
    last = os.path.join(ckpt_dir, "last.ckpt")
    assert os.path.islink(last) and os.path.realpath(last) == os.path.realpath(mc.best_model_path)
    assert visible(ckpt_dir) == {"last.ckpt", os.path.basename(mc.best_model_path)}

    loaded = LoadedStep()
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[pl.callbacks.ModelCheckpoint(
                             dirpath=ckpt_dir, monitor="epoch", mode="max", save_top_k=1, every_n_epochs=1,
                             save_last="link"), loaded], plugins=[ZerostallCheckpointIO()])
    trainer.fit(lt.make_module(), lt.make_data(), ckpt_path="last")
    assert loaded.global_step == 2 * lt.BATCHES
    assert ZerostallCheckpointIO().load_checkpoint(last)["global_step"] == 3 * lt.BATCHES


# ------------------------------------------------------------------------------------------------
# the plugin on its own


class Mode(enum.Enum):
    FAST = "fast"


def test_converted_values_come_back_as_they_were(tmp_path):
    Point = collections.namedtuple("Point", "x y")
    hparams = {
        "ns": argparse.Namespace(lr=0.1, nested=argparse.Namespace(p=pathlib.PurePosixPath("/a"))),
        "path": pathlib.Path("/data"), "win": pathlib.PureWindowsPath("C:/x"),
        "tags": {"a", "b"}, "frozen": frozenset({1, 2}), "size": torch.Size([2, 3]),
        "ordered": collections.OrderedDict(b=1, a=2), "attrs": AttributeDict(k=torch.ones(2)),
        "in_tuple": (pathlib.Path("/t"), {3}), "point": Point(1, 2), "plain": [1, 2.5, None, "s", b"\x00"],
    }
    io = ZerostallCheckpointIO()
    state = {"state_dict": {"w": torch.arange(4.0)}, "hyper_parameters": hparams, "epoch": 0, "global_step": 3}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    assert hparams["tags"] == {"a", "b"} and isinstance(hparams["ns"], argparse.Namespace)  # input untouched
    out = io.load_checkpoint(tmp_path / "a.ckpt")
    hp = out["hyper_parameters"]
    for k in ("ns", "path", "win", "tags", "frozen", "size", "ordered", "in_tuple", "plain"):
        assert hp[k] == hparams[k] and type(hp[k]) is type(hparams[k]), k
    assert type(hp["ns"].nested.p) is pathlib.PurePosixPath
    assert type(hp["attrs"]) is AttributeDict and torch.equal(hp["attrs"].k, torch.ones(2))
    assert list(hp["ordered"]) == ["b", "a"]
    assert hp["point"] == (1, 2) and type(hp["point"]) is tuple  # the class is never imported on load
    assert torch.equal(out["state_dict"]["w"], torch.arange(4.0))


@pytest.mark.parametrize("value", [Mode.FAST, torch.nn.Linear(2, 2), str.upper], ids=["enum", "module", "function"])
def test_unsupported_value_is_refused_naming_its_key_and_leaves_nothing(tmp_path, value):
    io = ZerostallCheckpointIO()
    p = tmp_path / "bad.ckpt"
    with pytest.raises(UnsupportedLeafError) as info:
        io.save_checkpoint({"state_dict": {}, "hyper_parameters": {"lr": 1.0, "mode": value}}, p)
    assert info.value.key == "hyper_parameters/mode" and info.value.path == str(p)
    assert not p.exists()
    io.teardown()


def test_registered_handler_saves_an_enum(tmp_path):
    zerostall.register_handler(Mode, name="test.Mode", format="json", encode=lambda m: m.value, decode=Mode)
    try:
        io = ZerostallCheckpointIO()
        io.save_checkpoint({"hyper_parameters": {"mode": Mode.FAST}}, tmp_path / "m.ckpt")
        assert io.load_checkpoint(tmp_path / "m.ckpt")["hyper_parameters"]["mode"] is Mode.FAST
    finally:
        zerostall.unregister_handler(Mode)


@pytest.mark.parametrize("next_call", ["save", "load", "remove", "teardown"])
def test_background_failure_is_raised_by_the_next_call(tmp_path, monkeypatch, next_call):
    io = ZerostallCheckpointIO(THREAD)
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "good.ckpt")
    io.teardown()  # committed before the fault is switched on
    monkeypatch.setenv("ZEROSTALL_FAULTS", json.dumps({"write": "raise:ENOSPC"}))
    bad = str(tmp_path / "bad.ckpt")
    io.save_checkpoint({"w": torch.ones(3)}, bad)  # returns: the failure happens in the writer

    with pytest.raises(StorageError) as info:
        if next_call == "save":
            # a synchronous save on the same writer finishes after the failed one (jobs run in order)
            with pytest.raises(StorageError):
                zerostall.save_pytree(tmp_path / "probe", {"x": 1}, options=io.save_options)
            io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "next.ckpt")
        elif next_call == "load":
            io.load_checkpoint(bad)
        elif next_call == "remove":
            io.remove_checkpoint(bad)
        else:
            io.teardown()
    assert isinstance(info.value, ZerostallError) and info.value.errno == errno.ENOSPC
    assert info.value.path is not None and info.value.path.startswith(bad)

    monkeypatch.delenv("ZEROSTALL_FAULTS")
    io.teardown()  # raised once, not again
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(bad)  # the failed save never became visible
    assert io.load_checkpoint(tmp_path / "good.ckpt")["w"].sum() == 3


def test_overwrite_is_atomic_and_remove_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    p = str(tmp_path / "last.ckpt")
    io = ZerostallCheckpointIO(THREAD)
    io.save_checkpoint({"global_step": 1}, p)
    io.teardown()
    release = tmp_path / "release"
    monkeypatch.setenv("ZEROSTALL_FAULTS", json.dumps({"commit": f"wait:{release}"}))
    io.save_checkpoint({"global_step": 2}, p)
    assert ZerostallCheckpointIO().load_checkpoint(p)["global_step"] == 1  # another reader: the old one

    removed = threading.Event()
    remover = threading.Thread(target=lambda: (io.remove_checkpoint(p), removed.set()))
    remover.start()
    try:
        assert not removed.wait(0.5)  # the writer is held, so the removal cannot have run
        assert os.path.isdir(p)
    finally:
        release.touch()
    remover.join(60)
    assert removed.is_set() and not os.path.lexists(p)
    io.teardown()
    assert os.listdir(tmp_path) == ["release"]  # the renamed-away directory is deleted too


def test_a_deletion_cut_short_never_leaves_a_committed_checkpoint(tmp_path, monkeypatch):
    """Deletion drops every manifest.json before any data: stop it after that (as a crash would)."""
    p = str(tmp_path / "epoch=0.ckpt")
    io = ZerostallCheckpointIO()
    io.save_checkpoint({"w": torch.ones(2)}, p)
    io.save_checkpoint({"w": torch.ones(2)}, p)
    io.teardown()

    def cut(path: str, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EIO, "injected", path)

    monkeypatch.setattr("shutil.rmtree", cut)
    io.remove_checkpoint(p)
    assert not os.path.lexists(p)
    with pytest.raises(StorageError) as info:
        io.teardown()
    assert info.value.errno == errno.EIO and info.value.path == p
    (left,) = os.listdir(tmp_path)
    for root, _dirs, files in os.walk(tmp_path / left):
        assert "manifest.json" not in files, root


def test_map_location(tmp_path):
    io = ZerostallCheckpointIO()
    p = tmp_path / "m.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "optimizer_states": [{"state": {0: {"m": torch.zeros(2)}}}],
                        "lr_schedulers": [], "t": (torch.ones(1),)}, p)

    def devices(ck: dict[str, Any]) -> set[str]:
        return {ck["state_dict"]["w"].device.type, ck["optimizer_states"][0]["state"][0]["m"].device.type,
                ck["t"][0].device.type}

    assert devices(io.load_checkpoint(p)) == {"cpu"}
    assert devices(io.load_checkpoint(p, map_location="meta")) == {"meta"}
    assert devices(io.load_checkpoint(p, map_location=torch.device("meta"))) == {"meta"}
    assert devices(io.load_checkpoint(p, map_location={"cpu": "meta"})) == {"meta"}
    assert devices(io.load_checkpoint(p, map_location={"cuda:0": "meta"})) == {"cpu"}
    assert devices(io.load_checkpoint(p, map_location=lambda storage, loc: storage)) == {"cpu"}
    assert devices(io.load_checkpoint(p, map_location=lambda s, loc: torch.UntypedStorage(0, device="meta"))) == {"meta"}
    with pytest.raises(TypeError):
        io.load_checkpoint(p, map_location=1.5)


def test_paths_zerostall_does_not_own(tmp_path):
    io = ZerostallCheckpointIO()
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"w": torch.ones(1)}, legacy)
    with pytest.raises(CheckpointNotFoundError, match="never unpickles"):
        io.load_checkpoint(legacy)
    io.save_checkpoint({"w": torch.zeros(1)}, legacy)  # replaces the file (kept until the save commits)
    io.teardown()
    assert io.load_checkpoint(legacy)["w"].item() == 0
    assert sorted(os.listdir(tmp_path)) == ["legacy.ckpt"]

    foreign = tmp_path / "sharded.ckpt"
    foreign.mkdir()
    (foreign / "shard-0.pt").write_bytes(b"x")
    with pytest.raises(CheckpointExistsError):
        io.save_checkpoint({"w": torch.ones(1)}, foreign)
    with pytest.raises(StorageError, match="local filesystem"):
        io.save_checkpoint({"w": torch.ones(1)}, "s3://bucket/x.ckpt")
    with pytest.raises(TypeError):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "o.ckpt", storage_options={"a": 1})


def test_lightning_plugin_options_of_the_wrong_type_are_refused_at_construction(tmp_path: pathlib.Path) -> None:
    # A dict for save_options would fail only at the first save, as an AttributeError about
    # 'distributed'; a non-dict checkpoint as one about 'get': both are refused by name instead.
    with pytest.raises(ArgumentTypeError, match=r"save_options must be a zerostall\.SaveOptions") as info:
        ZerostallCheckpointIO(save_options={"max_in_flight": 2})  # type: ignore[arg-type]
    assert info.value.argument == "save_options"
    with pytest.raises(ArgumentTypeError, match=r"load_options must be a zerostall\.LoadOptions"):
        ZerostallCheckpointIO(load_options=zerostall.SaveOptions())  # type: ignore[arg-type]
    io = ZerostallCheckpointIO()
    with pytest.raises(ArgumentTypeError, match="checkpoint must be a dict"):
        io.save_checkpoint([1], tmp_path / "x.ckpt")  # type: ignore[arg-type]
    io.teardown()


def test_options_and_pickling():
    with pytest.raises(ValueError, match="per process"):
        ZerostallCheckpointIO(SaveOptions(distributed=zerostall.DistributedOptions(enabled=True)))
    io = pickle.loads(pickle.dumps(ZerostallCheckpointIO(THREAD)))
    assert io.save_options.writer is WriterKind.THREAD and io.save_options.distributed.enabled is False
