"""The trainer's side of the memory tier: what this host's keeper holds, and loading from it.

A :class:`~zerostall.Checkpointer` with a memory tier holds one :class:`MemorySide` and delegates
every question about memory to it: the step the keeper holds and its metadata, a load from it
(alone, or collectively: every rank from its own memory when every rank holds the step), the
keeper-failure markers and warnings to report, and the adopted step pre-mapped at construction
(:mod:`zerostall.memtier.premap`). The Checkpointer keeps the steps, retention and the public API.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import mmap
import os
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from zerostall.commit import check_reachable, committed_steps, step_name
from zerostall.distributed import active
from zerostall.distributed.context import group_rank_world
from zerostall.distributed.load import agree_step, gather_objects, raise_first, raise_together, wire_error
from zerostall.engine import Engine
from zerostall.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    KeeperPersistError,
    PeerUnreachableError,
    ReplicaError,
    StorageError,
    ZerostallError,
    ZerostallWarning,
)
from zerostall.format.manifest import Manifest, parse_manifest
from zerostall.lease import host_id
from zerostall.memtier.client import KeeperSide
from zerostall.memtier.image import ImageStorage, open_image
from zerostall.memtier.instance import ensure_instance, read_instance
from zerostall.memtier.keeperfail import take_markers
from zerostall.memtier.messages import ReplicaSetup
from zerostall.memtier.paritypeers import group_name
from zerostall.memtier.peers import RECEIVER, SENDER, open_store, pair_group
from zerostall.memtier.placement import parity_groups
from zerostall.memtier.premap import Premap
from zerostall.memtier.rebuild import PARITY, receive_rebuild, serve_rebuild
from zerostall.memtier.replica import OutgoingStep, ReplicaOf, Scatter
from zerostall.memtier.spec import KeeperSpec
from zerostall.options import DistributedOptions, LoadOptions, MemoryTier, SaveOptions, WriterKind
from zerostall.persist.client import WriterClient
from zerostall.restore import load_items
from zerostall.restore.files import ArrivedFiles
from zerostall.restore.load import assemble, plan_items
from zerostall.restore.plan import ReadPlanner, ReadRequest, Thunk
from zerostall.restore.sources import Loaded, Source
from zerostall.storage import Storage, open_storage
from zerostall.storage.release import unmap_later

__all__ = ["MemorySide", "plan_steps"]

log = logging.getLogger("zerostall")


class MemorySide:
    """The memory tier as the trainer sees it, through ``engine``'s writer (the keeper)."""

    @staticmethod
    def writer_for(directory: str, tier: MemoryTier, options: SaveOptions, *, read_only: bool
                   ) -> tuple[WriterClient, KeeperSide]:
        """The writer of a Checkpointer of ``directory`` with ``tier``: a keeper of this directory and
        rank, adopted or started (the directory's instance marker is written first unless
        ``read_only``), and its side, which the Checkpointer's :class:`MemorySide` then holds.

        Raises:
            InvalidArgumentError: ``options`` asks for a thread writer (the memory must outlive the trainer).
            StorageError: storage cannot be read (or written) now (see :func:`directory_instance`).
        """
        if options.writer is not WriterKind.PROCESS:
            raise InvalidArgumentError("the memory tier needs the process writer (SaveOptions(writer=WriterKind.PROCESS)): "
                                       "the memory must outlive the trainer", path=directory, argument="memory_tier")
        spec = KeeperSpec(root=directory, rank=keeper_rank(options.distributed), linger_s=tier.linger_s,
                          instance=directory_instance(directory, create=not read_only))
        side = KeeperSide(spec)
        return WriterClient(options.writer, nice=options.writer_nice, sched=options.writer_sched, side=side), side

    def __init__(self, engine: Engine, keeper: KeeperSide, storage: Storage, directory: str,
                 load_options: LoadOptions | None, dist: DistributedOptions | None, *, markers_due: bool) -> None:
        self._engine, self._storage, self.directory = engine, storage, directory
        #: this trainer's keeper, as its writer client's side
        self.keeper = keeper
        self.load_options, self.dist = load_options, dist
        #: the keeper-failure markers of this directory and rank are still to be taken (see take_markers)
        self.markers_due = markers_due
        #: an adopted keeper's step, mapped and pre-faulted in the background for the first load
        #: (memtier.premap); released by the next save or close()
        self.premap: Premap | None = None
        #: replication settings (None: no replicas), told to every keeper this trainer has
        self.replicas: ReplicaSetup | None = None
        self.instance = ""
        #: after the last :meth:`agreed_steps`: step -> per rank, the ranks whose keepers hold its share
        self._sources: dict[int, list[list[int]]] | None = None
        self._stored: list[int] = []
        self._transfers = 0

    # -- replicas ------------------------------------------------------------------------------

    def setup_replicas(self, replicas: int, instance: str, timeout_s: float, *, in_place: bool = False,
                       parity: bool = False, parity_group: int | None = None) -> None:
        """Collectively (at construction): check the hosts, agree on the job's keeper group and
        its secret, and tell this rank's keeper (and every keeper it has later) how to replicate
        (``replicas``) or form parity (``parity``: groups of ``parity_group`` hosts,
        :func:`~zerostall.memtier.placement.parity_groups`).

        The secret is made by rank 0 (``secrets.token_bytes``) and broadcast over the job's
        process group; each trainer hands it to its own keeper over their private unix socket.
        It is never written anywhere (not to the checkpoint directory, not to the store).

        Raises:
            InvalidArgumentError: not under torch.distributed, one host only, hosts that do not
                hold equally many consecutive ranks, or no ``MASTER_ADDR``/``MASTER_PORT``.
        """
        what = "parity" if parity else "replicas"
        if not active(self.dist):
            raise InvalidArgumentError(f"MemoryTier({what}=...) needs torch.distributed: {what} go to the keepers "
                                       "of other hosts' ranks", argument=what, path=self.directory)
        _, rank, world = group_rank_world(self.dist)
        hosts = gather_objects(host_id(), self.dist)
        per_host = _ranks_per_host(hosts, self.directory)
        n_hosts = len(set(hosts))
        group = 0
        if parity:
            if n_hosts < 2:
                raise InvalidArgumentError(
                    f"MemoryTier(parity=1) needs at least 2 hosts, but the job's {world} ranks run on one "
                    f"({hosts[0]}): parity on its own host is lost with it", argument="parity", path=self.directory)
            groups = parity_groups(world, per_host, parity_group)  # raises for a parity_group past the hosts
            group = parity_group if parity_group is not None else len(groups[0])
        elif n_hosts < replicas + 1:
            raise InvalidArgumentError(
                f"MemoryTier(replicas={replicas}) needs {replicas + 1} hosts, but the job's {world} ranks run on "
                f"{n_hosts} ({', '.join(sorted(set(hosts)))}): a replica on its original's host is lost with it, and "
                "one host gains nothing from replicas; use replicas=0 there", argument="replicas", path=self.directory)
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise InvalidArgumentError(f"MemoryTier({what}=...) needs the job's store at MASTER_ADDR:MASTER_PORT "
                                       "(torchrun sets both) for the keepers to find each other",
                                       argument=what, path=self.directory)
        mine = (secrets.token_hex(8), secrets.token_hex(32)) if rank == 0 else None
        job, secret = agree_step(mine, self.dist)
        self.replicas = ReplicaSetup(store=f"{addr}:{port}", job=str(job), secret=str(secret), world=world, rank=rank,
                                     ranks_per_host=per_host, replicas=replicas, timeout_s=timeout_s,
                                     in_place=in_place, parity_group=group)
        self.instance = instance
        self.keeper.set_replica_setup(self.replicas)
        # The keeper takes the setup in order, before this query: once answered, its receivers
        # are up (torch imported: about a second of CPU for a new keeper). Waited for here, with
        # the job's start-up, rather than left to compete with the restore or first save that follows.
        # A keeper that does not answer within the job's timeout holds the constructor no longer:
        # said here, and what follows (a save, a load) finds it dead or slow and reports it there.
        if self.held_image(timeout_s) is None:  # a keeper always answers with an image, empty or not
            log.warning("zerostall: rank %d's memory-tier keeper did not answer within %.0f s of taking the replica "
                        "setup for %s; its saves and loads will say what became of it", rank, timeout_s,
                        self.directory)

    def _views(self, storage_steps: list[int]) -> list[tuple[list[int], int | None, dict[int, int], int | None]]:
        """Every rank's (storage steps, held step, {origin: replica step held}, step of the parity
        held): one exchange (a rank whose keeper hangs asks it until ``timeout_s``; the others
        wait that out, then ``timeout_s``)."""
        deadline = time.monotonic() + self._timeout_s()
        img = self.held_image(self._timeout_s()) if not self._engine.closed else None
        mem = img.step if img is not None else None
        reps = {r.origin: r.step for r in img.replicas} if img is not None else {}
        par = img.parity_step if img is not None else None
        out: list[tuple[list[int], int | None, dict[int, int], int | None]] = [
            (s, m, {int(k): v for k, v in r.items()}, p) for s, m, r, p in gather_objects(
                (storage_steps, mem, reps, par), self.dist, what="listing the steps in memory", after=deadline)]
        return out

    def agreed_steps(self, storage_steps: list[int]) -> list[int]:
        """Collectively, with replicas: the steps every rank can load, from storage, its own memory
        or a replica of its step in another keeper's memory (one all_gather_object). Remembers
        where each rank's share of each memory step is, for the load that follows."""
        setup = self.replicas
        groups = parity_groups(setup.world, setup.ranks_per_host, setup.parity_group) \
            if setup is not None and setup.parity_group else None
        stored, sources = plan_steps(self._views(storage_steps), groups)
        self._sources, self._stored = sources, stored
        return sorted(set(stored) | set(sources))

    def load_replicated(self, agreed: int, items: dict[str, Any] | None) -> dict[str, Any] | int | None:
        """A collective load of ``agreed`` with replicas: each rank from the first of its sources
        that delivers (its own keeper's memory, then each keeper holding a replica of its share,
        in placement order), received over the job's authenticated group and verified against
        every leaf's CRC32C. The ranks go in rounds: in each, a rank whose share has not arrived
        tries its next source while the holders serve; a source that fails (its keeper died,
        hung or let go of the step, a checksum, another run's or topology's replica) is told (a
        WARNING and an entry in ``keeper_failures``, on every rank) and the next one is tried in
        the next round; when a share has no source left, every rank loads storage's newest step
        instead. Every wait is bounded by ``DistributedOptions(timeout_s)``, so a round ends
        within it whatever a peer does. A failure of the request itself (a template that does
        not match) is raised on every rank."""
        sources = self._sources
        if sources is None or (agreed not in sources and agreed not in self._stored):
            self.agreed_steps(committed_steps(self._storage))  # a step given by the caller: plan it now
            sources = self._sources
            assert sources is not None
        if agreed not in sources:
            return None  # not a memory step: storage's
        plan = sources[agreed]
        _, rank, world = group_rank_world(self.dist)
        if all(p[0] == r for r, p in enumerate(plan)):
            return self.load_collective(agreed, items)
        tries = [0] * world  # per rank: its source now, an index into plan[rank]
        pending = set(range(world))  # the ranks whose share has not arrived
        into = _LoadInto(items, self.load_options, self.step_path(agreed))
        out: dict[str, Any] | None = None
        while pending:
            self._transfers += 1
            now = {r: plan[r][tries[r]] for r in sorted(pending)}
            deadline = time.monotonic() + (self.replicas.timeout_s if self.replicas is not None else self._timeout_s())
            got, err, fatal = self._round(agreed, now, rank, self._transfers, into, items, deadline)
            out = got if got is not None else out
            # One exchange per round: every rank's failure of the request, and which sources failed.
            # A rank that finished early waits for the others until the round's deadline, and then
            # timeout_s more: a live rank may be waiting for a hung source until that deadline.
            statuses = gather_objects((err, wire_error(fatal, rank, self.step_path(agreed))), self.dist,
                                      what="restoring from memory", step=agreed, after=deadline)
            raise_first([st[1] for st in statuses], rank, fatal)
            failed = {r: st[0] for r, st in enumerate(statuses) if st[0] is not None}
            for r, e in sorted(failed.items()):
                nxt = plan[r][tries[r] + 1] if tries[r] + 1 < len(plan[r]) else None
                then = None if nxt is None else "rebuilding it from its parity group" if nxt == PARITY \
                    else f"trying rank {nxt}'s keeper"
                self._tell(agreed, f"rank {r}: {e}", then)
                tries[r] += 1
            pending = set(failed)
            if any(tries[r] >= len(plan[r]) for r in pending):
                return self._fall_back(agreed)
        assert out is not None
        return out

    def _round(self, step: int, now: dict[int, int], rank: int, generation: int, into: _LoadInto,
               items: dict[str, Any] | None, deadline: float
               ) -> tuple[dict[str, Any] | None, str | None, BaseException | None]:
        """One round of :meth:`load_replicated`: serve the shares ``now`` asks of this rank's
        keeper (``now``: each pending rank -> the rank whose keeper it tries), each on a thread,
        and meanwhile get this rank's own share if it is pending: loaded from its own keeper, or
        received. Returns (this rank's tree, or None; why its source failed; a failure of the
        request itself, raised on every rank)."""
        setup = self.replicas
        assert setup is not None
        senders: list[threading.Thread] = []
        out: dict[str, Any] | None = None
        err: str | None = None
        fatal: BaseException | None = None
        source = now.get(rank)
        try:
            store = open_store(setup)
            # Every pair of this round forms, and every keeper answers, by the round's deadline (a
            # holder cut off, or hung, ends it); the transfers' own waits are each bounded by timeout_s.
            store.deadline = deadline
            mates = set(group_name(setup)[3]) if setup.parity_group else set()
            for r, holder in now.items():
                if holder == rank and r != rank:
                    t = threading.Thread(target=self._serve_replica,
                                         args=(store, setup, r, step, generation, deadline),
                                         name="zerostall-replica-serve", daemon=True)
                elif holder == PARITY and r != rank and r in mates:  # this rank survives r's loss
                    t = threading.Thread(target=serve_rebuild,
                                         args=(self.keeper, store, setup, r, step, generation, deadline),
                                         name="zerostall-parity-serve", daemon=True)
                else:
                    continue
                t.start()
                senders.append(t)
            if source == rank:  # this rank's own keeper, while the threads serve the others
                out = self.load_from_memory(step, items, collective=True,
                                            timeout_s=max(0.0, deadline - time.monotonic()))
                if out is None:
                    err = f"this host's keeper no longer holds step {step}, or did not answer within {setup.timeout_s:g} s"
            elif source == PARITY:
                got = receive_rebuild(store, setup, self.instance, step, generation)
                try:
                    out = self._load_received(got, step, items, into)
                finally:
                    got.close()
            elif source is not None:
                with pair_group(store, setup, f"fetch/{rank}", generation, RECEIVER) as g:
                    got = g.recv_step(SENDER, run_id=self.instance, world=setup.world, rank=rank, step=step,
                                      into=into)
                try:
                    out = self._load_received(got, step, items, into)
                finally:
                    got.close()
        except BaseException as exc:  # noqa: BLE001 - the next source is tried, or every rank raises it
            if _source_failed(exc):
                whose = ("its own keeper" if source == rank else "its parity group" if source == PARITY
                         else f"rank {source}'s keeper")
                err = f"its share of step {step} did not come from {whose}: {exc}"
            else:  # a failure of the request itself (a template that does not match)
                fatal = exc
        for t in senders:
            t.join()
        return out, err, fatal

    def _load_received(self, got: Any, step: int, items: dict[str, Any] | None, into: _LoadInto) -> dict[str, Any]:
        """The tree of a share received from a holder, verified as it arrived."""
        if got.scattered:  # received into the templates (and fresh arrays), verified: assemble
            assert into.thunks is not None
            return assemble(into.thunks, self.step_path(step))
        files = [(n, ln, b.size, os.dup(b.fd)) for n, ln, b in zip(got.names, got.lengths, got.buffers, strict=True)]
        # Every leaf matched its CRC32C as it arrived, into memory of this process that
        # nothing else writes: only the copy is left (as for a step the keeper verified).
        opts = dataclasses.replace(self.load_options or LoadOptions(), verify=False)
        with open_image(step_name(step), got.manifest, files) as image:
            return self.load_image(image, step, items, opts)

    def _serve_replica(self, store: Any, setup: ReplicaSetup, origin: int, step: int, generation: int,
                       deadline: float) -> None:
        """Send rank ``origin``'s step, as this rank's keeper holds it, to rank ``origin`` (this
        rank's keeper answering by ``deadline``)."""
        maps: list[mmap.mmap] = []
        try:
            got = self.keeper.query_image(max(0.0, deadline - time.monotonic()), origin=origin)
            if got is None or got[0].step != step:
                if got is not None:
                    for fd in got[1]:
                        os.close(fd)
                raise ReplicaError(f"this rank's keeper no longer holds rank {origin}'s step {step}" if got is not None
                                   else f"this rank's keeper did not answer within {setup.timeout_s:g} s")
            img, fds = got
            try:
                maps = [mmap.mmap(fd, f.size, mmap.MAP_SHARED, mmap.PROT_READ) for f, fd in zip(img.files, fds,
                                                                                             strict=True)]
            finally:
                for fd in fds:
                    os.close(fd)
            files = tuple((f.name, memoryview(m)[:f.length]) for f, m in zip(img.files, maps, strict=True))
            out = OutgoingStep(of=ReplicaOf(self.instance, setup.world, origin, step), manifest=img.manifest.encode(),
                               files=files)
            with pair_group(store, setup, f"fetch/{origin}", generation, SENDER) as g:
                g.send_step(RECEIVER, out)
        except (ZerostallError, RuntimeError, OSError) as exc:  # its receiver fails too, and says so
            log.warning("zerostall: rank %d's share of step %d was not sent from this rank's keeper: %s", origin,
                        step, exc)
        finally:
            for m in maps:
                unmap_later(m)

    def _tell(self, step: int, why: str, then: str | None) -> None:
        """A share of ``step`` did not come from memory: a WARNING and an entry in ``keeper_failures``."""
        older = self._stored[-1] if self._stored else None
        then = then or (f"loading step {older} from storage instead" if older is not None
                        else "storage holds no step to fall back to")
        err = KeeperPersistError(f"step {step} could not be restored from memory ({why}); {then}",
                                 path=self.step_path(step), step=step, cause=ReplicaError(why))
        self.keeper.keeper_failures.append(err)
        log.warning("zerostall: %s", err)

    def _fall_back(self, step: int) -> int:
        """A share of ``step`` is in no memory that could send it: storage's newest common step is
        the one to load instead (every rank the same).

        Raises:
            CheckpointNotFoundError: storage holds none.
        """
        older = self._stored[-1] if self._stored else None
        if older is None:
            raise CheckpointNotFoundError(f"no committed step to load: step {step} could not be restored from "
                                          "memory and storage holds none", path=self.directory)
        return older

    def sources(self) -> list[Source]:
        """Where a load finds a step in memory, in order, before storage (``restore.sources``):
        this host's keeper alone; or, under torch.distributed, every rank's own keeper (when every
        rank holds the step), or, with replicas, every rank's own keeper or a holder's replica."""
        if not active(self.dist):
            return [_Memory("this host's memory", lambda step, items: self.load_from_memory(step, items))]
        if self.replicas is not None:
            return [_Memory("the memory of this job's hosts", self.load_replicated)]
        return [_Memory("every rank's own memory", self.load_collective)]

    def start_premap(self) -> None:
        self.premap = Premap(self.keeper) if self._engine.writer.adopted else None

    def _timeout_s(self) -> float:
        """How long the trainer waits for its keeper's answer (a keeper that hung, SIGSTOP or
        swapping, holds no load longer): the job's ``DistributedOptions.timeout_s``."""
        return (self.dist or DistributedOptions()).timeout_s

    def step_path(self, step: int) -> str:
        return f"{self.directory.rstrip('/')}/{step_name(step)}"

    # -- what the keeper holds -----------------------------------------------------------------

    def memory_step(self) -> int | None:
        """The step this host's keeper holds (None: nothing held, or the keeper has exited)."""
        if self._engine.closed:
            return None
        img = self.held_image(self._timeout_s())
        return img.step if img is not None else None

    def held_image(self, timeout_s: float = 600.0) -> Any:
        """The keeper's description of the step it holds (its data descriptors closed), or None
        (also when the keeper does not answer within ``timeout_s``)."""
        got = self.keeper.query_image(timeout_s)
        if got is None:
            return None
        img, fds = got
        for fd in fds:
            os.close(fd)
        return img

    def memory_metadata(self) -> tuple[int, dict[str, Any]] | None:
        """The held step and its metadata (a memory-only step is in no storage manifest)."""
        img = self.held_image()
        if img is None or img.step is None:
            return None
        return img.step, dict(parse_manifest(img.manifest.encode(), path=self.step_path(img.step)).metadata)

    def held_everywhere(self, step: int) -> bool:
        """Collectively: whether every rank's memory tier holds ``step`` (one all_gather_object)."""
        deadline = time.monotonic() + self._timeout_s()
        return all(h == step for h in gather_objects(self.memory_step(), self.dist, what="listing the steps in memory",
                                                     step=step, after=deadline))

    # -- loading -------------------------------------------------------------------------------

    def load_collective(self, agreed: int, items: dict[str, Any] | None) -> dict[str, Any] | None:
        """A collective load: every rank from its own memory if every rank holds the step, else
        None on every rank (the next source: storage)."""
        if not self.held_everywhere(agreed):
            return None
        out: dict[str, Any] | None = None
        err: BaseException | None = None
        try:
            out = self.load_from_memory(agreed, items, collective=True)
            if out is None:  # the keeper let go of it since we agreed (it died)
                raise CheckpointNotFoundError("the memory tier no longer holds this step",
                                              path=self.step_path(agreed))
        except BaseException as exc:  # noqa: BLE001 - raised on every rank below
            err = exc
        raise_together(err, self.dist, self.step_path(agreed))
        assert out is not None
        return out

    def load_from_memory(self, step: int, items: dict[str, Any] | None, *,
                         collective: bool = False, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Load ``step`` from this host's memory tier if it holds it (verified as from storage, or
        already by the keeper after a crash: then the load only copies).

        Under torch.distributed only as part of :meth:`load_collective` (``collective``): each
        rank then restores the tree it saved from its own memory, with no collective traffic.
        """
        # The held step may be this trainer's own staging slot: a save on another thread must not
        # get it back to stage into while this load copies from it (KeeperSide.pin_held).
        writer = self.keeper
        writer.pin_held()
        try:
            return self._read_memory_step(step, items, collective=collective, timeout_s=timeout_s)
        finally:
            writer.unpin_held()

    def _read_memory_step(self, step: int, items: dict[str, Any] | None, *,
                          collective: bool = False, timeout_s: float | None = None) -> dict[str, Any] | None:
        """:meth:`load_from_memory`, with the held slots pinned."""
        if not collective and active(self.dist):
            return None
        bound = self._timeout_s() if timeout_s is None else timeout_s
        got = self.keeper.query_image(bound) if not self._engine.closed else None
        if got is None:
            return None
        img, fds = got
        if img.step != step:
            for fd in fds:
                os.close(fd)
            return None
        files = [(f.name, f.length, f.size, fd) for f, fd in zip(img.files, fds, strict=True)]
        opts = self.load_options
        if img.verified:
            # The keeper checked every leaf after the trainer that staged them died, and nothing
            # writes to them since (memtier.keeper): only the copy is left, all or nothing
            # whatever LoadOptions.atomic says: with no checksum to fail, what can still fail (a
            # key, shape or dtype the template does not match) is raised while planning, before
            # the first byte is copied.
            opts = dataclasses.replace(opts or LoadOptions(), verify=False)
        premap = self.premap  # a save on another thread may drop it meanwhile (premap.done)
        premapped = premap.take(img, fds) if premap is not None else None
        if premap is not None and premapped is not None:  # mapped (and pre-faulted) at adoption: kept
            try:
                return self.load_image(premapped, step, items, opts)
            finally:
                premap.done(premapped)
        with open_image(img.name, img.manifest.encode(), files) as image:
            return self.load_image(image, step, items, opts)

    def load_image(self, image: ImageStorage, step: int, items: dict[str, Any] | None,
                   opts: LoadOptions | None) -> dict[str, Any]:
        try:
            return load_items(image.url, image.name, items, opts)
        except ZerostallError as exc:
            _name_the_memory_step(exc, image.url, self.step_path(step))
            raise

    # -- what the keeper reports -----------------------------------------------------------------

    def warn_unadoptable(self, stacklevel: int) -> None:
        """Warn, on the training thread and once each, of a keeper that serves but cannot be adopted
        after a crash (its Hello said why; it is also in ``keeper_failures``)."""
        for err in self.keeper.take_unadoptable():
            warnings.warn(str(err), ZerostallWarning, stacklevel=stacklevel + 1)

    def take_markers(self) -> None:
        """Report (once) and remove the markers a keeper whose persist failed with no trainer to
        tell left for this directory and rank. Only once our keeper has said Hello: a trainer whose
        keeper lost the name to another trainer's (KeeperBusy, raised by the constructor or the next
        save) is not the one the failure is for, and must leave the markers to that one."""
        if not self.markers_due:
            return
        self.markers_due = False
        rank = self.keeper.keeper.rank
        for failure in take_markers(self._storage, self.directory, rank):
            self.keeper.note_keeper_failure(failure)

    def drop_premap(self) -> None:
        premap, self.premap = self.premap, None
        if premap is not None:
            premap.close()


def _name_the_memory_step(exc: ZerostallError, image_url: str, step_path: str) -> None:
    """Name the step as the user knows it, not by the internal ``zsimage://`` URL of the keeper's buffers."""
    if exc.path is not None and exc.path.startswith(image_url):
        exc.path = step_path
        exc.message = f"{exc.message} [read from this host's memory tier]"


class _Memory:
    """A source of ``restore.sources`` over one of :class:`MemorySide`'s loads (a tree, None:
    not held, or the older step to load instead)."""

    def __init__(self, name: str, load: Callable[[int, dict[str, Any] | None], dict[str, Any] | int | None]) -> None:
        self.name, self._load = name, load

    def load(self, step: int, items: dict[str, Any] | None) -> Loaded | int | None:
        got = self._load(step, items)
        return Loaded(step, got) if isinstance(got, dict) else got


def directory_instance(directory: str, *, create: bool) -> str:
    """The directory's instance id (:mod:`zerostall.memtier.instance`), its marker written first if
    ``create`` and it has none; empty when it has none (read-only).

    Raises:
        StorageError: storage cannot be read (or written) now: a keeper it might adopt cannot be
            told apart from one of a deleted directory at this path.
    """
    storage = open_storage(directory)
    try:
        return ensure_instance(storage) if create else (read_instance(storage) or "")
    except OSError as exc:
        check_reachable(storage, write=create, path=directory)  # the storage's own error, if it has one
        raise StorageError(f"cannot read the directory's instance marker: {exc}", path=directory,
                           errno=exc.errno) from exc


def keeper_rank(dopts: DistributedOptions | None) -> int:
    """This process's rank for the keeper's name: torch.distributed's if initialized, else
    torchrun's ``RANK``, else 0 (the same on a restart, so the restarted rank finds its keeper)."""
    torch = sys.modules.get("torch")
    if active(dopts) and torch is not None:
        return int(torch.distributed.get_rank(dopts.process_group if dopts is not None else None))
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _source_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says a source of a share failed (its keeper gone, hung or without the step,
    the transport, the bytes), so that the next source may deliver, rather than the request (a
    template that does not match, a missing key), which no source can satisfy."""
    if isinstance(exc, (ReplicaError, PeerUnreachableError, CorruptCheckpointError, StorageError,
                        KeeperPersistError)):
        return True
    return isinstance(exc, (RuntimeError, OSError)) and not isinstance(exc, ZerostallError)


def _ranks_per_host(hosts: list[str], directory: str) -> int:
    """How many consecutive ranks each host holds; every host must hold as many (placement needs it)."""
    world = len(hosts)
    per = next((i for i, h in enumerate(hosts) if h != hosts[0]), world)
    if world % per or any(hosts[r] != hosts[(r // per) * per] for r in range(world)) or len(set(hosts)) != world // per:
        raise InvalidArgumentError(f"MemoryTier(replicas=...) needs every host to hold as many consecutive ranks "
                                   f"(as torchrun places them); the ranks' hosts are {hosts}", argument="replicas",
                                   path=directory)
    return per


def plan_steps(views: list[tuple[list[int], int | None, dict[int, int], int | None]],
               groups: list[list[int]] | None = None) -> tuple[list[int], dict[int, list[list[int]]]]:
    """From every rank's (storage steps, held step, {origin: replica step held}, step of the
    parity held), in rank order, and the job's parity groups (None: no parity): the steps in
    every rank's storage, and each memory step whose every rank's share is held somewhere, with,
    per rank, the ranks whose keepers hold that share (the rank itself first), then
    :data:`~zerostall.memtier.rebuild.PARITY` when every other member of its parity group holds
    its own share of the step and the parity of it (a group so rebuilds one member only).

    Example::

        >>> plan_steps([([4], 6, {2: 6}, None), ([4], 6, {3: 6}, None), ([4], None, {}, None),
        ...             ([4], None, {}, None)])
        ([4], {6: [[0], [1], [0], [1]]})
        >>> plan_steps([([4], 6, {}, 6), ([4], None, {}, None), ([4], 6, {}, 6)], [[0, 1, 2]])
        ([4], {6: [[0], [-1], [2]]})
    """
    world = len(views)
    stored = set(views[0][0]).intersection(*(set(v[0]) for v in views[1:])) if views else set()
    sources: dict[int, list[list[int]]] = {}
    candidates = {v[1] for v in views if v[1] is not None} | {s for v in views for s in v[2].values()}
    group_of = {r: g for g in groups or [] for r in g}
    for s in candidates:
        per_rank: list[list[int]] = []
        for r in range(world):
            holders = ([r] if views[r][1] == s else []) + [h for h in range(world) if views[h][2].get(r) == s]
            others = [m for m in group_of.get(r, [r]) if m != r]
            if others and all(views[m][1] == s and views[m][3] == s for m in others):
                holders.append(PARITY)
            if not holders:
                break
            per_rank.append(holders)
        else:
            sources[s] = per_rank
    return sorted(stored), sources


class _LoadInto:
    """Where a rank on a new host receives its share: straight into the load's destinations (the
    templates' memory, fresh arrays for leaves without one), planned from the share's manifest as
    a load from storage plans its reads. Then the load only assembles: no memfds to allocate and
    fault in, no second copy. Only where a load from storage streams into the templates too
    (``LoadOptions(atomic=False)``, the default; a failed transfer may then have written part of
    them, and the next holder or storage writes them again) and every destination is in host
    memory; otherwise (None) the share is received into memfds and loaded from them."""

    def __init__(self, items: dict[str, Any] | None, options: LoadOptions | None, path: str) -> None:
        self.items, self.options, self.path = items, options or LoadOptions(), path
        #: the plan's thunks, once a share was planned (the last one, after a retry)
        self.thunks: dict[str, Thunk] | None = None
        self._reads: list[ReadRequest] = []

    def __call__(self, man: Manifest) -> Scatter | None:
        if self.options.atomic:
            return None
        planner = ReadPlanner(man, self.path, ArrivedFiles())
        try:
            thunks = plan_items(planner, man.items, self.items)
        except ZerostallError:  # a template that does not match: the load from memfds raises it, as any load
            return None
        regions: list[list[tuple[int, int, memoryview]]] = [[] for _ in man.files]
        for r in planner.reads:
            if r.device is not None:
                return None
            if r.leaf.nbytes:
                regions[r.leaf.file].append((r.leaf.offset, r.leaf.offset + r.leaf.nbytes, r.dest))
        for regs in regions:
            regs.sort(key=lambda x: x[0])
            if any(b[0] < a[1] for a, b in itertools.pairwise(regs)):
                return None  # two destinations of the same bytes: received once, copied by the load
        self.thunks, self._reads = thunks, planner.reads  # the reads keep their memory's owners alive
        return Scatter(regions)
