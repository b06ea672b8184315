"""Overlapped staging: copy optimizer-owned tensors after ``save_*_async`` has returned.

Nothing modifies an optimizer's parameters and state until its next ``step()``, so their copy
can run while the next forward and backward passes do. Two parts make that safe:

* **The copy** (:class:`Copier`, one background thread per engine). A CPU tensor is copied with
  one :func:`zerostall.memcopy.copy` (streaming stores) per 64 MiB piece: no torch kernel, so none of torch's intra-op (OpenMP)
  threads, and the GIL is released during each piece. The copy is cut into pieces that any
  thread may claim: the guard copies whatever the background has not started (see below), so
  a step never waits on a thread that did not get a core. The copier thread runs at the
  trainer's priority. A CUDA tensor is copied on a side stream that first waits for an event
  recorded on the caller's current stream at the call; one background thread enqueues those copies (the call only
  records the event, see :data:`CUDA_ENQUEUE_THREAD`) and the copier waits for their event.
  Each source's storage is referenced until its copy is done, so a parameter whose ``.data`` is
  replaced, or a block the CUDA caching allocator would hand out again, still yields the bytes
  of the call.
* **The guard** (:class:`Guard`, one global optimizer step pre-hook, installed while a copy is
  in flight). Before any optimizer's ``step()``: on CPU it copies the pieces nobody has started
  and waits for those in progress; on CUDA the current stream waits for the copy's event (the
  host waits only until the enqueuer has enqueued the copies, not for the copies).

Each overlapped tensor's autograd version counter is recorded at the call. A counter that moved
before the copy was done (an in-place change outside ``step()``) fails the save with
:class:`~zerostall.errors.TornSnapshotError` naming the leaf; nothing of it is submitted. A write
through ``t.data`` moves no counter the save recorded (the alias has its own), so it is ordered
instead: while a copy is in flight, a ``.data`` access of a tensor sharing memory with it waits
for the copy as a step does (:class:`_DataAccess`).

**Background sources.** A leaf whose value is an instance of a registered array type's
:attr:`~zerostall.arraytypes.ArrayType.source` (JAX's immutable arrays: :mod:`zerostall.integrations.jax`)
is copied by the same thread through the value's own ``copy_into(dst)``, in every overlapped
save, owned by an optimizer or not, after its ``hold()`` ran in the save call; the value judges
itself whether it is still intact and raises (a :class:`~zerostall.errors.TornSnapshotError`
subclass) when not. No guard is needed: nothing but the source's own rules (e.g. donation) can
change it.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from zerostall import envvars
from zerostall.arraytypes import BackgroundSource, background_sources
from zerostall.checksum import join_crcs
from zerostall.errors import TornSnapshotError, ZerostallError
from zerostall.memcopy import copy
from zerostall.stage.ownership import Spans, deferrable, note_optimizer, optimizer_tensors, span

__all__ = ["OverlapTask", "Copier", "Guard", "GUARD", "build_task", "CHUNK", "BackgroundSource",
           "deferrable_any", "sync_all"]

log = logging.getLogger("zerostall")

#: bytes per copy call: large enough to run at memory bandwidth, small enough that the GIL
#: is taken back often (other Python threads are never held up for long)
CHUNK = 64 << 20
#: Seconds the copier waits after a CPU copy for a thread that may modify the tensors to judge it
#: (:meth:`OverlapTask.sync`: the next guarded ``step()``, save, ``wait_staged()``, ``result()``,
#: ``wait()``, ``close()``, exit) before judging it itself and handing the save on. An in-place
#: kernel that started before the copy ended and still runs this long later is the only change
#: the versions cannot show; a save nobody syncs with (no step, no wait: a last save before a long
#: evaluation) commits this much later than its copy.
SYNC_GRACE_S = 2.0


@dataclass
class _CpuCopy:
    key: str
    tensor: Any  # holds the storage alive until copied
    storage: Any  # the storage as of the call (a later ``.data =`` swap does not change it)
    src: int
    dst: int
    nbytes: int
    version: int
    leaf: int = -1  # index in the save's leaves (where its CRC32C goes)


class _Pieces:
    """A task's CPU copies cut into ``CHUNK`` pieces that any thread may claim.

    The background thread copies them; the guard copies the ones nobody has started instead of
    waiting (a background thread that did not get a core must never hold up a step).
    """

    def __init__(self, copies: list[_CpuCopy], crc: bool = False) -> None:
        if max((c.nbytes for c in copies), default=0) <= CHUNK:  # one piece a copy: no range() per copy
            self._items = [(k, 0, c.dst, c.src, c.nbytes) for k, c in enumerate(copies)]
        else:
            self._items = [(k, off, c.dst + off, c.src + off, min(CHUNK, c.nbytes - off))
                           for k, c in enumerate(copies) for off in range(0, c.nbytes, CHUNK)]
        self._leaf = [c.leaf for c in copies]  # not the copies: they hold the tensors
        self._crc = crc
        self._sums: list[int | None] = [None] * len(self._items)
        self._next = 0
        self._running = 0
        self._cond = threading.Condition()
        self.error: BaseException | None = None

    def work(self) -> int:
        """Copy unclaimed pieces until none is left; the bytes this thread copied."""
        copied = 0
        while True:
            with self._cond:
                if self._next >= len(self._items) or self.error is not None:
                    return copied
                j = self._next
                self._next += 1
                self._running += 1
            try:
                _, _, dst, src, n = self._items[j]
                # streaming stores (and the CRC32C, in the same pass); the GIL is released for the copy
                self._sums[j] = copy(dst, src, n, 0 if self._crc else None)
                copied += n
            except BaseException as exc:  # noqa: BLE001 - fails the save through the task
                with self._cond:
                    self.error = self.error or exc
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def crcs(self) -> dict[int, int]:
        """Once every piece is copied: the CRC32C of each copy's leaf whose pieces all checksummed."""
        bad = {k for (k, *_), c in zip(self._items, self._sums, strict=True) if c is None}
        parts = [((k, off, off + n), c) for (k, off, _, _, n), c in zip(self._items, self._sums, strict=True)
                 if c is not None and k not in bad]
        joined = join_crcs(parts, len(self._leaf))
        return {self._leaf[k]: c for k, c in enumerate(joined) if c is not None and self._leaf[k] >= 0}

    def wait(self) -> None:
        """Until every piece is copied (or one failed and none is still running)."""
        with self._cond:
            self._cond.wait_for(lambda: self._running == 0 and (self._next >= len(self._items) or self.error is not None))

    @property
    def left(self) -> int:
        """Pieces nobody has started yet."""
        with self._cond:
            return len(self._items) - self._next


def _set_event() -> threading.Event:
    done = threading.Event()
    done.set()
    return done


@dataclass
class _CudaPart:
    device: Any
    event: Any  # recorded on the side stream after the copies (None until they are enqueued)
    entries: list[tuple[str, Any, Any, int]]  # key, tensor, storage, version at the call
    sealed: bool = False  # a guard ordered later work after the copy; versions judged then
    #: set once the copies are enqueued and ``event`` recorded, or the enqueue failed (``failure``)
    enqueued: threading.Event = field(default_factory=_set_event)
    failure: BaseException | None = None

    def wait_enqueued(self) -> Any:
        """The copy's event, once the enqueuer recorded it; raises the enqueue's failure."""
        self.enqueued.wait()
        if self.event is None:
            raise self.failure or RuntimeError("the CUDA copies of this save were never enqueued")
        return self.event


#: Where an overlapped save's CUDA copies are enqueued. On (the default): by one background
#: thread (:class:`_Enqueuer`), so the save call only records an event on the caller's stream.
#: Each ``copy_`` costs the host ~17 us in torch and the driver (H200 host: 22 ms for the
#: 1,268 tensors of benchmarks/gpu.py's model, half of the whole call), and a step needs the
#: copies enqueued only before its own kernels are. Off (:data:`zerostall.envvars.CUDA_ENQUEUE_THREAD`):
#: enqueued in the call, on the training thread; an A/B for a GPU run to decide.
CUDA_ENQUEUE_THREAD = envvars.switch(envvars.CUDA_ENQUEUE_THREAD, "background CUDA copy enqueues")


def _enqueue_copies(part: _CudaPart, stream: Any, ready: Any, dsts: list[Any]) -> None:
    """Enqueue ``part``'s copies on ``stream`` after ``ready`` and record their event (any thread)."""
    torch = sys.modules["torch"]
    try:
        stream.wait_event(ready)
        # the stream and grad mode are per thread: both are set here, on the thread that copies
        with torch.cuda.stream(stream), torch.no_grad():
            for (_, t, _, _), dst in zip(part.entries, dsts, strict=True):
                dst.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        part.event = done
    except BaseException as exc:  # noqa: BLE001 - fails the save (wait_enqueued raises it)
        part.failure = exc
    finally:
        part.enqueued.set()


class _Enqueuer:
    """One daemon thread that enqueues the CUDA copies of overlapped saves, in submission order."""

    def __init__(self) -> None:
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def put(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._queue.append(fn)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="zerostall-cuda-enqueue", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        _THREAD.ours = True  # never ordered after its own copies (see Guard.order_access)
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                fn = self._queue.popleft()
            try:
                fn()  # _enqueue_copies records its own failure in the part, which fails the save
            except BaseException:
                log.exception("zerostall: CUDA copy enqueue failed")


_ENQUEUER = _Enqueuer()


def deferrable_any(items: Any, leaves: list[Any]) -> tuple[list[bool], list[Any]] | None:
    """:func:`~zerostall.stage.ownership.deferrable` plus the leaves whose value is a registered
    array type's background source (:func:`zerostall.arraytypes.background_sources`)."""
    split = deferrable(items, leaves)
    sources = background_sources()
    if not sources:
        return split
    host = [isinstance(leaf.value, sources) and leaf.nbytes > 0 for leaf in leaves]
    if not any(host):
        return split
    if split is None:
        return host, []
    return [d or h for d, h in zip(split[0], host, strict=True)], split[1]


@dataclass
class _HostCopy:
    key: str
    source: Any  # a BackgroundSource; referenced until copied
    dst: Any
    leaf: int  # its index among the save's leaves


@dataclass
class OverlapTask:
    """The background part of one save."""

    path: str
    cpu: list[_CpuCopy] = field(default_factory=list)
    cuda: list[_CudaPart] = field(default_factory=list)
    #: runs on the copier thread once every byte landed: ``None`` or the error of the copy
    on_staged: Callable[[BaseException | None], None] | None = None
    cpu_done: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: ids of the optimizers owning the deferred leaves: their steps wait for this copy
    owners: set[int] = field(default_factory=set)
    #: memory of the deferred leaves, to judge an optimizer not among ``owners``
    spans: Spans = field(default_factory=Spans)
    #: the deferred tensors whose spans join ``spans`` when first needed (rarely: an optimizer
    #: not among ``owners``), not in the save call
    span_tensors: list[Any] = field(default_factory=list)
    span_lock: threading.Lock = field(default_factory=threading.Lock)
    _verdicts: dict[int, bool] = field(default_factory=dict)
    #: background sources (:attr:`zerostall.arraytypes.ArrayType.source`), copied after ``cpu``
    host: list[_HostCopy] = field(default_factory=list)
    #: ``cpu`` cut into claimable pieces (set by :func:`build_task`)
    pieces: _Pieces | None = None
    #: whether the copies checksum what they copy (see :meth:`crcs`)
    crc: bool = False
    #: the CRC32Cs the background sources' copies computed, by leaf index
    host_crcs: dict[int, int] = field(default_factory=dict)
    #: set once a thread that may modify the tensors (the training thread: the guard, the next
    #: save, ``wait_staged()``, ``result()``...) judged the versions after the copy; the copier
    #: hands the save on only then (see :meth:`sync`)
    synced: threading.Event = field(default_factory=threading.Event)

    def crcs(self) -> dict[int, int]:
        """Once staged: the CRC32C of the deferred CPU leaves (and background sources) whose copy
        checksummed them, by leaf index."""
        return {**(self.pieces.crcs() if self.pieces is not None else {}), **self.host_crcs}

    @property
    def guarded(self) -> bool:
        """Whether optimizer steps must be ordered after this task (it copies torch tensors)."""
        return bool(self.owners or self.cpu or self.cuda)

    def concerns(self, optimizer: Any) -> bool:
        """Whether ``optimizer.step()`` can change a tensor this task has not copied yet."""
        oid = id(optimizer)
        if oid in self.owners:
            return True
        verdict = self._verdicts.get(oid)
        if verdict is None:
            # Another optimizer over the same tensors (not known at the call): judged by memory,
            # once per task. An optimizer whose tensors cannot be listed is assumed to concern it.
            try:
                spans = [span(t) for t in optimizer_tensors(optimizer)]
                verdict = any(self.aliases(sp) for sp in spans if sp is not None)
            except Exception:  # noqa: BLE001 - a foreign optimizer-like object: be safe
                verdict = True
            self._verdicts[oid] = verdict
        return verdict

    @property
    def ordered(self) -> bool:
        """Whether everything the caller does from now on runs after this copy (judged, CUDA parts sealed)."""
        return self.synced.is_set() and all(part.sealed for part in self.cuda)

    def aliases(self, sp: tuple[bool, int, int]) -> bool:
        """Whether the memory ``sp`` (:func:`~zerostall.stage.ownership.span`) overlaps a tensor of this copy."""
        with self.span_lock:  # any thread: a ``.data`` access (see :class:`_DataAccess`) or the guard
            if self.span_tensors:
                for t in self.span_tensors:
                    tsp = span(t)
                    if tsp is not None:
                        self.spans.add(tsp)
                self.span_tensors = []
            return bool(self.spans) and self.spans.overlaps(sp)

    def order_step(self) -> None:
        """Order an optimizer step about to run after this copy (the guard; training thread)."""
        self.sync()  # what the background has not started, this thread copies; then it judges
        if not self.cuda:
            return
        torch = sys.modules["torch"]
        with self.lock:
            for part in self.cuda:
                if part.sealed:
                    continue
                try:
                    event = part.wait_enqueued()  # the host waits only if the enqueuer is still at it
                except BaseException as exc:  # noqa: BLE001 - the save fails; nothing to order after
                    self.error = self.error or exc
                    part.sealed = True
                    continue
                # From here on everything the caller enqueues on this stream runs after the
                # copy, so only a change made before this point can tear it.
                torch.cuda.current_stream(part.device).wait_event(event)
                if self.error is None:
                    self.error = _moved(self.path, [(k, t, v) for k, t, _, v in part.entries])
                part.sealed = True

    def sync(self, timeout: float | None = None) -> bool:
        """Judge the CPU copy's versions on the calling thread once the copy is done; True when judged.

        The copier judges them when the last piece lands, but an in-place change whose kernel
        ran during the copy bumps its tensor's version only after the kernel, which can be after
        that check: the snapshot would be torn and nothing would say so. A thread that modifies
        tensors has finished every earlier in-place op (and its version bump) when it calls
        this, so any change it made between the call and here is seen: the save fails with
        :class:`~zerostall.errors.TornSnapshotError` (a change made after the copy was done but
        before this point too: it is the pattern ``wait_staged()`` is for, and failing it always
        beats failing it only when it raced). The save is handed to the writer only after this.
        ``timeout``: None copies the pieces nobody has started on this thread and returns True;
        otherwise waits at most that long for the copy (0: only looks).
        """
        if self.synced.is_set():
            return True
        if not self.cpu_done.is_set():
            if timeout is None:
                if self.pieces is not None:
                    self.pieces.work()
                self._finish_cpu()
            if not self.cpu_done.wait(timeout):
                return False
        self._judge(self.synced)
        return True

    def _finish_cpu(self) -> None:
        """Once every piece is copied: judge the versions, release the guard (either thread, once)."""
        if self.pieces is not None:
            self.pieces.wait()
        self._judge(self.cpu_done, self.pieces.error if self.pieces is not None else None)

    def _judge(self, judged: threading.Event, failed: BaseException | None = None) -> None:
        """Record the copy's failure or a moved version counter, then set ``judged`` (once)."""
        with self.lock:
            if judged.is_set():
                return
            try:
                if self.error is None:
                    self.error = failed
                if self.error is None:
                    self.error = _moved(self.path, [(c.key, c.tensor, c.version) for c in self.cpu])
            except BaseException as exc:  # noqa: BLE001 - reported through the save
                self.error = self.error or exc
            finally:
                judged.set()

    def _run(self) -> None:
        """Copy, check, hand on (copier thread)."""
        if self.pieces is not None:
            self.pieces.work()
        self._finish_cpu()
        for h in self.host:
            if self.error is not None:
                break
            try:
                got = h.source.copy_into(h.dst, 0 if self.crc else None)
                if got is not None:
                    self.host_crcs[h.leaf] = got
            except ZerostallError as exc:
                if exc.path is None:
                    exc.path = self.path
                self.error = exc
            except BaseException as exc:  # noqa: BLE001 - reported through the save
                self.error = exc
        self.host = []  # the sources may be freed (or donated) now
        for part in self.cuda:
            try:
                part.wait_enqueued().synchronize()
            except BaseException as exc:  # noqa: BLE001 - a CUDA error fails this save
                self.error = self.error or exc
            with self.lock:
                if not part.sealed and self.error is None:
                    self.error = _moved(self.path, [(k, t, v) for k, t, _, v in part.entries])
                part.sealed = True
        if not self.synced.wait(SYNC_GRACE_S):  # normally the next step's guard syncs it (see sync())
            self.sync(0)  # nobody did (no step, no wait): judged here, as late as a commit can wait
        self.cpu = []
        self.cuda = []  # the sources may be freed now
        with self.span_lock:
            self.span_tensors = []


def _moved(path: str, entries: list[tuple[str, Any, int]]) -> TornSnapshotError | None:
    for key, tensor, version in entries:
        if int(tensor._version) != version:
            return TornSnapshotError(
                f"tensor {key!r} was modified in place outside optimizer.step() while its overlapped copy was "
                "in flight, so the snapshot would mix two states; nothing of this save is committed. Call "
                "response.wait_staged() before modifying optimizer-owned tensors outside step(), or save with "
                "SaveOptions(staging='blocking')", path=path, key=key)
    return None


def _list_host_copies(task: OverlapTask, leaves: list[Any], views: list[Any], defer: list[bool]) -> bool:
    """List the copies of ``task`` in bulk, one comprehension a field, when every deferred leaf is
    a host tensor (no background source, nothing on CUDA): a state of many leaves paid ~1 us a
    leaf in the general loop of :func:`build_task`. False (nothing done) otherwise."""
    if background_sources():
        return False
    picked = [li for li, (dst, d) in enumerate(zip(views, defer, strict=True)) if d and dst is not None]
    ts = [leaves[li].value for li in picked]
    if any(t.is_cuda for t in ts):
        return False
    task.span_tensors = ts
    task.cpu = list(map(_CpuCopy, [leaves[li].key for li in picked], ts, [t.untyped_storage() for t in ts],
                        [t.data_ptr() for t in ts], [views[li].data_ptr() for li in picked],
                        [leaves[li].nbytes for li in picked], [t._version for t in ts], picked))
    return True


def build_task(path: str, leaves: list[Any], views: list[Any], defer: list[bool],
               streams: dict[Any, Any] | None = None, owners: list[Any] | None = None, *,
               crc: bool = False) -> OverlapTask:
    """Describe (and on CUDA, enqueue) the copies of the deferred leaves; run on the training thread.

    With ``crc``, the CPU copies checksum what they copy (:meth:`OverlapTask.crcs` once staged).

    ``streams`` caches one side stream per CUDA device across saves; ``owners`` are the
    optimizers whose steps must wait (see :meth:`OverlapTask.concerns`).
    """
    task = OverlapTask(path, owners={id(o) for o in owners or ()}, crc=crc)
    by_device: dict[Any, list[tuple[str, Any, Any, int, Any]]] = {}
    listed = _list_host_copies(task, leaves, views, defer)
    sources = background_sources()
    for li, (leaf, dst, d) in enumerate(() if listed else zip(leaves, views, defer, strict=True)):
        if not d or dst is None:
            continue
        if sources and isinstance(leaf.value, sources):
            source = cast(BackgroundSource, leaf.value)
            try:
                source.hold()
            except ZerostallError as exc:
                if exc.path is None:
                    exc.path = path
                raise
            task.host.append(_HostCopy(leaf.key, source, dst, li))
            continue
        t = leaf.value
        version = int(t._version)
        storage = t.untyped_storage()
        task.span_tensors.append(t)
        if t.is_cuda:  # not device.type, nor a device object as the key: ~0.5 us a leaf
            by_device.setdefault(t.get_device(), []).append((leaf.key, t, storage, version, dst))
        else:
            task.cpu.append(_CpuCopy(leaf.key, t, storage, int(t.data_ptr()), int(dst.data_ptr()), leaf.nbytes,
                                     version, li))
    if by_device:
        torch = sys.modules["torch"]
        for device, entries in by_device.items():
            stream = streams.get(device) if streams is not None else None
            if stream is None:
                stream = torch.cuda.Stream(device=device)
                if streams is not None:
                    streams[device] = stream
            # The copies read the state as it is when this event completes: everything the
            # caller enqueued before the call; the guard orders every later step after them.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            part = _CudaPart(device, None, [(k, t, s, v) for k, t, s, v, _ in entries], enqueued=threading.Event())
            dsts = [dst for *_, dst in entries]
            task.cuda.append(part)
            if CUDA_ENQUEUE_THREAD:
                _ENQUEUER.put(functools.partial(_enqueue_copies, part, stream, ready, dsts))
            else:
                _enqueue_copies(part, stream, ready, dsts)
    if not task.owners and task.host and any(leaf.kind == "torch" for leaf in leaves):
        GUARD.learn()  # as for a save with nothing to overlap: an optimizer outside the tree is known next time
    if not task.cpu:
        # Nothing for the host to wait for: a guard must not block until the copier thread
        # reaches this task (it may still be busy with an earlier one). CUDA copies are judged
        # on the training thread by the guard (a kernel's version bump happens when it is
        # enqueued), background sources by themselves: nothing to sync.
        task.cpu_done.set()
        task.synced.set()
    else:
        task.pieces = _Pieces(task.cpu, crc)
    return task


class Guard:
    """The global optimizer step pre-hook that orders steps after in-flight copies.

    Installed when the first copy starts. Removed only on the thread that saves, at a point
    where no ``step()`` can be iterating torch's hook dict (the next save, ``wait_staged()``,
    ``wait()``, ``close()``): removing it from the copier thread could change the dict while a
    step iterates it. The ``Tensor.data`` interception (:class:`_DataAccess`) comes and goes with
    the copies in flight instead.
    """

    def __init__(self) -> None:
        self._tasks: list[OverlapTask] = []
        self._lock = threading.Lock()
        self._handle: Any = None
        self._hook: Any = None

    def _ready(self) -> Any:
        if self._hook is None:
            import torch

            # Never traced: inside a torch.compile'd step Dynamo would otherwise trace this
            # hook like the step itself, on fake tensors (every version counter reads 0, so
            # each overlapped save failed as torn) and without its side effects at run time
            # (no copy, no wait). Disabled, it is a graph break that runs eagerly each step.
            self._hook = torch.compiler.disable(self._pre_step)  # type: ignore[no-untyped-call]
        return self._hook

    def add(self, task: OverlapTask) -> None:
        with self._lock:
            self._tasks.append(task)
            self._install()
            DATA.install()

    def learn(self) -> None:
        """Install the hook until the next :meth:`tidy` only to see which optimizers step.

        A save whose tensors no known optimizer owns calls this: an optimizer kept outside the
        saved tree becomes known at its next step, so the next save can overlap its tensors.
        """
        if "torch._dynamo" not in sys.modules:
            # No torch optimizer exists in this process yet: constructing one imports
            # torch._dynamo (torch wraps Optimizer.add_param_group for Dynamo). There is no step
            # to see, and building the hook would import that module on the training thread
            # (1.2-1.6 s on a small VM) for nothing; the first save after one exists learns it.
            return
        with self._lock:
            self._install()

    def _install(self) -> None:
        # The caller holds self._lock (add() and learn() both do): two saves installing at once
        # would register the hook twice and leave one handle that tidy() can never remove.
        if self._handle is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._handle = register_optimizer_step_pre_hook(self._ready())

    def discard(self, task: OverlapTask) -> None:
        with self._lock:
            if task in self._tasks:
                self._tasks.remove(task)
            if not self._tasks:
                DATA.remove()  # unlike the hook, safe from any thread (see _DataAccess)

    def tidy(self) -> None:
        """Remove the hook if no copy is in flight; call only where no step can be running."""
        with self._lock:
            if not self._tasks:
                DATA.remove()
                if self._handle is not None:
                    self._handle.remove()
                    self._handle = None

    def order_access(self, t: Any) -> None:
        """Order what the caller does next with ``t`` after the in-flight copies of memory it shares.

        As before a step: the pieces nobody has started are copied on this thread, the copy is
        judged, and on CUDA the current stream waits for the copy's event. Never on zerostall's
        own threads (they would wait on themselves), nor inside an ordering already under way.
        """
        if _THREAD.ours:
            return
        tasks = list(self._tasks)  # one atomic copy; add() and discard() change it under the lock
        if not tasks:
            return
        try:
            local = getattr(t, "_local_tensor", None)  # a DTensor's memory on this rank is its local shard
            sp = span(t if local is None else local)
        except Exception:  # noqa: BLE001 - no memory of its own (fake or meta tensors while tracing)
            sp = None
        if sp is None:
            return
        hit = [task for task in tasks if not task.ordered and task.aliases(sp)]
        if not hit:
            return
        _THREAD.ours = True
        try:
            for task in hit:
                task.order_step()
        finally:
            _THREAD.ours = False

    @property
    def installed(self) -> bool:
        return self._handle is not None

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        note_optimizer(optimizer)
        with self._lock:
            tasks = [t for t in self._tasks if t.concerns(optimizer)]

        def order() -> None:
            for task in tasks:
                task.order_step()

        later = _order_after_closure(optimizer, args, kwargs, order) if tasks else None
        if later is not None:
            return later
        order()
        return None


def _order_after_closure(optimizer: Any, args: Any, kwargs: Any,
                         order: Callable[[], None]) -> tuple[Any, Any] | None:
    """A ``step(closure)`` of a torch optimizer, with ``order`` moved to the end of the closure's first call.

    Lightning's automatic optimization (and LBFGS) passes the forward and backward pass to
    ``step()`` as a closure: ordered before it, the step would wait for the copy before the very
    work the copy should overlap. Every ``torch.optim`` optimizer calls the closure first and
    updates only after it returns (LBFGS too: its later calls follow its first update), and a
    closure changes no parameter or optimizer state (module buffers such as BatchNorm's are copied
    before the save returns), so waiting at the end of its first call orders every update after
    the copy. A foreign optimizer may update before calling it: it is ordered before, as without a
    closure. Returns the ``(args, kwargs)`` to step with, or None where nothing is moved.
    """
    if not type(optimizer).__module__.startswith("torch.optim."):
        return None
    # torch's step wrapper hands hooks the bound call's args: ``(optimizer, closure?)``
    closure = kwargs.get("closure") if isinstance(kwargs, dict) else None
    positional = closure is None and len(args) > 1 and callable(args[1])
    if positional:
        closure = args[1]
    if closure is None or not callable(closure):
        return None
    ordered = False

    def closure_then_order(*a: Any, **k: Any) -> Any:
        nonlocal ordered
        try:
            return closure(*a, **k)
        finally:
            if not ordered:
                ordered = True
                order()

    if positional:
        return (args[0], closure_then_order, *args[2:]), kwargs
    return args, {**kwargs, "closure": closure_then_order}


class _DataAccess:
    """``Tensor.data``, intercepted while a copy is in flight, so a write through it is ordered after the copy.

    ``t.data`` is an alias of ``t``'s memory with a version counter of its own: an in-place
    change through it (``p.data.mul_()``, ``p.data.copy_()``, weight clipping with
    ``p.data.clamp_()``) moves no counter the save recorded, so it cannot be detected; it can
    only be kept from tearing the copy. While a copy is in flight ``torch.Tensor.data`` is a
    property that, before handing out the alias of a tensor sharing memory with the copy, orders
    the caller after it exactly as the guard orders a step (:meth:`Guard.order_access`); the
    setter (``p.data = t``) needs nothing: the copy holds the old storage. Installed with the
    first task and removed when the last one is done: from any thread, since replacing a class
    attribute, unlike removing a hook a step may be iterating, cannot disturb a caller. While
    installed, a ``.data`` access runs this Python property instead of torch's C getter, and
    while a copy is in flight it also compares the tensor's memory with the copy's
    (docs/guarantees.md has the measured cost). Dynamo traces ``.data`` as a graph operation
    without looking up this property, so the interception never enters a compiled graph
    (docs/guarantees.md lists what it cannot see).
    """

    def __init__(self) -> None:
        self._base: Any = None  # the C getset descriptor of torch._C.TensorBase
        self._prop: Any = None
        self.installed = False

    def install(self) -> None:
        """Intercept ``Tensor.data`` (the caller holds ``GUARD._lock``)."""
        if self.installed:
            return
        torch = sys.modules["torch"]
        if self._prop is None:
            base = torch._C.TensorBase.__dict__["data"]

            def get(t: Any) -> Any:
                if GUARD._tasks:
                    GUARD.order_access(t)
                return base.__get__(t)

            def put(t: Any, value: Any) -> None:
                base.__set__(t, value)

            self._base, self._prop = base, property(get, put, doc=base.__doc__)
        if "data" in torch.Tensor.__dict__:  # pragma: no cover - a torch that defines it in Python
            return  # left alone: writes through .data are then only as safe as the docs say
        torch.Tensor.data = self._prop
        self.installed = True

    def remove(self) -> None:
        """Give ``Tensor.data`` back to torch (the caller holds ``GUARD._lock``)."""
        if self.installed:
            torch = sys.modules["torch"]
            if torch.Tensor.__dict__.get("data") is self._prop:
                del torch.Tensor.data
            self.installed = False


class _ThreadMark(threading.local):
    """Set on zerostall's own threads, and during an ordering, where a ``.data`` access orders nothing."""

    ours = False  # a class default: read in every intercepted access, it must not raise and catch


_THREAD = _ThreadMark()
DATA = _DataAccess()
GUARD = Guard()
_COPIERS: weakref.WeakSet[Copier] = weakref.WeakSet()


def sync_all() -> None:
    """:meth:`OverlapTask.sync` every copy in flight (a save call, ``wait()``, ``close()``, exit)."""
    with GUARD._lock:
        tasks = list(GUARD._tasks)
    for task in tasks:
        task.sync()


@atexit.register
def _drain_all() -> None:
    """At interpreter exit, finish the copies and hand-offs of saves that already returned.

    The copier threads are daemons (an exiting interpreter would not wait for them); without
    this, a save whose ``save_*_async`` returned just before a normal exit would never reach the
    writer, which commits everything it was handed even after the trainer has gone.
    """
    sync_all()  # the training loop has ended: what it changed is seen, the rest is handed on
    for copier in list(_COPIERS):
        copier.drain(timeout=600)


class Copier:
    """One background thread that runs an engine's overlapped copies and hand-offs, in order."""

    def __init__(self, name: str = "zerostall-copier") -> None:
        self._queue: collections.deque[OverlapTask | Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._busy = 0  # queued or running items
        self._thread: threading.Thread | None = None
        self._name = name
        _COPIERS.add(self)

    def submit(self, task: OverlapTask) -> None:
        """Run ``task`` in the background after everything submitted before it."""
        if task.guarded:  # a task of background sources only needs no torch hook (nor torch)
            GUARD.add(task)
        self._put(task)

    def in_order(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` now if nothing is queued (returns True), else after the queue (False)."""
        with self._cond:
            if self._busy == 0:
                return True
        self._put(fn)
        return False

    def _put(self, item: OverlapTask | Callable[[], None]) -> None:
        with self._cond:
            self._busy += 1
            self._queue.append(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return self._busy == 0

    def drain(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout=timeout)

    def _loop(self) -> None:
        _THREAD.ours = True  # never ordered after its own copies (see Guard.order_access)
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.popleft()
            try:
                if isinstance(item, OverlapTask):
                    _run_task(item)
                else:
                    item()
            except BaseException:
                log.exception("zerostall: background staging step failed")
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()


def _run_task(task: OverlapTask) -> None:
    try:
        task._run()
    finally:
        GUARD.discard(task)
        try:
            if task.on_staged is not None:
                task.on_staged(task.error)
        finally:
            task.finished.set()
