"""DTensor: saved as its local shard plus its box in the global tensor; loaded by box intersection.

Saving (training thread, a flattener registered with :func:`zerostall.tree.register_flattener`):
a ``sharded`` tree node with the global shape and dtype and one shard ``{offset, shape, leaf}``
per rank; rank 0's writer merges every rank's shards into one list (identical boxes, as under
``Replicate``, once). A shard of a DTensor placed only with ``Shard`` is marked not shared: no
other rank holds those bytes, so the writer does not hash them.

Loading (any number of ranks, a box registered with
:func:`zerostall.restore.register_template_box`): each rank's template DTensor asks for its local
box; :class:`zerostall.restore.ReadPlanner` reads only the rows of the saved shards that
intersect it. Nothing here imports torch at module load.
"""

from __future__ import annotations

from typing import Any

from zerostall.dtypes import to_torch_dtype
from zerostall.errors import UnsupportedLeafError
from zerostall.restore import TemplateBox, register_stateful_template, register_template_box
from zerostall.tree import ArrayLeaf, add_torch_leaf, register_flattener

__all__ = ["flatten_dtensor", "local_box", "is_dtensor_type"]


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


def _template_box(dt: Any) -> TemplateBox:
    offset, shape = local_box(dt)
    return TemplateBox(offset=offset, shape=shape, local=dt.to_local())


def _is_torch_optimizer(obj: Any) -> bool:
    return any(c.__name__ == "Optimizer" and c.__module__ == "torch.optim.optimizer" for c in type(obj).__mro__)


def _fields(node: Any) -> dict[Any, Any] | None:
    return dict(zip(node["keys"], node["values"], strict=True)) if isinstance(node, dict) and \
        node.get("type") == "dict" else None


def optimizer_template(target: Any, node: dict[str, Any]) -> dict[str, Any] | None:
    """The template to restore a torch optimizer over DTensor parameters through (None: not one).

    A freshly built optimizer (the usual resume) has no state yet, so its ``state_dict()`` asks
    for no moments: they would come back as whole global tensors, which ``load_state_dict``
    keeps as plain tensors beside DTensor parameters (every rank holding the full moments, and
    the next ``step()`` failing in DTensor dispatch). Here each saved DTensor state entry whose
    parameter is a DTensor of its global shape gets an uninitialized DTensor placed like that
    parameter, so each rank reads only its box, resharded. The optimizer is not touched before
    the load (unlike DCP's ``set_optimizer_state_dict``, which steps it once with zero grads).
    """
    if not _is_torch_optimizer(target):
        return None
    params = [p for group in target.param_groups for p in group["params"]]
    if not any(is_dtensor_type(type(p)) for p in params):
        return None
    saved = _fields(node)
    state = _fields(saved.get("state")) if saved is not None else None
    if state is None:
        return None
    import torch

    tmpl: dict[str, Any] = target.state_dict()
    for index, entry in state.items():
        fields = _fields(entry)
        if fields is None or not isinstance(index, int) or not 0 <= index < len(params) or index in tmpl["state"]:
            continue
        param = params[index]
        if not is_dtensor_type(type(param)):
            continue
        boxes = {name: torch.empty_like(param, dtype=to_torch_dtype(sub["dtype"]))
                 for name, sub in fields.items()
                 if isinstance(sub, dict) and sub.get("type") == "sharded" and tuple(sub["shape"]) == tuple(param.shape)}
        if boxes:
            tmpl["state"][index] = boxes
    return tmpl


register_flattener(is_dtensor_type, flatten_dtensor)
register_template_box(is_dtensor_type, _template_box)
register_stateful_template(optimizer_template)
