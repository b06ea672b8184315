"""The collective step of a save: how the writers of all ranks agree, through the storage only.

Runs in the writer processes, never on the training thread, and never touches torch. Every rank
derives the same names from ``(checkpoint name, run id, save counter)`` without talking; the
attempt's outcome is its *decision file* (:mod:`zerostall.commit.agreement`, shared with the
trainers, which decide "abort" for a save that failed on their side). See docs/distributed.md.

Within one rank's save (:class:`CollectiveStep`, driven by :func:`zerostall.persist.job.run_save`):

1. hash every leaf another rank could hold (xxh3-128) and publish the table;
2. once every rank's table is in, compute the same owner map on every rank: bytes identical on
   several ranks are written once, by one of them, owners balanced by bytes;
3. the job writes this rank's file with the leaves it owns and publishes a report;
4. rank 0 merges the reports into one manifest and commits; every other rank waits for the
   commit or the abort. Any failure or timeout decides "abort" for every rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from zerostall._version import __version__
from zerostall.commit.agreement import (
    AttemptNames,
    abort_doc,
    attempt_names,
    decide,
    error_of,
    read_decision,
    wait_for_outcome,
)
from zerostall.commit.protocol import (
    Attempt,
    RenameCommit,
    committed_steps,
    delete_checkpoint,
    protocol_for,
    step_name,
    steps_to_delete_everywhere,
)
from zerostall.errors import CheckpointExistsError, WriterError
from zerostall.format.layout import (
    COORD_PREFIX,
    DATA_PREFIX,
    DEC_MARK,
    TMP_MARK,
    data_file,
)
from zerostall.format.manifest import encode_manifest
from zerostall.lease import covers, host_id, read_leases
from zerostall.messages import Collective, LeafRow, SaveJob, WireError, from_wire
from zerostall.options import RetentionPolicy
from zerostall.persist import faults
from zerostall.storage import Storage

__all__ = [
    "assign_owners", "merge_reports", "CollectiveStep",
    "attempts_of_run", "abort_attempts_except", "sweep_aborted_decisions", "RankTaken",
]

Table = dict[str, Any]


# -- ownership and the merged manifest ------------------------------------------------------------


def assign_owners(tables: list[Table]) -> dict[tuple[int, str], int]:
    """``(rank, key) -> owner rank`` for every leaf of every rank; deterministic on every rank.

    Leaves with equal ``(key, kind, dtype, shape, hash)`` on several ranks form a group written
    once; groups go, largest first, to the member rank with the fewest bytes so far (ties: the
    lowest rank). Unhashed leaves and leaves no other rank shares stay with their rank.
    """
    load = [0] * len(tables)
    groups: dict[tuple[Any, ...], list[int]] = {}
    sizes: dict[tuple[Any, ...], int] = {}
    owner: dict[tuple[int, str], int] = {}
    for r, t in enumerate(tables):
        for key, kind, dtype, shape, nbytes, h in t["leaves"]:
            if h is None:
                owner[(r, key)] = r
                load[r] += nbytes
                continue
            g = (key, kind, dtype, tuple(shape), h)
            groups.setdefault(g, []).append(r)
            sizes[g] = nbytes
    shared = []
    for g, members in groups.items():
        if len(members) == 1:
            owner[(members[0], g[0])] = members[0]
            load[members[0]] += sizes[g]
        else:
            shared.append(g)
    shared.sort(key=lambda g: (-sizes[g], g[0], g[4]))
    for g in shared:
        members = groups[g]
        o = min(members, key=lambda r: (load[r], r))
        load[o] += sizes[g]
        for r in members:
            owner[(r, g[0])] = o
    return owner


def _walk_leaves(node: Any, fn: Callable[[dict[str, Any]], None]) -> None:
    """Call ``fn`` on every node or shard entry that holds a ``leaf`` index."""
    if not isinstance(node, dict):
        return
    if node.get("type") == "sharded":
        for sh in node["shards"]:
            fn(sh)
        return
    if "leaf" in node:
        fn(node)
    for v in node.get("values", ()):
        _walk_leaves(v, fn)


def _walk_sharded(node: Any, key: str, fn: Callable[[str, dict[str, Any]], None]) -> None:
    if not isinstance(node, dict):
        return
    if node.get("type") == "sharded":
        fn(key, node)
        return
    labels = node.get("keys") or node.get("fields") or range(len(node.get("values", ())))
    for lab, v in zip(labels, node.get("values", ()), strict=True):
        _walk_sharded(v, f"{key}/{lab}", fn)


def merge_reports(reports: list[dict[str, Any]], data_dir: str
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The global ``files``, ``leaves`` and per-rank item trees of a collective save."""
    files = [{"path": f"{data_dir}/{data_file(r)}", "size": rep["file_size"]} for r, rep in enumerate(reports)]
    leaves: list[dict[str, Any]] = []
    index: dict[tuple[int, str], int] = {}
    for r, rep in enumerate(reports):
        for lf in rep["written"]:
            index[(r, lf["key"])] = len(leaves)
            leaves.append(dict(lf, file=r))
    trees: list[dict[str, Any]] = []
    shards: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], dict[str, Any]]] = {}

    def collect(key: str, n: dict[str, Any]) -> None:
        box = shards.setdefault(key, {})
        for sh in n["shards"]:
            box.setdefault((tuple(sh["offset"]), tuple(sh["shape"])), sh)

    def fill(key: str, n: dict[str, Any]) -> None:
        n["shards"] = [dict(sh) for _, sh in sorted(shards[key].items())]

    for rep in reports:
        refs = rep["refs"]
        items = json.loads(json.dumps(rep["items"]))  # a private copy to rewrite

        def remap(n: dict[str, Any], refs: list[Any] = refs) -> None:
            o, k = refs[n["leaf"]]
            n["leaf"] = index[(o, k)]
            n.pop("unique", None)

        for name, node in items.items():
            _walk_leaves(node, remap)
            _walk_sharded(node, name, collect)
        trees.append(items)
    # Every rank's sharded node lists every saved shard (identical boxes once), for resharding.
    for items in trees:
        for name, node in items.items():
            _walk_sharded(node, name, fill)
    return files, leaves, trees


# -- one rank's step -------------------------------------------------------------------------------


class RankTaken(WriterError):
    """A writer that yields (a stand-in, or a keeper persisting after its trainer died) found its
    rank's part of the attempt already taken (by the rank's own keeper or a stand-in): it
    withdraws, deciding nothing and removing nothing."""


class CollectiveStep:
    """This rank's part of a collective save, as :func:`zerostall.persist.job.run_save` drives it.

    ``yields``: another writer may take this rank's part of the same step, and this one then
    withdraws (:class:`RankTaken`) instead of aborting the attempt the other takes part in: a
    keeper standing in for a lost rank from a replica of its step (see
    :mod:`zerostall.memtier.standin`), or a keeper persisting its own held step after its trainer
    died, for which a stand-in may have taken over while it hung (its lease lapsed), with the
    same step's verified bytes. Each rank's hash table is created only if absent, so at most one
    writer ever takes a rank's part. A trainer's own collective save does not yield: a second
    writer of its part means two processes claim one rank, and the attempt is aborted.
    """

    writes = True

    def __init__(self, job: SaveJob, coll: Collective, storage: Storage, *, yields: bool = False,
                 known_crcs: Sequence[int | None] | None = None, guard: Callable[[], None] | None = None) -> None:
        self.job, self.coll, self.storage = job, coll, storage
        self.yields = yields
        #: see :class:`zerostall.persist.job.Step`
        self.known_crcs, self.guard = known_crcs, guard
        self.names = attempt_names(storage, job.name, coll.run, coll.counter)
        # Every rank applies retention to its own view of the storage (the same view on shared
        # storage: then the others find rank 0's deletions done), with what every rank agreed.
        self.applies_retention = True
        self._views: list[list[int]] | None = None
        self.check_lease: Callable[[], None] = lambda: None  # set by run_save

    def begin(self) -> None:
        if self.names.rename and self.storage.exists(self.names.name):
            raise CheckpointExistsError("a checkpoint already exists here; zerostall never overwrites one",
                                        path=self.job.path)

    def data_key(self, file_name: str) -> str:
        return self.names.data_file(self.coll.rank)

    def owned(self, views: Sequence[memoryview], hash_leaf: Callable[[LeafRow], bool]) -> list[int]:
        """Hash, publish the table, wait for every rank's, and return the indices of the leaves this rank writes."""
        job, coll, names = self.job, self.coll, self.names
        table = [[lf.key, lf.kind, lf.dtype, list(lf.shape), lf.nbytes,
                  _hash(views[lf.file][lf.offset:lf.offset + lf.nbytes]) if coll.world > 1 and hash_leaf(lf) else None]
                 for lf in job.leaves]
        doc: dict[str, Any] = {"leaves": table}
        if job.retention is not None and job.retention.deletes:
            # This rank's view of the committed steps: retention deletes only what every view allows.
            doc["steps"] = committed_steps(self.storage)
        # if_absent: written aside and linked into place, so a poller never reads half a file; and
        # the one writer of this rank's part is the one whose table is there
        try:
            self.storage.put(names.table(coll.rank), json.dumps(doc).encode(), if_absent=True)
        except FileExistsError:
            if not self.yields:
                raise
            raise RankTaken(f"rank {coll.rank}'s part of this save is taken by another writer", path=job.path,
                            rank=coll.rank) from None
        self._poll_all(f"{names.coord}/tables", "hash tables")
        tables = [json.loads(self.storage.get(names.table(r))) for r in range(coll.world)]
        if all(isinstance(t.get("steps"), list) for t in tables):
            self._views = [[int(x) for x in t["steps"]] for t in tables]
        self._owner = assign_owners(tables)
        return [i for i, lf in enumerate(job.leaves) if self._owner[(coll.rank, lf.key)] == coll.rank]

    def commit(self, written: list[dict[str, Any]], files: list[dict[str, Any]]) -> None:
        """Publish this rank's report; rank 0 merges every report and commits, the others wait."""
        job, coll, names, storage = self.job, self.coll, self.names, self.storage
        report = {"rank": coll.rank, "file_size": files[0]["size"],
                  "written": [{k: v for k, v in lf.items() if k != "file"} for lf in written],
                  "items": job.items, "refs": [[self._owner[(coll.rank, lf.key)], lf.key] for lf in job.leaves]}
        storage.put(names.report(coll.rank), json.dumps(report).encode(), if_absent=True)
        if coll.rank != 0:
            wait_for_outcome(storage, names, timeout_s=coll.timeout_s, poll_s=coll.poll_s, rank=coll.rank,
                             path=job.path)
            return
        self._poll_all(f"{names.coord}/ranks", "reports")
        faults.hit("manifest")
        reports = [json.loads(storage.get(names.report(r))) for r in range(coll.world)]
        all_files, all_leaves, trees = merge_reports(reports, names.data_dir)
        manifest = encode_manifest(items=trees[0], leaves=all_leaves, files=all_files, metadata=job.metadata,
                                   library_version=__version__, ranks=trees, attempt=names.attempt)
        faults.hit("commit")
        self.check_lease()
        dec = decide(storage, names, {"decision": "commit", "by": 0})
        if dec.get("decision") != "commit":
            raise error_of(dec)
        try:
            self._commit(manifest)
        except BaseException as exc:
            storage.put(names.failed, json.dumps(abort_doc(exc, 0, job.path)["error"]).encode(), if_absent=True)
            raise

    def fail(self, exc: BaseException) -> BaseException:
        """Decide "abort" (unless another rank decided first) and return what every rank raises.
        A writer that yields and whose rank's part is taken decides nothing: the attempt goes on
        without it."""
        if isinstance(exc, RankTaken):
            return exc
        storage, names = self.storage, self.names
        final: BaseException = exc
        try:
            dec = decide(storage, names, abort_doc(exc, self.coll.rank, self.job.path))
            if dec.get("decision") == "abort":
                final = error_of(dec)
                self._remove_attempt()
            elif storage.exists(names.failed):
                final = from_wire(WireError.from_json(json.loads(storage.get(names.failed))))
        except Exception:  # noqa: BLE001,S110 - the storage failed too: the original error stands
            pass
        return final

    def after_commit(self) -> None:
        if self.coll.rank == 0:
            self._cleanup_decisions()

    def lease_targets(self) -> list[str]:
        n = self.names
        if n.rename:
            return [n.staging, n.decision]
        return [f"{n.staging}/{n.data_dir}", n.coord, n.decision]

    def retain(self, storage: Storage, policy: RetentionPolicy | None, newest: int | None,
               deleted: list[int]) -> None:
        """Delete what retention drops in *every* rank's view, from this rank's view.

        The new step is committed for every rank at once (one commit), and ``keep_last`` counts
        the steps every rank sees (:func:`~zerostall.commit.steps_to_delete_everywhere`), so no
        rank loses a step it needs to resume from a common one.
        """
        if policy is None or not policy.deletes or newest is None or self._views is None:
            return
        faults.hit("retention")
        mine = set(self._views[self.coll.rank])
        doomed = steps_to_delete_everywhere(self._views, newest=newest, keep_last=policy.keep_last,
                                            keep_every_n_steps=policy.keep_every_n_steps)
        for st in doomed:
            if st in mine:
                delete_checkpoint(storage, step_name(st))
                deleted.append(st)

    # -- helpers -------------------------------------------------------------------------------

    def _poll_all(self, folder: str, what: str) -> None:
        """Wait until ``folder`` holds one file per rank; raise the abort error or a timeout naming the late ranks."""
        coll = self.coll
        deadline = time.monotonic() + coll.timeout_s
        want = {f"rank-{r:05d}.json" for r in range(coll.world)}
        while True:
            dec = read_decision(self.storage, self.names)
            if dec is not None and dec.get("decision") == "abort":
                raise error_of(dec)
            try:
                have = set(self.storage.list(folder))
            except FileNotFoundError:
                have = set()
            missing = sorted(int(n[5:10]) for n in want - have)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise WriterError(f"rank(s) {missing} did not publish their {what} within {coll.timeout_s:g} s "
                                  "(writer dead or late); nothing of this save was committed", path=self.job.path,
                                  rank=missing[0])
            time.sleep(coll.poll_s)

    def _commit(self, manifest: bytes) -> None:
        """Commit through the one commit protocol every save uses (commit.py), coordination files first."""
        storage, names = self.storage, self.names
        if names.rename:
            storage.delete(names.coord)  # it lives inside the staging directory: not part of the checkpoint
        protocol = protocol_for(storage)
        assert isinstance(protocol, RenameCommit) == names.rename
        protocol.commit(Attempt(name=names.name, staging=names.staging, data_dir=names.data_dir), manifest)
        if not names.rename:
            storage.delete(names.coord)  # beside the committed checkpoint on an object store

    def _remove_attempt(self) -> None:
        """Remove what this attempt wrote (any rank may; an aborted attempt is never committed)."""
        names = self.names
        for target in ((names.staging,) if names.rename else (f"{names.staging}/{names.data_dir}", names.coord)):
            try:
                self.storage.delete(target)
            except OSError:
                pass  # another rank is deleting it too

    def _cleanup_decisions(self) -> None:
        """Drop this run's older decision files: every rank has finished with them (all reported since)."""
        storage, names, run = self.storage, self.names, self.coll.run
        try:
            storage.delete(names.decision)
            for n in storage.list(""):
                if DEC_MARK in n and f"{DEC_MARK}{run}-" in n:
                    tail = n.split(f"{DEC_MARK}{run}-", 1)[1].split(".", 1)[0]
                    if tail.isdigit() and int(tail) < self.coll.counter:
                        storage.delete(n)
        except OSError:
            pass


def _hash(view: memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(view)


# -- a dead trainer's attempts (the memory tier's keepers) -------------------------------------------


def _attempt_of(key: str, run: str) -> tuple[str, int] | None:
    """``(checkpoint name, counter)`` if ``key`` is a staging directory, decision file or
    coordination/data prefix of an attempt of ``run`` (as a lease names it, or the root lists it)."""
    for mark in (TMP_MARK, DEC_MARK):
        head, sep, tail = key.partition(f"{mark}{run}-")
        if sep and head.startswith(".") and "/" not in head:
            digits = tail.split(".", 1)[0].split("/", 1)[0]
            return (head[1:], int(digits)) if digits.isdigit() else None
    name, sep, rest = key.partition("/")
    for mark in (DATA_PREFIX, COORD_PREFIX):
        if sep and rest.startswith(f"{mark}{run}-"):
            digits = rest[len(mark) + len(run) + 1:].split("/", 1)[0]
            return (name, int(digits)) if digits.isdigit() else None
    return None


def attempts_of_run(storage: Storage, run: str) -> dict[int, AttemptNames]:
    """The attempts of ``run`` that a live writer (any host) works on now, by save counter.

    Found through the writers' leases, which name every attempt's staging, coordination and
    decision keys on every kind of storage; an abandoned attempt (no live lease) is gc's.
    """
    here, now = host_id(), time.time()
    out: dict[int, AttemptNames] = {}
    for ls in read_leases(storage):
        if not ls.live(now, here):
            continue
        for k in ls.targets:
            got = _attempt_of(k, run)
            if got is not None and got[1] not in out:
                out[got[1]] = attempt_names(storage, got[0], run, got[1])
    return out


def abort_attempts_except(storage: Storage, run: str, keep: int | None, rank: int, reason: str, *,
                          once_keep_started: bool = False,
                          only: Callable[[AttemptNames], bool] | None = None) -> list[int]:
    """Decide "abort" for every undecided attempt of ``run`` in progress, other than counter ``keep``.

    Called by a rank's keeper once that rank's trainer is dead: the rank will never take part in
    any other attempt of ``run``, so none of them can commit; deciding now spares the other ranks'
    writers their timeout. A decided attempt (committed or aborted) is left as it is (``decide``
    never overrides). The writers of the attempts aborted remove them; an abort decision that no
    live writer covers any more is swept here. Returns the counters this call aborted.

    ``once_keep_started``: abort nothing until attempt ``keep`` is in progress too (its lease
    visible), so that any rank that sees its own attempt aborted by this one can, in turn, find
    and abort ``keep``.

    ``only``: abort only the attempts it accepts (the others are left to end on their own).
    """
    aborted: list[int] = []
    attempts = attempts_of_run(storage, run)
    if once_keep_started and keep is not None and keep not in attempts:
        return aborted
    for counter, names in sorted(attempts.items()):
        if counter == keep or (only is not None and not only(names)) or read_decision(storage, names) is not None:
            continue
        exc = WriterError(f"{reason}; nothing of this save was committed", rank=rank)
        dec = decide(storage, names, abort_doc(exc, rank, names.name))
        if dec.get("decision") == "abort" and dec.get("by") == rank:
            aborted.append(counter)
    if aborted:  # a writer that finished between the lease listing and the decision sweeps no more
        sweep_aborted_decisions(storage, run)
    return aborted


def sweep_aborted_decisions(storage: Storage, run: str) -> list[str]:
    """Delete the "abort" decision files of ``run`` that no live writer's lease covers.

    The rule :func:`zerostall.persist.gc.collect_garbage` applies to any decision file, limited to
    one run's aborted attempts: a writer that still works on such an attempt holds a lease that
    covers its decision, and an attempt whose writers have all gone can never commit (every rank's
    part is removed on abort and no rank takes part twice). Returns the keys deleted.
    """
    here, now = host_id(), time.time()
    # exactly decision files (not a conditional put's temporary beside one, nor a ".failed")
    candidates = [n for n in storage.list("") if (a := _attempt_of(n, run)) is not None
                  and n == f".{a[0]}{DEC_MARK}{run}-{a[1]}"]
    if not candidates:
        return []
    live = [ls for ls in read_leases(storage) if ls.live(now, here)]  # after listing: see gc
    gone = []
    for key in candidates:
        if any(covers(tg, key) for ls in live for tg in ls.targets):
            continue
        try:
            doc = json.loads(storage.get(key))
        except (FileNotFoundError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("decision") != "abort":
            continue
        try:
            storage.delete(key)
            gone.append(key)
        except OSError:
            pass  # another keeper deletes it too
    return gone
