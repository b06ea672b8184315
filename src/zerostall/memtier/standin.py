"""The persist after a node loss: a keeper holding a replica takes its lost origin rank's part.

After its trainer died, a keeper persists its held step through the collective protocol, which
commits only once every rank's part is in. When a host is lost, its keepers are gone with it;
a surviving keeper that holds a replica of a lost rank's step (the same step it holds itself)
*stands in* for that rank in the same attempt: it writes the rank's part from the replica, as
that rank's keeper would have. Storage then gets the step even if the job never restarts.

Who may stand in, so that a rank's part never has two writers:

- every keeper of a job with replicas holds a *keeper lease* (:mod:`zerostall.lease`) on the
  directory, renewed while it lives, naming the directory's instance and its rank
  (:func:`alive_target`). A keeper is *proven gone* once no live lease names it: its lease
  expired (not renewed for ``ZEROSTALL_LEASE_S``, default 60 s; on its own host, its process
  is gone), or was released at its exit;
- the stand-in for rank ``o`` is the first holder in :func:`~zerostall.memtier.placement.replica_holders`
  order whose keeper is not proven gone; it waits, up to the collective ``timeout_s``, until
  ``o``'s keeper is proven gone, and stands down as soon as ``o``'s part of the attempt is
  taken or the attempt is decided;
- the arbiter is storage: a rank's hash table is created only if absent, so of two writers of
  one rank's part (a keeper that was only slow, or a second stand-in) exactly one takes part; a
  stand-in that finds it taken withdraws (:class:`~zerostall.persist.collective.RankTaken`),
  and a keeper that finds it taken aborts the attempt. Either way nothing torn is committed:
  the manifest goes last, through the one commit protocol.

The replica is checked against its manifest's CRC32Cs (every leaf) right before it is used, and
those CRC32Cs are what the persist commits: a replica whose bytes changed in memory is never
written; the attempt is aborted at once instead (the other ranks' keepers need not wait).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from zerostall.commit.agreement import AttemptNames, abort_doc, attempt_names, decide, read_decision
from zerostall.errors import ChecksumMismatchError, ZerostallError
from zerostall.lease import host_id, read_leases
from zerostall.memtier.imagecheck import cpus, first_bad_leaf
from zerostall.memtier.replica import ReceivedStep
from zerostall.messages import Collective, FileRow, LeafRow, SaveJob
from zerostall.persist.collective import CollectiveStep, RankTaken
from zerostall.persist.job import run_save
from zerostall.storage import Storage

__all__ = ["alive_target", "keeper_alive", "origin_job", "stand_in", "KEEPER_MARK"]

#: the lease target of a live keeper (never a key of any file: it protects nothing)
KEEPER_MARK = ".zs-keeper-"
#: the slowest a stand-in looks whether its origin is gone (a root listing and the leases' reads)
_POLL_MIN_S = 0.25


def alive_target(instance: str, rank: int) -> str:
    """The target a live keeper of rank ``rank`` of the directory ``instance`` names in its lease."""
    return f"{KEEPER_MARK}{instance}-rank-{rank:05d}"


def keeper_alive(storage: Storage, instance: str, rank: int) -> bool:
    """Whether a keeper of ``rank`` may be alive: a lease naming it is live (see the module docstring)."""
    target, here, now = alive_target(instance, rank), host_id(), time.time()
    return any(target in ls.targets and ls.live(now, here) for ls in read_leases(storage))


def origin_job(job: SaveJob, replica: ReceivedStep) -> tuple[SaveJob, list[int]]:
    """The save job rank ``replica.of.rank``'s keeper would persist, rebuilt from its replica's
    manifest and this keeper's own job of the same step (the same directory, step, options and
    collective attempt: only the rank's own files, leaves and tree differ); with each leaf's
    CRC32C from that manifest, in the job's leaf order.

    Raises:
        ZerostallError: the manifest is not one a keeper holds (a leaf without a CRC32C, files
            that are not the replica's).
    """
    coll = job.collective
    if coll is None:  # pragma: no cover - only collective steps have stand-ins
        raise ZerostallError("only a collective save has other ranks to stand in for", path=job.path)
    doc: dict[str, Any] = json.loads(replica.manifest)
    files = tuple(FileRow(name=str(f["path"]).rsplit("/", 1)[-1], length=int(f["size"]), buffer=i)
                  for i, f in enumerate(doc["files"]))
    if [f.name for f in files] != replica.names or [f.length for f in files] != replica.lengths:
        raise ZerostallError(f"the replica of rank {replica.of.rank}'s step {replica.of.step} does not match its "
                             "manifest's files", path=job.path, rank=replica.of.rank)
    leaves, crcs = [], []
    for lf in doc["leaves"]:
        if not isinstance(lf.get("crc32c"), int):
            raise ZerostallError(f"leaf {lf.get('key')!r} of rank {replica.of.rank}'s replica has no CRC32C",
                                 path=job.path, key=str(lf.get("key")), rank=replica.of.rank)
        leaves.append(LeafRow(key=str(lf["key"]), kind=str(lf["kind"]), dtype=str(lf["dtype"]),
                              shape=tuple(int(x) for x in lf["shape"]), file=int(lf["file"]),
                              offset=int(lf["offset"]), nbytes=int(lf["nbytes"])))
        crcs.append(int(lf["crc32c"]))
    out = dataclasses.replace(job, files=files, leaves=tuple(leaves), items=doc["items"],
                              metadata=doc.get("metadata") or {}, crcs=(), memory=False, persist=True,
                              collective=dataclasses.replace(coll, rank=replica.of.rank))
    return out, crcs


def _wait_turn(storage: Storage, names: AttemptNames, coll: Collective, instance: str, holders: list[int],
               me: int, stop: threading.Event) -> str | None:
    """None once this keeper is to stand in for ``coll.rank``; else why not (bounded by ``coll.timeout_s``)."""
    origin = coll.rank
    deadline = time.monotonic() + coll.timeout_s
    while not stop.is_set():
        if read_decision(storage, names) is not None:
            return "the attempt is decided"
        if storage.exists(names.table(origin)):
            return f"rank {origin}'s part is taken"
        if not keeper_alive(storage, instance, origin):
            before = holders[:holders.index(me)] if me in holders else holders
            alive = [h for h in before if keeper_alive(storage, instance, h)]
            return f"rank {alive[0]}'s keeper stands in first" if alive else None
        if time.monotonic() > deadline:
            return f"rank {origin}'s keeper was not proven gone within {coll.timeout_s:g} s"
        stop.wait(max(coll.poll_s, _POLL_MIN_S))
    return "the keeper is exiting"


def stand_in(job: SaveJob, replica: ReceivedStep, storage: Storage, *, instance: str, holders: list[int], me: int,
             stop: threading.Event, guard: Callable[[], None], say: Callable[[str], None]) -> bool:
    """Take rank ``replica.of.rank``'s part in the attempt of ``job`` (this keeper's own held step,
    being persisted beside) once that rank's keeper is proven gone and this keeper is its stand-in.
    True when the part was written and the attempt committed; False when it was not this keeper's
    to take (said through ``say``).

    Raises:
        ZerostallError | OSError: the replica failed its check (the attempt is aborted), or the
            persist failed (as :func:`~zerostall.persist.job.run_save` raises it).
    """
    job_o, crcs = origin_job(job, replica)
    coll = job_o.collective
    assert coll is not None
    names = attempt_names(storage, job_o.name, coll.run, coll.counter)
    why = _wait_turn(storage, names, coll, instance, holders, me, stop)
    if why is not None:
        say(f"not standing in for rank {coll.rank} at step {job.step}: {why}")
        return False
    views = {i: replica.view(i) for i in range(len(replica.buffers))}
    bad = first_bad_leaf(replica.manifest, {f.name: views[f.buffer] for f in job_o.files}, cpus(),
                         path=f"replica:rank{coll.rank}/step{job.step}")
    if bad is not None:
        exc = ChecksumMismatchError(f"leaf {bad!r} of the replica of rank {coll.rank}'s step {job.step} changed in "
                                    "memory after it was received; it is not persisted", path=job.path, key=bad,
                                    rank=coll.rank)
        decide(storage, names, abort_doc(exc, me, job.path))
        raise exc
    say(f"rank {coll.rank}'s keeper is gone: standing in for it at step {job.step} from its replica")
    try:
        run_save(job_o, views, lambda: None,
                 step=CollectiveStep(job_o, coll, storage, yields=True, known_crcs=crcs, guard=guard))
    except RankTaken:
        say(f"rank {coll.rank}'s part of step {job.step} was taken by another writer; this stand-in withdrew")
        return False
    return True
