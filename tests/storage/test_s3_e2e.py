"""End to end against a real S3 server: Checkpointer and free functions in the default PROCESS
writer mode, plus the S3 backend's own guarantees (aborted uploads, error mapping, retried
conditional writes, options)."""

from __future__ import annotations

import errno
import sys
from typing import Any

import pytest
import torch

import zerostall
from zerostall.commit import ManifestLastCommit, committed_steps, step_name
from zerostall.errors import CheckpointExistsError, StorageError, ZerostallError
from zerostall.format.manifest import MANIFEST_NAME
from zerostall.options import SaveOptions, WriterKind
from zerostall.storage import open_storage

MiB = 1 << 20


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(1024, generator=g).to(torch.bfloat16)},
        "optim": {"step": seed, "lr": 0.1 * seed, "m": torch.randn(300_000, generator=g)},
        "name": f"run-{seed}",
    }


def assert_state_equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def test_checkpointer_async_latest_restore_retention(s3_url: str) -> None:
    with zerostall.Checkpointer(s3_url, keep_last=2) as ckpt:
        assert ckpt._engine.options.writer is WriterKind.PROCESS
        assert ckpt.latest_step() is None
        responses = []
        for step in (10, 20, 30):
            st = state(step)
            responses.append(ckpt.save_pytree_async(step, st))
            st["model"]["w"].zero_()  # safe once save_*_async returned: the bytes were staged
            responses[-1].result()
        assert all(r.done() and r.exception() is None for r in responses)
        assert ckpt.latest_step() == 30
        assert ckpt.steps() == [20, 30]
        # retention removed step 10 entirely, data included, not just its manifest
        storage = open_storage(s3_url)
        assert storage.list("") == [step_name(20), step_name(30)]

        template = state(0)
        w = template["model"]["w"]
        ptr = w.data_ptr()
        out = ckpt.load_pytree(template=template)
        assert out["model"]["w"] is w and w.data_ptr() == ptr  # restored in place
        assert_state_equal(out, state(30))
        assert_state_equal(ckpt.load_pytree(20), state(20))

        with pytest.raises(CheckpointExistsError):
            ckpt.save_pytree(30, state(31))  # never overwrite a committed step
        assert_state_equal(ckpt.load_pytree(30), state(30))


def test_free_functions_with_s3_path(s3_url: str) -> None:
    path = f"{s3_url}/ckpt"
    st = state(7)
    zerostall.save_pytree(path, st, metadata={"epoch": 3})
    assert_state_equal(zerostall.load_pytree(path), st)
    with pytest.raises(CheckpointExistsError):
        zerostall.save_pytree(path, st)
    r = zerostall.save_pytree_async(f"{s3_url}/ckpt2", st)
    r.result()
    assert r.stats.persist_s is not None
    assert_state_equal(zerostall.load_pytree(f"{s3_url}/ckpt2"), st)


def test_multipart_save_and_restore(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 5 MiB parts (read by the writer process from its environment): a ~13 MiB state is
    # uploaded as a parallel multipart upload.
    monkeypatch.setenv("ZEROSTALL_S3_PART_SIZE", str(5 * MiB))
    st = {"x": torch.randn(13 * MiB // 4)}
    with zerostall.Checkpointer(s3_url) as ckpt:
        ckpt.save_pytree(1, st)
        assert_state_equal(ckpt.load_pytree(1), st)


def test_load_of_missing_checkpoint(s3_url: str) -> None:
    with pytest.raises(FileNotFoundError) as info:
        zerostall.load_pytree(f"{s3_url}/nothing")
    assert isinstance(info.value, ZerostallError)


def test_save_into_missing_bucket_fails_cleanly(s3_bucket: str) -> None:
    # A Checkpointer refuses the location when it opens (tests/storage/test_s3_reach.py); a free
    # save finds out in the writer.
    with pytest.raises(StorageError) as info:
        zerostall.Checkpointer(f"s3://{s3_bucket}-missing/run")
    assert info.value.errno == errno.ENOENT
    r = zerostall.save_pytree_async(f"s3://{s3_bucket}-missing/run/step_1", {"x": torch.ones(10)})
    with pytest.raises(StorageError) as info:
        r.result(timeout=120)
    assert info.value.errno == errno.ENOENT


# -- the backend's own guarantees ----------------------------------------------------------------

def test_failed_multipart_upload_leaves_nothing(s3_url: str) -> None:
    from zerostall.storage.s3 import S3Storage

    s = S3Storage(s3_url, part_size=5 * MiB, concurrency=2, max_attempts=1)
    real = s.client.upload_part
    calls = {"n": 0}

    def flaky_upload_part(**kw: Any) -> Any:
        calls["n"] += 1
        if kw["PartNumber"] == 3:
            raise OSError(errno.EIO, "injected part failure")
        return real(**kw)

    data = bytes(range(256)) * (16 * MiB // 256)
    view = memoryview(bytearray(data))
    s.client.upload_part = flaky_upload_part  # type: ignore[method-assign]
    try:
        with pytest.raises(OSError):
            s.write_from_buffer("d/f", view, len(data), threads=2, chunk_bytes=MiB, direct=False)
    finally:
        del s.client.upload_part
    assert calls["n"] >= 3
    assert not s.exists("d/f") and s.list("") == []
    bucket, prefix = s.bucket, s.prefix
    uploads = s.client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert uploads == []  # aborted, not left to accrue storage


def test_delete_aborts_orphaned_uploads(s3_url: str) -> None:
    from zerostall.storage.s3 import S3Storage

    s = S3Storage(s3_url)
    key = f"{s.prefix}/step/data-x/f"
    s.client.create_multipart_upload(Bucket=s.bucket, Key=key)  # a writer died after this
    s.delete("step")
    assert s.client.list_multipart_uploads(Bucket=s.bucket, Prefix=s.prefix).get("Uploads", []) == []


@pytest.mark.parametrize("operation", ["PutObject", "CompleteMultipartUpload"])
def test_retried_conditional_write_that_had_landed(s3_url: str, operation: str) -> None:
    """The reply to a conditional write is lost and botocore retries: the retry fails its
    precondition against our own object. That is success, not a conflict."""
    from zerostall.storage.s3 import S3Storage

    s = S3Storage(s3_url, part_size=5 * MiB)
    seen: list[int] = []

    def lose_first_reply(attempts: int, response: Any = None, **kw: Any) -> Any:
        seen.append(attempts)
        if attempts == 1 and response is not None and response[0].status_code == 200:
            return 0  # "retry after 0 s", as if the 200 had been lost on the way
        return None

    event = f"needs-retry.s3.{operation}"
    s.client.meta.events.register_first(event, lose_first_reply)
    try:
        if operation == "PutObject":
            s.put("m/manifest.json", b"mine", if_absent=True)
            assert s.get("m/manifest.json") == b"mine"
            with pytest.raises(FileExistsError):  # someone else's bytes are still a conflict
                s.put("m/manifest.json", b"theirs", if_absent=True)
        else:
            data = bytes(11 * MiB)
            s.write_from_buffer("m/data", memoryview(data), len(data), threads=2, chunk_bytes=MiB, direct=False)
            assert s.size("m/data") == len(data)
    finally:
        s.client.meta.events.unregister(event, lose_first_reply)
    assert 2 in seen  # the forced retry happened


def test_commit_with_unknown_outcome(s3_url: str) -> None:
    """A manifest put that times out after landing is a commit; abort must not delete its data."""
    from zerostall.storage.s3 import S3Storage

    class LostReply(S3Storage):
        def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
            super().put(key, data, if_absent=if_absent)
            if key.endswith(MANIFEST_NAME):
                raise TimeoutError(errno.ETIMEDOUT, "reply lost", key)

    s = LostReply(s3_url)
    p = ManifestLastCommit(s)
    a = p.begin("step_00000001")
    s.write_from_buffer(f"{a.staging}/{a.data_dir}/f", memoryview(b"abc"), 3, threads=1, chunk_bytes=MiB,
                        direct=False)
    p.commit(a, f'{{"files": [{{"path": "{a.data_dir}/f"}}]}}'.encode())
    p.abort(a)  # even if the caller aborts anyway
    assert committed_steps(s) == [1]
    assert s.get(f"step_00000001/{a.data_dir}/f") == b"abc"


def test_error_mapping(s3_url: str, s3_server: Any) -> None:
    from zerostall.storage.s3 import S3Storage

    with pytest.raises(FileNotFoundError):
        S3Storage("s3://no-such-bucket-zs/x").get("k")
    import boto3

    bad = S3Storage(s3_url)
    bad.client = boto3.session.Session().client(  # this instance only: a wrong secret
        "s3", endpoint_url=s3_server.endpoint, region_name="us-east-1",
        aws_access_key_id=s3_server.env["AWS_ACCESS_KEY_ID"], aws_secret_access_key="wrong-secret")
    with pytest.raises(PermissionError):
        bad.put("k", b"x")
    dead = S3Storage(s3_url, endpoint_url="http://127.0.0.1:9", max_attempts=1, connect_timeout=1)
    with pytest.raises(OSError) as info:
        dead.get("k")
    assert info.value.errno == errno.ECONNREFUSED


def test_options_from_env() -> None:
    import boto3  # noqa: F401  (a dev dependency: missing means a broken install)

    from zerostall.storage.s3 import S3Options

    o = S3Options.from_env({"ZEROSTALL_S3_PART_SIZE": "8388608", "ZEROSTALL_S3_CONCURRENCY": "3",
                            "ZEROSTALL_S3_RETRY_MODE": "adaptive", "ZEROSTALL_S3_READ_TIMEOUT": "5"})
    assert (o.part_size, o.concurrency, o.retry_mode, o.read_timeout) == (8 * MiB, 3, "adaptive", 5.0)
    assert S3Options.from_env({}, concurrency=2).concurrency == 2
    with pytest.raises(ValueError):
        S3Options.from_env({"ZEROSTALL_S3_PART_SIZE": "1000"})  # below S3's 5 MiB minimum
    with pytest.raises(ValueError):
        S3Options.from_env({"ZEROSTALL_S3_CONCURRENCY": "many"})


def test_missing_boto3_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 -> ImportError
    monkeypatch.delitem(sys.modules, "zerostall.storage.s3", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'zerostall\[s3\]'"):
        open_storage("s3://bucket/prefix")


def test_thread_writer_also_works(s3_url: str) -> None:
    st = state(3)
    zerostall.save_pytree(f"{s3_url}/t", st, options=SaveOptions(writer=WriterKind.THREAD))
    assert_state_equal(zerostall.load_pytree(f"{s3_url}/t"), st)


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **kw: Any) -> Any:
        yield self.body


@pytest.mark.parametrize("max_attempts, fails, ok", [(4, 2, True), (2, 2, False)])
def test_throttling_is_retried(s3_url: str, max_attempts: int, fails: int, ok: bool) -> None:
    """SeaweedFS cannot be made to throttle on demand: the first ``fails`` PutObject requests are
    answered 503 SlowDown by a hook in front of the real server."""
    from botocore.awsrequest import AWSResponse

    from zerostall.storage.s3 import S3Storage

    s = S3Storage(s3_url, max_attempts=max_attempts, concurrency=11)  # its own client
    calls = {"n": 0}
    body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"

    def throttle(request: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] <= fails:
            return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _Raw(body))
        return None

    s.client.meta.events.register_first("before-send.s3.PutObject", throttle)
    try:
        if ok:
            s.put("k", b"v", if_absent=True)
            assert s.get("k") == b"v" and calls["n"] == fails + 1
        else:
            with pytest.raises(OSError) as info:
                s.put("k", b"v", if_absent=True)
            assert info.value.errno == errno.EAGAIN and calls["n"] == max_attempts
    finally:
        s.client.meta.events.unregister("before-send.s3.PutObject", throttle)


def test_listing_and_delete_across_pages_and_batches(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pagination and DeleteObjects batching, with pages and batches of 7 instead of 1000."""
    import zerostall.storage.s3 as s3mod

    monkeypatch.setattr(s3mod, "_LIST_PAGE", 7)
    monkeypatch.setattr(s3mod, "_DELETE_BATCH", 7)
    s = s3mod.S3Storage(s3_url)
    names = [f"step_{i:08d}" for i in range(12)]
    for n in names:
        for f in ("manifest.json", "data-x/a", "data-x/b"):
            s.put(f"{n}/{f}", b"1")
    assert s.list("") == names  # 36 keys over 6 pages
    s.delete("")  # 36 keys in 6 batches
    assert s.list("") == [] and not s.exists("")


def test_read_resumes_a_broken_stream(s3_url: str) -> None:
    """The connection drops mid-body (not producible on demand with the real server): the rest of
    the range is requested again and the buffer ends up complete."""
    from botocore.exceptions import ResponseStreamingError

    from zerostall.storage.s3 import S3Storage

    s = S3Storage(s3_url)
    data = bytes(range(256)) * 400  # 102,400 bytes
    s.put("obj", data)
    real = s.client.get_object
    ranges: list[str] = []

    class Breaks:
        def __init__(self, body: Any) -> None:
            self.body, self.sent = body, 0

        def readinto(self, b: Any) -> int:
            if self.sent >= 1000:
                raise ResponseStreamingError(error="connection reset by peer")
            n = self.body.readinto(memoryview(b)[:1000 - self.sent])
            self.sent += n
            return n

        def close(self) -> None:
            self.body.close()

    def get_object(**kw: Any) -> Any:
        ranges.append(kw.get("Range", ""))
        resp = real(**kw)
        if len(ranges) == 1:
            resp["Body"] = Breaks(resp["Body"])
        return resp

    s.client.get_object = get_object  # type: ignore[method-assign]
    try:
        out = bytearray(50_000)
        s.read_into("obj", 100, memoryview(out))
    finally:
        del s.client.get_object
    assert out == data[100:50_100]
    assert ranges == ["bytes=100-50099", "bytes=1100-50099"]


def test_two_writer_processes_race_for_one_step(s3_url: str) -> None:
    """Two Checkpointers (two writer processes) save the same step at once: exactly one commits,
    the other gets CheckpointExistsError, and the step holds the winner's state."""
    a, b = zerostall.Checkpointer(s3_url), zerostall.Checkpointer(s3_url)
    try:
        ra = a.save_pytree_async(5, state(1))
        rb = b.save_pytree_async(5, state(2))
        outcomes = []
        for r in (ra, rb):
            try:
                r.result(timeout=120)
                outcomes.append(None)
            except CheckpointExistsError as exc:
                outcomes.append(exc)
        assert sorted(o is None for o in outcomes) == [False, True], outcomes
        winner = state(1) if outcomes[0] is None else state(2)
        assert_state_equal(a.load_pytree(5), winner)
        # the loser removed its own data: only the winner's data directory is left
        storage = open_storage(s3_url)
        assert len([n for n in storage.list(step_name(5)) if n.startswith("data-")]) == 1
    finally:
        a.close()
        b.close()
