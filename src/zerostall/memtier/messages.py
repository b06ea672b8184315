"""The memory tier's messages: what a trainer and its keeper say beyond what any writer does.

The keeper is the writer process of a trainer with a memory tier (:mod:`zerostall.memtier.keeper`),
so it speaks the writer's protocol (:mod:`zerostall.messages`: one codec, one version) plus these
kinds, which this module registers into that codec when imported (the keeper, its trainer's side
:mod:`zerostall.memtier.client`, ``zerostall list``). A plain writer imports none of this and
refuses them as unknown. Each kind is a frozen dataclass whose fields the codec checks against
its annotations.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerostall.messages import Message, WireError, register_message

__all__ = ["Adopt", "Closed", "HeldParityInfo", "HeldReplica", "Image", "ImageFile", "ImageQuery", "KeeperBusy",
           "KeeperFailed", "PersistHeld", "Persisted", "ReplicaSetup"]


@dataclass(frozen=True, kw_only=True)
class Closed(Message):
    """A keeper's last message at a trainer's :class:`Close`: the step it held is on storage now
    (persisted at this close, or before). ``step`` None: it held none, or that persist failed (a
    :class:`KeeperFailed` with ``closing`` came first). A trainer that saved a memory-only step and
    hears no ``Closed`` naming it knows the keeper ended without storing it."""

    step: int | None


@dataclass(frozen=True, kw_only=True)
class PersistHeld(Message):
    """The trainer's ``wait()``: persist the step the keeper holds now if only memory has it, then
    answer :class:`Persisted`; the keeper goes on serving. Under torch.distributed a collective
    step is persisted collectively, so every rank's trainer asks."""

    #: the trainer's number for this request, repeated in the answer (an answer to a request the
    #: trainer stopped waiting for is then not taken for a later one's)
    request: int
    #: bounds a collective step's persist below the job's ``timeout_s`` (None: that timeout);
    #: after a preemption notice, the time the notice leaves
    timeout_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Persisted(Message):
    """The keeper's answer to :class:`PersistHeld`: the step it holds is on storage now (persisted
    for this request, or before). ``step`` None: it holds none, or that persist failed (a
    :class:`KeeperFailed` with ``closing`` came first)."""

    request: int
    step: int | None


@dataclass(frozen=True, kw_only=True)
class Adopt(Message):
    """A new trainer's first message to a lingering keeper: the directory and rank it checkpoints."""

    root: str
    rank: int
    #: the directory's instance id (:mod:`zerostall.memtier.instance`): a keeper of another
    #: instance (its directory was deleted since) gives up its name and exits instead of answering
    instance: str = ""


@dataclass(frozen=True, kw_only=True)
class ImageQuery(Message):
    """Which step does the memory tier hold? Answered by :class:`Image` once earlier jobs are done."""

    #: ask instead for the replica this keeper holds of rank ``origin``'s step (another host's
    #: rank; :class:`ReplicaSetup`): the :class:`Image` then describes that replica
    origin: int | None = None
    #: ask instead for the parity this keeper holds (:class:`ReplicaSetup` ``parity_group``): the
    #: :class:`Image` then has the parity buffer as its one file and :class:`HeldParityInfo`
    parity: bool = False
    #: the asker's number for this query, repeated in the :class:`Image` that answers it
    request: int = 0


@dataclass(frozen=True, kw_only=True)
class HeldReplica(Message):
    """A replica a keeper holds: rank ``origin``'s step ``step``, every leaf verified on arrival."""

    origin: int
    step: int


@dataclass(frozen=True, kw_only=True)
class HeldParityInfo(Message):
    """The parity a keeper holds (:mod:`zerostall.memtier.paritypeers`): its stripe's parity of
    step ``step`` for member ``member`` of a parity group of ``size`` members, the share size of
    every member and every member's manifest (of that step), as the exchange agreed on them."""

    step: int
    member: int
    size: int
    sizes: tuple[int, ...]
    manifests: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ReplicaSetup(Message):
    """The trainer tells its keeper how to replicate: the job's keeper group (``job``, its
    ``secret`` in hex, its store at ``store`` = ``"host:port"``), this rank in the world's
    layout, how many replicas each step gets, and whether a holder keeps one copy of each. Sent after each Hello (a keeper adopted by a
    new run learns that run's job and secret). No answer."""

    store: str
    job: str
    secret: str
    world: int
    rank: int
    ranks_per_host: int
    replicas: int
    timeout_s: float
    #: a holder receives each new replica over the one it holds (MemoryTier.replicas_in_place)
    in_place: bool = False
    #: hosts per parity group (MemoryTier.parity): the keepers of this rank's group exchange
    #: every held step's parity; 0: no parity
    parity_group: int = 0


@dataclass(frozen=True, kw_only=True)
class ImageFile(Message):
    """One data file of the memory tier's step: ``length`` bytes of a shared buffer of ``size``."""

    name: str
    length: int
    size: int


@dataclass(frozen=True, kw_only=True)
class Image(Message):
    """The memory tier's newest complete step (``step`` None: none); one descriptor per file
    follows (``SCM_RIGHTS``), to be mapped read-only."""

    step: int | None
    name: str
    manifest: str
    files: tuple[ImageFile, ...]
    #: the keeper checked every leaf's CRC32C against the manifest after the trainer that staged
    #: the buffers died, and all matched; nothing writes to them since (docs/guarantees.md,
    #: "Where the memory tier's bytes are verified"), so the load may skip its checksum pass.
    #: A default, so an older keeper's Image (without it) still decodes: as not verified, the
    #: meaning it had there; so no protocol bump.
    verified: bool = False
    #: the pid of the live trainer the keeper serves (None: none, it lingers), so that a keeper that
    #: lost the race for the name can tell its own trainer who holds it (:class:`KeeperBusy`).
    #: A default for the same reason as ``verified``.
    trainer_pid: int | None = None
    #: the step also reached storage (its save persisted it, or the keeper did after a crash):
    #: ``zerostall list`` then does not call a step that retention has since removed from storage
    #: "in memory only". A default for the same reason as ``verified``.
    persisted: bool = False
    #: the instance id of the directory the step was saved into (:mod:`zerostall.memtier.instance`):
    #: ``zerostall list`` shows a held step only if the directory still carries it
    instance: str = ""
    #: the replicas of other ranks' steps this keeper holds (:class:`ReplicaSetup`)
    replicas: tuple[HeldReplica, ...] = ()
    #: the step whose parity this keeper holds (None: none)
    parity_step: int | None = None
    #: answering ``ImageQuery(parity=True)``: the parity held (None: none); the one file is its buffer
    parity: HeldParityInfo | None = None
    #: the :class:`ImageQuery` this answers (its ``request``)
    request: int = 0


@dataclass(frozen=True, kw_only=True)
class KeeperFailed(Message):
    """The keeper's persist of a memory-only step after its trainer died failed (the step, its
    path, the error). Sent on the keeper's job loop to the trainer it serves: right after the
    Hello of an adopting trainer, after each job or image query, and before a clean close ends."""

    step: int | None
    path: str
    error: WireError
    #: the rank of the keeper (its directory and rank name it)
    rank: int = 0
    #: the persist the live trainer asked for (its clean close, or its ``wait()``) failed
    closing: bool = False


@dataclass(frozen=True, kw_only=True)
class KeeperBusy(Message):
    """The keeper's answer to :class:`Adopt` while the trainer it serves is alive: that trainer's
    pid. The asking Checkpointer then refuses to start (two memory tiers of one directory and rank
    on one host would hold steps that no restart could find). Also sent, instead of its Hello, by a
    new keeper whose name another keeper of the same user took first (two trainers started at once)
    to its own trainer, which refuses the same way, and then it exits."""

    pid: int
    #: ``pid`` is the holding keeper's own, not its trainer's: sent by a keeper that lost the race
    #: for the name to its own trainer when the winner named no live trainer (it lingers, or is of
    #: an older version). A default: no protocol bump.
    pid_is_keeper: bool = False


for _op, _cls in (("closed", Closed), ("adopt", Adopt), ("image?", ImageQuery), ("image", Image),
                  ("keeper-failed", KeeperFailed), ("keeper-busy", KeeperBusy), ("persist", PersistHeld),
                  ("persisted", Persisted), ("replica-setup", ReplicaSetup)):
    register_message(_op, _cls)
