"""The names and patterns of the on-disk layout: what every file and directory of a checkpoint,
of a run directory and of a save in flight is called. Imports nothing of zerostall.

A committed checkpoint ``<name>/`` holds :data:`MANIFEST_NAME` (its presence is the commit) and
its data files, :func:`data_file` of each rank, under :data:`DATA_DIR` (POSIX) or
``DATA_PREFIX + <attempt>`` (object stores, where two attempts must never mix bytes). A run
directory holds one checkpoint per step, named by :func:`step_name`. Beside them, hidden names
mark what is not (or no longer) a checkpoint: attempt directories (:data:`TMP_MARK`), deletion
directories (:data:`DEL_MARK`) and collective decision files (:data:`DEC_MARK`). docs/format.md
describes the layout.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "MANIFEST_NAME", "DATA_DIR", "DATA_PREFIX", "COORD_DIR", "COORD_PREFIX", "PAD_PREFIX", "data_file",
    "STEP_RE", "TAKEN_STEP_RE", "step_name", "parse_step",
    "TMP_MARK", "DEL_MARK", "DEC_MARK", "ATTEMPT_RE", "SOLO_ATTEMPT_RE", "LIGHTNING_REMOVED_MARK",
    "LEASE_MARK", "LEASE_RE", "PUT_TMP_MARK", "LEASE_TMP_RE", "KEEPER_FAILED_PREFIX", "fsync_dir",
]

#: the manifest, written last: a checkpoint exists iff ``<name>/manifest.json`` exists
MANIFEST_NAME = "manifest.json"
#: the data directory of a checkpoint committed by rename (POSIX, memory)
DATA_DIR = "data"
#: object stores: the data directory is this prefix and the attempt's id
DATA_PREFIX = "data-"
#: a collective save's coordination files: inside its attempt directory (POSIX), or under
#: ``COORD_PREFIX + <attempt>`` in the checkpoint's prefix (object stores)
COORD_DIR = "zs-coord"
COORD_PREFIX = f"{COORD_DIR}-"
#: the ``U8`` entries of a data file's header that fill alignment gaps
PAD_PREFIX = "__zerostall_pad_"


def data_file(rank: int) -> str:
    """The data file ``rank`` writes, inside the checkpoint's data directory."""
    return f"rank-{rank:05d}.safetensors"


_STEP = "step_"
#: a committed step's directory in a run directory
STEP_RE = re.compile(rf"^{_STEP}(\d+)$")
#: a step number in use: committed, partial (manifest dropped) or in flight (``.step_N.zs-tmp-…``)
TAKEN_STEP_RE = re.compile(rf"^\.?{_STEP}(\d+)(?:$|\.)")


def step_name(step: int) -> str:
    """The directory of step ``step`` in a run directory: ``step_00000100``."""
    return f"{_STEP}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step a run directory's entry ``name`` holds, or None if it is no step's name."""
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


#: ``.<name>.zs-tmp-<tag>``: a save attempt's directory (invisible until renamed onto ``<name>``)
TMP_MARK = ".zs-tmp-"
#: ``.<name>.zs-del-<tag>``: a checkpoint renamed away by retention, its data being deleted
DEL_MARK = ".zs-del-"
#: ``.<name>.zs-decision-<attempt>[.failed]``: a collective save's commit decision
DEC_MARK = ".zs-decision-"
#: ``.<file>.zs-lightning-removed-<id>``: a Lightning path's old file, deleted once its replacement commits
LIGHTNING_REMOVED_MARK = ".zs-lightning-removed-"
#: ``.zs-lease-<host>-<pid>-<id>.json``: a writer's lease on its partial files, in the storage root
LEASE_MARK = ".zs-lease-"
LEASE_RE = re.compile(rf"^{re.escape(LEASE_MARK)}(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{12}}\.json$")
#: ``<key>.tmp-<pid>-<hex>``: a POSIX put's temporary, renamed (or linked) onto ``<key>`` once whole
PUT_TMP_MARK = ".tmp-"
#: a lease's put temporary: left behind only by a writer killed while writing or renewing its lease
LEASE_TMP_RE = re.compile(rf"^(?P<lease>{LEASE_RE.pattern[1:-1]}){re.escape(PUT_TMP_MARK)}\d+-[0-9a-f]+$")
#: ``.zs-keeper-failed-r<rank>.json``: a memory-tier keeper's failed persist, in the run directory
KEEPER_FAILED_PREFIX = ".zs-keeper-failed-r"


def _owned(*marks: str) -> re.Pattern[str]:
    """Names ``.<name><mark><host>-<pid>-<12 hex digits>``: which writer (host, pid) made them."""
    alternatives = "|".join(re.escape(m) for m in marks)
    return re.compile(rf"^\..+(?:{alternatives})(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{12}}$")


#: a solo save's attempt directory or a deletion directory, naming the writer that made it
ATTEMPT_RE = _owned(TMP_MARK, DEL_MARK)
#: a solo save's attempt directory, naming the writer that made it
SOLO_ATTEMPT_RE = _owned(TMP_MARK)


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (a rename or a new file in it).

    Raises:
        OSError: ``path`` cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
