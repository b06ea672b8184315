"""Which leaves only an optimizer's ``step()`` modifies: those may be copied after the save returns.

A leaf is *owned* when its bytes lie inside a tensor that some ``torch.optim.Optimizer`` updates
in ``step()``: a parameter of one of its ``param_groups`` or a tensor of its ``state``. Module
buffers (BatchNorm statistics, updated by forward passes), tensors no optimizer holds, tensors
*inside* ``param_groups`` (a tensor ``lr``, changed by LR schedulers) and everything that is not
a tensor are not owned: they are copied before ``save_*_async`` returns.

Optimizers are found in the saved tree (through dicts, lists and tuples) and among the
optimizers seen stepping while an earlier overlapped save was in flight (:func:`note_optimizer`),
so an optimizer kept outside the saved tree is known from the second save on. Ownership is
decided by memory, not identity: ``model.state_dict()`` holds detached aliases of the parameters
(other tensor objects, same bytes).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

from zerostall.tree import ArrayLeaf

__all__ = ["find_optimizers", "note_optimizer", "known_optimizers", "owned_leaves", "owners_of", "deferrable",
           "optimizer_tensors", "storage_key"]

_KNOWN: weakref.WeakSet[Any] = weakref.WeakSet()
_MAX_WALK = 100_000  # containers and leaves looked at when searching the tree for optimizers


def note_optimizer(opt: Any) -> None:
    """Remember ``opt`` (weakly): later saves treat its parameters and state as owned."""
    try:
        _KNOWN.add(opt)
    except TypeError:  # pragma: no cover - an optimizer that cannot be weakly referenced
        pass


def known_optimizers() -> list[Any]:
    return list(_KNOWN)


def find_optimizers(items: Any) -> list[Any]:
    """Every ``torch.optim.Optimizer`` reachable from ``items`` through dicts, lists and tuples."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    optimizer_type = torch.optim.Optimizer
    found: list[Any] = []
    stack: list[Any] = [items]
    seen = 0
    while stack and seen < _MAX_WALK:
        obj = stack.pop()
        seen += 1
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, optimizer_type):
            found.append(obj)
    return found


def _local(t: Any) -> Any:
    # A DTensor parameter's bytes on this rank are its local shard (what the tree saves).
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def _extent(t: Any) -> tuple[int, int, int] | None:
    """``(storage address, first byte, end byte)`` of ``t``'s memory; None if it has none."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    base = int(storage.data_ptr())
    if base == 0:
        return None
    if t.is_contiguous():
        start = int(t.data_ptr())
        return base, start, start + t.numel() * t.element_size()
    return base, base, base + int(storage.nbytes())  # a strided view: claim its whole storage


def optimizer_tensors(opt: Any) -> list[Any]:
    """The tensors ``opt.step()`` updates: its parameters (a DTensor's local shard) and its state."""
    torch = sys.modules["torch"]
    out = [_local(p) for group in opt.param_groups for p in group["params"] if isinstance(p, torch.Tensor)]
    for st in opt.state.values():
        if isinstance(st, dict):
            out += [_local(v) for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def storage_key(t: Any) -> tuple[str, int] | None:
    """``(device type, storage address)`` of ``t``; None if it has no memory."""
    ext = _extent(t)
    return (t.device.type, ext[0]) if ext is not None else None


def _owned_extents(optimizers: list[Any]) -> dict[tuple[str, int], list[tuple[int, int, int]]]:
    """Per storage: the byte ranges of the optimizers' tensors, each with its optimizer's index."""
    out: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for i, opt in enumerate(optimizers):
        for t in optimizer_tensors(opt):
            ext = _extent(t)
            if ext is not None:
                out.setdefault((t.device.type, ext[0]), []).append((ext[1], ext[2], i))
    return out


def owners_of(leaves: list[ArrayLeaf], optimizers: list[Any]) -> list[int | None]:
    """Per leaf: the index in ``optimizers`` of one whose parameter or state tensor holds its bytes."""
    extents = _owned_extents(optimizers)
    if not extents:
        return [None] * len(leaves)
    out: list[int | None] = []
    for leaf in leaves:
        owner = None
        if leaf.kind == "torch" and leaf.nbytes > 0:
            ext = _extent(leaf.value)
            ranges = extents.get((leaf.value.device.type, ext[0])) if ext is not None else None
            if ranges is not None and ext is not None:
                owner = next((i for lo, hi, i in ranges if lo <= ext[1] and ext[2] <= hi), None)
        out.append(owner)
    return out


def owned_leaves(leaves: list[ArrayLeaf], optimizers: Iterable[Any]) -> list[bool]:
    """Per leaf: True if its bytes lie inside a parameter or state tensor of ``optimizers``."""
    return [o is not None for o in owners_of(leaves, list(optimizers))]


def _version_of(t: Any) -> int | None:
    try:
        return int(t._version)
    except (RuntimeError, AttributeError):  # inference tensors keep no version counter
        return None


def deferrable(items: Any, leaves: list[ArrayLeaf]) -> tuple[list[bool], list[Any]] | None:
    """Per leaf: whether it may be copied after the save returns, and the optimizers owning
    those leaves (whose steps must wait for the copy); None when no leaf may.

    Owned (see :func:`owners_of`), with a readable version counter (how a change before
    the copy is detected), and copyable by the background copier: a dense CPU tensor whose
    bytes are exactly its values (contiguous, no lazy conjugate or negative bit), or a CUDA
    tensor (copied on a side stream).
    """
    if sys.modules.get("torch") is None:
        return None
    optimizers = find_optimizers(items)
    ids = {id(o) for o in optimizers}
    optimizers += [o for o in known_optimizers() if id(o) not in ids]
    if not optimizers:
        return None
    for o in optimizers:
        note_optimizer(o)
    owners = owners_of(leaves, optimizers)
    defer = [o is not None and _copyable(leaf.value) and _version_of(leaf.value) is not None
             for o, leaf in zip(owners, leaves, strict=True)]
    if not any(defer):
        return None
    used = sorted({o for o, d in zip(owners, defer, strict=True) if d and o is not None})
    return defer, [optimizers[i] for i in used]


def _copyable(t: Any) -> bool:
    if t.device.type == "cuda":
        return True
    return bool(t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg())
