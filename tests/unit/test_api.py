import collections
import os
import random

import numpy as np
import pytest
import torch

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import CheckpointExistsError, CheckpointNotFoundError, MismatchError, MissingKeyError
from zerostall.messages import WriterStats

Pair = collections.namedtuple("Pair", ["left", "right"])
THREAD = SaveOptions(writer=WriterKind.THREAD)


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(4, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, generator=g).half(),
        "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "fp8b": torch.randn(6, generator=g).to(torch.float8_e5m2),
        "bool": torch.tensor([True, False, True]),
        "i64": torch.arange(-3, 3),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "scalar_t": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(20.0).reshape(4, 5)[:, 1::2],
        "transposed": torch.arange(6.0).reshape(2, 3).t(),
        "np": np.arange(6, dtype=np.float64).reshape(2, 3),
        "np_scalar": np.float32(1.5),
        "nested": {"list": [1, 2.5, "x", None, True], "tuple": (b"raw", -7), "pair": Pair(1, torch.ones(2))},
        3: "int key",
        "nan": float("nan"),
        "inf": float("-inf"),
        "big": 2 ** 100,
    }


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b and type(a) is type(b), (a, b)


@pytest.mark.parametrize("options", [None, THREAD], ids=["process", "thread"])
def test_round_trip_without_template(ckdir, options):
    state = _state()
    zerostall.save_pytree(ckdir / "c", state, options=options)
    out = zerostall.load_pytree(ckdir / "c")
    expect = dict(state)
    expect["nested"] = dict(state["nested"], pair=(1, state["nested"]["pair"].right))  # namedtuple -> tuple
    expect["np_scalar"] = state["np_scalar"]
    _assert_same(expect, out)
    assert isinstance(out["np_scalar"], np.float32)


def test_load_into_template_in_place(ckdir):
    state = _state()
    zerostall.save_pytree(ckdir / "c", state)
    template = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    template["np"] = np.zeros((2, 3))
    ptrs = {k: v.data_ptr() for k, v in template.items() if isinstance(v, torch.Tensor)}
    out = zerostall.load_pytree(ckdir / "c", template)
    for k, p in ptrs.items():
        assert out[k] is template[k] and out[k].data_ptr() == p
        _assert_same(state[k], out[k])
    assert out["np"] is template["np"] and np.array_equal(out["np"], state["np"])
    assert isinstance(out["nested"]["pair"], Pair)


def test_non_contiguous_template_is_filled(ckdir):
    zerostall.save_pytree(ckdir / "c", {"w": torch.arange(6.0).reshape(2, 3)})
    holder = torch.zeros(3, 2)
    view = holder.t()
    zerostall.load_pytree(ckdir / "c", {"w": view})
    assert torch.equal(holder.t(), torch.arange(6.0).reshape(2, 3))


def test_partial_restore_reads_only_requested_keys(ckdir):
    zerostall.save_pytree(ckdir / "c", {"a": torch.ones(3), "b": torch.full((1000,), 2.0)})
    # corrupt b's bytes: a partial load of "a" must not read (nor verify) them
    m = zerostall.load_pytree  # noqa
    import json
    man = json.loads((ckdir / "c" / "manifest.json").read_text())
    b = next(lf for lf in man["leaves"] if lf["key"] == "pytree/b")
    data = ckdir / "c" / man["files"][0]["path"]
    raw = bytearray(data.read_bytes())
    raw[b["offset"]] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = zerostall.load_pytree(ckdir / "c", {"a": torch.zeros(3)})
    assert list(out) == ["a"] and torch.equal(out["a"], torch.ones(3))
    with pytest.raises(zerostall.errors.ChecksumMismatchError):
        zerostall.load_pytree(ckdir / "c", {"b": torch.zeros(1000)})


def test_mismatches_name_key_and_both_sides(ckdir):
    zerostall.save_pytree(ckdir / "c", {"m": {"w": torch.zeros(2, 3)}})
    with pytest.raises(MismatchError) as ei:
        zerostall.load_pytree(ckdir / "c", {"m": {"w": torch.zeros(3, 2)}})
    assert ei.value.key == "pytree/m/w" and "[2, 3]" in str(ei.value) and "[3, 2]" in str(ei.value)
    assert str(ckdir / "c") in str(ei.value)
    with pytest.raises(MismatchError, match="dtype"):
        zerostall.load_pytree(ckdir / "c", {"m": {"w": torch.zeros(2, 3, dtype=torch.float64)}})
    with pytest.raises(MissingKeyError) as ei2:
        zerostall.load_pytree(ckdir / "c", {"m": {"nope": torch.zeros(1)}})
    assert ei2.value.key == "pytree/m/nope"


def test_an_expanded_template_tensor_is_refused_naming_its_key(tmp_path):
    # torch refuses to write into an expand()ed view only after every byte was read, and without
    # the key: the plan refuses it first, naming the key, and leaves every template untouched.
    zerostall.save_pytree(tmp_path / "a", {"b": torch.arange(3.0), "c": torch.ones(2)})
    template = {"b": torch.zeros(1).expand(3), "c": torch.zeros(2)}
    with pytest.raises(MismatchError, match=r"expand\(\)ed .*t\.clone\(\)") as info:
        zerostall.load_pytree(tmp_path / "a", template)
    assert info.value.key == "pytree/b"
    assert template["c"].tolist() == [0.0, 0.0]  # refused before anything was read


def test_meta_template_is_refused_naming_the_key(tmp_path):
    # A meta tensor has no storage: loaded "into" it, the template would come back empty.
    thread = SaveOptions(writer=WriterKind.THREAD)
    model = torch.nn.Linear(4, 2)
    zerostall.save_pytree(tmp_path / "a", {"w": torch.ones(3), "model": model}, options=thread)
    with pytest.raises(MismatchError, match=r"meta device.*to_empty") as info:
        zerostall.load_pytree(tmp_path / "a", {"w": torch.zeros(3, device="meta")})
    assert info.value.key == "pytree/w"
    meta_model = torch.nn.Linear(4, 2, device="meta")
    with pytest.raises(MismatchError, match="meta device") as info:
        zerostall.load_pytree(tmp_path / "a", {"model": meta_model})
    assert info.value.key == "pytree/model/weight"
    # the way out the message gives: materialize, then load in place
    meta_model.to_empty(device="cpu")
    zerostall.load_pytree(tmp_path / "a", {"model": meta_model})
    assert torch.equal(meta_model.weight, model.weight)


def test_a_load_state_dict_that_refuses_names_the_object_and_its_key(tmp_path):
    # torch's "Error(s) in loading state_dict" does not say which of the model, optimizer,
    # scheduler, ... refused: the error names the object's class and its key.
    model = torch.nn.Linear(3, 2)
    zerostall.save_pytree(tmp_path / "a", {"model": model, "step": 3})
    other = torch.nn.Sequential(torch.nn.Linear(3, 2))  # keys "0.weight", not "weight"
    with pytest.raises(MismatchError, match=r"Sequential\.load_state_dict refused") as info:
        zerostall.load_pytree(tmp_path / "a", {"model": other})
    assert info.value.key == "pytree/model"


def test_existing_checkpoint_is_never_overwritten(ckdir):
    zerostall.save_pytree(ckdir / "c", {"a": torch.ones(1)})
    with pytest.raises(CheckpointExistsError):
        zerostall.save_pytree(ckdir / "c", {"a": torch.zeros(1)})
    assert torch.equal(zerostall.load_pytree(ckdir / "c")["a"], torch.ones(1))


def test_missing_checkpoint(ckdir):
    with pytest.raises(CheckpointNotFoundError) as ei:
        zerostall.load_pytree(ckdir / "nothing")
    assert isinstance(ei.value, FileNotFoundError)


def test_load_pytree_of_a_run_directory_or_a_misspelled_step_names_the_steps(tmp_path):
    # The directory a Checkpointer writes, or run/step_1, holds no manifest itself: the error
    # lists the committed steps there and the call that loads one.
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


def test_loading_with_the_other_kind_of_function_says_which_one_saved_it(tmp_path):
    # "the checkpoint has no item 'pytree'" alone leaves the user to guess which function loads it.
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


def test_checkpointables(ckdir):
    zerostall.save_checkpointables(ckdir / "c", {"model": {"w": torch.ones(2)}, "extra": {"step": 5}})
    out = zerostall.load_checkpointables(ckdir / "c")
    assert set(out) == {"model", "extra"} and out["extra"] == {"step": 5}
    only = zerostall.load_checkpointables(ckdir / "c", {"extra": None})
    assert list(only) == ["extra"]
    with pytest.raises(MissingKeyError):
        zerostall.load_checkpointables(ckdir / "c", {"nope": None})


def test_stateful_module_optimizer_scheduler_round_trip(ckdir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    zerostall.save_pytree(ckdir / "c", {"model": model, "opt": opt, "sched": sched})

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)  # fresh: no state yet
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    w_ptr = model2[0].weight.data_ptr()
    zerostall.load_pytree(ckdir / "c", {"model": model2, "opt": opt2, "sched": sched2})
    assert model2[0].weight.data_ptr() == w_ptr  # in place
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for k in s1["state"]:
        for n in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][n], s2["state"][k][n])
    assert s1["param_groups"] == s2["param_groups"]
    assert sched.state_dict() == sched2.state_dict()
    # the restored run continues identically
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_rng_states_round_trip(ckdir):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    rng = np.random.default_rng(4)
    state = {"py": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state(),
             "np_gen": rng.bit_generator.state}
    expect = (random.random(), np.random.rand(), torch.rand(1).item(), rng.random())
    zerostall.save_pytree(ckdir / "c", state)
    out = zerostall.load_pytree(ckdir / "c")
    random.setstate(out["py"])
    np.random.set_state(out["np"])
    torch.set_rng_state(out["torch"])
    rng2 = np.random.default_rng()
    rng2.bit_generator.state = out["np_gen"]
    assert (random.random(), np.random.rand(), torch.rand(1).item(), rng2.random()) == expect


def test_unsupported_leaf_error_at_save(ckdir):
    with pytest.raises(zerostall.errors.UnsupportedLeafError) as ei:
        zerostall.save_pytree(ckdir / "c", {"ok": 1, "bad": object()})
    assert ei.value.key == "pytree/bad"
    assert not os.path.exists(ckdir / "c")


def test_handlers_round_trip(ckdir):
    import datetime

    zerostall.register_handler(datetime.date, name="date", encode=lambda d: d.isoformat(),
                               decode=datetime.date.fromisoformat)
    zerostall.register_handler(complex, name="cplx", format="bytes",
                               encode=lambda c: np.array([c.real, c.imag]).tobytes(),
                               decode=lambda b: complex(*np.frombuffer(b)))
    try:
        zerostall.save_pytree(ckdir / "c", {"d": datetime.date(2024, 5, 6), "c": 1.5 - 2j})
        out = zerostall.load_pytree(ckdir / "c")
        assert out == {"d": datetime.date(2024, 5, 6), "c": 1.5 - 2j}
    finally:
        zerostall.unregister_handler(datetime.date)
    with pytest.raises(zerostall.errors.UnsupportedFormatError, match="register"):
        zerostall.load_pytree(ckdir / "c")
    zerostall.unregister_handler(complex)


def test_memory_backend_with_thread_writer():
    zerostall.save_pytree("memory://unit/c1", {"a": torch.arange(3)}, options=THREAD)
    assert torch.equal(zerostall.load_pytree("memory://unit/c1")["a"], torch.arange(3))


class TestCheckpointer:
    def test_steps_latest_retention(self, ckdir):
        with Checkpointer(ckdir, keep_last=2, keep_every_n_steps=4) as ck:
            for step in range(1, 9):
                ck.save_pytree_async(step, {"w": torch.full((3,), float(step)), "step": step})
            ck.wait()
            assert ck.latest_step() == 8
            assert ck.steps() == [4, 7, 8]
            out = ck.load_pytree(template={"w": torch.zeros(3), "step": 0})
            assert out["step"] == 8 and torch.equal(out["w"], torch.full((3,), 8.0))
            assert ck.load_pytree(4)["step"] == 4
            assert len(ck.stats()) == 8 and all(s.persist_s is not None for s in ck.stats())

    def test_prepare_allocates_before_the_first_save(self, ckdir):
        state = {"w": torch.randn(1000), "step": 0}
        with Checkpointer(ckdir) as ck:
            nbytes = ck.prepare(tree=state)
            assert nbytes >= 4000
            slot = ck._engine.pool._all[0]
            buffers = list(slot.buffers)
            ck.save_pytree(1, state)
            assert slot.buffers == buffers  # the first save reused them
            assert torch.equal(ck.load_pytree(1)["w"], state["w"])
            with pytest.raises(ValueError):
                ck.prepare()

    def test_should_save(self, ckdir):
        with Checkpointer(ckdir, save_interval_steps=5) as ck:
            assert [s for s in range(12) if ck.should_save(s)] == [0, 5, 10]

    def test_no_checkpoint_yet(self, ckdir):
        with Checkpointer(ckdir) as ck:
            assert ck.latest_step() is None and ck.steps() == []
            with pytest.raises(CheckpointNotFoundError):
                ck.load_pytree()

    def test_hidden_partial_dirs_are_not_steps(self, ckdir):
        (ckdir / ".step_00000009.zs-tmp-abc").mkdir()
        (ckdir / "step_00000010").mkdir()  # no manifest: not committed
        with Checkpointer(ckdir) as ck:
            assert ck.steps() == []

    def test_checkpointables_and_metadata(self, ckdir):
        with Checkpointer(ckdir) as ck:
            ck.save_checkpointables(1, {"a": {"x": 1}, "b": [torch.ones(1)]}, metadata={"note": "hi"})
            out = ck.load_checkpointables(items={"a": None})
            assert out == {"a": {"x": 1}}
        import json
        man = json.loads((ckdir / "step_00000001" / "manifest.json").read_text())
        assert man["metadata"] == {"note": "hi", "step": 1}

    def test_bad_arguments(self, ckdir):
        with pytest.raises(ValueError):
            Checkpointer(ckdir, keep_last=0)
        with Checkpointer(ckdir) as ck, pytest.raises(ValueError):
            ck.save_pytree(-1, {})


def test_response_telemetry_and_info_log(ckdir, caplog):
    import logging

    state = {"w": torch.randn(256, 1024)}
    with caplog.at_level(logging.INFO, logger="zerostall"):
        r = zerostall.save_pytree_async(ckdir / "c", state)
        before = r.stats
        assert before.stall_s > 0 and before.nbytes >= 1 << 20 and before.staging_gbps > 0
        stats = r.result()
    assert r.done()
    assert stats.persist_s is not None and stats.persist_s > 0
    assert stats.persist_gbps is not None and stats.persist_gbps > 0
    assert stats.commit_s is not None and stats.commit_s >= 0
    assert stats.writer_peak_rss is not None and stats.writer_peak_rss > 0
    assert stats.stall_s == before.stall_s and stats.path.endswith("/c")
    assert any("saved" in rec.getMessage() and "stall" in rec.getMessage() for rec in caplog.records)


def test_background_error_keeps_its_type(ckdir, monkeypatch):
    """A failure in the writer comes back from result() with the same class and errno."""
    import errno
    import json

    monkeypatch.setenv("ZEROSTALL_FAULTS", json.dumps({"write": "raise:ENOSPC"}))
    r = zerostall.save_pytree_async(ckdir / "c", {"w": torch.ones(4)}, options=THREAD)
    with pytest.raises(zerostall.errors.StorageError) as ei:
        r.result()
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOSPC
    assert str(ckdir / "c") in str(ei.value)
    assert not os.path.exists(ckdir / "c")
    assert not [n for n in os.listdir(ckdir) if "zs-tmp" in n]  # the attempt was cleaned up
    monkeypatch.delenv("ZEROSTALL_FAULTS")
    zerostall.save_pytree(ckdir / "c", {"w": torch.ones(4)}, options=THREAD)


def test_uncommitted_directory_in_the_way_is_named_as_such(ckdir):
    (ckdir / "c").mkdir()
    with pytest.raises(CheckpointExistsError, match="not a committed checkpoint"):
        zerostall.save_pytree(ckdir / "c", {"a": 1})
    zerostall.save_pytree(ckdir / "d", {"a": 1})
    with pytest.raises(CheckpointExistsError, match="already exists"):
        zerostall.save_pytree(ckdir / "d", {"a": 1})


def test_runs_of_small_leaves_load_in_every_mode_and_corruption_is_named(ckdir):
    """Many small neighbouring leaves (one run of a data file) load exactly in every mode (a
    verified local load checksums and copies such runs through a mapping of the page cache, not by
    scatter reads); a flipped byte in one of them is still caught and named."""
    import json

    state = {f"t{i}": torch.arange(i, i + 37, dtype=torch.float32) for i in range(60)}  # 148-byte leaves
    zerostall.save_pytree(ckdir / "c", state)
    for opts in (zerostall.LoadOptions(atomic=False), zerostall.LoadOptions(atomic=True),
                 zerostall.LoadOptions(verify=False)):
        tmpl = {k: torch.zeros(37) for k in state}
        zerostall.load_pytree(ckdir / "c", tmpl, options=opts)
        assert all(torch.equal(tmpl[k], state[k]) for k in state), opts
    man = json.loads((ckdir / "c" / "manifest.json").read_text())
    leaf = next(lf for lf in man["leaves"] if lf["key"] == "pytree/t41")
    data = ckdir / "c" / man["files"][0]["path"]
    raw = bytearray(data.read_bytes())
    raw[leaf["offset"] + 5] ^= 1
    data.write_bytes(bytes(raw))
    for atomic in (False, True):
        with pytest.raises(zerostall.errors.ChecksumMismatchError) as ei:
            zerostall.load_pytree(ckdir / "c", {k: torch.zeros(37) for k in state},
                                  options=zerostall.LoadOptions(atomic=atomic))
        assert ei.value.key == "pytree/t41"


class TestResponseHooks:
    """Bookkeeping hooks (Checkpointer.stats, the engine's in-flight set) run exactly once, even
    when the save finished before the hook was added (a small save can commit before
    ``save_*_async`` has returned to the code that adds it)."""

    STATS = WriterStats(nbytes=8, write_s=0.1, commit_s=0.01, persist_s=0.2, writer_peak_rss=1)

    def test_hook_added_before_finish_runs_once_before_result(self):
        r = zerostall.Response("/p", 8, 1.0)
        seen: list = []
        r._add_before_done(lambda resp, exc: seen.append((resp.done(), exc)))
        r._finish(self.STATS, None)
        r._finish(self.STATS, None)  # a second finish (e.g. a dead writer's late report) is ignored
        assert seen == [(False, None)]  # it ran before the future completed
        assert r.result().persist_s == 0.2

    def test_hook_added_after_finish_runs_at_once(self):
        r = zerostall.Response("/p", 8, 1.0)
        err = OSError(5, "boom")
        r._finish(None, err)
        seen: list = []
        r._add_before_done(lambda resp, exc: seen.append(exc))
        assert seen == [err]

    def test_checkpointer_records_a_save_that_finished_first(self, ckdir):
        with Checkpointer(ckdir) as ck:
            ck.save_pytree_async(1, {"w": torch.ones(2)}).result()
            r2 = zerostall.Response("/x", 8, 1.0)
            r2._finish(self.STATS, None)
            r2._add_before_done(ck._record)
            assert len(ck.stats()) == 2 and ck.stats()[-1].persist_s == 0.2
