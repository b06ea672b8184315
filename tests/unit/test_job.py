"""The writer's use of the CRC32Cs staging computed (``SaveJob.crcs``): leaves staging checksummed
are not checksummed again; the others are; the committed manifest loads and verifies."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import zerostall
import zerostall.memcopy as memcopy
import zerostall.persist.job as job
import zerostall.stage.stager as stager
from zerostall import Checkpointer, SaveOptions, WriterKind

MiB = 1 << 20


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of every leaf the writer checksums (the thread writer runs in this process)."""
    sizes: list[int] = []
    real: Callable[..., int] = job.checksum

    def counted(view: Any, *a: Any) -> int:
        sizes.append(len(view))
        return real(view, *a)

    monkeypatch.setattr(job, "checksum", counted)
    return sizes


def _manifest_crcs(path: Path) -> dict[str, int]:
    doc = json.loads((path / "manifest.json").read_text())
    return {lf["key"]: lf["crc32c"] for lf in doc["leaves"]}


@pytest.mark.parametrize("staging", ["blocking", "overlap"])
@pytest.mark.parametrize("stage_crc", [True, False], ids=["staged-crc", "writer-crc"])
def test_the_writer_checksums_only_what_staging_did_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        staging: str, stage_crc: bool) -> None:
    if not memcopy.CRC_COPY:
        pytest.fail("the copy kernel is not built here (tests/unit/test_memcopy.py says why)")
    monkeypatch.setattr(stager, "STAGE_CRC", stage_crc)
    sizes = _counting(monkeypatch)
    model = torch.nn.Linear(512, 512)  # a 1 MiB weight: streamed (overlapped: by the copier)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 512)).sum().backward()
    opt.step()
    extra = {"np": np.arange(MiB // 8, dtype=np.float64), "small": torch.arange(5.0)}
    with Checkpointer(tmp_path, save_options=SaveOptions(writer=WriterKind.THREAD, staging=staging)) as ckpt:
        weight = model.weight.detach().clone()
        ckpt.save_pytree_async(1, {"model": model, "optimizer": opt, "extra": extra}).result()
        got = ckpt.load_pytree(1)  # verifies every leaf against the manifest
    assert torch.equal(got["model"]["weight"], weight)
    crcs = _manifest_crcs(tmp_path / "step_00000001")
    w_key = next(k for k in crcs if k.endswith("weight"))
    np_key = next(k for k in crcs if k.endswith("np"))
    assert crcs[np_key] == crc32c.crc32c(extra["np"].tobytes())
    big = [n for n in sizes if n >= MiB]
    if stage_crc:
        assert big == [], f"the writer checksummed {big} bytes that staging had checksummed"
        assert any(n < MiB for n in sizes)  # the small leaves it still sums itself
    else:
        assert sorted(big) == [MiB, MiB]  # the weight and the numpy leaf
    assert w_key in crcs


def test_a_job_with_checksums_for_other_leaves_is_refused() -> None:
    from zerostall.errors import WriterError
    from zerostall.messages import FileRow, LeafRow, SaveJob, WriteOptions

    rows = tuple(LeafRow(key=f"k{i}", kind="torch", dtype="U8", shape=(4,), file=0, offset=64 + 4 * i, nbytes=4)
                 for i in range(2))
    bad = SaveJob(id=1, root="/r", name="s", path="/r/s", files=(FileRow(name="f", length=72, buffer=0),),
                  leaves=rows, items={}, write=WriteOptions(direct_io=False, io_threads=1, chunk_bytes=MiB),
                  crcs=(5,))
    with pytest.raises(WriterError, match="1 checksums for 2 leaves"):
        job._known(bad, None)
    assert job._known(bad, [7, None]) == [7, None]  # the keeper's checked CRCs win


def test_a_thread_writer_leaves_the_trainers_environment_as_the_trainer_set_it(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread writer shares the trainer's ``os.environ``: a job that starts after the trainer
    changed its storage variables uses them and neither restores nor removes what changed."""
    go = tmp_path / "go"
    monkeypatch.delenv("AWS_ZS_ROTATED", raising=False)
    monkeypatch.setenv("ZEROSTALL_FAULTS", json.dumps({"begin": f"wait:{go}"}))  # every job waits at its start
    thread = SaveOptions(writer=WriterKind.THREAD, max_in_flight=2)  # the second save stages while the first waits
    first = zerostall.save_pytree_async(tmp_path / "a", {"w": torch.ones(4)}, options=thread)
    second = zerostall.save_pytree_async(tmp_path / "b", {"w": torch.ones(4)}, options=thread)  # queued; env taken now
    monkeypatch.setenv("AWS_ZS_ROTATED", "set-after-the-save")  # as a trainer rotating its credentials
    go.touch()
    first.result()
    second.result()
    assert os.environ.get("AWS_ZS_ROTATED") == "set-after-the-save"
