"""Large copies of checkpoint bytes, with streaming (non-temporal) stores where the CPU has them.

Every copy zerostall makes of tensor bytes writes many MiB that nothing reads again soon: a
staging buffer is read by the writer process, a restored template by the next training step,
long after the copy has pushed it out of every cache. Ordinary stores first read each destination
cache line (read-for-ownership) and write it back later; streaming stores write it once. glibc's
``memmove`` switches to them only above ``x86_non_temporal_threshold`` (192 MiB on the machine
measured), and checkpoints are copied a tensor at a time. Measured on that machine (AMD EPYC,
2 vCPUs, 1 GiB in 1-32 MiB pieces, ``benchmarks/probes/memcopy_probe.py``): 0.129-0.134 s per GiB with
``memmove`` on one thread, 0.077-0.080 s with streaming stores; 0.084-0.104 s and 0.057-0.071 s
on two threads.

The streaming copy is a small C extension (``zerostall._memcopy``, built at install where a C
compiler is found; an optional build). Without it, or on a CPU without streaming stores, every
copy is ``memmove``: the same bytes, only slower. :data:`STREAMING` says which.

The same extension has one more kernel, for copies whose bytes must be checksummed anyway (a
load that verifies, a staging copy whose CRC the writer then need not compute): the CRC32C of
the bytes computed in the copy's own pass (:func:`copy` / :func:`copy_array` with ``crc``,
:func:`copy_many` with ``crc=True``). Where the CPU has AVX-512 VPCLMULQDQ, 256 bytes at a time
are folded by carry-less multiplication and stream-stored from the same registers; elsewhere each
12 KiB block is checksummed (three lanes of SSE4.2 ``crc32``) while the block before it is copied
out of L1. Per GiB from faulted-in memory (``benchmarks/probes/memcopy_probe.py``, 32 MiB pieces):
0.048 s on one thread with the fold, 0.069 s without, against 0.053 s for the streaming copy alone;
0.043 s on two threads either way, as the copy (docs/design.md, "Streaming-store copies"). The
extension's CRC-only kernel (:func:`crc32c`) is what :func:`zerostall.checksum.checksum` uses.

A bottom-layer module: ``stage`` (the staging copies) and ``restore`` / ``storage`` (the load's
copies) use the same copy without importing one another.
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from zerostall.cpus import shared_pool, usable_cpus

__all__ = ["STREAMING", "CRC_COPY", "MIN_STREAM", "copy", "combine", "crc32c", "copy_array", "copy_many"]


def _load() -> ModuleType | None:
    try:
        ext = importlib.import_module("zerostall._memcopy")
    except ImportError:  # not built (no C compiler at install): memmove does every copy
        return None
    return ext if ext.NONTEMPORAL else None


_ext = _load()
# An extension built before the kernel existed has no CRC32C attribute: copies only.
_crc_ext = _ext if _ext is not None and bool(getattr(_ext, "CRC32C", False)) else None
# The carry-less-multiply kernels (AVX-512 VPCLMULQDQ) are used wherever the CPU has them, the
# crc32-instruction kernels elsewhere (the extension decides at import).
# The extension's CRC-only kernel (None where it is not built, or built before it existed)
_crc_only: Callable[[Any, int], int] | None = getattr(_crc_ext, "crc32c", None)
#: Whether large copies use streaming stores (the extension is built and the CPU has them).
#: Read at every copy (a test may switch it off to run the memmove path).
STREAMING: bool = _ext is not None
#: Whether :func:`copy_array` can checksum (CRC32C) the bytes it copies in the same pass: the
#: extension's kernel, on a CPU with SSE4.2's crc32 instruction, while :data:`STREAMING` is on.
CRC_COPY: bool = STREAMING and _crc_ext is not None
#: Copies smaller than this use ``memmove``: a small destination may well be read again while
#: still cached, and the fence that ends a streaming copy is a fixed cost.
MIN_STREAM = 256 << 10
#: A :func:`copy_many` piece: large enough to run at memory bandwidth, small enough to share a
#: tensor between threads evenly.
PIECE = 16 << 20


def copy(dst: int, src: int, n: int, crc: int | None = None) -> int | None:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (the ranges must not overlap),
    without holding the GIL.

    With ``crc`` (a CRC32C to continue; 0 starts one) and :data:`CRC_COPY`, also returns the
    CRC32C of the bytes, computed in the copy's own pass; ``None`` otherwise (copied all the same).

    Example::

        >>> a, b = np.arange(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
        >>> copy(b.ctypes.data, a.ctypes.data, 8); b.tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if crc is not None and CRC_COPY:
        assert _crc_ext is not None
        return int(_crc_ext.copy_crc32c(dst, src, n, crc))
    if STREAMING and n >= MIN_STREAM:
        assert _ext is not None
        _ext.copy(dst, src, n)
    else:
        ctypes.memmove(dst, src, n)  # a CFUNCTYPE call: the GIL is released for the copy
    return None


def combine(crc1: int, crc2: int, len2: int) -> int | None:
    """The CRC32C of ``A + B`` from ``crc1`` = CRC32C(A), ``crc2`` = CRC32C(B) and ``len2`` = len(B),
    by the extension (about 0.2 us against 12 us in Python); None where it is not built.
    :func:`zerostall.checksum.checksum_combine` uses it and falls back to its own arithmetic.
    """
    if _crc_ext is None:
        return None
    return int(_crc_ext.crc32c_combine(crc1, crc2, len2))


def crc32c(view: memoryview | bytes | bytearray, crc: int = 0) -> int | None:
    """The CRC32C of a contiguous buffer's bytes, continuing ``crc``, by the extension's kernel
    (without holding the GIL); None where it is not built.

    On a CPU with AVX-512 VPCLMULQDQ it folds 256 bytes at a time by carry-less multiplication
    and runs at memory speed (0.030 s per GiB on two cores here against 0.039 s for the crc32
    instruction; 0.033 against 0.069 s on one, ``benchmarks/probes/memcopy_probe.py``); elsewhere it
    is the three-lane crc32-instruction loop.
    :func:`zerostall.checksum.checksum` uses it and falls back to the ``crc32c`` package.
    """
    return None if _crc_only is None else int(_crc_only(view, crc))


def _address(a: np.ndarray[Any, Any]) -> int:
    return int(a.__array_interface__["data"][0])


def copy_array(dst: np.ndarray[Any, Any], src: Any, crc: int | None = None) -> int | None:
    """``np.copyto(dst, src, casting="no")``, with streaming stores when ``src`` is an array as
    large as ``dst``, of its dtype and shape, and both are contiguous (numpy's copy holds no GIL
    either).

    With ``crc`` (a CRC32C to continue; 0 starts one), also returns the CRC32C of the bytes
    copied, computed in the copy's own pass over the source (:data:`CRC_COPY`); ``None`` where
    that pass cannot checksum (no kernel, or arrays it does not stream): the bytes are copied
    all the same, and the caller checksums them apart.

    Example::

        >>> a, b = np.arange(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
        >>> copy_array(b, a); b.tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    n = dst.nbytes
    if n >= MIN_STREAM and not isinstance(src, np.ndarray) and hasattr(src, "__array__"):
        # an array-like that is a view of its bytes (a jax.Array's host view): np.copyto would
        # convert it anyway, and as an ndarray the kernel can take it by address and checksum it
        src = np.asarray(src)
    # The cheap tests first: a load of many small leaves calls this once per leaf.
    if crc is not None and CRC_COPY and _fits(dst, src):
        assert _crc_ext is not None
        return int(_crc_ext.copy_crc32c(_address(dst), _address(src), n, crc))
    if STREAMING and n >= MIN_STREAM and _fits(dst, src):
        assert _ext is not None
        _ext.copy(_address(dst), _address(src), n)
    else:
        np.copyto(dst, src, casting="no")
    return None


def _fits(dst: np.ndarray[Any, Any], src: Any) -> bool:
    """Whether the extension can copy ``src`` into ``dst`` by address: same layout, contiguous."""
    return (isinstance(src, np.ndarray) and dst.shape == src.shape and dst.dtype == src.dtype
            and dst.flags.c_contiguous and src.flags.c_contiguous and dst.flags.writeable)


def copy_many(items: Sequence[tuple[int, int, int]], threads: int | None = None, *,
              crc: bool = False) -> list[tuple[tuple[int, int, int], int]] | None:
    """Copy every ``(dst, src, n)`` of ``items`` (addresses; no range overlaps another), cut into
    :data:`PIECE`-byte pieces shared by the calling thread and up to ``threads - 1`` pooled ones
    (default: one per usable CPU). Returns once every piece is copied; the first error is raised
    after every piece has run.

    Not on the pinned team that a load's passes use (:func:`zerostall.cpus.pinned_team`): there
    the blocking save's stall was the same (256 MiB, 12 pairs in one process: 17.0 ms pooled,
    17.2 ms pinned).

    With ``crc`` and :data:`CRC_COPY`, returns each piece's ``((item, start, end), CRC32C)``,
    computed in the copy's own pass (:func:`zerostall.checksum.join_crcs` makes the items' CRCs
    of them); else None.

    For a copy the caller waits for anyway (blocking staging): every core it may use copies.
    """
    summed = crc and CRC_COPY
    pieces = [(i, o, d + o, s + o, min(PIECE, n - o)) for i, (d, s, n) in enumerate(items) for o in range(0, n, PIECE)]
    sums: list[int] = [0] * len(pieces)

    def one(k: int) -> None:
        _, _, d, s, n = pieces[k]
        sums[k] = copy(d, s, n, 0 if summed else None) or 0

    if threads is None:
        threads = usable_cpus()
    threads = max(1, min(threads, len(pieces)))
    if threads == 1:
        for k in range(len(pieces)):
            one(k)
    else:
        _run_pieces(len(pieces), threads, one)
    return [((i, o, o + n), c) for (i, o, _, _, n), c in zip(pieces, sums, strict=True)] if summed else None


def _run_pieces(count: int, threads: int, one: Callable[[int], None]) -> None:
    """``one(k)`` for every ``k < count``, claimed by the calling thread and ``threads - 1`` pooled
    ones; the first error is raised after every piece has run."""
    cond = threading.Condition()
    claimed = running = 0
    errors: list[BaseException] = []

    def worker() -> None:
        nonlocal claimed, running
        while True:
            with cond:
                if claimed >= count:
                    return
                k = claimed
                claimed += 1
                running += 1
            try:
                one(k)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller below
                errors.append(exc)
            finally:
                with cond:
                    running -= 1
                    cond.notify_all()

    pool = shared_pool(threads - 1)
    for _ in range(threads - 1):
        pool.submit(worker)
    worker()
    # Every piece is claimed once the caller's own worker returns: wait for those still being
    # copied, not for pool tasks that have not started (the pool may be busy with a load's pass;
    # such a task finds nothing left and returns).
    with cond:
        cond.wait_for(lambda: running == 0)
    if errors:
        raise errors[0]
