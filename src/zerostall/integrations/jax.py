"""JAX: ``jax.Array`` leaves and JAX pytrees in every save and load function and the Checkpointer.

Nothing to call: :mod:`zerostall` loads this module at the first save or load after ``jax`` has
been imported (``import zerostall.integrations.jax`` does it explicitly). It registers two array
types (:func:`zerostall.arraytypes.register_array_type`), ``jax.Array`` and JAX's pytree nodes,
each once: how to flatten one, how to stage it and how to load into a template of it.

Saving (training thread):

* a ``jax.Array`` on one device is an ordinary array leaf. JAX arrays are immutable, so with
  overlapped staging (the default) ``save_*_async`` only holds a reference to each (and on an
  accelerator starts its device-to-host transfer with ``copy_to_host_async``) and returns; the
  copy into the staging buffer runs on the engine's copier thread (the array type's background
  source, :attr:`zerostall.arraytypes.ArrayType.source`), straight from the device buffer
  (a zero-copy host view on CPU, the finished transfer elsewhere). ``response.wait_staged()``
  waits for it. With ``staging="blocking"`` the same copy runs before the call returns.
* donation (``donate_argnums``) is the one way a saved array can change: the step deletes it.
  On CPU the save call holds a zero-copy host view of each buffer until its copy, and XLA does not
  donate a buffer with an external reference (the step copies its input instead, slowly), so a
  donating step right after the call cannot tear or crash the save. Elsewhere the copier thread
  takes the view when it copies; an array donated before that cannot be read: the save fails
  with :class:`~zerostall.errors.DonatedArrayError` naming the leaf, through the save's response
  like any background failure, and nothing of it is committed. Either way, call
  ``response.wait_staged()`` before a step that donates the saved arrays (or save with
  ``staging="blocking"``).
* a ``jax.Array`` over several devices is a ``sharded`` node (like a DTensor): each addressable
  shard with ``replica_id == 0`` is one leaf with its box in the global array, so every byte is
  written once however the array is replicated.
* any other registered pytree node (flax ``struct`` dataclasses, ``TrainState``, classes
  registered with ``jax.tree_util.register_pytree_node`` / ``register_dataclass``) is saved as a
  dict of its children, named by their key paths (field names, dict keys, indices). Optax states
  are named tuples and already are a zerostall container. Static fields are not saved.

Loading (the array types' ``read``):

* a template ``jax.Array`` or ``jax.ShapeDtypeStruct`` gets a new ``jax.Array`` with the
  template's sharding (a ``ShapeDtypeStruct`` without one: the default device). Each distinct
  box the local devices need is read once, from whichever saved shards intersect it, so the mesh
  and sharding may differ from the ones at save time, and a checkpoint saved from torch loads too.
  The bytes go into fresh host buffers handed to ``jax.device_put``.
* a template pytree node is rebuilt with the template's tree structure (and static fields) from
  the saved dict of its children.
* without a template, arrays saved from JAX come back as numpy arrays (bf16 / fp8 as
  ``ml_dtypes`` types), a sharded one assembled whole, and pytree nodes as dicts: restore's own
  rules (:meth:`zerostall.restore.ReadPlanner.into_numpy`), so also where jax is not imported.

Example::

    >>> import jax.numpy as jnp, optax, zerostall
    >>> params = {"w": jnp.ones((4, 4))}
    >>> state = {"params": params, "opt": optax.adam(1e-3).init(params)}
    >>> zerostall.save_pytree("/tmp/ck", state)                              # doctest: +SKIP
    >>> state = zerostall.load_pytree("/tmp/ck", state)                     # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import datetime
import math
from collections.abc import Callable
from typing import Any

import numpy as np

import zerostall.memcopy as memcopy
from zerostall.errors import MissingDependencyError

try:
    import jax
    import jax.numpy as jnp
    from jax._src import tree_util as _jax_tree_util
except ImportError as _exc:  # only when imported by hand: zerostall loads this module once jax is imported
    raise MissingDependencyError(
        "zerostall.integrations.jax needs the `jax` package, which is not installed: "
        "pip install 'zerostall[jax]'", name=(_exc.name or "jax").split(".")[0]) from _exc

from zerostall.arraytypes import ArrayLeaf, ArrayType, register_array_type
from zerostall.dtypes import ITEMSIZE, to_numpy_dtype, torch_dtype_name
from zerostall.errors import (
    DonatedArrayError,
    InvalidArgumentError,
    MismatchError,
    MissingKeyError,
    UnsupportedLeafError,
)
from zerostall.restore import ReadPlanner, Thunk
from zerostall.restore.plan import plan_box, saved_shards
from zerostall.stage import overlap as _overlap
from zerostall.tree import flatten_child, key_join

__all__ = ["is_jax_array_type", "is_pytree_node_type", "flatten_array", "flatten_pytree_node", "join_processes"]

#: containers zerostall walks itself (jax registers them too)
_BUILTIN_NODES = (dict, list, tuple, type(None))


def is_jax_array_type(t: type) -> bool:
    return issubclass(t, jax.Array)


def is_pytree_node_type(t: type) -> bool:
    """A type registered as a pytree node with jax (not one of the containers zerostall walks)."""
    # jax has no public "is this type registered"; its Python-side registry mirrors the C++ one
    return t in _jax_tree_util._registry and not issubclass(t, _BUILTIN_NODES)


# what to do is the point: save before the step that donates (docs/integrations.md, "donation")
_DELETED = ("this jax.Array was deleted or donated to a computation before the save: save the state before "
            "the jitted step that donates it (donate_argnums), and call wait_staged() on the save's response "
            "before that step")


def _dtype_name(dtype: Any, key: str) -> str:
    # jax's dtype names (bfloat16, float8_e4m3fn, ...) are torch's, which dtypes already maps
    name = torch_dtype_name(np.dtype(dtype).name)
    if name is None:
        raise UnsupportedLeafError(f"jax dtype {dtype} has no safetensors equivalent: store it widened "
                                   "(x.astype(jnp.int8) for int4, say) or register a handler", key=key)
    return name


#: hold a host view of each CPU array from the save call until its background copy (see
#: ``_HostView.hold``); False gives CPU arrays the accelerator path (tests of that path use it)
HOLD_CPU_VIEWS = True


class _HostView:
    """What the stager copies from: the array's host bytes, typed as the staging buffer's view.

    ``np.copyto`` converts it at staging time (on the training thread with blocking staging, on
    the copier thread through :meth:`copy_into` otherwise), so the device-to-host wait happens
    there (after every leaf's transfer was started) and no host copy is made on CPU.
    """

    __slots__ = ("array", "host", "key", "view")

    def __init__(self, array: Any, view: np.dtype[Any], key: str) -> None:
        self.array = array
        self.view = view
        self.key = key
        self.host: np.ndarray | None = None  # the host view held from the save call to the copy

    def hold(self) -> None:
        # On CPU the host view is the device buffer itself (no copy), and while it lives XLA does
        # not donate that buffer: a donating step copies its input instead. Held from the call,
        # it makes donation after save_*_async returns safe. Elsewhere the view would be a blocking
        # device-to-host copy: the transfer started at flatten time is read on the copier thread.
        if HOLD_CPU_VIEWS and all(d.platform == "cpu" for d in self.array.sharding.device_set):
            self.host = self.__array__()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        try:
            host = np.asarray(self.array)
        except RuntimeError as exc:
            if self.array.is_deleted():
                raise _donated(self.key) from exc
            raise
        return host if host.dtype == self.view else host.view(self.view)

    def copy_into(self, dst: np.ndarray, crc: int | None = None) -> int | None:
        host, self.host = self.host, None
        # A view taken here (not held) is an external reference too, so once it exists the
        # buffer cannot be donated under the copy; an array donated before that raises instead.
        return memcopy.copy_array(dst, self.__array__() if host is None else host, crc)
        # the view is dropped at return: later steps may donate the buffer again


def _donated(key: str) -> DonatedArrayError:
    return DonatedArrayError(
        "this jax.Array was donated to a computation (donate_argnums) or deleted before its background copy "
        "to host read it, so the save cannot have its bytes; nothing of this save is committed. Call "
        "response.wait_staged() before a step that donates the saved arrays, or save with "
        "SaveOptions(staging='blocking')", key=key)


def _host_leaf(a: Any, key: str, name: str, leaves: list[ArrayLeaf], *, shared: bool = True) -> int:
    if a.is_deleted():
        raise UnsupportedLeafError(_DELETED,
                                   key=key)
    if any(d.platform != "cpu" for d in a.sharding.device_set):
        a.copy_to_host_async()  # all transfers in flight before staging waits for the first one
    shape = tuple(int(s) for s in a.shape)
    leaves.append(ArrayLeaf(key, "numpy", name, shape, math.prod(shape) * ITEMSIZE[name],
                            _HostView(a, to_numpy_dtype(name), key), shared))
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
    if _is_key_dtype(a.dtype):
        if a.is_deleted():
            raise UnsupportedLeafError(_DELETED,
                                       key=key)
        a = jax.random.key_data(a)  # typed PRNG keys: their uint32 words (a trailing axis more)
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

def _check(planner: ReadPlanner, key: str, name: str, shape: tuple[int, ...], tmpl: Any) -> None:
    want = torch_dtype_name(np.dtype(tmpl.dtype).name)
    if want != name:
        raise MismatchError(f"dtype differs: checkpoint has {name}, template has {tmpl.dtype}",
                            path=planner.path, key=key)
    if tuple(tmpl.shape) != shape:
        raise MismatchError(f"shape differs: checkpoint has {list(shape)}, template has {list(tmpl.shape)}",
                            path=planner.path, key=key)


def _into_jax(planner: ReadPlanner, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
    name, shape, shards = saved_shards(planner, node)
    _check(planner, key, name, shape, tmpl)
    sharding = getattr(tmpl, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], Callable[[], np.ndarray]] = {}
    wanted: list[tuple[Any, tuple[tuple[int, ...], tuple[int, ...]]]] = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = _box(tuple(index or ()), shape)
        if box not in boxes:  # replicas on this host share one read
            boxes[box] = plan_box(planner, key, name, shards, *box)
        wanted.append((device, box))

    def build() -> Any:
        host = {box: th() for box, th in boxes.items()}
        first: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
        arrays = []
        for device, box in wanted:
            # The first device of a box may adopt the fresh host buffer (zero-copy on CPU); its replicas
            # are copied from that device, so no two devices share memory (device_put of one numpy
            # buffer to two CPU devices aliases it twice, whatever may_alias says).
            if box in first:
                arrays.append(jax.device_put(first[box], device))
            else:
                first[box] = jax.device_put(host[box], device)
                arrays.append(first[box])
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


def _is_key_dtype(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))


def _into_key(planner: ReadPlanner, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
    """Typed PRNG keys: their saved uint32 words wrapped with the template's key implementation."""
    words = planner.into_numpy(node, None, key)
    impl = jax.random.key_impl(tmpl) if isinstance(tmpl, jax.Array) else getattr(tmpl.dtype, "_impl", None)
    sharding = getattr(tmpl, "sharding", None)

    def build() -> Any:
        try:
            keys = jax.random.wrap_key_data(words(), impl=impl)
        except (TypeError, ValueError) as exc:
            raise MismatchError(f"the saved words do not make {tmpl.dtype} keys of shape {list(tmpl.shape)}: {exc}",
                                path=planner.path, key=key) from exc
        if tuple(keys.shape) != tuple(tmpl.shape):
            raise MismatchError(f"shape differs: checkpoint has {list(keys.shape)} keys, template has "
                                f"{list(tmpl.shape)}", path=planner.path, key=key)
        return jax.device_put(keys, sharding) if sharding is not None else keys
    return build


def _scalar_into_jax(planner: ReadPlanner, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
    """A saved Python number where the template has a 0-d array: what ``jax.eval_shape`` makes of
    a state's step counter (the Orbax way to build a restore template). It comes
    back as an array of the template's dtype; a value that dtype cannot hold exactly is refused."""
    t = node["type"]
    value = float.fromhex(node["value"]) if t == "float" else node["value"]
    dtype = np.dtype(tmpl.dtype)
    sharding = getattr(tmpl, "sharding", None)
    if t == "float" and dtype.kind in "iub":
        raise MismatchError(f"checkpoint has the float {value!r} here but the template has a {dtype} array",
                            path=planner.path, key=key)

    def build() -> Any:
        try:
            arr = jnp.asarray(value, dtype=dtype)
        except (OverflowError, TypeError, ValueError) as exc:
            raise MismatchError(f"the saved {t} {value!r} does not fit the template's {dtype}: {exc}",
                                path=planner.path, key=key) from exc
        return jax.device_put(arr, sharding) if sharding is not None else arr
    return build


def _read_array(planner: ReadPlanner, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
    """Into a ``jax.Array`` or ``jax.ShapeDtypeStruct`` template."""
    t = node["type"]
    if t in ("int", "float", "bool") and tuple(tmpl.shape) == () and not _is_key_dtype(tmpl.dtype):
        return _scalar_into_jax(planner, node, tmpl, key)
    if t not in ("array", "sharded"):
        raise MismatchError(f"checkpoint has a {t} here but the template has an array",
                            path=planner.path, key=key)
    return _into_key(planner, node, tmpl, key) if _is_key_dtype(tmpl.dtype) else _into_jax(planner, node, tmpl, key)


def _is_array_template_type(t: type) -> bool:
    return issubclass(t, (jax.Array, jax.ShapeDtypeStruct))


def join_processes(timeout_s: float = 300.0) -> None:
    """Give zerostall's collective saves and loads the processes of ``jax.distributed``.

    zerostall coordinates the processes of a multi-host save (run id, the commit of every
    process's files as one checkpoint, steps every process sees) through ``torch.distributed``.
    Call this once after ``jax.distributed.initialize()``: it starts a CPU-only ``gloo`` group with
    one rank per JAX process (rank ``jax.process_index()``), its address agreed through
    jax's own coordination service, so nothing else needs configuring. Needs ``torch``. Every
    process then calls the same ``save_*`` / ``load_*`` / ``Checkpointer`` methods; each writes
    only the shards it owns (``replica_id == 0``).

    Example::

        >>> jax.distributed.initialize()                       # doctest: +SKIP
        >>> zerostall.integrations.jax.join_processes()         # doctest: +SKIP
        >>> ckpt = zerostall.Checkpointer("/shared/run")        # doctest: +SKIP

    Raises:
        InvalidArgumentError: ``jax.distributed`` is not initialized.
    """
    import socket

    import torch.distributed as dist
    from jax._src import distributed as _jax_distributed

    state = _jax_distributed.global_state
    client = state.client
    if client is None or state.coordinator_address is None:
        raise InvalidArgumentError("call jax.distributed.initialize() before join_processes()",
                                   argument="jax.distributed")
    if dist.is_initialized():
        return
    key = "zerostall/join_processes/init_method"
    rank, world = jax.process_index(), jax.process_count()
    if rank == 0:
        # the coordinator's host is process 0's (jax requires it); a free port there for torch's store
        host = state.coordinator_address.rsplit(":", 1)[0]
        with socket.socket() as sk:
            sk.bind(("", 0))
            port = sk.getsockname()[1]
        client.key_value_set(key, f"tcp://{host}:{port}")
    init_method = client.blocking_key_value_get(key, int(timeout_s * 1000))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


register_array_type(ArrayType(name="jax.Array", matches=is_jax_array_type, flatten=flatten_array, read=_read_array,
                              templates=_is_array_template_type, source=_HostView))
register_array_type(ArrayType(name="jax pytree node", matches=is_pytree_node_type, flatten=flatten_pytree_node,
                              read=_into_pytree_node))
# Saves whose background copy is still queued at exit finish before jax's own exit handlers
# (registered earlier, so run later) tear its backends down.
atexit.register(_overlap._drain_all)
