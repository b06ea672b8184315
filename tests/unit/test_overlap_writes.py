"""Writes to optimizer-owned tensors outside ``step()`` while an overlapped copy is in flight.

Every committed checkpoint holds the state at the call; a write that cannot be ordered after the
copy fails the save with ``TornSnapshotError`` and nothing is committed. ``t.data`` hands out an
alias with a version counter of its own, so a write through it cannot be detected: zerostall
orders the ``.data`` access after the copy instead (docs/guarantees.md, "Overlapped staging").

Deterministic: the engine's copier thread is held behind a gate that opens only after the write
and the next step, so nothing is copied in the background before the write. Without the
ordering the step's guard would copy the written bytes (the state after the write); a race
between the copier and the write makes it a mix of the two.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import TornSnapshotError
from zerostall.stage.overlap import GUARD

THREAD = SaveOptions(writer=WriterKind.THREAD)
OPTIMIZERS = ["sgd", "adamw_foreach", "adamw_fused"]


class _Case:
    def __init__(self, kind: str) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        params = list(self.model.parameters())
        if kind == "sgd":
            self.opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        elif kind == "adamw_foreach":
            self.opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
        else:
            self.opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
        self.step()

    def backward(self) -> None:
        self.opt.zero_grad()
        self.model(torch.randn(16, 32)).square().mean().backward()

    def step(self) -> None:
        self.backward()
        self.opt.step()

    def tree(self) -> dict[str, object]:
        return {"model": self.model, "optim": self.opt}

    def state(self) -> dict[str, object]:
        return copy.deepcopy({"model": self.model.state_dict(), "optim": self.opt.state_dict()["state"]})


def _assert_holds(ckpt: Checkpointer, step: int, expected: dict[str, object]) -> None:
    loaded = ckpt.load_pytree(step)
    model = expected["model"]
    assert isinstance(model, dict)
    assert set(loaded["model"]) == set(model)
    for k, v in model.items():
        assert torch.equal(loaded["model"][k], v), f"model/{k} is not the state at the call"
    state = expected["optim"]
    assert isinstance(state, dict)
    for i, st in state.items():
        got = loaded["optim"]["state"][str(i)] if str(i) in loaded["optim"]["state"] else loaded["optim"]["state"][i]
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(got[name]), torch.as_tensor(v)), f"optim/{i}/{name} is not the state at the call"


@contextlib.contextmanager
def _copier_held(ckpt: Checkpointer) -> Iterator[None]:
    """Nothing is copied in the background inside this block (the copier thread waits for it to end)."""
    opened = threading.Event()
    ckpt._engine._copier._put(lambda: opened.wait(60))
    try:
        yield
    finally:
        opened.set()


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)[: t.numel() // 2]


# Each write changes every parameter (or the optimizer's state) outside step(), right after the call.
# "call": the save commits the state at the call; "torn": it fails with TornSnapshotError.
WRITES: dict[str, tuple[Callable[[_Case], None], str]] = {
    "data_mul_": (lambda c: [p.data.mul_(0.5) for p in c.model.parameters()] and None, "call"),
    "data_copy_": (lambda c: [p.data.copy_(torch.full_like(p, 0.25)) for p in c.model.parameters()] and None, "call"),
    "data_clamp_": (lambda c: [p.data.clamp_(-0.01, 0.01) for p in c.model.parameters()] and None, "call"),
    "data_setitem": (lambda c: [p.data.__setitem__(0, 7.0) for p in c.model.parameters()] and None, "call"),
    # a view of the .data alias, and the .data alias of a view of the parameter
    "view_of_data": (lambda c: [_half(p.data).mul_(0.5) for p in c.model.parameters()] and None, "call"),
    "data_of_view": (lambda c: [_half(p.detach()).data.mul_(0.5) for p in c.model.parameters()] and None, "call"),
    # the optimizer's own state, through .data
    "state_data": (lambda c: [t.data.zero_() for st in c.opt.state.values() for t in st.values()
                              if t.dim() > 0] and None, "call"),
    # counted writes (the version counter moves): detected, the save fails loudly
    "no_grad_mul_": (lambda c: _no_grad(lambda: [p.mul_(0.5) for p in c.model.parameters()]), "torn"),
    "no_grad_view": (lambda c: _no_grad(lambda: [_half(p).mul_(0.5) for p in c.model.parameters()]), "torn"),
    "set_": (lambda c: _no_grad(lambda: [p.set_(p.detach() * 0.5) for p in c.model.parameters()]), "torn"),
    "detach_add_": (lambda c: [p.detach().add_(1.0) for p in c.model.parameters()] and None, "torn"),
    "load_state_dict": (lambda c: c.model.load_state_dict({k: v * 0.5 for k, v in c.model.state_dict().items()})
                        and None, "torn"),
}


def _no_grad(fn: Callable[[], object]) -> None:
    with torch.no_grad():
        fn()


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_outside_step_never_commits_a_mix(ckdir, write, kind):
    case = _Case(kind)
    fn, outcome = WRITES[write]
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        expected = case.state()
        with _copier_held(ckpt):
            r = ckpt.save_pytree_async(0, case.tree())
            assert GUARD.in_flight == 1  # the parameters and the optimizer state are copied after the call
            fn(case)
            case.step()
        if outcome == "torn":
            with pytest.raises(TornSnapshotError, match="wait_staged") as info:
                r.result()
            assert info.value.key is not None and info.value.key.startswith("pytree/")
            assert ckpt.steps() == []  # never committed
        else:
            r.result()
            _assert_holds(ckpt, 0, expected)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_clip_grad_norm_changes_only_gradients_and_needs_nothing(ckdir, kind):
    case = _Case(kind)
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        expected = case.state()
        with _copier_held(ckpt):
            r = ckpt.save_pytree_async(0, case.tree())
            case.backward()
            torch.nn.utils.clip_grad_norm_(case.model.parameters(), 1e-3)
            assert not r.staged()  # the gradients are not saved: clipping them orders nothing
            case.opt.step()
        r.result()
        _assert_holds(ckpt, 0, expected)


def test_data_writes_racing_40_overlapped_saves_commit_only_the_state_at_each_call(ckdir):
    """Linear(512, 512) with AdamW, 40 overlapped saves, each followed by ``p.data.mul_(0.5)`` and a step,
    with the copier free to race the write."""
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train() -> None:
        opt.zero_grad()
        model(torch.randn(64, 512)).square().mean().backward()
        opt.step()

    train()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        for step in range(40):
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            r = ckpt.save_pytree_async(step, {"model": model, "optim": opt})
            for p in model.parameters():
                p.data.mul_(0.5)
            train()
            r.result()
            loaded = ckpt.load_pytree(step)["model"]
            assert all(torch.equal(loaded[k], v) for k, v in expected.items()), f"step {step} is not the state at the call"


def test_a_data_write_from_another_thread_is_ordered_too(ckdir):
    case = _Case("adamw_foreach")
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        expected = case.state()
        with _copier_held(ckpt):
            r = ckpt.save_pytree_async(0, case.tree())
            other = threading.Thread(target=lambda: [p.data.mul_(0.5) for p in case.model.parameters()])
            other.start()
            other.join()
            case.step()
        r.result()
        _assert_holds(ckpt, 0, expected)


def test_data_is_intercepted_only_while_a_copy_is_in_flight(ckdir):
    case = _Case("sgd")
    unrelated = torch.ones(8)
    assert "data" not in torch.Tensor.__dict__
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        with _copier_held(ckpt):
            r = ckpt.save_pytree_async(0, case.tree())
            assert "data" in torch.Tensor.__dict__
            unrelated.data.add_(1)  # shares no memory with the copy: nothing is ordered
            case.model[0].weight.data = torch.zeros_like(case.model[0].weight)  # the setter works; orders nothing
            assert not r.staged()
            assert GUARD.in_flight == 1
        r.result()
        assert "data" not in torch.Tensor.__dict__  # torch's own descriptor again once the copy is done
        ckpt.save_pytree(1, case.tree())
        assert "data" not in torch.Tensor.__dict__
    assert torch.equal(unrelated, torch.full((8,), 2.0))


def test_zerostalls_own_threads_are_not_ordered_by_a_data_access(ckdir):
    """A ``.data`` access on the copier thread must not copy (or wait for) the copies that thread runs."""
    case = _Case("sgd")
    seen: list[int] = []
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        copier = ckpt._engine._copier
        opened, probed = threading.Event(), threading.Event()

        def probe() -> None:  # runs on the copier thread, before the save's own copy
            opened.wait(60)
            task = next(iter(GUARD._tasks))
            assert task.pieces is not None
            _ = case.model[0].weight.data
            seen.append(task.pieces.left)
            probed.set()

        copier._put(probe)
        r = ckpt.save_pytree_async(0, case.tree())
        opened.set()
        # result() helps the copy on this thread: only once the probe has looked at what is left
        assert probed.wait(60)
        r.result()
    assert seen and seen[0] > 0  # the access left every piece to the copy


def test_a_data_write_in_a_compiled_function_is_detected(ckdir):
    """Dynamo traces ``.data`` as a graph operation (the interception never runs there); with an
    AOT backend (inductor, the default, or aot_eager) the compiled code applies the write to the
    parameter with a counted ``copy_``, so the save fails loudly."""
    case = _Case("sgd")

    @torch.compile(backend="aot_eager")
    def shrink(model: torch.nn.Module) -> None:
        for p in model.parameters():
            p.data.mul_(0.5)

    shrink(case.model)  # compiled before the save, as in a real job
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        with _copier_held(ckpt):
            r = ckpt.save_pytree_async(0, case.tree())
            shrink(case.model)
            case.step()
        with pytest.raises(TornSnapshotError):
            r.result()
        assert ckpt.steps() == []


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_a_data_write_inside_a_step_closure_is_ordered(ckdir, kind):
    """A torch optimizer's step is ordered after its closure (the closure runs beside the copy), so a
    write through ``.data`` inside the closure (Lightning's ``on_before_optimizer_step``) is ordered
    by the ``.data`` access itself."""
    case = _Case(kind)

    def closure() -> torch.Tensor:
        case.opt.zero_grad()
        loss = case.model(torch.randn(16, 32)).square().mean()
        loss.backward()
        for p in case.model.parameters():
            p.data.clamp_(-0.01, 0.01)
        return loss

    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        expected = case.state()
        with _copier_held(ckpt):
            r = ckpt.save_pytree_async(0, case.tree())
            case.opt.step(closure)
        r.result()
        _assert_holds(ckpt, 0, expected)
