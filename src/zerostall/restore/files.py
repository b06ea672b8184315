"""The checkpoint's files as a load sees them: the manifest, and data files checked before use.

A load trusts nothing it reads: the manifest is validated (:func:`read_manifest`), and each data
file is checked once, before anything is allocated for its leaves (:class:`DataFiles`): a plain
file inside the checkpoint, with the size the manifest records.
"""

from __future__ import annotations

import os
import stat

from zerostall.commit import check_reachable
from zerostall.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    ZerostallError,
)
from zerostall.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, LeafEntry, Manifest, parse_manifest
from zerostall.storage import Storage
from zerostall.storage.base import as_local_files

__all__ = ["check_local_file", "read_manifest", "missing_file_error", "DataFiles", "ArrivedFiles"]


def check_local_file(storage: Storage, name: str, rel: str, *, path: str, what: str) -> None:
    """Refuse a file of a local checkpoint that is not a plain file inside it.

    A symlink (to anything), a file whose real path leaves the checkpoint directory (through a
    symlinked directory), a FIFO or a device is corrupt input: reading it could read outside the
    checkpoint or block forever. A missing file is left for the caller to report. The checkpoint
    directory itself may be reached through a symlink.
    """
    files = as_local_files(storage)
    if files is None:
        return  # not a local filesystem: no symlinks or FIFOs to fear
    ckpt = files.file_path(name)
    full = os.path.join(ckpt, rel)
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageError(f"cannot stat {what} {rel}: {exc.strerror}", errno=exc.errno, path=path) from exc
    if stat.S_ISLNK(st.st_mode):
        raise CorruptCheckpointError(f"{what} {rel} is a symbolic link; zerostall reads only plain files "
                                     "inside the checkpoint", path=path)
    real_ckpt = os.path.realpath(ckpt)
    if os.path.commonpath([real_ckpt, os.path.realpath(full)]) != real_ckpt:
        raise CorruptCheckpointError(f"{what} {rel} resolves outside the checkpoint directory (a symlinked "
                                     "directory?)", path=path)
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(f"{what} {rel} is not a regular file", path=path)


def read_manifest(storage: Storage, name: str, *, path: str) -> Manifest:
    """Read and validate ``name``'s manifest; ``path`` names the checkpoint in errors.

    Raises:
        CheckpointNotFoundError: there is no manifest (nothing committed there).
        CorruptCheckpointError: the manifest is malformed, too large, or not a plain file.
        UnsupportedFormatError: the manifest has a format version or entry kind this reader lacks.
        StorageError: the storage failed.
    """
    key = f"{name}/{MANIFEST_NAME}"
    check_local_file(storage, name, MANIFEST_NAME, path=path, what="the manifest")
    try:
        size = storage.size(key)
        if size > MAX_MANIFEST_BYTES:  # checked before reading: the file's own size is trusted, not its claims
            raise CorruptCheckpointError(f"manifest is {size} bytes, more than the {MAX_MANIFEST_BYTES} allowed",
                                         path=path)
        data = storage.get(key)
    except FileNotFoundError:
        # Nothing there, or nowhere to look (a missing bucket): only the second is a storage error.
        check_reachable(storage, write=False, path=path)
        raise CheckpointNotFoundError("no committed checkpoint here (no manifest)", path=path) from None
    except OSError as exc:
        raise StorageError(f"cannot read the manifest: {exc}", errno=exc.errno, path=path) from exc
    return parse_manifest(data, path=path)


def missing_file_error(storage: Storage, name: str, rel: str, path: str, key: str) -> ZerostallError:
    """The error for a data file that is not there: deleted with its checkpoint, or lost from it.

    Retention (or a user) may delete a checkpoint while it is being loaded; deletion removes the
    manifest first (rename away, or manifest-first on object stores), so a missing manifest
    means the checkpoint is gone, not corrupt.
    """
    try:
        gone = not storage.exists(f"{name}/{MANIFEST_NAME}")
    except OSError:
        gone = False
    if gone:
        return CheckpointNotFoundError("the checkpoint was deleted while it was being loaded (retention?)",
                                       path=path, key=key)
    return CorruptCheckpointError(f"data file {rel} is missing", path=path, key=key)


class ArrivedFiles:
    """The data files of a step received whole from another process (a memory-tier replica),
    whose sizes matched its manifest's before a byte arrived: nothing is left to check per leaf."""

    def check(self, leaf: LeafEntry) -> None:
        pass


class DataFiles:
    """Checks each data file once, before anything is allocated for the leaves it holds.

    The manifest's sizes are untrusted: a leaf declaring a terabyte must fail on the data file's
    real size, not after a terabyte buffer was allocated.
    """

    def __init__(self, storage: Storage, name: str, m: Manifest, path: str) -> None:
        self.storage, self.name, self.m, self.path = storage, name, m, path
        self.checked: set[int] = set()

    def check(self, leaf: LeafEntry) -> None:
        fi = leaf.file
        if fi in self.checked:
            return
        entry = self.m.files[fi]
        check_local_file(self.storage, self.name, entry.path, path=self.path, what="data file")
        try:
            size = self.storage.size(f"{self.name}/{entry.path}")
        except FileNotFoundError:
            raise missing_file_error(self.storage, self.name, entry.path, self.path, leaf.key) from None
        except OSError as exc:
            raise StorageError(f"cannot stat data file {entry.path}: {exc}", errno=exc.errno, path=self.path,
                               key=leaf.key) from exc
        if size != entry.size:
            raise CorruptCheckpointError(
                f"data file {entry.path} has {size} bytes, the manifest says {entry.size} (truncated?)",
                path=self.path, key=leaf.key)
        self.checked.add(fi)
