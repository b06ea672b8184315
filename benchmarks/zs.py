"""zerostall adapter: the system under test, measured with the same loop as every peer.

The free functions keep one writer process and one set of staging buffers per layout alive
across calls, so the first save (buffer allocation, writer start) is reported separately from
the later ones; every save targets a new path because an existing path raises. The free
functions have no ``prepare()``; the first-save target is also measured the way the docs advise
for training loops: a ``Checkpointer`` (writer started at creation) with ``prepare(tree=...)``.

Run alone: ``python -m benchmarks.zs --size 256M --repeats 1 --dir /tmp/zsb``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import measure
from benchmarks.floors import child_args
from benchmarks.state import build_state, parse_size


class _ZsPending(measure.Pending):
    def __init__(self, resp: Any) -> None:
        self.resp = resp

    def wait(self) -> dict[str, Any] | None:
        self.resp.result()
        stats = getattr(self.resp, "stats", None)
        if stats is None:
            return None
        if dataclasses.is_dataclass(stats):
            return dataclasses.asdict(stats)
        return dict(vars(stats))


class Zerostall(measure.System):
    """``zerostall.save_pytree_async`` / ``load_pytree`` (in place into the template)."""

    name = "zerostall"
    in_place = True

    def setup(self, directory: Path) -> None:
        import zerostall

        self.zs = zerostall

    def save(self, path: Path, state: Any) -> measure.Pending:
        return _ZsPending(self.zs.save_pytree_async(str(path), state))

    def restore(self, path: Path, template: Any) -> Any:
        return self.zs.load_pytree(str(path), template)

    def restore_variants(self) -> dict[str, Any]:
        # The default load verifies every leaf's checksum; timing it without shows whether a
        # slow restore is I/O or checksum CPU. atomic=True shows what holding the bytes back until
        # every leaf verified costs.
        lo = getattr(self.zs, "LoadOptions", None)
        if lo is None:
            return {}
        out: dict[str, Any] = {}
        for name, kw in (("verify=False", {"verify": False}), ("atomic=True", {"atomic": True})):
            try:
                opts = lo(**kw)
            except TypeError:
                continue
            out[name] = lambda path, template, opts=opts: self.zs.load_pytree(str(path), template, options=opts)
        return out


class ZerostallIdle(Zerostall):
    """The same, with the writer under ``SCHED_IDLE`` (``SaveOptions(writer_sched="idle")``)."""

    name = "zerostall_idle"

    def save(self, path: Path, state: Any) -> measure.Pending:
        options = self.zs.SaveOptions(writer_sched="idle")
        return _ZsPending(self.zs.save_pytree_async(str(path), state, options=options))


class _Floor:
    """The copy a save's stall makes, done alone: the state into a buffer of its own with
    ``zerostall.memcopy.copy_many`` (streaming stores, every core), as staging copies. The floor
    each save is paired with; faulted in when made, which is before ``prepare()``, so that faulting
    it in does not land between ``prepare()`` and the first save.

    Not torch's ``copy_``: its ordinary stores slowed less than streaming ones when the machine's
    copies slowed (4 GiB: a save 0.104 s against 0.17 s before it, torch's copy 0.22 s against
    0.25 s), so it did not track the stall it was paired with."""

    def __init__(self, state: Any) -> None:
        import torch

        from zerostall import memcopy

        self.copy_many = memcopy.copy_many
        tensors = [t.contiguous() for t in _tensors(state)]
        self.buffer = [torch.empty_like(t) for t in tensors]
        self.items = [(d.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
                      for d, t in zip(self.buffer, tensors, strict=True) if t.numel()]
        self.tensors = tensors  # the items point into them
        self()

    def __call__(self) -> float:
        t0 = measure.now()
        self.copy_many(self.items)
        return measure.now() - t0


def _paired_saves(save: Callable[[int], Any], floor: _Floor, saves: int, label: str) -> list[dict[str, Any]]:
    """``saves + 1`` calls of ``save(i)`` (each returns a response with ``result()``), each timed
    between two ``floor`` copies: right before it, and right after its commit (``floor_s``,
    ``floor_after_s``).

    The pair is what the first save is judged against: on this VM a copy into memory runs 1.5-4x
    slower for a while, every copy in the process alike, with no page fault, reclaim or steal to
    show for it (``benchmarks/probes/copy_speed.py``); a first save that fell into such a while
    was counted as a first-save cost. The copy after waits for the commit, so that the
    writer's work does not slow it.
    """
    out = []
    for i in range(saves + 1):
        measure.wait_for_quiet(max_wait_s=measure.QUIET_WAIT_S)
        before = floor()
        t0 = measure.now()
        r = save(i)
        t1 = measure.now()
        r.result()
        t2 = measure.now()
        after = floor()
        out.append({"stall_s": t1 - t0, "commit_s": t2 - t0, "floor_s": before, "floor_after_s": after})
        measure.log(f"{label} {i}: stall {t1 - t0:.3f}s commit {t2 - t0:.3f}s "
                    f"(copy floor before {before:.3f}s, after {after:.3f}s)")
    return out


def checkpointer_first_save(state: Any, directory: Path, saves: int) -> dict[str, Any]:
    """First save vs later ones through a ``Checkpointer`` that pre-warms, as the docs advise.

    The Checkpointer starts its writer when it is created, and ``prepare(tree=state)`` allocates
    and pre-faults the staging buffers (timed apart: ``prepare_s``). Each save is paired with a
    copy of the state right before it and right after its commit (:func:`_paired_saves`).
    """
    import zerostall

    root = measure.scratch_path(directory, "zerostall-ckpt")
    out: dict[str, Any] = {}
    floor = _Floor(state)
    try:
        with zerostall.Checkpointer(str(root), keep_last=1) as ck:
            t0 = measure.now()
            ck.prepare(tree=state)
            out["prepare_s"] = measure.now() - t0
            out["saves"] = _paired_saves(lambda step: ck.save_pytree_async(step, state), floor, saves,
                                         "zerostall checkpointer save")
    finally:
        measure.remove(root)
    del floor  # 4 GiB at 4 GiB: not held through the next measurement
    out.update(checkpointer_back_to_back(state, directory, saves))
    return out


def checkpointer_back_to_back(state: Any, directory: Path, saves: int) -> dict[str, Any]:
    """Saves back to back right after ``Checkpointer()`` + ``prepare()``, no ``result()`` between.

    With one slot, save ``i`` waits until the writer has written save ``i - 1``; the second save
    would wait for the writer's start-up if ``Checkpointer()`` did not. ``open_s`` is the
    constructor, that start-up included.
    """
    import zerostall

    root = measure.scratch_path(directory, "zerostall-ckpt-b2b")
    out: dict[str, Any] = {}
    try:
        measure.wait_for_quiet(max_wait_s=measure.QUIET_WAIT_S)
        t0 = measure.now()
        ck = zerostall.Checkpointer(str(root), keep_last=1)
        out["open_s"] = measure.now() - t0
        with ck:
            ck.prepare(tree=state)
            stalls, responses = [], []
            for step in range(max(3, saves + 1)):
                t0 = measure.now()
                responses.append(ck.save_pytree_async(step, state))
                stalls.append(measure.now() - t0)
            for r in responses:
                r.result()
        out["back_to_back_stall_s"] = stalls
        measure.log(f"zerostall checkpointer back to back: open {out['open_s']:.3f}s, stalls "
                    + " ".join(f"{x:.3f}" for x in stalls))
    finally:
        measure.remove(root)
    return out


def free_prepared_first_save(state: Any, directory: Path, saves: int) -> dict[str, Any]:
    """First ``save_pytree`` vs later ones after ``zerostall.prepare(state)``, from a cold start.

    ``release_buffers()`` first stops the writer and frees the buffers the main measurement left,
    so the first save finds only what ``prepare`` (timed apart: ``prepare_s``) made ready.
    """
    import zerostall

    if not hasattr(zerostall, "prepare"):
        return {"error": "zerostall has no prepare()"}
    out: dict[str, Any] = {}
    root = measure.scratch_path(directory, "zerostall-free")
    root.mkdir(parents=True, exist_ok=True)
    try:
        zerostall.release_buffers()
        floor = _Floor(state)
        measure.wait_for_quiet(max_wait_s=measure.QUIET_WAIT_S)
        t0 = measure.now()
        zerostall.prepare(state)
        out["prepare_s"] = measure.now() - t0
        out["saves"] = _paired_saves(lambda i: zerostall.save_pytree_async(str(root / f"c{i}"), state), floor,
                                     saves, "zerostall free save after prepare")
    finally:
        zerostall.release_buffers()
        measure.remove(root)
    return out


def _tensors(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def available() -> str | None:
    """None if zerostall's API is importable, else why not (the suite then skips it)."""
    try:
        import zerostall
    except ImportError as e:
        return f"zerostall not importable: {e}"
    missing = [n for n in ("save_pytree_async", "load_pytree") if not hasattr(zerostall, n)]
    return f"zerostall lacks {', '.join(missing)}" if missing else None


def main() -> None:
    args = child_args(__doc__.splitlines()[0]).parse_args()
    why = available()
    if why:
        measure.emit({"system": "zerostall", "skipped": why})
        return
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = build_state(parse_size(args.size))
    out = measure.measure_system(Zerostall(), state, directory, args.repeats)
    try:
        out["checkpointer_first_save"] = checkpointer_first_save(state, directory, max(2, args.repeats))
    except Exception as e:  # recorded, not raised: the main numbers above still stand
        out["checkpointer_first_save"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        out["free_prepared_first_save"] = free_prepared_first_save(state, directory, max(2, args.repeats))
    except Exception as e:  # recorded, not raised
        out["free_prepared_first_save"] = {"error": f"{type(e).__name__}: {e}"}
    measure.emit(out)


if __name__ == "__main__":
    main()
