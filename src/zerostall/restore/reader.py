"""Read planning and execution for :func:`load_items`."""

from __future__ import annotations

import copy
import os
import stat
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
from zerostall.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, LeafEntry, Manifest, parse_manifest
from zerostall.options import LoadOptions
from zerostall.persist.job import checksum
from zerostall.storage import Storage, open_storage
from zerostall.tree import handler_by_name, is_stateful, key_join

__all__ = ["load_items", "read_manifest"]

Thunk = Callable[[], Any]
_VERIFY_CHUNK = 4 << 20


def check_local_file(storage: Storage, name: str, rel: str, *, path: str, what: str) -> None:
    """Refuse a file of a local checkpoint that is not a plain file inside it.

    A symlink (to anything), a file whose real path leaves the checkpoint directory (through a
    symlinked directory), a FIFO or a device is corrupt input: reading it could read outside the
    checkpoint or block forever. A missing file is left for the caller to report. The checkpoint
    directory itself may be reached through a symlink.
    """
    from zerostall.storage.local import LocalStorage

    if not isinstance(storage, LocalStorage):
        return  # not a local filesystem: no symlinks or FIFOs to fear
    ckpt = os.path.join(storage.root, name)
    full = os.path.join(ckpt, rel)
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageError(f"cannot stat {what} {rel}: {exc.strerror}", errno=exc.errno, path=path) from exc
    if stat.S_ISLNK(st.st_mode):
        raise CorruptCheckpointError(f"{what} {rel} is a symbolic link; zerostall reads only plain files "
                                     "inside the checkpoint", path=path)
    real_ckpt = os.path.realpath(ckpt)
    if os.path.commonpath([real_ckpt, os.path.realpath(full)]) != real_ckpt:
        raise CorruptCheckpointError(f"{what} {rel} resolves outside the checkpoint directory (a symlinked "
                                     "directory?)", path=path)
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(f"{what} {rel} is not a regular file", path=path)


def read_manifest(storage: Storage, name: str, *, path: str) -> Manifest:
    key = f"{name}/{MANIFEST_NAME}"
    check_local_file(storage, name, MANIFEST_NAME, path=path, what="the manifest")
    try:
        size = storage.size(key)
        if size > MAX_MANIFEST_BYTES:  # checked before reading: the file's own size is trusted, not its claims
            raise CorruptCheckpointError(f"manifest is {size} bytes, more than the {MAX_MANIFEST_BYTES} allowed",
                                         path=path)
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


def _missing(storage: Storage, name: str, rel: str, path: str, key: str) -> ZerostallError:
    """The error for a data file that is not there: deleted with its checkpoint, or lost from it.

    Retention (or a user) may delete a checkpoint while it is being loaded; deletion removes the
    manifest first (rename away, or manifest-first on object stores), so a missing manifest
    means the checkpoint is gone, not corrupt.
    """
    try:
        gone = not storage.exists(f"{name}/{MANIFEST_NAME}")
    except OSError:
        gone = False
    if gone:
        return CheckpointNotFoundError("the checkpoint was deleted while it was being loaded (retention?)",
                                       path=path, key=key)
    return CorruptCheckpointError(f"data file {rel} is missing", path=path, key=key)


class _Files:
    """Checks each data file once, before anything is allocated for the leaves it holds.

    The manifest's sizes are untrusted: a leaf declaring a terabyte must fail on the data file's
    real size, not after a terabyte buffer was allocated.
    """

    def __init__(self, storage: Storage, name: str, m: Manifest, path: str) -> None:
        self.storage, self.name, self.m, self.path = storage, name, m, path
        self.checked: set[int] = set()

    def check(self, leaf: LeafEntry) -> None:
        fi = leaf.file
        if fi in self.checked:
            return
        entry = self.m.files[fi]
        check_local_file(self.storage, self.name, entry.path, path=self.path, what="data file")
        try:
            size = self.storage.size(f"{self.name}/{entry.path}")
        except FileNotFoundError:
            raise _missing(self.storage, self.name, entry.path, self.path, leaf.key) from None
        except OSError as exc:
            raise StorageError(f"cannot stat data file {entry.path}: {exc}", errno=exc.errno, path=self.path,
                               key=leaf.key) from exc
        if size != entry.size:
            raise CorruptCheckpointError(
                f"data file {entry.path} has {size} bytes, the manifest says {entry.size} (truncated?)",
                path=self.path, key=leaf.key)
        self.checked.add(fi)


class _Planner:
    def __init__(self, manifest: Manifest, path: str, files: _Files) -> None:
        self.m = manifest
        self.path = path
        self.files = files
        self.reads: list[_Read] = []

    def _leaf(self, index: int) -> LeafEntry:
        """The leaf at ``index``, once its data file has been checked (before any allocation)."""
        leaf = self.m.leaves[index]
        if leaf.nbytes:
            self.files.check(leaf)
        return leaf

    # -- leaves ------------------------------------------------------------------------------

    def _mismatch(self, key: str, what: str, saved: Any, want: Any) -> MismatchError:
        return MismatchError(f"{what} differs: checkpoint has {saved}, template has {want}", path=self.path, key=key)

    def array(self, node: dict[str, Any], tmpl: Any, key: str) -> Thunk:
        leaf = self._leaf(node["leaf"])
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
        leaf = self._leaf(node["leaf"])
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
    # Every file read here was checked by _Files when its leaves were planned.
    if not reads:
        return
    # Verifying, read in cache-sized pieces and checksum each one right after it lands, while it
    # is still in cache: one pass over memory instead of two.
    chunk = min(opts.chunk_bytes, _VERIFY_CHUNK) if opts.verify else opts.chunk_bytes
    vectored = getattr(storage, "read_vectored", None)
    tasks = _group(reads, chunk) if vectored is not None else [[r] for r in reads]
    # Largest first, so one big read does not finish last on its own.
    tasks.sort(key=lambda g: -sum(r.leaf.nbytes for r in g))

    def fail(exc: BaseException, leaf: LeafEntry) -> BaseException:
        if isinstance(exc, EOFError):
            return CorruptCheckpointError(f"data ends early: {exc}", path=path, key=leaf.key)
        if isinstance(exc, FileNotFoundError):
            return _missing(storage, name, m.files[leaf.file].path, path, leaf.key)
        assert isinstance(exc, OSError)
        return StorageError(f"read failed: {exc}", errno=exc.errno, path=path, key=leaf.key)

    def check(r: _Read, got: int) -> None:
        leaf = r.leaf
        if not (opts.verify and r.verify):
            return
        if leaf.crc32c is None:
            raise CorruptCheckpointError("leaf has no checksum to verify (load with verify=False)",
                                         path=path, key=leaf.key)
        if got != leaf.crc32c:
            raise ChecksumMismatchError(
                f"checksum mismatch: crc32c {got:#010x}, manifest says {leaf.crc32c:#010x}; the data file "
                f"{m.files[leaf.file].path} is corrupt", path=path, key=leaf.key)

    def read_one(r: _Read) -> None:
        leaf = r.leaf
        fkey = f"{name}/{m.files[leaf.file].path}"
        got = 0

        def add(piece: memoryview) -> None:
            nonlocal got
            got = checksum(piece, got)

        want = opts.verify and r.verify
        try:
            sequential = getattr(storage, "read_sequential", None)
            if sequential is not None:  # one open file per leaf: readahead spans the leaf
                sequential(fkey, leaf.offset, r.dest, chunk=chunk, on_piece=add if want else None)
            else:
                for off in range(0, leaf.nbytes, chunk):
                    piece = r.dest[off:off + chunk]
                    storage.read_into(fkey, leaf.offset + off, piece)
                    if want:
                        add(piece)
        except (EOFError, OSError) as exc:
            raise fail(exc, leaf) from exc
        check(r, got)

    def read_group(group: list[_Read]) -> None:
        if len(group) == 1:
            read_one(group[0])
            return
        first = group[0].leaf
        bufs: list[memoryview] = []
        pos = first.offset
        for r in group:  # alignment gaps between leaves land in a scratch buffer
            if r.leaf.offset > pos:
                bufs.append(memoryview(bytearray(r.leaf.offset - pos)))
            bufs.append(r.dest)
            pos = r.leaf.offset + r.leaf.nbytes
        try:
            assert vectored is not None
            vectored(f"{name}/{m.files[first.file].path}", first.offset, bufs)
        except (EOFError, OSError) as exc:
            raise fail(exc, first) from exc
        for r in group:
            check(r, checksum(r.dest) if opts.verify and r.verify else 0)

    if opts.io_threads == 1 or len(tasks) == 1:
        for g in tasks:
            read_group(g)
        return
    with ThreadPoolExecutor(max_workers=opts.io_threads, thread_name_prefix="zerostall-read") as pool:
        futures = [pool.submit(read_group, g) for g in tasks]
        errors = [f.exception() for f in futures]
    first_error = next((e for e in errors if e is not None), None)
    if first_error is not None:
        raise first_error


def _group(reads: list[_Read], limit: int) -> list[list[_Read]]:
    """Runs of neighbouring leaves (same file, in file order, gaps under a page, up to ``limit``
    bytes together) to read with one vectored call; a leaf of ``limit`` bytes or more goes alone."""
    groups: list[list[_Read]] = []
    cur: list[_Read] = []
    cur_bytes = 0
    for r in sorted(reads, key=lambda r: (r.leaf.file, r.leaf.offset)):
        leaf = r.leaf
        if leaf.nbytes >= limit:
            groups.append([r])
            continue
        if cur:
            last = cur[-1].leaf
            gap = leaf.offset - (last.offset + last.nbytes)
            if (leaf.file != last.file or not 0 <= gap < 4096 or cur_bytes + leaf.nbytes > limit
                    or len(cur) >= 256):
                groups.append(cur)
                cur, cur_bytes = [], 0
        cur.append(r)
        cur_bytes += leaf.nbytes
    if cur:
        groups.append(cur)
    return groups


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
    planner = _Planner(m, path, _Files(storage, name, m, path))
    wanted = {k: None for k in m.items} if items is None else items
    thunks: dict[str, Thunk] = {}
    for item, tmpl in wanted.items():
        if item not in m.items:
            raise MissingKeyError(f"the checkpoint has no item {item!r} (it has {sorted(m.items)})",
                                  path=path, key=item)
        thunks[item] = planner.build(m.items[item], tmpl, item)
    _execute(storage, name, m, planner.reads, opts, path)
    return assemble(thunks, path)


def assemble(thunks: dict[str, Thunk], path: str) -> dict[str, Any]:
    """Run the planned thunks once every byte is in: copies, decoders, ``load_state_dict``."""
    try:
        return {k: th() for k, th in thunks.items()}
    except ZerostallError:
        raise
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        # load_state_dict of a user object refused the restored state
        raise MismatchError(f"restoring into the template failed: {type(exc).__name__}: {exc}", path=path) from exc




