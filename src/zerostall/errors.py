"""The zerostall error tree.

This module is the public home of every error class (``from zerostall.errors import
StorageError``); ``__all__`` lists each one defined here. The base, :class:`ZerostallError`, and the two
a training loop catches, :class:`CorruptCheckpointError` and :class:`BackgroundSaveError`, are
also at the top level (``zerostall.BackgroundSaveError``). Two classes of the tree are defined
with the protocol they belong to, ``ProtocolMismatchError`` (:mod:`zerostall.messages`) and
``RankTaken`` (:mod:`zerostall.persist.collective`); both are ``WriterError`` subclasses, which
is how a caller catches them.

Every error raised by zerostall derives from :class:`ZerostallError` and also from the builtin
exception a caller would naturally catch, so ``except FileNotFoundError`` keeps working::

    ZerostallError(Exception)                 .path  .key  .rank
    ├── CheckpointNotFoundError(FileNotFoundError)   no committed checkpoint at a path / step
    │   └── DirectoryReplacedError                   the directory was deleted after a memory-only step was saved into it
    ├── CheckpointExistsError(FileExistsError)       refusing to overwrite a committed checkpoint
    ├── CorruptCheckpointError(ValueError)           bytes or manifest do not match what was committed
    │   ├── ChecksumMismatchError                    a leaf's checksum differs
    │   └── NoValidCheckpointError                   a fallback load found no committed step that verifies
    ├── UnsupportedFormatError(ValueError)           unknown format version or entry kind
    ├── MismatchError(ValueError)                    template and checkpoint disagree (shape, dtype, kind)
    ├── MissingKeyError(KeyError)                    a requested key is not in the checkpoint
    ├── UnsupportedLeafError(TypeError)              a leaf type zerostall cannot save
    ├── InvalidArgumentError(ValueError)             an argument out of range (.argument names it)
    │   ├── ArgumentTypeError(+TypeError)            an argument of the wrong type
    │   ├── HostMemoryLimitError                     host_memory_limit cannot hold what the configuration needs (zerostall.budget)
    │   └── MetadataError                            metadata= cannot be stored (NaN, reserved key)
    │       └── MetadataTypeError(+TypeError)        metadata= holds a non-JSON type
    ├── AdviceError(ValueError)                      the interval advisor's inputs are out of range, or too few were measured
    ├── MissingDependencyError(ImportError)          an optional dependency is not installed (.name; the message names the extra)
    ├── StorageError(OSError)                        an I/O failure, errno preserved
    │   └── ReadOnlyError                            a save asked of a read_only Checkpointer (EROFS)
    ├── WriterError(RuntimeError)                    the background writer died or was closed
    │   ├── BackgroundSaveError                      a save that failed in the background, raised later (.step .cause)
    │   ├── ProtocolMismatchError                    trainer and writer speak different protocol versions (zerostall.messages)
    │   ├── UnknownLayoutError                       a save named a leaf layout its writer does not hold (zerostall.messages)
    │   ├── RankTaken                                a keeper standing in for a lost rank found that rank's part taken: it withdraws (persist.collective)
    │   └── KeeperPersistError                       the memory tier's keeper could not persist a memory-only step (.step .cause)
    │       └── KeeperLostError                      the keeper ended while only it held the newest step
    ├── TornSnapshotError(RuntimeError)              an overlapped tensor changed before its copy was done
    │   └── DonatedArrayError                        a jax.Array donated before its background copy
    ├── ReplicaError(RuntimeError)                   a replica in another host's memory could not be formed, sent or received intact
    ├── PeerUnreachableError(TimeoutError)           a rank, a keeper or the job's store did not answer within timeout_s (.step .ranks)
    └── PreemptionError(RuntimeError)                the ranks could not agree on the final step after a preemption notice

    ZerostallWarning(UserWarning)                    a guarantee is weaker than documented; what was asked for still works

Background failures are re-raised on the caller's thread by ``Response.result()`` with the same
class and errno they had in the writer: the classes that cross a process boundary by name are
those :func:`wire_class` knows (the codec is :class:`zerostall.messages.WireError`).
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    # in the order of the tree above
    "ZerostallError",
    "CheckpointNotFoundError", "DirectoryReplacedError",
    "CheckpointExistsError",
    "CorruptCheckpointError", "ChecksumMismatchError", "NoValidCheckpointError",
    "UnsupportedFormatError",
    "MismatchError",
    "MissingKeyError",
    "UnsupportedLeafError",
    "InvalidArgumentError", "ArgumentTypeError", "HostMemoryLimitError", "MetadataError", "MetadataTypeError",
    "AdviceError",
    "MissingDependencyError",
    "StorageError", "ReadOnlyError",
    "WriterError", "BackgroundSaveError", "UnknownLayoutError", "KeeperPersistError", "KeeperLostError",
    "TornSnapshotError", "DonatedArrayError",
    "ReplicaError",
    "PeerUnreachableError",
    "PreemptionError",
    "ZerostallWarning",
]


class ZerostallError(Exception):
    """Base of every zerostall error. ``path``, ``key`` and ``rank`` say where it happened."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        key: str | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = None if path is None else str(path)
        self.key = key
        self.rank = rank

    def __str__(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"checkpoint {self.path!r}")
        if self.key is not None:
            where.append(f"key {self.key!r}")
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        return f"{self.message} ({', '.join(where)})" if where else self.message

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.message, self.path, self.key, self.rank))


def _rebuild(cls: type[ZerostallError], message: str, path: str | None, key: str | None, rank: int | None) -> ZerostallError:
    return cls(message, path=path, key=key, rank=rank)


class CheckpointNotFoundError(ZerostallError, FileNotFoundError):
    """No committed checkpoint exists where one was asked for."""


class CheckpointExistsError(ZerostallError, FileExistsError):
    """The target already holds a committed checkpoint; zerostall never overwrites one."""


class CorruptCheckpointError(ZerostallError, ValueError):
    """The checkpoint's files do not match its manifest (truncated, malformed, out of range)."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A leaf's bytes do not have the checksum recorded at save time."""


class UnsupportedFormatError(ZerostallError, ValueError):
    """The manifest has a format version or entry kind this reader does not know."""


class MismatchError(ZerostallError, ValueError):
    """A template leaf differs from the saved leaf in shape, dtype or kind."""


class MissingKeyError(ZerostallError, KeyError):
    """A key asked for by the template is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return ZerostallError.__str__(self)


class UnsupportedLeafError(ZerostallError, TypeError):
    """A leaf has a type zerostall cannot save; register a handler for it."""


class StorageError(ZerostallError, OSError):
    """An I/O operation failed. ``errno`` is the operating system's (ENOSPC, EIO, ...)."""

    def __init__(
        self,
        message: str,
        *,
        errno: int | None = None,
        path: str | None = None,
        key: str | None = None,
        rank: int | None = None,
    ) -> None:
        ZerostallError.__init__(self, message, path=path, key=key, rank=rank)
        self.errno = errno
        self.strerror = _errno.errorcode.get(errno, None) if errno is not None else None
        self.filename = path

    def __str__(self) -> str:
        base = ZerostallError.__str__(self)
        if self.errno is not None:
            return f"[{_errno.errorcode.get(self.errno, self.errno)}] {base}"
        return base

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_storage, (type(self), self.message, self.errno, self.path, self.key, self.rank))


def _rebuild_storage(cls: type[StorageError], message: str, errno: int | None, path: str | None, key: str | None,
                     rank: int | None) -> ZerostallError:
    return cls(message, errno=errno, path=path, key=key, rank=rank)


class WriterError(ZerostallError, RuntimeError):
    """The background writer died (killed, crashed) or was closed before the save committed."""


class TornSnapshotError(ZerostallError, RuntimeError):
    """A tensor staged in the background (overlapped staging) was modified in place before its copy
    was done, outside ``optimizer.step()``. ``key`` names the leaf; nothing of the save is committed.

    Call ``response.wait_staged()`` before such in-place changes, or save with
    ``SaveOptions(staging="blocking")``.
    """


class DonatedArrayError(TornSnapshotError):
    """A ``jax.Array`` of an overlapped save was donated to a computation (``donate_argnums``), or
    deleted, before its background copy to host read it. ``key`` names the leaf; nothing of the save
    is committed.

    Call ``response.wait_staged()`` before a step that donates the
    saved arrays, or save with ``SaveOptions(staging="blocking")``.
    """


_BY_NAME: dict[str, type[ZerostallError]] = {
    cls.__name__: cls
    for cls in (
        ZerostallError,
        CheckpointNotFoundError,
        CheckpointExistsError,
        CorruptCheckpointError,
        ChecksumMismatchError,
        UnsupportedFormatError,
        MismatchError,
        MissingKeyError,
        UnsupportedLeafError,
        StorageError,
        WriterError,
        TornSnapshotError,
        DonatedArrayError,
    )
}


def wire_class(name: str) -> type[ZerostallError]:
    """The error class called ``name`` that another process may send (:class:`WriterError` for a
    name this version does not know: a newer writer's class)."""
    return _BY_NAME.get(name, WriterError)


class BackgroundSaveError(WriterError):
    """A save that failed in the background, raised later because nobody received it.

    Raised by the next ``save_*`` call, ``wait()``, ``close()`` or the end of a ``with
    Checkpointer(...)`` block when a save failed after its ``save_*_async`` had returned and its
    :class:`~zerostall.Response` never raised it (``result()`` raising, or ``exception()``
    returning it, counts as received). ``step`` and ``path`` name the first failed save,
    ``cause`` is its error (the class it had in the writer: ``StorageError`` with its errno,
    ``WriterError``, ...), and ``errors`` lists every failed save this one reports, oldest first,
    as ``(step or None, path, error)``.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None,
                 rank: int | None = None, step: int | None = None, cause: BaseException | None = None,
                 errors: tuple[tuple[int | None, str, BaseException], ...] = ()) -> None:
        super().__init__(message, path=path, key=key, rank=rank)
        self.step = step
        self.cause = cause
        self.errors = errors

    @property
    def errno(self) -> int | None:
        """The cause's errno (``ENOSPC``, ``EIO``, ...), if it has one."""
        value = getattr(self.cause, "errno", None)
        return value if isinstance(value, int) else None


class ReadOnlyError(StorageError):
    """A save was asked of a read-only :class:`~zerostall.Checkpointer` (``errno`` is ``EROFS``)."""


class UnknownLayoutError(WriterError):
    """A save named a leaf layout (:class:`zerostall.messages.LeafLayout`) that its writer was
    never sent or has forgotten: the writer refuses it, and nothing of that save is written."""


_BY_NAME["BackgroundSaveError"] = BackgroundSaveError
_BY_NAME["ReadOnlyError"] = ReadOnlyError
_BY_NAME["UnknownLayoutError"] = UnknownLayoutError


class NoValidCheckpointError(CorruptCheckpointError):
    """A fallback load or ``latest_valid_step`` found committed checkpoints, but none that verifies.

    The message names every checkpoint tried and why it was skipped, newest first.
    """


_BY_NAME[NoValidCheckpointError.__name__] = NoValidCheckpointError


class InvalidArgumentError(ZerostallError, ValueError):
    """An argument of a public function or option is out of range (``step=-1``, ``keep_last=0``).

    ``argument`` names the parameter (``"keep_last"``, ``"SaveOptions.io_threads"``); ``path``
    and ``key`` say where, when there is a where.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None,
                 rank: int | None = None, argument: str | None = None) -> None:
        super().__init__(message, path=path, key=key, rank=rank)
        self.argument = argument


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (``keep_last=2.5``, ``step="10"``, ``path=None``).

    Also a ``ValueError`` (as :class:`InvalidArgumentError`), so code that caught the
    ``ValueError`` zerostall raised for such arguments before keeps working.
    """


class MetadataError(InvalidArgumentError):
    """``metadata=`` cannot be stored as given; ``key`` names the offending entry (``"a/b/0"``).

    Raised on the training thread before anything is staged: a NaN or infinite float (manifests
    are strict JSON, RFC 8259, readable by any parser), a reserved key (``"step"`` in a
    :class:`~zerostall.Checkpointer`), or nesting deeper than 64 levels.
    """


class MetadataTypeError(MetadataError, TypeError):
    """A ``metadata=`` value or key has a type JSON cannot hold (a tensor, an object, a non-str key)."""


class HostMemoryLimitError(InvalidArgumentError):
    """``Checkpointer(host_memory_limit=...)`` cannot hold what the configuration needs in this
    rank's host memory (:mod:`zerostall.budget` does the accounting): raised by the constructor
    for a limit below the parts known without the state, and by the first save (or one whose
    layout grows) before any byte is staged. The message names each part's bytes, the limit, and
    what would fit; ``argument`` is ``"host_memory_limit"``, ``path`` the step's path."""


for _cls in (InvalidArgumentError, ArgumentTypeError, HostMemoryLimitError, MetadataError, MetadataTypeError):
    _BY_NAME[_cls.__name__] = _cls


class AdviceError(ZerostallError, ValueError):
    """An input to the checkpoint-interval advisor is out of range (an MTBF <= 0, a negative cost,
    time running backwards), or advice was asked for before the costs could be measured.
    ``key`` names the argument."""


_BY_NAME["AdviceError"] = AdviceError


class MissingDependencyError(ZerostallError, ImportError):
    """An optional dependency of the feature asked for is not installed (``boto3`` for ``s3://``,
    ``lightning`` for :mod:`zerostall.lightning`). The message names the extra that brings it
    (``pip install 'zerostall[s3]'``); ``name`` is the missing module, ``path`` the URL asked for.

    Also an ``ImportError``, so code that caught the plain ``ImportError`` zerostall raised
    before keeps working.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None,
                 rank: int | None = None, name: str | None = None) -> None:
        super().__init__(message, path=path, key=key, rank=rank)
        self.name = name  # ImportError's attribute: the module that could not be imported


_BY_NAME["MissingDependencyError"] = MissingDependencyError


class KeeperPersistError(WriterError):
    """The memory tier's keeper could not persist a memory-only step.

    ``wait()`` and ``close()`` raise it for the persist they ask for (the newest memory-only
    step). A persist the keeper runs on its own after its trainer died is not raised: the
    restarted trainer still resumes from memory, and under torch.distributed an aborted persist
    of the keepers is an expected outcome (a rank did not hold the step). That one is reported
    (docs/guarantees.md, "When the keeper's persist fails"): logged at WARNING on the
    ``zerostall`` logger and listed in :attr:`zerostall.Checkpointer.keeper_failures` of
    the trainer that adopts the keeper, or, when no trainer adopts it before its linger expires,
    kept in a marker file that the next ``Checkpointer`` of that directory and rank reports.
    ``step`` and ``path`` name the step that storage lacks, ``cause`` is the persist's own error
    (``StorageError`` with its errno, ``ChecksumMismatchError`` when the held bytes changed,
    ``WriterError`` for a collective persist that was aborted or timed out).
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None,
                 rank: int | None = None, step: int | None = None, cause: BaseException | None = None) -> None:
        super().__init__(message, path=path, key=key, rank=rank)
        self.step = step
        self.cause = cause

    @property
    def errno(self) -> int | None:
        """The cause's errno (``ENOSPC``, ``EROFS``, ...), if it has one."""
        value = getattr(self.cause, "errno", None)
        return value if isinstance(value, int) else None


_BY_NAME["KeeperPersistError"] = KeeperPersistError


class DirectoryReplacedError(CheckpointNotFoundError):
    """The checkpoint directory was deleted (or deleted and created again) after a step was saved
    into it: that step, held only in the memory tier, belongs to the deleted directory, and is never
    persisted into nor restored from the new one. The message names the step, ``path`` its path."""


_BY_NAME["DirectoryReplacedError"] = DirectoryReplacedError


class KeeperLostError(KeeperPersistError):
    """The memory tier's keeper ended (killed, or its host lost) while it held the newest step this
    trainer saved, a step only its memory held: that step never reached storage and is lost.
    ``wait()`` or ``close()`` raises it (and it is in :attr:`zerostall.Checkpointer.keeper_failures`,
    logged at WARNING when the keeper's end is seen); ``step`` names the step, ``path`` its path."""


_BY_NAME["KeeperLostError"] = KeeperLostError


class ZerostallWarning(UserWarning):
    """Base of zerostall's warnings: what was asked for still works, but a guarantee is weaker
    than documented (``warnings.filterwarnings("error", category=ZerostallWarning)`` makes them fatal)."""


class ReplicaError(ZerostallError, RuntimeError):
    """A replica of a memory-tier step could not be formed, sent or received intact.

    Raised by :mod:`zerostall.memtier.replica`: a keeper that did not prove membership of the job
    (wrong secret, another job, another user on this machine), a group that did not form within
    its timeout, a peer that died or went silent mid-transfer, a manifest whose authentication or
    fields (run, world size, rank, step) are not the expected ones, or bytes whose CRC32C differs
    from the one taken at staging. A received step that raised is never held. ``rank`` is the
    rank whose step it was, where known; ``key`` the leaf whose bytes differ, for a checksum.
    """


_BY_NAME["ReplicaError"] = ReplicaError


class PreemptionError(ZerostallError, RuntimeError):
    """After a preemption notice (``Checkpointer(preemption_signals=...)``), the ranks could not
    agree on the final step: a rank's watcher did not answer within ``DistributedOptions.timeout_s``,
    or the job's ``torch.distributed`` store failed. Raised by ``should_save`` on the training
    thread, once; ``step`` is the step it was called with, where known.
    """



_BY_NAME["PreemptionError"] = PreemptionError


class PeerUnreachableError(ZerostallError, TimeoutError):
    """A peer did not answer within ``DistributedOptions.timeout_s``: another rank, another host's
    keeper, or the job's ``torch.distributed`` store. The peer may be cut off by the network, hung
    (stopped, swapping) or gone; nothing tells these apart from here, so every wait on a peer ends
    at that bound and raises this. ``step`` is the step the wait was for, where known; ``ranks``
    the ranks that did not answer, where known (empty: the store itself did not answer, so no
    rank could be heard). A ``TimeoutError``, so ``except TimeoutError`` and ``except OSError``
    catch it.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None, rank: int | None = None,
                 step: int | None = None, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message, path=path, key=key, rank=rank)
        self.step = step
        self.ranks = tuple(ranks)


_BY_NAME["PeerUnreachableError"] = PeerUnreachableError
