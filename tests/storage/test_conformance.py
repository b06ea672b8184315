"""The storage contract, run once per backend: local directory, memory, S3 (a real local server).

A new backend joins by adding a case to ``backend``. Sizes stay small (a few MiB) to keep the
suite fast on a shared 2-core machine; the S3 case uses 5 MiB parts (S3's minimum) so that the
multipart path is exercised with an 11 MiB object.
"""

from __future__ import annotations

import json
import mmap
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from zerostall.commit import committed_steps, is_committed, protocol_for, step_name
from zerostall.errors import CheckpointExistsError
from zerostall.format.manifest import MANIFEST_NAME
from zerostall.storage import Storage, open_storage
from zerostall.storage.local import LocalStorage

MiB = 1 << 20
PART = 5 * MiB


class _LocalWithoutRename(LocalStorage):
    """A local directory treated as an object store: the manifest-last commit applies."""

    atomic_rename = False


def _open(kind: str, request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Storage]:
    if kind == "local":
        yield open_storage(str(tmp_path / "root"))
    elif kind == "local-norename":
        yield _LocalWithoutRename(str(tmp_path / "root"))
    elif kind == "memory":
        url = f"memory://conf-{uuid.uuid4().hex[:12]}"
        s = open_storage(url)
        yield s
        s.delete("")
    else:
        from zerostall.storage.s3 import S3Storage

        url = request.getfixturevalue("s3_url")
        s = S3Storage(url, part_size=PART, concurrency=3)
        yield s
        s.delete("")


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Storage]:
    yield from _open(request.param, request, tmp_path)


@pytest.fixture(params=["local", "memory"])
def renaming_backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Storage]:
    """Backends with an atomic rename (the POSIX commit)."""
    yield from _open(request.param, request, tmp_path)


@pytest.fixture(params=["s3", "local-norename"])
def manifest_last_backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Storage]:
    """Backends without rename (the manifest-last commit)."""
    yield from _open(request.param, request, tmp_path)


def staged(data: bytes, pad: int = 4096) -> memoryview:
    """``data`` in a page-aligned shared mapping with ``pad`` bytes of junk after it, like a staging buffer."""
    m = mmap.mmap(-1, len(data) + pad)
    m[:len(data)] = data
    m[len(data):] = b"\xee" * pad
    return memoryview(m)


def blob(n: int, seed: int = 0) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


def write(s: Storage, key: str, data: bytes) -> None:
    s.write_from_buffer(key, staged(data), len(data), threads=2, chunk_bytes=MiB, direct=True)


class TestStorageContract:
    # -- round trips -------------------------------------------------------------------------

    @pytest.mark.parametrize("n", [0, 1, 4096 + 3, 300_000])
    def test_round_trip_small(self, backend: Storage, n: int) -> None:
        data = blob(n, n)
        write(backend, f"d/obj{n}", data)
        assert backend.get(f"d/obj{n}") == data  # the padding after `length` is not stored
        assert backend.size(f"d/obj{n}") == n
        assert backend.exists(f"d/obj{n}")

    def test_round_trip_multipart(self, backend: Storage) -> None:
        n = 2 * PART + 12345  # three parts on S3, the last one short
        data = blob(n, 1)
        write(backend, "big/obj", data)
        assert backend.size("big/obj") == n
        out = bytearray(n)
        backend.read_into("big/obj", 0, memoryview(out))
        assert out == data

    def test_put_get_overwrite(self, backend: Storage) -> None:
        backend.put("m/a.json", b'{"v": 1}')
        backend.put("m/a.json", b'{"v": 2}')  # a plain put replaces
        assert backend.get("m/a.json") == b'{"v": 2}'

    # -- ranged reads ------------------------------------------------------------------------

    def test_ranged_reads(self, backend: Storage) -> None:
        n = 2 * PART + 100
        data = blob(n, 2)
        write(backend, "r/obj", data)
        for off, ln in [(0, 1), (7, 4093), (PART - 10, 20), (PART * 2, 100), (n - 1, 1), (3, n - 3)]:
            out = bytearray(ln)
            backend.read_into("r/obj", off, memoryview(out))
            assert out == data[off:off + ln], (off, ln)
        backend.read_into("r/obj", n, memoryview(bytearray(0)))  # an empty read is fine anywhere

    def test_read_into_a_numpy_slice(self, backend: Storage) -> None:
        import numpy as np
        data = blob(10_000, 3)
        write(backend, "r/np", data)
        arr = np.zeros(20_000, dtype=np.uint8)
        backend.read_into("r/np", 100, memoryview(arr)[5000:5000 + 9000])
        assert arr[5000:14000].tobytes() == data[100:9100]
        assert not arr[:5000].any() and not arr[14000:].any()

    def test_eof_on_short_object(self, backend: Storage) -> None:
        write(backend, "e/obj", b"0123456789")
        with pytest.raises(EOFError):
            backend.read_into("e/obj", 5, memoryview(bytearray(10)))  # runs past the end
        with pytest.raises(EOFError):
            backend.read_into("e/obj", 10, memoryview(bytearray(1)))  # starts at the end
        with pytest.raises(EOFError):
            backend.read_into("e/obj", 50, memoryview(bytearray(4)))  # starts past the end

    # -- names -------------------------------------------------------------------------------

    def test_listing(self, backend: Storage) -> None:
        for k in ["a/x", "a/y/z", "a/y/w", "b", "c/d/e/f"]:
            backend.put(k, k.encode())
        assert backend.list("") == ["a", "b", "c"]
        assert backend.list("a") == ["x", "y"]
        assert backend.list("a/y") == ["w", "z"]
        assert backend.list("c/d") == ["e"]
        assert backend.list("nothing") == []
        assert backend.list("a/nothing") == []

    def test_exists(self, backend: Storage) -> None:
        backend.put("p/q/r", b"1")
        assert backend.exists("p/q/r")  # an object
        assert backend.exists("p/q") and backend.exists("p")  # prefixes with objects below
        assert not backend.exists("p/q/r2")
        assert not backend.exists("p/qq")

    def test_missing_objects(self, backend: Storage) -> None:
        with pytest.raises(FileNotFoundError):
            backend.get("missing/obj")
        with pytest.raises(FileNotFoundError):
            backend.size("missing/obj")
        with pytest.raises(FileNotFoundError):
            backend.read_into("missing/obj", 0, memoryview(bytearray(4)))
        assert not backend.exists("missing/obj")

    def test_delete_prefix(self, backend: Storage) -> None:
        for k in ["s/a", "s/b/c", "s/b/d/e", "sx/keep", "t/keep"]:
            backend.put(k, b"x")
        backend.delete("s/b")
        assert backend.list("s") == ["a"]
        assert not backend.exists("s/b/c") and not backend.exists("s/b")
        backend.delete("s")
        assert backend.list("") == ["sx", "t"]  # a sibling sharing the name's first letters stays
        assert backend.get("sx/keep") == b"x"
        backend.delete("s")  # deleting nothing is not an error
        backend.delete("never/was")

    def test_delete_single_object(self, backend: Storage) -> None:
        backend.put("o/one", b"1")
        backend.put("o/two", b"2")
        backend.delete("o/one")
        assert backend.list("o") == ["two"]

    def test_delete_many(self, backend: Storage) -> None:
        keys = [f"many/{i:04d}" for i in range(60)]
        for k in keys:
            backend.put(k, b"")
        assert len(backend.list("many")) == 60
        backend.delete("many")
        assert backend.list("many") == [] and not backend.exists("many")

    # -- exclusivity -------------------------------------------------------------------------

    def test_put_if_absent_refuses_a_second_writer(self, backend: Storage) -> None:
        backend.put("x/manifest.json", b"first", if_absent=True)
        with pytest.raises(FileExistsError):
            backend.put("x/manifest.json", b"second", if_absent=True)
        assert backend.get("x/manifest.json") == b"first"

    def test_put_if_absent_race(self, backend: Storage) -> None:
        wins, losses = run_threads(8, lambda i: backend.put("race/manifest.json", f"w{i}".encode(), if_absent=True))
        assert len(wins) == 1 and len(losses) == 7
        assert all(isinstance(e, FileExistsError) for e in losses.values())
        assert backend.get("race/manifest.json") == f"w{wins[0]}".encode()

    def test_write_from_buffer_refuses_existing(self, backend: Storage) -> None:
        write(backend, "w/f", b"one")
        with pytest.raises(FileExistsError):
            write(backend, "w/f", b"two")
        assert backend.get("w/f") == b"one"

    # -- keys --------------------------------------------------------------------------------

    def test_rejects_keys_leaving_the_root(self, backend: Storage) -> None:
        for bad in ["/abs", "a/../../b"]:
            with pytest.raises(ValueError):
                backend.put(bad, b"x")

    # -- rename capability -------------------------------------------------------------------

    def test_rename_when_atomic(self, renaming_backend: Storage) -> None:
        backend = renaming_backend
        assert backend.atomic_rename
        backend.put("src/f", b"1")
        backend.put("dst/g", b"2")
        with pytest.raises(FileExistsError):
            backend.rename("src", "dst")
        backend.rename("src", "new")
        assert backend.get("new/f") == b"1" and not backend.exists("src")

    # -- commit protocol ---------------------------------------------------------------------

    def test_commit_makes_visible(self, backend: Storage) -> None:
        p = protocol_for(backend)
        name = step_name(1)
        a = p.begin(name)
        data = blob(100_000, 4)
        write(backend, f"{a.staging}/{a.data_dir}/f0", data)
        assert not is_committed(backend, name)  # written, not committed: invisible
        assert committed_steps(backend) == []
        p.commit(a, manifest_for(a.data_dir))
        assert is_committed(backend, name) and committed_steps(backend) == [1]
        assert backend.get(f"{name}/{a.data_dir}/f0") == data
        assert json.loads(backend.get(f"{name}/{MANIFEST_NAME}"))["files"][0]["path"] == f"{a.data_dir}/f0"

    def test_second_commit_of_a_name_fails(self, backend: Storage) -> None:
        p = protocol_for(backend)
        name = step_name(2)
        a = p.begin(name)
        b = p.begin(name)  # both start before either commits
        write(backend, f"{a.staging}/{a.data_dir}/f0", b"A" * 1000)
        write(backend, f"{b.staging}/{b.data_dir}/f0", b"B" * 1000)
        p.commit(a, manifest_for(a.data_dir))
        with pytest.raises(CheckpointExistsError):
            p.commit(b, manifest_for(b.data_dir))
        p.abort(b)  # the loser cleans up its own data only
        assert backend.get(f"{name}/{a.data_dir}/f0") == b"A" * 1000
        with pytest.raises(CheckpointExistsError):
            p.begin(name)  # and a later save of the name is refused up front

    def test_abort_leaves_nothing_visible(self, backend: Storage) -> None:
        p = protocol_for(backend)
        name = step_name(3)
        a = p.begin(name)
        write(backend, f"{a.staging}/{a.data_dir}/f0", blob(50_000, 5))
        p.abort(a)
        assert not is_committed(backend, name)
        assert committed_steps(backend) == []
        assert not backend.exists(f"{a.staging}/{a.data_dir}")
        a2 = p.begin(name)  # the name is free again
        write(backend, f"{a2.staging}/{a2.data_dir}/f0", b"ok")
        p.commit(a2, manifest_for(a2.data_dir))
        assert committed_steps(backend) == [3]

    def test_abort_after_commit_keeps_the_checkpoint(self, manifest_last_backend: Storage) -> None:
        # A commit whose reply was lost may have landed: abort must not delete committed data.
        # (Under the rename commit the staging directory is gone after the commit: nothing to abort.)
        backend = manifest_last_backend
        p = protocol_for(backend)
        name = step_name(4)
        a = p.begin(name)
        write(backend, f"{a.staging}/{a.data_dir}/f0", b"data")
        p.commit(a, manifest_for(a.data_dir))
        p.abort(a)
        assert backend.get(f"{name}/{a.data_dir}/f0") == b"data"

    def test_concurrent_writers_to_one_step(self, backend: Storage) -> None:
        name = step_name(5)
        payload = {i: blob(20_000, 100 + i) for i in range(6)}
        attempts: dict[int, Any] = {}

        def save(i: int) -> None:
            p = protocol_for(backend)
            a = p.begin(name)
            attempts[i] = a
            write(backend, f"{a.staging}/{a.data_dir}/f0", payload[i])
            try:
                p.commit(a, manifest_for(a.data_dir))
            except BaseException:
                p.abort(a)
                raise

        wins, losses = run_threads(6, save)
        assert len(wins) == 1, (wins, losses)
        assert all(isinstance(e, CheckpointExistsError) for e in losses.values()), losses
        w = wins[0]
        m = json.loads(backend.get(f"{name}/{MANIFEST_NAME}"))
        assert m["files"][0]["path"] == f"{attempts[w].data_dir}/f0"
        assert backend.get(f"{name}/{attempts[w].data_dir}/f0") == payload[w]
        assert committed_steps(backend) == [5]


def manifest_for(data_dir: str) -> bytes:
    return json.dumps({"format_version": 1, "files": [{"path": f"{data_dir}/f0"}]}).encode()


def run_threads(n: int, fn: Callable[[int], None]) -> tuple[list[int], dict[int, BaseException]]:
    """Run ``fn(i)`` on ``n`` threads released together; (winners, {loser: error})."""
    barrier = threading.Barrier(n)
    wins: list[int] = []
    losses: dict[int, BaseException] = {}
    lock = threading.Lock()

    def run(i: int) -> None:
        barrier.wait()
        try:
            fn(i)
        except BaseException as exc:
            with lock:
                losses[i] = exc
        else:
            with lock:
                wins.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wins, losses
