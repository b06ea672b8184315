"""First save vs later saves through a Checkpointer, with and without ``prepare()``.

    python benchmarks/first_save.py [--size 1G] [--saves 4] [--dir /tmp]

Uses the benchmark state (157 fp32 tensors). Each save's stall is printed next to a memcpy of the
same state into warm buffers done in the same process just before it (the paired floor). With
``prepare()``, buffer allocation and page faulting happen ahead of the first save (its own time
is printed), which is what the issue's "pre-warm at Checkpointer creation" asks for. Last, saves
back to back right after ``Checkpointer()`` (no ``result()`` between): the worst of the first two
stalls against the warm ones (target: at most 2x; ``make bench`` reports the same figure).

Then the same through the free functions (``save_pytree``, one shared engine per ``SaveOptions``):
the first call's stall and whole time (stage, write, commit) against later calls', from a cold start
(``release_buffers()`` first: no writer, no buffers) and after ``zerostall.prepare(state)``
(target: first <= 2x a later one).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import zerostall
from benchmarks.state import build_state, parse_size
from benchmarks.zs import _tensors as _leaves


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    state = build_state(parse_size(args.size))
    tensors = [v for v in _leaves(state)]
    warm = [torch.empty_like(t) for t in tensors]

    def memcpy() -> float:
        t = time.perf_counter()
        for d, s in zip(warm, tensors):
            d.copy_(s)
        return time.perf_counter() - t

    memcpy()
    for prepare in (False, True):
        d = tempfile.mkdtemp(dir=args.dir)
        try:
            with zerostall.Checkpointer(d, keep_last=1) as ck:
                t = time.perf_counter()
                if prepare:
                    ck.prepare(tree=state)
                prep_s = time.perf_counter() - t
                stalls = []
                for step in range(args.saves):
                    m = memcpy()
                    t = time.perf_counter()
                    r = ck.save_pytree_async(step, state)
                    stalls.append((time.perf_counter() - t, m))
                    r.result()
            first, later = stalls[0][0], sorted(s for s, _ in stalls[1:])[len(stalls[1:]) // 2]
            print(f"prepare={prepare!s:5} prepare {prep_s:6.3f}s | first stall {first:.3f}s "
                  f"({first / stalls[0][1]:.2f}x its memcpy) | later median {later:.3f}s | first/later "
                  f"{first / later:.2f}x | " + " ".join(f"{s:.3f}/{m:.3f}" for s, m in stalls))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    # Back to back right after Checkpointer() + prepare(), no result() between: save i waits for the
    # writer to have written save i - 1; the second save used to wait for the writer's start-up too.
    d = tempfile.mkdtemp(dir=args.dir)
    try:
        t = time.perf_counter()
        ck = zerostall.Checkpointer(d, keep_last=1)
        open_s = time.perf_counter() - t
        with ck:
            ck.prepare(tree=state)
            stalls, responses = [], []
            for step in range(max(3, args.saves)):
                t = time.perf_counter()
                responses.append(ck.save_pytree_async(step, state))
                stalls.append(time.perf_counter() - t)
            for r in responses:
                r.result()
        early, warm = max(stalls[:2]), sorted(stalls[2:])[len(stalls[2:]) // 2]
        print(f"back to back: Checkpointer() {open_s:.3f}s | first two saves' worst stall {early:.3f}s vs warm "
              f"{warm:.3f}s: {early / warm:.2f}x (target <= 2x) | " + " ".join(f"{s:.3f}" for s in stalls))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    free_functions(state, args.saves, args.dir)


def free_functions(state: dict[str, object], saves: int, base: str | None) -> None:
    """First vs later ``save_pytree`` calls, cold and after ``zerostall.prepare``."""
    for prepare in (False, True):
        zerostall.release_buffers()  # cold: no writer, no buffers
        d = tempfile.mkdtemp(dir=base)
        try:
            t = time.perf_counter()
            if prepare:
                zerostall.prepare(state)
            prep_s = time.perf_counter() - t
            runs = []
            for i in range(max(2, saves)):
                t = time.perf_counter()
                r = zerostall.save_pytree_async(f"{d}/c{i}", state)
                stall = time.perf_counter() - t
                r.result()
                runs.append((stall, time.perf_counter() - t))
            first, later = runs[0], runs[1:]
            med_stall = sorted(s for s, _ in later)[len(later) // 2]
            med_total = sorted(w for _, w in later)[len(later) // 2]
            print(f"free functions prepare={prepare!s:5} prepare {prep_s:6.3f}s | first stall {first[0]:.3f}s "
                  f"total {first[1]:.3f}s | later median stall {med_stall:.3f}s total {med_total:.3f}s | "
                  f"first/later stall {first[0] / med_stall:.2f}x total {first[1] / med_total:.2f}x "
                  f"(target <= 2x with prepare)")
        finally:
            shutil.rmtree(d, ignore_errors=True)
    zerostall.release_buffers()


if __name__ == "__main__":
    main()
