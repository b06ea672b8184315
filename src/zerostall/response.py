"""What an asynchronous save returns: staged on return, committed when ``result()`` returns."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from zerostall.messages import WriterStats
from zerostall.validate import check_number, check_timeout

__all__ = ["Response", "SaveStats"]


@dataclass(frozen=True)
class SaveStats:
    """Telemetry of one save.

    Attributes:
        path: the checkpoint's URL.
        nbytes: bytes written (data files, headers included).
        stall_s: seconds the caller was blocked in ``save_*_async`` (flatten, wait for a free
            buffer, copy into it, hand-off).
        staging_gbps: array bytes staged per second of copying.
        persist_s: seconds from hand-off to commit in the writer (None until committed).
        persist_gbps: ``nbytes`` over the writer's write time.
        commit_s: seconds spent writing the manifest, syncing and renaming.
        writer_peak_rss: the writer process's peak resident memory in bytes.
        tiers: where the save is committed: ``("storage",)``, or with a memory tier
            ``("memory",)`` (memory only) or ``("memory", "storage")``, with ``"peer"`` after
            ``"memory"`` when ``MemoryTier(replicas=...)`` holders on other hosts verified it
            too; empty until committed.
        staged_s: seconds from the call until every byte was in host memory (with overlapped
            staging, later than ``stall_s``; None until then).
        limit_wait_s: the part of ``stall_s`` the caller waited because of
            ``Checkpointer(host_memory_limit=...)``: for a free staging slot where the limit
            allows fewer than ``max_in_flight``, or, for a save in pieces, for each piece buffer
            the writer had not finished writing (0.0 without a limit, or when it cost nothing).
    """

    path: str
    nbytes: int
    stall_s: float
    staging_gbps: float
    persist_s: float | None = None
    persist_gbps: float | None = None
    commit_s: float | None = None
    writer_peak_rss: int | None = None
    tiers: tuple[str, ...] = ()
    staged_s: float | None = None
    limit_wait_s: float = 0.0

    def summary(self) -> str:
        """One line: the stall of the save call, then the background persist, each rate named by
        what it measures (the staging copy's speed; the writes' speed, over their own time only)."""
        mib = self.nbytes / (1 << 20)
        s = f"{self.path}: {mib:.1f} MiB, stall {self.stall_s * 1e3:.1f} ms (staging copy {self.staging_gbps:.2f} GB/s)"
        if self.persist_s is not None:
            s += (f", persist {self.persist_s:.2f} s (writes {self.persist_gbps or 0:.2f} GB/s), "
                  f"commit {self.commit_s or 0:.3f} s")
        return s


class Response:
    """Handle of an asynchronous save.

    When ``save_*_async`` returns, the state has been copied, except, with overlapped staging
    (the default), the tensors only ``optimizer.step()`` modifies, whose copy the next ``step()``
    waits for by itself; before changing those in place outside ``step()``, call
    :meth:`wait_staged`. ``result()`` waits until the checkpoint is committed and returns its
    :class:`SaveStats`, or raises the background error with its original type.
    """

    def __init__(self, path: str, nbytes: int, staging_gbps: float) -> None:
        self._future: Future[None] = Future()
        self._path = path
        self._nbytes = nbytes
        self._staging_gbps = staging_gbps
        self._stall_s = 0.0
        #: the part of the stall spent waiting because of host_memory_limit (SaveStats.limit_wait_s)
        self._limit_wait_s = 0.0
        self._writer: WriterStats | None = None
        # run before result() can return, so that what they record is visible to its caller
        self._before_done: list[Callable[[Response, BaseException | None], None]] = []
        self._hooks_lock = threading.Lock()
        self._finished = False
        self._error: BaseException | None = None
        #: the step this save was for (Checkpointer saves), named in a BackgroundSaveError
        self._step: int | None = None
        #: set once the caller has been handed this save's error (result() raised it, exception() returned it)
        self._received = False
        # set once every byte is in host memory; the engine clears it for an overlapped save
        self._staged = threading.Event()
        #: copies the part of an overlapped copy nobody has started, on the waiting thread
        self._help_stage: Callable[[], object] | None = None
        #: judges an overlapped copy on the calling thread once it is done (``OverlapTask.sync``:
        #: None helps and completes, a number waits at most that long); the save reaches the
        #: writer only after it, so every wait on this save calls it first
        self._sync: Callable[[float | None], bool] | None = None
        self._staged.set()
        self._staged_s: float | None = None

    @property
    def stats(self) -> SaveStats:
        """Statistics so far (persist fields are None until committed)."""
        w = self._writer
        if w is None:
            return SaveStats(path=self._path, nbytes=self._nbytes, stall_s=self._stall_s,
                             staging_gbps=self._staging_gbps, staged_s=self._staged_s,
                             limit_wait_s=self._limit_wait_s)
        write_s = w.write_s or 0.0  # None when the writer died after committing
        return SaveStats(
            path=self._path,
            nbytes=w.nbytes,
            stall_s=self._stall_s,
            staging_gbps=self._staging_gbps,
            persist_s=w.persist_s,
            persist_gbps=(w.nbytes / write_s / 1e9) if write_s > 0 else None,
            commit_s=w.commit_s,
            writer_peak_rss=w.writer_peak_rss,
            tiers=w.tiers,
            staged_s=self._staged_s,
            limit_wait_s=self._limit_wait_s,
        )

    def done(self) -> bool:
        """True once the save committed or failed."""
        self._try_sync(0)
        return self._future.done()

    def _try_sync(self, timeout: float | None) -> None:
        if self._sync is not None:
            self._sync(timeout)

    def result(self, timeout: float | None = None) -> SaveStats:
        """Block until committed and return the save's statistics.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (the save goes on).
            ZerostallError: the save failed, with the class it had in the writer (``StorageError``
                keeps its errno; ``WriterError`` if the writer died); nothing of it is committed.
                Raising it here counts as receiving it: the next save, ``wait()`` or ``close()``
                does not raise it again as a ``BackgroundSaveError``.
        """
        if timeout is not None:
            check_number("timeout", timeout)
        self._try_sync(timeout)
        try:
            self._future.result(timeout)
        except BaseException as exc:
            if self._future.done():  # the save's own error, not the timeout
                self._received = True
            elif isinstance(exc, futures.TimeoutError):  # it has no message: say what timed out
                raise TimeoutError(f"{self._path}: not committed within {timeout} s (the save goes on)") from None
            raise
        return self.stats

    def wait_staged(self, timeout: float | None = None) -> None:
        """Return once every byte of this save is in host memory (the state may then be changed freely).

        With overlapped staging (the default), ``save_*_async`` returns before the tensors that
        only ``optimizer.step()`` modifies are copied, and the next ``step()`` waits for them by
        itself. Call this before modifying such tensors in place *outside* ``step()`` (weight
        clipping, an EMA written into the parameters, ``load_state_dict``); otherwise the save
        fails with :class:`~zerostall.errors.TornSnapshotError` (a write through ``.data`` waits
        for the copy by itself instead; docs/guarantees.md lists every case). A failed copy is reported by
        :meth:`result`, not here. Without a ``timeout``, the calling thread copies the part of
        the CPU copy the background has not started yet, rather than only wait for it.

        ``jax.Array`` leaves are all copied in the background: call this before a step that
        donates them (``donate_argnums``), otherwise a leaf donated before its copy fails the save
        with :class:`~zerostall.errors.DonatedArrayError`.

        Example::

            >>> r = ckpt.save_pytree_async(step, {"model": model, "optim": opt})  # doctest: +SKIP
            >>> r.wait_staged()                                                   # doctest: +SKIP
            >>> with torch.no_grad(): model.weight.clamp_(-1, 1)                  # doctest: +SKIP

        Raises:
            TimeoutError: the copy did not finish within ``timeout`` seconds (it goes on).
            InvalidArgumentError: ``timeout`` is not None or a finite number >= 0.
        """
        timeout = check_timeout("timeout", timeout, path=self._path)
        if self._help_stage is not None and timeout is None and not self._staged.is_set():
            self._help_stage()  # this thread copies too, rather than wait on a background thread alone
        self._try_sync(timeout)
        if not self._staged.wait(timeout):
            raise TimeoutError(f"{self._path}: staging did not finish within {timeout} s")

    def staged(self) -> bool:
        """True once every byte of this save is in host memory (see :meth:`wait_staged`)."""
        self._try_sync(0)
        return self._staged.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None if it committed); returning it counts as receiving it."""
        if timeout is not None:
            check_number("timeout", timeout)
        self._try_sync(timeout)
        exc = self._future.exception(timeout)
        if exc is not None:
            self._received = True
        return exc

    def _wait(self, timeout: float | None = None) -> None:
        """Wait for the outcome without receiving it (``Engine.wait``: the error stays unreceived)."""
        self._try_sync(timeout)
        futures.wait([self._future], timeout)

    def add_done_callback(self, fn: Callable[[Response], Any]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def _add_before_done(self, hook: Callable[[Response, BaseException | None], None]) -> None:
        """Run ``hook(response, error)`` before ``result()`` returns; at once if already finished.

        A small save can commit before ``save_*_async`` has returned to the code that adds the
        hook (the writer's listener thread finishes it), so a late hook runs on the caller's
        thread instead of being lost.
        """
        with self._hooks_lock:
            if not self._finished:
                self._before_done.append(hook)
                return
        _run_hook(hook, self, self._error)

    def _finish(self, writer_stats: WriterStats | None, error: BaseException | None) -> None:
        with self._hooks_lock:
            if self._finished:
                return
            self._finished = True
            self._error = error
            if error is None:
                self._writer = writer_stats
            hooks = list(self._before_done)
        for hook in hooks:
            _run_hook(hook, self, error)
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(None)


def _run_hook(hook: Callable[[Response, BaseException | None], None], r: Response,
              error: BaseException | None) -> None:
    try:
        hook(r, error)
    except Exception:  # noqa: BLE001,S110 - a bookkeeping hook must not lose the save's outcome
        pass
