"""The manifest: plain JSON, integer ``format_version``, written last; its presence is the commit.

Reading it is the first thing a load does with untrusted bytes, so :func:`parse_manifest`
validates everything a later step relies on (types, ranges, file names, nesting) and raises
a :class:`~zerostall.errors.ZerostallError` naming the checkpoint and the key for anything off.
It never imports or calls anything named in the file.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from zerostall.dtypes import ITEMSIZE
from zerostall.errors import CorruptCheckpointError, UnsupportedFormatError
from zerostall.format.header import TensorEntry
from zerostall.format.layout import MANIFEST_NAME

__all__ = [
    "FORMAT_VERSION", "MANIFEST_NAME", "MAX_MANIFEST_BYTES", "FileEntry", "LeafEntry", "leaf_entry", "Manifest",
    "parse_manifest", "encode_manifest",
]

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20
MAX_NDIM = 64
MAX_DEPTH = 200
#: no size, offset or element count may reach this (what int64 sizes in torch / numpy hold)
MAX_SIZE = 2**63 - 1
LEAF_KINDS = frozenset({"torch", "numpy", "numpy_scalar", "bytes", "custom"})
NODE_TYPES = frozenset({"none", "bool", "int", "float", "str", "bytes", "array", "custom",
                        "dict", "list", "tuple", "namedtuple", "sharded"})
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


_new_object = object.__new__


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the checkpoint, "/"-separated, no ".." components
    size: int


@dataclass(frozen=True, kw_only=True)
class LeafEntry:
    """One leaf: its bytes are ``[offset, offset + nbytes)`` of data file ``file``.

    The one record of a leaf from plan to manifest: the staging plan makes it
    (:func:`zerostall.format.file.lay_out`), the writer receives it unchanged on the wire (it is
    :class:`zerostall.messages.LeafRow`), and the manifest holds it as :meth:`to_json` spells it,
    with the ``crc32c`` the writer (or staging) computed; :func:`parse_manifest` reads it back.
    The data file's safetensors header entry is derived from it (:meth:`header_entry`).
    """

    key: str
    kind: str  # torch, numpy, numpy_scalar, bytes, custom (LEAF_KINDS)
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    file: int  # index into the manifest's files (on the wire: into SaveJob.files)
    offset: int  # absolute byte offset in that file
    nbytes: int
    #: CRC32C of the bytes; None until computed (a planned leaf), or a manifest that lacks one
    crc32c: int | None = None
    #: False when no other process can hold these bytes (a shard of a Shard-only DTensor): a
    #: collective save does not hash them looking for replicas. Not written to the manifest
    #: (a load does not care who else held the bytes): a parsed entry says True.
    shared: bool = True

    def to_json(self) -> dict[str, Any]:
        """The manifest's object for this leaf (``shared`` is not part of it)."""
        return {"key": self.key, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
                "file": self.file, "offset": self.offset, "nbytes": self.nbytes, "crc32c": self.crc32c}

    def header_entry(self, data_start: int) -> TensorEntry:
        """This leaf's entry in the safetensors header of its data file, whose data section starts at
        byte ``data_start``."""
        lo = self.offset - data_start
        return TensorEntry(self.key, self.dtype, self.shape, lo, lo + self.nbytes)


def leaf_entry(key: str, kind: str, dtype: str, shape: tuple[int, ...], file: int, offset: int, nbytes: int,
               crc32c: int | None = None, shared: bool = True) -> LeafEntry:
    """``LeafEntry(...)`` without the frozen dataclass's ``__init__`` (one ``object.__setattr__``
    per field): for the callers that make one per leaf of a layout or a manifest of thousands."""
    entry = _new_object(LeafEntry)
    entry.__dict__.update(key=key, kind=kind, dtype=dtype, shape=shape, file=file, offset=offset, nbytes=nbytes,
                          crc32c=crc32c, shared=shared)
    return entry


@dataclass(frozen=True)
class Manifest:
    format_version: int
    files: tuple[FileEntry, ...]
    leaves: tuple[LeafEntry, ...]
    items: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    created_unix: float | None = None
    library_version: str | None = None
    #: collective saves only: each saving rank's ``{item name: tree}`` (``items`` is rank 0's)
    ranks: tuple[dict[str, Any], ...] = ()


def encode_manifest(
    *, items: dict[str, Any], leaves: list[dict[str, Any]], files: list[dict[str, Any]],
    metadata: dict[str, Any] | None = None, library_version: str = "",
    ranks: list[dict[str, Any]] | None = None, attempt: str | None = None,
) -> bytes:
    doc: dict[str, Any] = {
        "format": "zerostall",
        "format_version": FORMAT_VERSION,
        "library_version": library_version,
        "created_unix": time.time(),
        "files": files,
        "leaves": leaves,
        "items": items,
        "metadata": metadata or {},
    }
    if ranks is not None:
        doc["ranks"] = [{"items": r} for r in ranks]
        doc["attempt"] = attempt
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _bad(msg: str, path: str, key: str | None = None) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"malformed manifest: {msg}", path=path, key=key)


def _int(v: Any, what: str, path: str, key: str | None = None, *, lo: int = 0) -> int:
    if type(v) is not int or not lo <= v <= MAX_SIZE:
        raise _bad(f"{what} must be an integer in [{lo}, 2**63), got {_short(v)}", path, key)
    return v


def _short(v: Any) -> str:
    """``repr(v)`` cut short: a hostile value may be huge (and ``repr`` of a 5000-digit int raises)."""
    try:
        r = repr(v)
    except ValueError:
        return f"<{type(v).__name__} too large to print>"
    return r if len(r) <= 80 else r[:77] + "..."


def parse_manifest(data: bytes, *, path: str) -> Manifest:
    """Decode and validate a manifest. ``path`` is the checkpoint's, for error messages."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise _bad(f"{len(data)} bytes is larger than the {MAX_MANIFEST_BYTES} allowed", path)
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _bad(f"not UTF-8 ({exc.reason} at byte {exc.start})", path) from exc
    except json.JSONDecodeError as exc:
        raise _bad(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", path) from exc
    except RecursionError as exc:
        raise _bad("JSON nested too deeply", path) from exc
    except ValueError as exc:  # e.g. an integer literal longer than Python converts (4300 digits)
        raise _bad(f"not JSON ({exc})"[:300], path) from exc
    if not isinstance(doc, dict):
        raise _bad("top level must be an object", path)
    if doc.get("format") != "zerostall":
        raise _bad(f"'format' must be \"zerostall\", got {_short(doc.get('format'))}; not a zerostall manifest",
                   path)
    version = doc.get("format_version")
    if type(version) is not int:
        raise _bad(f"format_version must be an integer, got {_short(version)}", path)
    if version != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"format_version {_short(version)} is not supported by this zerostall (reads {FORMAT_VERSION}); "
            "upgrade zerostall to read it", path=path)

    raw_files = doc.get("files")
    if not isinstance(raw_files, list):
        raise _bad("'files' must be a list", path)
    files: list[FileEntry] = []
    for i, f in enumerate(raw_files):
        if not isinstance(f, dict) or not isinstance(f.get("path"), str):
            raise _bad(f"files[{i}] must be an object with a string 'path'", path)
        fp = f["path"]
        if not _SAFE_PATH.match(fp) or any(part in ("..", ".") for part in fp.split("/")):
            raise _bad(f"files[{i}].path {_short(fp)} is not a plain relative path inside the checkpoint", path)
        files.append(FileEntry(fp, _int(f.get("size"), f"files[{i}].size", path)))

    raw_leaves = doc.get("leaves")
    if not isinstance(raw_leaves, list):
        raise _bad("'leaves' must be a list", path)
    leaves: list[LeafEntry] = []
    sizes = [f.size for f in files]
    for i, lf in enumerate(raw_leaves):
        leaves.append(_plain_leaf(lf, sizes) or _leaf(lf, i, files, path))
    _check_overlaps(leaves, path)

    items = doc.get("items")
    if not isinstance(items, dict):
        raise _bad("'items' must be an object", path)
    # Each leaf may back one node only: a leaf referenced a million times would make a
    # template-less load allocate it a million times.
    used = bytearray(len(leaves))
    for name, node in items.items():
        _check_node(node, name, used, path, 0)
    ranks = _ranks(doc, len(leaves), path)
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise _bad("'metadata' must be an object", path)
    created = doc.get("created_unix")
    lib = doc.get("library_version")
    return Manifest(
        format_version=version,
        files=tuple(files),
        leaves=tuple(leaves),
        items=items,
        metadata=metadata,
        created_unix=_finite(created),
        library_version=lib if isinstance(lib, str) else None,
        ranks=ranks,
    )


def _finite(v: Any) -> float | None:
    if type(v) not in (int, float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _ranks(doc: dict[str, Any], n_leaves: int, path: str) -> tuple[dict[str, Any], ...]:
    """The optional per-rank trees of a collective save (see docs/distributed.md)."""
    raw = doc.get("ranks")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise _bad("'ranks' must be a non-empty list", path)
    out = []
    for r, entry in enumerate(raw):
        rank_items = entry.get("items") if isinstance(entry, dict) else None
        if not isinstance(rank_items, dict):
            raise _bad(f"ranks[{r}].items must be an object", path)
        for name, node in rank_items.items():
            _check_node(node, name, bytearray(n_leaves), path, 0)  # a leaf backs one node per rank tree
        out.append(rank_items)
    return tuple(out)


def _plain_leaf(lf: Any, sizes: list[int]) -> LeafEntry | None:
    """``lf`` as a :class:`LeafEntry` when it passes every check of :func:`_leaf`, else None (then
    :func:`_leaf` runs and says what is wrong).

    The same checks in fewer steps: a manifest of 20,000 leaves spent ~8 us a leaf in
    :func:`_leaf`'s helper calls. The entry is built without the frozen dataclass's ``__init__``
    (:func:`leaf_entry`).
    """
    if type(lf) is not dict:
        return None
    key, kind, dtype, shape = lf.get("key"), lf.get("kind"), lf.get("dtype"), lf.get("shape")
    nbytes, fi, offset, crc = lf.get("nbytes"), lf.get("file"), lf.get("offset"), lf.get("crc32c")
    if (type(key) is not str or type(kind) is not str or kind not in LEAF_KINDS or type(dtype) is not str
            or type(shape) is not list or len(shape) > MAX_NDIM or type(nbytes) is not int
            or type(fi) is not int or type(offset) is not int or not 0 <= fi < len(sizes)
            or not 0 <= offset <= MAX_SIZE):
        return None
    itemsize = ITEMSIZE.get(dtype)
    if itemsize is None:
        return None
    n = itemsize
    bound = itemsize
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_SIZE:
            return None
        n *= d
        bound *= d or 1
    if nbytes != n or bound > MAX_SIZE or offset + nbytes > sizes[fi]:
        return None
    if crc is not None and (type(crc) is not int or not 0 <= crc < 2**32):
        return None
    return leaf_entry(key, kind, dtype, tuple(shape), fi, offset, nbytes, crc)


def _leaf(lf: Any, i: int, files: list[FileEntry], path: str) -> LeafEntry:
    if not isinstance(lf, dict):
        raise _bad(f"leaves[{i}] must be an object", path)
    key = lf.get("key")
    if not isinstance(key, str):
        raise _bad(f"leaves[{i}].key must be a string", path)
    kind = lf.get("kind")
    if not isinstance(kind, str) or kind not in LEAF_KINDS:  # (a list is not even hashable)
        raise UnsupportedFormatError(f"unknown leaf kind {_short(kind)}", path=path, key=key)
    dtype = lf.get("dtype")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise UnsupportedFormatError(f"unknown dtype {_short(dtype)}", path=path, key=key)
    shape = lf.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise _bad(f"shape must be a list of at most {MAX_NDIM} sizes", path, key)
    dims = tuple(_int(s, "shape entries", path, key) for s in shape)
    nbytes = _int(lf.get("nbytes"), "nbytes", path, key)
    expect = math.prod(dims) * ITEMSIZE[dtype]
    if nbytes != expect:
        raise _bad(f"nbytes {nbytes} does not match shape {_short(list(dims))} of {dtype} ({expect} bytes)",
                   path, key)
    # Bound the element count with zero sizes taken as one: torch and numpy reject (or overflow
    # on) such shapes even when a zero makes the array empty.
    if math.prod(max(d, 1) for d in dims) * ITEMSIZE[dtype] > MAX_SIZE:
        raise _bad(f"shape {_short(list(dims))} is too large for any array", path, key)
    fi = _int(lf.get("file"), "file", path, key)
    if fi >= len(files):
        raise _bad(f"file index {fi} is out of range ({len(files)} files)", path, key)
    offset = _int(lf.get("offset"), "offset", path, key)
    if offset + nbytes > files[fi].size:
        raise _bad(f"byte range [{offset}, {offset + nbytes}) lies outside {files[fi].path} "
                   f"({files[fi].size} bytes)", path, key)
    crc = lf.get("crc32c")
    if crc is not None and (type(crc) is not int or not 0 <= crc < 2**32):
        raise _bad("crc32c must be a 32-bit unsigned integer", path, key)
    return LeafEntry(key=key, kind=kind, dtype=dtype, shape=dims, file=fi, offset=offset, nbytes=nbytes, crc32c=crc)


def _check_overlaps(leaves: list[LeafEntry], path: str) -> None:
    spans = sorted((lf.file, lf.offset, lf.offset + lf.nbytes, lf.key) for lf in leaves if lf.nbytes)
    for a, b in itertools.pairwise(spans):
        if a[0] == b[0] and b[1] < a[2]:
            raise _bad(f"byte ranges of {_short(a[3])} and {_short(b[3])} overlap", path, b[3])


def _check_node(node: Any, key: str, used: bytearray, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _bad(f"tree nested deeper than {MAX_DEPTH}", path, key)
    if not isinstance(node, dict):
        raise _bad("tree node must be an object", path, key)
    t = node.get("type")
    if not isinstance(t, str) or t not in NODE_TYPES:
        raise UnsupportedFormatError(f"unknown tree node type {_short(t)}", path=path, key=key)
    if t in ("array", "bytes") or (t == "custom" and "leaf" in node):
        li = node.get("leaf")
        if type(li) is not int or not 0 <= li < len(used):
            raise _bad(f"leaf index {_short(li)} out of range", path, key)
        if used[li]:
            raise _bad(f"leaf {li} is referenced by more than one tree node", path, key)
        used[li] = 1
    if t == "sharded":
        _check_sharded(node, key, used, path)
    if t == "custom" and not isinstance(node.get("handler"), str):
        raise _bad("custom node needs a handler name", path, key)
    if t in ("int", "bool", "str", "float"):
        v = node.get("value")
        ok = {"int": type(v) is int, "bool": type(v) is bool, "str": isinstance(v, str), "float": isinstance(v, str)}[t]
        if not ok:
            raise _bad(f"{t} node has value {_short(v)}", path, key)
        if t == "float":
            try:
                float.fromhex(str(v))
            except ValueError as exc:
                raise _bad(f"float value {_short(v)} is not a hex float", path, key) from exc
    if t in ("dict", "list", "tuple", "namedtuple"):
        values = node.get("values")
        if not isinstance(values, list):
            raise _bad(f"{t} node needs a 'values' list", path, key)
        labels: list[Any]
        if t == "dict":
            keys = node.get("keys")
            if not isinstance(keys, list) or len(keys) != len(values) or any(type(k) not in (str, int) for k in keys):
                raise _bad("dict node needs 'keys' (str or int) matching its values", path, key)
            labels = keys
        elif t == "namedtuple":
            fields = node.get("fields")
            if not isinstance(fields, list) or len(fields) != len(values) or not all(
                    isinstance(f, str) and f.isidentifier() for f in fields):
                raise _bad("namedtuple node needs identifier 'fields' matching its values", path, key)
            labels = fields
        else:
            labels = list(range(len(values)))
        for label, child in zip(labels, values, strict=True):
            _check_node(child, f"{key}/{label}", used, path, depth + 1)


def _check_sharded(node: dict[str, Any], key: str, used: bytearray, path: str) -> None:
    """A tensor saved as boxes: ``shape`` (global), ``dtype``, ``shards`` of ``offset``/``shape``/``leaf``."""
    if node.get("dtype") not in ITEMSIZE:
        raise UnsupportedFormatError(f"unknown dtype {node.get('dtype')!r}"[:200], path=path, key=key)
    shape = node.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or any(type(s) is not int or s < 0 for s in shape):
        raise _bad("sharded node needs a 'shape' list of sizes", path, key)
    shards = node.get("shards")
    if not isinstance(shards, list):
        raise _bad("sharded node needs a 'shards' list", path, key)
    for sh in shards:
        if not isinstance(sh, dict):
            raise _bad("shard must be an object", path, key)
        off, ext, li = sh.get("offset"), sh.get("shape"), sh.get("leaf")
        if (not isinstance(off, list) or not isinstance(ext, list) or len(off) != len(shape)
                or len(ext) != len(shape)
                or any(type(v) is not int or v < 0 for v in off + ext)
                or any(o + e > s for o, e, s in zip(off, ext, shape, strict=True))):
            raise _bad("shard box must lie inside the global shape", path, key)
        if type(li) is not int or not 0 <= li < len(used):
            raise _bad(f"leaf index {_short(li)} out of range", path, key)
        if used[li]:
            raise _bad(f"leaf {li} is referenced by more than one tree node", path, key)
        used[li] = 1
