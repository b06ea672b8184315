"""The keeper's check of a held step: every leaf's CRC32C against its manifest, on every core.

A trainer that must verify the image checksums every byte as it copies it (the default load), or
reads every byte twice when the load is all or nothing (``LoadOptions(atomic=True)``: a checksum
pass, then the copy). After a crash the checksums can be taken by the keeper instead, between
the trainer's death and the restarted trainer's query (see
:meth:`zerostall.memtier.keeper.Keeper.session_ended`). This is that pass: the same byte-range
split as the loader's (:func:`zerostall.checksum.split_even`, one large leaf cut between threads,
the parts joined with :func:`~zerostall.checksum.checksum_combine`), over the keeper's own
mappings of the buffers, read only.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from zerostall.checksum import Span, checksum, join_crcs, split_even
from zerostall.cpus import usable_cpus as cpus  # a checksum pass: one thread per CPU it may use
from zerostall.format.manifest import LeafEntry, parse_manifest

__all__ = ["cpus", "first_bad_leaf"]


def first_bad_leaf(manifest: bytes, views: Mapping[str, memoryview], threads: int, *, path: str) -> str | None:
    """The key of the first leaf (in file order) whose bytes do not match the manifest's CRC32C,
    or None when every leaf matches.

    ``views`` maps each data file's name (the last part of the manifest's file path) to its
    bytes. A leaf without a checksum counts as bad: a load that verifies refuses it too.

    Example::

        >>> from zerostall.format.manifest import encode_manifest
        >>> m = encode_manifest(items={"x": {"type": "array", "leaf": 0}}, files=[{"path": "data/a", "size": 3}],
        ...                     leaves=[{"key": "x", "kind": "bytes", "dtype": "U8", "shape": [3], "file": 0,
        ...                              "offset": 0, "nbytes": 3, "crc32c": checksum(b"abc")}])
        >>> first_bad_leaf(m, {"a": memoryview(b"abc")}, 2, path="step")
        >>> first_bad_leaf(m, {"a": memoryview(b"abd")}, 2, path="step")
        'x'
    """
    m = parse_manifest(manifest, path=path)
    bufs = [views[f.path.rsplit("/", 1)[-1]] for f in m.files]
    leaves: list[LeafEntry] = sorted(m.leaves, key=lambda lf: (lf.file, lf.offset))

    def run(piece: list[Span]) -> list[tuple[Span, int]]:
        out = []
        for i, lo, hi in piece:
            lf = leaves[i]
            out.append(((i, lo, hi), checksum(bufs[lf.file][lf.offset + lo:lf.offset + hi])))
        return out

    pieces = split_even([lf.nbytes for lf in leaves], threads)
    if threads > 1 and len(pieces) > 1:  # crc32c releases the GIL: one thread per core
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zerostall-keeper-check") as pool:
            done = list(pool.map(run, pieces))
    else:
        done = [run(p) for p in pieces]
    crcs = join_crcs([p for got in done for p in got], len(leaves))
    for lf, crc in zip(leaves, crcs, strict=True):
        if lf.crc32c is None or (crc or 0) != lf.crc32c:
            return lf.key
    return None
