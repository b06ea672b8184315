"""The parity codec's rates (zerostall.memtier.parity) against a memcpy and a plain XOR of the same bytes.

``python -m benchmarks.parity [--mib 256] [--group 4 8] [--repeats 3]``

For each group size G, G shares of ``--mib`` MiB each (one per member, faulted in before any
timer), their G parities, and per repeat, on those same buffers:

* the floors: ``np.copyto`` of one share into a preallocated buffer of its size (a memcpy) and
  ``np.bitwise_xor`` of two shares into it (a plain XOR of two arrays);
* **encode, streamed**: the holder's work per step as the transport delivers it: an
  :class:`Accumulator` fed the G-1 members' chunks (c bytes each) in 16 MiB pieces
  (``memtier.replica.CHUNK_BYTES``), one member after another;
* **encode, at hand**: :func:`encode`, the same parity from the G-1 shares in one call (each
  piece of the parity finished while in cache);
* **rebuild**: :func:`rebuild` of member 0's share from the G-1 others' shares and parities;
* **chain**: the same share rebuilt as the chain does it, every hop's work in this one process:
  per stripe, a copy of the parity, then each of the G-2 survivors' :func:`partial`.

Rates are GB/s of share bytes: (G-1) x c for an encode (what the holder XORs), the rebuilt share's
size for a rebuild (which reads G-1 times that: a parity and G-2 chunks per stripe; its read rate
is printed too), the share's size for the floors. Ratios are against the floors of the same
repeat (medians of the paired ratios). The run also measures the choices the module's docstring
states: ``uint8`` against ``uint64`` views of the same arrays (aligned, and offset by one byte);
one :func:`xor_into` of a share against two threads each XORing half of it; and whether another
Python thread runs while numpy XORs (the GIL released). The last line is the JSON summary, marked as
``benchmarks.measure.RESULT_MARKER`` (``measure.emit``), as every benchmark's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from zerostall.memtier.parity import Accumulator, ParityLayout, encode, partial, rebuild, xor_into  # noqa: E402

PIECE = 16 << 20  # the replica transport's piece on the wire
LOST = 0

now = time.perf_counter


def filled(n: int, seed: int) -> np.ndarray:
    """``n`` bytes (n a multiple of 8) of a cheap pattern, distinct per seed, faulted in."""
    a = np.empty(n // 8, np.uint64)
    a[:] = np.arange(len(a), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
    return a.view(np.uint8)


def timed(fn: Callable[[], object]) -> float:
    t0 = now()
    fn()
    return now() - t0


def accumulate(lay: ParityLayout, stripe: int, shares: list[np.ndarray], out: np.ndarray) -> None:
    acc = Accumulator(lay, stripe, memoryview(out))
    for m in lay.stripes_of(stripe):
        a, b = lay.chunk_range(m, stripe)
        view = memoryview(shares[m])
        for x in range(0, b - a, PIECE):
            acc.add(m, x, view[a + x:min(a + x + PIECE, b)])
    if not acc.complete:
        raise AssertionError("the accumulator did not complete")


def chain(lay: ParityLayout, pars: dict[int, np.ndarray], shares: list[np.ndarray], out: np.ndarray) -> None:
    for s in lay.stripes_of(LOST):
        a, b = lay.chunk_range(LOST, s)
        hop = out[a:b]  # the last hop's buffer is where the new host receives it
        np.copyto(hop, pars[s][:b - a])
        for m in lay.stripes_of(LOST):
            if m != s:
                partial(lay, s, LOST, {m: memoryview(shares[m])}, memoryview(hop))


def kernels(n: int, repeats: int) -> dict[str, float]:
    """GB/s of ``bitwise_xor`` in place over ``n`` bytes: uint8, uint64 aligned, uint64 offset by one."""
    a, b = filled(n + 8, 1), filled(n + 8, 2)
    views = {"uint8": (a[:n], b[:n]),
             "uint64": (a[:n].view(np.uint64), b[:n].view(np.uint64)),
             "uint64_unaligned": (np.frombuffer(memoryview(a)[1:n + 1], np.uint64),
                                  np.frombuffer(memoryview(b)[1:n + 1], np.uint64))}
    best = dict.fromkeys(views, float("inf"))
    for _ in range(max(5, repeats)):  # interleaved, so a slow moment of the machine hits all three
        for name, (x, y) in views.items():
            best[name] = min(best[name], timed(lambda x=x, y=y: np.bitwise_xor(x, y, out=x)))
    return {name: n / t / 1e9 for name, t in best.items()}


def two_threads(n: int, repeats: int) -> dict[str, float]:
    """GB/s of one :func:`xor_into` over ``n`` bytes, and of two threads each XORing half of them,
    with the median of the paired ratios (two threads' rate over one's)."""
    a, b = filled(n, 3), filled(n, 4)
    da, db, h = memoryview(a), memoryview(b), n // 2 // 4096 * 4096

    def halves() -> None:
        t = threading.Thread(target=xor_into, args=(da[h:], db[h:]))
        t.start()
        xor_into(da[:h], db[:h])
        t.join()

    pairs = [(timed(lambda: xor_into(da, db)), timed(halves)) for _ in range(max(5, repeats))]
    return {"one": n / statistics.median(p[0] for p in pairs) / 1e9,
            "two": n / statistics.median(p[1] for p in pairs) / 1e9,
            "two_vs_one": statistics.median(p[0] / p[1] for p in pairs)}


def gil(n: int) -> dict[str, float]:
    """How fast another Python thread counts while this one runs a pass over ``n`` bytes, against
    while this one sleeps as long: numpy's XOR, and ``bytes()`` of a buffer (a memcpy that holds
    the GIL, the reference for "held"). Near 0: the pass holds the GIL; near 1: it releases it
    (less where the machine is short of cores)."""
    a, b = filled(n, 1), filled(n, 2)
    count, stop = [0], [False]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    passes: dict[str, Callable[[], object]] = {"xor": lambda: np.bitwise_xor(a, b, out=a),
                                               "bytes_copy": lambda: bytes(memoryview(b))}
    t = threading.Thread(target=spin)
    t.start()
    out = {}
    try:
        for name, fn in passes.items():
            time.sleep(0.05)
            c0, t0 = count[0], now()
            for _ in range(3):
                fn()
            busy_s, c1 = now() - t0, count[0]
            time.sleep(busy_s)
            out[name] = (c1 - c0) / max(1, count[0] - c1)
    finally:
        stop[0] = True
        t.join()
    return out


def one_group(group: int, n: int, repeats: int) -> dict[str, Any]:
    lay = ParityLayout((n,) * group, group)
    c = lay.chunk
    shares = [filled(n, 10 + m) for m in range(group)]
    pars = {s: np.empty(c, np.uint8) for s in range(group)}
    for s in range(group):
        encode(lay, s, {m: memoryview(shares[m]) for m in lay.stripes_of(s)}, memoryview(pars[s]))
    out = filled(n, 99)
    par = filled(c, 98)
    survivors = {m: memoryview(shares[m]) for m in lay.stripes_of(LOST)}
    held = {s: memoryview(pars[s]) for s in lay.stripes_of(LOST)}
    rows: list[dict[str, float]] = []
    for r in range(repeats):
        row = {"memcpy_s": timed(lambda: np.copyto(out, shares[1])),
               "xor_s": timed(lambda: np.bitwise_xor(shares[1], shares[2 % group], out=out))}
        row["encode_stream_s"] = timed(lambda: accumulate(lay, LOST, shares, par))
        if not np.array_equal(par, pars[LOST]):
            raise AssertionError("the streamed parity differs from encode's")
        row["encode_s"] = timed(lambda: encode(lay, LOST, survivors, memoryview(par)))
        row["rebuild_s"] = timed(lambda: rebuild(lay, LOST, held, survivors, memoryview(out)))
        if not np.array_equal(out, shares[LOST]):
            raise AssertionError("the rebuilt share differs from the original")
        out[:8] ^= 1  # the chain below must write every byte again
        row["chain_s"] = timed(lambda: chain(lay, pars, shares, out))
        if not np.array_equal(out, shares[LOST]):
            raise AssertionError("the chain's share differs from the original")
        rows.append(row)
        print(f"G={group} repeat {r}: " + ", ".join(
            f"{k[:-2]} {(((group - 1) * c) if k.startswith('encode') else n) / v / 1e9:.2f} GB/s"
            for k, v in row.items()), flush=True)
    work = {k[:-2]: ((group - 1) * c if k.startswith("encode") else n) for k in rows[0]}
    rate = {k: work[k] / statistics.median(row[k + "_s"] for row in rows) / 1e9 for k in work}
    vs = {f"{k}_vs_{f}": statistics.median((row[f + "_s"] / n) / (row[k + "_s"] / work[k]) for row in rows)
          for k in work if k not in ("memcpy", "xor") for f in ("memcpy", "xor")}
    return {"group": group, "share_bytes": n, "chunk": c, "extra_bytes": c, "extra_ratio": c / n,
            "gb_s": rate, "ratios": vs, "repeats": rows}


def lines(s: dict[str, Any]) -> list[str]:
    out = [f"{s['mib']} MiB per share, {s['repeats']} repeats, {os.cpu_count()} CPUs; GB/s of share bytes "
           f"(median), ratio to the memcpy / XOR floors of the same repeat (median of paired ratios)"]
    for g in s["groups"]:
        out.append(f"G={g['group']}: chunk {g['chunk'] / 2**20:.1f} MiB, each holder keeps "
                   f"{g['extra_ratio']:.3f}x a share; floors: memcpy {g['gb_s']['memcpy']:.2f}, "
                   f"XOR {g['gb_s']['xor']:.2f} GB/s")
        for k, v in g["gb_s"].items():
            if k in ("memcpy", "xor"):
                continue
            read = f", reading {v * (g['group'] - 1):.2f} GB/s" if k in ("rebuild", "chain") else ""
            out.append(f"  {k:<14} {v:6.2f} GB/s  {g['ratios'][k + '_vs_memcpy']:.2f}x memcpy, "
                       f"{g['ratios'][k + '_vs_xor']:.2f}x XOR{read}")
    k = s["kernels"]
    out.append(f"bitwise_xor in place: uint8 {k['uint8']:.2f}, uint64 {k['uint64']:.2f}, uint64 offset by one "
               f"byte {k['uint64_unaligned']:.2f} GB/s")
    t = s["two_threads"]
    out.append(f"xor_into of one share: one thread {t['one']:.2f} GB/s, two threads each half of it "
               f"{t['two']:.2f} GB/s ({t['two_vs_one']:.2f}x, median of paired ratios)")
    g = s["gil"]
    out.append(f"another Python thread's pace, against its pace alone: {g['xor']:.2f} while numpy XORs, "
               f"{g['bytes_copy']:.2f} while bytes() copies (which holds the GIL)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="MiB per member's share (default 256)")
    p.add_argument("--group", type=int, nargs="+", default=[4, 8], help="group sizes G (default 4 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the summary JSON here")
    a = p.parse_args(argv)
    from benchmarks.measure import emit

    n = a.mib << 20
    probe = min(n, 256 << 20)
    s: dict[str, Any] = {"mib": a.mib, "repeats": a.repeats, "groups": [one_group(g, n, a.repeats) for g in a.group],
                         "kernels": kernels(probe, a.repeats), "two_threads": two_threads(probe, a.repeats),
                         "gil": gil(probe)}
    s["lines"] = lines(s)
    for line in s["lines"]:
        print(line, flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(s, indent=1))
    emit(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
