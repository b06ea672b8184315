"""The copies zerostall.memcopy makes, against memmove, on one and two threads.

    python -m benchmarks.probes.memcopy_probe [--gib 1] [--rounds 7]

1 GiB (faulted in, source and destination) is copied in pieces of 1, 4 and 32 MiB, each way in
turn, round after round: ``memmove`` (ctypes, what numpy and torch use), the streaming-store
copy, a CRC32C pass (the ``crc32c`` package, and the extension's kernel) and the one-pass copy
with CRC32C; the extension's kernels each twice, with the carry-less-multiply (fold) kernels on
and off (``_memcopy.set_fold``; on a CPU without AVX-512 VPCLMULQDQ both are the same). Prints
the median seconds per GiB of each. Compare within one run; the numbers quoted in ``zerostall/memcopy.py``
and docs/design.md come from this script.

What it showed on the 2-vCPU AMD EPYC VM of the reference runs (1 GiB faulted in, 32 MiB pieces,
seconds per GiB, one thread / two): the streaming copy 0.053 / 0.043; the one-pass copy and
CRC32C 0.048 / 0.043 with the fold kernels and 0.069 / 0.044 without; CRC32C alone 0.033 / 0.030
with the fold, against 0.064 / 0.036 for the ``crc32c`` package. On two threads every pass is at
the VM's memory bandwidth, so the one-pass copy and checksum costs what the plain copy does. In
another run (1-32 MiB pieces, one thread) ``memmove`` took 0.129-0.134 against 0.077-0.080 for
the streaming copy.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time
from collections.abc import Callable

import crc32c
import numpy as np

import zerostall.memcopy as mc


def _timed(threads: int, fn: Callable[[int, int], object], n: int, piece: int) -> float:
    """Wall time of ``fn(offset, length)`` over ``[0, n)`` in ``piece``-byte calls, ``threads`` halves."""
    part = n // threads

    def work(i: int) -> None:
        for o in range(i * part, (i + 1) * part, piece):
            fn(o, min(piece, (i + 1) * part - o))
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t = time.perf_counter()
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30))
    src, dst = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)  # both faulted in
    s, d = src.ctypes.data, dst.ctypes.data
    view = memoryview(src)
    # name -> (fold kernels on/off, or None where it does not matter; the copy)
    ways: dict[str, tuple[bool | None, Callable[[int, int], object]]] = {
        "memmove": (None, lambda o, k: ctypes.memmove(d + o, s + o, k)),
        "crc32c package pass": (None, lambda o, k: crc32c.crc32c(view[o:o + k])),
    }
    folds = (True, False) if mc._crc_ext is not None and hasattr(mc._crc_ext, "set_fold") else (None,)
    for fold in folds:
        tag = {True: " (fold)", False: " (crc32 instr.)", None: ""}[fold]
        if mc._ext is not None:
            ext = mc._ext
            ways["streaming copy" + tag] = (fold, lambda o, k: ext.copy(d + o, s + o, k))
        if mc._crc_ext is not None:
            cext = mc._crc_ext
            ways["copy + CRC32C, one pass" + tag] = (fold, lambda o, k: cext.copy_crc32c(d + o, s + o, k, 0))
            if hasattr(cext, "crc32c"):
                ways["kernel CRC32C pass" + tag] = (fold, lambda o, k: cext.crc32c(view[o:o + k], 0))
    print(f"streaming stores: {mc._ext is not None}, one-pass copy + CRC32C: {mc._crc_ext is not None}")
    for threads in (1, 2):
        for piece in (1 << 20, 4 << 20, 32 << 20):
            got: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(args.rounds):
                for w, (fold, fn) in ways.items():
                    if fold is not None and mc._crc_ext is not None:
                        mc._crc_ext.set_fold(fold)
                    got[w].append(_timed(threads, fn, n, piece) / args.gib)
            print(f"{threads} thread(s), {piece >> 20} MiB pieces, s per GiB:")
            for w, v in got.items():
                print(f"  {w:38s} {statistics.median(v):.3f}")
    if folds[0] is not None and mc._crc_ext is not None:
        mc._crc_ext.set_fold(True)


if __name__ == "__main__":
    main()
