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

import bisect
import sys
import weakref
from collections.abc import Iterable
from typing import Any

from zerostall.tree import ArrayLeaf

__all__ = ["find_optimizers", "note_optimizer", "known_optimizers", "owned_leaves", "owners_of", "deferrable",
           "optimizer_tensors", "span", "Spans"]

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
    # the leaves of a large state are mostly plain tensors: one set lookup each instead of three isinstance
    plain = {torch.Tensor, torch.nn.Parameter, int, float, str, bool, type(None)}
    found: list[Any] = []
    stack: list[Any] = [items]
    seen = 0
    while stack and seen < _MAX_WALK:
        obj = stack.pop()
        seen += 1
        if type(obj) in plain:
            continue
        if isinstance(obj, (dict, list, tuple)):
            values = obj.values() if isinstance(obj, dict) else obj
            # a dict of plain tensors (a state_dict): one pass over its types, not a step per leaf
            if len(values) > 16 and set(map(type, values)) <= plain:
                continue
            stack.extend(values)
        elif isinstance(obj, optimizer_type):
            found.append(obj)
    return found


def _local(t: Any) -> Any:
    # A DTensor parameter's bytes on this rank are its local shard (what the tree saves).
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def span(t: Any) -> tuple[bool, int, int] | None:
    """``(on CUDA?, first byte address, end address)`` of ``t``'s memory; None if it has none.

    A contiguous tensor's own bytes; a strided one claims its whole storage. Addresses of two
    live allocations of one device never overlap, so no storage identity is needed (CPU tensors
    that alias one buffer do share those bytes).
    """
    try:
        if t.is_contiguous():
            lo = int(t.data_ptr())
            hi = lo + t.numel() * t.element_size()
        else:
            storage = t.untyped_storage()
            lo = int(storage.data_ptr())
            hi = lo + int(storage.nbytes())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    if lo == 0 or hi <= lo:
        return None
    return bool(t.is_cuda), lo, hi


class Spans:
    """Byte ranges, each with a tag, searchable by containment and by overlap."""

    def __init__(self) -> None:
        self._items: dict[bool, list[tuple[int, int, int]]] = {False: [], True: []}
        self._starts: dict[bool, list[int]] = {}
        self._max_end: dict[bool, list[int]] = {}  # running maximum of the ends, in start order

    def add(self, sp: tuple[bool, int, int], tag: int = 0) -> None:
        self._items[sp[0]].append((sp[1], sp[2], tag))
        self._starts.clear()

    def __bool__(self) -> bool:
        return bool(self._items[False] or self._items[True])

    def _sorted(self, cuda: bool) -> tuple[list[tuple[int, int, int]], list[int]]:
        if cuda not in self._starts:
            self._items[cuda].sort()
            self._starts[cuda] = [lo for lo, _, _ in self._items[cuda]]
            ends, top = [], 0
            for _, hi, _ in self._items[cuda]:
                top = max(top, hi)
                ends.append(top)
            self._max_end[cuda] = ends
        return self._items[cuda], self._starts[cuda]

    def containing(self, sp: tuple[bool, int, int]) -> int | None:
        """The tag of a range that holds all of ``sp``, if any."""
        items, starts = self._sorted(sp[0])
        j = bisect.bisect_right(starts, sp[1]) - 1
        # Ranges may nest (a flat parameter and views of it): look at a few that start before.
        for k in range(j, max(j - 8, -1), -1):
            lo, hi, tag = items[k]
            if lo <= sp[1] and sp[2] <= hi:
                return tag
        return None

    def overlaps(self, sp: tuple[bool, int, int]) -> bool:
        _, starts = self._sorted(sp[0])
        j = bisect.bisect_left(starts, sp[2]) - 1  # the last range starting before sp ends
        return j >= 0 and self._max_end[sp[0]][j] > sp[1]


def optimizer_tensors(opt: Any) -> list[Any]:
    """The tensors ``opt.step()`` updates: its parameters (a DTensor's local shard) and its state."""
    torch = sys.modules["torch"]
    out = [_local(p) for group in opt.param_groups for p in group["params"] if isinstance(p, torch.Tensor)]
    for st in opt.state.values():
        if isinstance(st, dict):
            out += [_local(v) for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def owners_of(leaves: list[ArrayLeaf], optimizers: list[Any]) -> list[int | None]:
    """Per leaf: the index in ``optimizers`` of one whose parameter or state tensor holds its bytes."""
    # Cheapest first, since this runs in every save call (a GPT's 1,268 leaves: ~11 ms on an H200
    # host with spans for all): a leaf that is an optimizer's tensor itself (its state: exp_avg...)
    # by identity; one that starts where an optimizer's tensor starts and ends inside it (a
    # state_dict's detached parameter) by address; only what is left by span containment.
    tensors: list[tuple[Any, int]] = []
    by_id: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for t in optimizer_tensors(opt):
            tensors.append((t, i))
            by_id.setdefault(id(t), i)
    out: list[int | None] = []
    rest: list[int] = []
    for li, leaf in enumerate(leaves):
        owner = None
        if leaf.kind == "torch" and leaf.nbytes > 0:
            owner = by_id.get(id(leaf.value))
            if owner is None:
                rest.append(li)
        out.append(owner)
    if not rest:
        return out
    by_start: dict[tuple[bool, int], tuple[Any, int]] = {}  # (on CUDA?, first byte) -> (tensor, owner)
    for t, i in tensors:
        try:
            by_start.setdefault((bool(t.is_cuda), int(t.data_ptr())), (t, i))
        except (RuntimeError, NotImplementedError, AttributeError):
            continue  # no memory of its own (span() says None too)
    owned: Spans | None = None
    for li in rest:
        sp = span(leaves[li].value)
        if sp is None:
            continue
        hit = by_start.get((sp[0], sp[1]))
        if hit is not None:
            hsp = span(hit[0])
            if hsp is not None and hsp[1] == sp[1] and sp[2] <= hsp[2]:
                out[li] = hit[1]
                continue
        if owned is None:
            owned = Spans()
            for t, i in tensors:
                tsp = span(t)
                if tsp is not None:
                    owned.add(tsp, i)
        out[li] = owned.containing(sp)
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
    graphed = [_graph_capturable(o) for o in optimizers]
    defer = [o is not None and not graphed[o] and _copyable(leaf.value) and _version_of(leaf.value) is not None
             for o, leaf in zip(owners, leaves, strict=True)]
    if not any(defer):
        return None
    used = sorted({o for o, d in zip(owners, defer, strict=True) if d and o is not None})
    return defer, [optimizers[i] for i in used]


def _graph_capturable(optimizer: Any) -> bool:
    """Whether ``optimizer`` is set up for CUDA-graph capture (``capturable=True`` in a group).

    A step captured in a CUDA graph and replayed (``torch.cuda.graph``,
    ``make_graphed_callables``) runs no Python, so no step hook orders it after the copy, and a
    replay moves no version counter, so a tear could not even be detected. Such an optimizer's
    tensors are therefore copied before the save returns, as with blocking staging.
    """
    try:
        return any(isinstance(g, dict) and bool(g.get("capturable", False)) for g in optimizer.param_groups)
    except Exception:  # noqa: BLE001 - a foreign optimizer-like object: it has no such flag
        return False


def _copyable(t: Any) -> bool:
    # is_cuda / is_cpu rather than device.type: no device object per leaf (~0.5 us each)
    if t.is_cuda:
        return True
    return bool(t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg())
