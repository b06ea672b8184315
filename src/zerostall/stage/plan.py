"""Where each leaf's bytes go: one safetensors-layout data file per rank, laid out once per layout.

The staging buffer of a file *is* the file's image: 8-byte header length, JSON header, then
the data section. The header depends only on keys, dtypes and shapes, so it is written into
the buffer when a layout is first planned, and persisting is one large write of the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from zerostall.format.header import DATA_ALIGN, encode_header
from zerostall.format.layout import PAD_PREFIX, data_file
from zerostall.tree import FlatState

__all__ = ["LeafSlot", "FilePlan", "Plan", "LeafSpec", "make_plan", "plan_file", "DATA_ALIGN", "PAGE"]

#: buffers are sized in whole pages so that direct I/O can write the padded tail
PAGE = 4096


@dataclass(frozen=True)
class LeafSlot:
    key: str
    offset: int  # absolute byte offset in the file (and in the buffer)
    nbytes: int


@dataclass(frozen=True)
class FilePlan:
    name: str  # file name inside the checkpoint's data directory
    header: bytes  # the first `data_start` bytes of the file: length prefix + JSON header
    data_start: int
    size: int  # file size in bytes
    alloc: int  # buffer size: `size` rounded up to whole pages


@dataclass(frozen=True)
class Plan:
    signature: tuple[object, ...]
    files: tuple[FilePlan, ...]
    slots: tuple[LeafSlot, ...]  # one per leaf, in leaf order
    leaf_file: tuple[int, ...]  # file index of each leaf
    nbytes: int  # array bytes (without headers and padding)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class LeafSpec(Protocol):
    """What laying a leaf out needs: its key, dtype and size (shape goes into the header)."""

    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...


def plan_file(leaves: Sequence[LeafSpec], *, rank: int = 0) -> tuple[FilePlan, list[int]]:
    """Lay ``leaves`` out, in order, in one safetensors file for ``rank``.

    Returns the file's plan and each leaf's absolute byte offset in it. Leaves start at
    multiples of :data:`DATA_ALIGN`; the gaps are named padding tensors, as safetensors forbids
    holes, and the header is padded with spaces so that the data section starts aligned.
    """
    name = data_file(rank)
    header: dict[str, object] = {"__metadata__": {"format": "zerostall", "rank": str(rank)}}
    rel_offsets: list[int] = []
    pos = 0
    pads = 0
    for leaf in leaves:
        aligned = _round_up(pos, DATA_ALIGN)
        if aligned != pos:
            header[f"{PAD_PREFIX}{pads}"] = {"dtype": "U8", "shape": [aligned - pos], "data_offsets": [pos, aligned]}
            pads += 1
            pos = aligned
        header[leaf.key] = {"dtype": leaf.dtype, "shape": list(leaf.shape), "data_offsets": [pos, pos + leaf.nbytes]}
        rel_offsets.append(pos)
        pos += leaf.nbytes
    head = encode_header(header, align=DATA_ALIGN)
    data_start = len(head)
    size = data_start + pos
    fplan = FilePlan(name=name, header=head, data_start=data_start, size=size, alloc=_round_up(max(size, 1), PAGE))
    return fplan, [data_start + off for off in rel_offsets]


def make_plan(flat: FlatState, *, rank: int = 0) -> Plan:
    """Lay out every leaf of ``flat`` in one data file for ``rank``."""
    fplan, offsets = plan_file(flat.leaves, rank=rank)
    slots = tuple(LeafSlot(leaf.key, off, leaf.nbytes) for leaf, off in zip(flat.leaves, offsets, strict=True))
    return Plan(
        signature=flat.signature,
        files=(fplan,),
        slots=slots,
        leaf_file=tuple(0 for _ in flat.leaves),
        nbytes=sum(leaf.nbytes for leaf in flat.leaves),
    )
