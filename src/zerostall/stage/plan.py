"""Where each leaf's bytes go: one safetensors-layout data file per rank, laid out once per layout.

The staging buffer of a file *is* the file's image: 8-byte header length, JSON header, then
the data section. The header depends only on keys, dtypes and shapes, so it is written into
the buffer when a layout is first planned, and persisting is one large write of the buffer.

The plan makes each leaf's one record, its :class:`~zerostall.format.manifest.LeafEntry` (where
its bytes lie, :func:`zerostall.format.file.lay_out`): the same record goes to the writer (a
:class:`~zerostall.messages.LeafRow` is a ``LeafEntry``) and into the manifest, with the checksum
added.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerostall.format.file import DATA_ALIGN, PAGE, FilePlan, LeafSpec, lay_out
from zerostall.format.manifest import LeafEntry
from zerostall.tree import FlatState

__all__ = ["FilePlan", "Plan", "LeafSpec", "make_plan", "lay_out", "DATA_ALIGN", "PAGE"]


@dataclass(frozen=True)
class Plan:
    signature: tuple[object, ...]
    files: tuple[FilePlan, ...]
    #: one per leaf, in leaf order: the record that reaches the writer and the manifest unchanged
    leaves: tuple[LeafEntry, ...]
    nbytes: int  # array bytes (without headers and padding)


def make_plan(flat: FlatState, *, rank: int = 0) -> Plan:
    """Lay out every leaf of ``flat`` in one data file for ``rank``."""
    fplan, entries = lay_out(flat.leaves, rank=rank)
    return Plan(signature=flat.signature, files=(fplan,), leaves=entries,
                nbytes=sum(leaf.nbytes for leaf in flat.leaves))
