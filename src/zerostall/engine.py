"""The save engine: flatten → plan → stage into a free buffer slot → hand off to the writer.

``Engine.save_async`` is the whole of what a save costs the training thread. Everything after
the hand-off (I/O, checksums, manifest, commit, retention) runs in the writer.

A collective save (torch.distributed) is the same save with a :class:`Coordinator`: the
engine asks it for this rank's part (:class:`~zerostall.messages.Collective`) and hands that to
the writer with the job. The engine knows nothing of torch.distributed; :mod:`zerostall.distributed`
provides the coordinator.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import functools
import logging
import operator
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from zerostall.budget import Fit, HostLimit
from zerostall.commit import exists_error
from zerostall.errors import BackgroundSaveError, StorageError, WriterError, ZerostallError
from zerostall.gcpause import paused_gc
from zerostall.messages import Collective, FileRow, LeafRow, SaveJob, WriteOptions, WriterStats
from zerostall.options import RetentionPolicy, SaveOptions, Staging
from zerostall.persist.client import OnDone, WriterClient
from zerostall.persist.job import storage_env
from zerostall.response import Response
from zerostall.stage import BufferPool, Plan, make_plan, stage
from zerostall.stage.buffers import Slot
from zerostall.stage.overlap import GUARD, Copier, OverlapTask, build_task, deferrable_any, sync_all
from zerostall.stage.pieces import fill_piece
from zerostall.stage.reuse import LayoutCache, Reused, layout_key
from zerostall.stage.stager import prepare_slot, staging_checksums
from zerostall.storage import Storage, open_storage, scheme_reference
from zerostall.storage.base import as_piece_writer
from zerostall.tree import FlatState, flatten, registry_generation

__all__ = ["Engine", "Coordinator"]

log = logging.getLogger("zerostall")
_PLAN_CACHE = 8
_KIND = operator.attrgetter("kind")


class Coordinator(Protocol):
    """How a save joins the saves of other ranks (implemented by :mod:`zerostall.distributed`).

    Every method runs on the training thread except the callback :meth:`on_done` returns.
    """

    def active(self) -> bool:
        """Whether saves act collectively right now (a process group exists and is enabled)."""

    @property
    def rank(self) -> int:
        """This process's rank in the saving group (valid once :meth:`active`)."""

    def begin(self, root_url: str, name: str, timeout_s: float | None = None) -> Collective:
        """Number this save and say who takes part; may run a collective at the first save.
        ``timeout_s`` bounds this save's waits for the other ranks below the usual one."""

    def abort(self, root_url: str, name: str, info: Collective, path: str, exc: BaseException) -> None:
        """This rank failed before handing the save off: tell the other ranks' writers at once."""

    def on_done(self, root_url: str, name: str, info: Collective, path: str, finish: OnDone) -> OnDone:
        """Wrap ``finish`` so that a local failure ends the same way on every rank."""


def _cuda_present() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA install means: do not pin
        return False


class Engine:
    """Owns the staging buffers, the plan cache and one writer; not shared across processes."""

    def __init__(self, options: SaveOptions | None = None, *, prewarm: bool = False,
                 coordinator: Coordinator | None = None, writer: WriterClient | None = None,
                 buffer_cache_bytes: int = 0, host_limit: HostLimit | None = None) -> None:
        self.options = options or SaveOptions()
        #: the writer this engine hands its saves to: given (the memory tier's, whose keeper is
        #: its side), or a plain one of ``options``
        self.writer = writer if writer is not None else WriterClient(
            self.options.writer, nice=self.options.writer_nice, sched=self.options.writer_sched)
        # A writer may keep slots after their saves are done (the memory tier's keeper holds the
        # newest in-memory step's until a newer one is in memory): that many more slots than in
        # flight, so a save never waits for a held one.
        # buffer_cache_bytes > 0 keeps buffers per layout (the free functions' shared engines).
        slots = self.options.max_in_flight + self.writer.held_slots
        self.pool = BufferPool(slots, pin=_cuda_present(), on_free=self.writer.forget,
                               cache_bytes=buffer_cache_bytes)
        #: Checkpointer(host_memory_limit=...): what the pool may hold (zerostall.budget)
        self.host_limit = host_limit
        #: the pool's shape under the limit and the largest data-file image it was checked for
        self._fit: Fit | None = None
        self._fit_bytes = 0
        self._plans: OrderedDict[tuple[object, ...], tuple[Plan, tuple[LeafRow, ...]]] = OrderedDict()
        #: the previous saves' work per layout, reused while it still holds (stage.reuse)
        self._layouts = LayoutCache(_PLAN_CACHE)
        self._inflight: set[Response] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._coordinator = coordinator
        self._rank = 0  # the rank the cached plans' file names were made for
        self._write = WriteOptions(direct_io=self.options.direct_io, io_threads=self.options.io_threads,
                                   chunk_bytes=self.options.chunk_bytes)
        #: failed saves whose error nobody has received yet (see :meth:`take_failures`)
        self._failures: list[tuple[Response, BaseException]] = []
        #: called with each background failure instead of raising it later (Checkpointer(on_error=))
        self.on_error: Callable[[BackgroundSaveError], None] | None = None
        _ENGINES.add(self)
        # overlapped staging: the background copies and the hand-offs queued behind them
        self._copier = Copier()
        self._streams: dict[Any, Any] = {}  # one CUDA side stream per device, kept across saves
        if prewarm:
            self.writer.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def in_flight(self, path: str) -> bool:
        """Whether a save of ``path`` is still in flight (not committed or failed yet)."""
        with self._lock:
            return any(r.stats.path == path for r in self._inflight)

    def _plan(self, flat: FlatState, rank: int) -> tuple[Plan, tuple[LeafRow, ...]]:
        with self._lock:
            if rank != self._rank:  # plans name the rank's file
                self._plans.clear()
                self._layouts.clear()
                self._rank = rank
            sig = flat.signature
            hit = self._plans.get(sig)
            if hit is not None:
                self._plans.move_to_end(sig)
                return hit
            plan = make_plan(flat, rank=rank)
            rows = plan.leaves  # the plan's own leaf records travel to the writer and the manifest
            self._plans[sig] = (plan, rows)
            if len(self._plans) > _PLAN_CACHE:
                self._plans.popitem(last=False)
            return plan, rows

    def _layout(self, items: dict[str, Any], rank: int) -> tuple[Any, FlatState, Plan, tuple[LeafRow, ...]]:
        """The flattened state, plan and rows of ``items``: the previous save's where its layout
        still holds (stage.reuse), else flattened and planned, and kept for the next save."""
        key = layout_key(items)
        states: dict[int, tuple[Any, Any]] = {}
        hit: Reused | None = self._layouts.lookup(key, items, rank, states)
        if hit is not None:
            return hit.entry, hit.flat, hit.plan, hit.rows
        generation = registry_generation()
        flat = flatten(items, states=states)
        plan, rows = self._plan(flat, rank)
        return self._layouts.remember(key, flat, plan, rows, rank, generation), flat, plan, rows

    def _collective(self) -> bool:
        return self._coordinator is not None and self._coordinator.active()

    def prepare(self, items: dict[str, Any]) -> int:
        """Plan ``items``' layout and allocate (and pre-fault) every slot's buffers for it now.

        Returns the bytes allocated. Saves of the same layout then only copy. Nothing is saved.
        """
        rank = self._coordinator.rank if self._coordinator is not None and self._collective() else 0
        reused, flat, plan, _ = self._layout(items, rank)
        if reused is not None:
            reused.layout.release(flat)  # only the layout is needed below (headers and views)
        fit = self._fit_plan(plan, None, None, rank != 0 or self._collective(), None)
        if fit is not None and fit.pieces:
            self.writer.start()
            return 0  # piece buffers are allocated by the first save
        total = 0
        slots = [self.pool.acquire() for _ in range(min(self.options.max_in_flight, self.pool.slots))]
        for _ in range(self.writer.held_slots):  # the slots the writer may keep, unless it keeps them now
            try:
                slots.append(self.pool.acquire(timeout=0))
            except TimeoutError:
                break
        try:
            for slot in slots:
                fit_slot(self.pool, slot, plan, None)
                prepare_slot(flat, plan, slot)
                total += slot.nbytes
        finally:
            for slot in slots:
                self.pool.release(slot)
        self.writer.start()
        return total

    def save_async(
        self,
        root_url: str,
        name: str,
        items: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        step: int | None = None,
        retention: RetentionPolicy | None = None,
        memory: bool = False,
        persist: bool = True,
        timeout_s: float | None = None,
    ) -> Response:
        """Stage ``items`` and hand the save of ``root_url/name`` to the writer; see :class:`Response`.

        ``memory``: commit to the memory tier (the engine's writer's side must be a keeper); ``persist``:
        also write to storage. ``timeout_s``: a collective save waits this long at most for the
        other ranks (None: ``DistributedOptions.timeout_s``; a preemption's final save has less).
        """
        t0 = time.perf_counter()
        if self._closed:
            raise WriterError("this saver is closed")
        self.raise_failures()
        path = f"{root_url.rstrip('/')}/{name}"
        coordinator = self._coordinator if self._collective() else None
        info = coordinator.begin(root_url, name, timeout_s) if coordinator is not None else None
        try:
            with paused_gc():  # see zerostall.gcpause: a state of many leaves made the collector walk it all
                return self._save_async(root_url, name, path, items, t0, info, metadata, step, retention,
                                        memory=memory, persist=persist)
        except BaseException as exc:
            if coordinator is not None and info is not None:
                # the other ranks' writers learn of it now, not at their timeout
                coordinator.abort(root_url, name, info, path, exc)
            raise

    def _save_async(self, root_url: str, name: str, path: str, items: dict[str, Any], t0: float,
                    info: Collective | None, metadata: dict[str, Any] | None, step: int | None,
                    retention: RetentionPolicy | None, *, memory: bool = False, persist: bool = True) -> Response:
        storage = open_storage(root_url)
        if storage.atomic_rename and storage.exists(name):  # a cheap local check; the writer re-checks
            raise exists_error(storage, name, path)
        reused, flat, plan, rows = self._layout(items, info.rank if info is not None else 0)
        try:
            fit = self._fit_plan(plan, path, step, info is not None, storage)
            if fit is not None and fit.pieces:
                return self._save_pieces(root_url, name, path, flat, plan, rows, t0, fit, metadata, step, retention)
            return self._stage_async(root_url, name, path, items, t0, info, metadata, step, retention, reused, flat,
                                     plan, rows, memory=memory, persist=persist)
        finally:
            if reused is not None:
                reused.layout.release(flat)  # nothing after the call reads the leaves

    def _stage_async(self, root_url: str, name: str, path: str, items: dict[str, Any], t0: float,
                     info: Collective | None, metadata: dict[str, Any] | None, step: int | None,
                     retention: RetentionPolicy | None, reused: Any, flat: FlatState, plan: Plan,
                     rows: tuple[LeafRow, ...], *, memory: bool, persist: bool) -> Response:
        sync_all()  # copies in flight are judged before this thread stages again (stage.overlap)
        GUARD.tidy()  # the training thread, outside any step: a finished save's hook may go
        split = (self._layouts.deferral(reused, items, flat.leaves, deferrable_any)
                 if self.options.staging is Staging.OVERLAP else None)
        defer = split[0] if split is not None else None
        t_wait = time.perf_counter()
        slot = self.pool.acquire()
        # fewer slots than max_in_flight: waiting for one is the limit's cost
        limit_wait_s = time.perf_counter() - t_wait if self._fit is not None and \
            self._fit.slots < self.options.max_in_flight + self.writer.held_slots else 0.0
        task: OverlapTask | None = None
        try:
            fit_slot(self.pool, slot, plan, path)
            t_copy = time.perf_counter()
            crcs: list[int | None] | None = [None] * len(flat.leaves) if staging_checksums() else None
            views = stage(flat, plan, slot, skip=defer, crcs=crcs)
            if split is not None:
                task = build_task(path, flat.leaves, views, split[0], self._streams, owners=split[1],
                                  crc=crcs is not None)
            elif self.options.staging is Staging.OVERLAP and "torch" in map(_KIND, flat.leaves):  # one C loop
                GUARD.learn()  # an optimizer outside the tree is known by the next save
            copy_s = time.perf_counter() - t_copy
        except BaseException:
            self.pool.release(slot)
            raise
        job = SaveJob(
            id=0, root=root_url, name=name, path=path,
            files=tuple(FileRow(name=f.name, length=f.size, buffer=b.id) for f, b in zip(plan.files, slot.buffers, strict=True)),
            leaves=rows, items=flat.items, metadata=metadata or {}, step=step, retention=retention,
            env=storage_env(), write=self._write, collective=info, memory=memory, persist=persist,
            crcs=_sent_crcs(crcs) if task is None else (), storage_ref=scheme_reference(root_url),
        )
        response = Response(path, sum(f.size for f in plan.files),
                            plan.nbytes / copy_s / 1e9 if copy_s > 0 else 0.0)
        response._step = step
        response._limit_wait_s = limit_wait_s
        on_done: OnDone = response._finish
        if info is not None:
            assert self._coordinator is not None
            on_done = self._coordinator.on_done(root_url, name, info, path, response._finish)
        with self._lock:
            self._inflight.add(response)
        response._add_before_done(self._on_done)
        if task is not None:
            response._staged.clear()
            overlapped = task
            task.on_staged = lambda err: self._staged(response, t0, err, job, slot, on_done,
                                                      lambda j: _with_crcs(j, crcs, overlapped))
            if task.pieces is not None:
                response._help_stage = task.pieces.work
            response._sync = task.sync
            self._copier.submit(task)
        elif self._copier.in_order(lambda: self._hand_off_quietly(job, slot, on_done)):
            self._hand_off(job, slot, on_done, raised_to=response)
        response._stall_s = time.perf_counter() - t0  # the hand-off counts as stall too
        if task is None:
            response._staged_s = response._stall_s
        return response

    # -- host_memory_limit ---------------------------------------------------------------------

    def _fit_plan(self, plan: Plan, path: str | None, step: int | None, collective: bool,
                  storage: Storage | None) -> Fit | None:
        """How saves of ``plan`` fit ``host_limit`` (None: no limit), checked before anything is
        staged; the pool takes the fit's shape, from no buffers, when it changes.

        A layout no larger than the largest one checked keeps the pool as it is (its slots may
        still hold that one's buffers, which the check covered); a larger one is checked with its
        own size for every slot, so buffers of old and new layouts never exceed the limit together.

        Raises:
            HostMemoryLimitError: the configuration cannot fit (zerostall.budget.HostLimit.decide).
        """
        limit = self.host_limit
        if limit is None:
            return None
        size = sum(f.alloc for f in plan.files)
        pieces_ok = len(plan.files) == 1 and (storage is None or as_piece_writer(storage) is not None)
        current = self._fit
        if limit.memory_tier:  # the keeper's held slot is never free: the pool keeps its shape, checked at the largest
            grown = max(size, self._fit_bytes)
            self._fit = limit.decide(grown, path=path, step=step, collective=collective, piece_writes=pieces_ok)
            self._fit_bytes = grown
            return self._fit
        if current is not None and not current.pieces:
            grown = max(size, self._fit_bytes)
            kept = limit.decide(grown, path=path, step=step, collective=collective, piece_writes=pieces_ok) \
                if grown * current.slots > limit.limit or grown == size else current
            if not kept.pieces and kept.slots == current.slots:
                self._fit_bytes = grown
                return current
        fit = limit.decide(size, path=path, step=step, collective=collective, piece_writes=pieces_ok)
        if current is None or not (fit.pieces and current.pieces):
            self.wait()  # every slot free: the new shape starts from no buffers
            self.pool.resize(fit.slots)
        self._fit, self._fit_bytes = fit, size
        return fit

    def _save_pieces(self, root_url: str, name: str, path: str, flat: FlatState, plan: Plan,
                     rows: tuple[LeafRow, ...], t0: float, fit: Fit, metadata: dict[str, Any] | None,
                     step: int | None, retention: RetentionPolicy | None) -> Response:
        """Stage and hand off ``plan``'s one data file in pieces of ``fit.piece_bytes`` (training thread).

        The writer gets the job first, then each piece as it is staged into a free piece buffer;
        it writes each into the attempt's data file and releases it, and commits after the last
        (manifest last), as any save. Returns once the last piece is handed over: every byte
        was copied, so the caller may change its tensors. The waits for free piece buffers are
        ``limit_wait_s``."""
        sync_all()  # an overlapped save before this one is handed to the writer first
        GUARD.tidy()
        fplan = plan.files[0]
        piece = fit.piece_bytes
        count = -(-fplan.size // piece)
        job = SaveJob(
            id=0, root=root_url, name=name, path=path,
            files=(FileRow(name=fplan.name, length=fplan.size, buffer=0),), leaves=rows, items=flat.items,
            metadata=metadata or {}, step=step, retention=retention, env=storage_env(), write=self._write,
            storage_ref=scheme_reference(root_url), pieces=count)
        response = Response(path, fplan.size, 0.0)
        response._step = step
        with self._lock:
            self._inflight.add(response)
        response._add_before_done(self._on_done)
        try:
            job_id = self.writer.submit(job, [], on_released=_nothing, on_done=response._finish)
        except BaseException as exc:
            response._received = True
            response._finish(None, exc)
            raise
        starts = [r.offset for r in rows]
        waited = copied = 0.0
        try:
            for a in range(0, fplan.size, piece):
                if response.done():  # the writer failed the job: the rest would be read by nobody
                    break
                t = time.perf_counter()
                slot = self.pool.acquire()
                t_copy = time.perf_counter()
                waited += t_copy - t
                try:
                    fit_slot(self.pool, slot, _piece_plan(plan, piece), path)
                    n = min(piece, fplan.size - a)
                    crcs = fill_piece(slot.buffers[0], a, n, fplan.header, flat.leaves, rows, starts)
                except BaseException:
                    self.pool.release(slot)
                    raise
                copied += time.perf_counter() - t_copy
                self.writer.submit_piece(job_id, file=0, offset=a, length=n, buffer=slot.buffers[0], crcs=crcs,
                                         on_released=functools.partial(self.pool.release, slot))
        except BaseException:
            response._received = True  # raised to the caller here
            self.writer.abort_pieces(job_id)
            raise
        response._staging_gbps = plan.nbytes / copied / 1e9 if copied > 0 else 0.0
        response._limit_wait_s = waited
        response._stall_s = response._staged_s = time.perf_counter() - t0
        return response

    def _hand_off(self, job: SaveJob, slot: Slot, on_done: OnDone, raised_to: Response | None = None) -> None:
        """Submit ``job``; ``raised_to``: the response of a caller that gets the error raised here."""
        try:
            self.writer.submit(job, slot.buffers, on_released=lambda: self.pool.release(slot), on_done=on_done)
        except BaseException as exc:
            self.pool.release(slot)
            if raised_to is not None:
                raised_to._received = True  # raised to the caller right here: not a background failure
            on_done(None, exc)
            raise

    def _hand_off_quietly(self, job: SaveJob, slot: Slot, on_done: OnDone) -> None:
        """The hand-off on the copier thread: a failure is the save's, reported through ``on_done``."""
        try:
            self._hand_off(job, slot, on_done)
        except BaseException:  # noqa: BLE001,S110 - on_done reported it
            pass

    def _staged(self, response: Response, t0: float, err: BaseException | None, job: SaveJob, slot: Slot,
                on_done: OnDone, finish_job: Callable[[SaveJob], SaveJob] | None = None) -> None:
        """An overlapped copy finished (copier thread): hand the save off, or fail it (torn).
        ``finish_job`` completes the job with what the copy produced (its CRCs); an error there
        fails the save like a torn copy."""
        response._staged_s = time.perf_counter() - t0
        if err is None and finish_job is not None:
            try:
                job = finish_job(job)
            except BaseException as exc:  # noqa: BLE001 - fails this save, through on_done below
                err = exc
        if err is not None:
            self.pool.release(slot)
            response._staged.set()
            on_done(None, err)
            return
        try:
            self._hand_off_quietly(job, slot, on_done)
        finally:
            # only now: a trainer that dies once wait_staged() returned must leave the job with the
            # writer (the writer commits what it was handed), as with blocking staging
            response._staged.set()

    def _on_done(self, response: Response, exc: BaseException | None) -> None:
        with self._lock:
            self._inflight.discard(response)
        if exc is None:
            log.info("zerostall: saved %s", response.stats.summary())
            w: WriterStats | None = response._writer
            if w is not None and w.retention_error:
                log.warning("zerostall: %s committed, but deleting old steps failed (retried after the next "
                            "save): %s", response.stats.path, w.retention_error)
        else:
            log.warning("zerostall: save of %s failed: %s", response.stats.path, exc)
            self._note_failure(response, exc)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every in-flight save; errors stay with their responses."""
        sync_all()  # an overlapped save is handed to the writer once judged (stage.overlap)
        with self._lock:
            pending = list(self._inflight)
        for r in pending:
            r._wait(timeout)  # errors stay with their responses, unreceived
        GUARD.tidy()

    def close(self) -> None:
        if self._closed:
            return
        self.wait()
        self._copier.drain()
        GUARD.tidy()
        self._closed = True
        self.writer.close()
        self.pool.close()

    def idle(self) -> bool:
        """Whether no save is in flight."""
        with self._lock:
            return not self._inflight

    def writer_ready(self, timeout: float | None = None) -> bool:
        """Wait until the writer is up (see :meth:`WriterClient.wait_ready`); False if it is not."""
        return self.writer.wait_ready(timeout)

    # -- background failures -----------------------------------------------------------------

    def _note_failure(self, response: Response, exc: BaseException) -> None:
        """Keep a failed save's error for the next save, ``wait()`` or ``close()``, or hand it to ``on_error``."""
        if response._received:
            return
        callback = self.on_error
        if callback is not None:
            try:
                callback(background_error([(response, exc)]))
                return
            except Exception:  # the failure must not be lost with the callback's error
                log.exception("zerostall: on_error raised; the failure of %s will be raised by the next "
                              "save, wait() or close()", response.stats.path)
        with self._lock:
            self._failures.append((response, exc))

    def take_failures(self) -> BackgroundSaveError | None:
        """The failed saves nobody has received yet, as one error (None if there are none); forgets them."""
        with self._lock:
            failed = [(r, e) for r, e in self._failures if not r._received]
            self._failures.clear()
        for r, _ in failed:
            r._received = True
        return background_error(failed) if failed else None

    def raise_failures(self) -> None:
        """Raise :class:`BackgroundSaveError` if a save failed in the background and nobody received it."""
        err = self.take_failures()
        if err is not None:
            raise err from err.cause


def _nothing() -> None:
    return None


def _piece_plan(plan: Plan, piece: int) -> Plan:
    """A plan whose one file is a piece buffer (what :func:`fit_slot` allocates for a piece)."""
    f = plan.files[0]
    return dataclasses.replace(plan, signature=("piece", piece),
                               files=(dataclasses.replace(f, size=piece, alloc=piece),))


def _with_crcs(job: SaveJob, crcs: list[int | None] | None, task: OverlapTask) -> SaveJob:
    """``job`` with the CRC32Cs staging computed, the overlapped copy's included (copier thread, once staged)."""
    if crcs is None:
        return job
    for i, c in task.crcs().items():
        crcs[i] = c
    return dataclasses.replace(job, crcs=_sent_crcs(crcs))


def _sent_crcs(crcs: list[int | None] | None) -> tuple[int | None, ...]:
    """The job's ``crcs``: empty where staging checksummed no leaf (small leaves are copied in
    batches without a checksum), so a state of many small leaves sends no list of nulls."""
    if crcs is None or crcs.count(None) == len(crcs):  # one C loop
        return ()
    return tuple(crcs)


def background_error(failed: list[tuple[Response, BaseException]]) -> BackgroundSaveError:
    """One error naming the first failed save (step, path, cause) and counting the others."""
    first, cause = failed[0]
    what = f"step {first._step}" if first._step is not None else repr(first.stats.path)
    msg = f"the background save of {what} failed: {type(cause).__name__}: {cause}"
    if len(failed) > 1:
        later = [f"step {r._step}" if r._step is not None else repr(r.stats.path) for r, _ in failed[1:]]
        msg += f"; {len(later)} later save(s) failed too ({', '.join(later[:5])}{', ...' if len(later) > 5 else ''})"
    msg += "; nothing of a failed save was committed"
    err = BackgroundSaveError(msg, path=first.stats.path, step=first._step, cause=cause,
                              errors=tuple((r._step, r.stats.path, e) for r, e in failed))
    err.__cause__ = cause  # also when handed to on_error, never raised
    return err


_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _warn_unreceived() -> None:
    """At interpreter exit, say which saves failed without anyone receiving the error."""
    for eng in list(_ENGINES):
        err = eng.take_failures()
        if err is not None:
            # explicit location: the warning is about the saves, not about this line of code
            warnings.warn_explicit(f"{err}", RuntimeWarning, filename="zerostall", lineno=0)


_FIT_HINTS = {
    errno.EFBIG: "the process's file-size limit (ulimit -f, RLIMIT_FSIZE) applies to them: raise it "
                 "(ulimit -f unlimited) for the trainer",
    errno.ENOMEM: "not enough memory: each save in flight needs a full-size copy of the state in host "
                  "memory (README, \"Host memory\")",
    errno.ENOSPC: "not enough memory: each save in flight needs a full-size copy of the state in host "
                  "memory (README, \"Host memory\")",
}


def fit_slot(pool: BufferPool, slot: Slot, plan: Plan, path: str | None) -> None:
    """``pool.fit`` with the operating system's refusal named.

    The staging buffers are memfd files, so a file-size limit (``ulimit -f``) refuses them with a
    bare ``OSError: [Errno 27] File too large`` that names no checkpoint and says nothing of what
    was being allocated.

    Raises:
        StorageError: the buffers could not be created (``errno`` kept), naming the checkpoint.
    """
    try:
        pool.fit(slot, [f.alloc for f in plan.files], signature=plan.signature)
    except OSError as exc:
        if isinstance(exc, ZerostallError):
            raise
        nbytes = sum(f.alloc for f in plan.files)
        hint = _FIT_HINTS.get(exc.errno or 0)
        raise StorageError(f"cannot allocate this save's staging buffers ({nbytes} bytes of shared memory, "
                           f"memfd): {exc.strerror or exc}" + (f"; {hint}" if hint else ""),
                           errno=exc.errno, path=path) from exc
