"""zerostall.arraytypes: one registration is everything a new array type needs (save, overlapped
staging, load into a template), and torch and numpy are array types like any other."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import zerostall
from zerostall import Checkpointer, SaveOptions, Staging, WriterKind
from zerostall.arraytypes import (
    ArrayLeaf,
    ArrayType,
    array_type_of,
    background_sources,
    reader_of,
    register_array_type,
    unregister_array_type,
)
from zerostall.errors import UnsupportedLeafError
from zerostall.tree import NUMPY, TORCH

THREAD = SaveOptions(writer=WriterKind.THREAD)


class Frame:
    """A tiny array class: immutable float32 values (nothing changes them once made)."""

    def __init__(self, values: Any) -> None:
        self.data = np.array(values, dtype=np.float32)


class FrameCopy:
    """The leaf value a Frame stages from: it copies itself, and says on which thread."""

    threads: ClassVar[list[str]] = []

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.held = False

    def hold(self) -> None:
        self.held = True

    def copy_into(self, dst: Any, crc: int | None = None) -> int | None:
        FrameCopy.threads.append(threading.current_thread().name + (" (held)" if self.held else ""))
        np.copyto(dst, self.frame.data)
        return None  # the writer checksums it


def _flatten(frame: Frame, key: str, leaves: list[ArrayLeaf]) -> dict[str, Any]:
    shape = tuple(frame.data.shape)
    leaves.append(ArrayLeaf(key, "numpy", "F32", shape, frame.data.nbytes, FrameCopy(frame)))
    return {"type": "array", "leaf": len(leaves) - 1}


def _read(planner: Any, node: dict[str, Any], tmpl: Frame, key: str) -> Any:
    fill = planner.into_ndarray(node, tmpl.data, key)  # into the template's own memory
    if fill is None:
        return None

    def done() -> Frame:
        fill()
        return tmpl
    return done


FRAME = ArrayType(name="test.Frame", matches=lambda t: issubclass(t, Frame), flatten=_flatten, read=_read,
                  source=FrameCopy)


@pytest.fixture
def frames() -> Iterator[None]:
    register_array_type(FRAME)
    FrameCopy.threads = []
    try:
        yield
    finally:
        unregister_array_type(FRAME.name)


def test_one_registration_saves_stages_in_the_background_and_loads_back_in_place(tmp_path: Path,
                                                                                   frames: None) -> None:
    state = {"f": Frame(np.arange(6).reshape(2, 3)), "w": torch.ones(3), "step": 4}
    with Checkpointer(tmp_path / "run", save_options=THREAD) as ck:
        r = ck.save_pytree_async(1, state)
        r.result()
        assert FrameCopy.threads == ["zerostall-copier (held)"]  # held in the call, copied in the background
        tmpl = {"f": Frame(np.zeros((2, 3))), "w": torch.zeros(3), "step": 0}
        before = tmpl["f"].data
        out = ck.load_pytree(1, tmpl)
    assert out["f"] is tmpl["f"] and out["f"].data is before  # loaded in place
    np.testing.assert_array_equal(before, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert torch.equal(out["w"], torch.ones(3)) and out["step"] == 4
    # without a template: what the leaf's kind rebuilds, a numpy array
    np.testing.assert_array_equal(zerostall.load_pytree(tmp_path / "run" / "step_00000001")["f"],
                                  np.arange(6, dtype=np.float32).reshape(2, 3))


def test_blocking_staging_copies_an_array_type_s_source_on_the_calling_thread(tmp_path: Path, frames: None) -> None:
    opts = SaveOptions(writer=WriterKind.THREAD, staging=Staging.BLOCKING)
    zerostall.save_pytree(tmp_path / "c", {"f": Frame([1.5, 2.5])}, options=opts)
    assert FrameCopy.threads == [threading.current_thread().name]
    np.testing.assert_array_equal(zerostall.load_pytree(tmp_path / "c")["f"], [1.5, 2.5])


def test_an_unregistered_type_is_refused_and_its_registration_is_looked_up_once_per_class(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedLeafError):
        zerostall.save_pytree(tmp_path / "a", {"f": Frame([1.0])}, options=THREAD)
    register_array_type(FRAME)
    try:
        assert array_type_of(Frame) is FRAME and reader_of(Frame) is FRAME and FrameCopy in background_sources()
        zerostall.save_pytree(tmp_path / "b", {"f": Frame([1.0])}, options=THREAD)
    finally:
        unregister_array_type(FRAME.name)
    assert array_type_of(Frame) is None and FrameCopy not in background_sources()


def test_torch_and_numpy_are_registered_array_types() -> None:
    assert array_type_of(torch.Tensor) is TORCH and array_type_of(torch.nn.Parameter) is TORCH
    assert reader_of(torch.Tensor) is TORCH
    assert array_type_of(np.ndarray) is NUMPY and array_type_of(np.float32) is NUMPY and reader_of(np.ndarray) is NUMPY
    assert array_type_of(dict) is None and array_type_of(int) is None


def test_a_later_registration_for_a_class_wins_and_leaves_the_rest_to_the_earlier_one(tmp_path: Path) -> None:
    """A type that refines another (a DTensor is a torch.Tensor) takes over flattening; without a
    ``read`` of its own, its templates are still read by the type it refines."""

    class Marked(torch.Tensor):
        pass

    seen: list[str] = []

    def flatten(t: Any, key: str, leaves: list[ArrayLeaf]) -> dict[str, Any]:
        seen.append(key)
        return TORCH.flatten(t.as_subclass(torch.Tensor), key, leaves)

    register_array_type(ArrayType(name="test.Marked", matches=lambda t: issubclass(t, Marked), flatten=flatten))
    try:
        assert reader_of(Marked) is TORCH
        t = torch.arange(4.0).as_subclass(Marked)
        zerostall.save_pytree(tmp_path / "c", {"m": t}, options=THREAD)
        assert seen == ["pytree/m"]
        into = torch.zeros(4).as_subclass(Marked)
        out = zerostall.load_pytree(tmp_path / "c", {"m": into})
        assert out["m"] is into and torch.equal(into.as_subclass(torch.Tensor), torch.arange(4.0))
    finally:
        unregister_array_type("test.Marked")
    assert array_type_of(Marked) is TORCH


def test_an_integration_loads_once_at_the_first_flatten_after_its_trigger_is_imported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from zerostall.arraytypes import add_trigger
    from zerostall.tree import flatten, register_lazy_integration

    calls: list[str] = []
    add_trigger("zs_test_trigger", lambda: calls.append("entry"))
    with pytest.warns(DeprecationWarning, match="entry point"):
        register_lazy_integration("zs_test_trigger", lambda: calls.append("lazy"))
    flatten({"x": 1})
    assert calls == []
    monkeypatch.setitem(sys.modules, "zs_test_trigger", types.ModuleType("zs_test_trigger"))
    flatten({"x": 1})
    flatten({"x": 1})
    assert calls == ["entry", "lazy"]


def test_the_jax_integration_is_declared_as_an_entry_point_of_the_installed_package() -> None:
    from importlib.metadata import entry_points

    from zerostall.arraytypes import ENTRY_POINT_GROUP

    assert {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)} == {"jax": "zerostall.integrations.jax"}


def test_a_jax_leaf_without_its_integration_names_the_module_to_import() -> None:
    from zerostall.tree import flatten

    fake = type("ArrayImpl", (), {"__module__": "jaxlib.fake"})
    with pytest.raises(UnsupportedLeafError, match="import zerostall.integrations.jax"):
        flatten({"x": fake()})


_DTENSOR_ONCE = """
import socket, sys, torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import zerostall
from zerostall.arraytypes import reader_of
from zerostall.distributed import dtensor as d  # registers DTensor: one array type
mesh = init_device_mesh("cpu", (1,))
x = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
one = reader_of(type(x))
assert one is not None and one.name == "torch.distributed.tensor.DTensor" and one.matches is d.is_dtensor_type
with zerostall.Checkpointer(sys.argv[1]) as ck:
    ck.save_pytree(1, {"x": x})
    ck.save_pytree(2, {"x": x})
    into = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    out = ck.load_pytree(2, {"x": into})
assert out["x"] is into and torch.equal(into.to_local(), torch.arange(12.0).reshape(4, 3))
dist.destroy_process_group()
print("loaded")
"""


def test_a_dtensor_needs_one_registration_too(tmp_path: Path) -> None:
    """``distributed.dtensor`` makes one registration: its flatten saves the local shard with its box,
    its read gives a template its own box (``ReadPlanner.into_tensor(box=)``); a sharded DTensor
    saves and loads back in place through it."""
    import os
    import subprocess
    import sys

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    res = subprocess.run([sys.executable, "-c", _DTENSOR_ONCE, str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=src))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("loaded")
