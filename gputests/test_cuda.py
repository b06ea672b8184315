"""The CUDA paths, on a real GPU: run by ``scripts/gpu-session.sh run`` on a machine with CUDA.

Not part of ``make test`` (CI and the development machine have no GPU; the CPU tests cover the
logic with stand-ins, ``tests/unit/test_overlap.py``). Here nothing is stood in for: pinned
staging buffers, the side stream, the guard's ``wait_event``, fused and foreach optimizers,
GradScaler, a compiled step, loads into CUDA templates.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zerostall
from zerostall.errors import TornSnapshotError
from zerostall.stage.buffers import HostBuffer

#: "cuda" on the GPU machine; ``ZEROSTALL_GPUTEST_DEVICE=cpu`` only dry-runs this file's own logic
DEV = torch.device(os.environ.get("ZEROSTALL_GPUTEST_DEVICE", "cuda"))


def _model(width: int = 1024, depth: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(DEV)


def _iteration(model: torch.nn.Module, opts: list[torch.optim.Optimizer], scaler: Any = None,
               width: int = 1024) -> None:
    x = torch.randn(64, width, device=DEV)
    with torch.autocast(DEV.type, dtype=torch.bfloat16 if scaler is None else torch.float16):
        loss = model(x).float().square().mean()
    if scaler is not None:
        scaler.scale(loss).backward()
        for o in opts:
            scaler.step(o)
        scaler.update()
    else:
        loss.backward()
        for o in opts:
            o.step()
    for o in opts:
        o.zero_grad(set_to_none=True)


def _snapshot(model: torch.nn.Module, opts: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """Every tensor of the state as it is now (cloned on the current stream, before the save)."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, o in enumerate(opts):
        for pid, st in o.state_dict()["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"optim{i}/{pid}/{k}"] = v.detach().clone()
    return out


def _loaded(path: str, kind: str) -> dict[str, torch.Tensor]:
    """Load ``path`` in place into a fresh model and optimizers of ``kind``; their tensors."""
    m2 = _model()
    o2 = OPTIMIZERS[kind](m2.parameters())
    template: dict[str, Any] = {"model": m2, **{f"optim{i}": o for i, o in enumerate(o2)}}
    zerostall.load_pytree(path, template)
    return _snapshot(m2, o2)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if not torch.equal(a[k].cpu(), b[k].cpu())]


def test_round_trip_every_dtype_and_views_bit_for_bit(tmp_path: Path) -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    base = torch.randn(1024, 1024, device=DEV, generator=g)
    state = {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "f8": base.clamp(-100, 100).to(torch.float8_e4m3fn),
        "i64": torch.arange(1 << 20, device=DEV),
        "bool": base > 0,
        "transposed": base.t(),  # not contiguous
        "slice": base[7:300, 3:900],
        "scalar": torch.tensor(3.5, device=DEV),
    }
    path = str(tmp_path / "ck")
    zerostall.save_pytree(path, state)
    as_saved = zerostall.load_pytree(path)
    for k, v in state.items():
        assert torch.equal(as_saved[k].cpu().view(torch.uint8) if v.dtype == torch.float8_e4m3fn else as_saved[k].cpu(),
                           v.cpu().view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v.cpu()), k
    template = {k: torch.empty_like(v) for k, v in state.items()}
    ptrs = {k: t.data_ptr() for k, t in template.items()}
    got = zerostall.load_pytree(path, template)
    for k, v in state.items():
        assert got[k] is template[k] and got[k].data_ptr() == ptrs[k] and got[k].device == v.device, k
        assert torch.equal(got[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else got[k],
                           v.contiguous().view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v), k


def test_staging_buffers_are_page_locked(tmp_path: Path) -> None:
    state = {"w": torch.randn(4 << 20, device=DEV)}
    with zerostall.Checkpointer(str(tmp_path / "run")) as ckpt:
        ckpt.save_pytree_async(1, state).result()
        bufs = [o for o in gc.get_objects() if isinstance(o, HostBuffer)]
        assert bufs and all(b.pinned for b in bufs), [(b.size, b.pinned) for b in bufs]


OPTIMIZERS = {
    "sgd_momentum": lambda p: [torch.optim.SGD(p, lr=1e-3, momentum=0.9)],
    "adamw_foreach": lambda p: [torch.optim.AdamW(p, lr=1e-3, foreach=True)],
    "adamw_fused": lambda p: [torch.optim.AdamW(p, lr=1e-3, fused=True)],
    "two_optimizers": lambda p: (lambda ps: [torch.optim.AdamW(ps[::2], lr=1e-3, fused=True),
                                             torch.optim.SGD(ps[1::2], lr=1e-3, momentum=0.9)])(list(p)),
}


@pytest.mark.parametrize("scaler", [False, True], ids=["bf16", "gradscaler"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_no_torn_save_when_steps_follow_the_call(tmp_path: Path, kind: str, scaler: bool) -> None:
    model = _model()
    opts = OPTIMIZERS[kind](model.parameters())
    gs = torch.amp.GradScaler(DEV.type) if scaler else None
    _iteration(model, opts, gs)  # the optimizer state exists
    torn = []
    with zerostall.Checkpointer(str(tmp_path / "run"), keep_last=2) as ckpt:
        for step in range(1, 11):
            snap = _snapshot(model, opts)
            r = ckpt.save_pytree_async(step, {"model": model, **{f"optim{i}": o for i, o in enumerate(opts)}})
            for _ in range(3):  # no wait: the guard orders these steps after the copy
                _iteration(model, opts, gs)
            r.result()
            bad = _equal(_loaded(r.result().path, kind), snap)
            if bad:
                torn.append((step, bad[:3]))
    assert not torn


def test_in_place_change_outside_step_is_never_committed_torn(tmp_path: Path) -> None:
    w = torch.nn.Parameter(torch.randn(64 << 20, device=DEV))  # 256 MiB: the copy takes a while
    opt = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.ones_like(w)
    opt.step()
    outcomes = []
    with zerostall.Checkpointer(str(tmp_path / "run"), keep_last=1) as ckpt:
        for step in range(1, 6):
            before = w.detach().clone()
            r = ckpt.save_pytree_async(step, {"w": w, "opt": opt})
            with torch.no_grad():
                w.add_(1.0)  # outside step(), no wait_staged(): the pattern the error is for
            try:
                path = r.result().path
            except TornSnapshotError as exc:
                assert "wait_staged" in str(exc)
                outcomes.append("refused")
                continue
            got = zerostall.load_pytree(path)["w"]
            assert torch.equal(got.cpu(), before.cpu()), f"step {step}: a torn checkpoint was committed"
            outcomes.append("clean")
    assert outcomes  # every save either refused or equal to the state at the call


def test_hooks_do_not_grow_over_many_saves(tmp_path: Path) -> None:
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    model = _model(256, 2)
    opts = [torch.optim.AdamW(model.parameters(), fused=True)]
    _iteration(model, opts, width=256)
    with zerostall.Checkpointer(str(tmp_path / "run"), keep_last=1) as ckpt:
        for step in range(1, 201):
            ckpt.save_pytree_async(step, {"model": model, "optim": opts[0]})
            _iteration(model, opts, width=256)
        ckpt.wait()
        _iteration(model, opts, width=256)  # the last save's hook goes at the next step
    assert len(_global_optimizer_pre_hooks) == 0
    assert len(opts[0]._optimizer_step_pre_hooks) == 0


def test_compiled_optimizer_step(tmp_path: Path) -> None:
    model = _model(512, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @torch.compile(fullgraph=False)
    def step() -> None:
        opt.step()

    def it() -> None:
        x = torch.randn(32, 512, device=DEV)
        model(x).square().mean().backward()
        step()
        opt.zero_grad(set_to_none=True)

    it()
    with zerostall.Checkpointer(str(tmp_path / "run"), keep_last=1) as ckpt:
        for s in range(1, 4):
            snap = _snapshot(model, [opt])
            r = ckpt.save_pytree_async(s, {"model": model, "optim0": opt})
            it()
            it()
            m2 = _model(512, 2)
            o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
            zerostall.load_pytree(r.result().path, {"model": m2, "optim0": o2})
            assert not _equal(_snapshot(m2, [o2]), snap)


def test_memory_tier_holds_cuda_state(tmp_path: Path) -> None:
    model = _model(512, 2)
    opts = [torch.optim.AdamW(model.parameters(), fused=True)]
    _iteration(model, opts, width=512)
    tier = zerostall.MemoryTier(persist_interval_steps=2)
    with zerostall.Checkpointer(str(tmp_path / "run"), memory_tier=tier) as ckpt:
        for step in range(1, 4):
            snap = _snapshot(model, opts)
            ckpt.save_pytree_async(step, {"model": model, "optim0": opts[0]}).result()
            _iteration(model, opts, width=512)
        assert ckpt.latest_step() == 3
        m2 = _model(512, 2)
        o2 = torch.optim.AdamW(m2.parameters(), fused=True)
        ckpt.load_pytree(template={"model": m2, "optim0": o2})
        assert not _equal(_snapshot(m2, [o2]), snap)
        assert ckpt.stats()[-1].tiers == ("memory",)  # step 3: memory only (persisted every 2nd)


def test_step_replayed_from_a_cuda_graph_never_tears(tmp_path: Path) -> None:
    """capturable=True: the replay runs no hook and moves no version counter, so zerostall copies
    that optimizer's tensors before the call returns (docs/guarantees.md)."""
    model = _model(1024, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    x = torch.randn(64, 1024, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch's CUDA-graph recipe does
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        model(x).square().mean().backward()
        opt.step()
    g.replay()
    with zerostall.Checkpointer(str(tmp_path / "run"), keep_last=1) as ckpt:
        for step in range(1, 4):
            snap = _snapshot(model, [opt])
            r = ckpt.save_pytree_async(step, {"model": model, "optim0": opt})
            g.replay()  # at once: no hook runs here
            g.replay()
            m2 = _model(1024, 2)
            o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3, capturable=True)
            zerostall.load_pytree(r.result().path, {"model": m2, "optim0": o2})
            assert not _equal(_snapshot(m2, [o2]), snap)


@pytest.mark.parametrize("where", ["device", "host", "straight"])
def test_load_into_cuda_templates_is_all_or_nothing(tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device pass (restore.device): every byte in place and verified; a bad leaf fails the
    load with every CUDA template unchanged, whether the bytes were held back on the device, in host
    memory (no room on the device), or (``atomic=False``) sent straight in."""
    import json

    from zerostall.restore import device

    if where == "host":
        monkeypatch.setattr(device, "_device_scratch", lambda *a: None)
    g = torch.Generator(device=DEV).manual_seed(2)
    state = {"w": torch.randn(3000, 1000, device=DEV, generator=g),  # 12 MB: several pieces
             "b": [torch.randn(17 + i, device=DEV, generator=g).to(torch.bfloat16) for i in range(50)],
             "i": torch.arange(5000, device=DEV)}
    path = tmp_path / "ck"
    zerostall.save_pytree(path, state)

    def fresh() -> dict[str, Any]:
        return {"w": torch.full_like(state["w"], 7), "b": [torch.full_like(t, 7) for t in state["b"]],
                "i": torch.full_like(state["i"], 7)}
    opts = zerostall.LoadOptions(atomic=where != "straight")
    tmpl = fresh()
    ptrs = [t.data_ptr() for t in [tmpl["w"], *tmpl["b"], tmpl["i"]]]
    got = zerostall.load_pytree(path, tmpl, options=opts)
    assert [t.data_ptr() for t in [got["w"], *got["b"], got["i"]]] == ptrs
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["i"], state["i"])
    assert all(torch.equal(a, b) for a, b in zip(got["b"], state["b"], strict=True))
    m = json.loads((path / "manifest.json").read_bytes())
    leaf = next(lf for lf in m["leaves"] if lf["key"].endswith("b/49"))
    f = next((path / "data").iterdir())
    with open(f, "r+b") as fh:
        fh.seek(leaf["offset"] + 3)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x20]))
    tmpl = fresh()
    with pytest.raises(zerostall.errors.ChecksumMismatchError):
        zerostall.load_pytree(path, tmpl, options=opts)
    if where != "straight":
        assert bool((tmpl["w"] == 7).all()) and bool((tmpl["i"] == 7).all())
        assert all(bool((t == 7).all()) for t in tmpl["b"])
