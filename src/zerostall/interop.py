"""Export checkpoints to plain files other tools read, and import other tools' checkpoints.

:func:`export_checkpoint` writes a committed zerostall checkpoint (or one of its items) as

- a **safetensors** file with flat keys: streamed from the checkpoint's data files (which already
  are safetensors files) through one reused buffer, every leaf's CRC32C checked on the way; or
- a **torch.save** file of nested state dicts that ``torch.load(path, weights_only=True)`` reads.

:func:`import_checkpoint` brings in a ``torch.save`` file (read with ``weights_only=True``: no
arbitrary pickle), a ``.safetensors`` file (read by zerostall itself: a JSON header and raw bytes,
no pickle and no ``safetensors`` package), or a PyTorch DCP checkpoint directory, and saves it
with :func:`zerostall.save_pytree`.

What is exported (both formats) is what a template-less load returns: for a checkpoint written by
``save_pytree``, its tree; for one written by ``save_checkpointables``, ``{item name: tree}``; with
``item=NAME``, that item's tree. A checkpoint saved by several ranks exports rank 0's tree (what a
single-process load returns), with DTensors saved as shards assembled into full tensors.

Flat keys (safetensors): the path from the exported root to the value, components joined by
``/``: dict keys, list and tuple indices, namedtuple field names (``model/layers/0/weight``). In
each component ``%`` is written ``%25`` and ``/`` is written ``%2F``, so ``key.split("/")`` and
``urllib.parse.unquote`` on each part give the components back, and a dict key holding ``/``
never collides with a nested dict. A root that is a single value takes the item's name as its key.
The one collision left, a dict holding both ``1`` and ``"1"``, raises
:class:`~zerostall.errors.UnsupportedLeafError` (export with ``format="torch"``, which keeps key
types). Arrays (torch, numpy, numpy scalars) become tensors with their dtype and shape; ``bytes``
become ``U8`` tensors. Everything else goes into the header's ``__metadata__`` (a str → str map)
under its flat key, as JSON text: ``7``, ``0.1`` (Python's shortest round-trip repr; ``NaN``,
``Infinity``, ``-Infinity`` as Python's ``json`` writes them), ``true``, ``null``, ``"adam"``,
and a custom handler's JSON value as it was encoded. One more entry, ``%zerostall``, holds
``{"source", "item", "metadata"}`` (the checkpoint's own metadata) and cannot clash with a flat
key, in which ``%`` only appears escaped. Empty containers, tuple-versus-list and int-versus-str
keys have no place in a flat file: use ``format="torch"`` to keep them.

torch files: tensors stay tensors, numpy arrays and numpy scalars become tensors (sharing memory,
0-d for scalars), namedtuples become plain tuples, ``bytes`` and Python scalars stay as they are;
custom leaves are decoded by their registered handler and must decode to those types.
"""

from __future__ import annotations

import dataclasses
import errno as _errno
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import numpy as np

from zerostall.api import PYTREE, load_checkpointables, save_pytree_async
from zerostall.checksum import checksum
from zerostall.dtypes import ITEMSIZE, to_torch_dtype
from zerostall.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MissingKeyError,
    StorageError,
    UnsupportedFormatError,
    UnsupportedLeafError,
    ZerostallError,
)
from zerostall.format.header import (
    DATA_ALIGN,
    MAX_HEADER,
    HeaderError,
    TensorEntry,
    decode_header,
    header_length,
    header_of,
    tensor_entries,
)
from zerostall.format.layout import fsync_dir
from zerostall.format.manifest import MANIFEST_NAME, LeafEntry, Manifest
from zerostall.options import DistributedOptions, LoadOptions, SaveOptions
from zerostall.restore import DataFiles, read_manifest
from zerostall.storage import Storage, local_path, open_storage, split_url

__all__ = ["ExportReport", "ImportReport", "ProgressCallback", "export_checkpoint", "import_checkpoint"]

#: ``progress(phase, done, total)``: bytes of ``phase`` ("copy", "read", "write") done so far (0 of 0: unknown)
ProgressCallback = Callable[[str, int, int], None]
ExportFormat = Literal["safetensors", "torch", "hf"]
ImportFormat = Literal["torch", "dcp", "safetensors"]

_CHUNK = 8 << 20
_SUFFIXES: dict[str, ExportFormat] = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch",
                                      ".bin": "torch"}
#: zerostall dtypes the safetensors format does not define (readers reject the file)
_NOT_SAFETENSORS = frozenset({"C128"})
_SINGLE = DistributedOptions(enabled=False)  # export and import are one process's work
#: format="hf": the item holding the model's state dict, and the one holding its config.json text
#: (the names zerostall.integrations.transformers saves under)
HF_MODEL_ITEM = "model"
HF_CONFIG_ITEM = "hf_config"
#: format="hf": shards above this many bytes (what the Hub's tooling has long used, "5GB")
HF_MAX_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        source: the checkpoint's URL.
        path: the file written.
        format: ``"safetensors"`` or ``"torch"``.
        tensors: arrays written as tensors.
        values: other values (safetensors: ``__metadata__`` entries, ``%zerostall`` not counted).
        nbytes: tensor bytes written.
    """

    source: str
    path: str
    format: ExportFormat
    tensors: int
    values: int
    nbytes: int


@dataclass(frozen=True)
class ImportReport:
    """What :func:`import_checkpoint` read and saved.

    Attributes:
        source: the file or directory read.
        path: the zerostall checkpoint written.
        format: ``"torch"``, ``"dcp"`` or ``"safetensors"``.
        tensors: tensors saved.
        nbytes: their bytes.
    """

    source: str
    path: str
    format: ImportFormat
    tensors: int
    nbytes: int


# -- export ------------------------------------------------------------------------------------


def export_checkpoint(
    src: str | os.PathLike[str], out: str | os.PathLike[str], *, format: ExportFormat | None = None,
    item: str | None = None, overwrite: bool = False, chunk_bytes: int = _CHUNK,
    progress: ProgressCallback | None = None, max_shard_bytes: int = HF_MAX_SHARD_BYTES,
) -> ExportReport:
    """Write the committed checkpoint at ``src`` (a path or storage URL) to the local file ``out``.

    Args:
        src: the checkpoint (a path or URL, as for :func:`zerostall.load_pytree`).
        out: the file to write: a local path whose directory exists.
        format: ``"safetensors"`` or ``"torch"``; default from ``out``'s suffix (``.safetensors``;
            ``.pt``, ``.pth``, ``.bin``). ``"hf"``: ``out`` is a directory in the layout of
            ``save_pretrained`` (``config.json``, ``model.safetensors`` or shards with
            ``model.safetensors.index.json``) that ``from_pretrained(out)`` reads: the item
            ``item`` (default ``"model"``) holds the model's state dict, the item ``hf_config``
            its ``config.json`` text (what ``zerostall.integrations.transformers`` saves).
        item: export this item only (its tree becomes the root); default: everything.
        overwrite: replace ``out`` if it exists (default: refuse).
        chunk_bytes: safetensors only: the size of the one buffer the leaves stream through.
        progress: called with ``(phase, bytes done, bytes total)`` as the export goes.
        max_shard_bytes: ``"hf"`` only: a model with more tensor bytes is split into shards of at
            most this size (a single larger tensor gets a shard of its own), listed in the index.

    The output is written to a temporary file beside ``out``, synced, and renamed into place: on
    any failure no partial ``out`` is left. safetensors: leaf bytes stream through one buffer of
    ``chunk_bytes`` (a sharded DTensor is assembled in memory first, one tensor at a time), so the
    checkpoint is never held in memory; torch: the checkpoint is loaded once (``torch.save``
    needs every tensor), checksums verified by the load. See the module documentation for keys,
    metadata and type conversions.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at ``src``.
        CheckpointExistsError: ``out`` exists and ``overwrite`` is false.
        ChecksumMismatchError: a leaf's bytes do not match their checksum (names the key).
        CorruptCheckpointError: a data file is missing, truncated, or not a plain file.
        MissingKeyError: ``item`` is not in the checkpoint.
        UnsupportedLeafError: two values flatten to one key (safetensors), or a value cannot be
            written so that ``torch.load(weights_only=True)`` reads it (torch).
        UnsupportedFormatError: unknown ``format`` or suffix; a custom leaf with no registered
            handler (torch).
        StorageError: reading the checkpoint or writing ``out`` failed (errno kept).

    Example::

        >>> from zerostall.interop import export_checkpoint
        >>> export_checkpoint("/ckpt/run1/step_00000100", "model.safetensors", item="model")  # doctest: +SKIP
        ExportReport(source='/ckpt/run1/step_00000100', path='model.safetensors', format='safetensors', ...)
        >>> from safetensors.torch import load_file                                           # doctest: +SKIP
        >>> load_file("model.safetensors")["layers/0/weight"].shape                           # doctest: +SKIP
        torch.Size([512, 512])
    """
    fmt = _export_format(out, format)
    if chunk_bytes < 4096:
        raise InvalidArgumentError(f"chunk_bytes must be >= 4096, got {chunk_bytes}", argument="chunk_bytes")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise InvalidArgumentError(f"max_shard_bytes must be an int >= 1, got {max_shard_bytes!r}",
                                   argument="max_shard_bytes")
    out_path = os.path.abspath(os.path.expanduser(os.fspath(out)))
    if fmt == "hf":
        _check_out_dir(out_path, overwrite)
    else:
        _check_out(out_path, overwrite)
    root, name = split_url(_url(src))
    storage = open_storage(root)
    ckpt = f"{root.rstrip('/')}/{name}"
    m = read_manifest(storage, name, path=ckpt)
    if item is not None and item not in m.items:
        raise MissingKeyError(f"the checkpoint has no item {item!r} (it has {sorted(m.items)})", path=ckpt, key=item)
    if fmt == "hf":
        counts = _export_hf(_Source(storage, name, m, ckpt), item or HF_MODEL_ITEM, out_path, overwrite,
                            max_shard_bytes, chunk_bytes, progress)
    elif fmt == "safetensors":
        flat = _Flattener(m, ckpt).run(item)
        with _AtomicFile(out_path, overwrite) as f:
            _write_safetensors(f, flat, _Source(storage, name, m, ckpt), item, chunk_bytes, progress)
        counts = (len(flat.tensors), len(flat.values), flat.nbytes)
    else:
        counts = _export_torch(ckpt, m, item, out_path, overwrite, progress)
    return ExportReport(source=ckpt, path=out_path, format=fmt, tensors=counts[0], values=counts[1],
                        nbytes=counts[2])


def _export_format(out: str | os.PathLike[str], format: str | None) -> ExportFormat:
    if format is None:
        suffix = os.path.splitext(os.fspath(out))[1].lower()
        if suffix not in _SUFFIXES:
            raise UnsupportedFormatError(
                f"cannot tell the format from the suffix of {os.fspath(out)!r}: name it .safetensors or .pt, or "
                "pass format='safetensors' or format='torch'", path=os.fspath(out))
        return _SUFFIXES[suffix]
    if format not in ("safetensors", "torch", "hf"):
        raise UnsupportedFormatError(f"format must be 'safetensors', 'torch' or 'hf', got {format!r}",
                                     path=os.fspath(out))
    return "safetensors" if format == "safetensors" else "hf" if format == "hf" else "torch"


def _check_out(out: str, overwrite: bool) -> None:
    """Fail before any work if ``out`` cannot be written (the rename at the end checks again)."""
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise StorageError(f"cannot write {out}: directory {parent} does not exist", errno=_errno.ENOENT, path=out)
    if os.path.isdir(out):
        raise StorageError(f"cannot write {out}: it is a directory", errno=_errno.EISDIR, path=out)
    if not overwrite and os.path.lexists(out):
        raise _exists(out)


def _exists(out: str) -> CheckpointExistsError:
    return CheckpointExistsError("the output file exists; refusing to overwrite it (overwrite=True or --force "
                                 "replaces it)", path=out)


class _AtomicFile:
    """A temporary file beside ``path``, synced and renamed to ``path`` only if the block succeeds."""

    def __init__(self, path: str, overwrite: bool) -> None:
        self.path, self.overwrite = path, overwrite
        self.tmp = ""
        self.file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        directory, base = os.path.split(self.path)
        try:
            fd, self.tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".zs-tmp", dir=directory)
        except OSError as exc:
            raise StorageError(f"cannot create a file in {directory}: {exc.strerror}", errno=exc.errno,
                               path=self.path) from exc
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        assert self.file is not None
        published = False
        try:
            if exc_type is None:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if exc_type is None:
                self._publish()
                published = True
        except ZerostallError:
            raise
        except OSError as err:
            raise StorageError(f"writing {self.path} failed: {err.strerror or err}", errno=err.errno,
                               path=self.path) from err
        finally:
            if not published:
                self._discard()
        if isinstance(exc, OSError) and not isinstance(exc, ZerostallError):  # e.g. ENOSPC while writing
            raise StorageError(f"writing {self.path} failed: {exc.strerror or exc}", errno=exc.errno,
                               path=self.path) from exc

    def _publish(self) -> None:
        os.chmod(self.tmp, 0o666 & ~_umask())  # mkstemp makes it 0600; a plain file is what torch.save makes
        if self.overwrite:
            os.replace(self.tmp, self.path)
        else:
            try:  # link, unlike rename, fails if the name exists: no race with another writer
                os.link(self.tmp, self.path)
            except FileExistsError:
                raise _exists(self.path) from None
            except OSError as exc:
                if exc.errno not in (_errno.EPERM, _errno.ENOTSUP, _errno.EOPNOTSUPP, _errno.EXDEV, _errno.EMLINK):
                    raise
                if os.path.lexists(self.path):  # a filesystem without hard links: check, then rename
                    raise _exists(self.path) from None
                os.rename(self.tmp, self.path)
            else:
                os.unlink(self.tmp)
        fsync_dir(os.path.dirname(self.path))

    def _discard(self) -> None:
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- safetensors: flatten the manifest tree ------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    """One tensor of an exported file, before its place in the file is chosen: its flat key, its
    dtype and (global) shape, and the leaves that hold its bytes. Once placed, its header entry is a
    :class:`~zerostall.format.header.TensorEntry`."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    leaf: LeafEntry | None  # saved whole: the one leaf (of this dtype and shape), or:
    shards: tuple[tuple[LeafEntry, tuple[int, ...]], ...] = ()  # (leaf, offset in the global tensor)

    @classmethod
    def whole(cls, key: str, leaf: LeafEntry) -> _Tensor:
        return cls(key, leaf.dtype, leaf.shape, leaf)

    @property
    def nbytes(self) -> int:
        return self.leaf.nbytes if self.leaf is not None else math.prod(self.shape) * ITEMSIZE[self.dtype]

    @property
    def itemsize(self) -> int:
        n = math.prod(self.shape)
        return self.nbytes // n if n else 1

    @property
    def source_order(self) -> tuple[int, int]:
        first = self.leaf if self.leaf is not None else (self.shards[0][0] if self.shards else None)
        return (first.file, first.offset) if first is not None else (-1, -1)


@dataclass(frozen=True)
class _Flat:
    tensors: list[_Tensor]
    values: dict[str, str]  # flat key -> JSON text
    nbytes: int


def _escape(part: Any) -> str:
    return str(part).replace("%", "%25").replace("/", "%2F")


class _Flattener:
    """Walks the manifest's trees (no bytes read) into tensors to stream and values as JSON."""

    def __init__(self, m: Manifest, path: str) -> None:
        self.m, self.path = m, path
        self.tensors: list[_Tensor] = []
        self.values: dict[str, str] = {}
        self.keys: set[str] = set()

    def run(self, item: str | None) -> _Flat:
        for name, prefix in _roots(self.m, item):
            self.walk(self.m.items[name], prefix, name, name)
        return _Flat(self.tensors, self.values, sum(t.nbytes for t in self.tensors))

    def _claim(self, parts: list[str], item: str, zs_key: str) -> str:
        key = "/".join(parts) if parts else _escape(item)
        if key in self.keys:
            raise UnsupportedLeafError(
                f"two values map to the flat key {key!r} (a dict holding both an int key and its str form?); "
                "export with format='torch' to keep both", path=self.path, key=zs_key)
        self.keys.add(key)
        return key

    def walk(self, node: dict[str, Any], parts: list[str], zs_key: str, item: str) -> None:
        """Flatten ``node``; ``parts`` is its escaped flat path, ``zs_key`` its zerostall key (for errors)."""
        t = node["type"]
        if t in ("dict", "list", "tuple", "namedtuple"):
            labels = node.get("keys") if t == "dict" else node.get("fields")
            if labels is None:
                labels = list(range(len(node["values"])))
            for label, child in zip(labels, node["values"], strict=True):
                self.walk(child, [*parts, _escape(label)], f"{zs_key}/{label}", item)
            return
        key = self._claim(parts, item, zs_key)
        if t in ("array", "bytes") or (t == "custom" and "leaf" in node):
            lf = self.m.leaves[node["leaf"]]
            self._check_crc(lf)
            self._add(_Tensor.whole(key, lf), zs_key)
        elif t == "sharded":
            self._add(self._sharded(node, key, zs_key), zs_key)
        else:
            self.values[key] = json.dumps(_scalar(node))

    def _add(self, t: _Tensor, zs_key: str) -> None:
        if t.dtype in _NOT_SAFETENSORS:
            raise UnsupportedLeafError(f"dtype {t.dtype} has no safetensors name; export format='torch'",
                                       path=self.path, key=zs_key)
        self.tensors.append(t)

    def _check_crc(self, lf: LeafEntry) -> None:
        if lf.crc32c is None:
            raise CorruptCheckpointError("leaf has no checksum to verify", path=self.path, key=lf.key)

    def _sharded(self, node: dict[str, Any], key: str, zs_key: str) -> _Tensor:
        gshape = tuple(node["shape"])
        shards = []
        covered = 0
        for sh in node["shards"]:
            lf = self.m.leaves[sh["leaf"]]
            if lf.shape != tuple(sh["shape"]) or lf.dtype != node["dtype"]:
                raise CorruptCheckpointError(f"shard leaf {lf.key!r} has shape {list(lf.shape)} {lf.dtype}, its box "
                                             f"says {sh['shape']} {node['dtype']}", path=self.path, key=zs_key)
            self._check_crc(lf)
            covered += math.prod(lf.shape)
            shards.append((lf, tuple(sh["offset"])))
        if covered != math.prod(gshape):  # the boxes lie inside the shape (parse_manifest checked)
            raise CorruptCheckpointError(f"the saved shards cover {covered} of the tensor's {math.prod(gshape)} "
                                         "elements", path=self.path, key=zs_key)
        return _Tensor(key, node["dtype"], gshape, None, tuple(shards))


def _roots(m: Manifest, item: str | None) -> list[tuple[str, list[str]]]:
    """``(item name, key prefix)`` of each exported item: no prefix for a single exported tree."""
    if item is not None:
        return [(item, [])]
    if list(m.items) == [PYTREE]:
        return [(PYTREE, [])]
    return [(name, [_escape(name)]) for name in m.items]


def _leaf_bytes(m: Manifest, items: list[str]) -> int:
    """Bytes of the leaves the named items' trees use."""
    total = 0
    stack: list[dict[str, Any]] = [m.items[name] for name in items]
    while stack:
        node = stack.pop()
        if "leaf" in node:
            total += m.leaves[node["leaf"]].nbytes
        stack.extend(node.get("values", ()))
        stack.extend(node.get("shards", ()))
    return total


def _scalar(node: dict[str, Any]) -> Any:
    t = node["type"]
    if t == "none":
        return None
    if t == "float":
        return float.fromhex(node["value"])
    if t == "custom":
        return node.get("json")
    return node["value"]


# -- safetensors: stream the bytes -------------------------------------------------------------


class _Source:
    """Reads leaves of one checkpoint through its storage, checking every checksum."""

    def __init__(self, storage: Storage, name: str, m: Manifest, path: str) -> None:
        self.storage, self.name, self.m, self.path = storage, name, m, path
        self.files = DataFiles(storage, name, m, path)

    def _check_file(self, lf: LeafEntry) -> None:
        """The data file is a plain file of the size the manifest says (before reading from it)."""
        self.files.check(lf)

    def pieces(self, lf: LeafEntry, dest: memoryview, *, reuse: bool) -> Iterator[memoryview]:
        """Yield the leaf's bytes piece by piece, then check its checksum.

        ``reuse``: ``dest`` is a scratch buffer each piece overwrites (consume a piece before the
        next); otherwise ``dest`` holds the whole leaf and each piece is where it landed.
        """
        self._check_file(lf)
        rel = self.m.files[lf.file].path
        step = len(dest) if reuse else _CHUNK
        crc = 0
        for off in range(0, lf.nbytes, step):
            n = min(step, lf.nbytes - off)
            piece = dest[:n] if reuse else dest[off:off + n]
            try:
                self.storage.read_into(f"{self.name}/{rel}", lf.offset + off, piece)
            except EOFError as exc:
                raise CorruptCheckpointError(f"data file {rel} ends early: {exc}", path=self.path, key=lf.key) from exc
            except FileNotFoundError:
                raise CorruptCheckpointError(f"data file {rel} is missing", path=self.path, key=lf.key) from None
            except OSError as exc:
                raise StorageError(f"read failed: {exc}", errno=exc.errno, path=self.path, key=lf.key) from exc
            crc = checksum(piece, crc)
            yield piece
        if crc != lf.crc32c:
            raise ChecksumMismatchError(
                f"checksum mismatch: crc32c {crc:#010x}, manifest says {lf.crc32c or 0:#010x}; the data file "
                f"{rel} is corrupt", path=self.path, key=lf.key)

    def assemble(self, t: _Tensor) -> np.ndarray:
        """A sharded tensor's bytes, shape ``(*shape, itemsize)``, from its boxes (one shard in memory at a time)."""
        full = np.empty((*t.shape, t.itemsize), dtype=np.uint8)
        for lf, offset in t.shards:
            part = np.empty((*lf.shape, t.itemsize), dtype=np.uint8)
            for _ in self.pieces(lf, part.reshape(-1).data, reuse=False):
                pass
            full[tuple(slice(o, o + s) for o, s in zip(offset, lf.shape, strict=True))] = part
        return full


def _write_safetensors(f: BinaryIO, flat: _Flat, src: _Source, item: str | None, chunk_bytes: int,
                       progress: ProgressCallback | None, meta: dict[str, str] | None = None) -> None:
    """Write ``flat`` as one safetensors file; ``meta`` replaces the ``__metadata__`` built from
    ``flat.values`` and the ``%zerostall`` entry."""
    # Empty tensors, then the largest element size first: with the data section 64-aligned every
    # tensor starts at a multiple of its own element size (no padding entries needed); within a
    # size, in source order, for readahead.
    order = sorted(flat.tensors, key=lambda t: (t.nbytes > 0, -t.itemsize, t.source_order))
    if meta is None:
        meta = dict(flat.values)
        meta["%zerostall"] = json.dumps({"source": src.path, "item": item, "metadata": src.m.metadata})
    entries: list[TensorEntry] = []
    pos = 0
    for t in order:
        entries.append(TensorEntry(t.key, t.dtype, t.shape, pos, pos + t.nbytes))
        pos += t.nbytes
    head = header_of(entries, meta, align=DATA_ALIGN)  # the data section starts aligned, as in zerostall's own files
    if len(head) - 8 > MAX_HEADER:
        raise UnsupportedLeafError(f"the safetensors header would be {len(head) - 8} bytes, more than the "
                                   f"{MAX_HEADER} readers accept (too many keys or values)", path=src.path)
    f.write(head)
    scratch = memoryview(bytearray(max(4096, min(chunk_bytes, max((t.nbytes for t in order), default=0)))))
    done = 0
    for t in order:
        if t.leaf is None:
            f.write(src.assemble(t).reshape(-1).data)
            done += t.nbytes
        else:
            for piece in src.pieces(t.leaf, scratch, reuse=True):
                f.write(piece)
                done += len(piece)
                if progress is not None:
                    progress("copy", done, flat.nbytes)
        if progress is not None:
            progress("copy", done, flat.nbytes)


# -- Hugging Face save_pretrained layout --------------------------------------------------------


def _check_out_dir(out: str, overwrite: bool) -> None:
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise StorageError(f"cannot write {out}: directory {parent} does not exist", errno=_errno.ENOENT, path=out)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise StorageError(f"cannot write {out}: it is a file, not a directory", errno=_errno.ENOTDIR, path=out)
    if not overwrite and os.path.lexists(out):
        raise CheckpointExistsError("the output directory exists; refusing to overwrite it (overwrite=True or "
                                    "--force replaces it)", path=out)


def _hf_config(src: _Source) -> str:
    node = src.m.items.get(HF_CONFIG_ITEM)
    value = _scalar(node) if node is not None and "leaf" not in node and "values" not in node else None
    if not isinstance(value, str):
        raise MissingKeyError(f"format='hf' needs the model's config.json text in an item {HF_CONFIG_ITEM!r} (str), "
                              f"as zerostall.integrations.transformers saves it; the checkpoint has items "
                              f"{sorted(src.m.items)}", path=src.path, key=HF_CONFIG_ITEM)
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise UnsupportedFormatError(f"item {HF_CONFIG_ITEM!r} is not a config.json text: {exc}", path=src.path,
                                     key=HF_CONFIG_ITEM) from exc
    if not isinstance(parsed, dict):
        raise UnsupportedFormatError(f"item {HF_CONFIG_ITEM!r} is not a config.json text: not a JSON object",
                                     path=src.path, key=HF_CONFIG_ITEM)
    return value


def _shards(tensors: list[_Tensor], max_bytes: int) -> list[list[_Tensor]]:
    """Consecutive groups (in source order) of at most ``max_bytes``; a larger tensor is a group of its own."""
    groups: list[list[_Tensor]] = []
    size = 0
    for t in sorted(tensors, key=lambda t: t.source_order):
        if not groups or (size + t.nbytes > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups or [[]]


def _export_hf(src: _Source, item: str, out: str, overwrite: bool, max_shard_bytes: int, chunk_bytes: int,
               progress: ProgressCallback | None) -> tuple[int, int, int]:
    if item not in src.m.items:
        raise MissingKeyError(f"format='hf' exports the model's state dict from the item {item!r}, which the "
                              f"checkpoint does not have (it has {sorted(src.m.items)}); name it with item=",
                              path=src.path, key=item)
    config = _hf_config(src)
    flat = _Flattener(src.m, src.path).run(item)
    if flat.values:
        bad = sorted(flat.values)
        raise UnsupportedLeafError(f"format='hf' writes tensors only; item {item!r} holds {len(bad)} other "
                                   f"value(s): {', '.join(bad[:5])}", path=src.path, key=f"{item}/{bad[0]}")
    groups = _shards(flat.tensors, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)])
    parent, base = os.path.split(out)
    try:
        tmp = tempfile.mkdtemp(prefix=f".{base}.", suffix=".zs-tmp", dir=parent)
    except OSError as exc:
        raise StorageError(f"cannot create a directory in {parent}: {exc.strerror}", errno=exc.errno,
                           path=out) from exc
    try:
        done = 0
        for name, group in zip(names, groups, strict=True):
            nbytes = sum(t.nbytes for t in group)
            shard_progress = None if progress is None else (
                lambda phase, d, _t, off=done: progress(phase, off + d, flat.nbytes))
            with _AtomicFile(os.path.join(tmp, name), overwrite=False) as f:
                _write_safetensors(f, _Flat(group, {}, nbytes), src, item, chunk_bytes, shard_progress,
                                   meta={"format": "pt"})
            done += nbytes
        files = {"config.json": config}
        if len(groups) > 1:
            files["model.safetensors.index.json"] = json.dumps(
                {"metadata": {"total_size": flat.nbytes},
                 "weight_map": {t.key: name for name, g in zip(names, groups, strict=True) for t in g}},
                indent=2, sort_keys=True) + "\n"
        for fname, text in files.items():
            with _AtomicFile(os.path.join(tmp, fname), overwrite=False) as f:
                f.write(text.encode())
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700
        _publish_dir(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(flat.tensors), 0, flat.nbytes


def _publish_dir(tmp: str, out: str, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` (``overwrite``) is moved aside first."""
    old = None
    if os.path.lexists(out):
        if not overwrite:
            raise _exists(out)
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".zs-old", dir=os.path.dirname(out))
        os.rename(out, os.path.join(old, "out"))
    try:
        os.rename(tmp, out)
    except OSError as exc:
        if old is not None:  # put the previous output back
            os.rename(os.path.join(old, "out"), out)
        raise StorageError(f"cannot rename the export into place: {exc.strerror}", errno=exc.errno, path=out) from exc
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    fsync_dir(os.path.dirname(out))


# -- torch -------------------------------------------------------------------------------------


def _export_torch(ckpt: str, m: Manifest, item: str | None, out: str, overwrite: bool,
                  progress: ProgressCallback | None) -> tuple[int, int, int]:
    torch = _torch()
    total = _leaf_bytes(m, [name for name, _ in _roots(m, item)])
    if progress is not None:
        progress("read", 0, total)
    opts = LoadOptions(distributed=_SINGLE)
    if item is not None:
        obj = load_checkpointables(ckpt, {item: None}, options=opts)[item]
    else:
        loaded = load_checkpointables(ckpt, None, options=opts)
        obj = loaded[PYTREE] if list(loaded) == [PYTREE] else loaded
    counts = [0, 0, 0]
    obj = _weights_only(obj, item or "", counts, ckpt, torch)
    if progress is not None:
        progress("write", 0, counts[2])
    with _AtomicFile(out, overwrite) as f:
        torch.save(obj, f)
    if progress is not None:
        progress("write", counts[2], counts[2])
    return counts[0], counts[1], counts[2]


def _weights_only(obj: Any, key: str, counts: list[int], path: str, torch: Any) -> Any:
    """``obj`` with only what ``torch.load(weights_only=True)`` rebuilds; counts tensors, values, bytes."""
    if isinstance(obj, (np.ndarray, np.generic)):  # a fresh array from the load: shared, not copied
        obj = torch.from_numpy(obj if isinstance(obj, np.ndarray) and obj.flags.writeable else np.array(obj))
    if isinstance(obj, torch.Tensor):
        counts[0] += 1
        counts[2] += obj.numel() * obj.element_size()
        return obj
    if obj is None or type(obj) in (bool, int, float, str, bytes):
        counts[1] += 1
        return obj
    if isinstance(obj, dict):
        return {k: _weights_only(v, f"{key}/{k}", counts, path, torch) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # a namedtuple becomes a plain tuple
        values = [_weights_only(v, f"{key}/{i}", counts, path, torch) for i, v in enumerate(obj)]
        return values if isinstance(obj, list) else tuple(values)
    raise UnsupportedLeafError(f"a {type(obj).__module__}.{type(obj).__qualname__} cannot be written so that "
                               "torch.load(weights_only=True) reads it; export format='safetensors' keeps "
                               "custom leaves in their encoded form", path=path, key=key.lstrip("/") or None)


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise UnsupportedFormatError(f"torch files need torch: pip install 'zerostall[torch]' ({exc})") from exc
    return torch


# -- import ------------------------------------------------------------------------------------


def import_checkpoint(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, format: ImportFormat | None = None,
    metadata: dict[str, Any] | None = None, options: SaveOptions | None = None,
    progress: ProgressCallback | None = None,
) -> ImportReport:
    """Save a ``torch.save`` file, a ``.safetensors`` file or a PyTorch DCP checkpoint directory as
    the zerostall checkpoint ``dst``.

    Args:
        src: a local ``torch.save`` or ``.safetensors`` file, or a local DCP checkpoint directory
            (with ``.metadata``).
        dst: the checkpoint to create (a path or storage URL); it must not exist.
        format: ``"torch"``, ``"safetensors"`` or ``"dcp"``; default: ``"dcp"`` for a directory,
            ``"safetensors"`` for a file named ``*.safetensors``, else ``"torch"``.
        metadata: JSON stored in the manifest, beside ``imported_from`` (``{"path", "format"}``).
        options: how ``dst`` is saved; ``distributed`` defaults to disabled (an import is one
            process's work even when torch.distributed is initialized).
        progress: called with ``(phase, bytes done, bytes total)`` for the "read" and "write" phases.

    The loaded object is saved with :func:`zerostall.save_pytree`, whatever its shape, so
    ``zerostall.load_pytree(dst)`` returns it as loaded and ``export_checkpoint(dst, "x.pt")``
    gives it back; a template (``{"model": model}``) restores only part of it, in place. torch
    files are read with ``torch.load(src, weights_only=True, mmap=True, map_location="cpu")``:
    tensor bytes stay in the page cache until saved, and nothing but weights-only pickle runs
    (files in the legacy, non-zip format are read without ``mmap``). A safetensors file is mapped
    and read by zerostall (its 8-byte header length, JSON header, then raw bytes; nothing is
    unpickled and the ``safetensors`` package is not needed): its tensors are saved as one flat
    dict under their names as they are (``"layers.0.weight"``), and its ``__metadata__`` goes into
    the manifest's metadata as ``"safetensors_metadata"``. DCP checkpoints are read by
    DCP's own loader (the calls behind ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``,
    without a process group), into memory; **that loader unpickles the checkpoint's ``.metadata``
    and its non-tensor values, so import only DCP checkpoints you trust.** DCP itself turns int
    dict keys into strings. Like every ``save_pytree``, the staging buffers stay allocated in this
    process for later saves with the same ``options`` (the CLI exits, which frees them).

    Raises:
        CheckpointNotFoundError: ``src`` does not exist.
        CheckpointExistsError: ``dst`` already holds a checkpoint (checked before reading ``src``).
        UnsupportedFormatError: ``src`` needs pickle beyond what ``weights_only`` allows, is not a
            torch.save file, is a malformed safetensors file (names what is wrong), or is a
            directory without DCP's ``.metadata``.
        CorruptCheckpointError: DCP's loader failed on ``src``.
        UnsupportedLeafError: the loaded object holds a value zerostall cannot save (names the key).
        StorageError: reading ``src`` or writing ``dst`` failed.

    Example::

        >>> import torch, zerostall
        >>> from zerostall.interop import import_checkpoint
        >>> torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "epoch": 3}, "/tmp/old.pt")  # doctest: +SKIP
        >>> import_checkpoint("/tmp/old.pt", "/ckpt/imported")                                     # doctest: +SKIP
        ImportReport(source='/tmp/old.pt', path='/ckpt/imported', format='torch', tensors=2, nbytes=24)
        >>> zerostall.load_pytree("/ckpt/imported")["epoch"]                                     # doctest: +SKIP
        3
    """
    source = os.path.abspath(os.path.expanduser(os.fspath(src)))
    if not os.path.exists(source):
        raise CheckpointNotFoundError("no such file or directory to import", path=source)
    fmt: ImportFormat
    if format is None:
        fmt = "dcp" if os.path.isdir(source) else "safetensors" if source.endswith(".safetensors") else "torch"
    elif format in ("torch", "dcp", "safetensors"):
        fmt = format
    else:
        raise UnsupportedFormatError(f"format must be 'torch', 'safetensors' or 'dcp', got {format!r}", path=source)
    root, name = split_url(_url(dst))
    target = f"{root.rstrip('/')}/{name}"
    _check_dst(root, name, target)
    if progress is not None:
        progress("read", 0, 0)
    extra: dict[str, Any] = {}
    if fmt == "safetensors":
        tree, st_meta = _load_safetensors(source)
        if st_meta:
            extra["safetensors_metadata"] = st_meta
    else:
        tree = _load_dcp(source) if fmt == "dcp" else _load_torch(source)
    counts = _count_tensors(tree)
    if progress is not None:
        progress("write", 0, counts[1])
    opts = options if options is not None else SaveOptions()
    if opts.distributed is None:
        opts = dataclasses.replace(opts, distributed=_SINGLE)
    meta = {"imported_from": {"path": source, "format": fmt}, **extra, **(metadata or {})}
    save_pytree_async(target, tree, metadata=meta, options=opts).result()
    if progress is not None:
        progress("write", counts[1], counts[1])
    return ImportReport(source=source, path=target, format=fmt, tensors=counts[0], nbytes=counts[1])


def _check_dst(root: str, name: str, target: str) -> None:
    local = local_path(root)
    if local is not None and os.path.lexists(os.path.join(local, name)) and not os.path.isdir(
            os.path.join(local, name)):
        raise CheckpointExistsError("the destination exists and is not a directory", path=target)
    try:
        committed = open_storage(root).exists(f"{name}/{MANIFEST_NAME}")
    except OSError as exc:
        raise StorageError(f"cannot check the destination: {exc}", errno=exc.errno, path=target) from exc
    if committed:
        raise CheckpointExistsError("a committed checkpoint is already there; zerostall never overwrites one",
                                    path=target)


def _load_torch(source: str) -> Any:
    torch = _torch()
    try:
        try:
            return torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap can only be used" not in str(exc):
                raise
        return torch.load(source, map_location="cpu", weights_only=True)  # legacy format (or not torch at all)
    except OSError as exc:
        raise StorageError(f"cannot read the file: {exc.strerror or exc}", errno=exc.errno, path=source) from exc
    except Exception as exc:
        text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).split())
        why = text.partition("WeightsUnpickler error:")[2].partition(" Check the documentation")[0].strip()
        if "Unsupported global" in why:
            raise UnsupportedFormatError(
                f"the file needs pickle beyond what torch.load(weights_only=True) allows ({why.split('. ')[0]}); "
                "zerostall never unpickles arbitrary objects: if you trust the file, load it with "
                "torch.load(weights_only=False) yourself and save the result with zerostall.save_pytree",
                path=source) from exc
        raise UnsupportedFormatError(f"not a readable torch.save file ({type(exc).__name__}: {(why or text)[:200]})",
                                     path=source) from exc


def _load_safetensors(source: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors of a safetensors file as one flat dict (views of a copy-on-write mapping of the
    file: no read until saved), and its ``__metadata__``; every header field checked."""
    torch = _torch()

    def bad(why: str) -> UnsupportedFormatError:
        return UnsupportedFormatError(f"not a readable safetensors file: {why}", path=source)
    try:
        size = os.path.getsize(source)
        with open(source, "rb") as f:
            n = header_length(f.read(8), size)
            raw = f.read(n)
        data = np.memmap(source, dtype=np.uint8, mode="c") if size > 8 + n else np.zeros(0, dtype=np.uint8)
    except HeaderError as exc:
        raise bad(str(exc)) from exc
    except OSError as exc:
        raise StorageError(f"cannot read the file: {exc.strerror or exc}", errno=exc.errno, path=source) from exc
    start = 8 + n
    try:
        meta, entries = tensor_entries(decode_header(raw), size - start)
    except HeaderError as exc:
        raise bad(str(exc)) from exc
    tree = {}
    for e in entries:
        t = torch.from_numpy(data[start + e.lo:start + e.hi]) if e.hi > e.lo else torch.zeros(0, dtype=torch.uint8)
        if (start + e.lo) % ITEMSIZE[e.dtype]:
            t = t.clone()  # a view as a wider type needs an aligned start
        tree[e.name] = t.view(to_torch_dtype(e.dtype)).reshape(e.shape)
    return tree, meta


def _load_dcp(source: str) -> Any:
    if not os.path.isfile(os.path.join(source, ".metadata")):
        hint = " (it is a zerostall checkpoint already)" if os.path.exists(os.path.join(source, MANIFEST_NAME)) else ""
        raise UnsupportedFormatError(f"not a DCP checkpoint: the directory has no .metadata file{hint}", path=source)
    _torch()
    try:
        # DCP's public converter (format_utils.dcp_to_torch_save) is these two calls plus a
        # torch.save we do not want; the public load() cannot rebuild a state dict from nothing.
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError as exc:
        raise UnsupportedFormatError(f"this torch has no DCP loader to import with ({exc})", path=source) from exc
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(source), planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
                         no_dist=True)
    except Exception as exc:
        first = " ".join(str(exc).split())[:300]
        raise CorruptCheckpointError(f"DCP's loader failed: {type(exc).__name__}: {first}", path=source) from exc
    return state


def _count_tensors(tree: Any) -> tuple[int, int]:
    import torch

    n = nbytes = 0
    stack = [tree]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            n += 1
            nbytes += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return n, nbytes


# -- helpers -----------------------------------------------------------------------------------


def _url(p: str | os.PathLike[str]) -> str:
    s = os.fspath(p)
    return local_path(s) or s


