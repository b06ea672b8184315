"""No orphans on a real object store (SeaweedFS): writers of "another host" killed at every phase,
plus incomplete multipart uploads, are removed by ``zerostall gc`` once their leases expire;
a live writer's data and a live upload are never touched; committed steps stay whole."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
import pytest

from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.cli import main as cli_main
from zerostall.lease import HOST_ENV, Lease, read_leases
from zerostall.persist.faults import PHASES
from zerostall.persist.gc import collect_garbage
from zerostall.storage.s3 import S3Storage

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration"))
import _orphans as orph

THREAD = SaveOptions(writer=WriterKind.THREAD)


def _keys(st: S3Storage) -> list[str]:
    base = f"{st.prefix}/"
    out = []
    for page in st.client.get_paginator("list_objects_v2").paginate(Bucket=st.bucket, Prefix=base):
        out.extend(o["Key"][len(base):] for o in page.get("Contents", ()))
    return sorted(out)


def _upload(st: S3Storage, key: str) -> str:
    k = f"{st.prefix}/{key}"
    uid = str(st.client.create_multipart_upload(Bucket=st.bucket, Key=k)["UploadId"])
    st.client.upload_part(Bucket=st.bucket, Key=k, UploadId=uid, PartNumber=1, Body=b"p" * (5 << 20))
    return uid


def _referenced_only(st: S3Storage, allowed: set[str]) -> None:
    """Every key is a committed manifest, data it refers to, or in ``allowed``."""
    for key in _keys(st):
        if key in allowed or any(key.startswith(a + "/") for a in allowed):
            continue
        step, rest = key.split("/", 1)
        if rest == "manifest.json":
            continue
        files = json.loads(st.get(f"{step}/manifest.json"))["files"]
        assert rest in {f["path"] for f in files}, f"orphan {key}"


def test_s3_writers_killed_at_every_phase_and_uploads(s3_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    st = S3Storage(s3_url)
    with Checkpointer(s3_url, save_options=THREAD) as ck:
        ck.save_pytree(1, orph.state(1))
        ck.save_pytree(2, orph.state(2))
    doomed = {ph: orph.start_held(s3_url, tmp_path, 10 + i, ph, "sleep:300") for i, ph in enumerate(PHASES)}
    gate = tmp_path / "gate"
    live = orph.start_held(s3_url, tmp_path, 30, "manifest", f"wait:{gate}")
    held: Lease | None = None
    try:
        for ph, t in doomed.items():
            orph.wait_mark(t.mark, ph)  # type: ignore[attr-defined]
        orph.wait_mark(live.mark, "manifest")  # type: ignore[attr-defined]
        for t in doomed.values():
            t.kill()
        # Incomplete multipart uploads of two more writers of the other host: one gone (its lease
        # no longer renewed), one alive (renewing).
        monkeypatch.setenv(HOST_ENV, orph.OTHER)
        gone = Lease(st, ["step_00000040/data-0123456789ab"], duration_s=0.5).acquire()
        gone.release(delete=False)
        gone_id = _upload(st, "step_00000040/data-0123456789ab/rank-00000.safetensors")
        held = Lease(st, ["step_00000041/data-ba9876543210"], duration_s=30).acquire()
        live_id = _upload(st, "step_00000041/data-ba9876543210/rank-00000.safetensors")
        monkeypatch.delenv(HOST_ENV)

        leases = read_leases(st)
        dead = [ls for ls in leases if ls.pid not in (live.writer, os.getpid())]
        assert sorted(ls.pid for ls in dead) == sorted(doomed[ph].writer for ph in PHASES[1:5])
        abandoned = [*dead, *(ls for ls in leases if ls.key == gone.key)]
        early = collect_garbage(st, dry_run=True, now=min(ls.expires or 0 for ls in abandoned) - 0.01)
        assert early.removed == [] and early.uploads_aborted == []
        while time.time() <= max(ls.expires or 0 for ls in abandoned) + 0.05:
            time.sleep(0.05)

        assert cli_main(["gc", s3_url, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        # the data of the writers killed at checksum, manifest and commit (none yet at write)
        assert sorted(k.split("/")[0] for k in report["removed"]) == ["step_00000012", "step_00000013",
                                                                      "step_00000014"]
        assert all(k.split("/")[1].startswith("data-") for k in report["removed"])
        assert [u.split("#")[1] for u in report["uploads_aborted"]] == [gone_id]
        assert len(report["leases_removed"]) == 5
        assert any(k.startswith("step_00000030/data-") for k in report["kept_live"])
        assert any(k.endswith(f"#{live_id}") for k in report["kept_live"])
        uploads = st.list_uploads("")
        assert [u for _, u in uploads] == [live_id]
        live_data = [k for k in report["kept_live"] if k.startswith("step_00000030/")]
        _referenced_only(st, {ls.key for ls in read_leases(st)} | set(live_data))
        with Checkpointer(s3_url, save_options=THREAD) as ck:
            assert ck.steps() == [1, 2, 15]  # 15: killed at retention, after its commit
            for s in ck.steps():
                np.testing.assert_array_equal(ck.load_pytree(s)["w"], orph.state(s)["w"])
        gate.touch()
        assert "COMMITTED 30" in live.finish()
    finally:
        if held is not None:
            held.release()  # the "writer" of step 41 is done: its upload is now abandoned
        for t in [*doomed.values(), live]:
            if t.proc.poll() is None:
                t.kill()
    with Checkpointer(s3_url, save_options=THREAD) as ck:
        assert ck.gc_report is not None and [u.split("#")[1] for u in ck.gc_report.uploads_aborted] == [live_id]
        assert ck.steps() == [2, 15, 30]
    assert st.list_uploads("") == []
    assert not read_leases(st)
    _referenced_only(st, set())
