"""``Checkpointer``: numbered steps in one directory, retention, latest, for training loops."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from zerostall.advice import (
    Advice,
    FailureMix,
    MeasuredCosts,
    Model,
    ReplicaCost,
    SaveKind,
    advise,
)
from zerostall.api import PYTREE, check_writer_reaches, hint_held_in_memory, hint_item_layout, load_newest_valid
from zerostall.budget import HostLimit, check_limit
from zerostall.cadence import Cadence
from zerostall.commit import check_reachable, committed_steps, delete_checkpoint, parse_step, step_name
from zerostall.distributed import DistContext, active, agree_step, agree_steps, load
from zerostall.engine import Engine
from zerostall.errors import (
    AdviceError,
    ArgumentTypeError,
    BackgroundSaveError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    KeeperPersistError,
    MissingKeyError,
    NoValidCheckpointError,
    ReadOnlyError,
    StorageError,
    WriterError,
    ZerostallError,
)
from zerostall.format.manifest import MANIFEST_NAME
from zerostall.options import DistributedOptions, LoadOptions, MemoryTier, RetentionPolicy, SaveOptions
from zerostall.persist.gc import collect_at_start
from zerostall.preempt import GRACE_S, Preemption, check_grace, check_signals
from zerostall.response import Response, SaveStats
from zerostall.restore import read_manifest, verify_checkpoint
from zerostall.restore.sources import Loaded, load_first
from zerostall.storage import Storage, local_path, open_storage
from zerostall.validate import (
    check_bool,
    check_callable,
    check_choice,
    check_instance,
    check_items,
    check_number,
    check_optional_int,
    check_path,
    check_step,
    clean_metadata,
)

if TYPE_CHECKING:  # the memory tier is imported only by a Checkpointer that has one
    from zerostall.memtier.keeperfail import UnadoptableKeeper
    from zerostall.memtier.tier import MemorySide

__all__ = ["Checkpointer"]

log = logging.getLogger("zerostall")

#: how long opening a Checkpointer waits for its writer to say hello (a slower start is not an error)
_WRITER_READY_TIMEOUT_S = 60.0


class Checkpointer:
    """Save and restore numbered steps under ``directory`` (``step_00000100/`` ...).

    Args:
        directory: a local path or storage URL; created if needed.
        keep_last: keep this many newest steps (``None``: keep all). Older ones are deleted by
            the writer only after a newer step has committed.
        keep_every_n_steps: also keep every step divisible by this, whatever ``keep_last`` says.
        save_interval_steps: :meth:`should_save` is true every this many steps (default: every step).
        save_options / load_options: see :class:`SaveOptions` and :class:`LoadOptions`.
        process_group: under ``torch.distributed``, the group whose ranks save and load together
            (default: the world); shorthand for ``distributed=DistributedOptions(process_group=...)``
            in both option sets. Saves and loads are collective whenever torch.distributed is
            initialized: every rank calls them with the same step (docs/distributed.md).
        on_error: called with a :class:`~zerostall.errors.BackgroundSaveError` for each save that
            fails in the background, instead of raising it later (for loops that log and go
            on). Runs on the writer's listener thread as the failure arrives: keep it short.
        read_only: only list and load: no writer is started, the directory is not created, and
            ``save_*`` / :meth:`prepare` raise :class:`~zerostall.errors.ReadOnlyError`.
        memory_tier: checkpoint every save into this host's memory and persist only some (see
            :class:`MemoryTier`); a restarted trainer of the same directory and rank on this host
            then restores the newest step from memory. Needs the process writer. With
            ``MemoryTier(replicas=k)`` each rank's newest memory step is also held by keepers on
            k other hosts, and a restart after a node loss resumes from memory (construction is
            then collective: every rank constructs its Checkpointer).
        save_interval: ``"auto"``: :meth:`should_save` follows the interval advisor
            (:meth:`advice`; docs/advice.md): a warm-up that measures what saves cost this job,
            then the interval that minimises the expected time lost for ``mtbf_s``, recomputed
            as the measured costs drift. Excludes ``save_interval_steps``.
        mtbf_s: the job's mean time between failures in seconds (the whole job's: a node's MTBF
            over the number of nodes); needed by ``save_interval="auto"``, the default of
            :meth:`advice`.
        costs: with ``save_interval="auto"``, use these costs (a :class:`~zerostall.advice.MeasuredCosts`,
            say a previous run's ``advice().costs``) instead of measuring them: no warm-up, the
            interval is fixed by them and ``mtbf_s``.
        preemption_signals: signals that announce a preemption (``(signal.SIGTERM,)``: what
            Kubernetes, Slurm and torchrun send before they kill). On one, the newest step only
            this host's memory holds is persisted at once, and :meth:`should_save` is true at one
            final step, the same on every rank, whose save is persisted; then :attr:`preempted`
            is true and the loop should stop. Off by default: a library does not take over a
            process's signals unasked. The handlers are installed here (create the Checkpointer
            on the main thread), chain to the ones installed before (a default action, which would
            end the process before the final save, is not chained) and are restored by
            :meth:`close`. Under torch.distributed, create it after ``init_process_group``; the
            ranks agree through the job's store (docs/design.md, "Preemption").
        preemption_grace_s: the time a preemption leaves between its notice and the kill, 20 s by
            default (torchrun's is 30 s: ``--shutdown-timeout`` or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``;
            Kubernetes' ``terminationGracePeriodSeconds``, 30 s by default). Every wait a notice adds
            ends within it, not within ``DistributedOptions.timeout_s``: the ranks' agreement and its
            exchanges within half of it, the immediate persist and the final save's wait for the
            other ranks within all of it. Set it a few seconds below your scheduler's grace.
        host_memory_limit: bytes of this rank's host memory zerostall may hold (None: no limit):
            staging slots, the memory tier's held step, replicas kept for other ranks and their
            transfer (:mod:`zerostall.budget`; not the trainer's own tensors). From a per-host
            budget: the budget divided by the ranks on the host. Checked when the first save of a
            layout is planned, before any byte is staged (the state's size is known only then):
            a state whose staging slot does not fit is saved in pieces that do (synchronously:
            the save call returns once the last piece is handed over; ``SaveStats.limit_wait_s``);
            a memory tier whose parts do not fit raises ``HostMemoryLimitError`` (docs/guarantees.md,
            "Host memory limit").

    Raises:
        ValueError: an argument is out of range (:class:`~zerostall.errors.InvalidArgumentError`,
            naming it) or of the wrong type (:class:`~zerostall.errors.ArgumentTypeError`, also a
            ``TypeError``: ``keep_last=2.5``).
        StorageError: the location cannot be reached, created or written (a missing bucket,
            refused credentials, an unreachable endpoint, a regular file in the way, ...);
            ``errno`` and ``path`` say which. Raised here, not at the first save.
        CheckpointNotFoundError: ``read_only`` and the local directory does not exist.
        HostMemoryLimitError: ``host_memory_limit`` is below what any state needs (one piece
            buffer; with the memory tier, its slots and the replicas' transfer).

    The writer process starts here and the constructor returns once it is up (~0.3 s), so no
    save waits for it. Partial saves left by writers that are provably gone, on any host, are removed here
    (:mod:`zerostall.persist.gc`; ``gc_report`` says what was removed and what was kept for live
    writers).
    Saves are unconditional: call :meth:`should_save` to follow the interval. Use as a context
    manager; leaving it waits for in-flight saves.

    **Errors from background saves.** A save that fails after ``save_*_async`` returned is
    raised by its response's ``result()``. If that never happens, the next ``save_*``,
    :meth:`wait`, :meth:`close` or the end of the ``with`` block raises
    :class:`~zerostall.errors.BackgroundSaveError` naming the step and the cause (once per
    failure; a ``with`` block that is already raising keeps its own exception and the failure
    is logged). ``on_error`` receives them instead. See docs/guarantees.md.
    With a memory tier, a failed persist of the keeper (of a step only memory held, after a
    crash) is logged at WARNING and listed in :attr:`keeper_failures`, not raised; :meth:`wait`
    and :meth:`close` raise the failure of the persist they asked for themselves.

    Example::

        >>> with zerostall.Checkpointer("/tmp/run1", keep_last=3) as ckpt:    # doctest: +SKIP
        ...     start = ckpt.latest_step() or 0
        ...     if start:
        ...         ckpt.load_pytree(template={"model": model, "optim": optim})
        ...     for step in range(start + 1, 1001):
        ...         train_step()
        ...         if ckpt.should_save(step):
        ...             ckpt.save_pytree_async(step, {"model": model, "optim": optim})
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every_n_steps: int | None = None,
        save_interval_steps: int | None = None,
        save_options: SaveOptions | None = None,
        load_options: LoadOptions | None = None,
        process_group: Any = None,
        on_error: Callable[[BackgroundSaveError], None] | None = None,
        read_only: bool = False,
        memory_tier: MemoryTier | None = None,
        save_interval: Literal["auto"] | None = None,
        mtbf_s: float | None = None,
        costs: MeasuredCosts | None = None,
        preemption_signals: tuple[int, ...] | None = None,
        preemption_grace_s: float = GRACE_S,
        host_memory_limit: int | None = None,
    ) -> None:
        directory = _check_args(directory, keep_last=keep_last, keep_every_n_steps=keep_every_n_steps,
                                save_interval_steps=save_interval_steps, save_options=save_options,
                                load_options=load_options, on_error=on_error, read_only=read_only)
        _check_cadence_args(memory_tier=memory_tier, save_interval=save_interval,
                            save_interval_steps=save_interval_steps, mtbf_s=mtbf_s, costs=costs)
        limit = check_limit(host_memory_limit, path=directory)
        signals = check_signals(preemption_signals, path=directory)
        grace_s = check_grace(preemption_grace_s, path=directory)
        if signals and read_only:
            raise InvalidArgumentError("preemption_signals needs a Checkpointer that saves (read_only=False)",
                                       argument="preemption_signals", path=directory)
        if not read_only:
            check_writer_reaches(directory, save_options)
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every_n_steps=keep_every_n_steps)
        local = local_path(directory)
        self.directory = local if local is not None else directory
        self.read_only = bool(read_only)
        self.save_interval_steps = save_interval_steps
        self.memory_tier = memory_tier
        if process_group is not None:
            so, lo = save_options or SaveOptions(), load_options or LoadOptions()
            save_options = dataclasses.replace(so, distributed=dataclasses.replace(
                so.distributed or DistributedOptions(), process_group=process_group))
            load_options = dataclasses.replace(lo, distributed=dataclasses.replace(
                lo.distributed or DistributedOptions(), process_group=process_group))
        self.load_options = load_options
        so = save_options or SaveOptions()
        #: host_memory_limit and what fills it (zerostall.budget); None: no limit
        self.host_limit = None if limit is None or self.read_only else HostLimit(
            limit, max_in_flight=so.max_in_flight, held_slots=1 if memory_tier is not None else 0,
            replicas=memory_tier.replicas if memory_tier is not None else 0,
            in_place=memory_tier.replicas_in_place if memory_tier is not None else False)
        if self.host_limit is not None:
            self.host_limit.check_fixed(directory)
        self._save_dist = so.distributed
        self._cadence = Cadence(save_interval, save_interval_steps, mtbf_s, costs, so.max_in_flight,
                                memory_tier=memory_tier is not None,
                                replicas=memory_tier.replicas if memory_tier is not None else 0)
        self._last_persist = time.monotonic()
        self._committed: deque[Response] = deque(maxlen=100)
        #: the step the last successful ``load_*`` read (with ``fallback=True``, the one it fell back to)
        self.last_loaded_step: int | None = None
        # The parts, built in order, each undone by one unwind if a later one fails; held once all are.
        with contextlib.ExitStack() as unwind:
            keeper = None
            if memory_tier is not None:
                from zerostall.memtier.tier import MemorySide

                writer, keeper = MemorySide.writer_for(self.directory, memory_tier, so, read_only=self.read_only)
            else:
                writer = None
            # The writer starts first: its interpreter boots while the storage is probed below.
            if writer is not None and self.host_limit is not None:  # the keeper's own count of the slots it holds
                self.host_limit = dataclasses.replace(self.host_limit, held_slots=writer.held_slots)
            engine = Engine(so, prewarm=not self.read_only, coordinator=DistContext(so.distributed), writer=writer,
                            host_limit=self.host_limit)
            unwind.callback(engine.close)
            engine.on_error = on_error
            storage = open_storage(self.directory)
            check_reachable(storage, write=not self.read_only, path=self.directory)
            if self.read_only and local is not None and not os.path.isdir(local):
                raise CheckpointNotFoundError("no such directory (read_only=True does not create it)",
                                              path=self.directory)
            _refuse_a_checkpoint_as_run(storage, self.directory)
            # Partial saves whose writers are provably gone, on any host (docs/guarantees.md#no-orphans).
            self.gc_report = collect_at_start(storage) if not self.read_only else None
            # Wait for the writer's hello so that no save waits for the writer to boot (the first
            # save's slot is released only once the writer has written it). Raises when our keeper
            # found the memory tier held by another trainer's (KeeperBusy).
            ready = engine.writer_ready(_WRITER_READY_TIMEOUT_S)
            memory = None
            if keeper is not None:
                assert memory_tier is not None
                memory = MemorySide(engine, keeper, storage, self.directory, self.load_options,
                                    self._dist_options(), markers_due=not self.read_only)
                if (memory_tier.replicas > 0 or memory_tier.parity) and not self.read_only:
                    # collective: every rank constructs its Checkpointer
                    memory.setup_replicas(memory_tier.replicas, keeper.keeper.instance,
                                          (so.distributed or DistributedOptions()).timeout_s,
                                          in_place=memory_tier.replicas_in_place, parity=bool(memory_tier.parity),
                                          parity_group=memory_tier.parity_group)
                if ready:
                    memory.take_markers()
                memory.warn_unadoptable(stacklevel=2)  # an error under filterwarnings("error") too
            preemption = None
            if signals:
                preemption = Preemption(
                    signals, path=self.directory, dist=so.distributed, grace_s=grace_s,
                    idle=engine.idle if keeper is not None else None,
                    held=(lambda: keeper.memory_only_step) if keeper is not None else None,
                    persist=(lambda bound_s, sent: keeper.persist_held(bound_s, sent=sent, bound_s=bound_s))
                    if keeper is not None else None)
            unwind.pop_all()
        self._engine, self._storage = engine, storage
        #: the memory tier's side in this trainer (None: no memory tier)
        self._memory: MemorySide | None = memory
        self._preemption: Preemption | None = preemption
        if memory is not None:
            memory.start_premap()

    # -- saving ------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether ``step`` falls on the save interval.

        A pure function of ``step`` and ``save_interval_steps`` (no storage, no collective), so
        every rank passing the same step gets the same answer; under torch.distributed the
        starting step comes from the collective :meth:`latest_step`.

        Call it once per step, after the step: it also times the steps for :meth:`advice`.
        With ``save_interval="auto"`` the answer follows the advisor (a warm-up that measures,
        then the advised interval; a due save waits while ``max_in_flight`` saves are in
        flight); under torch.distributed it is then rank 0's answer, broadcast to the group at
        every call, so every rank must call it at every step.
        """
        step = check_step(step, path=self.directory)  # a str step would fail deep inside (str % int)
        if self._cadence.auto is not None:
            due = self._should_save_auto(step)
        else:
            self._cadence.observe_step(step)
            due = self.save_interval_steps is None or step % self.save_interval_steps == 0
        final = self._preemption is not None and self._preemption.observe(step)
        return due or final

    @property
    def preempted(self) -> bool:
        """Whether a preemption signal arrived and :meth:`should_save` has answered true for the
        final step: save it, then stop the loop (``preemption_signals``)."""
        return self._preemption is not None and self._preemption.preempted

    def prepare(self, items: dict[str, Any] | None = None, *, tree: Any = None) -> int:
        """Allocate the staging buffers for this state's layout now, so the first save only copies.

        Pass the same ``items`` (or ``tree=`` for ``save_pytree``) you will save, once it has its
        final layout (optimizers create their state at their first step). Returns the bytes
        allocated per in-flight slot times ``max_in_flight``. Optional: without it the first
        save allocates.
        """
        if (items is None) == (tree is None):
            raise InvalidArgumentError("pass exactly one of items or tree=", argument="items", path=self.directory)
        self._check_writable(None)
        self._check_open(None)
        if items is not None:
            check_items(items, self.directory)
        return self._engine.prepare(dict(items) if items is not None else {PYTREE: tree})

    def save_checkpointables_async(self, step: int, items: dict[str, Any], *,
                                   metadata: dict[str, Any] | None = None) -> Response:
        """Stage ``items`` as ``step`` and return; commit (and retention) follow in the background.

        Raises:
            ValueError: ``step`` is not a non-negative int.
            BackgroundSaveError: an earlier save failed in the background and nobody received
                its error (see the class docstring); nothing was saved by this call.
            ReadOnlyError: the Checkpointer was opened with ``read_only=True``.
            The errors of :func:`zerostall.save_checkpointables_async` (``step`` exists: ``CheckpointExistsError``).
        """
        step = check_step(step, path=self.directory)
        check_items(items, self._step_path(step))
        self._check_writable(step)
        self._check_open(step)
        meta = dict(clean_metadata(metadata, reserved=RESERVED_METADATA_KEYS, path=self._step_path(step)), step=step)
        t_start = self._cadence.clock()
        persist = True
        # the final save after a preemption notice waits for the other ranks only as long as the notice leaves
        bound = self._preemption.time_left() if self._preemption is not None and self._preemption.is_final(step) \
            else None
        # the immediate persist after a preemption signal never runs while a save is handed over
        with self._preemption.saving() if self._preemption is not None else contextlib.nullcontext():
            if self.memory_tier is not None:
                mem = self._memory
                assert mem is not None
                if mem.markers_due and self._engine.writer_ready(0):
                    mem.take_markers()  # our keeper's Hello came after the constructor stopped waiting
                mem.warn_unadoptable(stacklevel=2)  # a keeper started after the constructor (the last one died)
                mem.drop_premap()  # the keeper lets go of the step it held once this one is in memory
                persist = self._persists(step)
                r = self._engine.save_async(self.directory, step_name(step), dict(items), metadata=meta, step=step,
                                            retention=self.retention, memory=True, persist=persist, timeout_s=bound)
                if persist:
                    self._last_persist = time.monotonic()
            else:
                r = self._engine.save_async(self.directory, step_name(step), dict(items), metadata=meta, step=step,
                                            retention=self.retention, timeout_s=bound)
        self._cadence.started()
        r._add_before_done(self._record)
        r._add_before_done(lambda resp, exc: self._cadence.durable(step, t_start, resp, exc, persisted=persist))
        return r

    def save_checkpointables(self, step: int, items: dict[str, Any], *, metadata: dict[str, Any] | None = None) -> None:
        self.save_checkpointables_async(step, items, metadata=metadata).result()

    def save_pytree_async(self, step: int, tree: Any, *, metadata: dict[str, Any] | None = None) -> Response:
        return self.save_checkpointables_async(step, {PYTREE: tree}, metadata=metadata)

    def save_pytree(self, step: int, tree: Any, *, metadata: dict[str, Any] | None = None) -> None:
        self.save_pytree_async(step, tree, metadata=metadata).result()

    def _persists(self, step: int) -> bool:
        """Whether a memory-tier save of ``step`` also goes to storage."""
        mt = self.memory_tier
        assert mt is not None
        if self._preemption is not None and self._preemption.is_final(step):  # the save before stopping
            return True
        if self._cadence.auto is not None:  # save_interval="auto": the advisor chose the kind
            return self._cadence.persist_at(step)
        if step % mt.persist_interval_steps == 0:
            return True
        if mt.persist_interval_s is None:
            return False
        dopts = self._engine.options.distributed
        if active(dopts):
            raise InvalidArgumentError("MemoryTier(persist_interval_s=...) cannot be used under torch.distributed: "
                                       "the ranks must agree on which saves persist; use persist_interval_steps",
                                       argument="memory_tier", path=self.directory)
        return time.monotonic() - self._last_persist >= mt.persist_interval_s

    def _record(self, r: Response, exc: BaseException | None) -> None:
        if exc is None:
            self._committed.append(r)

    def stats(self) -> list[SaveStats]:
        """Statistics of the most recent committed saves (up to 100), oldest first."""
        # Read when asked, not when recorded: a save can commit before its stall is set.
        return [r.stats for r in list(self._committed)]

    @property
    def keeper_failures(self) -> list[KeeperPersistError | UnadoptableKeeper]:
        """The memory tier's failed persists reported to this Checkpointer, oldest first.

        After a crash the keeper persists the newest memory-only step in the background; if that
        fails (storage full or read-only, the held bytes changed, a collective persist aborted or
        timed out), the trainer that adopts the keeper is told, or, when none did before the
        keeper exited, the next ``Checkpointer`` of this directory and rank reads the marker it
        left. Each failure is also logged at WARNING on the ``zerostall`` logger as it arrives.
        Nothing is raised: the step is still in memory for this trainer to resume from, but
        storage lacks it (a restart elsewhere gets an older step). See docs/guarantees.md,
        "When the keeper's persist fails".

        A keeper that serves this trainer but cannot be adopted after a crash (it could not bind
        its name, or another user's process holds it) is listed here too, as a record,
        :class:`~zerostall.memtier.keeperfail.UnadoptableKeeper` (``step`` None), and warned of with a
        :class:`~zerostall.errors.ZerostallWarning` instead of the log line (docs/guarantees.md,
        "A keeper that cannot be adopted").

        Example::

            ckpt = Checkpointer(directory, memory_tier=MemoryTier(persist_interval_steps=10))
            for err in ckpt.keeper_failures:
                print(err.step, err.path, type(err.cause).__name__, err.errno)
        """
        return list(self._memory.keeper.keeper_failures) if self._memory is not None else []

    # -- loading -----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (with a memory tier: storage's and the one this host's memory
        holds). In-flight and partial saves are never listed.

        Under torch.distributed this is collective (every rank must call it) and every rank gets
        the same answer: the steps committed in every rank's view (so a step only in memory counts
        only if every rank's memory holds it; with ``MemoryTier(replicas=...)``, if every rank's
        share of it is in its own keeper or in a holder's replica: one ``all_gather_object``).
        """
        local = committed_steps(self._storage)
        if self._memory is not None and self._memory.replicas is not None and active(self._dist_options()):
            # one collective: storage, every rank's memory and the replicas other keepers hold
            return self._memory.agreed_steps(local)
        mem = self.memory_step()
        if mem is not None and mem not in local:
            local = sorted([*local, mem])
        dopts = self._dist_options()
        return agree_steps(local, dopts) if active(dopts) else local

    def _dist_options(self) -> DistributedOptions | None:
        lo = self.load_options.distributed if self.load_options is not None else None
        return lo if lo is not None else self._save_dist

    def latest_step(self) -> int | None:
        """The newest committed step (in either tier), or None (under torch.distributed:
        collective, the same on every rank)."""
        s = self.steps()
        return s[-1] if s else None

    def memory_step(self) -> int | None:
        """The step this host's memory tier holds (None: no memory tier, or nothing held).

        Waits for the saves already handed to the writer to finish first.
        """
        return self._memory.memory_step() if self._memory is not None else None

    def _resolve(self, step: int | None) -> int:
        if step is not None:
            step = check_step(step, path=self.directory)
        if step is None:
            step = self.latest_step()  # collective under torch.distributed: every rank loads the same step
            if step is None:
                raise CheckpointNotFoundError("no committed step to load", path=self.directory)
        return step

    def load_checkpointables(self, step: int | None = None, items: dict[str, Any] | None = None, *,
                             fallback: bool = False) -> dict[str, Any]:
        """Load ``step`` (default: latest committed); see :func:`zerostall.load_checkpointables`.

        ``fallback=True``: if that step is corrupt or gone, the next older committed step that
        loads instead, logged (WARNING, ``zerostall`` logger); :attr:`last_loaded_step` says which.

        Raises:
            CheckpointNotFoundError: no step is committed (or not ``step``).
            NoValidCheckpointError: ``fallback=True`` and no step from ``step`` down loads.
            The errors of :func:`zerostall.load_checkpointables`.
        """
        _check_load_step(step, self.directory, "load_checkpointables", "items")
        if fallback:
            name, out = load_newest_valid(self.directory, self._fallback_names(step), items, self.load_options)
            self.last_loaded_step = parse_step(name)
            return out
        resolved = self._resolve(step)
        # The sources in order: the memory tier's (this host's memory, then the peers'), then storage.
        sources = [*(self._memory.sources() if self._memory is not None else ()), _Storage(self)]
        try:
            got = load_first(sources, resolved, items, path=self._step_path(resolved))
        except CheckpointNotFoundError as exc:
            if step is None or active(self._dist_options()):
                raise
            raise hint_held_in_memory(_hint_steps(exc, self.steps()), self.directory, resolved) from exc
        self.last_loaded_step = got.step
        return got.tree

    def load_pytree(self, step: int | None = None, template: Any = None, *, fallback: bool = False) -> Any:
        """Load ``step`` (default: latest committed) into ``template`` in place, if given.

        ``fallback=True``: the newest step from ``step`` down that loads (see :meth:`load_checkpointables`).
        """
        _check_load_step(step, self.directory, "load_pytree", "template")
        try:
            return self.load_checkpointables(step, {PYTREE: template}, fallback=fallback)[PYTREE]
        except MissingKeyError as exc:
            hinted = hint_item_layout(exc, "", "")  # only the "no item 'pytree'" hint: no manifest read
            if hinted is exc:
                raise
            raise hinted from exc

    def _agreed_steps(self) -> list[int]:
        steps = self.steps()
        dopts = self.load_options.distributed if self.load_options is not None else None
        if active(dopts):  # every rank walks the steps rank 0 sees
            steps = agree_step(steps, dopts)
        return list(steps)

    def _fallback_names(self, step: int | None) -> list[str]:
        steps = self._agreed_steps()
        if step is None:
            return [step_name(s) for s in reversed(steps)]
        return [step_name(step), *(step_name(s) for s in reversed(steps) if s < step)]

    def latest_valid_step(self) -> int | None:
        """The newest committed step whose every file and leaf checksum verifies, or None if none is committed.

        Reads every byte of each step it checks (newest first, stopping at the first good one);
        each step skipped is logged (WARNING, ``zerostall`` logger) with what is wrong with it.
        Under torch.distributed, rank 0 verifies and every rank gets its answer.

        Raises:
            NoValidCheckpointError: steps are committed but none verifies (the message names each
                step and its first problem).

        Example::

            >>> step = ckpt.latest_valid_step()                                # doctest: +SKIP
            >>> if step is not None:                                           # doctest: +SKIP
            ...     ckpt.load_pytree(step, template=state)
        """
        dopts = self.load_options.distributed if self.load_options is not None else None
        if active(dopts):
            import torch.distributed as dist

            group = dopts.process_group if dopts is not None else None
            steps = self.steps()  # collective: every rank calls it, rank 0 verifies what all see
            answer = self._verify_newest_first(steps) if dist.get_rank(group) == 0 else None
            agreed: tuple[int | None, list[str]] = agree_step(answer, dopts)
            step, failures = agreed
        else:
            step, failures = self._verify_newest_first(self.steps())
        if step is None and failures:
            raise NoValidCheckpointError(f"no committed step verifies ({len(failures)} checked, newest first: "
                                         f"{'; '.join(failures)})", path=self.directory)
        return step

    def _verify_newest_first(self, steps: list[int]) -> tuple[int | None, list[str]]:
        failures: list[str] = []
        for s in reversed(steps):
            path = f"{self.directory.rstrip('/')}/{step_name(s)}"
            try:
                report = verify_checkpoint(path)
                problem = None if report.ok else f"{len(report.problems)} problem(s), first: {report.problems[0]}"
            except ZerostallError as exc:  # manifest gone or malformed
                problem = f"{type(exc).__name__}: {exc}"
            if problem is None:
                return s, failures
            failures.append(f"step {s}: {problem}")
            log.warning("latest_valid_step: step %d of %s does not verify: %s", s, self.directory, problem)
        return None, failures

    # -- lifecycle ---------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Block until every in-flight save has committed or failed.

        With a memory tier, also until the newest step saved is on storage: if only this host's
        memory holds it (a memory-only save, ``MemoryTier.persist_interval_steps``), the keeper
        persists it now, and goes on serving this trainer (later saves go to memory as before).
        Under torch.distributed that persist is collective, as at :meth:`close`: every rank
        calls ``wait()``.

        Args:
            timeout: return after about this many seconds even if saves (or the keeper's
                persist) have not finished; nothing is raised for them then.

        Raises:
            BackgroundSaveError: a save failed in the background and its response never raised
                it (unless ``on_error`` took it); names the step and the cause.
            KeeperPersistError: with a memory tier, the keeper could not persist the step only its
                memory holds (``step`` names it, ``cause`` says why); the step is still in memory,
                and :meth:`close` tries again (a collective step's persist is tried once).
            KeeperLostError: with a memory tier, the keeper ended before that step reached
                storage: the step is lost.
        """
        if timeout is not None:
            check_number("timeout", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._engine.wait(timeout)
        self._engine.raise_failures()
        if self._memory is not None and not self.read_only and not self._engine.closed and self._engine.idle():
            self._memory.keeper.persist_held(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Wait for in-flight saves, then stop the writer and free the buffers.

        Raises:
            BackgroundSaveError: as :meth:`wait` (the writer is stopped all the same).
            KeeperPersistError: with a memory tier, the keeper could not persist the step only its
                memory held (storage full, say); the keeper has exited, so that step is lost.
                It is also in :attr:`keeper_failures`.
        """
        if self._preemption is not None:
            self._preemption.close()
        memory = self._memory
        told = len(memory.keeper.close_failures) if memory is not None else 0
        if memory is not None:
            memory.drop_premap()
        self._engine.close()
        self._engine.raise_failures()
        lost = memory.keeper.close_failures[told:] if memory is not None else []
        if lost:  # the persist this close asked for failed: the keeper exits, the step with it
            raise lost[-1]

    @property
    def keep_last(self) -> int | None:
        return self.retention.keep_last

    @property
    def keep_every_n_steps(self) -> int | None:
        return self.retention.keep_every_n_steps

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None and self.memory_tier is not None and not self._engine.closed:
            # Leaving on an error (torchrun's SIGTERM included) is a crash to the memory tier: the
            # keeper keeps the newest step for a restart instead of persisting it and exiting.
            self._engine.wait()
            self._engine.writer.abandon()
        if exc_type is None:
            self.close()  # raises an unreceived background failure
            return
        try:
            self.close()
        except BackgroundSaveError as err:
            # The block is already raising: its exception is kept; the failure is logged.
            log.error("zerostall: %s (not raised: the with block raised %s)", err, exc_type.__name__)

    def _check_writable(self, step: int | None) -> None:
        if self.read_only:
            raise ReadOnlyError("this Checkpointer was opened with read_only=True; it does not save or delete "
                                "(it lists and loads)",
                                errno=errno.EROFS, path=self.directory if step is None
                                else f"{self.directory.rstrip('/')}/{step_name(step)}")

    def _check_open(self, step: int | None) -> None:
        """A save after close() (or after its with block) names the directory and what to do; the
        engine's own "this saver is closed" named neither."""
        if self._engine.closed:
            raise WriterError("this Checkpointer is closed (by close() or the end of its with block) and no "
                              "longer saves; create a new zerostall.Checkpointer for this directory to save "
                              "again (loading and listing still work)",
                              path=self.directory if step is None else self._step_path(step))

    # -- metadata and deletion -----------------------------------------------------------------

    def _step_path(self, step: int) -> str:
        return f"{self.directory.rstrip('/')}/{step_name(step)}"

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The ``metadata=`` saved with ``step`` (default: the latest committed), ``"step"`` included.

        Reads the manifest only (no array data). Not collective: any rank may call it alone
        (with ``step=None`` it lists this rank's view of the storage, not the agreed one).

        Raises:
            CheckpointNotFoundError: no step is committed (or not ``step``).
            InvalidArgumentError: ``step`` is not a non-negative int.
            CorruptCheckpointError, UnsupportedFormatError, StorageError: as a load.

        Example::

            >>> ckpt.save_pytree(100, state, metadata={"loss": 0.25})    # doctest: +SKIP
            >>> ckpt.metadata(100)                                       # doctest: +SKIP
            {'loss': 0.25, 'step': 100}
        """
        mem = self._memory.memory_metadata() if self._memory is not None else None
        if step is None:
            steps = committed_steps(self._storage) + ([mem[0]] if mem is not None else [])
            if not steps:
                raise CheckpointNotFoundError("no committed step", path=self.directory)
            step = max(steps)
        step = check_step(step, path=self.directory)
        if mem is not None and mem[0] == step:
            return mem[1]
        try:
            return dict(read_manifest(self._storage, step_name(step), path=self._step_path(step)).metadata)
        except CheckpointNotFoundError as exc:
            raise _hint_steps(exc, committed_steps(self._storage)) from exc

    def delete(self, step: int) -> None:
        """Delete the committed ``step``: it stops being listed at once, then its files are removed.

        Not collective: under torch.distributed call it on one rank (the storage is shared),
        then make the others wait (a barrier) before they list steps. A save of ``step`` that
        is still in flight is not a committed step: wait for it first. The step this host's
        memory tier holds cannot be deleted (it would stay listed and loadable from memory);
        the next save replaces it.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed here.
            InvalidArgumentError: ``step`` is not a non-negative int.
            ReadOnlyError: the Checkpointer was opened with ``read_only=True``.
            InvalidArgumentError: the memory tier holds ``step``.
            StorageError: the storage failed (the step is then either whole or no longer listed).

        Example::

            >>> ckpt.delete(100)        # doctest: +SKIP
        """
        step = check_step(step, path=self.directory)
        self._check_writable(step)
        path = self._step_path(step)
        if self.memory_tier is not None and self.memory_step() == step:
            raise InvalidArgumentError("this host's memory tier holds this step; it cannot be deleted until a newer "
                                       "step replaces it", argument="step", path=path)
        if step not in committed_steps(self._storage):
            if self._engine.in_flight(path):  # "no committed step" for the step just saved would puzzle
                raise CheckpointNotFoundError("no committed step to delete: its save is still in flight; wait for it "
                                              "(response.result() or ckpt.wait()), then delete", path=path)
            raise CheckpointNotFoundError("no committed step to delete", path=path)
        try:
            delete_checkpoint(self._storage, step_name(step))
        except OSError as exc:
            raise StorageError(f"cannot delete: {exc.strerror or exc}", errno=exc.errno, path=path) from exc
        log.info("zerostall: deleted %s", path)


    # -- the interval advisor ------------------------------------------------------------------

    def advice(self, mtbf_s: float | None = None, *, costs: MeasuredCosts | None = None,
               model: Model | None = None, memory_fraction: float | None = None,
               failure_mix: FailureMix | None = None) -> Advice:
        """How often this job should save, and what that is expected to cost (docs/advice.md).

        Works from the costs measured on this Checkpointer: the iteration time between
        :meth:`should_save` calls with no save in flight, and per save the time the training
        thread was blocked (``SaveStats.stall_s``), the time until it was committed, and the
        training lost while it persisted (the slowdown of the iterations it overlapped). Call
        :meth:`should_save` once per step (after the step), whatever the interval, so the steps
        are timed.

        Args:
            mtbf_s: the job's mean time between failures (default: the constructor's ``mtbf_s``).
            costs: use these instead of the measured (or constructor-given) costs.
            model: ``None`` picks Daly's, or the two-level model once memory-only saves of the
                memory tier are measured; ``Model.YOUNG`` for the first-order one.
            memory_fraction: with the memory tier and no replicas, the share of failures a
                restart on the same hosts recovers from memory (docs/advice.md); shorthand for
                ``failure_mix=FailureMix(crash=p, node_loss=1 - p)``.
            failure_mix: the shares of process crashes and node losses (default
                :data:`~zerostall.advice.DEFAULT_FAILURE_MIX`); give this one, not
                ``memory_fraction``, with ``MemoryTier(replicas=...)``.

        With ``MemoryTier(replicas=r)`` the advice has three tiers (memory, peer, storage) and
        ``replicas=r``. The measured memory-only saves already include the replication (their
        ``result()`` returns once the replicas hold them), so the measured costs' replica
        (``costs.replica``) costs no extra time and takes ``host_bytes`` = twice the bytes this
        rank's newest save staged (a holder keeps the newest replica and the buffers the next one
        arrives into); given costs whose ``replica`` lacks ``host_bytes`` get the same.

        Returns:
            The frozen :class:`~zerostall.advice.Advice`: ``interval_steps``, ``interval_s``,
            ``overhead``, ``save_overhead``, ``work_lost_s`` and the ``costs`` used.

        Raises:
            AdviceError: no ``mtbf_s`` (key ``mtbf_s``), or not enough measured yet: at least 8
                steps with no save in flight and 3 saves whose persisting the steps covered (key
                ``costs``).

        Example::

            >>> a = ckpt.advice(mtbf_s=3 * 3600)        # doctest: +SKIP
            >>> a.interval_steps, a.summary()           # doctest: +SKIP
            (21, 'save every 21 steps (212 s); expected overhead 7.77%, ...')
        """
        m = mtbf_s if mtbf_s is not None else self._cadence.mtbf_s
        if m is None:
            raise AdviceError("advice() needs mtbf_s (here or in Checkpointer(mtbf_s=...))", key="mtbf_s",
                              path=self.directory)
        c = costs if costs is not None else self._cadence.costs()
        if c is None:
            est = self._cadence.estimator
            raise AdviceError(
                f"not enough measured yet to advise: {est.saves_observed()} save(s) observed, iteration time "
                f"{'unknown' if est.step_s() is None else f'{est.step_s():.3g} s'}; call should_save(step) "
                "after every step and save a few times (at least 8 steps without a save in flight and 3 "
                "saves covered by later steps)", key="costs", path=self.directory)
        replicas = self.memory_tier.replicas if self.memory_tier is not None else 0
        if replicas:
            c = self._with_replica_bytes(c, measured=costs is None and self._cadence.fixed is None)
        return advise(c, mtbf_s=m, model=model, memory_fraction=memory_fraction, failure_mix=failure_mix,
                      replicas=replicas)

    def _with_replica_bytes(self, c: MeasuredCosts, *, measured: bool) -> MeasuredCosts:
        """``c`` with its replica's ``host_bytes`` from this rank's newest save (a holder keeps two
        copies of the bytes a save stages: the newest replica, and the buffers of the one it
        replaced, which the next arrives into; one with ``replicas_in_place``). Measured costs
        without a replica get one that costs no time: the measured memory-only saves returned
        once the replicas held them."""
        assert self.memory_tier is not None
        copies = 1 if self.memory_tier.replicas_in_place else 2
        newest = copies * self._committed[-1].stats.nbytes if self._committed else None
        if c.replica is None:
            return dataclasses.replace(c, replica=ReplicaCost(host_bytes=newest)) if measured else c
        if c.replica.host_bytes is None and newest is not None:
            return dataclasses.replace(c, replica=dataclasses.replace(c.replica, host_bytes=newest))
        return c

    def _should_save_auto(self, step: int) -> bool:
        kind = self._cadence.decide(step)
        dopts = self._save_dist
        if active(dopts):
            # Every rank must save the same steps (and persist the same ones): rank 0's
            # measurements decide (one broadcast per call).
            got = agree_step(kind.value if kind is not None else None, dopts)
            kind = SaveKind(got) if got is not None else None
        self._cadence.decided = (step, kind)
        return kind is not None


class _Storage:
    """The last source of a Checkpointer's load: its directory on storage (collectively under
    torch.distributed)."""

    name = "storage"

    def __init__(self, ckpt: Checkpointer) -> None:
        self._ckpt = ckpt

    def load(self, step: int, items: dict[str, Any] | None) -> Loaded:
        ck = self._ckpt
        return Loaded(step, load(ck.directory, step_name(step), items, ck.load_options))


#: metadata keys a Checkpointer writes itself; ``metadata=`` may not set them
RESERVED_METADATA_KEYS = ("step",)


def _check_args(directory: object, *, keep_last: object, keep_every_n_steps: object, save_interval_steps: object,
                save_options: object, load_options: object, on_error: object, read_only: object) -> str:
    """Type and range checks of the constructor's arguments, before anything starts."""
    path = check_path(directory, "directory")
    check_optional_int("keep_last", keep_last, lo=1, path=path)
    check_optional_int("keep_every_n_steps", keep_every_n_steps, lo=1, path=path)
    check_optional_int("save_interval_steps", save_interval_steps, lo=1, path=path)
    check_instance("save_options", save_options, SaveOptions)
    check_instance("load_options", load_options, LoadOptions)
    check_callable("on_error", on_error)
    check_bool("read_only", read_only, path=path)
    return path


def _check_cadence_args(*, memory_tier: object, save_interval: object, save_interval_steps: object,
                        mtbf_s: object, costs: object) -> None:
    """The memory-tier and save-interval arguments, typed (``Cadence`` checks how they combine)."""
    check_instance("memory_tier", memory_tier, MemoryTier)
    if save_interval is not None:
        check_choice("save_interval", save_interval, ("auto",))
        if save_interval_steps is not None:
            raise InvalidArgumentError("pass save_interval='auto' or save_interval_steps, not both",
                                       argument="save_interval")
    if mtbf_s is not None:
        check_number("mtbf_s", mtbf_s, positive=True)
    check_instance("costs", costs, MeasuredCosts)


# -- common mistakes, refused with what to do -------------------------------------------------


def _check_load_step(step: object, directory: str, method: str, what: str) -> None:
    """``ckpt.load_pytree(state)``: the template passed where the step goes. Say so, not only
    that a step must be an int."""
    if step is None:
        return
    try:
        check_step(step, path=directory)
    except ArgumentTypeError as exc:
        raise ArgumentTypeError(f"{exc.message}: the first argument of {method} is the step to load (None: the "
                                f"latest); pass the {what} by keyword: ckpt.{method}({what}=...)",
                                path=directory, argument="step") from None


def _hint_steps(exc: CheckpointNotFoundError, steps: list[int]) -> CheckpointNotFoundError:
    """A step that is not committed: name the ones that are (or say there are none)."""
    held = ", ".join(map(str, steps[-10:])) if steps else "none"
    more = f" (the newest {min(len(steps), 10)} of {len(steps)})" if len(steps) > 10 else ""
    return CheckpointNotFoundError(f"{exc.message}; committed steps here: {held}{more}", path=exc.path, key=exc.key,
                                   rank=exc.rank)


def _refuse_a_checkpoint_as_run(storage: Storage, directory: str) -> None:
    """``Checkpointer("run/step_00000100")`` (or a ``save_pytree`` output) listed nothing, and its
    saves nested new ``step_*`` folders inside that committed checkpoint."""
    try:
        inside = storage.exists(MANIFEST_NAME)
    except OSError:
        return  # cannot tell: check_reachable / the first save reports the storage itself
    if inside:
        raise InvalidArgumentError(
            "this directory is itself a committed checkpoint (it holds manifest.json): a Checkpointer takes the run "
            "directory that holds step_* checkpoints (here, probably its parent); load this one with "
            "zerostall.load_pytree(path) or zerostall.load_checkpointables(path)", path=directory, argument="directory")
