"""One save, as the writer runs it: write data files, checksum leaves, commit, apply retention.

:func:`run_save` is the only save job there is. What differs between a single-process save and
one rank's part of a collective save is a *step* object (:class:`SoloStep` or
:class:`~zerostall.persist.collective.CollectiveStep`) that decides where the data file goes,
which leaves this writer writes (a collective save writes bytes that several ranks hold only
once) and how the commit is agreed. The environment, the checksum thread, the write, the
release of the staging buffers, retention, error handling and the statistics exist once, here.

Runs in the writer (a process by default), never on the training thread.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from zerostall import envvars
from zerostall._version import __version__
from zerostall.checksum import checksum, join_crcs
from zerostall.commit import (
    CommitProtocol,
    RenameCommit,
    committed_steps,
    delete_checkpoint,
    protocol_for,
    step_name,
    steps_to_delete,
)
from zerostall.errors import WriterError
from zerostall.format.file import lay_out
from zerostall.format.manifest import encode_manifest
from zerostall.lease import Lease
from zerostall.messages import LeafRow, SaveJob, SavePiece, WriterStats
from zerostall.options import RetentionPolicy
from zerostall.persist import faults
from zerostall.persist.collective import CollectiveStep
from zerostall.storage import Storage, open_storage
from zerostall.storage.base import as_piece_writer

__all__ = ["run_save", "Pieces", "solo_manifest", "SoloStep", "apply_retention", "peak_rss", "STORAGE_ENV_PREFIXES", "storage_env"]

#: environment variables that configure storage backends; the trainer's values travel with each job
STORAGE_ENV_PREFIXES = ("AWS_", envvars.S3_PREFIX)


def storage_env() -> dict[str, str]:
    """This process's storage configuration, to send along with a job."""
    return {k: v for k, v in os.environ.items() if k.startswith(STORAGE_ENV_PREFIXES)}


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: unlike ru_maxrss, reset at exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def apply_retention(storage: Storage, policy: RetentionPolicy | None, newest: int | None,
                    deleted: list[int] | None = None) -> list[int]:
    """Delete the committed steps that ``policy`` drops now that step ``newest`` is committed.

    Returns the deleted steps; they are also appended to ``deleted`` as they go, so a caller
    that catches a failure half-way still knows what was removed.

    Raises:
        OSError: a deletion failed (what was deleted before it is in ``deleted``).
    """
    out = [] if deleted is None else deleted
    if policy is None or not policy.deletes or newest is None:
        return out
    faults.hit("retention")
    doomed = steps_to_delete(committed_steps(storage), newest=newest, keep_last=policy.keep_last,
                             keep_every_n_steps=policy.keep_every_n_steps)
    for s in doomed:
        delete_checkpoint(storage, step_name(s))
        out.append(s)
    return out


class Pieces(Protocol):
    """Where a piecewise job's bytes come from (:attr:`SaveJob.pieces`; the writer's loop reads
    them from the trainer's connection as they are staged)."""

    def next(self) -> tuple[SavePiece, memoryview]:
        """The next piece and the view of its buffer (blocks until the trainer sent it).

        Raises:
            WriterError: the trainer's connection ended first."""

    def release(self, piece: SavePiece) -> None:
        """The writer no longer reads ``piece``'s buffer: the trainer may stage into it again."""


class Step(Protocol):
    """The part of a save that depends on how many writers take part in it, and on what the
    bytes are (a trainer's staged save, or a keeper's held step: :mod:`zerostall.memtier.keeper`)."""

    #: whether this writer deletes old steps once the save is committed
    applies_retention: bool
    #: whether the data files are written (False: the memory tier's step keeps them in memory)
    writes: bool
    #: CRC32Cs (one per leaf of the job, in its order) already checked against these very bytes,
    #: which nothing writes to any more: the save makes no checksum pass of its own and commits
    #: those (a keeper's held step it verified after its trainer died). None: the CRC32Cs staging
    #: computed (:attr:`SaveJob.crcs`) are taken and only the other leaves checksummed
    known_crcs: Sequence[int | None] | None
    #: runs right before the commit, with the lease check; raising there fails the save (a keeper
    #: checks that its directory was not deleted since the step was saved into it). None: nothing
    guard: Callable[[], None] | None
    #: called right before the commit becomes visible: raises if the writer's lease lapsed
    check_lease: Callable[[], None]

    def begin(self) -> None:
        """Start the attempt; raises ``CheckpointExistsError`` if the checkpoint exists."""

    def data_key(self, file_name: str) -> str:
        """The storage key the data file ``file_name`` is written to."""

    def owned(self, views: Sequence[memoryview], hash_leaf: Callable[[LeafRow], bool]) -> list[int]:
        """Indices of the job's leaves this writer writes."""

    def commit(self, written: list[dict[str, Any]], files: list[dict[str, Any]]) -> None:
        """Make the checkpoint visible (or wait until the committer has); manifest last."""

    def fail(self, exc: BaseException) -> BaseException:
        """Clean up a failed attempt; return the error to raise."""

    def after_commit(self) -> None:
        """Housekeeping once committed (never turns the save into a failure)."""

    def lease_targets(self) -> list[str]:
        """What this attempt may create under the root, the partial data first (see :mod:`zerostall.lease`)."""

    def retain(self, storage: Storage, policy: RetentionPolicy | None, newest: int | None,
               deleted: list[int]) -> None:
        """Apply retention once committed (only if ``applies_retention``)."""


def solo_manifest(job: SaveJob, written: list[dict[str, Any]], files: list[dict[str, Any]], data_dir: str) -> bytes:
    """The manifest of a save that holds every leaf of ``job`` (data files under ``data_dir``)."""
    return encode_manifest(
        items=job.items, leaves=written, metadata=job.metadata, library_version=__version__,
        files=[{"path": f"{data_dir}/{f['name']}", "size": f["size"]} for f in files])


class SoloStep:
    """A save that one writer makes alone: every leaf is its own; commit by the storage's protocol."""

    applies_retention = True
    writes = True

    def __init__(self, job: SaveJob, storage: Storage, *, known_crcs: Sequence[int | None] | None = None,
                 guard: Callable[[], None] | None = None) -> None:
        self.job = job
        self.known_crcs, self.guard = known_crcs, guard
        self.protocol: CommitProtocol = protocol_for(storage)
        #: set by run_save: raises if the writer's lease lapsed (its partial may be gone)
        self.check_lease: Callable[[], None] = _no_check

    def begin(self) -> None:
        self.attempt = self.protocol.begin(self.job.name)

    def data_key(self, file_name: str) -> str:
        return f"{self.attempt.staging}/{self.attempt.data_dir}/{file_name}"

    def owned(self, views: Sequence[memoryview], hash_leaf: Callable[[LeafRow], bool]) -> list[int]:
        return list(range(len(self.job.leaves)))

    def commit(self, written: list[dict[str, Any]], files: list[dict[str, Any]]) -> None:
        faults.hit("manifest")
        manifest = solo_manifest(self.job, written, files, self.attempt.data_dir)
        #: kept for the memory tier, which holds the same manifest as storage
        self.manifest_bytes = manifest
        faults.hit("commit")
        self.check_lease()
        self.protocol.commit(self.attempt, manifest)

    def fail(self, exc: BaseException) -> BaseException:
        if not hasattr(self, "attempt"):  # failed before the attempt existed: nothing to remove
            return exc
        try:
            self.protocol.abort(self.attempt)
        except Exception:  # noqa: BLE001,S110 - cleaning up after a failure; the failure is what the user sees
            pass
        return exc

    def after_commit(self) -> None:
        return None

    def lease_targets(self) -> list[str]:
        a = self.attempt
        return [a.staging] if isinstance(self.protocol, RenameCommit) else [f"{a.staging}/{a.data_dir}"]

    def retain(self, storage: Storage, policy: RetentionPolicy | None, newest: int | None,
               deleted: list[int]) -> None:
        apply_retention(storage, policy, newest, deleted)


def run_save(job: SaveJob, buffers: Mapping[int, memoryview], released: Callable[[], None],
             step: Step | None = None, *, mirror_env: bool = True, pieces: Pieces | None = None) -> WriterStats:
    """Persist and commit one save; call ``released()`` as soon as the buffers are no longer read.

    ``mirror_env``: make this process's storage environment the one the trainer had at the save
    (:attr:`SaveJob.env`) first. Only a writer or keeper process of its own does: a writer thread
    shares the trainer's ``os.environ``, which a background job must never rewrite (it would undo
    what the trainer set since, credentials rotated after the save, say), so it uses that
    environment as it is when the job runs.

    ``step`` replaces the step the job would get (a collective or solo save's): the memory tier's,
    which writes no data file, or a keeper's persist of a held step, with the CRC32Cs it verified
    and its directory's guard (:class:`Step`).

    ``pieces``: where a piecewise job's bytes come from (:class:`Pieces`): each is written at its
    offset of the attempt's data file and released before the next is read; the commit follows the
    last, as for a job staged whole.

    Raises:
        ZerostallError | OSError: the save failed; this attempt's partial files were removed
            (for a collective save, the error every rank raises).
    """
    if mirror_env:
        _mirror_env(job.env)
    save = _Save(job, buffers, released, step, pieces)
    try:
        save.begin()  # the attempt, and the lease on what it will create
        mine = save.plan()  # the leaves this writer writes; their checksums start beside the writes
        save.write(mine)  # the data files; then the buffers are released
        save.commit(mine)  # every CRC32C in, the manifest last
    except BaseException as exc:
        final = save.failed(exc)
        if final is exc:
            raise
        raise final from exc
    return save.finish(mine)  # retention and housekeeping, which never fail the save


class _Save:
    """One save job's state across its phases (:func:`run_save`)."""

    def __init__(self, job: SaveJob, buffers: Mapping[int, memoryview], released: Callable[[], None],
                 step: Step | None, pieces: Pieces | None = None) -> None:
        self.t0 = time.perf_counter()
        self.job = job
        self.storage = open_storage(job.root)
        self.step: Step = step if step is not None else (
            CollectiveStep(job, job.collective, self.storage) if job.collective is not None else SoloStep(job, self.storage))
        if job.pieces and (pieces is None or job.collective is not None or len(job.files) != 1):
            raise WriterError(f"save of {job.path}: a save in pieces is one rank's alone, one data file, and needs "
                              "its pieces' source")
        self.pieces = pieces if job.pieces else None
        #: a piecewise job's bytes are in no buffer of its own: they arrive piece by piece
        self.views = [] if self.pieces is not None else [buffers[f.buffer] for f in job.files]
        self._released, self.is_released = released, False
        self.lease: Lease | None = None
        self.known: list[int | None] = []
        self.sums: dict[int, int] = {}
        self.crc_error: list[BaseException] = []
        self.crc_thread: threading.Thread | None = None
        self.written: list[dict[str, Any]] = []
        self.files: list[dict[str, Any]] = []
        self.write_s = self.commit_s = 0.0

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._released()

    def begin(self) -> None:
        job, step = self.job, self.step
        faults.hit("begin", job.root)
        step.begin()
        # Before anything of the attempt exists: a collector on any host leaves it alone while renewed.
        # (A memory-only save creates nothing under the root: no lease.)
        targets = step.lease_targets()
        self.lease = Lease(self.storage, targets).acquire() if targets else None
        if self.lease is not None:
            held = self.lease
            step.check_lease = lambda: held.check(job.path)
        if step.guard is not None:
            step.check_lease = _guarded(step.guard, step.check_lease)

    def plan(self) -> list[int]:
        """The leaves this writer writes; the CRC32Cs no one took yet start on a thread of their own."""
        job, views = self.job, self.views
        mine = self.step.owned(views, lambda lf: lf.shared)
        if self.pieces is not None:  # each piece brings its leaves' CRC32Cs (write())
            self.known = [None] * len(job.leaves)
            return mine
        self.known = _known(job, self.step.known_crcs)
        todo = [li for li in mine if self.known[li] is None]

        def crc_runner() -> None:
            # Checksums run beside the writes: CRC32C is ~10 GB/s on one core and mostly overlaps I/O.
            try:
                faults.hit("checksum")
                for li in todo:
                    lf = job.leaves[li]
                    self.sums[li] = checksum(views[lf.file][lf.offset:lf.offset + lf.nbytes])
            except BaseException as exc:  # noqa: BLE001 - re-raised in commit(), on the job's thread
                self.crc_error.append(exc)

        if todo:
            self.crc_thread = threading.Thread(target=crc_runner, name="zerostall-crc", daemon=True)
            self.crc_thread.start()
        elif self.step.known_crcs is None:
            # The checksum phase of a trainer's save, with nothing left to sum (staging did): a
            # fault point all the same (crash tests stop a save there). The keeper's persist of
            # CRCs it checked has no such phase.
            faults.hit("checksum")
        return mine

    def write(self, mine: list[int]) -> None:
        job, step = self.job, self.step
        t_write = time.perf_counter()
        try:
            faults.hit("write", job.root)
            if self.pieces is not None:
                self.known = _write_pieces(job, step, self.storage, self.pieces)
                self.written = [lf.to_json() for lf in job.leaves]
                self.files = [{"name": f.name, "size": f.length} for f in job.files]
            elif step.writes:
                self.written, self.files = _write(job, step, self.storage, self.views, mine)
            else:  # the staged images stay where they are (the memory tier)
                self.written = [lf.to_json() for lf in job.leaves]
                self.files = [{"name": f.name, "size": f.length} for f in job.files]
        finally:
            if self.crc_thread is not None:
                self.crc_thread.join()
        self.write_s = time.perf_counter() - t_write
        self.release()

    def commit(self, mine: list[int]) -> None:
        if self.crc_error:
            raise self.crc_error[0]
        for lf, li in zip(self.written, mine, strict=True):
            c = self.known[li]
            lf["crc32c"] = c if c is not None else self.sums[li]
        t_commit = time.perf_counter()
        self.step.commit(self.written, self.files)
        self.commit_s = time.perf_counter() - t_commit

    def failed(self, exc: BaseException) -> BaseException:
        """What a failed save raises, once its attempt is cleaned up (its buffers released first)."""
        self.release()
        final = self.step.fail(exc)
        if self.lease is not None:
            _release_after_failure(self.lease, self.storage)
        return final

    def finish(self, mine: list[int]) -> WriterStats:
        # Committed: what follows never turns the save into a failure. A retention failure only
        # leaves old steps behind (the next save's retention retries them); it is reported in the
        # stats and logged by the trainer.
        job, step = self.job, self.step
        if self.lease is not None:
            self.lease.release()
        step.after_commit()
        deleted: list[int] = []
        retention_error: str | None = None
        if step.applies_retention:
            try:
                step.retain(self.storage, job.retention, job.step, deleted)
            except Exception as exc:  # noqa: BLE001 - any failure here is reported, never raised
                retention_error = f"{type(exc).__name__}: {exc}"
        return WriterStats(
            nbytes=sum(f["size"] for f in self.files), write_s=self.write_s, commit_s=self.commit_s,
            persist_s=time.perf_counter() - self.t0, writer_peak_rss=peak_rss(), deleted_steps=tuple(deleted),
            retention_error=retention_error,
            rank=job.collective.rank if job.collective is not None else None,
            leaves_written=len(mine) if job.collective is not None else None,
        )


def _guarded(guard: Callable[[], None], check_lease: Callable[[], None]) -> Callable[[], None]:
    def check() -> None:
        guard()
        check_lease()
    return check


def _no_check() -> None:
    return None


def _release_after_failure(lease: Lease, storage: Storage) -> None:
    """Drop the lease if the failed attempt's partial data is gone; else let it expire, so that a
    collector removes what the clean-up could not."""
    try:
        gone = not storage.exists(lease.targets[0])
    except OSError:
        gone = False
    lease.release(delete=gone)


def _known(job: SaveJob, known_crcs: Sequence[int | None] | None) -> list[int | None]:
    """Each leaf's CRC32C known before this save checksums anything: ``known_crcs`` if given, else
    what staging computed (:attr:`SaveJob.crcs`); None where the save must checksum the leaf."""
    given = known_crcs if known_crcs is not None else job.crcs
    if not given:
        return [None] * len(job.leaves)
    if len(given) != len(job.leaves):
        raise WriterError(f"save of {job.path}: {len(given)} checksums for {len(job.leaves)} leaves")
    return list(given)


def _write(job: SaveJob, step: Step, storage: Storage, views: list[memoryview],
           mine: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Write this writer's data files; return the manifest rows of the leaves written, and the files.

    A row is the leaf's entry as the trainer planned it (:meth:`~zerostall.format.manifest.LeafEntry.to_json`),
    unchanged where the staged image is the file; the caller adds the checksum."""
    w = job.write
    if len(mine) == len(job.leaves):
        # Everything staged is this writer's: the staged images are the files, written as they are.
        def write_file(i: int) -> None:
            f = job.files[i]
            storage.write_from_buffer(step.data_key(f.name), views[i], f.length, threads=w.io_threads,
                                      chunk_bytes=w.chunk_bytes, direct=w.direct_io)

        if len(job.files) == 1:
            for i in range(len(job.files)):
                write_file(i)
        else:
            with ThreadPoolExecutor(max_workers=min(4, len(job.files))) as pool:
                list(pool.map(write_file, range(len(job.files))))
        written = [lf.to_json() for lf in job.leaves]
        return written, [{"name": f.name, "size": f.length} for f in job.files]
    # A collective save gave some leaves to other ranks: lay out the rest compactly (the staging
    # plan's own rules) and write each leaf from the staging buffer to its new place, which only
    # this writer knows: its entry, laid out again, is what the manifest records.
    leaves = [job.leaves[i] for i in mine]
    fplan, placed = lay_out(leaves, rank=job.collective.rank if job.collective is not None else 0)
    name = job.files[0].name
    _write_compact(storage, step.data_key(name), views, fplan.header, fplan.size,
                   [(lf.file, lf.offset, to.offset, lf.nbytes) for lf, to in zip(leaves, placed, strict=True)])
    return [to.to_json() for to in placed], [{"name": name, "size": fplan.size}]


def _write_pieces(job: SaveJob, step: Step, storage: Storage, pieces: Pieces) -> list[int | None]:
    """Write a piecewise job's one data file from its pieces as they arrive; return each leaf's
    CRC32C, joined from the pieces' parts.

    Each piece is released once written (the next is read only then), so the trainer stages into
    at most the buffers it has. The file is durable on return, as a file written whole."""
    writer = as_piece_writer(storage)
    if writer is None:
        raise WriterError(f"save of {job.path}: this storage writes no data file in pieces")
    parts: list[tuple[tuple[int, int, int], int]] = []
    f = job.files[0]

    def stream() -> Any:
        held: SavePiece | None = None
        try:
            for _ in range(job.pieces):
                piece, view = pieces.next()
                if piece.job != job.id or piece.file != 0 or piece.offset + piece.length > f.length:
                    raise WriterError(f"save of {job.path}: a piece of {piece.length} bytes at {piece.offset} does not "
                                      f"belong to this job's file of {f.length} bytes")
                if held is not None:  # resumed after its write returned
                    pieces.release(held)
                held = piece
                parts.extend(((leaf, lo, hi), crc) for leaf, lo, hi, crc in piece.crcs)
                yield view[:piece.length], piece.offset
        finally:
            if held is not None:
                pieces.release(held)

    writer.write_pieces(step.data_key(f.name), b"", f.length, stream())
    crcs = join_crcs(parts, len(job.leaves))
    for i, (c, lf) in enumerate(zip(crcs, job.leaves, strict=True)):
        if c is None:
            if lf.nbytes:
                raise WriterError(f"save of {job.path}: no piece held leaf {lf.key!r}")
            crcs[i] = 0  # an empty leaf's checksum
    return crcs


def _write_compact(storage: Storage, key: str, views: list[memoryview], header: bytes, size: int,
                   pieces: list[tuple[int, int, int, int]]) -> None:
    """Write a file of ``size`` bytes: ``header``, then each ``(buffer, src offset, dst offset, n)``."""
    writer = as_piece_writer(storage)
    if writer is not None:  # the backend writes each piece from the staging buffer: no assembled copy
        writer.write_pieces(key, header, size, [(views[b][src:src + n], dst) for b, src, dst, n in pieces])
        return
    buf = bytearray(size)  # other backends take one contiguous buffer
    buf[:len(header)] = header
    for b, src, dst, n in pieces:
        buf[dst:dst + n] = views[b][src:src + n]
    storage.write_from_buffer(key, memoryview(buf), size, threads=1, chunk_bytes=32 << 20, direct=False)


def _mirror_env(env: Mapping[str, str]) -> None:
    """Make this writer's storage environment the trainer's (credentials, endpoint, S3 tuning)."""
    for k in [k for k in os.environ if k.startswith(STORAGE_ENV_PREFIXES) and k not in env]:
        del os.environ[k]
    os.environ.update(env)
