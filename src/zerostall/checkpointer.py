"""``Checkpointer``: numbered steps in one directory, retention, latest, for training loops."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from typing import Any

from zerostall.api import PYTREE, load_newest_valid
from zerostall.commit import committed_steps, parse_step, remove_stale_attempts, step_name
from zerostall.distributed import DistContext, active, agree_step, load
from zerostall.engine import Engine
from zerostall.errors import CheckpointNotFoundError, NoValidCheckpointError, ZerostallError
from zerostall.options import DistributedOptions, LoadOptions, RetentionPolicy, SaveOptions
from zerostall.response import Response, SaveStats
from zerostall.restore import verify_checkpoint
from zerostall.storage import local_path, open_storage

__all__ = ["Checkpointer"]

log = logging.getLogger("zerostall")


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

    Raises:
        ValueError: an argument is out of range.
        StorageError: the directory cannot be created.

    The writer process starts here, so the first save does not pay for it. Partial saves left by
    writers that died (on this host) are removed here. Saves are
    unconditional: call :meth:`should_save` to follow the interval. Use as a context manager;
    leaving it waits for in-flight saves.

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
    ) -> None:
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every_n_steps=keep_every_n_steps)
        if save_interval_steps is not None and save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1 or None, got {save_interval_steps}")
        self.directory = os.fspath(directory)
        local = local_path(self.directory)
        if local is not None:
            os.makedirs(local, exist_ok=True)
            self.directory = local
        self.save_interval_steps = save_interval_steps
        if process_group is not None:
            so, lo = save_options or SaveOptions(), load_options or LoadOptions()
            save_options = dataclasses.replace(so, distributed=dataclasses.replace(
                so.distributed or DistributedOptions(), process_group=process_group))
            load_options = dataclasses.replace(lo, distributed=dataclasses.replace(
                lo.distributed or DistributedOptions(), process_group=process_group))
        self.load_options = load_options
        self._storage = open_storage(self.directory)
        if self._storage.atomic_rename:
            remove_stale_attempts(self._storage)  # partial saves of writers that died
        so = save_options or SaveOptions()
        self._engine = Engine(so, prewarm=True, coordinator=DistContext(so.distributed))
        self._committed: deque[Response] = deque(maxlen=100)
        #: the step the last successful ``load_*`` read (with ``fallback=True``, the one it fell back to)
        self.last_loaded_step: int | None = None

    # -- saving ------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether ``step`` falls on the save interval."""
        return self.save_interval_steps is None or step % self.save_interval_steps == 0

    def prepare(self, items: dict[str, Any] | None = None, *, tree: Any = None) -> int:
        """Allocate the staging buffers for this state's layout now, so the first save only copies.

        Pass the same ``items`` (or ``tree=`` for ``save_pytree``) you will save, once it has its
        final layout (optimizers create their state at their first step). Returns the bytes
        allocated per in-flight slot times ``max_in_flight``. Optional: without it the first
        save allocates.
        """
        if (items is None) == (tree is None):
            raise ValueError("pass exactly one of items or tree=")
        return self._engine.prepare(dict(items) if items is not None else {PYTREE: tree})

    def save_checkpointables_async(self, step: int, items: dict[str, Any], *,
                                   metadata: dict[str, Any] | None = None) -> Response:
        """Stage ``items`` as ``step`` and return; commit (and retention) follow in the background.

        Raises:
            ValueError: ``step`` is not a non-negative int.
            The errors of :func:`zerostall.save_checkpointables_async` (``step`` exists: ``CheckpointExistsError``).
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        meta = dict(metadata or {}, step=step)
        r = self._engine.save_async(self.directory, step_name(step), dict(items), metadata=meta, step=step,
                                    retention=self.retention)
        r._add_before_done(self._record)
        return r

    def save_checkpointables(self, step: int, items: dict[str, Any], *, metadata: dict[str, Any] | None = None) -> None:
        self.save_checkpointables_async(step, items, metadata=metadata).result()

    def save_pytree_async(self, step: int, tree: Any, *, metadata: dict[str, Any] | None = None) -> Response:
        return self.save_checkpointables_async(step, {PYTREE: tree}, metadata=metadata)

    def save_pytree(self, step: int, tree: Any, *, metadata: dict[str, Any] | None = None) -> None:
        self.save_pytree_async(step, tree, metadata=metadata).result()

    def _record(self, r: Response, exc: BaseException | None) -> None:
        if exc is None:
            self._committed.append(r)

    def stats(self) -> list[SaveStats]:
        """Statistics of the most recent committed saves (up to 100), oldest first."""
        # Read when asked, not when recorded: a save can commit before its stall is set.
        return [r.stats for r in list(self._committed)]

    # -- loading -----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending. In-flight and partial saves are never listed."""
        return committed_steps(self._storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        s = self.steps()
        return s[-1] if s else None

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            dopts = self.load_options.distributed if self.load_options is not None else None
            if active(dopts):  # every rank loads the step rank 0 sees as latest
                step = agree_step(step, dopts)
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
        if fallback:
            name, out = load_newest_valid(self.directory, self._fallback_names(step), items, self.load_options)
            self.last_loaded_step = parse_step(name)
            return out
        resolved = self._resolve(step)
        out = load(self.directory, step_name(resolved), items, self.load_options)
        self.last_loaded_step = resolved
        return out

    def load_pytree(self, step: int | None = None, template: Any = None, *, fallback: bool = False) -> Any:
        """Load ``step`` (default: latest committed) into ``template`` in place, if given.

        ``fallback=True``: the newest step from ``step`` down that loads (see :meth:`load_checkpointables`).
        """
        return self.load_checkpointables(step, {PYTREE: template}, fallback=fallback)[PYTREE]

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
            answer = self._verify_newest_first() if dist.get_rank(group) == 0 else None
            agreed: tuple[int | None, list[str]] = agree_step(answer, dopts)
            step, failures = agreed
        else:
            step, failures = self._verify_newest_first()
        if step is None and failures:
            raise NoValidCheckpointError(f"no committed step verifies ({len(failures)} checked, newest first: "
                                         f"{'; '.join(failures)})", path=self.directory)
        return step

    def _verify_newest_first(self) -> tuple[int | None, list[str]]:
        failures: list[str] = []
        for s in reversed(self.steps()):
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
        """Block until every in-flight save has committed or failed."""
        self._engine.wait(timeout)

    def close(self) -> None:
        """Wait for in-flight saves, then stop the writer and free the buffers."""
        self._engine.close()

    @property
    def keep_last(self) -> int | None:
        return self.retention.keep_last

    @property
    def keep_every_n_steps(self) -> int | None:
        return self.retention.keep_every_n_steps

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
