"""Copy leaves into a slot's buffers.

Each leaf gets a typed view into its place in the data-file image, built once per layout and
kept with the slot, so a save is one ``copy_`` per tensor: strided sources are gathered by the
copy itself (no ``.contiguous()`` temporary), device tensors are copied device-to-host.
"""

from __future__ import annotations

import sys
from itertools import compress, count, repeat
from operator import attrgetter, itemgetter
from typing import Any, Protocol, cast

import numpy as np

import zerostall.memcopy as memcopy
from zerostall.arraytypes import ArrayLeaf, BackgroundSource, background_sources
from zerostall.checksum import join_crcs
from zerostall.cpus import usable_cpus
from zerostall.dtypes import to_numpy_dtype, to_torch_dtype
from zerostall.stage.buffers import Slot
from zerostall.stage.plan import Plan
from zerostall.tree import FlatState

__all__ = ["CopyEngine", "CpuCopyEngine", "CudaCopyEngine", "select_engine", "stage", "prepare_slot", "STAGE_CRC",
           "staging_checksums"]


class CopyEngine(Protocol):
    """Copies tensors into host views; ``finish`` returns once every copy has landed, with the
    CRC32C of the leaves (by index) whose copy checksummed them."""

    def copy(self, dst: Any, src: Any, leaf: int = -1) -> None: ...

    def finish(self) -> dict[int, int]: ...


#: Whether staging checksums what it copies (the copy kernel's CRC32C in the copy's own pass,
#: where :data:`zerostall.memcopy.CRC_COPY`): the writer and the memory tier's keeper then make
#: no checksum pass of their own over those leaves. Read at every save: a test switches it off to
#: run the path of a build without the kernel, where the writer checksums (docs/design.md,
#: "Checksums at staging").
STAGE_CRC: bool = True


def staging_checksums() -> bool:
    """Whether this save's staging copies checksum (:data:`STAGE_CRC` and the kernel is there)."""
    return STAGE_CRC and memcopy.CRC_COPY


class CpuCopyEngine:
    """CPU copies. A large contiguous tensor is queued and copied at :meth:`finish` by
    :func:`~zerostall.memcopy.copy_many`: streaming stores, on as many threads as torch's intra-op
    setting gives ``copy_`` (the caller waits for the copy anyway); 0.057-0.071 s per GiB on two threads against 0.084-0.104 s for
    ``copy_``'s cached stores on this machine (zerostall.memcopy). The rest go through ``copy_``,
    which gathers strided sources and resolves conjugate and negative views.

    With ``crc``, the queued copies also checksum their bytes (:func:`~zerostall.memcopy.copy_many`
    with ``crc``); :meth:`finish` returns those CRCs by the leaf index given to :meth:`copy`."""

    def __init__(self, crc: bool = False) -> None:
        self._queued: list[tuple[int, int, int]] = []
        self._leaves: list[int] = []
        self._crc = crc

    def copy(self, dst: Any, src: Any, leaf: int = -1) -> None:
        n = _streamable(dst, src)
        if n:
            self._queued.append((dst.data_ptr(), src.data_ptr(), n))
            self._leaves.append(leaf)
        else:
            dst.copy_(src)

    def finish(self) -> dict[int, int]:
        if not self._queued:
            return {}
        items, self._queued = self._queued, []
        leaves, self._leaves = self._leaves, []
        # as many threads as torch's own copy_ would use (the trainer's intra-op setting)
        parts = memcopy.copy_many(items, min(usable_cpus(), sys.modules["torch"].get_num_threads()), crc=self._crc)
        if parts is None:
            return {}
        return {i: c for i, c in zip(leaves, join_crcs(parts, len(items)), strict=True) if i >= 0 and c is not None}


def _streamable(dst: Any, src: Any) -> int:
    """The bytes of ``src`` if it may be copied into ``dst`` as raw bytes by address: a plain
    contiguous CPU tensor of ``dst``'s dtype and size, at least :data:`~zerostall.memcopy.MIN_STREAM`
    bytes, with no lazy conjugate or negation; else 0."""
    if not memcopy.STREAMING:
        return 0
    torch = sys.modules["torch"]
    if src.__class__ is not torch.Tensor and src.__class__ is not torch.nn.Parameter:
        return 0  # a subclass may keep its bytes elsewhere
    n = src.numel() * src.element_size()
    if (n < memcopy.MIN_STREAM or src.device.type != "cpu" or src.dtype != dst.dtype or src.numel() != dst.numel()
            or not src.is_contiguous() or not dst.is_contiguous() or src.is_conj() or src.is_neg()):
        return 0
    return int(n)


class CudaCopyEngine:
    """Device-to-host copies on a side stream into page-locked buffers.

    The side stream first waits for the trainer's current stream, so kernels that produce the
    tensors finish before they are read; ``finish`` synchronizes the side stream only, so the
    caller may mutate its tensors as soon as staging returns.
    """

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self._stream = torch.cuda.Stream(device=device)
        self._started = False

    def copy(self, dst: Any, src: Any, leaf: int = -1) -> None:
        if not src.is_cuda:
            dst.copy_(src)
            return
        if not self._started:
            self._stream.wait_stream(self._torch.cuda.current_stream(src.device))
            self._started = True
        with self._torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)

    def finish(self) -> dict[int, int]:
        # No CRCs: the bytes arrive by DMA, no CPU pass reads them (the writer checksums them).
        if self._started:
            self._stream.synchronize()
            self._started = False
        return {}


_VALUE = attrgetter("value")


def select_engine(leaves: list[ArrayLeaf], *, cuda_available: bool | None = None, crc: bool = False) -> CopyEngine:
    """The CUDA engine when any leaf lives on a CUDA device and CUDA works, else the CPU one
    (which checksums its streamed copies with ``crc``)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return CpuCopyEngine(crc)
    # ``is_cuda`` rather than ``device.type``: this scans every leaf at every save, and building
    # a device object costs ~0.5 us a leaf
    # one C-level loop over the leaves' values; only a torch leaf's ``is_cuda`` counts
    flags = map(getattr, map(_VALUE, leaves), repeat("is_cuda"), repeat(False))
    cuda_leaf = next((leaves[i].value for i in compress(count(), flags) if leaves[i].kind == "torch"), None)
    if cuda_leaf is None:
        return CpuCopyEngine(crc)
    if cuda_available is None:
        cuda_available = bool(torch.cuda.is_available())
    if not cuda_available:
        return CpuCopyEngine(crc)
    return CudaCopyEngine(torch, cuda_leaf.device)


def _views(slot: Slot, plan: Plan, flat: FlatState) -> list[Any]:
    """Typed destination views of every leaf, cached on the slot for its current layout."""
    if slot.signature == plan.signature and len(slot.views) == len(flat.leaves):
        return slot.views
    views: list[Any] = []
    torch = sys.modules.get("torch")
    for leaf, place in zip(flat.leaves, plan.leaves, strict=True):
        buf = slot.buffers[place.file].mmap
        if leaf.nbytes == 0:
            views.append(None)
        elif leaf.kind == "torch":
            assert torch is not None
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=leaf.nbytes, offset=place.offset)
            views.append(raw.view(to_torch_dtype(leaf.dtype)).view(leaf.shape))
        elif leaf.kind in ("numpy", "numpy_scalar"):
            raw_np = np.frombuffer(buf, dtype=np.uint8, count=leaf.nbytes, offset=place.offset)
            views.append(raw_np.view(to_numpy_dtype(leaf.dtype)).reshape(leaf.shape))
        else:  # bytes and custom handlers' bytes
            views.append(np.frombuffer(buf, dtype=np.uint8, count=leaf.nbytes, offset=place.offset))
    slot.views = views
    slot.signature = plan.signature
    return views


def write_headers(slot: Slot, plan: Plan) -> None:
    for fplan, buf in zip(plan.files, slot.buffers, strict=True):
        buf.mmap[: len(fplan.header)] = fplan.header


def prepare_slot(flat: FlatState, plan: Plan, slot: Slot) -> list[Any]:
    """Write ``plan``'s headers into ``slot`` and build its typed views (once per layout)."""
    if slot.signature != plan.signature:
        write_headers(slot, plan)
    return _views(slot, plan, flat)


#: small CPU tensors are copied by one ``torch._foreach_copy_`` call per this many (one dispatch
#: from Python instead of one per tensor: ~1.2 us a tensor down to ~0.7 us here); large ones keep
#: their own ``copy_`` (the per-call cost is nothing next to their bytes, and torch's copy of a
#: large tensor may use several threads, which the foreach fallback does not promise)
_BATCH_LEN = 4096
_BATCH_MAX_BYTES = 1 << 16


def _batch_copy(torch: Any) -> Any:
    """``torch._foreach_copy_`` where this torch has it (2.1 and later), else None."""
    return getattr(torch, "_foreach_copy_", None) if torch is not None else None


def _split(slot: Slot, plan: Plan, flat: FlatState) -> tuple[list[int], list[int]]:
    """The indices of the layout's small torch leaves and of its other leaves with bytes, cached on
    ``slot`` per layout (kinds and sizes are the layout's; nothing of the buffers is held)."""
    cached = slot.batch
    if cached is not None and cached[0] is plan.signature:
        return cached[1], cached[2]
    small: list[int] = []
    rest: list[int] = []
    for i, leaf in enumerate(flat.leaves):
        if leaf.nbytes:
            (small if leaf.kind == "torch" and leaf.nbytes <= _BATCH_MAX_BYTES else rest).append(i)
    slot.batch = (plan.signature, small, rest)
    return small, rest


def stage(flat: FlatState, plan: Plan, slot: Slot, engine: CopyEngine | None = None, *,
          skip: list[bool] | None = None, crcs: list[int | None] | None = None) -> list[Any]:
    """Copy every leaf of ``flat`` into ``slot`` (but those ``skip`` marks); returns when the copies
    are complete, with the destination views (for the skipped leaves' later copy).

    ``crcs`` (one entry per leaf, None to start with): where the copy of a leaf checksummed its
    bytes whole (a streamed copy, :func:`staging_checksums`), its entry is set to their CRC32C."""
    views = prepare_slot(flat, plan, slot)
    want = crcs is not None
    if engine is None:
        engine = select_engine(flat.leaves if skip is None else
                               [leaf for leaf, s in zip(flat.leaves, skip, strict=True) if not s], crc=want)
    torch = sys.modules.get("torch")
    sources = background_sources()
    grad_off = torch.no_grad() if torch is not None else None
    if grad_off is not None:
        grad_off.__enter__()
    try:
        batch = _batch_copy(torch) if type(engine) is CpuCopyEngine else None
        dsts: list[Any] = []
        srcs: list[Any] = []
        order: Any = enumerate(zip(flat.leaves, views, strict=True))
        if batch is not None and skip is None:
            # The layout's small torch leaves and their views are listed once per slot and layout:
            # a save then gathers its sources and makes one call per batch, and walks only the rest.
            small, rest = _split(slot, plan, flat)
            leaves = flat.leaves
            for k in range(0, len(small), _BATCH_LEN):
                part = small[k:k + _BATCH_LEN]
                # C-level gathers (itemgetter, map): a Python step per leaf cost ~0.25 us
                pick = itemgetter(*part) if len(part) > 1 else (lambda seq, i=part[0]: (seq[i],))
                batch(list(pick(views)), list(map(_VALUE, pick(leaves))))
            order = ((i, (leaves[i], views[i])) for i in rest)
        for i, (leaf, dst) in order:
            if dst is None or (skip is not None and skip[i]):
                continue
            if leaf.kind == "torch":
                if batch is not None and leaf.nbytes <= _BATCH_MAX_BYTES:
                    dsts.append(dst)
                    srcs.append(leaf.value)
                    if len(dsts) == _BATCH_LEN:
                        batch(dsts, srcs)
                        dsts, srcs = [], []
                else:
                    engine.copy(dst, leaf.value, i)
            elif leaf.kind in ("numpy", "numpy_scalar"):
                crc = 0 if want and leaf.nbytes >= memcopy.MIN_STREAM else None
                if sources and isinstance(leaf.value, sources):  # an array type's source copies itself
                    got = cast(BackgroundSource, leaf.value).copy_into(dst, crc)
                else:
                    got = memcopy.copy_array(dst, leaf.value, crc)
                if crc is not None:
                    assert crcs is not None
                    crcs[i] = got
            else:
                dst[:] = np.frombuffer(leaf.value, dtype=np.uint8)
        if dsts:
            assert batch is not None
            batch(dsts, srcs)
        sums = engine.finish()
        if crcs is not None:
            for i, c in sums.items():
                crcs[i] = c
    finally:
        if grad_off is not None:
            grad_off.__exit__(None, None, None)
    return views
