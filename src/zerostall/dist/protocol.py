"""How the ranks of a collective save agree, through the storage only (no torch here).

Runs in the writer processes and in the trainers' listener threads, never on the training
thread. Every rank derives the same names from ``(checkpoint name, run id, save counter)``
without talking; the one place that decides the outcome of an attempt is its *decision file*,
created with ``put(if_absent=True)``: the first writer wins, so exactly one of "commit" (only
rank 0 writes it, once every report is in) or "abort" (any rank, on its own failure or on a
timeout) ever exists, and every rank follows it. See docs/distributed.md.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from zerostall.commit import TMP_MARK
from zerostall.errors import WriterError, ZerostallError, from_wire, to_wire
from zerostall.manifest import MANIFEST_NAME
from zerostall.storage import Storage

__all__ = ["AttemptNames", "attempt_names", "read_decision", "decide", "abort_doc", "wait_for_outcome",
           "DEC_MARK", "rank_file"]

DEC_MARK = ".zs-decision-"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class AttemptNames:
    """Where one attempt's files go; the same on every rank."""

    name: str  # the checkpoint's final name under the storage root
    attempt: str  # "<run id>-<save counter>"
    staging: str  # directory (rename) or prefix (object store) the data files go under
    data_dir: str  # relative to the checkpoint, as recorded in the manifest
    coord: str  # hash tables and reports: <coord>/tables/, <coord>/ranks/
    decision: str  # the decision file, beside the checkpoint
    rename: bool  # commit by renaming ``staging`` onto ``name``

    def data_file(self, rank: int) -> str:
        return f"{self.staging}/{self.data_dir}/{rank_file(rank)}"

    def table(self, rank: int) -> str:
        return f"{self.coord}/tables/rank-{rank:05d}.json"

    def report(self, rank: int) -> str:
        return f"{self.coord}/ranks/rank-{rank:05d}.json"

    @property
    def failed(self) -> str:
        """Written by rank 0 if it fails after deciding to commit (rename refused, I/O error)."""
        return f"{self.decision}.failed"


def attempt_names(storage: Storage, name: str, run: str, counter: int) -> AttemptNames:
    attempt = f"{run}-{counter}"
    if storage.atomic_rename:
        staging = f".{name}{TMP_MARK}{attempt}"
        return AttemptNames(name, attempt, staging, "data", f"{staging}/zs-coord", f".{name}{DEC_MARK}{attempt}",
                            True)
    return AttemptNames(name, attempt, name, f"data-{attempt}", f"{name}/zs-coord-{attempt}",
                        f".{name}{DEC_MARK}{attempt}", False)


def read_decision(storage: Storage, names: AttemptNames) -> dict[str, Any] | None:
    try:
        data = storage.get(names.decision)
    except FileNotFoundError:
        return None
    doc = json.loads(data)
    return doc if isinstance(doc, dict) else None


def decide(storage: Storage, names: AttemptNames, doc: dict[str, Any]) -> dict[str, Any]:
    """Propose ``doc`` as the attempt's outcome; returns the outcome that holds (maybe another's)."""
    try:
        storage.put(names.decision, json.dumps(doc).encode(), if_absent=True)
    except FileExistsError:
        pass
    got = read_decision(storage, names)
    if got is None:  # pragma: no cover - put succeeded or the file existed
        raise WriterError("the decision file vanished", path=names.decision)
    return got


def abort_doc(exc: BaseException, rank: int, path: str) -> dict[str, Any]:
    """An abort decision carrying ``exc`` as every rank will raise it, naming ``rank``."""
    wire = to_wire(exc, path=path)
    if not isinstance(exc, ZerostallError) or exc.rank is None:
        wire["rank"] = rank
        wire["message"] = f"rank {rank}: {wire.get('message', '')}"
    return {"decision": "abort", "by": rank, "error": wire}


def error_of(decision: dict[str, Any]) -> ZerostallError:
    err = decision.get("error")
    if not isinstance(err, dict):
        return WriterError("the save was aborted (no reason recorded)")
    return from_wire(err)


def committed_attempt(storage: Storage, names: AttemptNames) -> str | None:
    """The attempt id recorded in the committed manifest at ``names.name``, if one is there."""
    key = f"{names.name}/{MANIFEST_NAME}"
    if not storage.exists(key):
        return None
    try:
        doc = json.loads(storage.get(key))
    except (FileNotFoundError, ValueError):
        return None
    att = doc.get("attempt") if isinstance(doc, dict) else None
    return att if isinstance(att, str) else ""


def wait_for_outcome(storage: Storage, names: AttemptNames, *, timeout_s: float, poll_s: float, rank: int,
                     path: str) -> None:
    """Return once the attempt is committed; raise the abort error (or a timeout) otherwise.

    On timeout without any decision, this rank decides "abort", naming rank 0 (the committer),
    so that no rank waits forever and all raise the same error. The timeout counts from the
    last sign of progress (another rank's report appearing), so a rank 0 that is still writing
    a large share is not mistaken for a dead one.
    """
    deadline = time.monotonic() + timeout_s
    reports = -1
    while True:
        if committed_attempt(storage, names) == names.attempt:
            return
        try:
            n = len(storage.list(f"{names.coord}/ranks"))
        except FileNotFoundError:
            n = reports
        if n > reports:
            reports = n
            deadline = time.monotonic() + timeout_s
        dec = read_decision(storage, names)
        if dec is not None and dec.get("decision") == "abort":
            raise error_of(dec)
        if dec is not None and storage.exists(names.failed):
            raise from_wire(json.loads(storage.get(names.failed)))
        if time.monotonic() > deadline:
            if dec is None:
                exc = WriterError(f"rank 0 neither committed nor aborted the save within {timeout_s:g} s "
                                  "(its writer is dead or late); nothing of this save was committed",
                                  path=path, rank=0)
                dec = decide(storage, names, {"decision": "abort", "by": rank, "error": to_wire(exc, path=path)})
                if dec.get("decision") == "abort":
                    raise error_of(dec)
            raise WriterError(f"rank 0 decided to commit but the checkpoint did not appear within {timeout_s:g} s",
                              path=path, rank=0)
        time.sleep(poll_s)
