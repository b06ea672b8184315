"""The training-thread side of collective saves: who we are, the run id, the save counter.

Runs on the training thread. The only collective here is one exchange (bounded by
``timeout_s``: :mod:`zerostall.distributed.exchange`) at an engine's first collective save (the run id from rank 0, and a check that every rank saves the
same path); every later save derives its attempt's names locally from ``(run id, counter)``.
"""

from __future__ import annotations

import sys
import threading
import uuid
from typing import Any

from zerostall.commit.agreement import abort_doc, attempt_names, decide, error_of, wait_for_outcome
from zerostall.distributed.exchange import gather
from zerostall.errors import ZerostallError
from zerostall.messages import Collective, WriterStats
from zerostall.options import DistributedOptions
from zerostall.persist.client import OnDone
from zerostall.storage import open_storage

__all__ = ["DistContext", "active", "group_rank_world", "agree_steps"]


def active(opts: DistributedOptions | None) -> bool:
    """Whether saves and loads with ``opts`` act collectively right now."""
    if opts is not None and not opts.enabled:
        return False
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def group_rank_world(opts: DistributedOptions | None) -> tuple[Any, int, int]:
    import torch.distributed as dist

    group = opts.process_group if opts is not None else None
    return group, dist.get_rank(group), dist.get_world_size(group)


class DistContext:
    """The :class:`~zerostall.engine.Coordinator` of one engine's collective saves."""

    def __init__(self, opts: DistributedOptions | None) -> None:
        self.opts = opts or DistributedOptions()
        self._rank: int | None = None
        self.world = 1
        self.group: Any = None
        self.run: str | None = None
        self.counter = 0

    def active(self) -> bool:
        return active(self.opts)

    @property
    def rank(self) -> int:
        if self._rank is None:
            self.group, self._rank, self.world = group_rank_world(self.opts)
        return self._rank

    def begin(self, root_url: str, name: str, timeout_s: float | None = None) -> Collective:
        """Number this save; at the first one, agree on the run id (the only collective).
        ``timeout_s`` bounds this save's waits below ``DistributedOptions.timeout_s``."""
        rank = self.rank
        if self.run is None:
            gathered = gather((uuid.uuid4().hex[:12], f"{root_url.rstrip('/')}/{name}"), self.opts,
                              what="the first collective save", path=f"{root_url.rstrip('/')}/{name}")
            paths = {g[1] for g in gathered}
            if len(paths) != 1:
                raise ValueError(f"a collective save needs the same path on every rank, got {sorted(paths)}")
            self.run = str(gathered[0][0])
        self.counter += 1
        bound = self.opts.timeout_s if timeout_s is None else min(self.opts.timeout_s, timeout_s)
        return Collective(rank=rank, world=self.world, run=self.run, counter=self.counter,
                          timeout_s=bound, poll_s=self.opts.poll_s)

    def abort(self, root_url: str, name: str, info: Collective, path: str, exc: BaseException) -> None:
        """Decide "abort" for a save that failed on this rank's training thread."""
        try:
            storage = open_storage(root_url)
            decide(storage, attempt_names(storage, name, info.run, info.counter), abort_doc(exc, info.rank, path))
        except Exception:  # noqa: BLE001,S110 - the other ranks time out instead
            pass

    def on_done(self, root_url: str, name: str, info: Collective, path: str, finish: OnDone) -> OnDone:
        """Wrap a response's ``finish``: on any local failure (the writer died, say) follow the
        attempt's decision, deciding "abort" first if no rank has, so every rank ends the same."""

        def done(stats: WriterStats | None, err: BaseException | None) -> None:
            if err is None:
                finish(stats, None)
                return
            threading.Thread(target=resolve, args=(err,), name="zerostall-dist-resolve", daemon=True).start()

        def resolve(err: BaseException) -> None:
            try:
                storage = open_storage(root_url)
                names = attempt_names(storage, name, info.run, info.counter)
                dec = decide(storage, names, abort_doc(err, info.rank, path))
                if dec.get("decision") == "abort":
                    finish(None, error_of(dec))
                    return
                wait_for_outcome(storage, names, timeout_s=info.timeout_s, poll_s=self.opts.poll_s,
                                 rank=info.rank, path=path)
                finish(WriterStats(nbytes=0), None)
            except BaseException as exc:  # noqa: BLE001 - every path ends the response
                # A typed error of the agreement (a timeout naming the late rank) says more than the
                # local one; if the storage itself failed here, the local error (typed) stands.
                finish(None, exc if isinstance(exc, ZerostallError) else err)

        return done


def agree_steps(local: list[int], opts: DistributedOptions | None) -> list[int]:
    """The steps committed in *every* rank's view of the storage, on every rank (one ``all_gather_object``).

    Ranks can see different things (a step removed from one node's directory, a lagging
    filesystem cache): a step only some ranks see cannot be loaded by all of them, so it is
    not offered to any. Runs on the training thread of every rank of the group: every rank must call it.
    """
    gathered = gather([int(s) for s in local], opts, what="listing the steps every rank sees")
    common = set(gathered[0]).intersection(*gathered[1:])
    return sorted(common)
