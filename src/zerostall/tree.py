"""Flatten a training state into a JSON structure plus a list of array leaves.

Runs on the training thread at every save: it only walks containers and reads tensor metadata;
no tensor bytes are touched here.

A state is a nest of dict / list / tuple / namedtuple whose leaves are objects of a registered
array type (:mod:`zerostall.arraytypes`: torch tensors and numpy arrays, registered here; JAX
arrays, DTensors), Python scalars (int, float, bool, str, None), ``bytes``, objects with a
``state_dict()`` / ``load_state_dict()`` pair (:class:`Stateful`: modules, optimizers, LR
schedulers, user objects), or objects of a type with a registered :class:`LeafHandler`.
"""

from __future__ import annotations

import json
import math
import operator
import random
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from zerostall import arraytypes
from zerostall.arraytypes import ArrayLeaf, ArrayType, LeafKind, Node, array_type_of, register_array_type
from zerostall.dtypes import ITEMSIZE, numpy_dtype_name, torch_dtype_name
from zerostall.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedLeafError

__all__ = [
    "Stateful",
    "LeafHandler",
    "TORCH",
    "NUMPY",
    "register_handler",
    "unregister_handler",
    "ArrayLeaf",
    "FlatState",
    "LeafFlattener",
    "flatten",
    "is_stateful",
    "register_flattener",
    "add_torch_leaf",
    "key_join",
    "handler_by_name",
    "register_lazy_integration",
    "load_lazy_integrations",
    "flatten_child",
    "Layout",
    "registry_generation",
]

JSON = Any


@runtime_checkable
class Stateful(Protocol):
    """An object saved through its state dict and restored in place.

    ``torch.nn.Module``, optimizers and LR schedulers already are. Restoring calls
    ``load_state_dict`` with the saved state, whose tensors were first filled into the
    object's own current ``state_dict()`` tensors where shapes and dtypes match.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, (dict, list, tuple, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


@dataclass(frozen=True)
class LeafHandler:
    """Saves objects of one type as bytes (into the data file) or JSON (into the manifest).

    ``encode`` turns the object into ``bytes`` (``format="bytes"``) or a JSON value
    (``format="json"``); ``decode`` turns that back into the object. Nothing is pickled.

    Example::

        >>> import datetime, zerostall
        >>> zerostall.register_handler(
        ...     datetime.date, name="date", format="json",
        ...     encode=lambda d: d.isoformat(), decode=datetime.date.fromisoformat)
    """

    name: str
    type: type
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    format: Literal["bytes", "json"] = "json"


_HANDLERS_BY_TYPE: dict[type, LeafHandler] = {}
_HANDLERS_BY_NAME: dict[str, LeafHandler] = {}
_HANDLER_LOCK = threading.Lock()


def register_handler(
    type_: type,
    *,
    name: str,
    encode: Callable[[Any], Any],
    decode: Callable[[Any], Any],
    format: Literal["bytes", "json"] = "json",
) -> LeafHandler:
    """Register how leaves of ``type_`` (and its subclasses) are saved and restored.

    ``name`` is written into the manifest and must be registered again (with the same name)
    in the process that loads the checkpoint.

    Raises:
        InvalidArgumentError: ``format`` is neither ``"bytes"`` nor ``"json"``, or ``name`` is empty
            (a ``ValueError``).
        ArgumentTypeError: ``type_`` is not a class, or ``encode`` / ``decode`` is not callable.
    """
    if not isinstance(type_, type):
        raise ArgumentTypeError(f"type_ must be a class, got {type_!r}", argument="type_")
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"name must be a non-empty str, got {name!r}", argument="name")
    for arg, fn in (("encode", encode), ("decode", decode)):
        if not callable(fn):
            raise ArgumentTypeError(f"{arg} must be callable, got {fn!r}", argument=arg)
    if format not in ("bytes", "json"):
        raise InvalidArgumentError(f"format must be 'bytes' or 'json', got {format!r}", argument="format")
    handler = LeafHandler(name=name, type=type_, encode=encode, decode=decode, format=format)
    with _HANDLER_LOCK:
        _HANDLERS_BY_TYPE[type_] = handler
        _HANDLERS_BY_NAME[name] = handler
        _bump_generation()
    return handler


def unregister_handler(type_: type) -> None:
    with _HANDLER_LOCK:
        handler = _HANDLERS_BY_TYPE.pop(type_, None)
        if handler is not None:
            _HANDLERS_BY_NAME.pop(handler.name, None)
        _bump_generation()


_GENERATION = 0


def _bump_generation() -> None:
    global _GENERATION
    _GENERATION += 1


def registry_generation() -> int:
    """A number that changes whenever a handler or an array type is registered or removed: a
    :class:`Layout` made under another generation may flatten differently and is not used."""
    return _GENERATION + arraytypes.generation()


def handler_for_type(type_: type) -> LeafHandler | None:
    if not _HANDLERS_BY_TYPE:
        return None
    for base in type_.__mro__:
        h = _HANDLERS_BY_TYPE.get(base)
        if h is not None:
            return h
    return None


def handler_by_name(name: str) -> LeafHandler | None:
    return _HANDLERS_BY_NAME.get(name)


@dataclass(frozen=True)
class FlatState:
    items: dict[str, Node]
    leaves: list[ArrayLeaf]
    #: per leaf index: the key a registered array type's ``reuse`` gave for the object that leaf
    #: came from (:attr:`zerostall.arraytypes.ArrayType.reuse`), where it made exactly that one leaf
    reuse_keys: dict[int, Any] = field(default_factory=dict)

    @property
    def signature(self) -> tuple[tuple[str, str, str, tuple[int, ...], bool], ...]:
        """What decides the buffer layout: keys, kinds, dtypes and shapes, in order."""
        return tuple((leaf.key, leaf.kind, leaf.dtype, leaf.shape, leaf.shared) for leaf in self.leaves)


#: adds the leaves of one object of a type zerostall does not know itself and returns its node
LeafFlattener = Callable[[Any, str, list[ArrayLeaf]], Node]
#: ``(key, leaf value)`` of an object a flattener makes one leaf of: see :func:`register_flattener`
LeafReuse = Callable[[Any], tuple[Any, Any]]


def register_flattener(match: Callable[[type], bool], flatten: LeafFlattener, *,
                       reuse: LeafReuse | None = None) -> None:
    """Flatten objects whose type satisfies ``match`` with ``flatten``: an array type
    (:func:`zerostall.arraytypes.register_array_type`) that says only how to flatten, named after
    ``flatten``; loads of its templates take the built-in rules (a ``DTensor`` template is read as
    a ``torch.Tensor`` is, through its box, :func:`zerostall.restore.register_template_box`).

    ``flatten(obj, key, leaves)`` appends the object's :class:`ArrayLeaf` s to ``leaves`` and
    returns the tree node that refers to them; ``reuse`` is :attr:`ArrayType.reuse`.
    """
    register_array_type(ArrayType(name=f"{flatten.__module__}.{flatten.__qualname__}", matches=match,
                                  flatten=flatten, reuse=reuse))


def register_lazy_integration(module: str, load: Callable[[], None]) -> None:
    """Run ``load`` (once) at the first save or load after ``module`` has been imported by anyone.

    Deprecated: an integration declares itself as an entry point
    (:data:`zerostall.arraytypes.ENTRY_POINT_GROUP`); this declares one at run time
    (:func:`zerostall.arraytypes.add_trigger`).
    """
    warnings.warn("zerostall.tree.register_lazy_integration is deprecated: declare an entry point of the group "
                  f"{arraytypes.ENTRY_POINT_GROUP!r}, or call zerostall.arraytypes.add_trigger",
                  DeprecationWarning, stacklevel=2)
    arraytypes.add_trigger(module, load)


#: the integrations whose trigger module is imported by now, loaded (see :mod:`zerostall.arraytypes`)
load_lazy_integrations = arraytypes.load_integrations


def key_join(prefix: str, part: Any) -> str:
    return f"{prefix}/{part}" if prefix else str(part)


_local = threading.local()


def flatten(items: dict[str, Any], *, states: dict[int, tuple[Any, Any]] | None = None) -> FlatState:
    """Walk ``{item name: tree}`` into JSON nodes and array leaves.

    ``states``: ``{id(obj): (obj, obj.state_dict())}`` already obtained in this save (by
    :meth:`Layout.rewalk`): those objects' state dicts are taken from there, not asked again.
    """
    arraytypes.load_integrations()
    leaves: list[ArrayLeaf] = []
    out: dict[str, Node] = {}
    reuse_keys: dict[int, Any] = {}
    _local.states = states or None
    _local.reuse_keys = reuse_keys if arraytypes.reuses() else None
    try:
        for name, tree in items.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise UnsupportedLeafError(f"item names must be non-empty strings without '/', got {name!r}",
                                           key=str(name))
            out[name] = _flatten(tree, name, leaves, depth=0)
    finally:
        _local.states = None
        _local.reuse_keys = None
    keys = [leaf.key for leaf in leaves]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise UnsupportedLeafError(
            "two leaves flatten to the same key; rename one of the dict keys", key=dup)
    return FlatState(items=out, leaves=leaves, reuse_keys=reuse_keys)


_MAX_DEPTH = 200


def _flatten(obj: Any, key: str, leaves: list[ArrayLeaf], depth: int) -> Node:
    if depth > _MAX_DEPTH:
        raise UnsupportedLeafError(f"state is nested deeper than {_MAX_DEPTH} levels (a cycle?)", key=key)
    # Order matters: bool before int, namedtuple before tuple, handlers before generic types.
    if obj is None:
        return {"type": "none"}
    t = type(obj)
    if t is bool:
        return {"type": "bool", "value": obj}
    if t is int:
        return {"type": "int", "value": obj}
    if t is float:
        return {"type": "float", "value": obj.hex()}
    if t is str:
        return {"type": "str", "value": obj}
    array_type = array_type_of(t)  # torch, numpy and every registered type: one dict lookup
    if array_type is not None:
        reuse = array_type.reuse
        recorded: dict[int, Any] | None = getattr(_local, "reuse_keys", None) if reuse is not None else None
        if recorded is None or reuse is None:
            return array_type.flatten(obj, key, leaves)
        n = len(leaves)
        node = array_type.flatten(obj, key, leaves)
        if len(leaves) == n + 1:
            recorded[n] = reuse(obj)[0]
        return node
    handler = handler_for_type(t)
    if handler is not None:
        return _custom_leaf(obj, handler, key, leaves)
    if t in (bytes, bytearray):
        leaves.append(ArrayLeaf(key, "bytes", "U8", (len(obj),), len(obj), bytes(obj)))
        return {"type": "bytes", "leaf": len(leaves) - 1}
    if isinstance(obj, dict):
        keys: list[Any] = []
        values: list[Node] = []
        # A state_dict is a dict of plain tensors: those go straight to add_torch_leaf (torch's
        # flatten), without a _flatten call's checks (~0.6 us a leaf, paid at every save; another
        # array type registered for the class still wins: _plain_tensors asks the registry).
        plain = _plain_tensors()
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise UnsupportedLeafError(
                    f"dict keys must be str or int, got {type(k).__name__} {k!r}"
                    + (f": use {'str' if isinstance(k, str) else 'int'}(key)" if isinstance(k, (str, int, np.integer))
                       else ""), key=key)
            keys.append(k)
            child = f"{key}/{k}" if key else str(k)
            if type(v) in plain:
                values.append(add_torch_leaf(v, child, leaves))
            else:
                values.append(_flatten(v, child, leaves, depth + 1))
        return {"type": "dict", "keys": keys, "values": values}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        values = [_flatten(v, key_join(key, f), leaves, depth + 1) for f, v in zip(obj._fields, obj, strict=True)]
        return {"type": "namedtuple", "name": t.__name__, "fields": list(obj._fields), "values": values}
    if isinstance(obj, (list, tuple)):
        values = [_flatten(v, key_join(key, i), leaves, depth + 1) for i, v in enumerate(obj)]
        return {"type": "list" if isinstance(obj, list) else "tuple", "values": values}
    if is_stateful(obj):
        known = getattr(_local, "states", None)
        got = known.pop(id(obj), None) if known else None
        if got is not None and got[0] is obj:
            state = got[1]
        else:
            state = obj.state_dict()
            record = getattr(_local, "record", None)
            if record is not None:  # a re-walk (Layout.rewalk): a full flatten may follow
                record[id(obj)] = (obj, state)
        return _flatten(state, key, leaves, depth + 1)
    raise UnsupportedLeafError(
        f"cannot save a leaf of type {t.__module__}.{t.__qualname__}; {_leaf_hint(obj)}, "
        "or register a handler with zerostall.register_handler", key=key)


def _leaf_hint(obj: Any) -> str:
    """What to save instead of ``obj``: random generators have a state, not a ``state_dict()``."""
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if name == "torch._C.Generator":
        return "save its state, g.get_state() (a uint8 tensor), and restore it with g.set_state(t)"
    if name == "numpy.random._generator.Generator":
        return "save its state, g.bit_generator.state (a dict), and restore it by assigning that attribute"
    if isinstance(obj, random.Random):
        return "save its state, r.getstate() (a tuple), and restore it with r.setstate(state)"
    if name.split(".")[0] in ("jax", "jaxlib"):
        return ("JAX support (zerostall.integrations.jax) is not loaded: it turns itself on through an entry point "
                f"of {arraytypes.ENTRY_POINT_GROUP!r} in zerostall's installed metadata, which this installation "
                "lacks (reinstall zerostall), so import zerostall.integrations.jax")
    return "save its state_dict()"


def flatten_child(obj: Any, key: str, leaves: list[ArrayLeaf]) -> Node:
    """Walk ``obj`` at ``key`` with the tree's own rules: for flatteners of container types."""
    return _flatten(obj, key, leaves, depth=key.count("/"))


def add_torch_leaf(t: Any, key: str, leaves: list[ArrayLeaf], *, shared: bool = True) -> Node:
    """Append a dense torch tensor's leaf to ``leaves`` and return its ``array`` node.

    Raises:
        UnsupportedLeafError: a dtype safetensors lacks, a sparse / quantized / meta tensor.
    """
    torch = sys.modules["torch"]  # a torch tensor exists, so torch is imported (an import statement costs more)
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        # The common case in a few attribute reads: a state of 10,000 leaves pays this per save.
        name = _TORCH_DTYPE_NAME.get(t.dtype)
        if name is None:
            name = torch_dtype_name(t.dtype)
            if name is not None:
                _TORCH_DTYPE_NAME[t.dtype] = name
        if name is not None and t.layout is torch.strided and not t.is_quantized and not t.is_meta and not t.is_nested:
            shape = tuple(t.shape)  # torch.Size holds ints
            nbytes = t.numel() * ITEMSIZE[name]
            if nbytes == 0:
                _check_empty_shape(shape, ITEMSIZE[name], key)
            leaves.append(_array_leaf(key, "torch", name, shape, nbytes, t, shared))
            return {"type": "array", "leaf": len(leaves) - 1}
    name = torch_dtype_name(t.dtype)
    if name is None:
        fix = ("save t.dequantize(), or t.int_repr() with t.q_scale() and t.q_zero_point()" if t.is_quantized
               else "save t.to(torch.complex64) (it holds every complex32 value exactly), or register a handler"
               if t.dtype == torch.complex32
               else f"save its bytes, t.view(torch.uint8), and view them back with .view({t.dtype}) after loading, "
                    "or register a handler")
        raise UnsupportedLeafError(f"tensor dtype {t.dtype} has no safetensors equivalent: {fix}", key=key)
    if t.layout != torch.strided:
        raise UnsupportedLeafError(f"only dense (strided) tensors can be saved, got layout {t.layout}", key=key)
    if t.is_nested:  # strided nested tensors have no single shape (torch raises on .shape)
        raise UnsupportedLeafError("cannot save a nested tensor: save t.unbind() (a tuple of dense tensors) and "
                                   "rebuild it with torch.nested.nested_tensor(...)", key=key)
    if t.is_quantized or t.device.type == "meta":
        raise UnsupportedLeafError(f"cannot save a {'quantized' if t.is_quantized else 'meta'} tensor", key=key)
    if type(t).__name__ == "DTensor":  # pragma: no cover - zerostall.distributed registers a flattener
        raise UnsupportedLeafError("DTensor leaves need the torch.distributed save path", key=key)
    shape = tuple(int(s) for s in t.shape)
    nbytes = t.numel() * ITEMSIZE[name]
    if nbytes == 0:
        _check_empty_shape(shape, ITEMSIZE[name], key)
    leaves.append(ArrayLeaf(key, "torch", name, shape, nbytes, t, shared))
    return {"type": "array", "leaf": len(leaves) - 1}


_new_object = object.__new__


def _array_leaf(key: str, kind: LeafKind, dtype: str, shape: tuple[int, ...], nbytes: int, value: Any,
                shared: bool) -> ArrayLeaf:
    """``ArrayLeaf(...)`` without the frozen dataclass's ``__init__`` (one ``object.__setattr__`` per
    field: ~1.1 us, against ~0.5 us here, paid per leaf at every save)."""
    leaf = _new_object(ArrayLeaf)
    d = leaf.__dict__
    d["key"] = key
    d["kind"] = kind
    d["dtype"] = dtype
    d["shape"] = shape
    d["nbytes"] = nbytes
    d["value"] = value
    d["shared"] = shared
    return leaf


#: torch dtype -> safetensors name, filled as dtypes are met (``str(dtype)`` per leaf cost ~1 us)
_TORCH_DTYPE_NAME: dict[Any, str] = {}


def _numpy_leaf(a: np.ndarray, key: str, leaves: list[ArrayLeaf], kind: LeafKind) -> Node:
    name = numpy_dtype_name(a.dtype)
    if name is None:
        raise UnsupportedLeafError(f"numpy dtype {a.dtype} cannot be saved (object, string or big-endian): "
                                   f"{_numpy_fix(a)}", key=key)
    if a.nbytes == 0:
        _check_empty_shape(tuple(int(s) for s in a.shape), ITEMSIZE[name], key)
    leaves.append(ArrayLeaf(key, kind, name, tuple(int(s) for s in a.shape), int(a.nbytes), a))
    return {"type": "array", "leaf": len(leaves) - 1}


# manifest.MAX_SIZE (a sibling layer): the largest byte count a manifest may describe
_MAX_SIZE = 2**63 - 1


def _check_empty_shape(shape: tuple[int, ...], itemsize: int, key: str) -> None:
    """An empty array of a shape torch or numpy could never allocate (``torch.empty(0, 2**62)``)
    was saved and committed, then refused by every load as a malformed manifest."""
    if math.prod(max(d, 1) for d in shape) * itemsize > _MAX_SIZE:
        raise UnsupportedLeafError(f"empty array of shape {list(shape)}: its other dimensions multiply past "
                                   "2**63 bytes, which no load could allocate; save a smaller empty shape",
                                   key=key)


def _numpy_fix(a: np.ndarray) -> str:
    """What to store instead of a numpy value of a dtype safetensors has no name for."""
    if a.dtype.kind in "USO":
        return "store x.item() (a Python value) instead" if a.ndim == 0 else "store x.tolist() (Python values) instead"
    if a.dtype.kind in "Mm":
        return "store x.astype('int64') (and its unit) instead"
    if a.dtype.byteorder not in "=|" and a.dtype.newbyteorder("=") != a.dtype:
        return "store x.astype(x.dtype.newbyteorder('=')) (native byte order) instead"
    return "convert it to a numeric dtype, or register a handler with zerostall.register_handler"


def _custom_leaf(obj: Any, handler: LeafHandler, key: str, leaves: list[ArrayLeaf]) -> Node:
    try:
        encoded = handler.encode(obj)
    except Exception as exc:
        raise UnsupportedLeafError(f"handler {handler.name!r} failed to encode: {exc}", key=key) from exc
    if handler.format == "bytes":
        if not isinstance(encoded, (bytes, bytearray, memoryview)):
            raise UnsupportedLeafError(f"handler {handler.name!r} must return bytes", key=key)
        data = bytes(encoded)
        leaves.append(ArrayLeaf(key, "custom", "U8", (len(data),), len(data), data))
        return {"type": "custom", "handler": handler.name, "leaf": len(leaves) - 1}
    try:
        json.dumps(encoded, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UnsupportedLeafError(f"handler {handler.name!r} returned a value that is not plain JSON: {exc}",
                                   key=key) from exc
    return {"type": "custom", "handler": handler.name, "json": encoded}


# -- torch and numpy: array types like any other ------------------------------------------------


def _is_torch_tensor_type(t: type) -> bool:
    torch = sys.modules.get("torch")  # a tensor's class exists only once torch is imported
    return torch is not None and issubclass(t, torch.Tensor)


def _read_torch(planner: Any, node: Node, template: Any, key: str) -> Any:
    return planner.into_tensor(node, template, key)


def _is_numpy_type(t: type) -> bool:
    return issubclass(t, (np.ndarray, np.generic))


def _flatten_numpy(a: Any, key: str, leaves: list[ArrayLeaf]) -> Node:
    if isinstance(a, np.ndarray):
        return _numpy_leaf(a, key, leaves, "numpy")
    return _numpy_leaf(np.asarray(a), key, leaves, "numpy_scalar")


def _read_numpy(planner: Any, node: Node, template: Any, key: str) -> Any:
    return planner.into_ndarray(node, template, key)


#: torch tensors: staged by torch's own copies (zerostall.stage.stager), read into a template
#: tensor's memory (:meth:`zerostall.restore.ReadPlanner.into_tensor`)
TORCH = register_array_type(ArrayType(name="torch.Tensor", matches=_is_torch_tensor_type, flatten=add_torch_leaf,
                                      read=_read_torch))
#: numpy arrays and scalars (:meth:`zerostall.restore.ReadPlanner.into_ndarray`)
NUMPY = register_array_type(ArrayType(name="numpy.ndarray", matches=_is_numpy_type, flatten=_flatten_numpy,
                                      read=_read_numpy))


def _plain_tensors() -> tuple[type, ...]:
    """``torch.Tensor`` and ``Parameter`` where torch's own array type flattens them: the classes
    that the flatten of a dict hands straight to :func:`add_torch_leaf`, and a kept layout checks
    in bulk, with no ``_flatten`` call per leaf (the bulk of a large state; see the dict branch of
    ``_flatten``)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    return tuple(c for c in (torch.Tensor, torch.nn.Parameter) if array_type_of(c) is TORCH)


# -- re-walking a state of a known layout --------------------------------------------------------


class _Tail(list):  # type: ignore[type-arg]
    """The leaves a re-walked subtree appends, numbered as if they followed ``base`` earlier ones
    (the node a flattener returns names its leaf by ``len(leaves) - 1``)."""

    def __init__(self, base: int) -> None:
        super().__init__()
        self.base = base

    def __len__(self) -> int:
        return self.base + list.__len__(self)


class _Op:
    """How to re-walk one node of a known layout (see :class:`Layout`)."""

    __slots__ = (
        "children",
        "count",
        "first",
        "key_types",
        "keys",
        "kind",
        "node",
        "reuse_key",
        "scalar_types",
        "scalars",
        "seq_type",
    )

    def __init__(self, kind: str, node: Node, *, keys: list[Any] | None = None, children: list[_Op] | None = None,
                 seq_type: type | None = None, first: int = 0, count: int = 0,
                 scalars: list[Any] | None = None, reuse_key: Any = None) -> None:
        self.kind = kind  # "tensors" | "dict" | "seq" | "tensor" | "keyed" | "other"
        self.node = node
        self.keys = keys or []
        self.key_types = [type(k) for k in self.keys]
        self.children = children or []
        self.seq_type = seq_type
        self.first = first  # "tensors": the index of the first leaf
        self.count = count  # "tensors", "other": how many leaves the subtree has
        #: "seq" of ints, strings, bools and Nones only: their values (equal values of equal
        #: types give the same nodes; floats are not compared: 0.0 == -0.0 but not their nodes)
        self.scalars = scalars
        self.scalar_types = [type(v) for v in scalars] if scalars is not None else None
        #: "keyed": the key its flattener's ``reuse`` gave (see :func:`register_flattener`)
        self.reuse_key = reuse_key


def _count_leaves(node: Any) -> int:
    if not isinstance(node, dict):
        return 0
    if node.get("type") == "sharded":
        return len(node["shards"])
    return ("leaf" in node) + sum(_count_leaves(v) for v in node.get("values", ()))


def _single_leaf(node: Node) -> int | None:
    """The leaf index of a node that refers to exactly one leaf (an array, or one shard), else None."""
    if node.get("type") == "sharded":
        shards = node.get("shards")
        return shards[0].get("leaf") if isinstance(shards, list) and len(shards) == 1 else None
    leaf = node.get("leaf")
    return leaf if type(leaf) is int and "values" not in node else None


def _compile(node: Node, fast: list[bool], keys: dict[int, Any]) -> _Op:
    t = node.get("type")
    if t == "dict":
        values = node["values"]
        idx = [v.get("leaf") if v.get("type") == "array" else None for v in values]
        first = idx[0] if idx else None
        if first is not None and all(i is not None and fast[i] for i in idx) and idx == list(range(first, first + len(idx))):
            return _Op("tensors", node, keys=list(node["keys"]), first=first, count=len(idx))
        return _Op("dict", node, keys=list(node["keys"]), children=[_compile(v, fast, keys) for v in values])
    if t in ("list", "tuple"):
        values = node["values"]
        exact = values and all(v.get("type") in _EXACT_SCALARS for v in values)
        return _Op("seq", node, seq_type=list if t == "list" else tuple, children=[_compile(v, fast, keys) for v in values],
                   scalars=[v.get("value") for v in values] if exact else None)
    if t == "array" and fast[node["leaf"]]:
        return _Op("tensor", node, first=node["leaf"])
    one = _single_leaf(node) if keys else None
    if one is not None and one in keys and fast[one]:
        return _Op("keyed", node, first=one, count=1, reuse_key=keys[one])
    return _Op("other", node, count=_count_leaves(node))


#: scalar nodes whose value compares exactly (not floats: 0.0 == -0.0, and NaN != NaN)
_EXACT_SCALARS = ("int", "str", "bool", "none")


def _hooked(t: type) -> bool:
    """Whether an array type or a handler decides how objects of type ``t`` are saved."""
    return array_type_of(t) is not None or handler_for_type(t) is not None


def _unwrap(obj: Any, depth: int, states: dict[int, tuple[Any, Any]]) -> Any:
    """``obj`` with Stateful objects replaced by their ``state_dict()`` as :func:`_flatten` does;
    each call's result is recorded in ``states`` (for a full flatten that follows)."""
    while depth <= _MAX_DEPTH:
        t = type(obj)
        if t is dict or t is OrderedDict or t is list or t is tuple or t in _SCALARS or _hooked(t) \
                or isinstance(obj, (dict, list, tuple, bytes, bytearray)) or not is_stateful(obj):
            return obj
        state = obj.state_dict()
        states[id(obj)] = (obj, state)
        obj = state
        depth += 1
    return obj


_SCALARS = (type(None), bool, int, float, str)


class Layout:
    """What flattening a state found, kept (without its tensors) to re-walk a later state cheaply.

    :meth:`rewalk` follows a new state along the recorded nodes instead of flattening it: a dict
    whose values were all plain tensors costs one comparison of its keys and one ``extend`` of
    its values, whatever its size; Stateful objects' ``state_dict()`` is called as by
    :func:`flatten`; an object of a registered flattener with ``reuse`` (DTensor) whose key is
    the recorded one gives the recorded node and its leaf's value; scalars and every other kind of
    leaf (numpy arrays, bytes, handlers' objects, a DTensor of another key) are flattened as
    usual, and their leaves must be the recorded ones. What :meth:`rewalk` does not check is the plain tensors'
    metadata (type, dtype, shape...): the caller checks those in bulk (:mod:`zerostall.stage.reuse`).
    """

    def __init__(self, flat: FlatState, generation: int) -> None:
        self.generation = generation
        self.names = list(flat.items)
        self.count = len(flat.leaves)
        #: the leaves as flattened, without their values (the plan's identity only)
        self.leaves = [_array_leaf(leaf.key, leaf.kind, leaf.dtype, leaf.shape, leaf.nbytes, None, leaf.shared)
                       for leaf in flat.leaves]
        plain = _plain_tensors()
        #: per leaf: a plain tensor reached through dicts, lists and tuples (checked by the caller)
        self.fast = [leaf.kind == "torch" and type(leaf.value) in plain for leaf in flat.leaves]
        self._ops = [_compile(flat.items[name], self.fast, flat.reuse_keys) for name in self.names]
        #: leaf objects lent to one save at a time (see :meth:`flat`), and their attribute dicts
        self._live = [_with_value(leaf, None) for leaf in self.leaves]
        self._dicts = [leaf.__dict__ for leaf in self._live]
        self._lock = threading.Lock()
        self._in_use = False

    def rewalk(self, items: dict[str, Any], states: dict[int, tuple[Any, Any]]
               ) -> tuple[dict[str, Node], list[Any], dict[int, ArrayLeaf]] | None:
        """Walk ``items`` along this layout: its nodes, the value of every leaf (in leaf order),
        and the leaves flattened as usual by position; None where the walk leaves the layout.
        The caller then flattens ``items`` with ``states``, where the walk recorded the
        ``state_dict()`` results it obtained: none is called twice in one save (a sharded
        model's ``state_dict()`` may run collectives, which every rank must call alike).

        Raises:
            UnsupportedLeafError: as :func:`flatten`, for a leaf flattened as usual.
        """
        arraytypes.load_integrations()
        if self.generation != registry_generation() or list(items) != self.names:
            return None
        values: list[Any] = []
        others: dict[int, ArrayLeaf] = {}
        nodes: dict[str, Node] = {}
        _local.record = states
        try:
            for name, op in zip(self.names, self._ops, strict=True):
                node = self._walk(items[name], op, name, values, others, 0, states)
                if node is None:
                    return None
                nodes[name] = node
        finally:
            _local.record = None
        if len(values) != self.count:
            return None
        return nodes, values, others

    def _walk(self, obj: Any, op: _Op, key: str, values: list[Any], others: dict[int, ArrayLeaf],
              depth: int, states: dict[int, tuple[Any, Any]]) -> Node | None:
        kind = op.kind
        if kind == "tensor":
            values.append(obj)
            return op.node
        if kind == "keyed":  # a registered type's one leaf: its key, else flattened as usual
            array_type = array_type_of(type(obj))
            reuse = array_type.reuse if array_type is not None else None
            if reuse is not None:
                k, v = reuse(obj)
                if k == op.reuse_key:
                    values.append(v)
                    return op.node
            return self._other(obj, op, key, values, others, depth)
        if kind == "other":
            return self._other(obj, op, key, values, others, depth)
        obj = _unwrap(obj, depth, states)
        t = type(obj)
        if kind == "seq":
            if t is not op.seq_type or len(obj) != len(op.children):
                return None
            if op.scalars is not None and list(map(type, obj)) == op.scalar_types and list(obj) == op.scalars:
                return op.node
            labels: Any = range(len(obj))
            items: Any = obj
        else:
            if not (t is dict or t is OrderedDict or (isinstance(obj, dict) and not _hooked(t))):
                return None
            labels = list(obj)
            if labels != op.keys or list(map(type, labels)) != op.key_types:
                return None
            if kind == "tensors":
                values.extend(obj.values())
                return op.node
            items = obj.values()
        nodes: list[Node] = []
        same = True
        for lab, v, child, old in zip(labels, items, op.children, op.node["values"], strict=True):
            tv = type(v)
            if child.kind == "tensors" and (tv is dict or tv is OrderedDict):
                # an optimizer's per-parameter state: inlined (one call per parameter otherwise)
                ks = list(v)
                if ks != child.keys or list(map(type, ks)) != child.key_types:
                    return None
                values.extend(v.values())
                n: Node | None = old
            else:
                n = self._walk(v, child, f"{key}/{lab}" if key else str(lab), values, others, depth + 1, states)
            if n is None:
                return None
            if n is not old:
                same = False
            nodes.append(n)
        if same:
            return op.node
        if kind == "seq":
            return {"type": op.node["type"], "values": nodes}
        return {"type": "dict", "keys": labels, "values": nodes}

    def _other(self, obj: Any, op: _Op, key: str, values: list[Any], others: dict[int, ArrayLeaf],
               depth: int) -> Node | None:
        """A node flattened as usual; its leaves must be the recorded ones."""
        if op.count == 0:  # a scalar, mostly
            scratch: list[ArrayLeaf] = []
            node = _flatten(obj, key, scratch, depth)
            if scratch:
                return None
            return op.node if node == op.node else node
        base = len(values)
        tail = _Tail(base)
        node = _flatten(obj, key, tail, depth)
        if list.__len__(tail) != op.count:
            return None
        for j, leaf in enumerate(list.__iter__(tail)):
            was = self.leaves[base + j]
            if (leaf.key, leaf.kind, leaf.dtype, leaf.shape, leaf.nbytes, leaf.shared) != \
                    (was.key, was.kind, was.dtype, was.shape, was.nbytes, was.shared):
                return None
            others[base + j] = leaf
            values.append(leaf.value)
        return op.node if node == op.node else node

    def flat(self, nodes: dict[str, Node], values: list[Any], others: dict[int, ArrayLeaf]) -> FlatState:
        """The :class:`FlatState` of a re-walked state (:meth:`rewalk`'s results).

        Its leaves are this layout's own leaf objects with the values filled in (one C-level
        pass, not an object per leaf: ~0.5 us a leaf at 20,000 leaves); :meth:`release` empties
        them again once the save no longer reads them, so no tensor stays referenced. While they
        are in use (a save on another thread), copies are made instead.
        """
        with self._lock:
            mine = not self._in_use
            self._in_use = self._in_use or mine
        if not mine:
            leaves = [_with_value(leaf, v) for leaf, v in zip(self.leaves, values, strict=True)]
            for i, leaf in others.items():
                leaves[i] = leaf
            return FlatState(items=nodes, leaves=leaves)
        if len(values) != len(self._dicts):  # pragma: no cover - rewalk counted them
            raise AssertionError("re-walked values do not match the layout")
        for _ in map(operator.setitem, self._dicts, repeat("value"), values):
            pass
        return FlatState(items=nodes, leaves=self._live)

    def release(self, flat: FlatState) -> None:
        """Empty the leaf objects :meth:`flat` lent to ``flat`` (no-op for copies)."""
        if flat.leaves is not self._live:
            return
        for _ in map(operator.setitem, self._dicts, repeat("value"), repeat(None, len(self._dicts))):
            pass
        with self._lock:
            self._in_use = False


def _with_value(leaf: ArrayLeaf, value: Any) -> ArrayLeaf:
    """A copy of ``leaf`` holding ``value`` (without the frozen dataclass's ``__init__``, as
    :func:`_array_leaf`)."""
    out = _new_object(ArrayLeaf)
    d = out.__dict__
    d.update(leaf.__dict__)
    d["value"] = value
    return out
