"""Configuration: keyword-only frozen dataclasses, one per concern."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal

from zerostall.errors import ArgumentTypeError, InvalidArgumentError
from zerostall.validate import check_bool, check_choice, check_instance, check_int, check_number, check_optional_int

__all__ = ["WriterKind", "SaveOptions", "LoadOptions", "DistributedOptions", "Replicated", "RetentionPolicy",
           "MemoryTier", "Staging"]

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


class Staging(enum.Enum):
    """When ``save_*_async`` returns relative to the copy of the state (docs/guarantees.md).

    ``OVERLAP`` (default): tensors that only an optimizer's ``step()`` modifies (its parameters
    and its ``state``) are copied in the background while training goes on; the next
    ``step()`` of any optimizer waits for that copy first (zerostall installs the guard).
    Everything else is copied before the call returns. ``BLOCKING``: everything is copied
    before the call returns. A string value (``"overlap"``, ``"blocking"``) is accepted.
    """

    OVERLAP = "overlap"
    BLOCKING = "blocking"


class Replicated(enum.Enum):
    """How a collective load reads leaves that every saving rank had identical (DDP state).

    ``BROADCAST`` (default): each such leaf is read by one rank (the reads are spread over the
    ranks) and sent to the others with ``torch.distributed.broadcast``. ``EVERY_RANK``: every
    rank reads what it needs from storage itself (no collective traffic; more storage reads).
    """

    BROADCAST = "broadcast"
    EVERY_RANK = "every_rank"


def _positive_int_or_none(name: str, value: object) -> None:
    check_optional_int(name, value, lo=1)  # typed: ArgumentTypeError / InvalidArgumentError (both ValueError)


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which committed steps of a :class:`~zerostall.Checkpointer` survive a newer commit.

    Built once by the Checkpointer from its ``keep_last`` / ``keep_every_n_steps`` arguments and
    carried, unchanged, to the writer that applies it after each commit.

    Attributes:
        keep_last: keep this many newest steps (the one just committed included); None keeps all.
        keep_every_n_steps: also keep every step divisible by this, whatever ``keep_last`` says.

    Raises:
        ValueError: a field is not a positive int or None.
    """

    keep_last: int | None = None
    keep_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        _positive_int_or_none("keep_last", self.keep_last)
        _positive_int_or_none("keep_every_n_steps", self.keep_every_n_steps)

    @property
    def deletes(self) -> bool:
        """Whether this policy can ever delete a step."""
        return self.keep_last is not None


@dataclass(frozen=True, kw_only=True)
class DistributedOptions:
    """How saves and loads behave under ``torch.distributed`` (see docs/distributed.md).

    Attributes:
        enabled: act collectively when ``torch.distributed`` is initialized (default). ``False``
            makes every rank save and load on its own, as a single process would.
        process_group: the group whose ranks save together (default: the world). It is used on
            the training thread only: once at the first save (run id) and during loads.
        timeout_s: how long a rank's writer waits for the other ranks (their hash tables, their
            reports, rank 0's commit) before the save is aborted on every rank.
        poll_s: how often writers look at the shared storage while they wait.
    """

    enabled: bool = True
    process_group: Any = None
    timeout_s: float = 300.0
    poll_s: float = 0.02

    def __post_init__(self) -> None:
        check_bool("DistributedOptions.enabled", self.enabled)
        check_number("DistributedOptions.timeout_s", self.timeout_s, positive=True)
        check_number("DistributedOptions.poll_s", self.poll_s, positive=True)
        if not self.timeout_s > 0:
            raise InvalidArgumentError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.poll_s > 0:
            raise InvalidArgumentError(f"poll_s must be > 0, got {self.poll_s}")


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
        io_threads: parallel write streams per save. One is the default: a single 64 MiB
            ``O_DIRECT`` write already keeps 16 requests of 4 MiB in the disk's queue, and a
            second stream only adds kernel CPU (ext4 serializes extending direct writes).
            Object stores use ``S3Options.concurrency`` (this raises it, never lowers it).
        chunk_bytes: size of one write call.
        writer_nice: niceness added to the writer process, so training keeps CPU priority.
            0 leaves the writer's niceness alone.
        writer_sched: the writer process's Linux scheduling class: ``"batch"`` (default; a writer
            woken by a finished I/O never preempts the trainer), ``"idle"`` (``SCHED_IDLE``: it
            runs only on cores the trainer leaves idle, so persisting can take much longer while
            training saturates the cores) or ``"normal"``.
        distributed: collective behaviour under ``torch.distributed`` (None: the defaults of
            :class:`DistributedOptions`, i.e. collective whenever it is initialized).
        staging: ``"overlap"`` (default) or ``"blocking"``; see :class:`Staging`.
    """

    writer: WriterKind = WriterKind.PROCESS
    max_in_flight: int = 1
    direct_io: bool = True
    io_threads: int = 1
    chunk_bytes: int = 64 * MiB
    writer_nice: int = 10
    distributed: DistributedOptions | None = None
    writer_sched: str = "batch"
    staging: Staging = Staging.OVERLAP

    def __post_init__(self) -> None:
        if isinstance(self.writer, str):  # "thread" / "process", as the enum's values
            check_choice("SaveOptions.writer", self.writer, tuple(k.value for k in WriterKind))
            object.__setattr__(self, "writer", WriterKind(self.writer))
        check_instance("SaveOptions.writer", self.writer, WriterKind, optional=False)
        check_int("SaveOptions.max_in_flight", self.max_in_flight, lo=1)
        check_bool("SaveOptions.direct_io", self.direct_io)
        check_int("SaveOptions.io_threads", self.io_threads, lo=1)
        check_int("SaveOptions.chunk_bytes", self.chunk_bytes, lo=MiB)
        check_int("SaveOptions.writer_nice", self.writer_nice)
        check_instance("SaveOptions.distributed", self.distributed, DistributedOptions)
        check_choice("SaveOptions.writer_sched", self.writer_sched, ("batch", "idle", "normal"))
        if not isinstance(self.staging, Staging):
            try:
                object.__setattr__(self, "staging", Staging(self.staging))
            except ValueError:
                raise InvalidArgumentError(f"staging must be 'overlap' or 'blocking', got {self.staging!r}") from None
        if self.chunk_bytes % 4096:
            raise InvalidArgumentError(f"chunk_bytes must be a multiple of 4096 and >= 1 MiB, got {self.chunk_bytes}")


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How checkpoints are read.

    Attributes:
        verify: check every leaf's checksum after reading it (default on).
        io_threads: parallel read streams.
        chunk_bytes: size of one read call.
        replicated: collective loads only; see :class:`Replicated` (a string value is accepted).
        distributed: collective behaviour under ``torch.distributed``; see :class:`DistributedOptions`.
        atomic: whether a failed load may leave a template partly overwritten (docs/guarantees.md,
            "All-or-nothing loads"). ``False`` (default): one verified streaming pass, each byte
            checksummed as it is copied in (the fastest load: 1.3-1.4x ``safetensors.load_file``
            warm); a load that raises has left the leaves read before the failure, and part of the
            failing one, overwritten, and its error says so. ``True``: every leaf is read and
            verified before the first byte is written into a template's own memory (the local
            backend checks the bytes in the page cache, other backends in a staging copy of the
            in-place bytes), so a load that raises leaves every template as it was; it costs a
            second pass over the bytes. ``"auto"``: ``True`` while the bytes loaded in place are
            at most half the memory the kernel reports available (``MemAvailable``), else
            ``False``. Only with ``verify``.
    """

    verify: bool = True
    io_threads: int = 4
    chunk_bytes: int = 32 * MiB
    replicated: Replicated = Replicated.BROADCAST
    distributed: DistributedOptions | None = None
    atomic: bool | Literal["auto"] = False

    def __post_init__(self) -> None:
        check_bool("LoadOptions.verify", self.verify)
        check_int("LoadOptions.io_threads", self.io_threads, lo=1)
        check_int("LoadOptions.chunk_bytes", self.chunk_bytes, lo=4096)
        check_instance("LoadOptions.distributed", self.distributed, DistributedOptions)
        if not isinstance(self.atomic, bool):
            check_choice("LoadOptions.atomic", self.atomic, (True, False, "auto"))
        if not isinstance(self.replicated, Replicated):
            check_choice("LoadOptions.replicated", self.replicated, tuple(r.value for r in Replicated))
            object.__setattr__(self, "replicated", Replicated(self.replicated))


def _check_memory_tier_types(tier: MemoryTier) -> None:
    """A value of the wrong type is a ``TypeError`` too (``ArgumentTypeError``), a bool is not a number."""
    for name, number in (("persist_interval_steps", False), ("persist_interval_s", True), ("linger_s", True),
                         ("replicas", False), ("parity", False), ("parity_group", False)):
        value = getattr(tier, name)
        if value is None and name in ("persist_interval_s", "parity_group"):
            continue
        ok = isinstance(value, (int, float)) if number else isinstance(value, int)
        if isinstance(value, bool) or not ok:
            want = "a number of seconds" if number else ("an int" if name in ("replicas", "parity") else "a positive int")
            raise ArgumentTypeError(f"MemoryTier {name} must be {want}"
                                    f"{' or None' if name in ('persist_interval_s', 'parity_group') else ''}, "
                                    f"got {value!r}",
                                    argument=name)


@dataclass(frozen=True, kw_only=True)
class MemoryTier:
    """Checkpoint every save into this host's memory; persist only some saves to storage.

    Passed to :class:`~zerostall.Checkpointer` as ``memory_tier=``. Every save commits to the
    memory tier (the staged bytes, checksummed, with the same manifest as on storage), held by a
    *keeper*: the writer process, which outlives the trainer. A save is also persisted to the
    Checkpointer's directory when its step is a multiple of ``persist_interval_steps`` or, if
    ``persist_interval_s`` is set, when that many seconds have passed since the last persisted
    save. A restarted trainer on the same host (same user, directory and rank) adopts the
    keeper and restores the newest step from memory (docs/guarantees.md, "Memory tier").

    Attributes:
        persist_interval_steps: persist steps divisible by this (1: every save; the memory tier
            then only speeds up restarts).
        persist_interval_s: also persist the first save after this many seconds without one
            (None: steps only). Single-process only: under ``torch.distributed`` ranks must agree
            on which saves persist, and clocks differ.
        linger_s: how long a keeper whose trainer died waits for a new trainer before it exits
            and frees the memory (after persisting the newest memory-only step).
        replicas: how many keepers on *other* hosts also hold each rank's newest memory step
            (docs/guarantees.md, "Replicas in another host's memory"): a restart after a node
            loss then resumes from memory. 0 (the default) keeps today's single copy: one host
            gains nothing from replicas, and each replica costs another full copy of every rank's
            state in host memory (on the holder's host). Needs torch.distributed with at least
            ``replicas + 1`` hosts (``ZEROSTALL_HOST_ID``, else the hostname) holding equally
            many consecutive ranks, and the job's store at ``MASTER_ADDR:MASTER_PORT``.
        replicas_in_place: a holder receives each new replica over the one it holds instead of
            beside it: one copy of the origin's state per replica instead of two, but while a
            transfer runs that holder has no complete replica of the origin, so a loss of the
            origin's host then restores that rank from storage (docs/guarantees.md, "Replicas in
            another host's memory"). False (the default) keeps the newest replica until the next
            one has arrived and matched its checksums.
        parity: 1 keeps, instead of replicas, one XOR parity per group of ``parity_group`` hosts
            (docs/guarantees.md, "Parity across hosts"): each rank's keeper holds about
            ``1 / (parity_group - 1)`` of its own state as parity for the ranks of the same local
            index on the other hosts of its group, and a restart after the loss of one host of a
            group rebuilds each lost rank's newest memory step from the survivors' memory. 0 (the
            default): none. Not with ``replicas``. Needs what ``replicas`` needs, and at least 2 hosts.
        parity_group: hosts per parity group, consecutive in rank order (None: the job's hosts, at
            most 8: a larger group costs less memory, ``1 / (G - 1)``, but is more likely to lose
            two hosts at once, which only storage then survives; past 8 the memory saved is under
            2% of the state per host added). When the hosts do not divide into groups of it, the
            last group is the remainder, or, if that would be one host, the one before it takes it.

    Raises:
        InvalidArgumentError: a field is out of range (a ``ValueError``).
        ArgumentTypeError: a field has the wrong type, a bool included (also a ``TypeError``).

    Example::

        >>> MemoryTier(persist_interval_steps=10).persist_interval_steps
        10
    """

    persist_interval_steps: int = 1
    persist_interval_s: float | None = None
    linger_s: float = 600.0
    replicas: int = 0
    replicas_in_place: bool = False
    parity: int = 0
    parity_group: int | None = None

    def __post_init__(self) -> None:
        _check_memory_tier_types(self)  # from here on every field has its type
        if self.persist_interval_steps < 1:
            raise InvalidArgumentError(f"persist_interval_steps must be a positive int, got {self.persist_interval_steps!r}")
        if self.persist_interval_s is not None and not self.persist_interval_s > 0:
            raise InvalidArgumentError(f"persist_interval_s must be > 0 or None, got {self.persist_interval_s!r}")
        if not self.linger_s >= 0:
            raise InvalidArgumentError(f"linger_s must be >= 0, got {self.linger_s!r}")
        if self.replicas < 0:
            raise InvalidArgumentError(f"replicas must be >= 0, got {self.replicas!r}", argument="replicas")
        check_bool("MemoryTier.replicas_in_place", self.replicas_in_place)
        if self.parity not in (0, 1):
            raise InvalidArgumentError(f"parity must be 0 or 1 (one XOR parity per group survives one lost host), got "
                                       f"{self.parity!r}", argument="parity")
        if self.parity and self.replicas:
            raise InvalidArgumentError(f"parity={self.parity} and replicas={self.replicas}: choose one (each survives "
                                       "the loss of a host on its own)", argument="parity")
        if self.parity_group is not None and (self.parity_group < 2 or not self.parity):
            raise InvalidArgumentError(f"parity_group={self.parity_group!r} needs parity=1 and at least 2 hosts per "
                                       "group", argument="parity_group")
