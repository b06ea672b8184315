"""The agreement of a collective save's ranks on one outcome, through the storage only.

Shared by both sides of the trainer/writer boundary: the writers decide and follow it
(:mod:`zerostall.persist.collective`), and a trainer whose save failed before its writer got it
decides "abort" at once so the other ranks need not time out (:mod:`zerostall.distributed.context`).
Every rank derives the same names from ``(checkpoint name, run id, save counter)`` without
talking; the one place that decides the outcome of an attempt is its *decision file*, created
with ``put(if_absent=True)``: the first writer wins, so exactly one of "commit" (only rank 0
writes it, once every report is in) or "abort" (any rank, on its own failure or on a timeout)
ever exists, and every rank follows it. Never on the training thread but for that one abort;
never touches torch.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from zerostall.errors import WriterError, ZerostallError
from zerostall.format.layout import (
    COORD_DIR,
    COORD_PREFIX,
    DATA_DIR,
    DATA_PREFIX,
    DEC_MARK,
    MANIFEST_NAME,
    TMP_MARK,
    data_file,
)
from zerostall.messages import WireError, from_wire, to_wire
from zerostall.storage import Storage

__all__ = ["AttemptNames", "attempt_names", "read_decision", "decide", "abort_doc", "error_of", "wait_for_outcome"]


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
        return f"{self.staging}/{self.data_dir}/{data_file(rank)}"

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
        return AttemptNames(name, attempt, staging, DATA_DIR, f"{staging}/{COORD_DIR}", f".{name}{DEC_MARK}{attempt}",
                            True)
    return AttemptNames(name, attempt, name, f"{DATA_PREFIX}{attempt}", f"{name}/{COORD_PREFIX}{attempt}",
                        f".{name}{DEC_MARK}{attempt}", False)


# -- the decision ------------------------------------------------------------------------------


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
        wire = WireError(cls=wire.cls, message=f"rank {rank}: {wire.message}", errno=wire.errno, path=wire.path,
                         key=wire.key, rank=rank)
    return {"decision": "abort", "by": rank, "error": wire.to_json()}


def error_of(decision: dict[str, Any]) -> ZerostallError:
    err = decision.get("error")
    if not isinstance(err, dict):
        return WriterError("the save was aborted (no reason recorded)")
    return from_wire(WireError.from_json(err))


def _committed_attempt(storage: Storage, names: AttemptNames) -> str | None:
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

    Raises:
        ZerostallError: the abort's error, as every rank raises it.
        WriterError: rank 0 neither committed nor aborted within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    reports = -1
    while True:
        if _committed_attempt(storage, names) == names.attempt:
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
            raise from_wire(WireError.from_json(json.loads(storage.get(names.failed))))
        if time.monotonic() > deadline:
            if dec is None:
                exc = WriterError(f"rank 0 neither committed nor aborted the save within {timeout_s:g} s "
                                  "(its writer is dead or late); nothing of this save was committed",
                                  path=path, rank=0)
                dec = decide(storage, names, {"decision": "abort", "by": rank,
                                              "error": to_wire(exc, path=path).to_json()})
                if dec.get("decision") == "abort":
                    raise error_of(dec)
            raise WriterError(f"rank 0 decided to commit but the checkpoint did not appear within {timeout_s:g} s",
                              path=path, rank=0)
        time.sleep(poll_s)
