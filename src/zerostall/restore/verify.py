"""Verify a checkpoint completely: every file, every leaf's checksum, every problem reported.

Unlike a load, which stops at the first bad leaf, :func:`verify_checkpoint` keeps going and
returns every problem it finds. It reads through one reused chunk buffer (memory stays at
``chunk_bytes`` whatever the checkpoint's size), needs no torch, and also compares each data
file's own safetensors header with the manifest, which catches what a checksum cannot (a leaf
relabelled with another dtype of the same size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from zerostall.checksum import checksum
from zerostall.errors import ZerostallError
from zerostall.format.header import HeaderError, decode_header, header_length
from zerostall.format.manifest import LeafEntry, Manifest
from zerostall.restore.files import check_local_file, read_manifest
from zerostall.storage import Storage, open_storage, split_url

__all__ = ["Problem", "VerifyReport", "verify_checkpoint"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong. ``key`` is the leaf's (None for a whole file); ``file`` the data file's."""

    kind: str  # "checksum", "missing-checksum", "file", "header", "read"
    message: str
    key: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        where = f"{self.key}: " if self.key else (f"{self.file}: " if self.file else "")
        return f"{where}{self.message}"


@dataclass(frozen=True)
class VerifyReport:
    path: str
    leaves: int
    nbytes: int  # leaf bytes read and checked
    problems: tuple[Problem, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_keys(self) -> list[str]:
        """Every leaf key with a problem, in manifest order, once each."""
        seen: dict[str, None] = {}
        for p in self.problems:
            if p.key is not None:
                seen.setdefault(p.key, None)
        return list(seen)


def verify_checkpoint(path: str, *, chunk_bytes: int = 8 << 20,
                      progress: Callable[[str, int, int], None] | None = None) -> VerifyReport:
    """Check every file and leaf of the checkpoint at ``path``; raise only if the manifest is unusable.

    A missing or malformed manifest raises the same error a load would
    (:class:`~zerostall.errors.CheckpointNotFoundError`, :class:`~zerostall.errors.CorruptCheckpointError`,
    ...). Everything else is collected into the report. ``progress``, if given, is called as
    ``progress("verify", bytes_checked, bytes_total)`` as the leaves' bytes are read (a
    :class:`zerostall.progress.Progress` draws it).
    """
    root, name = split_url(path)
    storage = open_storage(root)
    ckpt = f"{root.rstrip('/')}/{name}"
    m = read_manifest(storage, name, path=ckpt)
    problems: list[Problem] = []
    sizes: dict[int, int] = {}
    for fi, entry in enumerate(m.files):
        try:
            check_local_file(storage, name, entry.path, path=ckpt, what="data file")
            size = storage.size(f"{name}/{entry.path}")
        except FileNotFoundError:
            problems.append(Problem("file", "data file is missing", file=entry.path))
            continue
        except ZerostallError as exc:
            problems.append(Problem("file", exc.message, file=entry.path))
            continue
        except OSError as exc:
            problems.append(Problem("file", f"cannot stat: {exc}", file=entry.path))
            continue
        if size != entry.size:
            problems.append(Problem("file", f"has {size} bytes, the manifest says {entry.size} (truncated?)",
                                    file=entry.path))
        sizes[fi] = size
        problems += _check_header(storage, name, m, fi, size)

    buf = bytearray(max(4096, min(chunk_bytes, max((lf.nbytes for lf in m.leaves), default=0))))
    view = memoryview(buf)
    checked = 0
    total = sum(lf.nbytes for lf in m.leaves)
    tick = None if progress is None else (lambda n: progress("verify", checked + n, total))
    for leaf in sorted(m.leaves, key=lambda lf: (lf.file, lf.offset)):
        fpath = m.files[leaf.file].path
        if leaf.file not in sizes:
            problems.append(Problem("read", f"not checked: data file {fpath} is unusable", key=leaf.key, file=fpath))
            continue
        if leaf.offset + leaf.nbytes > sizes[leaf.file]:
            problems.append(Problem("read", f"data file {fpath} ends before this leaf's bytes "
                                    f"[{leaf.offset}, {leaf.offset + leaf.nbytes})", key=leaf.key, file=fpath))
            continue
        if leaf.crc32c is None:
            problems.append(Problem("missing-checksum", "leaf has no checksum", key=leaf.key, file=fpath))
            continue
        try:
            crc = _crc_of(storage, f"{name}/{fpath}", leaf, view, tick)
        except (OSError, EOFError) as exc:
            problems.append(Problem("read", f"read failed: {exc}", key=leaf.key, file=fpath))
            continue
        checked += leaf.nbytes
        if crc != leaf.crc32c:
            problems.append(Problem("checksum", f"checksum mismatch: crc32c {crc:#010x}, manifest says "
                                    f"{leaf.crc32c:#010x}", key=leaf.key, file=fpath))
    return VerifyReport(path=ckpt, leaves=len(m.leaves), nbytes=checked, problems=tuple(problems))


def _crc_of(storage: Storage, key: str, leaf: LeafEntry, view: memoryview,
            tick: Callable[[int], None] | None = None) -> int:
    crc = 0
    for off in range(0, leaf.nbytes, len(view)):
        n = min(len(view), leaf.nbytes - off)
        storage.read_into(key, leaf.offset + off, view[:n])
        crc = checksum(view[:n], crc)
        if tick is not None:
            tick(off + n)
    return crc


def _check_header(storage: Storage, name: str, m: Manifest, fi: int, size: int) -> list[Problem]:
    """Compare the data file's safetensors header with the manifest's leaves in that file."""
    fpath = m.files[fi].path

    def bad(msg: str, key: str | None = None) -> Problem:
        return Problem("header", msg, key=key, file=fpath)

    try:
        head = bytearray(8)
        if size >= 8:
            storage.read_into(f"{name}/{fpath}", 0, memoryview(head))
        hlen = header_length(head, size)
        raw = bytearray(hlen)
        storage.read_into(f"{name}/{fpath}", 8, memoryview(raw))
        header = decode_header(bytes(raw))
    except (OSError, EOFError) as exc:
        return [bad(f"cannot read the safetensors header: {exc}")]
    except HeaderError as exc:
        return [bad(f"not a readable safetensors header: {str(exc)[:200]}")]
    start = 8 + hlen
    out = []
    for leaf in m.leaves:
        if leaf.file != fi:
            continue
        h = header.get(leaf.key)
        entry = leaf.header_entry(start)  # what the header says of a leaf the manifest describes so
        want = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [entry.lo, entry.hi]}
        if not isinstance(h, dict):
            out.append(bad("the data file's header has no entry for this leaf", leaf.key))
            continue
        diff = [f"{k} {h.get(k)!r} != manifest {v!r}" for k, v in want.items() if h.get(k) != v]
        if diff:
            out.append(bad("the data file's header disagrees with the manifest: " + "; ".join(diff)[:300],
                           leaf.key))
    return out

