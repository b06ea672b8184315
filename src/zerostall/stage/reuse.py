"""Reuse what the previous save of the same layout computed (training thread).

A save flattens the state, plans the data files, decides which leaves an optimizer owns (those
are copied after the call returns) and lists the copies. For a state whose layout has not changed
since the previous save, all of that comes out the same, so :class:`LayoutCache` keeps it (per
engine, a few layouts, no tensors held) and a later save only checks that it still holds:

* the tree is re-walked along the recorded nodes (:class:`zerostall.tree.Layout`): the same item
  names, container types and dict keys (and key types); Stateful objects' ``state_dict()`` is
  called as always; a DTensor is taken by its key (mesh, placements, global shape and dtype:
  ``zerostall.distributed.dtensor.dtensor_reuse``) and its local shard checked with the plain
  tensors; scalars and other leaves are flattened as usual and must give the recorded leaves; a
  dict of plain tensors is one comparison of its keys;
* every tensor leaf is then checked in bulk, one list comprehension per property compared with the
  recorded list in C: its type, dtype and shape (a tensor of no bytes is also checked as
  :func:`zerostall.tree.add_torch_leaf` does). That is all the plan, the leaf rows and the staging
  views depend on; where the bytes are is read by the stager at every save;
* the deferral (which leaves an optimizer owns: those are copied after the call returns) is
  reused while the optimizers found in the tree are the same objects in the same order, no
  optimizer has been seen stepping since (one that is gone changes nothing unless it was an
  owner), its owners are still known, these keep their parameters (by identity), param groups and
  ``capturable`` settings, and the deferred leaves keep their data pointers and contiguity and
  still have a version counter. Ownership is decided by memory, so these fix it.

What counts as changed, and makes that save take the full path (flatten, plan lookup, ownership),
after which its layout is the one kept: a new or removed parameter, buffer or optimizer state key;
a resized or re-typed tensor; a scalar or string that became a tensor (or the reverse); a
different container type or key type; a registered handler or flattener added or removed. What
changes only the deferral (recomputed for that save, the layout still reused): a ``.data`` swap
or any reallocation of a deferred leaf (its data pointer moves), a tensor made non-contiguous in
place, another optimizer object, a parameter added to or removed from a param group, a changed
``capturable``. A changed scalar value (a step count, a learning rate) changes only the
manifest's nodes: the reused save records it, as do new tensor objects of the same type, dtype
and shape (an RNG state taken at each save). Not checked: a tensor turned, in place and at the
same address, into a lazy conjugate or negative view (no public API does that; layouts with
complex tensors are never kept).

The checks read a few attributes per tensor (about 0.1 us each here); everything else costs per
container or per optimizer parameter, not per leaf. A cached save and a full save of the same
state stage the same bytes under the same plan: the checkpoints are identical
(tests/unit/test_reuse.py).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from zerostall.messages import LeafRow
from zerostall.stage.ownership import find_optimizers, known_optimizers, note_optimizer
from zerostall.stage.plan import Plan
from zerostall.tree import ArrayLeaf, FlatState, Layout, add_torch_leaf

__all__ = ["LayoutCache", "Reused", "layout_key"]

#: a deferral: per leaf, copied after the call? and the optimizers owning those leaves
Split = tuple[list[bool], list[Any]] | None
#: computes a deferral the full way (``zerostall.stage.overlap.deferrable_any``)
Compute = Callable[[Any, list[ArrayLeaf]], Split]


class _Entry:
    """One layout's reusable work and what checks it (no tensor is referenced)."""

    def __init__(self, layout: Layout, plan: Plan, rows: tuple[LeafRow, ...], rank: int,
                 leaves: list[ArrayLeaf]) -> None:
        self.layout = layout
        self.plan = plan
        self.rows = rows
        self.rank = rank
        idx = [i for i, leaf in enumerate(leaves) if leaf.kind == "torch"]
        self.all_torch = len(idx) == len(leaves)
        #: the tensor leaves' positions (None: every leaf)
        self.torch_idx: list[int] | None = None if self.all_torch else idx
        tv = [leaves[i].value for i in idx]
        self.types = list(map(type, tv))
        self.dtypes = [t.dtype for t in tv]
        self.shapes = [t.shape for t in tv]
        #: plain tensors of no bytes: checked one by one as a flatten would (a meta tensor...)
        self.empty = [i for i in idx if leaves[i].nbytes == 0 and layout.fast[i]]
        #: the deferral kept, replaced whole (saves on two threads may race): see :class:`_Deferral`
        self.deferral: _Deferral | None = None


@dataclass(frozen=True)
class _Deferral:
    """A deferral (``defer`` None: no leaf deferred), valid while the optimizers found in the tree
    are ``found`` (ids, in order), no optimizer outside ``listed`` is known, the owners are still
    known, the fingerprint of the found ones and the owners is ``fingerprint``, and the
    ``deferred`` leaves keep their data pointers and contiguity.

    An optimizer seen stepping for the first time may own leaves: the deferral is recomputed. One
    that is gone (collected) changes nothing unless it was an owner."""

    found: list[int]
    listed: frozenset[int]
    owners: list[int]  # ids of the owning optimizers, in the deferral's order
    fingerprint: list[Any]
    defer: list[bool] | None
    deferred: list[int]
    ptrs: list[int]
    contiguous: list[bool]


@dataclass(frozen=True)
class Reused:
    """A save of a known layout: its flattened state, plan and leaf rows, as the full path makes them."""

    flat: FlatState
    plan: Plan
    rows: tuple[LeafRow, ...]
    entry: _Entry


def layout_key(items: dict[str, Any]) -> tuple[Any, ...]:
    """Which kept layout a save tries (one per key): item names, each item's type, and a dict
    item's own keys. Costs per item, not per leaf."""
    out: list[Any] = []
    for name, v in items.items():
        out.append(name)
        out.append(type(v))
        if isinstance(v, dict) and len(v) <= 64:
            out.append(tuple(v))
    return tuple(out)


class LayoutCache:
    """The kept layouts of one engine, least recently used dropped past ``size``."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()  # saves may run on several threads
        #: saves that reused a kept layout, and those that did not (tests and benchmarks read them)
        self.hits = 0
        self.misses = 0
        #: saves whose deferral was reused (a subset of ``hits``)
        self.deferrals_reused = 0

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: tuple[Any, ...], items: dict[str, Any], rank: int,
               states: dict[int, tuple[Any, Any]]) -> Reused | None:
        """The reused work for ``items`` if its layout is the kept one for ``key``, else None.

        After a None, ``states`` holds the ``state_dict()`` results the walk obtained: pass it to
        :func:`~zerostall.tree.flatten`, so that none is called twice (:meth:`Layout.rewalk`).

        Raises:
            UnsupportedLeafError: a leaf flattened as usual cannot be saved (as :func:`flatten`).
        """
        with self._lock:
            entry = self._entries.get(key)
        walked = entry.layout.rewalk(items, states) if entry is not None and entry.rank == rank else None
        if entry is None or walked is None or not _same_tensors(entry, walked[1]):
            self.misses += 1
            return None
        nodes, values, others = walked
        with self._lock:
            self.hits += 1
            if key in self._entries:
                self._entries.move_to_end(key)
        return Reused(entry.layout.flat(nodes, values, others), entry.plan, entry.rows, entry)

    def remember(self, key: tuple[Any, ...], flat: FlatState, plan: Plan, rows: tuple[LeafRow, ...], rank: int,
                 generation: int) -> _Entry | None:
        """Keep ``flat``'s layout (just saved the full way) for the saves that follow; None when
        it is not kept (a complex tensor: see the module docstring)."""
        torch = sys.modules.get("torch")
        entry: _Entry | None = None
        if torch is not None and not any(leaf.kind == "torch" and leaf.value.is_complex() for leaf in flat.leaves):
            try:
                entry = _Entry(Layout(flat, generation), plan, rows, rank, flat.leaves)
            except (RuntimeError, NotImplementedError, AttributeError, TypeError):  # a tensor without metadata
                entry = None
        with self._lock:
            if entry is None:
                self._entries.pop(key, None)
                return None
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return entry

    def deferral(self, entry: _Entry | None, items: Any, leaves: list[ArrayLeaf], compute: Compute) -> Split:
        """``compute(items, leaves)``, or the deferral it gave for ``entry``'s layout while the
        optimizers are unchanged (see the module docstring). Layouts with leaves other than
        tensors are always computed (a registered background source decides per value)."""
        if entry is None or not entry.all_torch:
            return compute(items, leaves)
        found = find_optimizers(items)
        ids = {id(o) for o in found}
        optimizers = found + [o for o in known_optimizers() if id(o) not in ids]
        by_id = {id(o): o for o in optimizers}
        kept = entry.deferral
        if kept is not None and [id(o) for o in found] == kept.found and kept.listed.issuperset(by_id) \
                and all(i in by_id for i in kept.owners):
            owners = [by_id[i] for i in kept.owners]
            try:
                deferred = [leaves[i].value for i in kept.deferred]
                same = _fingerprint(found + owners) == kept.fingerprint \
                    and [t.data_ptr() for t in deferred] == kept.ptrs \
                    and [t.is_contiguous() for t in deferred] == kept.contiguous
                for t in deferred:
                    t._version  # noqa: B018 - raises for an inference tensor (no version counter)
            except RuntimeError:
                same = False
            if same:
                for o in found:
                    note_optimizer(o)
                self.deferrals_reused += 1
                return (kept.defer, owners) if kept.defer is not None else None
        split = compute(items, leaves)
        entry.deferral = None
        owner_ids = [id(o) for o in split[1]] if split is not None else []
        fp = _fingerprint(found + (split[1] if split is not None else []))
        if fp is None:
            return split
        picked = [i for i, d in enumerate(split[0]) if d] if split is not None else []
        deferred = [leaves[i].value for i in picked]
        entry.deferral = _Deferral([id(o) for o in found], frozenset(by_id), owner_ids, fp,
                                   split[0] if split is not None else None,
                                   picked, [t.data_ptr() for t in deferred], [t.is_contiguous() for t in deferred])
        return split


_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")


def _same_tensors(entry: _Entry, values: list[Any]) -> bool:
    """Whether the tensor leaves in ``values`` have the recorded type, dtype and shape (each one
    list comprehension, compared in C): what the plan, the rows and the staging views depend on.
    Where the bytes are (device, address, strides) is read by the stager at every save and
    checked by :meth:`LayoutCache.deferral` for the leaves copied after the call."""
    tv = values if entry.torch_idx is None else [values[i] for i in entry.torch_idx]
    try:
        if list(map(type, tv)) != entry.types or list(map(_DTYPE, tv)) != entry.dtypes \
                or list(map(_SHAPE, tv)) != entry.shapes:
            return False
        for i in entry.empty:
            leaf = entry.layout.leaves[i]
            add_torch_leaf(values[i], leaf.key, [])  # raises what a flatten would (a meta tensor...)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False
    return True


def _fingerprint(optimizers: list[Any]) -> list[Any] | None:
    """What the ownership of leaves depends on besides the leaves' own memory (checked by
    :func:`_same_tensors`), per optimizer: its identity, its param groups' sizes and
    ``capturable`` settings, its parameters' identities; None if they cannot be listed.

    A parameter's ``.data`` swap needs no check here: the ownership of a leaf is decided by its
    bytes lying inside an optimizer's tensor, and a leaf that aliases the parameter moves with it.
    """
    out: list[Any] = []
    try:
        for o in optimizers:
            groups = o.param_groups
            out.append(id(o))
            out.append([len(g["params"]) for g in groups])
            out.append([bool(g.get("capturable", False)) for g in groups])
            out.append([id(p) for g in groups for p in g["params"]])
    except Exception:  # noqa: BLE001 - a foreign optimizer-like object: computed every save
        return None
    return out
