"""A save of an unchanged layout reuses the previous save's work (zerostall.stage.reuse): it writes
the checkpoint a full save writes, and every kind of change takes the full path and is saved."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import UnknownLayoutError

THREAD = SaveOptions(writer=WriterKind.THREAD)
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src")


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _reuse(ck: Checkpointer) -> Any:
    return ck._engine._layouts


def _files(step_dir: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(step_dir):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                data = f.read()
            if n == "manifest.json":
                doc = json.loads(data)
                doc.pop("created_unix")
                data = json.dumps(doc, sort_keys=True).encode()
            out[os.path.relpath(p, step_dir)] = data
    return out


def _expect_saved(ck: Checkpointer, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                  extra: dict[str, Any]) -> None:
    """The checkpoint of ``step`` holds the model's and optimizer's state as they are now."""
    got = ck.load_pytree(step)
    want_model = model.state_dict()
    assert list(got["model"]) == list(want_model)
    for k, v in want_model.items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k
    want_opt = opt.state_dict()
    assert got["optim"]["param_groups"] == want_opt["param_groups"]
    assert sorted(got["optim"]["state"]) == sorted(want_opt["state"])
    for pid, st in want_opt["state"].items():
        assert sorted(got["optim"]["state"][pid]) == sorted(st), pid
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][pid][k], v), (pid, k)
    for k, v in extra.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def test_cached_save_writes_the_same_checkpoint_as_a_full_save(tmp_path):
    model, opt = _trained()
    tree = {"model": model, "optim": opt, "step": 1, "note": "x"}
    with Checkpointer(tmp_path / "cached", save_options=THREAD) as ck:
        ck.save_pytree(1, tree)
        _step(model, opt)
        tree["step"] = 2
        ck.save_pytree(2, tree)
        assert _reuse(ck).hits == 1
    with Checkpointer(tmp_path / "full", save_options=THREAD) as ck:
        ck.save_pytree(2, tree)
        assert _reuse(ck).hits == 0
    cached, full = _files(str(tmp_path / "cached" / "step_00000002")), _files(str(tmp_path / "full" / "step_00000002"))
    assert cached.keys() == full.keys() and len(cached) == 2
    for name in cached:
        assert cached[name] == full[name], name


def _new_parameter(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    model.extra = torch.nn.Parameter(torch.randn(5))
    opt.add_param_group({"params": [model.extra]})
    _step(model, opt)


def _data_swap(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    model[0].weight.data = torch.randn_like(model[0].weight)


def _data_swap_new_shape(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    model[2].bias.data = torch.randn(3)


def _new_dtype(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    model[1].weight.data = model[1].weight.data.double()


def _resized_state(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    st = opt.state[model[1].bias]
    st["exp_avg"].resize_(3).fill_(0.25)  # shrunk in place: the same data pointer


def _new_state_key(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    opt.state[model[0].bias]["extra"] = torch.full((2,), 7.0)


def _strided_in_place(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    t = opt.state[model[2].weight]["exp_avg"]  # 8x8: same pointer, shape and dtype, transposed strides
    t.copy_(torch.arange(64.0).reshape(8, 8))
    t.as_strided_((8, 8), (1, 8))


def _scalar_became_tensor(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    tree["step"] = torch.tensor([7])


def _changed_scalars(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    opt.param_groups[0]["lr"] = 0.5
    tree["step"] = 7
    tree["note"] = "changed"


def _trained_in_place(model: torch.nn.Module, opt: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    _step(model, opt)


CHANGES: dict[str, tuple[Callable[..., None], bool, bool]] = {
    # name: (change, whether the save after it reuses the layout, and the deferral)
    "new parameter": (_new_parameter, False, False),
    ".data swap": (_data_swap, True, False),
    ".data swap to another shape": (_data_swap_new_shape, False, False),
    "another dtype": (_new_dtype, False, False),
    "resized state tensor": (_resized_state, False, False),
    "new optimizer state key": (_new_state_key, False, False),
    "strides changed in place": (_strided_in_place, True, False),
    "scalar became a tensor": (_scalar_became_tensor, False, False),
    "changed scalars": (_changed_scalars, True, True),
    "values changed in place": (_trained_in_place, True, True),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_each_kind_of_change_is_detected_and_saved(tmp_path, name):
    change, reused, deferral = CHANGES[name]
    model, opt = _trained()
    tree: dict[str, Any] = {"model": model, "optim": opt, "step": 1, "note": "x"}
    with Checkpointer(tmp_path, save_options=THREAD) as ck:
        cache = _reuse(ck)
        ck.save_pytree(1, tree)
        ck.save_pytree(2, tree)  # unchanged: reused
        assert (cache.hits, cache.misses, cache.deferrals_reused) == (1, 1, 1)
        change(model, opt, tree)
        ck.save_pytree(3, tree)
        assert (cache.hits, cache.deferrals_reused) == (1 + reused, 1 + deferral), name
        _expect_saved(ck, 3, model, opt, {"step": tree["step"], "note": tree["note"]})
        ck.save_pytree(4, tree)  # the changed layout (and deferral) is the one kept now
        assert (cache.hits, cache.deferrals_reused) == (2 + reused, 2 + deferral), name
        _expect_saved(ck, 4, model, opt, {"step": tree["step"], "note": tree["note"]})


class _Counting:
    """A Stateful object that counts its ``state_dict()`` calls; ``grow()`` adds a key."""

    def __init__(self) -> None:
        self.calls = 0
        self.state: dict[str, Any] = {"a": torch.arange(3.0), "n": 1}

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return dict(self.state)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state = dict(sd)


def test_a_changed_layout_calls_state_dict_once_per_save(tmp_path):
    obj = _Counting()
    with Checkpointer(tmp_path, save_options=THREAD) as ck:
        ck.save_pytree(1, {"obj": obj})
        ck.save_pytree(2, {"obj": obj})
        obj.state["b"] = torch.ones(2)  # the re-walk finds a new key and the full path takes over
        ck.save_pytree(3, {"obj": obj})
        assert obj.calls == 3
        assert _reuse(ck).hits == 1
        got = ck.load_pytree(3)
        assert torch.equal(got["obj"]["b"], torch.ones(2)) and got["obj"]["n"] == 1


def test_new_tensor_objects_of_the_same_layout_reuse_it(tmp_path):
    model, opt = _trained()
    saved = {}
    with Checkpointer(tmp_path, save_options=THREAD) as ck:
        for step in (1, 2, 3):
            saved[step] = torch.randint(0, 1 << 30, (17,))  # a new tensor at each save, as an RNG state
            ck.save_pytree(step, {"model": model, "optim": opt, "rng": saved[step]})
        assert _reuse(ck).hits == 2
        for step in (2, 3):
            assert torch.equal(ck.load_pytree(step)["rng"], saved[step])


def test_kept_layouts_hold_no_tensor(tmp_path):
    model, opt = _trained()
    probe = weakref.ref(opt.state[model[0].weight]["exp_avg"])
    with Checkpointer(tmp_path, save_options=THREAD) as ck:
        ck.save_pytree(1, {"model": model, "optim": opt})
        ck.save_pytree(2, {"model": model, "optim": opt})
        assert len(_reuse(ck)) == 1
        del model, opt
        gc.collect()
        assert probe() is None  # the engine still keeps the layout, not the tensors


def test_a_handler_registered_between_saves_is_used(tmp_path):
    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

    tree: dict[str, Any] = {"w": torch.ones(2), "p": 3}
    with Checkpointer(tmp_path, save_options=THREAD) as ck:
        ck.save_pytree(1, tree)
        zerostall.register_handler(Point, name="test-reuse-point", encode=lambda p: p.x,
                                   decode=lambda v: Point(v))
        try:
            tree["p"] = Point(5)
            ck.save_pytree(2, tree)
            assert _reuse(ck).hits == 0
            assert ck.load_pytree(2)["p"].x == 5
        finally:
            zerostall.unregister_handler(Point)


def test_free_function_saves_reuse_the_layout(tmp_path):
    model, opt = _trained()
    tree = {"model": model, "optim": opt}
    zerostall.release_buffers()  # a fresh shared engine: its counters start here
    try:
        zerostall.save_pytree(tmp_path / "a", tree, options=THREAD)
        _step(model, opt)
        zerostall.save_pytree(tmp_path / "b", tree, options=THREAD)
        from zerostall.api import _engine

        assert _engine(THREAD)._layouts.hits == 1
        got = zerostall.load_pytree(tmp_path / "b")
        for k, v in model.state_dict().items():
            assert torch.equal(got["model"][k], v), k
    finally:
        zerostall.release_buffers()


def test_a_layout_lends_its_leaves_to_one_save_at_a_time():
    from zerostall.tree import Layout, flatten, registry_generation

    state = {"a": torch.arange(3.0), "b": {"c": torch.ones(2, 2), "n": 4}}
    layout = Layout(flatten({"t": state}), registry_generation())
    walked = layout.rewalk({"t": state}, {})
    assert walked is not None
    first = layout.flat(*walked)
    second = layout.flat(*walked)  # another save while the first holds the leaves: copies
    assert first.leaves is not second.leaves
    assert [leaf.value for leaf in second.leaves] == [state["a"], state["b"]["c"]]
    layout.release(first)
    assert [leaf.value for leaf in first.leaves] == [None, None]  # no tensor kept once released
    assert [leaf.value for leaf in second.leaves] == [state["a"], state["b"]["c"]]
    third = layout.flat(*walked)
    assert third.leaves is first.leaves  # lent again


# -- the writer keeps each layout: saves name it and send only what changed --------------------


def _sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every message this process sends on a writer connection from now on, decoded (the writer
    is a process: the trainer's sends are the only ones here)."""
    out: list[dict[str, Any]] = []
    real = Connection.send_bytes

    def send_bytes(self: Connection, buf: Any, *args: Any) -> None:
        out.append(json.loads(bytes(buf)))
        real(self, buf, *args)

    monkeypatch.setattr(Connection, "send_bytes", send_bytes)
    return out


def _ops(sent: list[dict[str, Any]]) -> list[str]:
    return [m["op"] for m in sent if m["op"] != "map"]


def test_a_save_of_a_known_layout_sends_only_what_changed(tmp_path, monkeypatch):
    model, opt = _trained()
    tree: dict[str, Any] = {"model": model, "optim": opt, "step": 1, "w": torch.arange(6.0)}
    sent = _sent(monkeypatch)
    with Checkpointer(tmp_path / "cached") as ck:
        ck.save_pytree(1, tree)
        layout = next(m for m in sent if m["op"] == "layout")
        assert len(layout["leaves"]) == len(model.state_dict()) + 3 * len(opt.state) + 1  # AdamW: 3 tensors a parameter
        del sent[:]
        _step(model, opt)
        tree["step"] = 2
        ck.save_pytree(2, tree)
    assert _ops(sent) == ["save", "close"]  # the writer holds the layout: not sent again
    job = sent[0]
    assert job["layout"] == layout["id"] and job["leaves"] == []
    assert job["order"] == ["pytree"]
    # only the step count changed: its node and the dict above it are sent, the rest by reference
    tree_node = job["items"]["pytree"]
    assert tree_node["keys"] == ["model", "optim", "step", "w"]
    assert [v["type"] for v in tree_node["values"]] == ["layout-ref", "layout-ref", "int", "array"]
    assert tree_node["values"][2]["value"] == 2
    with Checkpointer(tmp_path / "full", save_options=THREAD) as ck:
        ck.save_pytree(2, tree)
        assert _reuse(ck).hits == 0
    cached, full = _files(str(tmp_path / "cached" / "step_00000002")), _files(str(tmp_path / "full" / "step_00000002"))
    assert cached.keys() == full.keys() and len(cached) == 2
    for name in cached:
        assert cached[name] == full[name], name


def test_a_restarted_writer_is_sent_the_layout_again(tmp_path, monkeypatch):
    tree = {"w": torch.arange(4.0), "b": torch.ones(3)}
    sent = _sent(monkeypatch)
    with Checkpointer(tmp_path) as ck:
        ck.save_pytree(1, tree)
        writer = ck._engine.writer
        first = writer.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        writer._reap()  # its listener sees the end; the next save starts a fresh writer
        del sent[:]
        tree["w"] = torch.arange(4.0) * 2
        ck.save_pytree(2, tree)  # a fresh writer holds no layout: it is sent again, not named blindly
        assert writer.pid not in (None, first)
        assert _ops(sent) == ["layout", "save"]
        assert torch.equal(ck.load_pytree(2)["w"], tree["w"])


def test_a_save_naming_a_layout_its_writer_lacks_is_refused(tmp_path):
    """A writer refuses a job naming a layout it was never sent, with a typed error; nothing is written."""
    from zerostall.messages import FileRow, Hello, LeafLayout, LeafRow, SaveJob, WriteOptions, decode, encode, from_wire

    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, "-m", "zerostall.persist.server", str(child.fileno()), "0"],
                            pass_fds=(child.fileno(),), env=dict(os.environ, PYTHONPATH=SRC))
    child.close()
    conn = Connection(parent.detach())
    rows = (LeafRow(key="t/w", kind="torch", dtype="F32", shape=(0,), file=0, offset=0, nbytes=0),)
    job = SaveJob(id=1, root=str(tmp_path), name="step_00000001", path=f"{tmp_path}/step_00000001",
                  files=(FileRow(name="rank-00000.safetensors", length=0, buffer=1),), leaves=(),
                  items={}, write=WriteOptions(direct_io=False, io_threads=1, chunk_bytes=1 << 20), layout=5,
                  order=("t",))
    try:
        assert isinstance(decode(conn.recv_bytes()), Hello)
        conn.send_bytes(encode(LeafLayout(id=4, leaves=rows, items={"t": {"type": "int", "value": 1}})))
        conn.send_bytes(encode(job))
        failed = decode(conn.recv_bytes())
        assert type(failed).__name__ == "Failed" and failed.job == 1  # type: ignore[union-attr]
        err = from_wire(failed.error)  # type: ignore[union-attr]
        assert isinstance(err, UnknownLayoutError) and "leaf layout 5" in str(err)
        assert err.path == job.path
    finally:
        conn.close()
        proc.wait(timeout=60)
    assert os.listdir(tmp_path) == []
