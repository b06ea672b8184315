"""Restoring the GPU trainer's state into CUDA tensors: zerostall vs the floors and the peers.

    python benchmarks/gpu_restore.py [--layers 26] [--d 1024] [--repeats 2] [--dir /tmp/zsgpu-restore]
                                     [--systems ...] [--out FILE] [--cpu-dry-run]

The trainer of ``benchmarks/gpu.py`` (4.74 GB of fp32 weights and AdamW moments at the defaults)
is trained a few steps and saved once by each system; then each checkpoint is loaded back onto
the GPU, warm (its files in the page cache) and cold (dropped with ``POSIX_FADV_DONTNEED`` on every
file first, and ``/proc/sys/vm/drop_caches`` where writable), ``--repeats`` times each, medians:

* ``floor_h2d``: the state copied host-to-device from page-locked buffers (one ``copy_`` per tensor,
  ``non_blocking``, one synchronize): what no load can beat once the bytes are in host memory;
* ``floor_read``: zerostall's data files read into one reused host buffer (``readinto``, 64 MiB);
* ``zerostall``: ``Checkpointer.load_pytree(step, {"model": model, "optim": opt})``: in place, into
  the live CUDA parameters and optimizer state, every byte verified (the default load, which
  streams: ``LoadOptions(atomic=False)``);
* ``zerostall_atomic``: the same through a ``Checkpointer`` with ``LoadOptions(atomic=True)``
  (all or nothing: held back in a device scratch until every leaf verified);
* ``zerostall_host_tmp``: the default load the way before the device pass (``restore.device``):
  each leaf read into a fresh host tensor, then one synchronous copy per leaf (what
  ``ZEROSTALL_DEVICE_LOADS=0`` selects), for the A/B in one process;
* ``safetensors``: ``safetensors.torch.load_file(path, device="cuda")`` of one file holding the same
  tensors (new tensors, as its users do);
* ``dcp``: ``torch.distributed.checkpoint.load`` into the live model and optimizer state dicts;
* ``torch_load``: ``torch.load(path, map_location="cuda")`` of ``torch.save``'s file.

Exits with a message and status 0 where no CUDA device is present (``--cpu-dry-run`` runs the logic
on CPU with a tiny model: no figures).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # the trainer and its helpers

SYSTEMS = ["floor_h2d", "floor_read", "zerostall", "zerostall_atomic", "zerostall_host_tmp", "safetensors", "dcp",
           "torch_load"]


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def _drop(d: Path) -> None:
    """Evict ``d``'s files from the page cache (what a restart on a fresh node reads)."""
    os.sync()
    for p in _files(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        pass  # not root: the fadvise above did what it could


_BUF: list[mmap.mmap] = []


def _warm(d: Path) -> None:
    if not _BUF:
        # Allocated once, not per timed read, and page-aligned: a read() into a bytearray ran at
        # half the speed on the reference VM.
        _BUF.append(mmap.mmap(-1, 64 << 20))
    buf = _BUF[0]
    for p in _files(d):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _time(fn: Callable[[], Any]) -> float:
    gpu._sync()
    t = time.perf_counter()
    fn()
    gpu._sync()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu.model_args(ap)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/zsgpu-restore")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        gpu.DEV = "cpu"
        args.layers, args.d, args.vocab, args.batch, args.seq, args.repeats = 2, 128, 1000, 2, 64, 1
    elif not torch.cuda.is_available():
        print("gpu_restore: no CUDA device on this machine; nothing measured.")
        return 0
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    trainer = gpu.Trainer(args)
    gpu.timed_iterations(trainer, 3)
    tensors = trainer.tensors()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    device = torch.cuda.get_device_name() if gpu.DEV == "cuda" else "cpu (dry run: no figures)"
    gpu.log(f"{device}: state {nbytes / 1e9:.2f} GB in {len(tensors)} tensors")
    systems = [s for s in args.systems.split(",") if s]

    import zerostall
    from zerostall.options import DistributedOptions, LoadOptions

    zdir = root / "zerostall"
    ck = zerostall.Checkpointer(zdir, keep_last=1, save_options=zerostall.SaveOptions(
        staging="blocking", distributed=DistributedOptions(enabled=False)))
    ck.save_pytree(1, trainer.tree())
    ck.wait()
    loads: dict[str, tuple[Path, Callable[[], Any]]] = {}
    loads["zerostall"] = (zdir, lambda: ck.load_pytree(1, trainer.tree()))
    atomic = zerostall.Checkpointer(zdir, load_options=LoadOptions(atomic=True), read_only=True)
    loads["zerostall_atomic"] = (zdir, lambda: atomic.load_pytree(1, trainer.tree()))
    loads["floor_read"] = (zdir, lambda: _warm(zdir))

    def host_tmp() -> Any:
        from zerostall.restore import plan

        was, plan.DEVICE_LOADS = plan.DEVICE_LOADS, False
        try:
            return ck.load_pytree(1, trainer.tree())
        finally:
            plan.DEVICE_LOADS = was
    loads["zerostall_host_tmp"] = (zdir, host_tmp)
    if "safetensors" in systems:
        from safetensors.torch import load_file, save_file

        sdir = root / "safetensors"
        sdir.mkdir()
        flat = {f"t{i}": t.contiguous() for i, t in enumerate(tensors)}
        save_file(flat, str(sdir / "state.safetensors"))
        loads["safetensors"] = (sdir, lambda: load_file(str(sdir / "state.safetensors"), device=gpu.DEV))
    if "dcp" in systems:
        import torch.distributed.checkpoint as dcp

        ddir = root / "dcp"
        dcp.save(trainer.state_dicts(), checkpoint_id=str(ddir), no_dist=True)

        def dcp_load() -> None:
            sd = trainer.state_dicts()
            dcp.load(sd, checkpoint_id=str(ddir), no_dist=True)
            trainer.opt.load_state_dict(sd["optim"])

        loads["dcp"] = (ddir, dcp_load)
    if "torch_load" in systems:
        tdir = root / "torch"
        tdir.mkdir()
        with open(tdir / "state.pt", "wb") as f:
            torch.save(trainer.state_dicts(), f)
        loads["torch_load"] = (tdir, lambda: torch.load(tdir / "state.pt", map_location=gpu.DEV, weights_only=True))
    out: dict[str, Any] = {"device": device, "state_bytes": nbytes, "tensors": len(tensors), "args": vars(args),
                           "systems": {}}
    if "floor_h2d" in systems:
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu._pin()) for t in tensors]
        for h, t in zip(host, tensors, strict=True):
            h.copy_(t)

        def h2d() -> None:
            for h, t in zip(host, tensors, strict=True):
                t.copy_(h, non_blocking=True)

        samples = [_time(h2d) for _ in range(args.repeats + 1)][1:]
        out["systems"]["floor_h2d"] = {"warm": samples}
        del host
    for name in systems:
        if name not in loads:
            continue
        d, fn = loads[name]
        res: dict[str, Any] = {"warm": [], "cold": []}
        try:
            for _ in range(args.repeats):
                _drop(d)
                res["cold"].append(_time(fn))
                _warm(d)
                res["warm"].append(_time(fn))
        except Exception as exc:
            gpu.log(f"{name} failed:\n{traceback.format_exc()}")
            res = {"error": f"{type(exc).__name__}: {exc}"}
        out["systems"][name] = res
        if "warm" in res:
            gpu.log(f"{name}: warm {[round(x, 3) for x in res['warm']]} s, cold {[round(x, 3) for x in res['cold']]} s")
    ck.close()
    atomic.close()
    print(f"state {nbytes / 1e9:.2f} GB in {len(tensors)} tensors on {device}")
    print(f"{'system':>20} {'warm s':>8} {'GB/s':>6} {'cold s':>8} {'GB/s':>6}")
    for name, res in out["systems"].items():
        if "error" in res:
            print(f"{name:>20} {res['error']}")
            continue
        cells = []
        for kind in ("warm", "cold"):
            xs = res.get(kind) or []
            med = statistics.median(xs) if xs else float("nan")
            res[f"{kind}_median_s"] = med
            cells.append(f"{med:8.3f} {nbytes / med / 1e9 if xs else float('nan'):6.2f}")
        print(f"{name:>20} {cells[0]} {cells[1]}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
