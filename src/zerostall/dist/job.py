"""One rank's part of a collective save, as its writer process runs it (no torch here).

1. hash every leaf that could be replicated (xxh3-128) and publish the table;
2. once every rank's table is in, compute the same owner map on every rank: a leaf whose bytes
   are identical on several ranks is written once, by one of them, owners balanced by bytes;
3. write this rank's data file with only the leaves it owns, straight from the staging buffer;
   CRC32C them; release the buffer; publish a report;
4. rank 0 merges the reports into one manifest and commits; every other rank waits for the
   commit or the abort. Any failure or timeout decides "abort" for every rank.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from typing import Any, Callable

import crc32c
import xxhash

from zerostall import __version__
from zerostall.commit import Attempt, RenameCommit, protocol_for
from zerostall.dist.protocol import (
    DEC_MARK, AttemptNames, abort_doc, attempt_names, decide, error_of, read_decision, rank_file, wait_for_outcome,
)
from zerostall.errors import CheckpointExistsError, WriterError, from_wire
from zerostall.manifest import encode_manifest
from zerostall.persist import faults
from zerostall.persist.job import apply_retention, peak_rss
from zerostall.stage.plan import make_plan
from zerostall.storage import Storage, open_storage
from zerostall.tree import ArrayLeaf, FlatState

__all__ = ["run_dist_job", "assign_owners", "merge_reports"]

Table = dict[str, Any]


def _hash(view: memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(view)


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
    t = node.get("type")
    if t == "sharded":
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
    for lab, v in zip(labels, node.get("values", ())):
        _walk_sharded(v, f"{key}/{lab}", fn)


def merge_reports(reports: list[dict[str, Any]], data_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                                          list[dict[str, Any]]]:
    """The global ``files``, ``leaves`` and per-rank item trees of a collective save."""
    files = [{"path": f"{data_dir}/{rank_file(r)}", "size": rep["file_size"]} for r, rep in enumerate(reports)]
    leaves: list[dict[str, Any]] = []
    index: dict[tuple[int, str], int] = {}
    for r, rep in enumerate(reports):
        for lf in rep["written"]:
            index[(r, lf["key"])] = len(leaves)
            leaves.append(dict(lf, file=r))
    trees: list[dict[str, Any]] = []
    shards: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], dict[str, Any]]] = {}
    for r, rep in enumerate(reports):
        refs = rep["refs"]
        items = json.loads(json.dumps(rep["items"]))  # a private copy to rewrite

        def remap(n: dict[str, Any], refs: list[Any] = refs) -> None:
            o, k = refs[n["leaf"]]
            n["leaf"] = index[(o, k)]
            n.pop("unique", None)

        for name, node in items.items():
            _walk_leaves(node, remap)

            def collect(key: str, n: dict[str, Any]) -> None:
                box = shards.setdefault(key, {})
                for sh in n["shards"]:
                    box.setdefault((tuple(sh["offset"]), tuple(sh["shape"])), sh)
            _walk_sharded(node, name, collect)
        trees.append(items)
    # Every rank's sharded node lists every saved shard (identical boxes once), for resharding.
    for items in trees:
        for name, node in items.items():
            def fill(key: str, n: dict[str, Any]) -> None:
                n["shards"] = [dict(sh) for _, sh in sorted(shards[key].items())]
            _walk_sharded(node, name, fill)
    return files, leaves, trees


def _poll_all(storage: Storage, names: AttemptNames, folder: str, world: int, *, timeout_s: float, poll_s: float,
              what: str, path: str) -> None:
    """Wait until ``folder`` holds one file per rank; raise the abort error or a timeout naming the late ranks."""
    deadline = time.monotonic() + timeout_s
    want = {f"rank-{r:05d}.json" for r in range(world)}
    while True:
        dec = read_decision(storage, names)
        if dec is not None and dec.get("decision") == "abort":
            raise error_of(dec)
        try:
            have = set(storage.list(folder))
        except FileNotFoundError:
            have = set()
        missing = sorted(int(n[5:10]) for n in want - have)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise WriterError(f"rank(s) {missing} did not publish their {what} within {timeout_s:g} s "
                              "(writer dead or late); nothing of this save was committed", path=path,
                              rank=missing[0])
        time.sleep(poll_s)


def _write_compact(storage: Storage, key: str, view: memoryview, header: bytes, size: int,
                   pieces: list[tuple[int, int, int]]) -> None:
    """Write a file of ``size`` bytes: ``header``, then each ``(src offset, dst offset, n)`` from ``view``."""
    root = getattr(storage, "root", None)
    if root is not None and type(storage).__name__ == "LocalStorage":
        # pwrite each leaf from the shared staging buffer to its new offset: no assembled copy.
        path = os.path.join(root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            _pwrite_all(fd, memoryview(header), 0)
            for src, dst, n in pieces:
                _pwrite_all(fd, view[src:src + n], dst)
            os.ftruncate(fd, size)  # alignment gaps read back as zeros
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    buf = bytearray(size)  # other backends take one contiguous buffer
    buf[:len(header)] = header
    for src, dst, n in pieces:
        buf[dst:dst + n] = view[src:src + n]
    storage.write_from_buffer(key, memoryview(buf), size, threads=1, chunk_bytes=32 << 20, direct=False)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        w = os.pwrite(fd, view[done:], offset + done)
        if w == 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        done += w


def run_dist_job(job: dict[str, Any], buffers: dict[int, memoryview], released: Callable[[], None]) -> dict[str, Any]:
    t0 = time.perf_counter()
    d = job["dist"]
    rank, world = int(d["rank"]), int(d["world"])
    timeout_s, poll_s = float(d["timeout_s"]), float(d["poll_s"])
    storage = open_storage(job["root"])
    names = attempt_names(storage, job["name"], d["run"], int(d["counter"]))
    path = job["path"]
    is_released = False
    try:
        faults.hit("begin", job["root"])
        if names.rename and storage.exists(names.name):
            raise CheckpointExistsError("a checkpoint already exists here; zerostall never overwrites one", path=path)
        view = buffers[job["files"][0]["buffer"]]
        leaves = job["leaves"]
        unhashed = set(d.get("unhashed", ()))
        table = [[lf["key"], lf["kind"], lf["dtype"], lf["shape"], lf["nbytes"],
                  None if (i in unhashed or world == 1) else _hash(view[lf["offset"]:lf["offset"] + lf["nbytes"]])]
                 for i, lf in enumerate(leaves)]
        # if_absent: written aside and linked into place, so a poller never reads half a file
        storage.put(names.table(rank), json.dumps({"leaves": table}).encode(), if_absent=True)
        _poll_all(storage, names, f"{names.coord}/tables", world, timeout_s=timeout_s, poll_s=poll_s,
                  what="hash tables", path=path)
        tables = [json.loads(storage.get(names.table(r))) for r in range(world)]
        owner = assign_owners(tables)

        # This rank's file: the leaves it owns, laid out compactly (same rules as the staging plan).
        mine = [lf for lf in leaves if owner[(rank, lf["key"])] == rank]
        faults.hit("write", job["root"])
        t_write = time.perf_counter()
        crcs = [0] * len(mine)

        def do_crc() -> None:
            for i, lf in enumerate(mine):
                crcs[i] = crc32c.crc32c(view[lf["offset"]:lf["offset"] + lf["nbytes"]])
        crc_err: list[BaseException] = []

        def crc_runner() -> None:
            try:
                faults.hit("checksum")
                do_crc()
            except BaseException as exc:
                crc_err.append(exc)
        crc_thread = threading.Thread(target=crc_runner, name="zerostall-crc", daemon=True)
        crc_thread.start()
        try:
            if len(mine) == len(leaves):
                # Nothing was handed to another rank: the staged image is the file, as in a local save.
                offsets = [lf["offset"] for lf in leaves]
                size = job["files"][0]["length"]
                opts = job["options"]
                storage.write_from_buffer(names.data_file(rank), view, size, threads=opts["io_threads"],
                                          chunk_bytes=opts["chunk_bytes"], direct=opts["direct_io"])
            else:
                fake = FlatState(items={}, leaves=[ArrayLeaf(lf["key"], lf["kind"], lf["dtype"], tuple(lf["shape"]),
                                                             lf["nbytes"], None) for lf in mine])
                plan = make_plan(fake, rank=rank)
                fp = plan.files[0]
                offsets = [s.offset for s in plan.slots]
                size = fp.size
                _write_compact(storage, names.data_file(rank), view, fp.header, size,
                               [(lf["offset"], off, lf["nbytes"]) for lf, off in zip(mine, offsets)])
        finally:
            crc_thread.join()
        write_s = time.perf_counter() - t_write
        released()
        is_released = True
        if crc_err:
            raise crc_err[0]
        written = [{"key": lf["key"], "kind": lf["kind"], "dtype": lf["dtype"], "shape": lf["shape"],
                    "offset": off, "nbytes": lf["nbytes"], "crc32c": c}
                   for lf, off, c in zip(mine, offsets, crcs)]
        report = {"rank": rank, "file_size": size, "written": written, "items": job["items"],
                  "refs": [[owner[(rank, lf["key"])], lf["key"]] for lf in leaves]}
        storage.put(names.report(rank), json.dumps(report).encode(), if_absent=True)

        t_commit = time.perf_counter()
        if rank == 0:
            _poll_all(storage, names, f"{names.coord}/ranks", world, timeout_s=timeout_s, poll_s=poll_s,
                      what="reports", path=path)
            faults.hit("manifest")
            reports = [json.loads(storage.get(names.report(r))) for r in range(world)]
            files, all_leaves, trees = merge_reports(reports, names.data_dir)
            manifest = encode_manifest(items=trees[0], leaves=all_leaves, files=files, metadata=job.get("metadata"),
                                       library_version=__version__, ranks=trees, attempt=names.attempt)
            faults.hit("commit")
            dec = decide(storage, names, {"decision": "commit", "by": 0})
            if dec.get("decision") != "commit":
                raise error_of(dec)
            try:
                _commit(storage, names, manifest)
            except BaseException as exc:
                storage.put(names.failed, json.dumps(abort_doc(exc, 0, path)["error"]).encode(), if_absent=True)
                raise
        else:
            wait_for_outcome(storage, names, timeout_s=timeout_s, poll_s=poll_s, rank=rank, path=path)
        commit_s = time.perf_counter() - t_commit
    except BaseException as exc:
        if not is_released:
            released()
        final: BaseException = exc
        try:
            dec = decide(storage, names, abort_doc(exc, rank, path))
            if dec.get("decision") == "abort":
                final = error_of(dec)
                _remove_attempt(storage, names, rank)
            elif storage.exists(names.failed):
                final = from_wire(json.loads(storage.get(names.failed)))
        except Exception:
            pass
        if final is exc:
            raise
        raise final from exc
    # Committed: what follows never turns the save into a failure on other ranks.
    deleted: list[int] = []
    retention_error = None
    if rank == 0:
        _cleanup_decisions(storage, names, d["run"], int(d["counter"]))
        try:
            apply_retention(storage, job.get("retention"), deleted)
        except OSError as exc:  # the new step is committed on every rank; old ones stay for next time
            retention_error = f"{type(exc).__name__}: {exc}"
    return {
        "nbytes": size,
        "write_s": write_s,
        "commit_s": commit_s,
        "persist_s": time.perf_counter() - t0,
        "writer_peak_rss": peak_rss(),
        "deleted_steps": deleted,
        "rank": rank,
        "leaves_written": len(mine),
        "retention_error": retention_error,
    }


def _commit(storage: Storage, names: AttemptNames, manifest: bytes) -> None:
    """Commit through the one commit protocol every save uses (commit.py), coordination files first."""
    if names.rename:
        storage.delete(names.coord)  # it lives inside the staging directory: not part of the checkpoint
    protocol = protocol_for(storage)
    assert isinstance(protocol, RenameCommit) == names.rename
    protocol.commit(Attempt(name=names.name, staging=names.staging, data_dir=names.data_dir), manifest)
    if not names.rename:
        storage.delete(names.coord)  # beside the committed checkpoint on an object store


def _remove_attempt(storage: Storage, names: AttemptNames, rank: int) -> None:
    """Remove what this attempt wrote (any rank may; an aborted attempt is never committed)."""
    for target in ((names.staging,) if names.rename else (f"{names.staging}/{names.data_dir}", names.coord)):
        try:
            storage.delete(target)
        except OSError:
            pass  # another rank is deleting it too


def _cleanup_decisions(storage: Storage, names: AttemptNames, run: str, counter: int) -> None:
    """Drop this run's older decision files: every rank has finished with them (all reported since)."""
    try:
        storage.delete(names.decision)
        for n in storage.list(""):
            if DEC_MARK in n and f"{DEC_MARK}{run}-" in n:
                tail = n.split(f"{DEC_MARK}{run}-", 1)[1].split(".", 1)[0]
                if tail.isdigit() and int(tail) < counter:
                    storage.delete(n)
    except OSError:
        pass


