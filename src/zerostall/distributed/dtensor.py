"""DTensor: saved as its local shard plus its box in the global tensor; loaded by box intersection.

One array type (:func:`zerostall.arraytypes.register_array_type`) says both sides.

Saving (training thread, its ``flatten``): a ``sharded`` tree node with the global shape and dtype and one shard ``{offset, shape, leaf}``
per rank; rank 0's writer merges every rank's shards into one list (identical boxes, as under
``Replicate``, once). A shard of a DTensor placed only with ``Shard`` is marked not shared: no
other rank holds those bytes, so the writer does not hash them.

Loading (any number of ranks, its ``read``): each rank's template DTensor asks for its local box
(``ReadPlanner.into_tensor(box=)``); :class:`zerostall.restore.ReadPlanner` reads only the rows of
the saved shards that intersect it. Nothing here imports torch at module load.
"""

from __future__ import annotations

from typing import Any

from zerostall.arraytypes import ArrayType, register_array_type
from zerostall.errors import UnsupportedLeafError
from zerostall.restore import TemplateBox
from zerostall.tree import ArrayLeaf, add_torch_leaf

__all__ = ["flatten_dtensor", "dtensor_reuse", "local_box", "is_dtensor_type"]


def is_dtensor_type(t: type) -> bool:
    """Whether ``t`` is torch's DTensor (matched by name: this module must not import torch)."""
    return t.__name__ == "DTensor" and t.__module__.startswith("torch.distributed")


def local_box(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global offset, local shape)`` of a DTensor's local shard on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def flatten_dtensor(dt: Any, key: str, leaves: list[ArrayLeaf]) -> dict[str, Any]:
    """The ``sharded`` node of ``dt``: its local shard as a leaf, with its box.

    Raises:
        UnsupportedLeafError: ``dt`` has a ``Partial`` placement (no saved value exists).
    """
    if any(p.is_partial() for p in dt.placements):
        raise UnsupportedLeafError("a DTensor with a Partial placement has no saved value; redistribute it "
                                   "to Shard or Replicate first", key=key)
    local = dt.to_local()
    offset, shape = local_box(dt)
    if tuple(local.shape) != shape:  # pragma: no cover - torch computes both
        raise UnsupportedLeafError(f"local shard shape {tuple(local.shape)} differs from its box {shape}", key=key)
    # Shard-only placements: no other rank holds these bytes, so the writer need not hash them.
    node = add_torch_leaf(local.detach(), key, leaves, shared=not all(p.is_shard() for p in dt.placements))
    shard: dict[str, Any] = {"offset": list(offset), "shape": list(shape), "leaf": node["leaf"]}
    return {"type": "sharded", "kind": "torch", "dtype": leaves[-1].dtype, "shape": [int(s) for s in dt.shape],
            "shards": [shard]}


def dtensor_reuse(dt: Any) -> tuple[Any, Any]:
    """``(key, local shard)`` of ``dt`` for a save of a kept layout (:attr:`zerostall.arraytypes.ArrayType.reuse`):
    the node :func:`flatten_dtensor` makes depends only on the mesh, the placements and the global
    shape and dtype (the box is computed from them), and the leaf on the local shard, whose type,
    dtype and shape the save checks in bulk. A few attribute reads instead of the box's computation."""
    spec = dt._spec
    meta = spec.tensor_meta
    return (spec.mesh, spec.placements, meta.shape, meta.dtype), dt._local_tensor


def _template_box(dt: Any) -> TemplateBox:
    offset, shape = local_box(dt)
    return TemplateBox(offset=offset, shape=shape, local=dt.to_local())


def _read(planner: Any, node: dict[str, Any], tmpl: Any, key: str) -> Any:
    """A template DTensor receives its own box of the saved global tensor."""
    return planner.into_tensor(node, tmpl, key, box=_template_box(tmpl) if node["type"] == "sharded" else None)


register_array_type(ArrayType(name="torch.distributed.tensor.DTensor", matches=is_dtensor_type, flatten=flatten_dtensor,
                              reuse=dtensor_reuse, read=_read))
