"""Flatten a training state into a JSON structure plus a list of array leaves.

Runs on the training thread at every save: it only walks containers and reads tensor metadata;
no tensor bytes are touched here.

A state is a nest of dict / list / tuple / namedtuple whose leaves are torch tensors, numpy
arrays, Python scalars (int, float, bool, str, None), ``bytes``, objects with a
``state_dict()`` / ``load_state_dict()`` pair (:class:`Stateful`: modules, optimizers, LR
schedulers, user objects), or objects of a type with a registered :class:`LeafHandler`.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from zerostall.dtypes import ITEMSIZE, numpy_dtype_name, torch_dtype_name
from zerostall.errors import ArgumentTypeError, InvalidArgumentError, UnsupportedLeafError

__all__ = [
    "Stateful",
    "LeafHandler",
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
]

JSON = Any
Node = dict[str, Any]
LeafKind = Literal["torch", "numpy", "numpy_scalar", "bytes", "custom"]


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
    return handler


def unregister_handler(type_: type) -> None:
    with _HANDLER_LOCK:
        handler = _HANDLERS_BY_TYPE.pop(type_, None)
        if handler is not None:
            _HANDLERS_BY_NAME.pop(handler.name, None)


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
class ArrayLeaf:
    """One run of bytes to stage: a tensor, an array, or an encoded object."""

    key: str
    kind: LeafKind
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    value: Any  # the tensor / array / bytes; never part of the plan's identity
    #: False when no other process can hold these bytes (a shard of a Shard-only DTensor): a
    #: collective save need not hash them looking for replicas
    shared: bool = True


@dataclass(frozen=True)
class FlatState:
    items: dict[str, Node]
    leaves: list[ArrayLeaf]

    @property
    def signature(self) -> tuple[tuple[str, str, str, tuple[int, ...], bool], ...]:
        """What decides the buffer layout: keys, kinds, dtypes and shapes, in order."""
        return tuple((leaf.key, leaf.kind, leaf.dtype, leaf.shape, leaf.shared) for leaf in self.leaves)


#: adds the leaves of one object of a type zerostall does not know itself and returns its node
LeafFlattener = Callable[[Any, str, list[ArrayLeaf]], Node]
_FLATTENERS: list[tuple[Callable[[type], bool], LeafFlattener]] = []
_FLATTENER_OF: dict[type, LeafFlattener | None] = {}  # per concrete type: one dict lookup per leaf


def register_flattener(match: Callable[[type], bool], flatten: LeafFlattener) -> None:
    """Flatten objects whose type satisfies ``match`` with ``flatten`` (checked before torch and numpy).

    How array types from other libraries plug in without this module importing them:
    :mod:`zerostall.distributed` registers ``DTensor``; a JAX integration registers ``jax.Array``.
    ``flatten(obj, key, leaves)`` appends the object's :class:`ArrayLeaf` s to ``leaves`` and
    returns the tree node that refers to them. A later registration wins over an earlier one.
    """
    with _HANDLER_LOCK:
        _FLATTENERS.insert(0, (match, flatten))
        _FLATTENER_OF.clear()


def _flattener_for(t: type) -> LeafFlattener | None:
    try:
        return _FLATTENER_OF[t]
    except KeyError:
        fn = next((f for m, f in _FLATTENERS if m(t)), None)
        _FLATTENER_OF[t] = fn
        return fn


_LAZY: dict[str, Callable[[], None]] = {}  # module whose import enables an integration -> its loader


def register_lazy_integration(module: str, load: Callable[[], None]) -> None:
    """Run ``load`` (once) at the first save or load after ``module`` has been imported by anyone.

    How an integration turns itself on without this layer importing it, and without
    ``import zerostall`` importing a framework: :mod:`zerostall` registers the JAX integration
    for ``"jax"`` (an object of a JAX type cannot exist before ``jax`` is imported).
    """
    with _HANDLER_LOCK:
        _LAZY[module] = load


def load_lazy_integrations() -> None:
    """Load the integrations whose trigger module is imported by now (one dict check when none is)."""
    if not _LAZY:
        return
    with _HANDLER_LOCK:
        due = [_LAZY.pop(m) for m in [m for m in _LAZY if m in sys.modules]]
    for load in due:
        load()


def key_join(prefix: str, part: Any) -> str:
    return f"{prefix}/{part}" if prefix else str(part)


def flatten(items: dict[str, Any]) -> FlatState:
    """Walk ``{item name: tree}`` into JSON nodes and array leaves."""
    load_lazy_integrations()
    leaves: list[ArrayLeaf] = []
    out: dict[str, Node] = {}
    for name, tree in items.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise UnsupportedLeafError(f"item names must be non-empty strings without '/', got {name!r}", key=str(name))
        out[name] = _flatten(tree, name, leaves, depth=0)
    keys = [leaf.key for leaf in leaves]
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise UnsupportedLeafError(
            "two leaves flatten to the same key; rename one of the dict keys", key=dup)
    return FlatState(items=out, leaves=leaves)


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
    if _FLATTENERS:
        hook = _flattener_for(t)
        if hook is not None:
            return hook(obj, key, leaves)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return add_torch_leaf(obj, key, leaves)
    if isinstance(obj, np.ndarray):
        return _numpy_leaf(obj, key, leaves, "numpy")
    if isinstance(obj, np.generic):
        return _numpy_leaf(np.asarray(obj), key, leaves, "numpy_scalar")
    handler = handler_for_type(t)
    if handler is not None:
        return _custom_leaf(obj, handler, key, leaves)
    if t in (bytes, bytearray):
        leaves.append(ArrayLeaf(key, "bytes", "U8", (len(obj),), len(obj), bytes(obj)))
        return {"type": "bytes", "leaf": len(leaves) - 1}
    if isinstance(obj, dict):
        keys: list[Any] = []
        values: list[Node] = []
        # A state_dict is a dict of plain tensors: those go straight to add_torch_leaf, without a
        # _flatten call's checks (~0.6 us a leaf, paid at every save; a flattener for the type still wins).
        plain = (torch.Tensor, torch.nn.Parameter) if torch is not None else ()
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise UnsupportedLeafError(
                    f"dict keys must be str or int, got {type(k).__name__} {k!r}"
                    + (f": use {'str' if isinstance(k, str) else 'int'}(key)" if isinstance(k, (str, int, np.integer))
                       else ""), key=key)
            keys.append(k)
            child = f"{key}/{k}" if key else str(k)
            tv = type(v)
            if tv in plain and (not _FLATTENERS or _flattener_for(tv) is None):
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
        state = obj.state_dict()
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
