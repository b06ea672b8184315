"""Configuration: keyword-only frozen dataclasses, one per concern."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["WriterKind", "SaveOptions", "LoadOptions"]

MiB = 1 << 20


class WriterKind(enum.Enum):
    """Where the persist phase runs.

    ``PROCESS`` (default): a writer process spawned once and reused; it reads the staged shared
    buffers directly, so the training process's GIL and cores are left alone, and it finishes a
    save even if the trainer is killed. ``THREAD``: a background thread of the trainer process
    (for environments that forbid subprocesses, and for the ``memory://`` backend).
    """

    PROCESS = "process"
    THREAD = "thread"


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How saves are staged and persisted.

    Attributes:
        writer: process (default) or thread; see :class:`WriterKind`.
        max_in_flight: how many saves may hold staging buffers at once. Each in-flight save owns
            one full-size host buffer; a save that finds none free waits (on the training thread)
            until the oldest in-flight save has finished writing its bytes.
        direct_io: write data files with ``O_DIRECT`` where the filesystem allows it, which skips
            the page-cache copy (less CPU stolen from training); falls back to buffered writes.
        io_threads: parallel write streams per save.
        chunk_bytes: size of one write call.
        writer_nice: niceness added to the writer process, so training keeps CPU priority.
    """

    writer: WriterKind = WriterKind.PROCESS
    max_in_flight: int = 1
    direct_io: bool = True
    io_threads: int = 2
    chunk_bytes: int = 32 * MiB
    writer_nice: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.writer, WriterKind):
            raise ValueError(f"writer must be a WriterKind, got {self.writer!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.chunk_bytes < MiB or self.chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a multiple of 4096 and >= 1 MiB, got {self.chunk_bytes}")


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How checkpoints are read.

    Attributes:
        verify: check every leaf's checksum after reading it (default on).
        io_threads: parallel read streams.
        chunk_bytes: size of one read call.
    """

    verify: bool = True
    io_threads: int = 4
    chunk_bytes: int = 32 * MiB

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {self.chunk_bytes}")
