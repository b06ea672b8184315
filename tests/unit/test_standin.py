"""Two writers of one rank's part of a collective attempt (a keeper only slow or hung, and a stand-in
for it from a replica): exactly one takes part, and the step is committed whole or not at all.
Both yield (the one that finds the part taken withdraws); a writer that does not yield, a trainer's
own collective save, aborts the attempt instead."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from zerostall.commit import committed_steps
from zerostall.commit.agreement import attempt_names, read_decision
from zerostall.format.manifest import parse_manifest
from zerostall.messages import Collective, FileRow, LeafRow, SaveJob, WriteOptions
from zerostall.persist.collective import CollectiveStep, RankTaken
from zerostall.persist.job import run_save
from zerostall.storage import open_storage

NAME = "step_00000001"


def _job(root: Path, rank: int) -> SaveJob:
    return SaveJob(id=rank, root=str(root), name=NAME, path=f"{root}/{NAME}",
                   files=(FileRow(name=f"f{rank}", length=80, buffer=0),),
                   leaves=(LeafRow(key="x", kind="bytes", dtype="U8", shape=(16,), file=0, offset=64, nbytes=16),),
                   items={"x": {"type": "array", "leaf": 0}}, step=1,
                   write=WriteOptions(direct_io=False, io_threads=1, chunk_bytes=1 << 20),
                   collective=Collective(rank=rank, world=2, run="run1", counter=1, timeout_s=5.0, poll_s=0.02))


def _views(rank: int) -> dict[int, memoryview]:
    return {0: memoryview(bytearray(64) + bytes([rank + 1] * 16))}


def _run(root: Path, rank: int, errors: dict[str, BaseException], who: str, stand_in: bool = False) -> None:
    job = _job(root, rank)
    assert job.collective is not None
    step = CollectiveStep(job, job.collective, open_storage(str(root)), yields=stand_in)
    try:
        run_save(job, _views(rank), lambda: None, step=step)
    except BaseException as exc:  # inspected by the test
        errors[who] = exc


def _wait_table(root: Path, rank: int) -> None:
    storage = open_storage(str(root))
    names = attempt_names(storage, NAME, "run1", 1)
    deadline = time.monotonic() + 30
    while not storage.exists(names.table(rank)):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_stand_in_finding_its_rank_s_part_taken_withdraws_and_the_step_commits(tmp_path: Path) -> None:
    errors: dict[str, BaseException] = {}
    owner = threading.Thread(target=_run, args=(tmp_path, 1, errors, "owner"))
    owner.start()
    _wait_table(tmp_path, 1)  # rank 1's own keeper took its part (rank 0 has not started: nothing is decided)
    _run(tmp_path, 1, errors, "stand-in", stand_in=True)
    assert isinstance(errors.pop("stand-in"), RankTaken)
    storage = open_storage(str(tmp_path))
    assert read_decision(storage, attempt_names(storage, NAME, "run1", 1)) is None  # it decided nothing
    _run(tmp_path, 0, errors, "rank 0")
    owner.join()
    assert errors == {}
    assert committed_steps(storage) == [1]
    m = parse_manifest(storage.get(f"{NAME}/manifest.json"), path=NAME)
    got = {m.leaves[r["x"]["leaf"]].file: m.leaves[r["x"]["leaf"]] for r in m.ranks}
    for rank, lf in got.items():  # each rank's part, written once, by one writer
        data = storage.get(f"{NAME}/{m.files[lf.file].path}")
        assert data[lf.offset:lf.offset + lf.nbytes] == bytes([rank + 1] * 16)
    assert sorted(got) == [0, 1]


def test_a_keeper_that_hung_finding_its_part_taken_by_a_stand_in_withdraws_and_the_step_commits(
        tmp_path: Path) -> None:
    errors: dict[str, BaseException] = {}
    stand_in = threading.Thread(target=_run, args=(tmp_path, 1, errors, "stand-in", True))
    stand_in.start()
    _wait_table(tmp_path, 1)  # the stand-in took rank 1's part while its keeper hung
    _run(tmp_path, 1, errors, "keeper", stand_in=True)  # its persist after the crash yields
    assert isinstance(errors.pop("keeper"), RankTaken)
    _run(tmp_path, 0, errors, "rank 0")
    stand_in.join()
    assert errors == {}
    assert committed_steps(open_storage(str(tmp_path))) == [1]


def test_a_writer_that_does_not_yield_finding_its_part_taken_aborts_the_attempt_nothing_is_committed(
        tmp_path: Path) -> None:
    errors: dict[str, BaseException] = {}
    stand_in = threading.Thread(target=_run, args=(tmp_path, 1, errors, "stand-in", True))
    stand_in.start()
    _wait_table(tmp_path, 1)
    _run(tmp_path, 1, errors, "owner")  # a trainer's collective save: its table is refused, it decides "abort"
    _run(tmp_path, 0, errors, "rank 0")
    stand_in.join()
    assert set(errors) == {"owner", "rank 0", "stand-in"}
    storage = open_storage(str(tmp_path))
    assert committed_steps(storage) == []
    dec = read_decision(storage, attempt_names(storage, NAME, "run1", 1))
    assert dec is not None and dec["decision"] == "abort"
    with pytest.raises(FileNotFoundError):
        storage.get(f"{NAME}/manifest.json")
