"""A data file's layout: where each leaf's bytes lie in one safetensors-layout file.

One home for both sides of the trainer/writer boundary: the trainer's staging plan lays a rank's
leaves out once per layout (:mod:`zerostall.stage.plan`), and a collective save's writer lays
out again the leaves it owns in its compact file (:mod:`zerostall.persist.job`). The file is
8-byte header length, JSON header, then the data section; each leaf's one record, its
:class:`~zerostall.format.manifest.LeafEntry`, is made here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from zerostall.format.header import DATA_ALIGN, encode_header
from zerostall.format.layout import PAD_PREFIX, data_file
from zerostall.format.manifest import LeafEntry, leaf_entry

__all__ = ["FilePlan", "LeafSpec", "lay_out", "DATA_ALIGN", "PAGE"]


#: buffers are sized in whole pages so that direct I/O can write the padded tail
PAGE = 4096


@dataclass(frozen=True)
class FilePlan:
    name: str  # file name inside the checkpoint's data directory
    header: bytes  # the first `data_start` bytes of the file: length prefix + JSON header
    data_start: int
    size: int  # file size in bytes
    alloc: int  # buffer size: `size` rounded up to whole pages


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class LeafSpec(Protocol):
    """What laying a leaf out needs (a :class:`~zerostall.tree.ArrayLeaf`, or a leaf entry laid
    out again by a collective save's writer)."""

    @property
    def key(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def shared(self) -> bool: ...


def lay_out(leaves: Sequence[LeafSpec], *, rank: int = 0, file: int = 0) -> tuple[FilePlan, tuple[LeafEntry, ...]]:
    """Lay ``leaves`` out, in order, in one safetensors file for ``rank`` (file ``file`` of the save).

    Returns the file's plan and each leaf's entry. Leaves start at multiples of
    :data:`DATA_ALIGN`; the gaps are named padding tensors, as safetensors forbids holes, and the
    header is padded with spaces so that the data section starts aligned.

    One pass places each leaf; its header entry and its leaf entry are both made from that place
    (the header's holds the offset into the data section, the leaf entry's the absolute one, known
    once the header is framed): each leaf's header entry is its entry's
    :meth:`~zerostall.format.manifest.LeafEntry.header_entry`, which ``zerostall verify`` checks.
    The header's JSON is built here directly: going through a ``TensorEntry`` per leaf made
    planning a layout of 20,000 leaves ~20% slower (101 against 124-181 ms, measured).
    """
    header: dict[str, object] = {"__metadata__": {"format": "zerostall", "rank": str(rank)}}
    starts: list[int] = []
    pos = 0
    pads = 0
    for leaf in leaves:
        aligned = _round_up(pos, DATA_ALIGN)
        if aligned != pos:
            header[f"{PAD_PREFIX}{pads}"] = {"dtype": "U8", "shape": [aligned - pos], "data_offsets": [pos, aligned]}
            pads += 1
            pos = aligned
        header[leaf.key] = {"dtype": leaf.dtype, "shape": list(leaf.shape), "data_offsets": [pos, pos + leaf.nbytes]}
        starts.append(pos)
        pos += leaf.nbytes
    head = encode_header(header, align=DATA_ALIGN)
    data_start = len(head)
    size = data_start + pos
    fplan = FilePlan(name=data_file(rank), header=head, data_start=data_start, size=size,
                     alloc=_round_up(max(size, 1), PAGE))
    entries = tuple(leaf_entry(leaf.key, leaf.kind, leaf.dtype, leaf.shape, file, data_start + lo, leaf.nbytes,
                               None, leaf.shared) for leaf, lo in zip(leaves, starts, strict=True))
    return fplan, entries
