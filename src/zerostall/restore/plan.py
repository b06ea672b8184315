"""Read planning: walk a manifest's tree against a template, check it, and decide where every byte goes.

:class:`ReadPlanner` is the public planning API of a load: :func:`zerostall.restore.load_items`
uses it for a local load and :mod:`zerostall.distributed` for a collective one. Planning checks
every asked-for leaf (key, shape, dtype) before any byte is read, and picks each leaf's
destination: straight into the template tensor's memory when it is a contiguous CPU tensor,
else a fresh host buffer copied in afterwards. It returns *thunks* that assemble the result
once the reads (:func:`zerostall.restore.read.execute_reads`) are done.

Which template goes where is the registry's (:mod:`zerostall.arraytypes`): a template of a
registered array type is read by that type's ``read`` (torch's and numpy's call
:meth:`ReadPlanner.into_tensor` and :meth:`ReadPlanner.into_ndarray`; JAX's builds ``jax.Array`` s),
asked after the node readers (:func:`register_node_reader`) and before the built-in rules for
containers, scalars and template-less leaves. A ``DTensor`` template is read as a tensor through
its box, which its array type's ``read`` gives (:mod:`zerostall.distributed.dtensor`).
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from zerostall import envvars
from zerostall.arraytypes import load_integrations, reader_of
from zerostall.dtypes import ITEMSIZE, to_numpy_dtype, to_torch_dtype, torch_dtype_name
from zerostall.errors import (
    CorruptCheckpointError,
    MismatchError,
    MissingKeyError,
    UnsupportedFormatError,
)
from zerostall.format.manifest import LeafEntry, Manifest
from zerostall.restore.files import ArrivedFiles, DataFiles
from zerostall.tree import TORCH, handler_by_name, is_stateful, key_join

__all__ = ["Thunk", "ReadRequest", "ReadPlanner", "TemplateBox", "NodeReader",
           "register_node_reader", "Shard", "saved_shards", "plan_box", "numpy_dtype",
           "ML_DTYPE_NAMES", "register_stateful_template", "stateful_template"]

Thunk = Callable[[], Any]


@dataclass(frozen=True)
class TemplateBox:
    """Where a template tensor sits in the global tensor, and the local tensor to fill."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    local: Any


_REGISTRY_LOCK = threading.Lock()


#: template types :meth:`ReadPlanner.build` reads ``array`` nodes into as torch's array type does,
#: without asking the readers: ``torch.Tensor`` and ``Parameter`` while torch's type reads them
#: (set by :func:`_plain_templates` at each planner, once torch is imported)
_PLAIN_TEMPLATES: set[type] = set()
#: readers registered with ``plain=True``: they want plain tensor templates too (the fast path is off)
_READERS_FOR_PLAIN: list[NodeReader] = []


def _plain_templates() -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        for cls in (torch.Tensor, torch.nn.Parameter):
            if reader_of(cls) is TORCH:
                _PLAIN_TEMPLATES.add(cls)
            else:
                _PLAIN_TEMPLATES.discard(cls)


#: ``reader(planner, node, template, key)``: a thunk for a node it takes over, else None
NodeReader = Callable[["ReadPlanner", dict[str, Any], Any, str], "Thunk | None"]
_READERS: list[NodeReader] = []


def register_node_reader(reader: NodeReader, *, plain: bool = False) -> None:
    """Let ``reader`` plan tree nodes before the built-in rules (a later registration is asked first).

    For rules that are not an array type's (those say how to read their templates in
    :attr:`zerostall.arraytypes.ArrayType.read`, asked after the readers): :mod:`zerostall.api`
    refuses templates on torch's ``meta`` device here. ``reader`` returns None for nodes it leaves
    to the next reader or the other rules; it queues its reads on ``planner.reads`` like the
    built-in rules do.

    ``plain=False`` (the default) promises that ``reader`` returns None for an ``array`` node whose
    template is a plain ``torch.Tensor`` or ``torch.nn.Parameter`` on the CPU: the planner
    then plans those (most leaves of a large state) without asking the readers. Pass
    ``plain=True`` for a reader that takes over such pairs.
    """
    with _REGISTRY_LOCK:
        _READERS.insert(0, reader)
        if plain:
            _READERS_FOR_PLAIN.append(reader)


#: ``fn(planner, target, node)``: the template tree to restore a Stateful ``target`` through, or None
StatefulTemplate = Callable[["ReadPlanner", Any, dict[str, Any]], Any]
_STATEFUL_TEMPLATES: list[StatefulTemplate] = []


def register_stateful_template(fn: StatefulTemplate) -> None:
    """Let ``fn`` give the template a Stateful object is restored through, in place of its ``state_dict()``.

    For objects whose ``state_dict()`` lacks what the checkpoint holds in a form the object needs
    back: a fresh torch optimizer has no state yet, so without a template its moments would come
    back as new contiguous tensors (whole global tensors for DTensor parameters), not laid out
    like its parameters (:mod:`zerostall.restore.optim` registers one). ``fn`` returns None for
    objects it leaves to the next one or ``state_dict()``.
    """
    with _REGISTRY_LOCK:
        _STATEFUL_TEMPLATES.insert(0, fn)


def stateful_template(planner: ReadPlanner, target: Any, node: dict[str, Any]) -> Any:
    """The template tree to restore the Stateful ``target`` through (see :func:`register_stateful_template`)."""
    for fn in _STATEFUL_TEMPLATES:
        tmpl = fn(planner, target, node)
        if tmpl is not None:
            return tmpl
    return target.state_dict()


def _bytes_of(a: Any) -> memoryview:
    """A flat uint8 view of a C-contiguous numpy array's memory."""
    return memoryview(a.reshape(-1).view(np.uint8))


#: safetensors name -> torch dtype, filled as names are met (``to_torch_dtype`` per leaf: ~1 us)
_TORCH_DTYPES: dict[str, Any] = {}


def _memory_of(t: Any, nbytes: int) -> memoryview:
    """A writable uint8 view of a contiguous CPU tensor's ``nbytes`` bytes, from its address.

    ``t.detach().reshape(-1).view(torch.uint8).numpy()`` builds three tensors and an array:
    ~5 us, paid per leaf of a load (0.1 s at 20,000 leaves); this is ~0.6 us. The view does not
    hold ``t``: the request that carries it keeps ``t`` (``ReadRequest.keep``), as does the thunk.
    """
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


@dataclass
class ReadRequest:
    leaf: LeafEntry
    dest: memoryview  # uint8, exactly leaf.nbytes
    verify: bool = True  # False for part of a leaf (a resharded read): its checksum covers the whole
    in_place: bool = False  # dest is a template's own memory: an all-or-nothing load writes it last
    keep: Any = None  # what owns ``dest``'s memory when ``dest`` does not hold it itself (see _memory_of)
    #: a template tensor on an accelerator, loaded by ``restore.device`` (``dest`` is then empty)
    device: Any = None


#: Whether templates on an accelerator are loaded by :mod:`zerostall.restore.device`'s pass, or
#: through a host tensor per leaf and one synchronous copy each (:data:`zerostall.envvars.DEVICE_LOADS`:
#: an A/B a GPU run has yet to decide).
DEVICE_LOADS: bool = envvars.switch(envvars.DEVICE_LOADS, "loads into CUDA templates through page-locked rings")
#: The device types that pass loads into. A test adds "cpu" to send CPU templates through the same
#: pass (no streams, no page-locked memory: its logic, not its speed).
DEVICE_TYPES: set[str] = {"cuda"}
_NO_BYTES = memoryview(b"")


class ReadPlanner:
    def __init__(self, manifest: Manifest, path: str, files: DataFiles | ArrivedFiles) -> None:
        self.m = manifest
        self.path = path
        self.files = files
        self.reads: list[ReadRequest] = []
        load_integrations()
        _plain_templates()

    def _leaf(self, index: int) -> LeafEntry:
        """The leaf at ``index``, once its data file has been checked (before any allocation)."""
        leaf = self.m.leaves[index]
        if leaf.nbytes:
            self.files.check(leaf)
        return leaf

    # -- leaves ------------------------------------------------------------------------------

    def mismatch(self, key: str, what: str, saved: Any, want: Any) -> MismatchError:
        return MismatchError(f"{what} differs: checkpoint has {saved}, template has {want}", path=self.path, key=key)

    def array(self, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
        """An ``array`` node whose template no array type reads: none, or a Python value (a
        placeholder: the saved array comes back in fresh memory, as saved)."""
        leaf = self._leaf(node["leaf"])
        if tmpl is not None and not isinstance(tmpl, (int, float, bool, np.generic)):
            raise MismatchError(f"checkpoint has an array here but the template has {type(tmpl).__name__}",
                                path=self.path, key=key)
        return self._fresh(leaf, key)

    def into_tensor(self, node: dict[str, Any], tmpl: Any, key: str, *, box: TemplateBox | None = None) -> Thunk | None:
        """An ``array`` or ``sharded`` node into the torch tensor ``tmpl`` (torch's array type's
        read): in its own memory where it is a contiguous CPU tensor, through the device pass on
        an accelerator, else through a temporary; a ``sharded`` node by box: ``box`` (a sharded
        template's own part of the global tensor, which its array type's ``read`` gives). None for
        other nodes."""
        t = node["type"]
        if t == "array":
            return self._into_torch(self._leaf(node["leaf"]), tmpl, key, sys.modules["torch"])
        if t == "sharded":
            return self._sharded(node, tmpl, key, box)
        return None

    def into_ndarray(self, node: dict[str, Any], tmpl: Any, key: str) -> Thunk | None:
        """An ``array`` node into the numpy array ``tmpl`` (numpy's array type's read); with bf16 /
        fp8 ``ml_dtypes`` arrays and ``sharded`` JAX nodes, by box (:meth:`into_numpy`). None for
        other nodes, and for a numpy scalar template (a placeholder)."""
        if not isinstance(tmpl, np.ndarray):
            return None
        t = node["type"]
        if t == "array":
            if torch_dtype_name(tmpl.dtype.name) in ML_DTYPE_NAMES:  # a type numpy alone lacks
                return self.into_numpy(node, tmpl, key)
            return self._into_numpy(self._leaf(node["leaf"]), tmpl, key)
        if t == "sharded" and node.get("kind") == "jax":
            return self.into_numpy(node, tmpl, key)
        return None

    def _into_torch(self, leaf: LeafEntry, t: Any, key: str, torch: Any) -> Thunk:
        want = _TORCH_DTYPES.get(leaf.dtype)
        if want is None:
            want = _TORCH_DTYPES[leaf.dtype] = to_torch_dtype(leaf.dtype)
        if t.dtype != want:
            raise self.mismatch(key, "dtype", f"{leaf.dtype} ({want})", t.dtype)
        if tuple(t.shape) != leaf.shape:
            raise self.mismatch(key, "shape", list(leaf.shape), list(t.shape))
        if leaf.nbytes == 0:
            return lambda: t
        if t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg() and "cpu" not in DEVICE_TYPES:
            # Read straight into the template's memory: no second full-size buffer. (A contiguous
            # tensor is never an expand()ed view: those have a zero stride on a dimension > 1.)
            self.reads.append(ReadRequest(leaf, _memory_of(t, leaf.nbytes), in_place=True, keep=t))
            return lambda: t
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True)):
            # An expand()ed / broadcast view: torch refuses to write it only after every byte was
            # read, with a message that names no key. Refuse it here, naming the key.
            raise MismatchError("the template tensor is an expand()ed (broadcast) view whose elements share "
                                f"memory (strides {list(t.stride())}), so it cannot be loaded in place: pass a "
                                "tensor with its own memory, e.g. t.clone()", path=self.path, key=key)
        plain = t.is_contiguous() and not t.is_conj() and not t.is_neg()
        if plain and DEVICE_LOADS and t.device.type in DEVICE_TYPES:
            # Read, checked and sent to the device piece by piece (restore.device); held back on the
            # device until everything verified when the load is all or nothing.
            self.reads.append(ReadRequest(leaf, _NO_BYTES, in_place=True, device=t))
            return lambda: t
        if plain and t.device.type == "cpu":
            # Read straight into the template's memory: no second full-size buffer.
            dest = t.detach().reshape(-1).view(torch.uint8).numpy()
            self.reads.append(ReadRequest(leaf, memoryview(dest).cast("B"), in_place=True))
            return lambda: t
        tmp = torch.empty(leaf.shape, dtype=want)
        self.reads.append(ReadRequest(leaf, memoryview(tmp.reshape(-1).view(torch.uint8).numpy()).cast("B")))

        def copy_back() -> Any:
            with torch.no_grad():
                t.copy_(tmp)
            return t
        return copy_back

    def _into_numpy(self, leaf: LeafEntry, a: np.ndarray, key: str) -> Thunk:
        want = to_numpy_dtype(leaf.dtype)
        if leaf.dtype == "BF16" or leaf.dtype.startswith("F8"):
            raise self.mismatch(key, "dtype", leaf.dtype, f"{a.dtype} (numpy has no {leaf.dtype})")
        if a.dtype != want:
            raise self.mismatch(key, "dtype", f"{leaf.dtype} ({want})", a.dtype)
        if tuple(a.shape) != leaf.shape:
            raise self.mismatch(key, "shape", list(leaf.shape), list(a.shape))
        if leaf.nbytes == 0:
            return lambda: a
        if a.flags.c_contiguous and a.flags.writeable:
            self.reads.append(ReadRequest(leaf, _bytes_of(a), in_place=True))
            return lambda: a
        tmp = np.empty(leaf.shape, dtype=want)
        self.reads.append(ReadRequest(leaf, _bytes_of(tmp)))

        def copy_back() -> Any:
            if not a.flags.writeable:
                return tmp  # a read-only template cannot be filled; return the loaded copy
            np.copyto(a, tmp)
            return a
        return copy_back

    def _fresh(self, leaf: LeafEntry, key: str) -> Thunk:
        if leaf.kind == "torch":
            torch_mod: Any
            try:
                import torch as torch_mod
            except ImportError:
                torch_mod = None
            if torch_mod is not None:
                torch = torch_mod
                t = torch.empty(leaf.shape, dtype=to_torch_dtype(leaf.dtype))
                if leaf.nbytes:
                    self.reads.append(ReadRequest(leaf, _memory_of(t, leaf.nbytes), keep=t))
                return lambda: t
        # numpy-kind bf16 / fp8 leaves come from JAX: back as the ml_dtypes types JAX uses
        a = np.empty(leaf.shape, dtype=numpy_dtype(leaf.dtype) if leaf.kind == "numpy" else to_numpy_dtype(leaf.dtype))
        if leaf.nbytes:
            self.reads.append(ReadRequest(leaf, _bytes_of(a)))
        if leaf.kind == "numpy_scalar":
            return lambda: a[()]
        return lambda: a

    def raw_bytes(self, node: dict[str, Any]) -> Callable[[], bytes]:
        leaf = self._leaf(node["leaf"])
        buf = bytearray(leaf.nbytes)
        if leaf.nbytes:
            self.reads.append(ReadRequest(leaf, memoryview(buf)))
        return lambda: bytes(buf)

    # -- tree --------------------------------------------------------------------------------

    def build(self, node: dict[str, Any], tmpl: Any, key: str, *, follow_checkpoint: bool = False) -> Thunk:
        """A thunk producing the value of ``node``; ``tmpl`` gives destinations and, unless
        ``follow_checkpoint``, the structure (keys absent from the template are not read)."""
        if type(tmpl) in _PLAIN_TEMPLATES and not _READERS_FOR_PLAIN and node.get("type") == "array" and tmpl.is_cpu:
            # A plain CPU tensor template of an array node (the bulk of a large state): torch's read,
            # with no Stateful test (a failed getattr costs ~1 us), no node readers, which all leave
            # such a pair alone (a meta tensor, which one refuses, is not on the CPU; see
            # register_node_reader), and no registry lookup
            return self._into_torch(self._leaf(node["leaf"]), tmpl, key, sys.modules["torch"])
        if tmpl is not None and is_stateful(tmpl):
            target = tmpl
            inner = self.build(node, stateful_template(self, target, node), key, follow_checkpoint=True)

            def load() -> Any:
                try:
                    target.load_state_dict(inner())
                except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                    # which object refused its state: the outer handler knew only the checkpoint
                    raise MismatchError(f"{type(target).__name__}.load_state_dict refused the restored state: "
                                        f"{type(exc).__name__}: {exc}", path=self.path, key=key) from exc
                return target
            return load
        for reader in _READERS:
            thunk = reader(self, node, tmpl, key)
            if thunk is not None:
                return thunk
        array_type = reader_of(type(tmpl)) if tmpl is not None else None
        if array_type is not None:
            assert array_type.read is not None
            thunk = array_type.read(self, node, tmpl, key)
            if thunk is not None:
                return thunk
        t = node["type"]
        if t == "none":
            return lambda: None
        if t in ("int", "bool", "str"):
            v = node["value"]
            return lambda: v
        if t == "float":
            f = float.fromhex(node["value"])
            return lambda: f
        if t == "array":
            return self.array(node, tmpl, key)
        if t == "bytes":
            return self.raw_bytes(node)
        if t == "custom":
            return self._custom(node, key)
        if t == "sharded":
            return self._sharded(node, tmpl, key)
        if t == "dict":
            return self._dict(node, tmpl, key, follow_checkpoint)
        return self._sequence(node, tmpl, key, follow_checkpoint)

    def _sharded(self, node: dict[str, Any], tmpl: Any, key: str, box: TemplateBox | None = None) -> Thunk:
        """A tensor saved as boxes: read the rows of each saved shard that intersect the template's box.

        The template is a registered box type (a ``DTensor``: its local box), a full tensor, or
        None (the whole global tensor is assembled). Each shard is read as one contiguous byte
        range: exact rows for dim-0 sharding, the covering row range otherwise.
        """
        if node.get("kind") == "jax" and (tmpl is None or isinstance(tmpl, np.ndarray)):
            return self.into_numpy(node, tmpl, key)
        import torch

        gshape = tuple(node["shape"])
        dtype_name = node["dtype"]
        dtype = to_torch_dtype(dtype_name)
        if tmpl is not None and box is None and not isinstance(tmpl, torch.Tensor):
            raise MismatchError(f"checkpoint has a tensor here but the template has {type(tmpl).__name__}",
                                path=self.path, key=key)
        if tmpl is not None:
            if tmpl.dtype != dtype:
                raise self.mismatch(key, "dtype", f"{dtype_name} ({dtype})", tmpl.dtype)
            if tuple(tmpl.shape) != gshape:
                raise self.mismatch(key, "shape", list(gshape), list(tmpl.shape))
        if box is not None:
            lo, ext, dest = box.offset, box.shape, box.local
        else:
            lo, ext = (0,) * len(gshape), gshape
            dest = tmpl if tmpl is not None else torch.empty(gshape, dtype=dtype)
        copies: list[tuple[Any, tuple[slice, ...], tuple[slice, ...]]] = []
        shards = [(tuple(sh["offset"]), tuple(sh["shape"]), sh["leaf"]) for sh in node["shards"]]
        for piece in _pieces(self, key, dtype_name, shards, lo, ext):
            tmp = torch.empty((piece.rows, *piece.shard_shape[1:]) if gshape else (), dtype=dtype)
            if piece.part.nbytes:
                raw: Any = tmp.reshape(-1).view(torch.uint8).numpy()
                self.reads.append(ReadRequest(piece.part, memoryview(raw).cast("B"), verify=piece.whole))
            copies.append((tmp, piece.src, piece.dst))

        def assemble() -> Any:
            with torch.no_grad():
                for tmp, src_idx, dst_idx in copies:
                    if gshape:
                        dest[dst_idx].copy_(tmp[src_idx])
                    else:
                        dest.copy_(tmp)
            return tmpl if tmpl is not None else dest
        return assemble

    def into_numpy(self, node: dict[str, Any], tmpl: np.ndarray | None, key: str) -> Thunk:
        """An ``array`` or ``sharded`` node as one numpy array (into ``tmpl`` when it is a writable
        array), bf16 / fp8 as ``ml_dtypes`` types: sharded JAX arrays, JAX's low-precision types."""
        name, shape, shards = saved_shards(self, node)
        if tmpl is not None:
            if tmpl.dtype != numpy_dtype(name):
                raise self.mismatch(key, "dtype", f"{name} ({numpy_dtype(name)})", tmpl.dtype)
            if tuple(tmpl.shape) != shape:
                raise self.mismatch(key, "shape", list(shape), list(tmpl.shape))
        whole = plan_box(self, key, name, shards, (0,) * len(shape), shape)
        if tmpl is None or not tmpl.flags.writeable:
            return whole
        dest = tmpl

        def fill() -> Any:
            np.copyto(dest, whole())
            return dest
        return fill

    def _custom(self, node: dict[str, Any], key: str) -> Thunk:
        handler = handler_by_name(node["handler"])
        if handler is None:
            raise UnsupportedFormatError(
                f"no handler named {node['handler']!r} is registered; register it with "
                "zerostall.register_handler before loading", path=self.path, key=key)
        if "leaf" in node:
            raw = self.raw_bytes(node)

            def decode_bytes() -> Any:
                return self._decode(handler, raw(), key)
            return decode_bytes
        value = node.get("json")
        return lambda: self._decode(handler, value, key)

    def _decode(self, handler: Any, value: Any, key: str) -> Any:
        try:
            return handler.decode(value)
        except Exception as exc:
            # Not corruption (the bytes were read whole and, when verified, matched): the handler's
            # bug. As CorruptCheckpointError, fallback=True skipped the step and silently loaded an older one.
            raise UnsupportedFormatError(f"handler {handler.name!r} could not decode the saved value "
                                         f"({type(exc).__name__}: {exc}): fix its decode, or register the handler "
                                         "version that saved it", path=self.path, key=key) from exc

    def _dict(self, node: dict[str, Any], tmpl: Any, key: str, follow: bool) -> Thunk:
        saved = dict(zip(node["keys"], node["values"], strict=True))
        if tmpl is not None and not isinstance(tmpl, dict):
            raise MismatchError(f"checkpoint has a dict here but the template has {type(tmpl).__name__}",
                                path=self.path, key=key)
        if tmpl is None or follow:
            t_get = tmpl.get if isinstance(tmpl, dict) else (lambda _k: None)
            parts = [(k, self.build(v, t_get(k), key_join(key, k), follow_checkpoint=follow)) for k, v in saved.items()]
            return lambda: {k: th() for k, th in parts}
        parts = []
        for k, sub in tmpl.items():
            if k not in saved:
                raise MissingKeyError("the template asks for a key the checkpoint does not have",
                                      path=self.path, key=key_join(key, k))
            parts.append((k, self.build(saved[k], sub, key_join(key, k))))
        proto = tmpl

        def make() -> Any:
            out = copy.copy(proto)  # keeps OrderedDict / defaultdict and their extras
            for k, th in parts:
                out[k] = th()
            return out
        return make

    def _sequence(self, node: dict[str, Any], tmpl: Any, key: str, follow: bool) -> Thunk:
        t = node["type"]
        values = node["values"]
        labels = node.get("fields") or list(range(len(values)))
        if tmpl is not None and not isinstance(tmpl, (list, tuple)):
            raise MismatchError(f"checkpoint has a {t} here but the template has {type(tmpl).__name__}",
                                path=self.path, key=key)
        if tmpl is not None and len(tmpl) != len(values):
            raise MismatchError(f"length differs: checkpoint has {len(values)}, template has {len(tmpl)}",
                                path=self.path, key=key)
        subs = list(tmpl) if tmpl is not None else [None] * len(values)
        parts = [self.build(v, s, key_join(key, lab), follow_checkpoint=follow)
                 for v, s, lab in zip(values, subs, labels, strict=True)]
        if tmpl is not None and isinstance(tmpl, tuple) and hasattr(tmpl, "_fields"):
            cls = type(tmpl)
            return lambda: cls(*[p() for p in parts])
        if tmpl is not None:
            kind: type = list if isinstance(tmpl, list) else tuple
        else:
            kind = list if t == "list" else tuple  # a namedtuple without template comes back as a tuple
        return lambda: kind(p() for p in parts)


# -- boxes into numpy (JAX arrays, and sharded nodes of JAX checkpoints without a template) ----

#: safetensors names of the types numpy lacks, and their ml_dtypes names
ML_DTYPE_NAMES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                   "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu"}


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a safetensors name: bf16 / fp8 as ``ml_dtypes`` types where installed
    (jax's own), else the same-size unsigned ints of :func:`~zerostall.dtypes.to_numpy_dtype`."""
    ml = ML_DTYPE_NAMES.get(name)
    if ml is not None:
        try:
            import ml_dtypes
        except ImportError:
            return to_numpy_dtype(name)
        dt: np.dtype[Any] = np.dtype(getattr(ml_dtypes, ml))
        return dt
    return to_numpy_dtype(name)


Shard = tuple[tuple[int, ...], tuple[int, ...], int]  # saved box offset, extent, leaf index


@dataclasses.dataclass(frozen=True)
class _Piece:
    """What one saved shard contributes to a box: the rows of the shard that cover the intersection."""

    shard_offset: tuple[int, ...]
    shard_shape: tuple[int, ...]
    part: LeafEntry  # the covering rows' byte range, with the leaf's checksum only when they are all of it
    whole: bool
    rows: int  # covering rows (1 for a 0-d tensor)
    row: int  # bytes per row
    src: tuple[slice, ...]  # the intersection within the covering rows
    dst: tuple[slice, ...]  # the intersection within the box


def _pieces(planner: ReadPlanner, key: str, name: str, shards: list[Shard], lo: tuple[int, ...],
            ext: tuple[int, ...]) -> list[_Piece]:
    """The saved shards' intersections with box ``lo``/``ext``, each data file checked before any read.

    Raises CorruptCheckpointError when a shard's leaf disagrees with its box or the shards do not
    cover the box exactly.
    """
    itemsize = ITEMSIZE[name]
    hi = tuple(a + b for a, b in zip(lo, ext, strict=True))
    pieces: list[_Piece] = []
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
        covered += math.prod(b - a for a, b in zip(ilo, ihi, strict=True))
        if not ext:  # 0-d: the one element
            a, b, row = 0, 1, itemsize
        else:
            a, b, row = ilo[0] - so[0], ihi[0] - so[0], math.prod(ss[1:]) * itemsize
        whole = a == 0 and b == (ss[0] if ext else 1)
        part = dataclasses.replace(leaf, offset=leaf.offset + a * row, nbytes=(b - a) * row,
                                   crc32c=leaf.crc32c if whole else None)
        if part.nbytes:
            planner._leaf(li)  # the data file is checked before anything is read from it
        src = (slice(None), *(slice(x - o, y - o) for x, y, o in zip(ilo[1:], ihi[1:], so[1:], strict=True)))
        dst = tuple(slice(x - o, y - o) for x, y, o in zip(ilo, ihi, lo, strict=True))
        pieces.append(_Piece(so, ss, part, whole, b - a, row, src[:len(ext)], dst))
    if covered != math.prod(ext):
        raise CorruptCheckpointError(f"the saved shards cover {covered} of the {math.prod(ext)} elements this "
                                     "process needs", path=planner.path, key=key)
    return pieces


def saved_shards(planner: ReadPlanner, node: dict[str, Any]) -> tuple[str, tuple[int, ...], list[Shard]]:
    if node["type"] == "array":
        leaf = planner.m.leaves[node["leaf"]]
        return leaf.dtype, leaf.shape, [((0,) * len(leaf.shape), leaf.shape, node["leaf"])]
    shards = [(tuple(sh["offset"]), tuple(sh["shape"]), sh["leaf"]) for sh in node["shards"]]
    return node["dtype"], tuple(node["shape"]), shards


def _as_view(a: Any) -> memoryview:
    return memoryview(a)


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """An uninitialised array starting on a 64-byte boundary: what ``jax.device_put`` on CPU adopts
    without a copy (numpy itself aligns to 16)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def plan_box(planner: ReadPlanner, key: str, name: str, shards: list[Shard],
              lo: tuple[int, ...], ext: tuple[int, ...]) -> Callable[[], np.ndarray]:
    """Queue the reads that fill box ``lo``/``ext`` of the saved array; the thunk returns it.

    A saved shard whose intersection with the box is a run of whole rows of both is read straight
    into the box's memory (the common case: same sharding, or resharding along the first axis);
    otherwise its covering rows go to a temporary and the intersection is copied out.
    """
    dtype = numpy_dtype(name)
    dest = _aligned_empty(ext, dtype)
    flat = dest.reshape(-1).view(np.uint8)
    copies: list[tuple[np.ndarray, tuple[slice, ...], tuple[slice, ...]]] = []
    for piece in _pieces(planner, key, name, shards, lo, ext):
        if not piece.part.nbytes:
            continue
        so, ss = piece.shard_offset, piece.shard_shape
        if ss[1:] == ext[1:] and so[1:] == lo[1:]:  # whole rows of both: straight into the box
            start = piece.dst[0].start * piece.row if ext else 0
            planner.reads.append(ReadRequest(piece.part, _as_view(flat[start:start + piece.part.nbytes]),
                                             verify=piece.whole))
            continue
        tmp = np.empty((piece.rows, *ss[1:]), dtype=dtype)
        planner.reads.append(ReadRequest(piece.part, _as_view(tmp.reshape(-1).view(np.uint8)), verify=piece.whole))
        copies.append((tmp, piece.src, piece.dst))

    def assemble() -> np.ndarray:
        for tmp, src, dst in copies:
            dest[dst] = tmp[src]
        return dest
    return assemble
