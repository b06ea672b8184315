"""What the trainer and its writer say to each other: frozen dataclasses, one codec, one version.

Everything that crosses the trainer-to-writer boundary (a socket pair to a writer process or
thread) is one of the message classes below, or one that the memory tier's keeper adds to the
same codec (:mod:`zerostall.memtier.messages`, :func:`register_message`), encoded as one JSON
object ``{"v": PROTOCOL, "op": "<kind>", ...fields}``. Buffer descriptors travel beside
:class:`MapBuffer` as ``SCM_RIGHTS``; nothing else is passed out of band.

Decoding is strict: an unknown ``op``, a missing field or a field of the wrong type is a
:class:`~zerostall.errors.WriterError` naming it. A message of another protocol version is
refused with a :class:`ProtocolMismatchError` that names both versions, so a trainer and a
writer of different zerostall versions (an upgrade on disk while a job runs, a keeper that
outlived its trainer) refuse each other clearly instead of misreading a field. The writer
introduces itself with :class:`Hello` as its first message.

Errors cross the boundary as :class:`WireError` (:func:`to_wire` / :func:`from_wire`), the same
codec the ranks of a collective save use for each other's failures.

A bottom layer: it imports only :mod:`zerostall.errors`, :mod:`zerostall.options`, the version
and the manifest's leaf record (:mod:`zerostall.format.manifest`), never a stage.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from zerostall._version import __version__
from zerostall.errors import (
    CheckpointExistsError,
    StorageError,
    UnknownLayoutError,
    WriterError,
    ZerostallError,
    wire_class,
)
from zerostall.format.manifest import LeafEntry
from zerostall.options import RetentionPolicy

__all__ = [
    "PROTOCOL", "ProtocolMismatchError", "LeafRow", "FileRow", "WriteOptions", "Collective", "SaveJob", "LeafLayout",
    "ForgetLayout", "resolve_layout", "node_index", "node_delta", "NodeIndex",
    "WriterStats", "Hello", "MapBuffer", "UnmapBuffer", "Close", "Released", "Done", "Failed", "SavePiece", "Message",
    "register_message", "encode", "decode", "WireError", "to_wire", "from_wire",
]

#: bumped whenever a message or one of its fields changes meaning
#: 3: KeeperFailed; 4: KeeperBusy; 5: SaveJob.crcs; 6: SaveJob.storage_ref, Adopt.instance (a
#: keeper that ignored it would offer a deleted directory's step to a trainer of a new one), Closed,
#: PersistHeld and Persisted; 7: ReplicaSetup, ImageQuery.origin (a keeper that ignored it would
#: answer with its own step for another rank's replica); 8: LeafLayout, ForgetLayout, SaveJob.layout
#: and SaveJob.order (a job may name its leaf rows and unchanged item nodes instead of carrying them);
#: 9: PersistHeld.timeout_s (a preemption notice bounds the keepers' persist by the time it leaves);
#: 10: a leaf row is the manifest's leaf entry (format.manifest.LeafEntry), with its ``crc32c`` field;
#: 11: ImageQuery.request and Image.request (an answer to a query the trainer stopped waiting for,
#: a keeper that hung, is never taken for a later query's: it may describe another rank's replica)
#: 12: ReplicaSetup.in_place; 13: SaveJob.pieces and SavePiece (a save staged and written in pieces);
#: 14: ReplicaSetup.parity_group, ImageQuery.parity, Image.parity_step and Image.parity (a keeper
#: that ignored the query's parity would answer with its own step as if it were parity)
PROTOCOL = 14


class ProtocolMismatchError(WriterError):
    """The other side speaks another version of the trainer-to-writer protocol."""


class Message:
    """A message of the trainer-to-writer wire: every kind derives from it, the core's below and
    those a writer that is more than a writer adds (the memory tier's keeper registers its own,
    :mod:`zerostall.memtier.messages`, with :func:`register_message`)."""

    __slots__ = ()


# -- errors as data -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WireError:
    """An exception as data, so that another process (the writer, another rank) can raise the same class.

    ``cls`` names an error class (:func:`~zerostall.errors.wire_class`); an unknown name comes back
    as :class:`~zerostall.errors.WriterError`.
    """

    cls: str
    message: str
    errno: int | None = None
    path: str | None = None
    key: str | None = None
    rank: int | None = None

    def to_json(self) -> dict[str, object]:
        return {"class": self.cls, "message": self.message, "errno": self.errno, "path": self.path,
                "key": self.key, "rank": self.rank}

    @classmethod
    def from_json(cls, data: object) -> WireError:
        """Read what :meth:`to_json` wrote; fields of the wrong type are dropped, never trusted."""
        d = data if isinstance(data, dict) else {}

        def opt_str(name: str) -> str | None:
            v = d.get(name)
            return v if isinstance(v, str) else None

        def opt_int(name: str) -> int | None:
            v = d.get(name)
            return v if type(v) is int else None

        return cls(cls=opt_str("class") or "WriterError", message=str(d.get("message", "")),
                   errno=opt_int("errno"), path=opt_str("path"), key=opt_str("key"), rank=opt_int("rank"))


def to_wire(exc: BaseException, *, path: str | None = None) -> WireError:
    """Describe ``exc`` so that :func:`from_wire` can rebuild it in another process.

    A :class:`~zerostall.errors.ZerostallError` keeps its class and fields; ``FileExistsError``
    becomes :class:`~zerostall.errors.CheckpointExistsError`, any other ``OSError`` a
    :class:`~zerostall.errors.StorageError` with its errno; anything else a ``WriterError`` whose
    message names the original type. ``path`` fills in where the exception names none.
    """
    if isinstance(exc, ZerostallError):
        return WireError(cls=type(exc).__name__, message=exc.message,
                         errno=exc.errno if isinstance(exc, StorageError) else None,
                         path=exc.path if exc.path is not None else path, key=exc.key, rank=exc.rank)
    if isinstance(exc, FileExistsError):
        return WireError(cls=CheckpointExistsError.__name__, message=str(exc), path=path)
    if isinstance(exc, OSError):
        message = exc.strerror or str(exc)
        if isinstance(exc.filename, str) and exc.filename != path:
            message = f"{message}: {exc.filename}"
        return WireError(cls=StorageError.__name__, message=message, errno=exc.errno,
                         path=path if path is not None else (exc.filename if isinstance(exc.filename, str) else None))
    return WireError(cls=WriterError.__name__, message=f"{type(exc).__name__}: {exc}", path=path)


def from_wire(w: WireError) -> ZerostallError:
    """Rebuild an exception described by :func:`to_wire` (same class, errno, path, key, rank)."""
    cls = wire_class(w.cls)
    if issubclass(cls, StorageError):
        return cls(w.message, errno=w.errno, path=w.path, key=w.key, rank=w.rank)
    return cls(w.message, path=w.path, key=w.key, rank=w.rank)


# -- the data of a save ---------------------------------------------------------------------


#: One staged leaf: where its bytes lie in the staged file image (and so in the data file). It is
#: the manifest's own leaf record, as the staging plan made it (``crc32c`` None: the checksums of
#: a save travel in :attr:`SaveJob.crcs`, since a layout's rows serve every save of it); the
#: writer writes it into the manifest unchanged, with the checksum.
LeafRow = LeafEntry


@dataclass(frozen=True, kw_only=True)
class FileRow:
    """One data file of the save, staged whole in buffer ``buffer`` (a :class:`MapBuffer` id)."""

    name: str
    length: int
    buffer: int


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How the writer writes data files (from :class:`~zerostall.SaveOptions`)."""

    direct_io: bool
    io_threads: int
    chunk_bytes: int


@dataclass(frozen=True, kw_only=True)
class Collective:
    """This rank's part in a collective save: who it is and how the ranks name the attempt."""

    rank: int
    world: int
    run: str  # agreed once per engine by all ranks
    counter: int  # this engine's save number; with ``run``, names the attempt on every rank
    timeout_s: float
    poll_s: float


@dataclass(frozen=True, kw_only=True)
class SaveJob(Message):
    """One save, as the writer runs it (:func:`zerostall.persist.job.run_save`)."""

    id: int
    root: str  # storage URL of the directory the checkpoint goes into
    name: str  # the checkpoint's name inside ``root``
    path: str  # root + name, for messages
    files: tuple[FileRow, ...]
    leaves: tuple[LeafRow, ...]
    items: dict[str, Any]  # the flattened tree nodes (JSON), as the manifest records them
    metadata: dict[str, Any] = field(default_factory=dict)
    step: int | None = None  # a Checkpointer's step (retention counts from it)
    retention: RetentionPolicy | None = None
    #: the trainer's storage variables (AWS_*, ZEROSTALL_S3_*): the writer may have started
    #: before the caller set its credentials or endpoint
    env: dict[str, str] = field(default_factory=dict)
    write: WriteOptions
    collective: Collective | None = None
    #: commit this save to the memory tier: the writer (the keeper) holds its buffers as the
    #: newest in-memory step until a newer one commits there (then sends :class:`Released`)
    memory: bool = False
    #: also write the checkpoint to ``root`` (False: a memory-only step)
    persist: bool = True
    #: the CRC32C of each leaf of ``leaves`` (in its order) as staging computed it in its copy
    #: (``None``: staging did not checksum that leaf); empty: none. The writer checksums only
    #: the others (docs/design.md, "Checksums at staging").
    crcs: tuple[int | None, ...] = ()
    #: where ``root``'s URL scheme comes from when it is not built in (``register_scheme``, or an
    #: entry point, in the trainer): the import reference of its factory (``module:name``), which
    #: the writer imports before it opens ``root`` (:func:`zerostall.storage.import_scheme`); ""
    #: for the built-in schemes
    storage_ref: str = ""
    #: the :class:`LeafLayout` (sent earlier on the same connection) this job names, 0: none. With
    #: one, ``leaves`` is empty (the layout's rows are this job's), ``items`` holds only the item
    #: nodes that differ from the layout's, in which a subtree the layout holds is a reference to
    #: it (:func:`node_delta`), and ``order`` names every item in order; the writer fills the job
    #: in (:func:`resolve_layout`) before it runs
    layout: int = 0
    order: tuple[str, ...] = ()
    #: how many :class:`SavePiece` messages follow with this job's bytes (0: ``files`` are staged
    #: whole, each in its ``buffer``); a piecewise job's files name buffer 0
    pieces: int = 0


@dataclass(frozen=True, kw_only=True)
class SavePiece(Message):
    """One byte range of a piecewise job's data file (``Checkpointer(host_memory_limit=...)``),
    staged in ``buffer``: ``length`` bytes written at ``offset`` of file ``file``. ``crcs`` are the
    CRC32Cs of the leaf parts it holds, ``(leaf, lo, hi, crc)`` (bytes ``lo:hi`` of leaf ``leaf``),
    which the writer joins into each leaf's. The writer answers :class:`Released` with ``id`` once
    it no longer reads the buffer. ``abort``: the trainer failed to stage the rest (no bytes
    here): the writer fails the job, and nothing of it is committed."""

    id: int
    job: int
    file: int
    offset: int
    length: int
    buffer: int
    crcs: tuple[tuple[int, int, int, int], ...] = ()
    abort: bool = False


@dataclass(frozen=True, kw_only=True)
class LeafLayout(Message):
    """What every save of one layout repeats: its leaf rows (~170 bytes of JSON a leaf) and its
    item nodes as first sent. Sent once per writer connection, ahead of the first job that names
    ``id``; the writer keeps it until :class:`ForgetLayout` or the end of the connection, so a
    restarted writer, or a keeper adopted by a new trainer, is sent it again. Ids are never reused
    by one trainer: a job naming an id its writer does not hold is refused
    (:class:`~zerostall.errors.UnknownLayoutError`), never run with other rows."""

    id: int
    leaves: tuple[LeafRow, ...]
    items: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ForgetLayout(Message):
    """The trainer will name layout ``id`` in no later job: the writer may drop it."""

    id: int


def resolve_layout(job: SaveJob, layouts: dict[int, LeafLayout]) -> SaveJob:
    """``job`` with the rows and item nodes of the layout it names filled in (itself if it names none).

    Raises:
        UnknownLayoutError: ``layouts`` holds no layout ``job.layout`` (never sent on this
            connection, or forgotten), or an item ``order`` names is in neither.
    """
    if not job.layout:
        return job
    known = layouts.get(job.layout)
    if known is None:
        raise UnknownLayoutError(f"the save names leaf layout {job.layout}, which this writer (pid {os.getpid()}) "
                                 "was never sent or has forgotten; nothing of this save was written", path=job.path)
    items: dict[str, Any] = {}
    for name in job.order:
        if name in job.items:
            items[name] = _resolved(job.items[name], known, job)
        elif name in known.items:
            items[name] = known.items[name]
        else:
            raise UnknownLayoutError(f"the save names item {name!r} of leaf layout {job.layout}, which has no such "
                                     "item; nothing of this save was written", path=job.path, key=name)
    return dataclasses.replace(job, leaves=known.leaves, items=items, layout=0, order=())


#: the type of a node that stands for the layout's node at ``path`` (:func:`node_delta`); no
#: flattener makes nodes of this type
_REF = "layout-ref"

#: a layout's container nodes (those with ``values``) by identity: (node, path to it)
NodeIndex = dict[int, tuple[Any, list[Any]]]


def node_index(items: dict[str, Any]) -> NodeIndex:
    """Every container node of a layout's ``items`` (a dict, list, tuple or namedtuple node) by
    identity, with its path (the item's name, then indices into ``values``). Made once per layout
    sent; the caller keeps ``items`` alive, so no id is reused while the index is."""
    out: NodeIndex = {}

    def walk(node: Any, path: list[Any]) -> None:
        values = node.get("values") if type(node) is dict else None
        if type(values) is list:
            out[id(node)] = (node, path)
            for i, v in enumerate(values):
                if type(v) is dict and "values" in v:
                    walk(v, [*path, i])

    for name, node in items.items():
        walk(node, [name])
    return out


def node_delta(node: Any, index: NodeIndex) -> Any:
    """``node`` with every subtree that is (by identity) a node of the layout ``index`` was made
    from replaced by a reference to it: a save whose step count changed sends that scalar and the
    containers above it, not the model's and optimizer's nodes again. Costs per container node
    that changed and its direct children."""
    hit = index.get(id(node))
    if hit is not None and hit[0] is node:
        return {"type": _REF, "path": hit[1]}
    values = node.get("values") if type(node) is dict else None
    if type(values) is not list:
        return node
    return {**node, "values": [node_delta(v, index) if type(v) is dict and "values" in v else v for v in values]}


def _resolved(node: Any, layout: LeafLayout, job: SaveJob) -> Any:
    """``node`` with the references :func:`node_delta` made replaced by the layout's nodes."""
    if type(node) is not dict:
        return node
    if node.get("type") == _REF:
        path: Any = node.get("path")
        found: Any = layout.items.get(path[0]) if type(path) is list and path and type(path[0]) is str else None
        for i in path[1:] if found is not None else ():
            values = found.get("values") if type(found) is dict else None
            found = values[i] if type(values) is list and type(i) is int and 0 <= i < len(values) else None
            if found is None:
                break
        if type(found) is not dict:
            raise UnknownLayoutError(f"the save refers to node {path!r} of leaf layout {layout.id}, which has no "
                                     "such node; nothing of this save was written", path=job.path)
        return found
    values = node.get("values")
    if type(values) is not list:
        return node
    return {**node, "values": [_resolved(v, layout, job) for v in values]}


@dataclass(frozen=True, kw_only=True)
class WriterStats:
    """What the writer measured and did for one committed save."""

    nbytes: int  # bytes written by this writer (data files, headers included)
    write_s: float | None = None  # None: the writer died after committing (nothing measured)
    commit_s: float | None = None
    persist_s: float | None = None
    writer_peak_rss: int | None = None
    deleted_steps: tuple[int, ...] = ()
    retention_error: str | None = None  # the save committed, but deleting old steps failed
    rank: int | None = None
    leaves_written: int | None = None
    #: the tiers this save reached: "memory" (the keeper holds it), "storage" (persisted)
    tiers: tuple[str, ...] = ("storage",)


# -- the messages ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """The writer's first message: its protocol and library version, and its pid."""

    protocol: int
    library: str
    pid: int
    #: a memory-tier keeper that could not take its name (the bind's error, or another user's
    #: process holding it): it serves this trainer, but no restart can adopt it after a crash.
    #: A default (None: adoptable, or no keeper), so either side of another version decodes it:
    #: no protocol bump.
    unadoptable: WireError | None = None


@dataclass(frozen=True, kw_only=True)
class MapBuffer(Message):
    """Map the shared buffer whose descriptor follows this message (``SCM_RIGHTS``)."""

    buffer: int
    size: int


@dataclass(frozen=True, kw_only=True)
class UnmapBuffer(Message):
    """The trainer is about to free ``buffer``: drop the mapping."""

    buffer: int


@dataclass(frozen=True, kw_only=True)
class Close(Message):
    """Finish the jobs already received, then exit."""


@dataclass(frozen=True, kw_only=True)
class Released(Message):
    """The writer no longer reads job ``job``'s buffers: they may be staged into again."""

    job: int


@dataclass(frozen=True, kw_only=True)
class Done(Message):
    """Job ``job`` is committed."""

    job: int
    stats: WriterStats


@dataclass(frozen=True, kw_only=True)
class Failed(Message):
    """Job ``job`` failed; nothing of it was committed."""

    job: int
    error: WireError


_OPS: dict[str, type[Message]] = {
    "hello": Hello, "map": MapBuffer, "unmap": UnmapBuffer, "save": SaveJob, "layout": LeafLayout,
    "forget-layout": ForgetLayout, "close": Close, "released": Released, "done": Done, "failed": Failed,
    "piece": SavePiece,
}
_OP_OF: dict[type[Message], str] = {cls: op for op, cls in _OPS.items()}


def register_message(op: str, cls: type[Message]) -> None:
    """Add the message kind ``cls`` under ``op`` to the one codec (a frozen dataclass deriving
    from :class:`Message`: its fields are checked against its annotations as the core's are).
    For a writer that is more than a writer: the memory tier's keeper registers its own kinds
    (:mod:`zerostall.memtier.messages`), so a plain writer neither knows nor imports them.

    Raises:
        ValueError: ``op`` names another kind already.
    """
    if _OPS.get(op, cls) is not cls:
        raise ValueError(f"message op {op!r} is {_OPS[op].__name__}'s")
    _OPS[op] = cls
    _OP_OF[cls] = op


def encode(msg: Message) -> bytes:
    """One message as UTF-8 JSON bytes."""
    if type(msg) is SaveJob:
        return _encode_job(msg)
    doc = _to_json(msg)
    assert isinstance(doc, dict)
    return json.dumps({"v": PROTOCOL, "op": _OP_OF[type(msg)], **doc}, separators=(",", ":"),
                      allow_nan=False).encode()


def decode(data: bytes) -> Message:
    """Parse and validate one message.

    Raises:
        ProtocolMismatchError: the message carries another protocol version.
        WriterError: the bytes are not a well-formed message of this protocol.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WriterError(f"malformed writer message: not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise WriterError("malformed writer message: not an object")
    version = doc.pop("v", None)
    if version != PROTOCOL:
        lib = doc.get("library") if doc.get("op") == "hello" else None
        raise ProtocolMismatchError(
            f"the other side of the writer connection speaks protocol {version!r}"
            + (f" (zerostall {lib})" if isinstance(lib, str) else "")
            + f", this process protocol {PROTOCOL} (zerostall {__version__}); restart the job so that "
            "trainer and writer run the same zerostall")
    op = doc.pop("op", None)
    cls = _OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise WriterError(f"malformed writer message: unknown op {op!r}")
    msg: Message = _from_json(cls, doc, op)
    return msg


# -- the codec: dataclass fields <-> JSON, checked against the annotations --------------------
#
# Each class's annotations are compiled once into converter functions: a layout's leaf rows
# (thousands) are then encoded and checked without re-reading annotations per field. A save of a
# known layout sends neither its rows nor its unchanged item nodes (:class:`LeafLayout`).

Encoder = Callable[[Any], Any]
_ENCODERS: dict[type[Any], Encoder] = {}
_DECODERS: dict[Any, Callable[[Any], Any]] = {}
_NODES_KEEP = 16


def _to_json(value: Any) -> Any:
    return _encoder(type(value))(value)


def _encoded_rows(rows: tuple[LeafRow, ...]) -> list[Any]:
    enc = _encoder(LeafRow)
    return [enc(r) for r in rows]


def _encode_job(job: SaveJob) -> bytes:
    """A ``SaveJob`` as :func:`encode` makes it, with each item node's JSON text made once per
    node object (:func:`_node_json`) and spliced in as the object's last member (the decoder does
    not care about member order)."""
    doc = _to_json(job)
    assert isinstance(doc, dict)
    doc.pop("items")
    head = json.dumps({"v": PROTOCOL, "op": _OP_OF[SaveJob], **doc}, separators=(",", ":"), allow_nan=False)
    items = b",".join(json.dumps(name).encode() + b":" + _node_json(node) for name, node in job.items.items())
    return b"".join((head[:-1].encode(), b',"items":{', items, b"}}"))


_NODES_JSON: OrderedDict[int, tuple[Any, bytes]] = OrderedDict()


def _node_json(node: Any) -> bytes:
    """The JSON text of one item's tree node, computed once per node object: a save whose layout
    is not yet its writer's, or whose node changed, may hand the same node objects as an earlier
    save (zerostall.stage.reuse keeps unchanged subtrees), and a node of 20,000 leaves is ~40 bytes
    of JSON each. Nodes are never modified once made."""
    hit = _NODES_JSON.get(id(node))
    if hit is not None and hit[0] is node:
        _NODES_JSON.move_to_end(id(node))
        return hit[1]
    out = json.dumps(node, separators=(",", ":"), allow_nan=False).encode()
    _NODES_JSON[id(node)] = (node, out)  # holds the node, so its id cannot be reused while cached
    while len(_NODES_JSON) > _NODES_KEEP:
        _NODES_JSON.popitem(last=False)
    return out


def _encoder(cls: type[Any]) -> Encoder:
    enc = _ENCODERS.get(cls)
    if enc is not None:
        return enc
    if cls is WireError:
        enc = WireError.to_json
    elif dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        parts = [(f.name, _field_encoder(hints[f.name])) for f in dataclasses.fields(cls)]

        def enc(v: Any, parts: list[tuple[str, Encoder | None]] = parts) -> Any:
            return {n: (getattr(v, n) if e is None else e(getattr(v, n))) for n, e in parts}
    else:
        enc = _plain
    _ENCODERS[cls] = enc
    return enc


def _plain(v: Any) -> Any:
    return v


def _field_encoder(tp: Any) -> Encoder | None:
    """None where the value is already JSON (str, int, float, bool, None, dicts of JSON)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        sub = _field_encoder(inner[0]) if len(inner) == 1 else _to_json
        if sub is None:
            return None
        opt: Encoder = sub
        return lambda v: None if v is None else opt(v)
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        if elem is LeafRow:
            return _encoded_rows
        sub = _field_encoder(elem)
        return list if sub is None else (lambda v: [sub(x) for x in v])
    if tp is WireError or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return _encoder(tp)
    return None


class _Bad(Exception):
    """A field failed its check; the location is filled in on the way out (success costs nothing)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path: list[str] = []


def _from_json(cls: type[Any], doc: Any, where: str) -> Any:
    try:
        return _decoder(cls)(doc)
    except _Bad as exc:
        raise WriterError(f"malformed writer message: {where}{''.join(reversed(exc.path))}{exc.what}"[:300]) from None


Decoder = Callable[[Any], Any]


def _decoder(tp: Any) -> Decoder:
    dec = _DECODERS.get(tp)
    if dec is None:
        dec = _DECODERS[tp] = _make_decoder(tp)
    return dec


def _make_decoder(tp: Any) -> Decoder:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:  # pragma: no cover - no message field is a union of two types
            raise TypeError(f"unsupported union {tp!r}")
        sub = _decoder(inner[0])
        nullable = type(None) in args

        def dec_opt(v: Any) -> Any:
            return None if v is None and nullable else sub(v)
        return dec_opt
    if tp is Any:
        return _plain
    if origin is tuple:
        elem = _decoder(typing.get_args(tp)[0])

        def dec_tuple(v: Any) -> Any:
            if not isinstance(v, list):
                raise _Bad(" must be a list")
            out = []
            for i, x in enumerate(v):
                try:
                    out.append(elem(x))
                except _Bad as exc:
                    exc.path.append(f"[{i}]")
                    raise
            return tuple(out)
        return dec_tuple
    if origin is dict:
        kt, vt = (_decoder(a) for a in typing.get_args(tp))

        def dec_dict(v: Any) -> Any:
            if not isinstance(v, dict):
                raise _Bad(" must be an object")
            out = {}
            for k, x in v.items():
                try:
                    out[kt(k)] = vt(x)
                except _Bad as exc:
                    exc.path.append(f".{k}")
                    raise
            return out
        return dec_dict
    if tp is WireError:
        return WireError.from_json
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    if tp is float:
        def dec_float(v: Any) -> Any:
            if type(v) not in (int, float):
                raise _Bad(f" must be a number, got {v!r}")
            return float(v)
        return dec_float
    if tp in (int, str, bool):
        def dec_exact(v: Any, tp: type = tp) -> Any:
            if type(v) is not tp:
                raise _Bad(f" must be {tp.__name__}, got {v!r}")
            return v
        return dec_exact
    raise TypeError(f"unsupported field type {tp!r}")  # pragma: no cover - a new message field


def _dataclass_decoder(cls: type[Any]) -> Decoder:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
               _decoder(hints[f.name])) for f in dataclasses.fields(cls)]

    def dec(doc: Any) -> Any:
        if not isinstance(doc, dict):
            raise _Bad(" must be an object")
        kwargs: dict[str, Any] = {}
        for name, required, sub in fields:
            if name in doc:
                try:
                    kwargs[name] = sub(doc[name])
                except _Bad as exc:
                    exc.path.append(f".{name}")
                    raise
            elif required:
                raise _Bad(f" lacks {name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise _Bad(f": {exc}") from exc
    return dec
