"""JAX: ``jax.Array`` leaves and JAX pytrees in every save and load function and the Checkpointer.

Nothing to call: :mod:`zerostall` loads this module at the first save or load after ``jax`` has
been imported (``import zerostall.integrations.jax`` does it explicitly). It registers two hooks:

Saving (training thread, a :func:`zerostall.tree.register_flattener` hook):

* a ``jax.Array`` on one device is an ordinary array leaf; its bytes are copied into the staging
  buffer during ``save_*_async`` straight from the device buffer (a zero-copy host view on CPU;
  on an accelerator the device-to-host transfers of all leaves are started first with
  ``copy_to_host_async`` and each is waited for when its turn to be copied comes). JAX arrays are
  immutable, but a step that donates them (``donate_argnums``) frees their buffers, so the copy
  is finished before ``save_*_async`` returns: a donating step right after it cannot tear the save.
* a ``jax.Array`` over several devices is a ``sharded`` node (like a DTensor): each addressable
  shard with ``replica_id == 0`` is one leaf with its box in the global array, so every byte is
  written once however the array is replicated.
* any other registered pytree node (flax ``struct`` dataclasses, ``TrainState``, classes
  registered with ``jax.tree_util.register_pytree_node`` / ``register_dataclass``) is saved as a
  dict of its children, named by their key paths (field names, dict keys, indices). Optax states
  are named tuples and already are a zerostall container. Static fields are not saved.

Loading (a :func:`zerostall.restore.register_node_reader` hook):

* a template ``jax.Array`` or ``jax.ShapeDtypeStruct`` gets a new ``jax.Array`` with the
  template's sharding (a ``ShapeDtypeStruct`` without one: the default device). Each distinct
  box the local devices need is read once, from whichever saved shards intersect it, so the mesh
  and sharding may differ from the ones at save time, and a checkpoint saved from torch loads too.
  The bytes go into fresh host buffers handed to ``jax.device_put``.
* a template pytree node is rebuilt with the template's tree structure (and static fields) from
  the saved dict of its children.
* without a template, arrays saved from JAX come back as numpy arrays (bf16 / fp8 as
  ``ml_dtypes`` types), a sharded one assembled whole, and pytree nodes as dicts.

Example::

    >>> import jax.numpy as jnp, optax, zerostall
    >>> params = {"w": jnp.ones((4, 4))}
    >>> state = {"params": params, "opt": optax.adam(1e-3).init(params)}
    >>> zerostall.save_pytree("/tmp/ck", state)                              # doctest: +SKIP
    >>> state = zerostall.load_pytree("/tmp/ck", state)                     # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax._src import tree_util as _jax_tree_util

from zerostall.dtypes import ITEMSIZE, to_numpy_dtype, torch_dtype_name
from zerostall.errors import CorruptCheckpointError, MismatchError, MissingKeyError, UnsupportedLeafError
from zerostall.restore import ReadPlanner, ReadRequest, Thunk, register_node_reader
from zerostall.tree import ArrayLeaf, flatten_child, key_join, register_flattener

__all__ = ["is_jax_array_type", "is_pytree_node_type", "numpy_dtype", "flatten_array", "flatten_pytree_node"]

#: safetensors names of the types numpy itself lacks, as the ml_dtypes types jax uses
_ML_DTYPES: dict[str, Any] = {
    "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}
#: containers zerostall walks itself (jax registers them too)
_BUILTIN_NODES = (dict, list, tuple, type(None))


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a safetensors dtype name, with ml_dtypes for bf16 and fp8."""
    ml = _ML_DTYPES.get(name)
    return np.dtype(ml) if ml is not None else to_numpy_dtype(name)


def is_jax_array_type(t: type) -> bool:
    return issubclass(t, jax.Array)


def is_pytree_node_type(t: type) -> bool:
    """A type registered as a pytree node with jax (not one of the containers zerostall walks)."""
    # jax has no public "is this type registered"; its Python-side registry mirrors the C++ one
    return t in _jax_tree_util._registry and not issubclass(t, _BUILTIN_NODES)


def _dtype_name(dtype: Any, key: str) -> str:
    # jax's dtype names (bfloat16, float8_e4m3fn, ...) are torch's, which dtypes already maps
    name = torch_dtype_name(np.dtype(dtype).name)
    if name is None:
        raise UnsupportedLeafError(f"jax dtype {dtype} has no safetensors equivalent", key=key)
    return name


class _HostView:
    """What the stager copies from: the array's host bytes, typed as the staging buffer's view.

    ``np.copyto`` converts it at staging time, so the device-to-host wait happens there (after
    every leaf's transfer was started) and no host copy is made on CPU.
    """

    __slots__ = ("array", "view")

    def __init__(self, array: Any, view: np.dtype[Any]) -> None:
        self.array = array
        self.view = view

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        host = np.asarray(self.array)
        return host if host.dtype == self.view else host.view(self.view)


def _host_leaf(a: Any, key: str, name: str, leaves: list[ArrayLeaf], *, shared: bool = True) -> int:
    if a.is_deleted():
        raise UnsupportedLeafError("this jax.Array was deleted or donated to a computation before the save",
                                   key=key)
    if any(d.platform != "cpu" for d in a.sharding.device_set):
        a.copy_to_host_async()  # all transfers in flight before staging waits for the first one
    shape = tuple(int(s) for s in a.shape)
    leaves.append(ArrayLeaf(key, "numpy", name, shape, math.prod(shape) * ITEMSIZE[name],
                            _HostView(a, to_numpy_dtype(name)), shared))
    return len(leaves) - 1


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, extent)`` of a shard's index (a tuple of slices) in an array of ``shape``."""
    spans = [sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True)]
    return tuple(a for a, _ in spans), tuple(b - a for a, b in spans)


def flatten_array(a: Any, key: str, leaves: list[ArrayLeaf]) -> dict[str, Any]:
    """The node of a ``jax.Array``: one leaf, or a ``sharded`` node of its replica-0 local shards.

    Raises:
        UnsupportedLeafError: a dtype safetensors lacks (e.g. int4), a deleted (donated) array.
    """
    name = _dtype_name(a.dtype, key)
    if len(a.sharding.device_set) == 1:
        return {"type": "array", "leaf": _host_leaf(a, key, name, leaves)}
    shape = tuple(int(s) for s in a.shape)
    shards: list[dict[str, Any]] = []
    for sh in a.addressable_shards:
        if sh.replica_id != 0:
            continue
        offset, ext = _box(sh.index, shape)
        label = ",".join(map(str, offset))
        li = _host_leaf(sh.data, f"{key}@{label}", name, leaves, shared=False)
        shards.append({"offset": list(offset), "shape": list(ext), "leaf": li})
    return {"type": "sharded", "kind": "jax", "dtype": name, "shape": list(shape), "shards": shards}


def _child_label(entry: Any) -> str | int:
    for attr in ("name", "key", "idx"):  # GetAttrKey, DictKey / FlattenedIndexKey, SequenceKey
        if hasattr(entry, attr):
            v = getattr(entry, attr)
            return v if type(v) in (str, int) else str(v)
    return str(entry)


def _children(obj: Any) -> tuple[list[tuple[str | int, Any]], Any]:
    """One level of a pytree node: its ``(label, child)`` pairs and its treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    out: list[tuple[str | int, Any]] = []
    for path, child in pairs:
        if len(path) != 1:  # pragma: no cover - is_leaf stops at the first level
            raise UnsupportedLeafError(f"unexpected pytree key path {path}", key="")
        out.append((_child_label(path[0]), child))
    return out, treedef


def flatten_pytree_node(obj: Any, key: str, leaves: list[ArrayLeaf]) -> dict[str, Any]:
    """A registered pytree node as a dict of its children (static fields stay out)."""
    pairs, _ = _children(obj)
    labels = [label for label, _ in pairs]
    if len(set(labels)) != len(labels):
        raise UnsupportedLeafError(f"pytree node {type(obj).__qualname__} has children with equal names "
                                   f"{labels}", key=key)
    values = [flatten_child(child, key_join(key, label), leaves) for label, child in pairs]
    return {"type": "dict", "keys": labels, "values": values}


# -- loading ---------------------------------------------------------------------------------

Shard = tuple[tuple[int, ...], tuple[int, ...], int]  # saved box offset, extent, leaf index


def _saved_shards(planner: ReadPlanner, node: dict[str, Any]) -> tuple[str, tuple[int, ...], list[Shard]]:
    if node["type"] == "array":
        leaf = planner.m.leaves[node["leaf"]]
        return leaf.dtype, leaf.shape, [((0,) * len(leaf.shape), leaf.shape, node["leaf"])]
    shards = [(tuple(sh["offset"]), tuple(sh["shape"]), sh["leaf"]) for sh in node["shards"]]
    return node["dtype"], tuple(node["shape"]), shards


def _mv(a: Any) -> memoryview:
    return memoryview(a)


def _plan_box(planner: ReadPlanner, key: str, name: str, shards: list[Shard],
              lo: tuple[int, ...], ext: tuple[int, ...]) -> Callable[[], np.ndarray]:
    """Queue the reads that fill box ``lo``/``ext`` of the saved array; the thunk returns it.

    A saved shard whose intersection with the box is a run of whole rows of both is read straight
    into the box's memory (the common case: same sharding, or resharding along the first axis);
    otherwise its covering rows go to a temporary and the intersection is copied out.
    """
    dtype = numpy_dtype(name)
    itemsize = ITEMSIZE[name]
    dest = np.empty(ext, dtype=dtype)
    flat = dest.reshape(-1).view(np.uint8)
    hi = tuple(a + b for a, b in zip(lo, ext, strict=True))
    copies: list[tuple[np.ndarray, tuple[slice, ...], tuple[slice, ...]]] = []
    covered = 0
    for so, ss, li in shards:
        leaf = planner.m.leaves[li]
        if leaf.shape != ss or leaf.dtype != name:
            raise CorruptCheckpointError(f"shard leaf {leaf.key!r} has shape {list(leaf.shape)} {leaf.dtype}, "
                                         f"its box says {list(ss)} {name}", path=planner.path, key=key)
        ilo = tuple(max(a, b) for a, b in zip(lo, so, strict=True))
        ihi = tuple(min(a, b + c) for a, b, c in zip(hi, so, ss, strict=True))
        if any(a >= b for a, b in zip(ilo, ihi, strict=True)):
            continue
        n = math.prod(b - a for a, b in zip(ilo, ihi, strict=True))
        covered += n
        if not ext:  # 0-d: the one element
            a, b, row = 0, 1, itemsize
        else:
            a, b, row = ilo[0] - so[0], ihi[0] - so[0], math.prod(ss[1:]) * itemsize
        whole = a == 0 and b == (ss[0] if ext else 1)
        part = replace(leaf, offset=leaf.offset + a * row, nbytes=(b - a) * row, crc32c=leaf.crc32c if whole else None)
        if not part.nbytes:
            continue
        planner._leaf(li)  # the data file is checked before anything is read from it
        if ss[1:] == ext[1:] and so[1:] == lo[1:]:  # whole rows of both: straight into the box
            start = (ilo[0] - lo[0]) * row if ext else 0
            planner.reads.append(ReadRequest(part, _mv(flat[start:start + part.nbytes]), verify=whole))
            continue
        tmp = np.empty((b - a, *ss[1:]), dtype=dtype)
        planner.reads.append(ReadRequest(part, _mv(tmp.reshape(-1).view(np.uint8)), verify=whole))
        src = (slice(None), *(slice(x - o, y - o) for x, y, o in zip(ilo[1:], ihi[1:], so[1:], strict=True)))
        dst = tuple(slice(x - o, y - o) for x, y, o in zip(ilo, ihi, lo, strict=True))
        copies.append((tmp, src, dst))
    if covered != math.prod(ext):
        raise CorruptCheckpointError(f"the saved shards cover {covered} of the {math.prod(ext)} elements this "
                                     "process needs", path=planner.path, key=key)

    def assemble() -> np.ndarray:
        for tmp, src, dst in copies:
            dest[dst] = tmp[src]
        return dest
    return assemble


def _check(planner: ReadPlanner, key: str, name: str, shape: tuple[int, ...], tmpl: Any) -> None:
    want = torch_dtype_name(np.dtype(tmpl.dtype).name)
    if want != name:
        raise MismatchError(f"dtype differs: checkpoint has {name}, template has {tmpl.dtype}",
                            path=planner.path, key=key)
    if tuple(tmpl.shape) != shape:
        raise MismatchError(f"shape differs: checkpoint has {list(shape)}, template has {list(tmpl.shape)}",
                            path=planner.path, key=key)


def _into_jax(planner: ReadPlanner, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
    name, shape, shards = _saved_shards(planner, node)
    _check(planner, key, name, shape, tmpl)
    sharding = getattr(tmpl, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], Callable[[], np.ndarray]] = {}
    wanted: list[tuple[Any, tuple[tuple[int, ...], tuple[int, ...]]]] = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = _box(tuple(index or ()), shape)
        if box not in boxes:  # replicas on this host share one read
            boxes[box] = _plan_box(planner, key, name, shards, *box)
        wanted.append((device, box))

    def build() -> Any:
        host = {box: th() for box, th in boxes.items()}
        arrays = [jax.device_put(host[box], device) for device, box in wanted]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return build


def _into_pytree_node(planner: ReadPlanner, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
    if node["type"] != "dict":
        raise MismatchError(f"checkpoint has a {node['type']} here but the template has {type(tmpl).__name__}",
                            path=planner.path, key=key)
    saved = dict(zip(node["keys"], node["values"], strict=True))
    pairs, treedef = _children(tmpl)
    parts: list[Thunk] = []
    for label, child in pairs:
        if label not in saved:
            raise MissingKeyError("the template asks for a key the checkpoint does not have",
                                  path=planner.path, key=key_join(key, label))
        parts.append(planner.build(saved[label], child, key_join(key, label)))
    return lambda: jax.tree_util.tree_unflatten(treedef, [p() for p in parts])


def _into_numpy(planner: ReadPlanner, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
    """A sharded JAX array into numpy: assembled whole (into ``tmpl`` when it is an array)."""
    name, shape, shards = _saved_shards(planner, node)
    if tmpl is not None:
        _check(planner, key, name, shape, tmpl)
    whole = _plan_box(planner, key, name, shards, (0,) * len(shape), shape)
    if tmpl is None or not tmpl.flags.writeable:
        return whole

    def fill() -> Any:
        np.copyto(tmpl, whole())
        return tmpl
    return fill


def _is_ml_dtype(tmpl: Any) -> bool:
    return isinstance(tmpl, np.ndarray) and any(tmpl.dtype == t for t in _ML_DTYPES.values())


def _reader(planner: ReadPlanner, node: dict[str, Any], tmpl: Any, key: str) -> Thunk | None:
    t = node["type"]
    if isinstance(tmpl, (jax.Array, jax.ShapeDtypeStruct)):
        if t not in ("array", "sharded"):
            raise MismatchError(f"checkpoint has a {t} here but the template has an array",
                                path=planner.path, key=key)
        return _into_jax(planner, node, tmpl, key)
    if t == "sharded" and node.get("kind") == "jax" and (tmpl is None or isinstance(tmpl, np.ndarray)):
        return _into_numpy(planner, node, tmpl, key)
    if t == "array" and (_is_ml_dtype(tmpl) if tmpl is not None else
                         planner.m.leaves[node["leaf"]].kind == "numpy"
                         and planner.m.leaves[node["leaf"]].dtype in _ML_DTYPES):
        return _into_numpy(planner, node, tmpl, key)  # bf16 / fp8 as ml_dtypes, which numpy alone lacks
    if tmpl is not None and is_pytree_node_type(type(tmpl)):
        return _into_pytree_node(planner, node, tmpl, key)
    return None


register_flattener(is_pytree_node_type, flatten_pytree_node)
register_flattener(is_jax_array_type, flatten_array)
register_node_reader(_reader)
