"""A wrong S3 location is an error when the Checkpointer opens or the load starts, against a real
server (SeaweedFS): a missing bucket, refused credentials, an unreachable endpoint. A mistyped
bucket must not look like a fresh run (``latest_step()`` None)."""

from __future__ import annotations

import errno
import socket
from typing import Any

import pytest
import torch

import zerostall
from zerostall import Checkpointer
from zerostall.errors import CheckpointNotFoundError, ReadOnlyError, StorageError
from zerostall.storage import open_storage


def state(seed: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(seed)), "step": seed}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("read_only", [False, True])
def test_missing_bucket(s3_server: Any, read_only: bool) -> None:
    url = "s3://zs-no-such-bucket-reach/run"
    with pytest.raises(StorageError) as ei:
        Checkpointer(url, read_only=read_only)
    err = ei.value
    assert err.errno == errno.ENOENT
    assert not isinstance(err, CheckpointNotFoundError)
    assert "zs-no-such-bucket-reach" in str(err) and "does not exist" in str(err)
    with pytest.raises(StorageError) as ei:
        zerostall.load_pytree(url + "/step_00000001")
    assert not isinstance(ei.value, CheckpointNotFoundError)
    assert ei.value.errno == errno.ENOENT


def test_missing_key_in_a_good_bucket_is_still_not_found(s3_url: str) -> None:
    with pytest.raises(CheckpointNotFoundError):
        zerostall.load_pytree(s3_url + "/nothing")
    with Checkpointer(s3_url, read_only=True) as ro:  # an empty prefix is an empty run
        assert ro.latest_step() is None


def test_bad_credentials(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError) as ei:
        Checkpointer(s3_url)
    assert ei.value.errno == errno.EACCES
    assert ei.value.path == s3_url
    with pytest.raises(StorageError) as ei:
        zerostall.load_pytree(s3_url + "/step_00000001")
    assert ei.value.errno == errno.EACCES and not isinstance(ei.value, CheckpointNotFoundError)


def test_unreachable_endpoint(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    monkeypatch.setenv("ZEROSTALL_S3_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("ZEROSTALL_S3_CONNECT_TIMEOUT", "2")
    with pytest.raises(StorageError) as ei:
        Checkpointer(s3_url, read_only=True)
    assert ei.value.errno == errno.ECONNREFUSED
    with pytest.raises(StorageError) as ei:
        zerostall.load_pytree(s3_url + "/step_00000001")
    assert ei.value.errno == errno.ECONNREFUSED


def test_read_only_loads_and_refuses_saves(s3_url: str) -> None:
    with Checkpointer(s3_url) as ck:
        ck.save_pytree(2, state(2))
    with Checkpointer(s3_url, read_only=True) as ro:
        assert ro.latest_step() == 2
        assert ro.load_pytree()["step"] == 2
        with pytest.raises(ReadOnlyError):
            ro.save_pytree(3, state(3))
    assert [n for n in open_storage(s3_url).list("")] == ["step_00000002"]


def test_s3_probe(s3_url: str) -> None:
    from zerostall.storage.s3 import S3Storage

    S3Storage(s3_url).probe(write=True)  # an existing bucket, an empty prefix
    with pytest.raises(FileNotFoundError):
        S3Storage("s3://zs-no-such-bucket-reach/x").probe(write=False)
