"""Which instance of a checkpoint directory this is: a marker written when the directory is created.

A path names a directory only until someone deletes it; a new run on the same path after an
``rm -rf`` (or an S3 prefix deleted and written again) is a fresh start. The memory tier's keeper
outlives its trainer and holds steps *of the directory it saved into*, so it must be able to tell
that directory from a new one at the same path. The first ``Checkpointer`` with a memory tier that
opens a writable directory without a marker writes ``<directory>/.zs-instance.json``::

    {"instance": "9f0c…(32 hex digits)", "created": 1763891204.5}

with a conditional put (``put(if_absent=True)``: of several ranks opening a new directory at once,
the first writer wins and every rank reads the winner's id). The id never changes while the
directory exists; nothing but deleting the directory removes the file (``gc``, retention and
``zerostall rm`` leave it alone). The keeper is started with its trainer's id
(:class:`zerostall.memtier.spec.KeeperSpec`) and offers a held step only to a trainer of the
same id, and persists it only while the directory still carries that id (docs/guarantees.md,
"A deleted directory is a fresh start").

A directory written without a marker (by an older version, or without a memory tier) gets one
from the first ``Checkpointer`` with a memory tier that opens it writable: it becomes that
instance from then on, with every step it holds. A read-only ``Checkpointer`` never writes one;
its id is the marker's if there is one, else empty.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from zerostall.storage import Storage

__all__ = ["INSTANCE_KEY", "read_instance", "ensure_instance"]

INSTANCE_KEY = ".zs-instance.json"


def _parse(raw: bytes) -> str:
    """The id a marker holds. A marker that is not the expected JSON still names one instance:
    the digest of its bytes (a directory keeps its identity as long as the file is unchanged)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    got = doc.get("instance") if isinstance(doc, dict) else None
    if isinstance(got, str) and got:
        return got
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:32]


def read_instance(storage: Storage) -> str | None:
    """The directory's instance id; None when it has no marker (or no longer exists).

    Raises:
        OSError: storage could not be read (the instance is then unknown, not absent).
    """
    try:
        return _parse(storage.get(INSTANCE_KEY))
    except FileNotFoundError:
        return None


def ensure_instance(storage: Storage) -> str:
    """The directory's instance id, writing the marker first if it has none.

    Raises:
        OSError: storage could not be read or written.
    """
    got = read_instance(storage)
    if got is not None:
        return got
    new = os.urandom(16).hex()
    try:
        storage.put(INSTANCE_KEY, json.dumps({"instance": new, "created": time.time()}).encode(), if_absent=True)
    except FileExistsError:  # another rank (or process) created the directory at the same moment
        got = read_instance(storage)
        if got is None:
            raise
        return got
    return new
