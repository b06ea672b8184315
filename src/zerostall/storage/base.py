"""The storage protocol: the only way zerostall touches bytes at rest.

Backends see bytes and ``/``-separated keys relative to their root; they know nothing of
tensors, manifests or steps (no torch import here). A backend either renames atomically
(``atomic_rename = True``: POSIX directories) or does not (object stores); :mod:`zerostall.commit`
picks the commit protocol from that flag.

Beyond the required :class:`Storage` methods a backend may offer optional groups of methods
(ranged and vectored reads, a mapping of a file, piece writes, multipart-upload listing, ...).
It declares which in one place, its :attr:`Storage.capabilities` (a :class:`Capabilities`),
and implements each declared group as the matching small protocol below. Callers branch on the
declaration and reach the methods through the ``as_*`` functions, never by looking for a method
by name; ``tests/storage/test_conformance.py`` checks each backend's declaration against what it
implements and does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

__all__ = [
    "Storage", "Capabilities", "NO_CAPABILITIES", "VectoredReads", "SequentialReads", "Scan", "MappedRange",
    "MapFile", "FillCache", "PieceWrites", "MultipartUploads", "Probe", "LocalFiles",
    "as_vectored", "as_sequential", "as_scan", "as_map_file", "as_fill_cache", "as_piece_writer",
    "as_multipart", "as_probe", "as_local_files",
]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """Which optional method groups a backend implements (each flag names its protocol).

    A backend that declares a flag implements the protocol in full and with its contract; one
    that does not is never asked for it (callers fall back to the required methods).
    """

    #: :class:`VectoredReads`: one call fills a run of buffers from a contiguous range
    vectored_reads: bool = False
    #: :class:`SequentialReads`: one large range through one open file, a callback per piece
    sequential_reads: bool = False
    #: :class:`Scan`: hand a range's bytes to a callback without keeping them
    scan: bool = False
    #: :class:`MapFile`: a read-only view of a whole object where its bytes lie
    map_file: bool = False
    #: :class:`FillCache`: bring a range into the page cache (read errors reported), copying nothing
    fill_cache: bool = False
    #: :class:`PieceWrites`: a new object written from scattered ``(bytes, offset)`` pieces
    write_pieces: bool = False
    #: :class:`MultipartUploads`: incomplete multipart uploads can be listed and aborted
    multipart_uploads: bool = False
    #: :class:`Probe`: a cheap reachability check (without it the root is listed instead)
    probe: bool = False
    #: :class:`LocalFiles`: every key is a file of this machine's filesystem
    local_files: bool = False

    def __post_init__(self) -> None:
        # A load verifies mapped bytes in place and reads evicted pages again with scan.
        if self.map_file and not self.scan:
            raise ValueError("Capabilities(map_file=True) needs scan=True: a load scans what is no longer mapped in")


#: What a backend without any optional method group declares.
NO_CAPABILITIES = Capabilities()


@runtime_checkable
class Storage(Protocol):
    """Byte-level operations a backend provides.

    Every method raises ``FileNotFoundError`` for a missing key and ``OSError`` (errno kept)
    for other I/O failures; zerostall wraps them with the checkpoint path and key.
    """

    url: str
    #: True when :meth:`rename` is atomic and fails if the target exists (POSIX directories).
    atomic_rename: bool
    #: The optional method groups this backend implements (a class attribute, the same for every
    #: instance of a class).
    capabilities: Capabilities

    def write_from_buffer(
        self, key: str, buf: memoryview, length: int, *, threads: int, chunk_bytes: int, direct: bool
    ) -> None:
        """Write ``buf[:length]`` as object ``key`` and make it durable before returning.

        ``buf`` may be longer than ``length`` (padding for aligned direct I/O); the object is
        exactly ``length`` bytes. Fails with ``FileExistsError`` if ``key`` exists.
        """

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write a small object durably; with ``if_absent`` fail with ``FileExistsError`` if present."""

    def get(self, key: str) -> bytes:
        """Read a whole (small) object."""

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes of ``key`` at ``offset``; ``EOFError`` if the object is shorter."""

    def size(self, key: str) -> int:
        """The size in bytes of object ``key``."""

    def exists(self, key: str) -> bool:
        """Whether object or prefix ``key`` exists."""

    def list(self, prefix: str) -> list[str]:
        """Names of the immediate children of ``prefix`` ("" for the root), sorted."""

    def delete(self, prefix: str) -> None:
        """Delete ``prefix`` and everything under it; deleting nothing is not an error."""

    def rename(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists.

        Only called when ``atomic_rename`` is true.
        """

    def sync(self, prefix: str) -> None:
        """Make the names under ``prefix`` durable (fsync of a directory); a no-op where meaningless."""


# -- the optional groups --------------------------------------------------------------------


@runtime_checkable
class VectoredReads(Protocol):
    def read_vectored(self, key: str, offset: int, bufs: list[memoryview], *, cached: bool = False) -> None:
        """Fill ``bufs`` one after the other from the contiguous range of ``key`` at ``offset``;
        ``EOFError`` if the object is shorter. ``cached``: the caller just read the range through
        the page cache (no read-ahead advice needed)."""


@runtime_checkable
class SequentialReads(Protocol):
    def read_sequential(self, key: str, offset: int, buf: memoryview, *, chunk: int,
                        on_piece: Callable[[memoryview], None] | None = None, cached: bool = False) -> None:
        """Fill ``buf`` from ``key`` at ``offset``; ``on_piece`` sees each piece of ``buf``, in
        order, right after it lands. ``EOFError`` if the object is shorter."""


@runtime_checkable
class Scan(Protocol):
    def scan(self, key: str, offset: int, length: int, on_piece: Callable[[memoryview], None], *,
             chunk: int = 1 << 20) -> None:
        """Hand ``on_piece`` the bytes of ``key`` at ``offset``, in order, in pieces of at most
        ``chunk`` bytes that are valid only during the call; ``EOFError`` if the object is shorter."""


@runtime_checkable
class MappedRange(Protocol):
    """A read-only view of a whole object, as :meth:`MapFile.map_file` returns it."""

    view: memoryview

    def cached(self, offset: int, length: int) -> bool:
        """Whether the range can be touched now without a read from disk (no ``SIGBUS`` on error)."""

    def copy_into(self, offset: int, dest: memoryview, crc: int | None = None) -> int | None:
        """Copy the bytes at ``offset`` into ``dest``; with ``crc``, their CRC32C too where the
        copy can compute it (else None)."""

    def close(self) -> None:
        """Let go of the view."""


@runtime_checkable
class MapFile(Protocol):
    def map_file(self, key: str) -> MappedRange | None:
        """A view of the whole of ``key`` where its bytes lie; None when it is empty or cannot be mapped."""


@runtime_checkable
class FillCache(Protocol):
    def fill_cache(self, key: str, offset: int, length: int, *, piece: int = 0,
                   on_filled: Callable[[int], None] | None = None) -> None:
        """Bring the range into the page cache, raising read errors, copying nothing (may do
        nothing where it cannot; callers check what is cached). With ``on_filled``, read in
        ``piece``-byte steps, each reported with the offset filled up to."""


@runtime_checkable
class PieceWrites(Protocol):
    def write_pieces(self, key: str, header: bytes, size: int, pieces: Iterable[tuple[memoryview, int]]) -> None:
        """Write a new ``size``-byte object: ``header`` at 0, then each ``(bytes, offset)`` in order,
        each written before the next is taken from ``pieces`` (a piecewise save's pieces arrive
        as they are staged); gaps are zeros; durable on return; ``FileExistsError`` if ``key`` exists."""


@runtime_checkable
class MultipartUploads(Protocol):
    def list_uploads(self, prefix: str) -> Sequence[tuple[str, str]]:
        """Incomplete multipart uploads under ``prefix``: ``(key relative to the root, upload id)``."""

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one incomplete upload; one already completed or aborted is not an error."""


@runtime_checkable
class Probe(Protocol):
    def probe(self, *, write: bool) -> None:
        """Check that the root can be reached now, and with ``write`` that it can be created and written.

        Called when a :class:`~zerostall.Checkpointer` opens (``write`` unless read-only) and
        when a load finds nothing, so that a wrong location fails at once instead of looking
        like an empty run. Cheap: a few system calls or one or two requests. A root that does
        not exist yet is not an error without ``write`` (nothing is committed there); a missing
        bucket or volume, refused credentials, an unreachable endpoint or an unwritable
        directory are. Raises ``OSError`` with its errno (``FileNotFoundError`` for a missing
        bucket, ``PermissionError`` for refused credentials, ``ENOTDIR``, ``EROFS``, ...).
        """


@runtime_checkable
class LocalFiles(Protocol):
    def file_path(self, key: str) -> str:
        """The absolute path of ``key`` on this machine's filesystem (which may be a symlink,
        a FIFO, anything: callers that read it check)."""


# -- reaching a declared group ---------------------------------------------------------------
# Each returns the backend typed as the group when its capabilities declare it, else None.
# The cast is the declaration: the conformance suite checks that it holds.


def as_vectored(storage: Storage) -> VectoredReads | None:
    return cast(VectoredReads, storage) if storage.capabilities.vectored_reads else None


def as_sequential(storage: Storage) -> SequentialReads | None:
    return cast(SequentialReads, storage) if storage.capabilities.sequential_reads else None


def as_scan(storage: Storage) -> Scan | None:
    return cast(Scan, storage) if storage.capabilities.scan else None


def as_map_file(storage: Storage) -> MapFile | None:
    return cast(MapFile, storage) if storage.capabilities.map_file else None


def as_fill_cache(storage: Storage) -> FillCache | None:
    return cast(FillCache, storage) if storage.capabilities.fill_cache else None


def as_piece_writer(storage: Storage) -> PieceWrites | None:
    return cast(PieceWrites, storage) if storage.capabilities.write_pieces else None


def as_multipart(storage: Storage) -> MultipartUploads | None:
    return cast(MultipartUploads, storage) if storage.capabilities.multipart_uploads else None


def as_probe(storage: Storage) -> Probe | None:
    return cast(Probe, storage) if storage.capabilities.probe else None


def as_local_files(storage: Storage) -> LocalFiles | None:
    return cast(LocalFiles, storage) if storage.capabilities.local_files else None
