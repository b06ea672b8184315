"""ZerostallCheckpointing with a real Hugging Face Trainer and trl SFTTrainer (tiny GPT-2, CPU, no Hub).

The kill tests run a trainer subprocess that SIGKILLs itself right after a save was staged, while
zerostall's writer is held before that save's commit (``ZEROSTALL_FAULTS={"commit": "wait:..."}``):
the save is provably in flight when the trainer dies, commits afterwards, and
``train(resume_from_checkpoint=True)`` resumes from it to the same parameters, optimizer and
scheduler state, bit for bit, as an uninterrupted stock run (one that never checkpoints).
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
import transformers
from packaging.version import Version
from safetensors import safe_open
from transformers import Trainer, TrainerCallback

import zerostall
import zerostall.integrations.transformers as zt
from zerostall.errors import BackgroundSaveError, MissingDependencyError, MissingKeyError, ZerostallWarning
from zerostall.integrations.transformers import HF_METHODS, ZerostallCheckpointing
from zerostall.interop import export_checkpoint

HERE = os.path.dirname(__file__)
SRC = os.path.join(HERE, "..", "..", "src")
sys.path.insert(0, HERE)
import _hf_trainer as ht  # noqa: E402

STEPS = 8  # 6 steps per epoch: the resumed run crosses an epoch boundary (a new shuffle)
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def committed(zs_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(zs_dir) if os.path.isfile(os.path.join(zs_dir, n, "manifest.json")))


def wait_for(predicate: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout  # a bound on a hang, not a verdict on speed
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def losses(trainer: Any) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


class StartStep(TrainerCallback):
    """Records the step training resumed at, and what a callback sees of the optimizer and the
    scheduler when training begins; then creates ``release`` (everything is loaded by then)."""

    def __init__(self, release: str) -> None:
        self.step: int | None = None
        self.optimizer_steps: int | None = None
        self.scheduler_epoch: int | None = None
        self.release = release

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.step = state.global_step
        adam = kw["optimizer"].state_dict()["state"]
        self.optimizer_steps = int(adam[0]["step"]) if adam else 0
        self.scheduler_epoch = kw["lr_scheduler"].last_epoch
        open(self.release, "w").close()


def reference(kind: str, out: str) -> Any:
    """An uninterrupted stock run that never checkpoints."""
    ref = ht.make_trainer(kind, out, STEPS, save_strategy="no")
    ref.train()
    return ref


def kill_and_resume(tmp_path: Any, kind: str, kill_step: int, memory: bool) -> tuple[Any, Any, StartStep, str]:
    out = str(tmp_path / "killed")
    zs_dir = os.path.join(out, "zerostall")
    release = str(tmp_path / "release")
    open(release, "w").close()
    # memory: the keeper of the killed trainer holds its persist of the newest step until after the resume
    hold = str(tmp_path / "keeper-hold")
    faults = {"keeper_persist": f"wait:{hold}"} if memory else {"commit": f"wait:{release}"}
    env = dict(ENV, ZEROSTALL_FAULTS=json.dumps(faults))
    out_path, err_path = tmp_path / "trainer.out", tmp_path / "trainer.err"
    with open(out_path, "w") as o, open(err_path, "w") as e:  # files: the orphaned writer inherits them
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_hf_trainer.py"), kind, out, str(STEPS),
                                 str(kill_step), release, *(["memory"] if memory else [])], env=env, stdout=o, stderr=e)
    try:
        ref = reference(kind, str(tmp_path / "reference"))  # meanwhile, in this process
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.returncode == -9, err_path.read_text()[-3000:]
        assert json.loads(out_path.read_text().strip().splitlines()[-1]) == {"killed_at": kill_step}
        if memory:  # the killed step is in the keeper's memory only; storage has the 4th
            assert committed(zs_dir) == ["step_00000004"]
        else:  # the trainer died with the save in flight: nothing of it is committed yet
            assert committed(zs_dir) == [f"step_{s:08d}" for s in range(2, kill_step, 2)]
    finally:
        open(release, "w").close()  # the orphaned writer commits what it holds, then exits
    if not memory:
        wait_for(lambda: f"step_{kill_step:08d}" in committed(zs_dir), "the writer to commit the held save")
    if memory:  # the killed step was never persisted: only the keeper's memory holds it
        assert committed(zs_dir) == ["step_00000004"]
    start = StartStep(hold)
    resumed = ht.make_trainer(kind, out, STEPS, callbacks=[start])
    ZerostallCheckpointing(resumed, memory_tier=ht.MEMORY if memory else None)
    try:
        resumed.train(resume_from_checkpoint=True)
    finally:
        open(hold, "w").close()
    return ref, resumed, start, out


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_sigkill_during_async_save_then_resume_true_matches_uninterrupted_run(tmp_path, kind):
    ref, resumed, start, out = kill_and_resume(tmp_path, kind, kill_step=4, memory=False)
    assert start.step == 4  # resumed from the save the trainer died during
    # a callback's on_train_begin sees the optimizer and scheduler of step 4, as from HF's own resume
    assert (start.optimizer_steps, start.scheduler_epoch) == (4, 4)
    assert resumed.state.global_step == STEPS
    assert_same(ref.model.state_dict(), resumed.model.state_dict(), "model")
    assert_same(ref.optimizer.state_dict(), resumed.optimizer.state_dict(), "optimizer")
    assert_same(ref.lr_scheduler.state_dict(), resumed.lr_scheduler.state_dict(), "scheduler")
    assert losses(resumed) == losses(ref)  # the log history up to step 4 came back from the checkpoint
    # HF's own save never ran: no checkpoint-N folders, only zerostall's steps
    assert os.listdir(out) == ["zerostall"]
    assert committed(os.path.join(out, "zerostall")) == [f"step_{s:08d}" for s in (2, 4, 6, 8)]


def test_sigkill_after_a_memory_only_save_resumes_from_memory_bit_for_bit(tmp_path):
    ref, resumed, start, out = kill_and_resume(tmp_path, "trainer", kill_step=6, memory=True)
    assert start.step == 6  # only the keeper's memory held step 6
    assert_same(ref.model.state_dict(), resumed.model.state_dict(), "model")
    assert_same(ref.optimizer.state_dict(), resumed.optimizer.state_dict(), "optimizer")
    assert losses(resumed) == losses(ref)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: Any) -> tuple[Any, ZerostallCheckpointing]:
    """One run of STEPS steps, saving every 2 with save_total_limit=2, then trainer.save_model()."""
    out = str(tmp_path_factory.mktemp("trained") / "run")
    trainer = ht.make_trainer("trainer", out, STEPS, save_total_limit=2)
    zs = ZerostallCheckpointing(trainer)
    trainer.train()
    trainer.save_model()
    return trainer, zs


def test_checkpoint_holds_trainer_state_rng_and_config(trained):
    trainer, zs = trained
    step = os.path.join(zs.directory, f"step_{STEPS:08d}")
    got = zerostall.load_checkpointables(step)
    assert set(got) == {"model", "optimizer", "scheduler", "rng", "trainer_state", "hf_config"}
    state = json.loads(got["trainer_state"])
    assert state["global_step"] == STEPS
    assert state["log_history"] == trainer.state.log_history[:len(state["log_history"])]
    assert "TrainerControl" in state["stateful_callbacks"]
    assert set(got["rng"]) >= {"python", "numpy", "cpu"}
    assert json.loads(got["hf_config"])["model_type"] == "gpt2"
    assert_same(got["model"], dict(trainer.model.state_dict()), "model")
    assert zerostall.load_metadata(step)["transformers"]["global_step"] == STEPS


def test_save_total_limit_keeps_the_newest_steps(trained):
    _, zs = trained
    assert committed(zs.directory) == ["step_00000006", "step_00000008"]


def test_load_best_model_at_end_keeps_and_loads_the_best_step(tmp_path):
    calls = []

    def compute_metrics(pred: Any) -> dict[str, float]:
        calls.append(1)
        return {"score": 10.0 - len(calls)}  # the first evaluation (step 2) is the best

    out = str(tmp_path / "run")
    trainer = ht.make_trainer("trainer", out, STEPS, save_total_limit=2, eval_strategy="steps", eval_steps=2,
                              load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=True,
                              per_device_eval_batch_size=24, compute_metrics=compute_metrics)
    zs = ZerostallCheckpointing(trainer)
    trainer.train()
    assert len(calls) == 4
    assert committed(zs.directory) == ["step_00000002", "step_00000006", "step_00000008"]
    best = os.path.join(zs.directory, "step_00000002")
    assert trainer.state.best_model_checkpoint == best and trainer.state.best_global_step == 2
    saved = zerostall.load_checkpointables(best, {"model": None})["model"]
    assert_same(saved, {k: v for k, v in trainer.model.state_dict().items()}, "best model")
    last = zerostall.load_checkpointables(os.path.join(zs.directory, "step_00000008"), {"model": None})["model"]
    assert not torch.equal(last["transformer.h.0.attn.c_attn.weight"],
                           trainer.model.state_dict()["transformer.h.0.attn.c_attn.weight"])


def _digest(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode() + sd[k].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# in a process where zerostall cannot be imported at all
_FROM_PRETRAINED = """
import hashlib, sys
sys.modules["zerostall"] = None
import torch
from transformers import AutoModelForCausalLM
for path in sys.argv[1:]:
    sd = AutoModelForCausalLM.from_pretrained(path).state_dict()
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode() + sd[k].detach().contiguous().view(torch.uint8).numpy().tobytes())
    print(h.hexdigest())
"""


def from_pretrained_digests(*paths: str) -> list[str]:
    """The state dicts' digests of ``from_pretrained(path)`` in a process without zerostall (one process)."""
    r = subprocess.run([sys.executable, "-c", _FROM_PRETRAINED, *paths], env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-len(paths):]


def test_save_model_and_export_hf_directories_load_with_from_pretrained_without_zerostall(tmp_path, trained):
    """trainer.save_model() after training, and `zerostall export --hf` of the last step (one file;
    shards with an index), each read by from_pretrained in a process where zerostall cannot be imported."""
    trainer, zs = trained
    out = trainer.args.output_dir
    assert not [n for n in os.listdir(out) if n.startswith("checkpoint-")]  # HF's own save never ran
    assert {"config.json", "model.safetensors", "zerostall"} <= set(os.listdir(out))
    step = os.path.join(zs.directory, f"step_{STEPS:08d}")
    want = trainer.model.state_dict()
    one, sharded = str(tmp_path / "hf-one"), str(tmp_path / "hf-sharded")
    cli = [sys.executable, "-m", "zerostall", "export", step]
    r = subprocess.run([*cli, one, "--hf", "--json"], env=dict(ENV, PYTHONPATH=SRC), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "hf"
    assert sorted(os.listdir(one)) == ["config.json", "model.safetensors"]
    with safe_open(os.path.join(one, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(want) and f.metadata() == {"format": "pt"}  # HF key names

    report = export_checkpoint(step, sharded, format="hf", max_shard_bytes=40_000)  # the Python API
    assert report.format == "hf" and report.tensors == len(want)
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    for name in shards:
        assert os.path.getsize(os.path.join(sharded, name)) < 40_000 + 4096  # a shard: <= 40 kB of tensors + header
    assert from_pretrained_digests(out, one, sharded) == [_digest(want)] * 3


def test_export_hf_without_a_config_item_names_what_is_missing(tmp_path):
    ckpt = str(tmp_path / "plain")
    zerostall.save_checkpointables(ckpt, {"model": {"w": torch.ones(3)}})
    with pytest.raises(MissingKeyError, match="hf_config"):
        export_checkpoint(ckpt, str(tmp_path / "out"), format="hf")
    assert not os.path.exists(tmp_path / "out")


def test_two_rank_torchrun_ddp_saves_collectively_and_resumes_bit_for_bit(tmp_path):
    out = str(tmp_path / "ddp")
    env = dict(ENV, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(HERE, "_hf_trainer.py"), "ddp", out], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(row["rank"] for row in rows) == [0, 1]
    for row in rows:
        assert row["global_step"] == 6 and row["ref"] == row["resumed"]
        assert row["steps"] == ["step_00000002", "step_00000004", "step_00000006"]
    assert rows[0]["ref"] == rows[1]["ref"]
    # one collective checkpoint per step, with a data file written by each rank
    manifest = json.load(open(os.path.join(out, "run", "zerostall", "step_00000006", "manifest.json")))
    assert [f["path"] for f in manifest["files"]] == ["data/rank-00000.safetensors", "data/rank-00001.safetensors"]


def test_missing_transformers_raises_missing_dependency_error():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from zerostall.errors import MissingDependencyError\n"
            "try:\n    import zerostall.integrations.transformers\n"
            "except MissingDependencyError as e:\n    print('MDE', e.name, e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(ENV, PYTHONPATH=SRC), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("MDE transformers") and "zerostall[transformers]" in r.stdout


# -- the transformers releases and Trainer methods the integration depends on ---------------------

def _minor(version: str) -> str:
    v = Version(version)
    return f"{v.major}.{v.minor}"


def test_each_trainer_method_in_the_table_has_the_signature_and_callers_it_relies_on_in_this_release():
    """The installed transformers is one the table was read in, and in it each method of the table
    exists with its signature and is called, by that name, from where the table says. A release
    that renames, moves or changes one fails here, naming it."""
    assert _minor(transformers.__version__) in zt.TESTED_TRANSFORMERS, (
        f"transformers {transformers.__version__} is not in TESTED_TRANSFORMERS: read HF_METHODS' methods and "
        "their callers in it, then add it")
    for m in HF_METHODS:
        assert _minor(transformers.__version__) in m.tested, m.name
        fn = getattr(Trainer, m.name, None)
        assert callable(fn), f"Trainer.{m.name} does not exist"
        assert zt.signature_of(fn) == m.signature, f"Trainer.{m.name}"
        assert m.public == (not m.name.startswith("_")) and m.why, m.name
        for module, qualname in m.callers:
            caller: Any = importlib.import_module(module)
            for part in qualname.split("."):
                caller = getattr(caller, part)
            assert f".{m.name}(" in inspect.getsource(caller), f"{module}.{qualname} no longer calls {m.name}"


def test_the_table_names_every_method_replaced_on_the_trainer(tmp_path):
    trainer = ht.make_trainer("trainer", str(tmp_path / "run"), 2)
    zs = ZerostallCheckpointing(trainer)
    replaced = {name for name, v in vars(trainer).items() if isinstance(v, types.MethodType) and v.__self__ is zs}
    assert replaced == {m.name for m in HF_METHODS if m.replaced}
    assert replaced >= {"_save_checkpoint", "_load_from_checkpoint", "_load_rng_state", "_load_best_model"}


def test_the_docs_table_lists_the_same_methods_releases_and_kinds():
    text = open(os.path.join(HERE, "..", "..", "docs", "integrations.md"), encoding="utf-8").read()
    section = text.split("### The Trainer methods it replaces, and the releases it accepts", 1)[1].split("\n### ", 1)[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| `")]
    rows = [r for r in cells if re.fullmatch(r"`\w+`", r[0])]  # the method rows, not the header
    assert [r[0].strip("`") for r in rows] == [m.name for m in HF_METHODS]
    for row, m in zip(rows, HF_METHODS):
        assert row[1].startswith("public" if m.public else "private"), m.name
        assert row[3] == ", ".join(f"transformers {t}" for t in m.tested), m.name


def test_the_loaders_left_to_hf_load_nothing_from_a_zerostall_resume_folder(tmp_path):
    """HF's own _load_optimizer_and_scheduler and _load_scaler run on every zerostall resume, with
    a folder that holds only trainer_state.json: they must load nothing (create_scheduler does)."""
    trainer = ht.make_trainer("trainer", str(tmp_path / "run"), 4)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    trainer.optimizer.step()  # some state, that a load would replace
    before = (trainer.optimizer.state_dict(), trainer.lr_scheduler.state_dict())
    folder = tmp_path / "resume"
    folder.mkdir()
    trainer.state.save_to_json(str(folder / "trainer_state.json"))
    trainer._load_optimizer_and_scheduler(str(folder))
    trainer._load_scaler(str(folder))
    assert_same(before, (trainer.optimizer.state_dict(), trainer.lr_scheduler.state_dict()))


@pytest.mark.parametrize("version", ["4.57.1", "5.23.2", "5.25.0", "6.0.0", "5.24.0rc1", "5.25.0.dev0"])
def test_a_transformers_release_outside_the_tested_ones_is_refused_by_name(tmp_path, monkeypatch, version):
    trainer = ht.make_trainer("trainer", str(tmp_path / "run"), 2)
    monkeypatch.setattr(zt.transformers, "__version__", version)  # the package object the integration reads
    with pytest.raises(MissingDependencyError, match=rf"tested with transformers 5\.24\.x; found transformers "
                                                     rf"{version.replace('.', '[.]')}\.") as e:
        ZerostallCheckpointing(trainer)
    assert e.value.name == "transformers" and "allow_untested_transformers=True" in str(e.value)
    assert not os.path.exists(tmp_path / "run" / "zerostall")
    assert trainer._save_checkpoint.__func__ is Trainer._save_checkpoint  # nothing was replaced


def test_an_untested_transformers_runs_with_the_opt_in_and_warns(tmp_path, monkeypatch):
    trainer = ht.make_trainer("trainer", str(tmp_path / "run"), 2)
    monkeypatch.setattr(zt.transformers, "__version__", "5.25.0")
    with pytest.warns(ZerostallWarning, match=r"found transformers 5\.25\.0.*allow_untested_transformers=True"):
        zs = ZerostallCheckpointing(trainer, allow_untested_transformers=True)
    trainer.train()
    assert committed(zs.directory) == ["step_00000002"]


def test_an_untested_trl_is_refused_for_a_trl_trainer_unless_opted_in(tmp_path, monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    trainer = ht.make_trainer("sft", str(tmp_path / "run"), 2)
    with pytest.raises(MissingDependencyError, match=r"tested with trl 1\.16\.x; found trl 1\.17\.0") as e:
        ZerostallCheckpointing(trainer)
    assert e.value.name == "trl"
    ZerostallCheckpointing(ht.make_trainer("trainer", str(tmp_path / "plain"), 2))  # not a trl trainer: trl is not asked
    with pytest.warns(ZerostallWarning, match=r"found trl 1\.17\.0"):
        ZerostallCheckpointing(trainer, allow_untested_transformers=True)


@pytest.mark.parametrize("change", ["renamed", "new parameter"])
def test_a_release_that_changed_a_replaced_method_is_refused_even_with_the_opt_in(tmp_path, monkeypatch, change):
    trainer = ht.make_trainer("trainer", str(tmp_path / "run"), 2)
    if change == "renamed":
        monkeypatch.delattr(Trainer, "_load_rng_state")
        want = r"Trainer\._load_rng_state does not exist, where .* relies on _load_rng_state\(self, checkpoint\)"
    else:
        monkeypatch.setattr(Trainer, "_save_checkpoint", lambda self, model, trial, metrics=None: None)
        want = r"Trainer\._save_checkpoint is _save_checkpoint\(self, model, trial, metrics=None\), where"
    with pytest.raises(MissingDependencyError, match=want):
        ZerostallCheckpointing(trainer, allow_untested_transformers=True)
    assert not hasattr(trainer, "_zerostall")


def test_an_installed_transformers_too_old_for_the_integration_names_its_version():
    code = ("import transformers.trainer_callback as tc\n"
            "del tc.ExportableState  # a name releases before the supported ones lack\n"
            "from zerostall.errors import MissingDependencyError\n"
            "try:\n    import zerostall.integrations.transformers\n"
            "except MissingDependencyError as e:\n    print('MDE', e.name, e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(ENV, PYTHONPATH=SRC), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import transformers

    assert r.stdout.startswith("MDE transformers"), r.stdout
    assert f"found {transformers.__version__}" in r.stdout and "not installed" not in r.stdout


def test_wrapping_a_trainer_that_is_already_training_is_refused(tmp_path):
    trainer = ht.make_trainer("trainer", str(tmp_path / "run"), 2)
    trainer.is_in_train = True  # what Trainer.train() sets for its whole run
    with pytest.raises(zerostall.errors.InvalidArgumentError, match=r"before trainer\.train\(\)"):
        ZerostallCheckpointing(trainer)


def test_resuming_from_a_zerostall_step_of_another_directory_says_how(tmp_path):
    trainer = ht.make_trainer("trainer", str(tmp_path / "run"), 2)
    ZerostallCheckpointing(trainer)
    other = tmp_path / "elsewhere" / "zerostall" / "step_00000005"
    with pytest.raises(zerostall.errors.InvalidArgumentError, match="directory=") as e:
        trainer.train(resume_from_checkpoint=str(other))
    assert e.value.path == str(other)


def test_a_save_that_fails_in_the_background_fails_train(tmp_path, monkeypatch):
    """The writer fails the commit (a full disk): train() raises that failure when it ends, as
    the Checkpointer's close() does; nothing of the step is committed."""
    monkeypatch.setenv("ZEROSTALL_FAULTS", json.dumps({"commit": "raise:ENOSPC"}))  # the writer starts in train()
    trainer = ht.make_trainer("trainer", str(tmp_path / "run"), 2)
    zs = ZerostallCheckpointing(trainer)
    with pytest.raises(BackgroundSaveError, match="ENOSPC") as e:
        trainer.train()
    assert getattr(e.value.__cause__, "errno", None) == errno.ENOSPC or "ENOSPC" in str(e.value)
    assert committed(zs.directory) == []
    assert zs.checkpointer is None  # closed


def test_a_resume_whose_optimizer_state_was_not_loaded_stops_before_training(tmp_path, trained):
    """If HF began training without calling create_scheduler (where the optimizer, scheduler and
    scaler state of the step are loaded), the resume stops at on_train_begin instead of training
    from a fresh optimizer."""
    _, done = trained
    trainer = ht.make_trainer("trainer", str(tmp_path / "run"), STEPS + 2)
    ZerostallCheckpointing(trainer, directory=done.directory)
    trainer.create_scheduler = types.MethodType(Trainer.create_scheduler, trainer)  # as if HF no longer called ours
    with pytest.raises(MissingDependencyError, match=r"without calling Trainer\.create_scheduler"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == STEPS  # it stopped where it resumed
    assert committed(done.directory) == ["step_00000006", "step_00000008"]


@pytest.mark.parametrize(("notice_step", "save_steps", "memory", "want"), [
    (3, 100, True, [3]),    # a step no regular save took: the JIT save is one, memory-only, persisted at the end
    (4, 2, False, [2, 4]),  # right after HF's regular save of step 4: HF asks for step 4 again, which it has
], ids=["new-step-memory-tier", "after-a-regular-save"])
def test_sigterm_with_enable_jit_checkpoint_saves_through_zerostall_then_resumes_bit_for_bit(
        tmp_path, notice_step, save_steps, memory, want):
    """HF's enable_jit_checkpoint with ZerostallCheckpointing: the test sends SIGTERM at the end of
    step N; 3 s later HF's timer requests the JIT checkpoint, which HF takes at the next step's
    on_step_begin (global step N) through the trainer's _save_checkpoint: zerostall's. That step
    finishes, training stops, train() returns with step N committed, and the process exits 0. A
    fresh trainer resuming it ends bit for bit where an uninterrupted run does."""
    out = tmp_path / "jit"
    ready = tmp_path / "ready"
    out_path, err_path = tmp_path / "trainer.out", tmp_path / "trainer.err"
    with open(out_path, "w") as o, open(err_path, "w") as e:
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_hf_trainer.py"), "jit", str(out), str(STEPS),
                                 str(notice_step), str(save_steps), str(ready), *(["memory"] if memory else [])],
                                env=ENV, stdout=o, stderr=e)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, f"the trainer to finish step {notice_step}",
                 timeout=300)
        assert proc.poll() is None, err_path.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        ref = reference("trainer", str(tmp_path / "reference"))  # meanwhile, in this process
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err_path.read_text()[-3000:]
    row = json.loads(out_path.read_text().strip().splitlines()[-1])
    # HF finished the step it noticed in, then stopped; the JIT step was committed when train() returned
    assert row == {"global_step": notice_step + 1, "committed": [f"step_{s:08d}" for s in want]}
    zs_dir = str(out / "zerostall")
    assert zerostall.load_metadata(os.path.join(zs_dir, f"step_{notice_step:08d}"))["transformers"]["global_step"] \
        == notice_step
    # HF's sentinel folder for the JIT save: created before the save, emptied once it returned
    assert sorted(os.listdir(out)) == [f"checkpoint-{notice_step}", "zerostall"]
    assert os.listdir(out / f"checkpoint-{notice_step}") == []

    start = StartStep(str(tmp_path / "started"))
    resumed = ht.make_trainer("trainer", str(out), STEPS, callbacks=[start], save_steps=save_steps)
    ZerostallCheckpointing(resumed)
    resumed.train(resume_from_checkpoint=True)
    assert start.step == notice_step
    assert resumed.state.global_step == STEPS
    assert_same(ref.model.state_dict(), resumed.model.state_dict(), "model")
    assert_same(ref.optimizer.state_dict(), resumed.optimizer.state_dict(), "optimizer")
    assert_same(ref.lr_scheduler.state_dict(), resumed.lr_scheduler.state_dict(), "scheduler")
    assert losses(resumed) == losses(ref)
