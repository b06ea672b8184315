"""DTensor: saved as its local shard plus its box in the global tensor; loaded by box intersection.

Saving (training thread, from :func:`zerostall.tree.flatten`): a ``sharded`` tree node with the
global shape and dtype and one shard ``{offset, shape, leaf}`` per rank; rank 0's writer merges
every rank's shards into one list (identical boxes, as under ``Replicate``, once).

Loading (any number of ranks): each rank computes its template's local box, finds the saved
shards that intersect it and reads only the rows it needs from each (a contiguous byte range
of the shard: exact rows for dim-0 sharding, the covering row range otherwise), then copies
the box into its local tensor. Without a template the whole global tensor is assembled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from zerostall.dtypes import ITEMSIZE, to_torch_dtype
from zerostall.errors import CorruptCheckpointError, MismatchError, UnsupportedLeafError
from zerostall.tree import ArrayLeaf

__all__ = ["flatten_dtensor", "unhashed_leaves", "plan_sharded", "local_box"]


def local_box(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global offset, local shape)`` of a DTensor's local shard on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def flatten_dtensor(dt: Any, key: str, leaves: list[ArrayLeaf]) -> dict[str, Any]:
    from zerostall.tree import _torch_leaf

    if any(p.is_partial() for p in dt.placements):
        raise UnsupportedLeafError("a DTensor with a Partial placement has no saved value; redistribute it "
                                   "to Shard or Replicate first", key=key)
    local = dt.to_local()
    offset, shape = local_box(dt)
    node = _torch_leaf(local.detach(), key, leaves)
    if tuple(local.shape) != shape:  # pragma: no cover - torch computes both
        raise UnsupportedLeafError(f"local shard shape {tuple(local.shape)} differs from its box {shape}", key=key)
    shard: dict[str, Any] = {"offset": list(offset), "shape": list(shape), "leaf": node["leaf"]}
    if all(p.is_shard() for p in dt.placements):
        shard["unique"] = True  # no other rank holds these bytes: the writer need not hash them
    return {"type": "sharded", "kind": "torch", "dtype": leaves[-1].dtype, "shape": [int(s) for s in dt.shape],
            "shards": [shard]}


def unhashed_leaves(items: dict[str, Any]) -> list[int]:
    """Leaf indices of shards that no other rank can hold (their writer skips hashing them)."""
    out: list[int] = []

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        if node.get("type") == "sharded":
            out.extend(sh["leaf"] for sh in node["shards"] if sh.get("unique"))
            return
        for v in node.get("values", ()):
            walk(v)
    for node in items.values():
        walk(node)
    return out


def plan_sharded(planner: Any, node: dict[str, Any], tmpl: Any, key: str) -> Callable[[], Any]:
    """Plan the reads of a ``sharded`` node into ``tmpl`` (a DTensor, a full tensor, or None)."""
    import torch

    from zerostall.restore.reader import _Read

    gshape = tuple(node["shape"])
    dtype_name = node["dtype"]
    dtype = to_torch_dtype(dtype_name)
    itemsize = ITEMSIZE[dtype_name]
    is_dt = tmpl is not None and type(tmpl).__name__ == "DTensor"
    if tmpl is not None and not isinstance(tmpl, torch.Tensor):
        raise MismatchError(f"checkpoint has a tensor here but the template has {type(tmpl).__name__}",
                            path=planner.path, key=key)
    if tmpl is not None:
        if tmpl.dtype != dtype:
            raise planner._mismatch(key, "dtype", f"{dtype_name} ({dtype})", tmpl.dtype)
        if tuple(tmpl.shape) != gshape:
            raise planner._mismatch(key, "shape", list(gshape), list(tmpl.shape))
    if is_dt:
        dt: Any = tmpl
        lo, ext = local_box(dt)
        dest = dt.to_local()
    else:
        lo, ext = (0,) * len(gshape), gshape
        dest = tmpl if tmpl is not None else torch.empty(gshape, dtype=dtype)
    hi = tuple(a + b for a, b in zip(lo, ext))
    copies: list[tuple[Any, tuple[slice, ...], tuple[slice, ...]]] = []
    covered = 0
    for sh in node["shards"]:
        leaf = planner.m.leaves[sh["leaf"]]
        so, ss = tuple(sh["offset"]), tuple(sh["shape"])
        if leaf.shape != ss or leaf.dtype != dtype_name:
            raise CorruptCheckpointError(f"shard leaf {leaf.key!r} has shape {list(leaf.shape)} {leaf.dtype}, "
                                         f"its box says {list(ss)} {dtype_name}", path=planner.path, key=key)
        ilo = tuple(max(a, b) for a, b in zip(lo, so))
        ihi = tuple(min(a, b + c) for a, b, c in zip(hi, so, ss))
        if any(a >= b for a, b in zip(ilo, ihi)):
            continue
        covered += math.prod(b - a for a, b in zip(ilo, ihi))
        if not gshape:  # a 0-d tensor: one element
            a, b, row = 0, 1, itemsize
        else:
            a, b = ilo[0] - so[0], ihi[0] - so[0]
            row = math.prod(ss[1:]) * itemsize
        tmp = torch.empty((b - a, *ss[1:]) if gshape else (), dtype=dtype)
        whole = a == 0 and b == (ss[0] if gshape else 1)
        part = dataclasses.replace(leaf, offset=leaf.offset + a * row, nbytes=(b - a) * row,
                                   crc32c=leaf.crc32c if whole else None)
        if part.nbytes:
            raw: Any = tmp.reshape(-1).view(torch.uint8).numpy()
            planner.reads.append(_Read(part, memoryview(raw).cast("B"), verify=whole))
        src_idx = (slice(None),) + tuple(slice(x - o, y - o) for x, y, o in zip(ilo[1:], ihi[1:], so[1:]))
        dst_idx = tuple(slice(x - o, y - o) for x, y, o in zip(ilo, ihi, lo))
        copies.append((tmp, src_idx[:len(gshape)], dst_idx))
    if covered != math.prod(ext):
        raise CorruptCheckpointError(f"the saved shards cover {covered} of the {math.prod(ext)} elements this "
                                     "rank needs", path=planner.path, key=key)

    def assemble() -> Any:
        with torch.no_grad():
            for tmp, src_idx, dst_idx in copies:
                if gshape:
                    dest[dst_idx].copy_(tmp[src_idx])
                else:
                    dest.copy_(tmp)
        return tmpl if tmpl is not None else dest
    return assemble
