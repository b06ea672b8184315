"""The S3 server dies under a save: the save fails with a zerostall error, nothing is committed,
the previous step survives, and once the server is back the next save works.

Each test runs its own server (killing the session's would break the other tests), and sets the
writer's environment before the Checkpointer starts its writer process, which inherits it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import zerostall
from zerostall.errors import ZerostallError
from zerostall.persist.faults import ENV as FAULTS_ENV

MiB = 1 << 20


def wait_for(fn: Any, timeout: float = 30.0, every: float = 0.02) -> Any:
    """Call ``fn`` until it returns something truthy (errors count as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            out = fn()
            if out:
                return out
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(every)


def small(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 1024, generator=g), "step": seed}


def big(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40 * MiB // 4, generator=g), "step": seed}  # 40 MiB: 8 parts of 5 MiB


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"])


def test_server_killed_mid_upload(own_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server, bucket = own_server
    url = f"s3://{bucket}/run"
    client = server.client()
    # The writer holds 3 s before each commit, so even a kill that lands just after the last part
    # (a fast machine) comes before the commit: the outcome does not depend on timing.
    monkeypatch.setenv(FAULTS_ENV, '{"commit": "sleep:3"}')
    with zerostall.Checkpointer(url, keep_last=2) as ckpt:
        ckpt.save_pytree(1, small(1))
        r = ckpt.save_pytree_async(2, big(2))

        def upload_in_progress() -> bool:
            return bool(client.list_multipart_uploads(Bucket=bucket, Prefix="run/").get("Uploads"))

        deadline = time.monotonic() + 30
        while not upload_in_progress():
            assert not r.done(), "the upload finished before the server could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.kill()  # SIGKILL while parts are being uploaded

        with pytest.raises(ZerostallError) as info:
            r.result(timeout=120)
        assert isinstance(info.value, OSError)  # a StorageError, errno kept

        server.restart(bucket)
        assert ckpt.steps() == [1]  # nothing of step 2 committed
        assert same(ckpt.load_pytree(1), small(1))  # the previous step is intact

        ckpt.save_pytree(2, small(22))  # the same writer process, after the restart
        assert ckpt.steps() == [1, 2]
        assert same(ckpt.load_pytree(2), small(22))


def test_server_killed_before_the_manifest(own_server: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Data uploaded, server gone when the manifest is put: the step must not exist."""
    server, bucket = own_server
    url = f"s3://{bucket}/run2"
    with zerostall.Checkpointer(url) as ckpt:
        ckpt.save_pytree(1, small(1))
    monkeypatch.setenv(FAULTS_ENV, '{"commit": "sleep:2"}')
    with zerostall.Checkpointer(url) as ckpt:  # a new writer process, with the fault hook
        r = ckpt.save_pytree_async(2, small(2))
        client = server.client()
        # wait until the data objects of step 2 are uploaded, then kill during the sleep
        wait_for(lambda: client.list_objects_v2(Bucket=bucket, Prefix="run2/step_00000002/").get("KeyCount"))
        server.kill()
        with pytest.raises(ZerostallError):
            r.result(timeout=120)
        server.restart(bucket)
        assert ckpt.steps() == [1]
        assert same(ckpt.load_pytree(1), small(1))
    monkeypatch.delenv(FAULTS_ENV)
    with zerostall.Checkpointer(url) as ckpt:
        ckpt.save_pytree(2, small(2))  # the step name is free: the orphaned data did not block it
        assert ckpt.steps() == [1, 2] and same(ckpt.load_pytree(2), small(2))
