"""The storage protocol: the only way zerostall touches bytes at rest.

Backends see bytes and ``/``-separated keys relative to their root; they know nothing of
tensors, manifests or steps (no torch import here). A backend either renames atomically
(``atomic_rename = True``: POSIX directories) or does not (object stores); :mod:`zerostall.commit`
picks the commit protocol from that flag.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Storage"]


@runtime_checkable
class Storage(Protocol):
    """Byte-level operations a backend provides.

    Every method raises ``FileNotFoundError`` for a missing key and ``OSError`` (errno kept)
    for other I/O failures; zerostall wraps them with the checkpoint path and key.
    """

    url: str
    #: True when :meth:`rename` is atomic and fails if the target exists (POSIX directories).
    atomic_rename: bool

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
