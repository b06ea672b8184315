"""S3 backend (``s3://bucket/prefix``) on boto3: no rename, so the manifest-last commit applies.

Invariants:

* Bytes are never copied into a Python ``bytes`` on the way out: a data file is uploaded from
  ``memoryview`` slices of the staged buffer (one part per slice, parts in parallel); a ranged
  GET streams into the caller's buffer with ``readinto``.
* Every write is conditional (``If-None-Match: *``): a second writer of the same key gets
  ``FileExistsError``. A conditional write that botocore *retried* and that then fails its
  precondition may have been our own first attempt landing; that case is checked (same bytes
  for :meth:`put`, same size for :meth:`write_from_buffer`) instead of reported as a conflict.
* Errors leave as builtins: missing key or bucket -> ``FileNotFoundError``; precondition
  failed -> ``FileExistsError``; range past the end / short body -> ``EOFError``; access
  denied or no credentials -> ``PermissionError``; anything else -> ``OSError`` with an errno
  (``ETIMEDOUT``, ``ECONNREFUSED``, ``ECONNRESET``, ``EAGAIN`` for throttling, ``EIO``).
* Configuration comes from the constructor, else from the environment, because the writer is a
  separate process that opens storage by URL and inherits only the environment. Endpoint,
  region and credentials follow boto3's own chain (``AWS_ENDPOINT_URL[_S3]``, ``AWS_REGION``,
  ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profiles, instance roles); tuning knobs are
  ``ZEROSTALL_S3_*`` (see :class:`S3Options`).

No torch import here; boto3 is imported on first use of this module (the ``s3`` extra).
"""

from __future__ import annotations

import errno
import io
import os
import random
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

import boto3
from botocore import exceptions as bex
from botocore.config import Config

from zerostall.envvars import S3_PREFIX
from zerostall.errors import InvalidArgumentError
from zerostall.storage.base import Capabilities
from zerostall.validate import check_int, check_number

__all__ = ["S3Storage", "S3Options"]

MiB = 1 << 20
_MIN_PART = 5 * MiB  # S3's minimum part size (all parts but the last)
_MAX_PARTS = 10_000
_DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
_LIST_PAGE = 1000  # ListObjectsV2 returns at most 1000 keys a page


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """How the S3 backend talks to the server. Unset fields come from the environment.

    Attributes:
        endpoint_url: the S3 endpoint; default boto3's (``AWS_ENDPOINT_URL_S3`` /
            ``AWS_ENDPOINT_URL``, else AWS).
        region: default boto3's (``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / profile).
        part_size: multipart part size in bytes (``ZEROSTALL_S3_PART_SIZE``, default 32 MiB);
            objects up to this size go in one PUT. Raised automatically to stay within 10,000
            parts, and never below S3's 5 MiB minimum.
        concurrency: parallel part uploads per object (``ZEROSTALL_S3_CONCURRENCY``, default 8);
            a save's ``io_threads`` raises it, never lowers it.
        max_attempts: attempts per request, retries included (``ZEROSTALL_S3_MAX_ATTEMPTS``,
            default 5), with exponential backoff on 5xx, throttling and connection errors.
        retry_mode: botocore retry mode, ``standard`` or ``adaptive``
            (``ZEROSTALL_S3_RETRY_MODE``, default ``standard``).
        connect_timeout / read_timeout: seconds (``ZEROSTALL_S3_CONNECT_TIMEOUT`` default 10,
            ``ZEROSTALL_S3_READ_TIMEOUT`` default 60).
        addressing_style: ``auto``, ``path`` or ``virtual`` (``ZEROSTALL_S3_ADDRESSING_STYLE``,
            default ``auto``).
    """

    endpoint_url: str | None = None
    region: str | None = None
    part_size: int = 32 * MiB
    concurrency: int = 8
    max_attempts: int = 5
    retry_mode: str = "standard"
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    addressing_style: str = "auto"

    def __post_init__(self) -> None:
        for name in ("part_size", "concurrency", "max_attempts"):
            check_int(f"S3Options.{name}", getattr(self, name))
        for name in ("connect_timeout", "read_timeout"):
            check_number(f"S3Options.{name}", getattr(self, name), positive=True)
        if self.part_size < _MIN_PART:
            raise InvalidArgumentError(f"part_size must be >= 5 MiB (S3's minimum), got {self.part_size}")
        if self.concurrency < 1:
            raise InvalidArgumentError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_attempts < 1:
            raise InvalidArgumentError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.retry_mode not in ("standard", "adaptive", "legacy"):
            raise InvalidArgumentError(f"retry_mode must be 'standard' or 'adaptive', got {self.retry_mode!r}")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise InvalidArgumentError(f"addressing_style must be auto, path or virtual, got {self.addressing_style!r}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> S3Options:
        """Options from ``ZEROSTALL_S3_<FIELD>`` variables, then ``overrides`` on top."""
        env = os.environ if environ is None else environ
        kw: dict[str, Any] = {}
        for f in fields(cls):
            name = f"{S3_PREFIX}{f.name.upper()}"
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            kind = type(f.default).__name__ if isinstance(f.default, (int, float)) else "str"
            try:
                kw[f.name] = int(float(raw)) if kind == "int" else float(raw) if kind == "float" else raw
            except ValueError:
                raise InvalidArgumentError(f"{name}={raw!r} is not a valid {kind}", argument=name) from None
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


# One client per (process, options, AWS environment): creating one costs ~50 ms and a connection
# pool; boto3 clients are thread-safe once created, sessions are not (hence the lock). The AWS
# variables boto3 reads at creation are part of the key, so a changed endpoint or credential in
# the environment gets a new client instead of a stale one.
_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE",
            "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
            "AWS_SHARED_CREDENTIALS_FILE")


def _client(opts: S3Options) -> Any:
    k = (os.getpid(), opts, tuple(os.environ.get(v) for v in _AWS_ENV))
    with _CLIENTS_LOCK:
        c = _CLIENTS.get(k)
        if c is None:
            cfg = Config(
                retries={"total_max_attempts": opts.max_attempts, "mode": opts.retry_mode},  # initial call included
                connect_timeout=opts.connect_timeout,
                read_timeout=opts.read_timeout,
                max_pool_connections=max(16, opts.concurrency * 4),  # up to 4 files x concurrency
                s3={"addressing_style": opts.addressing_style},
                # zerostall checksums every leaf with CRC32C itself; a second whole-body checksum
                # per request would cost a pass over the bytes for nothing.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            )
            c = boto3.session.Session().client(
                "s3", endpoint_url=opts.endpoint_url, region_name=opts.region, config=cfg)
            _CLIENTS[k] = c
        return c


class _ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview; ``read`` returns zero-copy slices.

    botocore needs a file-like body (it refuses a bare memoryview) that it can rewind for a
    retry; urllib3 then sends each slice with ``sendall``: the staged bytes are never copied
    into Python objects.
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._view)

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> memoryview:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        out = self._view[self._pos:end]
        self._pos = max(self._pos, end)
        return out

    def readinto(self, b: Any) -> int:
        chunk = self.read(len(b))
        n = len(chunk)
        memoryview(b).cast("B")[:n] = chunk
        return n


def _parse(root_url: str) -> tuple[str, str]:
    rest = root_url.split("://", 1)[1] if "://" in root_url else root_url
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise InvalidArgumentError("S3 URL has no bucket; expected s3://bucket/prefix", path=root_url, argument="path")
    return bucket, prefix


class S3Storage:
    """Objects under ``s3://bucket/prefix``; a "prefix" is every key below ``<prefix>/``."""

    atomic_rename = False
    capabilities = Capabilities(multipart_uploads=True, probe=True)

    def __init__(self, root_url: str, *, options: S3Options | None = None, **overrides: Any) -> None:
        self.bucket, self.prefix = _parse(root_url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.options = replace(options, **overrides) if options is not None else S3Options.from_env(**overrides)
        self.client = _client(self.options)

    # -- keys --------------------------------------------------------------------------------

    def _k(self, key: str) -> str:
        if key and (key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/"))):
            raise ValueError(f"storage key {key!r} is not a relative path under {self.url!r}")
        if not key:
            return self.prefix
        return f"{self.prefix}/{key}" if self.prefix else key

    def _url(self, k: str) -> str:
        return f"s3://{self.bucket}/{k}"

    def _dir(self, key: str) -> str:
        """The S3 prefix of everything under ``key`` ("" or ending in "/")."""
        k = self._k(key)
        return f"{k}/" if k else ""

    # -- writing -----------------------------------------------------------------------------

    def write_from_buffer(
        self, key: str, buf: memoryview, length: int, *, threads: int, chunk_bytes: int, direct: bool
    ) -> None:
        """Upload ``buf[:length]``: one PUT up to ``part_size``, else a parallel multipart upload.

        ``chunk_bytes`` and ``direct`` are for files; S3 uses ``S3Options.part_size``.
        """
        k = self._k(key)
        if length > buf.nbytes:
            raise ValueError(f"length {length} exceeds the buffer's {buf.nbytes} bytes")
        view = memoryview(buf).cast("B")[:length] if length else memoryview(b"")
        part = max(self.options.part_size, -(-length // _MAX_PARTS))
        with _errors(self._url(k)):
            if length <= part:
                self._put_conditional(k, view, verify=lambda: self._size_is(k, length))
            else:
                self._multipart(k, view, part, max(threads, self.options.concurrency))

    def _multipart(self, k: str, view: memoryview, part: int, concurrency: int) -> None:
        c = self.client
        ranges = [(i + 1, off, min(part, len(view) - off)) for i, off in enumerate(range(0, len(view), part))]
        upload_id = c.create_multipart_upload(Bucket=self.bucket, Key=k)["UploadId"]
        try:
            def upload(r: tuple[int, int, int]) -> dict[str, Any]:
                n, off, size = r
                resp = c.upload_part(Bucket=self.bucket, Key=k, UploadId=upload_id, PartNumber=n,
                                     Body=_ViewReader(view[off:off + size]), ContentLength=size)
                return {"PartNumber": n, "ETag": resp["ETag"]}

            with ThreadPoolExecutor(max_workers=min(concurrency, len(ranges)),
                                    thread_name_prefix="zerostall-s3-part") as pool:
                futures = [pool.submit(upload, r) for r in ranges]
                wait(futures, return_when=FIRST_EXCEPTION)
                failed = next((f for f in futures if f.done() and f.exception() is not None), None)
                if failed is not None:  # stop queued parts; the running ones finish and are aborted
                    for f in futures:
                        f.cancel()
                    raise failed.exception()  # type: ignore[misc]
                parts = [f.result() for f in futures]
            self._conditional(
                lambda: c.complete_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id, IfNoneMatch="*",
                                                    MultipartUpload={"Parts": parts}),
                k, verify=lambda: self._size_is(k, len(view)))
        except BaseException:
            try:
                c.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id)
            except Exception:  # noqa: BLE001,S110 - the server may be gone; delete() of the prefix retries the abort
                pass
            raise

    def _size_is(self, k: str, length: int) -> bool:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=k)["ContentLength"]) == length
        except bex.ClientError:
            return False

    def _put_conditional(self, k: str, body: memoryview, *, verify: Any) -> None:
        self._conditional(
            lambda: self.client.put_object(Bucket=self.bucket, Key=k, Body=_ViewReader(body),
                                           ContentLength=len(body), IfNoneMatch="*"),
            k, verify=verify)

    def _conditional(self, call: Any, k: str, *, verify: Any) -> None:
        """Run a conditional write; tell "someone else wrote it" from "our retried write landed"."""
        for attempt in range(8):
            try:
                call()
                return
            except bex.ClientError as exc:
                code, status = _code(exc)
                if code == "ConditionalRequestConflict" or status == 409:
                    # another conditional write of this key is in flight: wait for its outcome
                    time.sleep(min(2.0, 0.05 * 2 ** attempt) * random.uniform(0.5, 1.0))
                    continue
                retried = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0
                if retried and (status == 412 or code in ("PreconditionFailed", "NoSuchUpload")) and verify():
                    # an earlier attempt of this very call succeeded before the retry (a retried
                    # CompleteMultipartUpload can also find its upload already gone: NoSuchUpload)
                    return
                raise
        raise OSError(errno.EAGAIN, "conditional write kept conflicting with another writer", self._url(k))

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        k = self._k(key)
        view = memoryview(data).cast("B")
        with _errors(self._url(k)):
            if if_absent:
                self._put_conditional(k, view, verify=lambda: self._same_bytes(k, view))
            else:
                self.client.put_object(Bucket=self.bucket, Key=k, Body=_ViewReader(view), ContentLength=len(view))

    def _same_bytes(self, k: str, view: memoryview) -> bool:
        try:
            return bool(self.client.get_object(Bucket=self.bucket, Key=k)["Body"].read() == view)
        except bex.ClientError:
            return False

    # -- reading -----------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        k = self._k(key)
        with _errors(self._url(k)):
            return bytes(self.client.get_object(Bucket=self.bucket, Key=k)["Body"].read())

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from a ranged GET, resuming the range if the stream breaks mid-body."""
        k = self._k(key)
        dest = memoryview(buf).cast("B")
        n = len(dest)
        if n == 0:
            return
        done = 0
        broken = 0
        with _errors(self._url(k)):
            while done < n:
                try:
                    resp = self.client.get_object(Bucket=self.bucket, Key=k,
                                                  Range=f"bytes={offset + done}-{offset + n - 1}")
                except bex.ClientError as exc:
                    code, status = _code(exc)
                    if code == "InvalidRange" or status == 416:
                        raise EOFError(f"{self._url(k)}: object ends before byte {offset + n}") from None
                    raise
                body = resp["Body"]
                try:
                    while done < n:
                        got = body.readinto(dest[done:])
                        if not got:
                            raise EOFError(f"{self._url(k)}: object ends before byte {offset + n}")
                        done += got
                except (bex.ResponseStreamingError, bex.ReadTimeoutError, bex.IncompleteReadError,
                        ConnectionError):
                    broken += 1
                    if broken >= self.options.max_attempts:
                        raise
                    time.sleep(min(2.0, 0.1 * 2 ** broken))
                finally:
                    body.close()

    def size(self, key: str) -> int:
        k = self._k(key)
        with _errors(self._url(k)):
            return int(self.client.head_object(Bucket=self.bucket, Key=k)["ContentLength"])

    def exists(self, key: str) -> bool:
        k = self._k(key)
        with _errors(self._url(k)):
            if k:
                try:
                    self.client.head_object(Bucket=self.bucket, Key=k)
                    return True
                except bex.ClientError as exc:
                    if _code(exc)[1] != 404:
                        raise
            resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._dir(key), MaxKeys=1)
            return bool(resp.get("KeyCount") or resp.get("Contents") or resp.get("CommonPrefixes"))

    def list(self, prefix: str) -> list[str]:
        """Immediate children of ``prefix``; an empty or missing prefix lists as ``[]``.

        Children are derived from the keys of a listing *without* a delimiter. A delimited
        listing would be fewer bytes, but servers that keep directories (SeaweedFS) go on
        reporting a prefix in ``CommonPrefixes`` for minutes after its last object is deleted;
        the keys never lie. Under a checkpoint root there are a few objects per step, so this is
        one request per few hundred steps.
        """
        base = self._dir(prefix)
        names: set[str] = set()
        with _errors(self._url(base)):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base, PaginationConfig={"PageSize": _LIST_PAGE}):
                for obj in page.get("Contents", ()):
                    names.add(obj["Key"][len(base):].split("/", 1)[0])
        names.discard("")
        return sorted(names)

    def probe(self, *, write: bool) -> None:
        """The bucket exists and these credentials may list the prefix (one HEAD and one LIST).

        Write permission is not probed (that would write an object): a bucket that refuses
        writes fails the first save, which is then raised (see ``BackgroundSaveError``).
        """
        with _errors(f"s3://{self.bucket}"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except bex.ClientError as exc:
                code, status = _code(exc)
                if status == 404 or code in _NOT_FOUND:
                    raise FileNotFoundError(errno.ENOENT, f"S3 bucket {self.bucket!r} does not exist",
                                            f"s3://{self.bucket}") from exc
                raise
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._dir(""), MaxKeys=1)

    # -- metadata ----------------------------------------------------------------------------

    def delete(self, prefix: str) -> None:
        """Delete object ``prefix`` and every key under ``prefix/`` (in batches of 1000), and
        abort multipart uploads left there by a writer that died mid-upload."""
        k = self._k(prefix)
        base = self._dir(prefix)
        with _errors(self._url(k or base)):
            batch: list[dict[str, str]] = [{"Key": k}] if k else []
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base, PaginationConfig={"PageSize": _LIST_PAGE}):
                for obj in page.get("Contents", ()):
                    batch.append({"Key": obj["Key"]})
                    if len(batch) == _DELETE_BATCH:
                        self._delete_batch(batch)
                        batch = []
            if batch:
                self._delete_batch(batch)
            self._abort_uploads(base)

    def _delete_batch(self, batch: Sequence[dict[str, str]]) -> None:
        resp = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        errs = [e for e in resp.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
        if errs:
            e = errs[0]
            raise OSError(errno.EACCES if e.get("Code") == "AccessDenied" else errno.EIO,
                          f"could not delete {len(errs)} object(s): {e.get('Code')}: {e.get('Message')}", e.get("Key"))

    def _abort_uploads(self, base: str) -> None:
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base)
            for page in pages:
                for up in page.get("Uploads", ()):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
        except bex.ClientError:
            pass  # a server without ListMultipartUploads: the uploads expire by lifecycle rules

    def list_uploads(self, prefix: str) -> Sequence[tuple[str, str]]:
        """Incomplete multipart uploads under ``prefix``: ``(key relative to the root, upload id)``.

        The :class:`~zerostall.storage.base.MultipartUploads` group (``zerostall gc`` aborts them).

        Raises:
            OSError: the listing failed (``ENOTSUP`` if the server has no ListMultipartUploads).
        """
        base = self._dir(prefix)
        root = self._dir("")
        out: list[tuple[str, str]] = []
        with _errors(self._url(base)):
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base):
                out.extend((up["Key"][len(root):], up["UploadId"]) for up in page.get("Uploads", ()))
        return out

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one incomplete multipart upload (one already completed or aborted is not an error)."""
        k = self._k(key)
        try:
            with _errors(self._url(k)):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=upload_id)
        except FileNotFoundError:
            pass  # NoSuchUpload: completed or aborted meanwhile

    def rename(self, src: str, dst: str) -> None:
        raise OSError(errno.ENOTSUP, "S3 has no atomic rename (atomic_rename is False)", self._url(self._k(src)))

    def sync(self, prefix: str) -> None:
        return None  # a completed PUT is durable


# -- errors ----------------------------------------------------------------------------------

def _code(exc: bex.ClientError) -> tuple[str, int]:
    r = exc.response
    return str(r.get("Error", {}).get("Code", "")), int(r.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchUpload"}
_EXISTS = {"PreconditionFailed", "412"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
           "ExpiredToken", "InvalidToken"}
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
              "ServiceUnavailable", "503"}


@contextmanager
def _errors(key: str) -> Iterator[None]:
    """Translate botocore exceptions into the builtin errors the storage protocol promises."""
    try:
        yield
    except bex.ClientError as exc:
        code, status = _code(exc)
        msg = f"S3 {code or status}: {exc.response.get('Error', {}).get('Message') or exc}"
        if code in _NOT_FOUND or status == 404:
            raise FileNotFoundError(errno.ENOENT, msg, key) from exc
        if code in _EXISTS or status == 412:
            raise FileExistsError(errno.EEXIST, msg, key) from exc
        if code in _DENIED or status == 403:
            raise PermissionError(errno.EACCES, msg, key) from exc
        if code == "InvalidRange" or status == 416:
            raise EOFError(f"{key}: {msg}") from exc
        if code in _THROTTLED or status in (429, 503):
            raise OSError(errno.EAGAIN, msg + " (after retries)", key) from exc
        if code in ("EntityTooLarge", "QuotaExceeded") or status == 507:
            raise OSError(errno.ENOSPC, msg, key) from exc
        raise OSError(errno.EIO, msg, key) from exc
    except (bex.NoCredentialsError, bex.PartialCredentialsError, bex.NoAuthTokenError) as exc:
        raise PermissionError(errno.EACCES, f"no S3 credentials: {exc} (set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY, or a profile)", key) from exc
    except (bex.ConnectTimeoutError, bex.ReadTimeoutError) as exc:
        raise OSError(errno.ETIMEDOUT, f"S3 timed out: {exc}", key) from exc
    except bex.EndpointConnectionError as exc:
        raise OSError(errno.ECONNREFUSED, f"S3 endpoint unreachable: {exc}", key) from exc
    except (bex.ConnectionClosedError, bex.ResponseStreamingError, bex.IncompleteReadError) as exc:
        raise OSError(errno.ECONNRESET, f"S3 connection broken: {exc}", key) from exc
    except bex.BotoCoreError as exc:
        raise OSError(errno.EIO, f"S3 client error: {exc}", key) from exc
