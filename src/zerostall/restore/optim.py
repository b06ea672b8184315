"""Restoring a freshly built torch optimizer: its state laid out like its parameters.

A restarted job builds its optimizer anew, so the optimizer has no state when the checkpoint is
loaded into it, and its ``state_dict()`` asks for no moments. Restored without a template, the
moments would come back as new contiguous tensors: for a ``channels_last`` parameter (a CNN) the
fused AdamW kernel then pairs the elements of parameter and moments by memory position and trains
on silently wrong moments; for a DTensor parameter (FSDP2) every rank would hold the whole global
moments as plain tensors and the next ``step()`` fails in DTensor dispatch.

:func:`optimizer_template` gives each saved state entry of a parameter's shape an uninitialized
tensor made by ``torch.empty_like(param)`` (same strides, device and, for a DTensor, placement),
so the load fills it in place (each rank only its box). The optimizer is not touched before the
load: DCP's ``set_optimizer_state_dict`` steps it once with zero gradients instead.
"""

from __future__ import annotations

from typing import Any

from zerostall.dtypes import to_torch_dtype
from zerostall.restore.plan import ReadPlanner, register_stateful_template

__all__ = ["optimizer_template"]


def _is_torch_optimizer(obj: Any) -> bool:
    return any(c.__name__ == "Optimizer" and c.__module__ == "torch.optim.optimizer" for c in type(obj).__mro__)


def _fields(node: Any) -> dict[Any, Any] | None:
    if isinstance(node, dict) and node.get("type") == "dict":
        return dict(zip(node["keys"], node["values"], strict=True))
    return None


def _shape_dtype(planner: ReadPlanner, node: Any) -> tuple[tuple[int, ...], str] | None:
    """The saved shape and dtype name of an array or sharded node (None for anything else)."""
    if not isinstance(node, dict):
        return None
    if node.get("type") == "sharded":
        return tuple(int(s) for s in node["shape"]), str(node["dtype"])
    if node.get("type") == "array":
        index = node.get("leaf")
        if isinstance(index, int) and 0 <= index < len(planner.m.leaves):
            leaf = planner.m.leaves[index]
            return tuple(leaf.shape), leaf.dtype
    return None


def optimizer_template(planner: ReadPlanner, target: Any, node: dict[str, Any]) -> dict[str, Any] | None:
    """The template to restore a torch optimizer through (None: not a torch optimizer, or nothing to add).

    Its ``state_dict()``, plus, for every saved state entry of a parameter that has no state yet,
    ``torch.empty_like(param, dtype=saved dtype)`` for each field of the parameter's shape
    (``exp_avg``, ``momentum_buffer``, ...). Scalars (``step``) and fields of other shapes come
    back as saved, as before.
    """
    if not _is_torch_optimizer(target):
        return None
    saved = _fields(node)
    state = _fields(saved.get("state")) if saved is not None else None
    if state is None:
        return None
    import torch

    params = [p for group in target.param_groups for p in group["params"]]
    tmpl: dict[str, Any] = target.state_dict()
    added = False
    for index, entry in state.items():
        fields = _fields(entry)
        if fields is None or not isinstance(index, int) or not 0 <= index < len(params) or index in tmpl["state"]:
            continue
        param = params[index]
        boxes = {}
        for name, sub in fields.items():
            found = _shape_dtype(planner, sub)
            if name == "step" or found is None or found[0] != tuple(param.shape) or param.device.type == "meta":
                continue
            boxes[name] = torch.empty_like(param, dtype=to_torch_dtype(found[1]), requires_grad=False)
        if boxes:
            tmpl["state"][index] = boxes
            added = True
    return tmpl if added else None


register_stateful_template(optimizer_template)
