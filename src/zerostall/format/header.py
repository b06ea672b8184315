"""The safetensors header codec: an 8-byte little-endian length *N*, *N* bytes of JSON, then the
data section. zerostall's data files, exported files and imported files all go through it.

:class:`TensorEntry` is the format's own record of one tensor. :func:`header_of` writes a header
from such records (zerostall's data files derive theirs from their leaf entries,
:meth:`zerostall.format.manifest.LeafEntry.header_entry`), :func:`encode_header` from its JSON
object; :func:`header_length`, :func:`decode_header` and :func:`tensor_entries` read one, checking
everything the format's reference reader checks and raising :class:`HeaderError` that says what is
wrong (callers name the file).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from zerostall.dtypes import ITEMSIZE

__all__ = [
    "DATA_ALIGN", "MAX_HEADER", "HeaderError", "TensorEntry", "header_of", "encode_header", "header_length",
    "decode_header", "tensor_entries",
]

#: zerostall's data files and exports start every tensor (and the data section) at a multiple of this
DATA_ALIGN = 64
#: the longest JSON header the safetensors reference reader accepts
MAX_HEADER = 100_000_000
_PREFIX = 8


class HeaderError(ValueError):
    """The bytes are not a readable safetensors header; the message says what is wrong."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header: its bytes are ``[lo, hi)`` of the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    lo: int
    hi: int


def header_of(tensors: Iterable[TensorEntry], metadata: dict[str, str], *, align: int = DATA_ALIGN) -> bytes:
    """The header of a file holding ``tensors`` (in the order given) and ``metadata``, as
    :func:`encode_header` frames it."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.lo, t.hi]}
    return encode_header(header, align=align)


def encode_header(header: dict[str, Any], *, align: int = DATA_ALIGN) -> bytes:
    """The length prefix and the compact JSON of ``header``, padded with spaces so that the data
    section after it starts at a multiple of ``align`` bytes."""
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(_PREFIX + len(body)) % align)
    return len(body).to_bytes(_PREFIX, "little") + body


def header_length(prefix: bytes | bytearray, size: int) -> int:
    """The JSON header's length from the first 8 bytes of a file of ``size`` bytes.

    Raises:
        HeaderError: the file is too short, or the length does not fit in it (or exceeds
            :data:`MAX_HEADER`).
    """
    if size < _PREFIX or len(prefix) < _PREFIX:
        raise HeaderError(f"{size} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(prefix[:_PREFIX], "little")
    if not 2 <= n <= min(MAX_HEADER, size - _PREFIX):
        raise HeaderError(f"a header of {n} bytes in a file of {size}")
    return n


def decode_header(raw: bytes) -> dict[str, Any]:
    """The JSON object of a header's ``raw`` bytes.

    Raises:
        HeaderError: not UTF-8 JSON, or not an object.
    """
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise HeaderError(f"the header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise HeaderError("the header is not a JSON object")
    return header


def tensor_entries(header: dict[str, Any], data_size: int) -> tuple[dict[str, str], list[TensorEntry]]:
    """The ``__metadata__`` and the tensors of a decoded header, every field checked against a
    data section of ``data_size`` bytes: known dtypes, sizes that match the shapes, and tensors
    that tile the data section (no overlap, no hole), as the format's reference reader requires.

    Raises:
        HeaderError: names the entry that is wrong.
    """
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise HeaderError("__metadata__ is not a map of strings to strings")
    out = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise HeaderError(f"the entry of {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise HeaderError(f"{name!r} has the dtype {dtype!r}, which zerostall does not read")
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)):
            raise HeaderError(f"{name!r} has no valid shape and data_offsets")
        lo, hi = offsets
        if not 0 <= lo <= hi <= data_size or hi - lo != math.prod(shape) * ITEMSIZE[dtype]:
            raise HeaderError(f"{name!r}: its bytes {lo}..{hi} do not hold {shape} of {dtype} inside the file")
        out.append(TensorEntry(name, dtype, tuple(shape), lo, hi))
    end = 0
    for t in sorted(out, key=lambda t: (t.lo, t.hi, t.name)):
        if t.lo != end:
            raise HeaderError(f"{t.name!r} starts at byte {t.lo} of the data, not at {end} where the tensor before "
                              "it ends (tensors overlap or leave a hole)")
        end = t.hi
    if end != data_size:
        raise HeaderError(f"the tensors cover {end} bytes of a data area of {data_size}")
    return meta, out
