"""What the trainer and its writer say to each other: frozen dataclasses, one codec, one version.

Everything that crosses the trainer-to-writer boundary (a socket pair to a writer process or
thread; later the memory tier's keeper) is one of the message classes below, encoded as one
JSON object ``{"v": PROTOCOL, "op": "<kind>", ...fields}``. Buffer descriptors travel beside
:class:`MapBuffer` as ``SCM_RIGHTS``; nothing else is passed out of band.

Decoding is strict: an unknown ``op``, a missing field or a field of the wrong type is a
:class:`~zerostall.errors.WriterError` naming it. A message of another protocol version is
refused with a :class:`ProtocolMismatchError` that names both versions, so a trainer and a
writer of different zerostall versions (an upgrade on disk while a job runs, a keeper that
outlived its trainer) refuse each other clearly instead of misreading a field. The writer
introduces itself with :class:`Hello` as its first message.

A bottom layer: it imports only :mod:`zerostall.errors`, :mod:`zerostall.options` and the
version, never a stage.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from zerostall._version import __version__
from zerostall.errors import WireError, WriterError
from zerostall.options import RetentionPolicy

__all__ = [
    "PROTOCOL", "ProtocolMismatchError", "LeafRow", "FileRow", "WriteOptions", "Collective", "SaveJob",
    "WriterStats", "Hello", "MapBuffer", "UnmapBuffer", "Close", "Released", "Done", "Failed", "Message",
    "encode", "decode",
]

#: bumped whenever a message or one of its fields changes meaning
PROTOCOL = 1


class ProtocolMismatchError(WriterError):
    """The other side speaks another version of the trainer-to-writer protocol."""


# -- the data of a save ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LeafRow:
    """One staged leaf: where its bytes lie in the staged file image (and so in the data file)."""

    key: str
    kind: str  # torch, numpy, numpy_scalar, bytes, custom (the manifest's leaf kinds)
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    file: int  # index into SaveJob.files
    offset: int  # absolute byte offset in that file
    nbytes: int
    #: False when no other rank can hold these bytes (a shard of a Shard-only DTensor): a
    #: collective save does not hash it looking for replicas
    shared: bool = True


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
class SaveJob:
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


# -- the messages ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Hello:
    """The writer's first message: its protocol and library version, and its pid."""

    protocol: int
    library: str
    pid: int


@dataclass(frozen=True, kw_only=True)
class MapBuffer:
    """Map the shared buffer whose descriptor follows this message (``SCM_RIGHTS``)."""

    buffer: int
    size: int


@dataclass(frozen=True, kw_only=True)
class UnmapBuffer:
    """The trainer is about to free ``buffer``: drop the mapping."""

    buffer: int


@dataclass(frozen=True, kw_only=True)
class Close:
    """Finish the jobs already received, then exit."""


@dataclass(frozen=True, kw_only=True)
class Released:
    """The writer no longer reads job ``job``'s buffers: they may be staged into again."""

    job: int


@dataclass(frozen=True, kw_only=True)
class Done:
    """Job ``job`` is committed."""

    job: int
    stats: WriterStats


@dataclass(frozen=True, kw_only=True)
class Failed:
    """Job ``job`` failed; nothing of it was committed."""

    job: int
    error: WireError


Message = Hello | MapBuffer | UnmapBuffer | SaveJob | Close | Released | Done | Failed

_OPS: dict[str, type[Any]] = {
    "hello": Hello, "map": MapBuffer, "unmap": UnmapBuffer, "save": SaveJob, "close": Close,
    "released": Released, "done": Done, "failed": Failed,
}
_OP_OF = {cls: op for op, cls in _OPS.items()}


def encode(msg: Message) -> bytes:
    """One message as UTF-8 JSON bytes."""
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


def _to_json(value: Any) -> Any:
    if isinstance(value, WireError):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    return value


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = _HINTS[cls] = typing.get_type_hints(cls)
    return h


def _from_json(cls: type[Any], doc: Any, where: str) -> Any:
    if not isinstance(doc, dict):
        raise WriterError(f"malformed writer message: {where} must be an object")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in doc:
            kwargs[f.name] = _value(hints[f.name], doc[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise WriterError(f"malformed writer message: {where} lacks {f.name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise WriterError(f"malformed writer message: {where}: {exc}") from exc


def _value(tp: Any, v: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _value(inner[0], v, where)
        raise WriterError(f"malformed writer message: {where}: unsupported union")  # pragma: no cover
    if tp is Any:
        return v
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        if not isinstance(v, list):
            raise WriterError(f"malformed writer message: {where} must be a list")
        return tuple(_value(elem, x, f"{where}[{i}]") for i, x in enumerate(v))
    if origin is dict:
        kt, vt = typing.get_args(tp)
        if not isinstance(v, dict):
            raise WriterError(f"malformed writer message: {where} must be an object")
        return {_value(kt, k, where): _value(vt, x, f"{where}.{k}") for k, x in v.items()}
    if tp is WireError:
        return WireError.from_json(v)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _from_json(tp, v, where)
    if tp is float:
        if type(v) not in (int, float):
            raise WriterError(f"malformed writer message: {where} must be a number, got {v!r}"[:200])
        return float(v)
    if tp in (int, str, bool):
        if type(v) is not tp:
            raise WriterError(f"malformed writer message: {where} must be {tp.__name__}, got {v!r}"[:200])
        return v
    raise WriterError(f"malformed writer message: {where}: unsupported type {tp!r}")  # pragma: no cover
