"""The array types zerostall saves and loads: what each one says about itself, registered once.

An :class:`ArrayType` is everything the pipeline needs to know of one kind of array object:
how to recognise it (:attr:`~ArrayType.matches`), how to flatten it into the leaves staging
copies (:attr:`~ArrayType.flatten`; with :attr:`~ArrayType.source`, the class of leaf values
that copy themselves on the overlapped staging's copier thread, a :class:`BackgroundSource`),
and how to read a saved node into a template of it, or rebuild one, at a load
(:attr:`~ArrayType.read`). One :func:`register_array_type` call registers all of it, and
``tree`` (flatten), ``stage`` (background copies) and ``restore`` (reads) look it up here. torch
tensors and numpy arrays are registered the same way (by :mod:`zerostall.tree`); a later
registration is asked before an earlier one, so an integration's type (a ``DTensor`` is a
``torch.Tensor``) wins over the one it refines.

This module sits below the pipeline and imports nothing of it: the planner a reader receives is
a :class:`zerostall.restore.ReadPlanner`, typed ``Any`` here for that reason.

**Integrations that load themselves.** An integration whose types can only exist once its
framework is imported (JAX) declares itself as an entry point of the group
:data:`ENTRY_POINT_GROUP` in its package's metadata: the name is the module whose import turns it
on, the value the module that registers its array types (zerostall's own ``pyproject.toml``
declares ``jax = "zerostall.integrations.jax"``). :func:`load_integrations`, called at every
flatten and load, reads the group once per process and imports an entry's module the first time
its trigger is in ``sys.modules``: ``import zerostall`` imports no framework, a JAX user imports
nothing more, and no module of zerostall names a module above it in a string (the integration
names itself; the import linter sees every import statement there is). A checkout used without
being installed has no entry points: ``import zerostall.integrations.jax`` then registers JAX.

Example (a wrapper of a numpy array, saved as one numpy leaf and read back in place)::

    >>> import numpy as np
    >>> from zerostall.arraytypes import ArrayType, register_array_type
    >>> from zerostall.tree import ArrayLeaf
    >>> class Boxed:
    ...     def __init__(self, a): self.a = a
    >>> def flatten(obj, key, leaves):
    ...     leaves.append(ArrayLeaf(key, "numpy", "F32", obj.a.shape, obj.a.nbytes, obj.a))
    ...     return {"type": "array", "leaf": len(leaves) - 1}
    >>> def read(planner, node, tmpl, key):  # into the template's own array
    ...     fill = planner.into_ndarray(node, tmpl.a, key)
    ...     return None if fill is None else (lambda: Boxed(fill()))
    >>> _ = register_array_type(ArrayType(name="boxed", matches=lambda t: issubclass(t, Boxed),
    ...                                   flatten=flatten, read=read))
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from zerostall.errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "ArrayLeaf", "LeafKind", "Node", "Thunk", "ArrayType", "BackgroundSource", "register_array_type",
    "unregister_array_type", "array_type_of", "reader_of", "background_sources", "reuses", "generation",
    "ENTRY_POINT_GROUP", "load_integrations", "add_trigger",
]

Node = dict[str, Any]
Thunk = Callable[[], Any]
LeafKind = Literal["torch", "numpy", "numpy_scalar", "bytes", "custom"]


@dataclass(frozen=True)
class ArrayLeaf:
    """One run of bytes to stage: a tensor, an array, or an encoded object.

    ``kind`` says how staging copies ``value`` and what a load without a template rebuilds:
    ``"torch"`` a torch tensor; ``"numpy"`` / ``"numpy_scalar"`` anything ``numpy.asarray``
    reads (or a :class:`BackgroundSource`); ``"bytes"`` / ``"custom"`` bytes.
    """

    key: str
    kind: LeafKind
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    value: Any  # the tensor / array / bytes; never part of the plan's identity
    #: False when no other process can hold these bytes (a shard of a Shard-only DTensor): a
    #: collective save need not hash them looking for replicas
    shared: bool = True


class BackgroundSource(Protocol):
    """A leaf value that copies itself into its staging view (on the copier thread, when overlapped)."""

    def hold(self) -> None:
        """On the training thread, in an overlapped save's call: keep what the later copy needs (may raise)."""

    def copy_into(self, dst: Any, crc: int | None = None) -> int | None:
        """Copy every byte into ``dst``; raise if the source can no longer give the bytes of the call.

        With ``crc`` (0 starts a CRC32C), return the CRC32C of the bytes where the copy's own pass
        computed it (:func:`zerostall.memcopy.copy_array`), else ``None``: the writer sums them."""


#: ``flatten(obj, key, leaves)``: append ``obj``'s :class:`ArrayLeaf` s to ``leaves`` and return
#: the tree node that refers to them (by index: ``len(leaves) - 1`` for the last one appended)
Flatten = Callable[[Any, str, list[ArrayLeaf]], Node]
#: ``read(planner, node, template, key)``: a thunk that gives the loaded value, its reads queued
#: on the planner (a :class:`zerostall.restore.ReadPlanner`), or None to leave the node to the
#: built-in rules
Read = Callable[[Any, Node, Any, str], "Thunk | None"]
#: ``reuse(obj) -> (key, value)``: see :attr:`ArrayType.reuse`
Reuse = Callable[[Any], tuple[Any, Any]]


@dataclass(frozen=True, kw_only=True)
class ArrayType:
    """What one array type tells zerostall (Orbax's ``LeafHandler``, for zerostall's pipeline)."""

    #: the name it is registered under: registering another type of the same name replaces it
    name: str
    #: whether objects of this class are this type's (asked once per concrete class, remembered)
    matches: Callable[[type], bool]
    #: the leaves to stage of one object, and its tree node (:data:`Flatten`)
    flatten: Flatten
    #: the load of a saved node into a template of this type (:data:`Read`); None: the built-in rules
    read: Read | None = None
    #: the template classes :attr:`read` takes, where they are more than :attr:`matches` (an
    #: abstract template that holds no values, as ``jax.ShapeDtypeStruct``)
    templates: Callable[[type], bool] | None = None
    #: the class of the leaf values :attr:`flatten` makes that copy themselves
    #: (:class:`BackgroundSource`): in an overlapped save their copy runs on the copier thread,
    #: whether an optimizer owns them or not. Only for values nothing can modify in place (the
    #: registering type's promise): the save returns holding a reference.
    source: type | None = None
    #: for a type whose objects make one torch leaf each: ``(key, leaf value)`` read cheaply, where
    #: objects of equal keys flatten to the same node and the same leaf but for its value. A save of
    #: a kept layout (:class:`zerostall.tree.Layout`) then calls this instead of :attr:`flatten`
    #: and checks the value's type, dtype and shape in bulk with the plain tensors'.
    reuse: Reuse | None = None


_TYPES: list[ArrayType] = []  # the latest registration first
_FLATTEN_OF: dict[type, ArrayType | None] = {}  # per concrete class: one dict lookup per leaf
_READ_OF: dict[type, ArrayType | None] = {}
_SOURCES: tuple[type, ...] = ()
_REUSES = False
_GENERATION = 0
_LOCK = threading.Lock()


def register_array_type(array_type: ArrayType) -> ArrayType:
    """Save, stage and load objects that ``array_type.matches`` as ``array_type`` says; returns it.

    Raises:
        InvalidArgumentError: ``name`` is empty.
        ArgumentTypeError: ``array_type`` is not an :class:`ArrayType`, or ``matches`` / ``flatten``
            is not callable.
    """
    if not isinstance(array_type, ArrayType):
        raise ArgumentTypeError(f"expected an ArrayType, got {type(array_type).__name__}", argument="array_type")
    if not isinstance(array_type.name, str) or not array_type.name:
        raise InvalidArgumentError(f"name must be a non-empty str, got {array_type.name!r}", argument="name")
    for field in ("matches", "flatten"):
        if not callable(getattr(array_type, field)):
            raise ArgumentTypeError(f"{field} must be callable", argument=field)
    with _LOCK:
        _TYPES[:] = [array_type, *(t for t in _TYPES if t.name != array_type.name)]
        _changed()
    return array_type


def unregister_array_type(name: str) -> None:
    """Forget the array type registered as ``name`` (nothing if there is none)."""
    with _LOCK:
        _TYPES[:] = [t for t in _TYPES if t.name != name]
        _changed()


def _changed() -> None:
    global _SOURCES, _REUSES, _GENERATION
    _FLATTEN_OF.clear()
    _READ_OF.clear()
    _SOURCES = tuple(dict.fromkeys(t.source for t in _TYPES if t.source is not None))
    _REUSES = any(t.reuse is not None for t in _TYPES)
    _GENERATION += 1


def array_type_of(cls: type) -> ArrayType | None:
    """The array type that flattens objects of class ``cls``, or None."""
    try:
        return _FLATTEN_OF[cls]
    except KeyError:
        found = next((t for t in _TYPES if t.matches(cls)), None)
        _FLATTEN_OF[cls] = found
        return found


def reader_of(cls: type) -> ArrayType | None:
    """The array type whose :attr:`~ArrayType.read` loads into templates of class ``cls``, or None."""
    try:
        return _READ_OF[cls]
    except KeyError:
        found = next((t for t in _TYPES if t.read is not None and (t.templates or t.matches)(cls)), None)
        _READ_OF[cls] = found
        return found


def background_sources() -> tuple[type, ...]:
    """The registered :attr:`~ArrayType.source` classes (empty: none)."""
    return _SOURCES


def reuses() -> bool:
    """Whether any registered type has a :attr:`~ArrayType.reuse`."""
    return _REUSES


def generation() -> int:
    """A number that changes with every registration: a layout kept under another may flatten differently."""
    return _GENERATION


#: the entry-point group integrations declare themselves in: ``trigger module = "registering module"``
ENTRY_POINT_GROUP = "zerostall.array_types"
#: ``(trigger module, load)`` of the integrations not loaded yet; None until the group is read
_PENDING: list[tuple[str, Callable[[], object]]] | None = None
_ADDED: list[tuple[str, Callable[[], object]]] = []  # add_trigger's, before the group is read


def add_trigger(module: str, load: Callable[[], object]) -> None:
    """Run ``load`` (once) at the first flatten or load after ``module`` has been imported by anyone:
    an entry point of :data:`ENTRY_POINT_GROUP` declared at run time."""
    with _LOCK:
        (_ADDED if _PENDING is None else _PENDING).append((module, load))


def load_integrations() -> None:
    """Import the declared integrations whose trigger module is imported by now.

    Reads :data:`ENTRY_POINT_GROUP` the first time (a few ms); afterwards, one check of
    ``sys.modules`` per integration not loaded yet, and nothing once all are.
    """
    global _PENDING
    pending = _PENDING
    if pending is not None and not any(m in sys.modules for m, _ in pending):
        return
    with _LOCK:
        if _PENDING is None:
            _PENDING = _declared() + _ADDED
            _ADDED.clear()
        due = [entry for entry in _PENDING if entry[0] in sys.modules]
        _PENDING[:] = [entry for entry in _PENDING if entry[0] not in sys.modules]
    for _, load in due:
        load()


def _declared() -> list[tuple[str, Callable[[], object]]]:
    from importlib.metadata import entry_points  # here: ~40 ms to import where nothing has yet

    return [(ep.name, ep.load) for ep in entry_points(group=ENTRY_POINT_GROUP)]
