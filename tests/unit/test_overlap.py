"""Overlapped staging: optimizer-owned tensors are copied after the save returns, and the guard
orders every optimizer step after that copy, so no snapshot is torn.

To make "the step runs while the copy is in flight" certain rather than likely, a test holds the
engine's copier thread behind a gate (a queued callable waiting on an event) and opens it from
a timer: the save returns with its copy not started, the step is called at once, and only the
guard can keep it from changing the parameters first.
"""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import TornSnapshotError
from zerostall.options import Staging
from zerostall.stage.overlap import GUARD

THREAD = SaveOptions(writer=WriterKind.THREAD)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def _forward_backward(model: torch.nn.Module) -> torch.Tensor:
    loss = model(torch.randn(16, 32)).square().mean()
    loss.backward()
    return loss


def _snapshot(obj: object) -> object:
    return copy.deepcopy(obj)


def _equal(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where  # type: ignore[arg-type]
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}")  # type: ignore[index]
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b)):  # type: ignore[call-overload]
            _equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def _gate(ckpt: Checkpointer, delay: float = 0.15) -> threading.Timer:
    """Hold the copier until ``delay`` seconds from now; the next overlapped copy waits for it."""
    opened = threading.Event()
    ckpt._engine._copier._put(lambda: opened.wait(10))
    timer = threading.Timer(delay, opened.set)
    timer.start()
    return timer


class _Case:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.model = _model()
        params = list(self.model.parameters())
        self.scaler = None
        if kind == "sgd":
            self.opts = [torch.optim.SGD(params, lr=0.1, momentum=0.9)]
        elif kind == "adamw_foreach":
            self.opts = [torch.optim.AdamW(params, lr=1e-2, foreach=True)]
        elif kind == "adamw_fused":
            self.opts = [torch.optim.AdamW(params, lr=1e-2, fused=True)]
        elif kind == "two_optimizers":
            self.opts = [torch.optim.SGD(params[:2], lr=0.1, momentum=0.9),
                         torch.optim.AdamW(params[2:], lr=1e-2, foreach=False)]
        elif kind == "grad_scaler":
            self.opts = [torch.optim.AdamW(params, lr=1e-2)]
            self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
        else:  # pragma: no cover
            raise ValueError(kind)

    def step(self) -> None:
        for o in self.opts:
            o.zero_grad()
        if self.scaler is not None:
            self.scaler.scale(self.model(torch.randn(16, 32)).square().mean()).backward()
            for o in self.opts:
                self.scaler.step(o)
            self.scaler.update()
            return
        _forward_backward(self.model)  # BatchNorm statistics change here, outside step()
        for o in self.opts:
            o.step()

    def tree(self) -> dict[str, object]:
        t: dict[str, object] = {"model": self.model, "optim": list(self.opts)}
        if self.scaler is not None:
            t["scaler"] = self.scaler
        return t

    def state(self) -> dict[str, object]:
        s: dict[str, object] = {"model": self.model.state_dict(), "optim": [o.state_dict() for o in self.opts]}
        if self.scaler is not None:
            s["scaler"] = self.scaler.state_dict()
        return s


@pytest.mark.parametrize("kind", ["sgd", "adamw_foreach", "adamw_fused", "two_optimizers", "grad_scaler"])
def test_step_right_after_the_save_never_tears_it(ckdir, kind):
    case = _Case(kind)
    case.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        for step in range(4):
            expected = _snapshot(case.state())
            if step % 2 == 0:
                _gate(ckpt)
            r = ckpt.save_pytree_async(step, case.tree())
            if step % 2 == 0:
                assert not r.staged()  # the parameters are still being copied
            for _ in range(3):
                case.step()  # the first one waits for the copy (guard), later ones are free
            r.result()
            loaded = ckpt.load_pytree(step)
            _equal(expected["model"], loaded["model"], "model")
            assert len(loaded["optim"]) == len(case.opts)
            for exp, got in zip(expected["optim"], loaded["optim"]):
                _equal(exp["state"], {int(k): v for k, v in got["state"].items()}, "optim")
            if case.scaler is not None:
                _equal(expected["scaler"], loaded["scaler"], "scaler")
    assert not GUARD.installed


def test_without_the_guard_the_step_would_have_won(ckdir):
    """The control: staging must actually be overlapped here, or the test above proves nothing."""
    case = _Case("sgd")
    case.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        _gate(ckpt)
        r = ckpt.save_pytree_async(0, case.tree())
        assert not r.staged() and GUARD.in_flight == 1
        r.wait_staged()
        assert r.staged()
        r.result()


def test_buffers_and_non_optimizer_tensors_are_copied_before_return(ckdir):
    case = _Case("adamw_foreach")
    case.step()
    extra = torch.arange(10.0)
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        bn = case.model[1]
        mean_before = bn.running_mean.clone()
        _gate(ckpt)
        r = ckpt.save_pytree_async(0, {**case.tree(), "extra": extra})
        # Not owned by any optimizer: staged already, so these in-place changes are safe.
        _forward_backward(case.model)
        extra.add_(1)
        assert not torch.equal(bn.running_mean, mean_before)
        r.result()
        loaded = ckpt.load_pytree(0)
        assert torch.equal(loaded["model"]["1.running_mean"], mean_before)
        assert torch.equal(loaded["extra"], torch.arange(10.0))


def test_in_place_change_outside_step_fails_the_save_naming_the_leaf(ckdir):
    case = _Case("sgd")
    case.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        _gate(ckpt)
        r = ckpt.save_pytree_async(7, case.tree())
        with torch.no_grad():
            case.model[0].weight.clamp_(-0.01, 0.01)  # weight clipping without wait_staged()
        with pytest.raises(TornSnapshotError, match="wait_staged") as info:
            r.result()
        assert info.value.key == "pytree/model/0.weight"
        assert isinstance(info.value, RuntimeError)
        assert ckpt.steps() == []  # never committed
        # The next save goes through.
        ckpt.save_pytree(8, case.tree())
        assert ckpt.steps() == [8]


def test_wait_staged_makes_in_place_changes_safe(ckdir):
    case = _Case("sgd")
    case.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        expected = _snapshot(case.model.state_dict())
        _gate(ckpt, delay=0.05)
        r = ckpt.save_pytree_async(0, case.tree())
        r.wait_staged()
        with torch.no_grad():
            case.model[0].weight.clamp_(-0.01, 0.01)
        r.result()
        _equal(expected, ckpt.load_pytree(0)["model"])


def test_a_swapped_parameter_does_not_leak_into_the_snapshot(ckdir):
    case = _Case("sgd")
    case.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        expected = case.model[0].weight.detach().clone()
        _gate(ckpt)
        r = ckpt.save_pytree_async(0, {"w": case.model[0].weight, "optim": case.opts[0]})
        case.model[0].weight.data = torch.full_like(expected, 5.0)  # the old storage may be freed
        gc.collect()
        r.result()
        assert torch.equal(ckpt.load_pytree(0)["w"], expected)


def test_optimizer_outside_the_saved_tree_is_guarded_once_seen(ckdir):
    case = _Case("adamw_foreach")
    case.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        for step in range(3):
            expected = _snapshot(case.model.state_dict())
            _gate(ckpt)
            r = ckpt.save_pytree_async(step, {"model": case.model})  # the optimizer is not saved
            # The first save cannot know the optimizer; it sees it step and overlaps from then on.
            assert r.staged() == (step == 0)
            case.step()
            r.result()
            _equal(expected, ckpt.load_pytree(step)["model"], f"step {step}")
            assert r.stats.staged_s is not None


def test_an_optimizer_owning_nothing_in_flight_does_not_wait(ckdir):
    case = _Case("sgd")
    case.step()
    other = torch.nn.Parameter(torch.ones(3))
    other_opt = torch.optim.SGD([other], lr=0.1)
    other.grad = torch.ones(3)
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        opened = threading.Event()
        ckpt._engine._copier._put(lambda: opened.wait(10))
        r = ckpt.save_pytree_async(0, case.tree())
        other_opt.step()  # would deadlock here (the gate opens only below) if it waited
        assert not r.staged()
        opened.set()
        r.result()


def test_blocking_staging_copies_everything_before_return(ckdir):
    assert SaveOptions(staging="blocking").staging is Staging.BLOCKING
    assert SaveOptions().staging is Staging.OVERLAP
    with pytest.raises(ValueError, match="staging"):
        SaveOptions(staging="lazy")
    case = _Case("sgd")
    case.step()
    opts = SaveOptions(writer=WriterKind.THREAD, staging="blocking")
    with Checkpointer(ckdir, save_options=opts) as ckpt:
        expected = _snapshot(case.model.state_dict())
        _gate(ckpt)
        r = ckpt.save_pytree_async(0, case.tree())
        assert r.staged() and GUARD.in_flight == 0
        with torch.no_grad():
            case.model[0].weight.zero_()  # allowed at once with blocking staging
        r.result()
        _equal(expected, ckpt.load_pytree(0)["model"])


def test_hooks_and_references_do_not_grow_over_300_saves():
    # The bounds are absolute (one hook, one live tensor): a leak of one per save fails within the first saves.
    case = _Case("sgd")
    case.step()
    hooks_before = len(_global_optimizer_pre_hooks)
    with Checkpointer("memory://overlap-leak", save_options=THREAD, keep_last=1) as ckpt:
        dead = []
        for step in range(300):
            scratch = torch.nn.Parameter(torch.randn(4))
            opt = torch.optim.SGD([scratch], lr=0.1)
            dead.append(weakref.ref(scratch))
            r = ckpt.save_pytree_async(step, {"model": case.model, "optim": case.opts[0],
                                              "scratch": scratch, "scratch_opt": opt})
            case.opts[0].step()
            assert len(_global_optimizer_pre_hooks) <= hooks_before + 1
            del scratch, opt
            if step % 100 == 99:
                r.result()
        ckpt.wait()
        assert GUARD.in_flight == 0
        gc.collect()
        assert sum(ref() is not None for ref in dead) <= 1  # nothing keeps the saved tensors alive
    assert len(_global_optimizer_pre_hooks) == hooks_before
    assert not GUARD.installed


def test_compiled_step_runs_the_guard(ckdir):
    case = _Case("adamw_foreach")
    case.step()
    opt = case.opts[0]

    @torch.compile(backend="eager")
    def compiled_step() -> None:
        opt.step()

    compiled_step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        for step in range(2):
            expected = _snapshot(case.model.state_dict())
            _gate(ckpt)
            r = ckpt.save_pytree_async(step, case.tree())
            _forward_backward(case.model)
            compiled_step()
            r.result()
            got = ckpt.load_pytree(step)["model"]
            for k in ("0.weight", "3.bias"):
                assert torch.equal(got[k], expected[k])


def test_step_compiled_by_inductor_runs_the_guard_eagerly(ckdir):
    """The default backend: the hook runs eagerly, never traced by Dynamo. Traced, it would see fake
    tensors whose version counters read 0, so every overlapped save with a compiled step would fail
    as torn, and the hook's copy and wait would not run at run time."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    case = _Case("adamw_foreach")
    opt = case.opts[0]

    @torch.compile
    def compiled_step() -> None:
        opt.step()

    _forward_backward(case.model)
    compiled_step()  # compiled before any hook exists, as in a real job
    opt.zero_grad()
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        for step in range(4):
            expected = _snapshot(case.state())
            if step % 2 == 0:
                _gate(ckpt)  # the copy is still in flight when the compiled step runs
            r = ckpt.save_pytree_async(step, {"model": case.model, "optim": opt})
            _forward_backward(case.model)
            compiled_step()
            opt.zero_grad()
            r.result()
            got = ckpt.load_pytree(step)
            _equal(expected["model"], got["model"], "model")  # type: ignore[index]
            _equal(expected["optim"][0]["state"], got["optim"]["state"], "optim")  # type: ignore[index]
    # the hook comes and goes with each save: a graph break, not a recompilation per save
    assert dynamo_utils.counters["stats"]["unique_graphs"] - graphs <= 2


@pytest.mark.parametrize("kind", ["adamw", "sgd_positional", "lbfgs"])
def test_step_with_a_closure_orders_after_the_closure(ckdir, kind):
    """Lightning's automatic optimization passes forward and backward to step() as a closure: the
    guard orders the update after the closure's first call, so the copy overlaps that work too."""
    model = _model()
    if kind == "lbfgs":
        opt: torch.optim.Optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    elif kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    copied_at_closure_start: list[bool] = []

    def closure() -> torch.Tensor:
        with GUARD._lock:
            tasks = list(GUARD._tasks)
        copied_at_closure_start.append(all(t.cpu_done.is_set() for t in tasks))
        opt.zero_grad()
        return _forward_backward(model)

    def step() -> None:
        if kind == "sgd_positional":
            opt.step(closure)
        else:
            opt.step(closure=closure)

    step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        for n in range(3):
            expected = _snapshot({"model": model.state_dict(), "optim": opt.state_dict()})
            _gate(ckpt, delay=0.3)  # the copier is held: only the guard could have copied
            copied_at_closure_start.clear()
            r = ckpt.save_pytree_async(n, {"model": model, "optim": opt})
            step()
            step()
            assert copied_at_closure_start[0] is False  # the first closure ran beside the copy
            r.result()
            got = ckpt.load_pytree(n)
            _equal(expected["model"], got["model"], "model")  # type: ignore[index]
            _equal(expected["optim"]["state"], got["optim"]["state"], "optim")  # type: ignore[index]


def test_capturable_optimizer_is_copied_before_return(ckdir):
    """capturable=True means the step may be replayed from a CUDA graph: no hook, no version bump."""
    model = _model()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    graphed = torch.optim.AdamW(_model().parameters(), lr=1e-2, capturable=True)
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        _gate(ckpt, delay=0.3)
        r = ckpt.save_pytree_async(0, {"model": model, "optim": plain})
        assert not r._staged.is_set()  # overlapped: the held copier has not copied it
        r.result()
        g_model = graphed.param_groups[0]["params"]
        _gate(ckpt, delay=0.3)
        r = ckpt.save_pytree_async(1, {"params": g_model, "optim": graphed})
        assert r._staged.is_set()  # everything copied before the call returned
        r.result()


def test_free_function_and_process_writer(tmp_path):
    case = _Case("adamw_foreach")
    case.step()
    expected = _snapshot(case.state())
    r = zerostall.save_pytree_async(tmp_path / "ck", case.tree())
    case.step()
    r.result()
    loaded = zerostall.load_pytree(tmp_path / "ck")
    _equal(expected["model"], loaded["model"])


class _StandInEvent:
    """Stands in for ``torch.cuda.Event`` (no CUDA here): completes when the test says so."""

    def __init__(self) -> None:
        self.complete = threading.Event()

    def synchronize(self) -> None:
        self.complete.wait(10)


class _StandInStream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def _cuda_task(t: torch.Tensor):
    from zerostall.stage.overlap import OverlapTask, _CudaPart

    event = _StandInEvent()
    from zerostall.stage.ownership import Spans, span

    spans = Spans()
    spans.add(span(t))
    task = OverlapTask("mem://x", spans=spans)  # an owner judged by memory
    task.cuda.append(_CudaPart("cuda:0", event, [("w", t, t.untyped_storage(), t._version)]))
    task.cpu_done.set()  # as build_task does when nothing is copied by the host
    task.synced.set()
    outcome: list[BaseException | None] = []
    task.on_staged = outcome.append
    return task, event, outcome


def _stand_in_cuda_step(monkeypatch):
    """A stand-in current stream, and an SGD step ready to run over one parameter."""
    stream = _StandInStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.5)
    w.grad = torch.ones(4)
    return stream, w, opt


@pytest.mark.parametrize("scenario", ["step_first", "mutated_then_step", "mutated_no_step"])
def test_cuda_guard_orders_the_step_on_the_stream_without_blocking_the_host(monkeypatch, scenario):
    """The CUDA branch of the guard with stand-ins for the stream and event (the logic only)."""
    from zerostall.stage.overlap import GUARD, _run_task

    stream, w, opt = _stand_in_cuda_step(monkeypatch)
    task, event, outcome = _cuda_task(w.detach())
    GUARD.add(task)
    copier = threading.Thread(target=_run_task, args=(task,))
    copier.start()
    try:
        if scenario != "step_first":
            with torch.no_grad():
                w.mul_(3)  # outside step(), before the copy is done
        if scenario != "mutated_no_step":
            opt.step()  # returns although the copy's event has not completed: nothing blocks
            assert stream.waited == [event] and not event.complete.is_set()
            opt.step()  # sealed: not waited again
            assert stream.waited == [event]
    finally:
        event.complete.set()
        copier.join(10)
        GUARD.tidy()
    assert len(outcome) == 1
    if scenario == "step_first":
        assert outcome[0] is None  # the step's own changes are ordered after the copy
    else:
        assert isinstance(outcome[0], TornSnapshotError) and outcome[0].key == "w"
    assert not GUARD.installed


@pytest.mark.parametrize("outcome_kind", ["enqueued", "enqueue_failed"])
def test_cuda_guard_waits_for_the_background_enqueue_then_orders_the_step(monkeypatch, outcome_kind):
    """The copies of a CUDA part are enqueued by a background thread (``CUDA_ENQUEUE_THREAD``): a
    step that comes first waits on the host until they are, then orders itself after their event;
    an enqueue that failed fails the save and blocks nothing."""
    from zerostall.stage.overlap import _ENQUEUER, GUARD, _run_task

    stream, w, opt = _stand_in_cuda_step(monkeypatch)
    task, _, outcome = _cuda_task(w.detach())
    part = task.cuda[0]
    part.enqueued.clear()  # as build_task leaves it for the enqueuer
    part.event = None
    event = _StandInEvent()
    event.complete.set()
    release = threading.Event()
    order: list[str] = []

    def enqueue() -> None:
        release.wait(10)
        order.append("enqueued")
        if outcome_kind == "enqueued":
            part.event = event
        else:
            part.failure = RuntimeError("CUDA error: an illegal memory access was encountered")
        part.enqueued.set()

    GUARD.add(task)
    _ENQUEUER.put(enqueue)
    copier = threading.Thread(target=_run_task, args=(task,))
    copier.start()
    stepper = threading.Thread(target=lambda: (opt.step(), order.append("stepped")))
    try:
        stepper.start()
        stepper.join(0.3)
        assert stepper.is_alive() and order == []  # the step waits for the enqueue, on the host
        release.set()
        stepper.join(10)
        assert order == ["enqueued", "stepped"]
        assert stream.waited == ([event] if outcome_kind == "enqueued" else [])
    finally:
        release.set()
        copier.join(10)
        GUARD.tidy()
    assert len(outcome) == 1
    if outcome_kind == "enqueued":
        assert outcome[0] is None
    else:
        assert isinstance(outcome[0], RuntimeError) and "illegal memory access" in str(outcome[0])
    assert not GUARD.installed


def test_enqueuer_runs_every_save_in_order_on_one_thread():
    """Saves' CUDA copies are enqueued in submission order (a later save's copies must not overtake
    an earlier one's on the side stream), all on one daemon thread."""
    from zerostall.stage.overlap import _Enqueuer

    enq = _Enqueuer()
    seen: list[tuple[int, int]] = []
    done = threading.Event()
    for i in range(200):
        enq.put(lambda i=i: seen.append((i, threading.get_ident())))
    enq.put(done.set)
    assert done.wait(10)
    assert [i for i, _ in seen] == list(range(200))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
    assert enq._thread is not None and enq._thread.daemon


def test_enqueuer_survives_a_raising_item_and_logs_it(caplog):
    """An item that raises is logged, and the thread goes on with the next save's copies."""
    from zerostall.stage.overlap import _Enqueuer

    enq = _Enqueuer()
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("driver said no")

    with caplog.at_level("ERROR", logger="zerostall"):
        enq.put(boom)
        enq.put(done.set)
        assert done.wait(10)
    assert any("CUDA copy enqueue failed" in r.getMessage() for r in caplog.records)


def test_enqueue_copies_records_a_failure_instead_of_raising():
    """``_enqueue_copies`` on a thread must never die with the part left unenqueued (the guard
    would wait forever): any error becomes the part's failure."""
    from zerostall.stage.overlap import _CudaPart, _enqueue_copies

    class Broken:
        def wait_event(self, event: object) -> None:
            raise RuntimeError("stream is gone")

    part = _CudaPart("cuda:0", None, [("w", torch.ones(2), None, 0)], enqueued=threading.Event())
    _enqueue_copies(part, Broken(), object(), [torch.empty(2)])
    assert part.enqueued.is_set() and part.event is None
    with pytest.raises(RuntimeError, match="stream is gone"):
        part.wait_enqueued()


def test_which_leaves_are_deferred():
    from zerostall.stage.ownership import deferrable
    from zerostall.tree import flatten

    case = _Case("sgd")
    case.opts[0].param_groups[0]["lr"] = torch.tensor(0.01)  # changed by schedulers, not by step()
    case.step()
    items = {"pytree": {**case.tree(), "extra": torch.ones(3)}}
    flat = flatten(items)
    split = deferrable(items, flat.leaves)
    assert split is not None
    deferred = {leaf.key for leaf, d in zip(flat.leaves, split[0]) if d}
    assert split[1] == case.opts
    assert "pytree/model/0.weight" in deferred and "pytree/model/3.bias" in deferred
    assert any(k.endswith("/momentum_buffer") for k in deferred)
    assert not any("running_" in k or "num_batches" in k for k in deferred)  # BatchNorm buffers
    assert not any("param_groups" in k for k in deferred)  # the tensor lr
    assert "pytree/extra" not in deferred


def test_spans_containment_and_overlap():
    from zerostall.stage.ownership import Spans

    s = Spans()
    for lo, hi, tag in [(100, 200, 1), (0, 1000, 2), (300, 400, 3)]:
        s.add((False, lo, hi), tag)
    assert s.containing((False, 120, 180)) == 1 and s.containing((False, 500, 600)) == 2
    assert s.containing((False, 900, 1001)) is None and s.containing((True, 120, 180)) is None
    assert s.overlaps((False, 500, 600)) and s.overlaps((False, 999, 2000))
    assert not s.overlaps((False, 1000, 1100)) and not s.overlaps((True, 0, 10))


def test_an_unreceived_torn_save_is_raised_by_the_next_save(ckdir):
    from zerostall.errors import BackgroundSaveError

    case = _Case("sgd")
    case.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        _gate(ckpt, delay=0.05)
        r = ckpt.save_pytree_async(1, case.tree())
        with torch.no_grad():
            case.model[0].weight.add_(1)
        r.wait_staged()
        while not r.done():  # without receiving its outcome
            time.sleep(0.01)
        with pytest.raises(BackgroundSaveError) as info:
            ckpt.save_pytree(2, case.tree())
        assert isinstance(info.value.__cause__, TornSnapshotError)
        assert ckpt.steps() == []


def _cpu_task(tensors: list[torch.Tensor]):
    """A task over CPU tensors as ``build_task`` makes it (not submitted: no background thread)."""
    from zerostall.stage import overlap
    from zerostall.tree import flatten

    flat = flatten({"t": {str(i): t for i, t in enumerate(tensors)}})
    dsts = [torch.empty_like(t) for t in tensors]
    task = overlap.build_task("mem://x", flat.leaves, dsts, [True] * len(tensors))
    outcome: list[BaseException | None] = []
    task.on_staged = outcome.append
    return task, dsts, outcome


def test_the_guard_copies_what_the_background_has_not_started(monkeypatch):
    """A step before the background reached the copy: the training thread copies it itself
    (never waits on a background thread that did not get a core), and the background, once
    there, copies nothing."""
    from zerostall.stage import overlap

    monkeypatch.setattr(overlap, "CHUNK", 1 << 16)  # several pieces per tensor
    src = [torch.arange(100_000, dtype=torch.float32) + i for i in range(3)]
    task, dsts, outcome = _cpu_task(src)
    assert task.pieces is not None and task.pieces.left > 3
    task.order_step()  # the guard, on this thread
    assert task.cpu_done.is_set() and task.pieces.left == 0 and task.error is None
    for d, s in zip(dsts, src):
        assert torch.equal(d, s)
    for s in src:
        s.zero_()  # the step's own changes, after the copy
    assert task.pieces.work() == 0  # nothing left for the copier to claim
    overlap._run_task(task)  # the copier reaching it later
    assert outcome == [None]
    assert all(torch.equal(d, torch.arange(100_000, dtype=torch.float32) + i) for i, d in enumerate(dsts))


def test_a_change_before_the_guard_finished_the_copy_fails_the_save():
    src = [torch.ones(1000), torch.ones(1000)]
    task, _, outcome = _cpu_task(src)
    with torch.no_grad():
        src[1].add_(1)  # in place, outside step(), before any copy
    task.order_step()
    assert isinstance(task.error, TornSnapshotError) and task.error.key == "t/1"
    from zerostall.stage.overlap import _run_task

    _run_task(task)
    assert isinstance(outcome[0], TornSnapshotError)


def test_guard_and_copier_share_the_pieces(monkeypatch):
    """Both threads claim pieces of one copy; each piece is copied once, every byte lands."""
    from zerostall.stage import overlap

    monkeypatch.setattr(overlap, "CHUNK", 1 << 12)
    src = [torch.randn(1 << 18) for _ in range(4)]
    task, dsts, outcome = _cpu_task(src)
    copier = overlap.Copier("zerostall-test-copier")
    copier._put(task)
    task.order_step()
    copier.drain(10)
    assert outcome == [None]
    for d, s in zip(dsts, src):
        assert torch.equal(d, s)


def test_wait_staged_copies_on_the_waiting_thread(ckdir):
    """wait_staged() does not leave the copy to a background thread alone: with the copier held
    back, the waiting thread copies every piece, and the snapshot is the state at the call."""
    case = _Case("sgd")
    case.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        expected = _snapshot(case.model.state_dict())
        opened = threading.Event()
        ckpt._engine._copier._put(lambda: opened.wait(10))
        r = ckpt.save_pytree_async(0, case.tree())
        assert r._help_stage is not None
        assert r._help_stage() > 0 and not r.staged()  # copied here; the hand-off waits for the copier
        opened.set()
        r.wait_staged()
        with torch.no_grad():
            case.model[0].weight.clamp_(-0.01, 0.01)
        r.result()
        _equal(expected, ckpt.load_pytree(0)["model"])


def test_a_change_after_the_copy_but_before_any_sync_fails_the_save(ckdir):
    """The copy is judged again by the thread that may modify the tensors, at its next sync point
    (here ``result()``): an in-place change made without ``wait_staged()`` fails the save even
    when the copy had already finished, so a change racing the copy (its version bump lands after
    the copier's own check) can never commit a mix silently."""
    case = _Case("sgd")
    case.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        r = ckpt.save_pytree_async(0, case.tree())
        task = next(t for t in GUARD._tasks)
        assert task.cpu_done.wait(10)  # every byte copied, and the copier's check passed
        with torch.no_grad():
            case.model[0].weight.add_(1.0)  # no wait_staged(): the pattern the docs forbid
        with pytest.raises(TornSnapshotError) as ei:
            r.result()
        assert ei.value.key is not None and "0.weight" in ei.value.key
        assert 0 not in ckpt.steps()


def test_changes_right_after_the_call_never_commit_a_mix(ckdir):
    """A user's race: ``add_`` on a saved parameter right after the call, twenty times. Every
    save fails with TornSnapshotError; none commits."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256, 256))
    opt = torch.optim.AdamW([w], lr=1e-3)
    w.grad = torch.randn_like(w)
    opt.step()
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        for step in range(20):
            r = ckpt.save_pytree_async(step, {"w": w, "optim": opt})
            with torch.no_grad():
                w.add_(1.0)
            with pytest.raises(TornSnapshotError):
                r.result()
        assert ckpt.steps() == []


def test_a_save_nobody_syncs_with_is_judged_and_committed_by_the_copier(ckdir, monkeypatch):
    """No step, no wait: after ``SYNC_GRACE_S`` the copier judges the copy itself and hands it on."""
    from zerostall.stage import overlap

    monkeypatch.setattr(overlap, "SYNC_GRACE_S", 0.2)
    case = _Case("sgd")
    case.step()
    expected = _snapshot(case.model.state_dict())
    with Checkpointer(ckdir, save_options=THREAD) as ckpt:
        r = ckpt.save_pytree_async(0, case.tree())
        deadline = time.monotonic() + 20
        while not r._future.done() and time.monotonic() < deadline:  # not done(): it would sync
            time.sleep(0.05)
        assert r._future.done()
        r.result()
        _equal(expected, ckpt.load_pytree(0)["model"])
