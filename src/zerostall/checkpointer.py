"""``Checkpointer``: numbered steps in one directory, retention, latest, for training loops."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections import deque
from typing import Any

from zerostall.api import PYTREE
from zerostall.commit import committed_steps, remove_stale_attempts, step_name
from zerostall.distributed import DistContext, active, agree_step, load
from zerostall.distributed.load import gather_objects, raise_together
from zerostall.engine import Engine
from zerostall.errors import CheckpointNotFoundError
from zerostall.options import DistributedOptions, LoadOptions, MemoryTier, RetentionPolicy, SaveOptions, WriterKind
from zerostall.persist.keeper import KeeperSpec
from zerostall.response import Response, SaveStats
from zerostall.restore import load_items
from zerostall.storage import local_path, open_storage
from zerostall.storage.image import open_image

__all__ = ["Checkpointer"]


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
        memory_tier: checkpoint every save into this host's memory and persist only some (see
            :class:`MemoryTier`); a restarted trainer of the same directory and rank on this host
            then restores the newest step from memory. Needs the process writer.

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
        memory_tier: MemoryTier | None = None,
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
        self.memory_tier = memory_tier
        keeper: KeeperSpec | None = None
        if memory_tier is not None:
            if not isinstance(memory_tier, MemoryTier):
                raise TypeError(f"memory_tier must be a MemoryTier, got {memory_tier!r}")
            if so.writer is not WriterKind.PROCESS:
                raise ValueError("the memory tier needs the process writer (SaveOptions(writer=WriterKind.PROCESS)): "
                                 "the memory must outlive the trainer")
            keeper = KeeperSpec(root=self.directory, rank=_keeper_rank(so.distributed), linger_s=memory_tier.linger_s)
        self._last_persist = time.monotonic()
        self._engine = Engine(so, prewarm=True, coordinator=DistContext(so.distributed), keeper=keeper)
        self._committed: deque[Response] = deque(maxlen=100)

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
        if self.memory_tier is not None:
            persist = self._persists(step)
            r = self._engine.save_async(self.directory, step_name(step), dict(items), metadata=meta, step=step,
                                        retention=self.retention, memory=True, persist=persist)
            if persist:
                self._last_persist = time.monotonic()
            r._add_before_done(self._record)
            return r
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

    def _persists(self, step: int) -> bool:
        """Whether a memory-tier save of ``step`` also goes to storage."""
        mt = self.memory_tier
        assert mt is not None
        if step % mt.persist_interval_steps == 0:
            return True
        if mt.persist_interval_s is None:
            return False
        dopts = self._engine.options.distributed
        if active(dopts):
            raise ValueError("MemoryTier(persist_interval_s=...) cannot be used under torch.distributed: the "
                             "ranks must agree on which saves persist; use persist_interval_steps")
        return time.monotonic() - self._last_persist >= mt.persist_interval_s

    def _record(self, r: Response, exc: BaseException | None) -> None:
        if exc is None:
            self._committed.append(r)

    def stats(self) -> list[SaveStats]:
        """Statistics of the most recent committed saves (up to 100), oldest first."""
        # Read when asked, not when recorded: a save can commit before its stall is set.
        return [r.stats for r in list(self._committed)]

    # -- loading -----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (with a memory tier: storage's and the one this host's memory
        holds). In-flight and partial saves are never listed."""
        out = committed_steps(self._storage)
        mem = self.memory_step()
        if mem is not None and mem not in out:
            out = sorted([*out, mem])
        return out

    def latest_step(self) -> int | None:
        """The newest committed step (in either tier), or None.

        With a memory tier under torch.distributed this is collective (every rank calls it) and
        every rank gets the same answer: the memory tier's step if every rank holds it and it is
        not older than storage's newest, else storage's newest.
        """
        if self.memory_tier is not None and active(self._load_dopts()):
            return self._agree(None)[0]
        s = self.steps()
        return s[-1] if s else None

    def _load_dopts(self) -> DistributedOptions | None:
        return self.load_options.distributed if self.load_options is not None else None

    def _agree(self, step: int | None) -> tuple[int | None, bool]:
        """Collectively: which step to load (``step``, or the latest) and whether every rank
        reads it from its memory tier (only if every rank holds it; else storage for all)."""
        dopts = self._load_dopts()
        stored = committed_steps(self._storage)
        gathered = gather_objects((self.memory_step(), stored[-1] if stored else None), dopts)
        held = [g[0] for g in gathered]
        everywhere = held[0] if held[0] is not None and all(h == held[0] for h in held) else None
        newest_stored = gathered[0][1]  # rank 0's view of the shared storage, as agree_step
        if step is None:
            if everywhere is not None and (newest_stored is None or everywhere >= newest_stored):
                return everywhere, True
            return newest_stored, False
        return step, everywhere == step

    def memory_step(self) -> int | None:
        """The step this host's memory tier holds (None: no memory tier, or nothing held).

        Waits for the saves already handed to the writer to finish first.
        """
        if self.memory_tier is None or self._engine.closed:  # closed: the keeper has exited
            return None
        got = self._engine.writer.query_image()
        if got is None:
            return None
        img, fds = got
        for fd in fds:
            os.close(fd)
        return img.step

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            dopts = self.load_options.distributed if self.load_options is not None else None
            if active(dopts):  # every rank loads the step rank 0 sees as latest
                step = agree_step(step, dopts)
            if step is None:
                raise CheckpointNotFoundError("no committed step to load", path=self.directory)
        return step

    def load_checkpointables(self, step: int | None = None, items: dict[str, Any] | None = None) -> dict[str, Any]:
        """Load ``step`` (default: latest committed); see :func:`zerostall.load_checkpointables`.

        Raises:
            CheckpointNotFoundError: no step is committed (or not ``step``).
            The errors of :func:`zerostall.load_checkpointables`.
        """
        if self.memory_tier is not None and active(self._load_dopts()):
            return self._load_collective(step, items)
        step = self._resolve(step)
        if self.memory_tier is not None:
            got = self._load_from_memory(step, items)
            if got is not None:
                return got
        return load(self.directory, step_name(step), items, self.load_options)

    def _load_collective(self, step: int | None, items: dict[str, Any] | None) -> dict[str, Any]:
        """A collective load with a memory tier: every rank from its own memory, or all from storage."""
        agreed, from_memory = self._agree(step)
        if agreed is None:
            raise CheckpointNotFoundError("no committed step to load", path=self.directory)
        if not from_memory:
            return load(self.directory, step_name(agreed), items, self.load_options)
        out: dict[str, Any] | None = None
        err: BaseException | None = None
        try:
            out = self._load_from_memory(agreed, items, collective=True)
            if out is None:  # the keeper let go of it since we agreed (it died)
                raise CheckpointNotFoundError("the memory tier no longer holds this step",
                                              path=f"{self.directory}/{step_name(agreed)}")
        except BaseException as exc:  # noqa: BLE001 - raised on every rank below
            err = exc
        raise_together(err, self._load_dopts(), f"{self.directory}/{step_name(agreed)}")
        assert out is not None
        return out

    def _load_from_memory(self, step: int, items: dict[str, Any] | None, *,
                          collective: bool = False) -> dict[str, Any] | None:
        """Load ``step`` from this host's memory tier if it holds it (verified as from storage).

        Under torch.distributed only as part of :meth:`_load_collective` (``collective``): each
        rank then restores the tree it saved from its own memory, with no collective traffic.
        """
        if not collective and active(self._load_dopts()):
            return None
        got = self._engine.writer.query_image() if not self._engine.closed else None
        if got is None:
            return None
        img, fds = got
        if img.step != step:
            for fd in fds:
                os.close(fd)
            return None
        files = [(f.name, f.length, f.size, fd) for f, fd in zip(img.files, fds, strict=True)]
        with open_image(img.name, img.manifest.encode(), files) as image:
            return load_items(image.url, img.name, items, self.load_options)

    def load_pytree(self, step: int | None = None, template: Any = None) -> Any:
        """Load ``step`` (default: latest committed) into ``template`` in place, if given."""
        return self.load_checkpointables(step, {PYTREE: template})[PYTREE]

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

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None and self.memory_tier is not None and not self._engine.closed:
            # Leaving on an error (torchrun's SIGTERM included) is a crash to the memory tier: the
            # keeper keeps the newest step for a restart instead of persisting it and exiting.
            self._engine.wait()
            self._engine.writer.abandon()
        self.close()


def _keeper_rank(dopts: DistributedOptions | None) -> int:
    """This process's rank for the keeper's name: torch.distributed's if initialized, else
    torchrun's ``RANK``, else 0 (the same on a restart, so the restarted rank finds its keeper)."""
    torch = sys.modules.get("torch")
    if active(dopts) and torch is not None:
        return int(torch.distributed.get_rank(dopts.process_group if dopts is not None else None))
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
