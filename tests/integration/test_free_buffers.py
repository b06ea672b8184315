"""The free functions' staging buffers: reused across calls per layout, bounded, released on demand,
and made ready ahead of the first save by ``zerostall.prepare`` (real writer processes)."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import zerostall
from zerostall import api
from zerostall.errors import ArgumentTypeError, BackgroundSaveError
from zerostall.options import SaveOptions
from zerostall.stage import BufferPool, make_plan
from zerostall.tree import flatten


@pytest.fixture(autouse=True)
def _fresh_engines():
    """Each test starts and ends with no shared engine and the default cache bound."""
    limit = api._cache_bytes
    api.release_buffers()
    yield
    api.release_buffers()
    api.set_buffer_cache_limit(limit)


def _state(n: int, size: int = 4096) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((size,), float(i)) for i in range(n)}


def _buffer_ids() -> set[int]:
    pool = api._engines[SaveOptions()].pool
    ids = {b.id for s in pool._all for b in s.buffers}
    return ids | {b.id for p in pool._parked.values() for b in p.buffers}


def test_same_layout_reuses_the_buffers_across_calls(tmp_path):
    state = _state(3)
    zerostall.save_pytree(tmp_path / "a", state)
    pool = api._engines[SaveOptions()].pool
    allocated, ids = pool.allocations, _buffer_ids()
    for i in range(3):
        state["w0"].add_(1)
        zerostall.save_pytree(tmp_path / f"b{i}", state)
    assert pool.allocations == allocated and _buffer_ids() == ids
    assert torch.equal(zerostall.load_pytree(tmp_path / "b2")["w0"], state["w0"])


def test_alternating_layouts_each_keep_their_buffers(tmp_path):
    small, large = _state(2), _state(5)
    zerostall.save_pytree(tmp_path / "s0", small)
    zerostall.save_pytree(tmp_path / "l0", large)
    pool = api._engines[SaveOptions()].pool
    allocated = pool.allocations
    assert pool.parked_layouts() == 1  # the small layout's set waits for its next save
    zerostall.save_pytree(tmp_path / "s1", small)
    views = {id(v) for s in pool._all for v in [s.views]} | {id(p.views) for p in pool._parked.values()}
    for i in range(2, 4):
        zerostall.save_pytree(tmp_path / f"l{i}", large)
        zerostall.save_pytree(tmp_path / f"s{i}", small)
    assert pool.allocations == allocated  # no allocation after the first save of each layout
    # each layout kept its typed views (and headers): nothing was re-planned into the buffers
    assert views == {id(s.views) for s in pool._all} | {id(p.views) for p in pool._parked.values()}
    out = zerostall.load_pytree(tmp_path / "s3")
    assert set(out) == set(small) and all(torch.equal(out[k], small[k]) for k in small)
    out = zerostall.load_pytree(tmp_path / "l3")
    assert all(torch.equal(out[k], large[k]) for k in large)


def test_the_cache_bound_evicts_least_recently_used_layouts(tmp_path):
    layouts = [_state(n, 64 << 10) for n in (1, 2, 3)]  # 256 KiB, 512 KiB, 768 KiB of data
    one = sum(t.numel() * 4 for t in layouts[2].values())
    api.set_buffer_cache_limit(2 * one)  # room for about two of them
    for i, s in enumerate(layouts):
        zerostall.save_pytree(tmp_path / f"x{i}", s)
    pool = api._engines[SaveOptions()].pool
    assert pool.held_bytes() <= 2 * one
    assert pool.parked_layouts() == 1  # the oldest layout was evicted, the middle one kept
    allocated = pool.allocations
    zerostall.save_pytree(tmp_path / "again1", layouts[1])  # kept: no allocation
    assert pool.allocations == allocated
    zerostall.save_pytree(tmp_path / "again0", layouts[0])  # evicted: allocates (or reuses a spare)
    assert pool.held_bytes() <= 2 * one
    out = zerostall.load_pytree(tmp_path / "again0")
    assert torch.equal(out["w0"], layouts[0]["w0"])


def test_bound_zero_keeps_only_the_buffers_in_use(tmp_path):
    api.set_buffer_cache_limit(0)
    zerostall.save_pytree(tmp_path / "a", _state(4))
    zerostall.save_pytree(tmp_path / "b", _state(6))
    pool = api._engines[SaveOptions()].pool
    assert pool.parked_layouts() == 0
    assert pool.held_bytes() == sum(b.size for s in pool._all for b in s.buffers)


def test_release_buffers_frees_them_and_stops_the_writer(tmp_path):
    state = _state(3)
    zerostall.save_pytree(tmp_path / "a", state)
    zerostall.save_pytree(tmp_path / "b", _state(5))
    eng = api._engines[SaveOptions()]
    held = eng.pool.held_bytes()
    pid = eng.writer.pid
    assert held > 0 and pid is not None
    assert zerostall.release_buffers() == held
    assert eng.closed and eng.pool.held_bytes() == 0 and not eng.writer.alive()
    assert SaveOptions() not in api._engines
    assert zerostall.release_buffers() == 0  # nothing left
    zerostall.save_pytree(tmp_path / "c", state)  # a fresh engine
    assert api._engines[SaveOptions()] is not eng
    assert torch.equal(zerostall.load_pytree(tmp_path / "c")["w2"], state["w2"])


def test_release_buffers_raises_an_unreceived_background_failure(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"x")  # the writer's mkdir under it fails with ENOTDIR
    r = zerostall.save_pytree_async(blocker / "ckpt", _state(1))
    r._wait()  # finished, its error not received
    with pytest.raises(BackgroundSaveError) as ei:
        zerostall.release_buffers()
    assert str(blocker / "ckpt") in (ei.value.path or "")
    assert not api._engines
    assert zerostall.release_buffers() == 0  # reported once


def test_prepare_allocates_then_the_first_save_only_copies(tmp_path):
    state = _state(4)
    nbytes = zerostall.prepare(state)
    eng = api._engines[SaveOptions()]
    assert nbytes == eng.pool.held_bytes() > 0
    assert eng.writer.alive()
    allocated = eng.pool.allocations
    zerostall.save_pytree(tmp_path / "a", state)
    assert eng.pool.allocations == allocated
    out = zerostall.load_pytree(tmp_path / "a")
    assert all(torch.equal(out[k], state[k]) for k in state)


_FIRST_SAVE = """
import sys, torch, zerostall
state = {"w": torch.ones(4096)}
assert "torch._dynamo" not in sys.modules, "imported already: nothing to check"
zerostall.prepare(state)
before = set(sys.modules)
zerostall.save_pytree_async(sys.argv[1], state).result()
print("NEW", sorted(m for m in set(sys.modules) - before if m.startswith("torch._dynamo")))
"""


def test_prepare_leaves_the_first_save_no_dynamo_import(tmp_path):
    """prepare() and then the first save of plain tensors, with no optimizer in the process: no
    torch._dynamo import on the training thread (see the test below)."""
    out = subprocess.run([sys.executable, "-c", _FIRST_SAVE, str(tmp_path / "a")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "NEW []" in out.stdout, out.stdout


_OPTIMIZER_AFTER_THE_FIRST_SAVE = """
import sys, threading, torch, zerostall
model = torch.nn.Linear(256, 256)
assert "torch._dynamo" not in sys.modules, "imported already: nothing to check"
with zerostall.Checkpointer(sys.argv[1], save_options=zerostall.SaveOptions(writer="thread")) as ck:
    ck.save_pytree(0, {"model": model.state_dict()})  # no optimizer exists yet
    print("DYNAMO_AFTER_FIRST_SAVE", "torch._dynamo" in sys.modules)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        opt.zero_grad()
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()

    step()
    staged = []
    for s in (1, 2):
        opened = threading.Event()
        ck._engine._copier._put(lambda: opened.wait(10))  # hold the copier: an overlapped copy waits
        r = ck.save_pytree_async(s, {"model": model.state_dict()})  # the optimizer is not in the tree
        staged.append(r.staged())
        threading.Timer(0.2, opened.set).start()
        step()
        r.result()
    print("STAGED_AT_RETURN", staged)
"""


def test_the_first_save_before_any_optimizer_imports_no_dynamo(tmp_path):
    """Learning which optimizer steps needs the step hook, whose Dynamo wrapper imports
    torch._dynamo (1.2-1.6 s on this VM): with no optimizer in the process yet there is nothing
    to learn, so a first save of plain tensors does not pay it; an optimizer made afterwards is
    learned at the next save, and the one after overlaps its copy with the step."""
    out = subprocess.run([sys.executable, "-c", _OPTIMIZER_AFTER_THE_FIRST_SAVE, str(tmp_path / "ck")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "DYNAMO_AFTER_FIRST_SAVE False" in out.stdout, out.stdout
    assert "STAGED_AT_RETURN [True, False]" in out.stdout, out.stdout  # learned at save 1, overlapped at 2


def test_prepare_items_and_options(tmp_path):
    opts = SaveOptions(max_in_flight=2)
    items = {"model": _state(2), "extra": {"np": np.arange(10)}}
    nbytes = zerostall.prepare(items=items, options=opts)
    pool = api._engines[opts].pool
    assert nbytes == pool.held_bytes() and all(s.buffers for s in pool._all)  # both slots
    allocated = pool.allocations
    zerostall.save_checkpointables(tmp_path / "a", items, options=opts)
    zerostall.save_checkpointables(tmp_path / "b", items, options=opts)
    assert pool.allocations == allocated
    out = zerostall.load_checkpointables(tmp_path / "b")
    assert np.array_equal(out["extra"]["np"], items["extra"]["np"])
    with pytest.raises(ValueError):
        zerostall.prepare()
    with pytest.raises(ValueError):
        zerostall.prepare(state := _state(1), items={"a": state})


def test_prepare_with_items_that_are_not_a_dict_names_the_argument(tmp_path):
    # A list for items would fail deep inside as "cannot convert dictionary update sequence":
    # it is refused by argument name, as is an options that is not a SaveOptions.
    with pytest.raises(ArgumentTypeError, match="items must be a dict") as info:
        zerostall.prepare(items=[torch.ones(2)])  # type: ignore[arg-type]
    assert info.value.argument == "items"
    with pytest.raises(ArgumentTypeError, match="options must be a SaveOptions"):
        zerostall.prepare({"w": torch.ones(2)}, options={"max_in_flight": 2})  # type: ignore[arg-type]
    with zerostall.Checkpointer(tmp_path / "run") as ckpt, pytest.raises(ArgumentTypeError, match="items must be a dict"):
        ckpt.prepare([torch.ones(2)])  # type: ignore[arg-type]


def test_pool_without_cache_replaces_buffers_like_before():
    """cache_bytes=0 (the Checkpointer's pools): a larger layout frees the old set first."""
    freed = []
    pool = BufferPool(1, on_free=freed.append)
    slot = pool.acquire()
    a = make_plan(flatten({"p": _state(1)}))
    b = make_plan(flatten({"p": _state(3)}))
    assert pool.fit(slot, [f.alloc for f in a.files], signature=a.signature)
    old = slot.buffers[0]
    assert pool.fit(slot, [f.alloc for f in b.files], signature=b.signature)
    assert freed == [old] and pool.parked_layouts() == 0
    assert not pool.fit(slot, [f.alloc for f in a.files], signature=a.signature)  # fits: reused
    pool.close()
