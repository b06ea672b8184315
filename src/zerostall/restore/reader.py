"""Read planning and execution for :func:`load_items`."""

from __future__ import annotations

import copy
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from zerostall.dtypes import ITEMSIZE, to_numpy_dtype, to_torch_dtype
from zerostall.errors import (
    CheckpointNotFoundError, ChecksumMismatchError, CorruptCheckpointError, MismatchError, MissingKeyError,
    StorageError, UnsupportedFormatError, ZerostallError,
)
from zerostall.manifest import MANIFEST_NAME, LeafEntry, Manifest, parse_manifest
from zerostall.options import LoadOptions
from zerostall.persist.job import checksum
from zerostall.storage import Storage, open_storage
from zerostall.tree import handler_by_name, is_stateful, key_join

__all__ = ["load_items", "read_manifest"]

Thunk = Callable[[], Any]


def read_manifest(storage: Storage, name: str, *, path: str) -> Manifest:
    key = f"{name}/{MANIFEST_NAME}"
    try:
        size = storage.size(key)
    except FileNotFoundError:
        raise CheckpointNotFoundError("no committed checkpoint here (no manifest)", path=path) from None
    except OSError as exc:
        raise StorageError(f"cannot read the manifest: {exc}", errno=exc.errno, path=path) from exc
    from zerostall.manifest import MAX_MANIFEST_BYTES

    if size > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"manifest is {size} bytes, more than the {MAX_MANIFEST_BYTES} allowed",
                                     path=path)
    try:
        data = storage.get(key)
    except FileNotFoundError:
        raise CheckpointNotFoundError("no committed checkpoint here (no manifest)", path=path) from None
    except OSError as exc:
        raise StorageError(f"cannot read the manifest: {exc}", errno=exc.errno, path=path) from exc
    return parse_manifest(data, path=path)


def _bytes_of(a: Any) -> memoryview:
    """A flat uint8 view of a C-contiguous numpy array's memory."""
    return memoryview(a.reshape(-1).view(np.uint8))


@dataclass
class _Read:
    leaf: LeafEntry
    dest: memoryview  # uint8, exactly leaf.nbytes
    verify: bool = True  # False for part of a leaf (a resharded read): its checksum covers the whole


class _Planner:
    def __init__(self, manifest: Manifest, path: str) -> None:
        self.m = manifest
        self.path = path
        self.reads: list[_Read] = []

    # -- leaves ------------------------------------------------------------------------------

    def _mismatch(self, key: str, what: str, saved: Any, want: Any) -> MismatchError:
        return MismatchError(f"{what} differs: checkpoint has {saved}, template has {want}", path=self.path, key=key)

    def array(self, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
        leaf = self.m.leaves[node["leaf"]]
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(tmpl, torch.Tensor):
            return self._into_torch(leaf, tmpl, key, torch)
        if isinstance(tmpl, np.ndarray):
            return self._into_numpy(leaf, tmpl, key)
        if tmpl is not None and not isinstance(tmpl, (int, float, bool, np.generic)):
            raise MismatchError(f"checkpoint has an array here but the template has {type(tmpl).__name__}",
                                path=self.path, key=key)
        return self._fresh(leaf, key)

    def _into_torch(self, leaf: LeafEntry, t: Any, key: str, torch: Any) -> Thunk:
        want = to_torch_dtype(leaf.dtype)
        if t.dtype != want:
            raise self._mismatch(key, "dtype", f"{leaf.dtype} ({want})", t.dtype)
        if tuple(t.shape) != leaf.shape:
            raise self._mismatch(key, "shape", list(leaf.shape), list(t.shape))
        if leaf.nbytes == 0:
            return lambda: t
        if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg():
            # Read straight into the template's memory: no second full-size buffer.
            dest = t.detach().reshape(-1).view(torch.uint8).numpy()
            self.reads.append(_Read(leaf, memoryview(dest).cast("B")))
            return lambda: t
        tmp = torch.empty(leaf.shape, dtype=want)
        self.reads.append(_Read(leaf, memoryview(tmp.reshape(-1).view(torch.uint8).numpy()).cast("B")))

        def copy_back() -> Any:
            with torch.no_grad():
                t.copy_(tmp)
            return t
        return copy_back

    def _into_numpy(self, leaf: LeafEntry, a: np.ndarray, key: str) -> Thunk:
        want = to_numpy_dtype(leaf.dtype)
        if leaf.dtype in ("BF16",) or leaf.dtype.startswith("F8"):
            raise self._mismatch(key, "dtype", leaf.dtype, f"{a.dtype} (numpy has no {leaf.dtype})")
        if a.dtype != want:
            raise self._mismatch(key, "dtype", f"{leaf.dtype} ({want})", a.dtype)
        if tuple(a.shape) != leaf.shape:
            raise self._mismatch(key, "shape", list(leaf.shape), list(a.shape))
        if leaf.nbytes == 0:
            return lambda: a
        if a.flags.c_contiguous and a.flags.writeable:
            self.reads.append(_Read(leaf, _bytes_of(a)))
            return lambda: a
        tmp = np.empty(leaf.shape, dtype=want)
        self.reads.append(_Read(leaf, _bytes_of(tmp)))

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
                    self.reads.append(_Read(leaf, memoryview(t.reshape(-1).view(torch.uint8).numpy())))
                return lambda: t
        a = np.empty(leaf.shape, dtype=to_numpy_dtype(leaf.dtype))
        if leaf.nbytes:
            self.reads.append(_Read(leaf, _bytes_of(a)))
        if leaf.kind == "numpy_scalar":
            return lambda: a[()]
        return lambda: a

    def raw_bytes(self, node: dict[str, Any]) -> Callable[[], bytes]:
        leaf = self.m.leaves[node["leaf"]]
        buf = bytearray(leaf.nbytes)
        if leaf.nbytes:
            self.reads.append(_Read(leaf, memoryview(buf)))
        return lambda: bytes(buf)

    # -- tree --------------------------------------------------------------------------------

    def build(self, node: dict[str, Any], tmpl: Any, key: str, *, follow_checkpoint: bool = False) -> Thunk:
        """A thunk producing the value of ``node``; ``tmpl`` gives destinations and, unless
        ``follow_checkpoint``, the structure (keys absent from the template are not read)."""
        if tmpl is not None and is_stateful(tmpl):
            target = tmpl
            inner = self.build(node, target.state_dict(), key, follow_checkpoint=True)

            def load() -> Any:
                target.load_state_dict(inner())
                return target
            return load
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
            from zerostall.dist.dtensor import plan_sharded

            return plan_sharded(self, node, tmpl, key)
        if t == "dict":
            return self._dict(node, tmpl, key, follow_checkpoint)
        return self._sequence(node, tmpl, key, follow_checkpoint)

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
            raise CorruptCheckpointError(f"handler {handler.name!r} could not decode: {exc}",
                                         path=self.path, key=key) from exc

    def _dict(self, node: dict[str, Any], tmpl: Any, key: str, follow: bool) -> Thunk:
        saved = dict(zip(node["keys"], node["values"]))
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
                 for v, s, lab in zip(values, subs, labels)]
        if tmpl is not None and isinstance(tmpl, tuple) and hasattr(tmpl, "_fields"):
            cls = type(tmpl)
            return lambda: cls(*[p() for p in parts])
        if tmpl is not None:
            kind: type = list if isinstance(tmpl, list) else tuple
        else:
            kind = list if t == "list" else tuple  # a namedtuple without template comes back as a tuple
        return lambda: kind(p() for p in parts)


def _execute(storage: Storage, name: str, m: Manifest, reads: list[_Read], opts: LoadOptions, path: str) -> None:
    if not reads:
        return
    sizes: dict[int, int] = {}
    for fi in sorted({r.leaf.file for r in reads}):
        entry = m.files[fi]
        try:
            sizes[fi] = storage.size(f"{name}/{entry.path}")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {entry.path} is missing", path=path) from None
        if sizes[fi] != entry.size:
            bad = next(r.leaf.key for r in reads if r.leaf.file == fi)
            raise CorruptCheckpointError(
                f"data file {entry.path} has {sizes[fi]} bytes, the manifest says {entry.size} (truncated?)",
                path=path, key=bad)

    chunk = opts.chunk_bytes
    # Largest first, so one big leaf does not finish last on its own.
    order = sorted(reads, key=lambda r: -r.leaf.nbytes)

    def read_one(r: _Read) -> None:
        leaf = r.leaf
        fkey = f"{name}/{m.files[leaf.file].path}"
        try:
            for off in range(0, leaf.nbytes, chunk):
                n = min(chunk, leaf.nbytes - off)
                storage.read_into(fkey, leaf.offset + off, r.dest[off:off + n])
        except EOFError as exc:
            raise CorruptCheckpointError(f"data ends early: {exc}", path=path, key=leaf.key) from exc
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"data file {m.files[leaf.file].path} is missing", path=path,
                                         key=leaf.key) from exc
        except OSError as exc:
            raise StorageError(f"read failed: {exc}", errno=exc.errno, path=path, key=leaf.key) from exc
        if opts.verify and r.verify:
            if leaf.crc32c is None:
                raise CorruptCheckpointError("leaf has no checksum to verify (load with verify=False)",
                                             path=path, key=leaf.key)
            got = checksum(r.dest)
            if got != leaf.crc32c:
                raise ChecksumMismatchError(
                    f"checksum mismatch: crc32c {got:#010x}, manifest says {leaf.crc32c:#010x}; the data file "
                    f"{m.files[leaf.file].path} is corrupt", path=path, key=leaf.key)

    if opts.io_threads == 1 or len(order) == 1:
        for r in order:
            read_one(r)
        return
    with ThreadPoolExecutor(max_workers=opts.io_threads, thread_name_prefix="zerostall-read") as pool:
        futures = [pool.submit(read_one, r) for r in order]
        errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def load_items(root_url: str, name: str, items: dict[str, Any] | None, options: LoadOptions | None = None,
               ) -> dict[str, Any]:
    """Load ``{item name: template or None}`` (``None``: every item, as saved) from a checkpoint."""
    opts = options or LoadOptions()
    path = f"{root_url.rstrip('/')}/{name}"
    if "torch" in sys.modules:
        from zerostall.dist.context import active

        if active(opts.distributed):  # every rank loads its own tree; replicated leaves read once
            from zerostall.dist.load import load_collective

            return load_collective(root_url, name, items, opts, path)
    storage = open_storage(root_url)
    m = read_manifest(storage, name, path=path)
    planner = _Planner(m, path)
    wanted = {k: None for k in m.items} if items is None else items
    thunks: dict[str, Thunk] = {}
    for item, tmpl in wanted.items():
        if item not in m.items:
            raise MissingKeyError(f"the checkpoint has no item {item!r} (it has {sorted(m.items)})",
                                  path=path, key=item)
        thunks[item] = planner.build(m.items[item], tmpl, item)
    _execute(storage, name, m, planner.reads, opts, path)
    try:
        return {k: th() for k, th in thunks.items()}
    except ZerostallError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        # load_state_dict of a user object refused the restored state
        raise MismatchError(f"restoring into the template failed: {type(exc).__name__}: {exc}", path=path) from exc




