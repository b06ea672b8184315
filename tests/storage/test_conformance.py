"""The storage contract, run once per backend: local directory, memory, S3 (a real local server).

A new backend joins by adding a case to ``backend`` (and to ``declaring``, which runs the
capability checks: each optional method group a backend declares in its ``capabilities`` is
there and keeps its contract, and each one it does not declare is absent). Sizes stay small (a few MiB) to keep the
suite fast on a shared 2-core machine; the S3 case uses 5 MiB parts (S3's minimum) so that the
multipart path is exercised with an 11 MiB object.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from zerostall.checksum import checksum
from zerostall.commit import committed_steps, is_committed, protocol_for, step_name
from zerostall.errors import CheckpointExistsError
from zerostall.format.manifest import MANIFEST_NAME
from zerostall.memtier.image import open_image
from zerostall.storage import Storage, open_storage
from zerostall.storage.base import (
    Capabilities,
    FillCache,
    LocalFiles,
    MapFile,
    MultipartUploads,
    PieceWrites,
    Probe,
    Scan,
    SequentialReads,
    VectoredReads,
    as_fill_cache,
    as_local_files,
    as_map_file,
    as_multipart,
    as_piece_writer,
    as_probe,
    as_scan,
    as_sequential,
    as_vectored,
)
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


# -- declared capabilities ---------------------------------------------------------------------

#: each flag of Capabilities and the protocol of the method group it declares (the write hook is a
#: keyword of a required method: checked by signature instead)
GROUPS: dict[str, type] = {
    "vectored_reads": VectoredReads, "sequential_reads": SequentialReads, "scan": Scan, "map_file": MapFile,
    "fill_cache": FillCache, "write_pieces": PieceWrites, "multipart_uploads": MultipartUploads, "probe": Probe,
    "local_files": LocalFiles,
}


@dataclasses.dataclass
class Holder:
    """A backend and a way to get an object of given bytes into it: ``make(data) -> (storage, key)``
    (a read-only memory-tier image is a new storage per object)."""

    storage: Storage
    make: Callable[[bytes], tuple[Storage, str]]


def _image(data: bytes, images: list[Any]) -> tuple[Storage, str]:
    size = max(mmap.PAGESIZE, -(-len(data) // mmap.PAGESIZE) * mmap.PAGESIZE)
    fd = os.memfd_create("zerostall-conformance-image")
    os.ftruncate(fd, size)
    os.pwrite(fd, data, 0)
    img = open_image("ck", b"{}", [("f0", len(data), size, fd)])
    images.append(img)
    return img, "ck/data/f0"


@pytest.fixture(params=["local", "memory", "s3", "image"])
def declaring(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Holder]:
    """Every backend kind, the read-only memory-tier image included."""
    if request.param == "image":
        images: list[Any] = []
        first, _ = _image(b"x", images)
        yield Holder(first, lambda data: _image(data, images))
        for img in images:
            img.close()
        return
    for st in _open(request.param, request, tmp_path):
        counter = iter(range(1_000_000))

        def make(data: bytes, st: Storage = st) -> tuple[Storage, str]:
            key = f"cap/obj{next(counter)}"
            write(st, key, data)
            return st, key
        yield Holder(st, make)


class TestDeclaredCapabilities:
    def test_every_declared_group_is_implemented_and_no_other(self, declaring: Holder) -> None:
        st = declaring.storage
        caps = st.capabilities
        assert isinstance(caps, Capabilities)
        for flag, proto in GROUPS.items():
            assert isinstance(st, proto) == getattr(caps, flag), (type(st).__name__, flag)

    def test_a_mapping_needs_scan_to_be_declared(self) -> None:
        with pytest.raises(ValueError, match="scan"):
            Capabilities(map_file=True)

    def test_vectored_reads(self, declaring: Holder) -> None:
        data = blob(40_000, 11)
        st, key = declaring.make(data)
        vec = as_vectored(st)
        if vec is None:
            assert not st.capabilities.vectored_reads
            return
        for cached in (False, True):
            bufs = [memoryview(bytearray(n)) for n in (3, 4096, 10_000, 1, 0, 20_000)]
            vec.read_vectored(key, 7, bufs, cached=cached)
            assert b"".join(bytes(b) for b in bufs) == data[7:7 + sum(len(b) for b in bufs)]
        with pytest.raises(EOFError):
            vec.read_vectored(key, 39_000, [memoryview(bytearray(500)), memoryview(bytearray(600))])

    def test_sequential_reads(self, declaring: Holder) -> None:
        data = blob(100_000, 12)
        st, key = declaring.make(data)
        seq = as_sequential(st)
        if seq is None:
            assert not st.capabilities.sequential_reads
            return
        for cached in (False, True):
            out, pieces = bytearray(90_000), []
            seq.read_sequential(key, 5, memoryview(out), chunk=8192, on_piece=lambda p: pieces.append(bytes(p)),
                                cached=cached)
            assert out == data[5:90_005] and b"".join(pieces) == out
        with pytest.raises(EOFError):
            seq.read_sequential(key, 99_000, memoryview(bytearray(2000)), chunk=8192)

    def test_scan(self, declaring: Holder) -> None:
        data = blob(50_000, 13)
        st, key = declaring.make(data)
        sc = as_scan(st)
        if sc is None:
            assert not st.capabilities.scan
            return
        pieces: list[bytes] = []
        sc.scan(key, 100, 45_000, lambda p: pieces.append(bytes(p)), chunk=4096)
        assert b"".join(pieces) == data[100:45_100] and all(0 < len(p) <= 4096 for p in pieces)
        with pytest.raises(EOFError):
            sc.scan(key, 49_000, 2000, lambda p: None)

    def test_map_file(self, declaring: Holder) -> None:
        data = blob(70_000, 14)
        st, key = declaring.make(data)
        mp = as_map_file(st)
        if mp is None:
            assert not st.capabilities.map_file
            return
        st.read_into(key, 0, memoryview(bytearray(len(data))))  # in the page cache now, if there is one
        mf = mp.map_file(key)
        assert mf is not None
        try:
            assert bytes(mf.view) == data
            assert mf.cached(0, len(data)) in (True, False) and not mf.cached(0, len(data) + 1)
            dest = bytearray(30_000)
            mf.copy_into(1000, memoryview(dest))
            assert dest == data[1000:31_000]
            got = mf.copy_into(2000, memoryview(dest), crc=0)
            assert got is None or got == checksum(data[2000:32_000])
        finally:
            mf.close()
        empty, empty_key = declaring.make(b"")
        empty_map = as_map_file(empty)
        assert empty_map is not None and empty_map.map_file(empty_key) is None  # nothing to map

    def test_fill_cache(self, declaring: Holder) -> None:
        data = blob(64 * 1024 + 5, 15)
        st, key = declaring.make(data)
        fc = as_fill_cache(st)
        if fc is None:
            assert not st.capabilities.fill_cache
            return
        reported: list[int] = []
        fc.fill_cache(key, 100, len(data) - 100, piece=8192, on_filled=reported.append)
        assert reported == sorted(reported) and (not reported or reported[-1] == len(data))
        with pytest.raises(EOFError):
            fc.fill_cache(key, len(data) - 10, 100)
        with pytest.raises(FileNotFoundError):
            fc.fill_cache("cap/missing", 0, 10)

    def test_write_pieces(self, declaring: Holder) -> None:
        st = declaring.storage
        pw = as_piece_writer(st)
        if pw is None:
            assert not st.capabilities.write_pieces
            return
        a, b = blob(3000, 16), blob(7000, 17)
        pw.write_pieces("pw/obj", b"HEADER", 20_000, [(memoryview(a), 100), (memoryview(b), 9000)])
        want = bytearray(20_000)
        want[:6], want[100:3100], want[9000:16_000] = b"HEADER", a, b
        assert st.get("pw/obj") == want and st.size("pw/obj") == 20_000
        with pytest.raises(FileExistsError):
            pw.write_pieces("pw/obj", b"", 10, [])

    def test_multipart_uploads(self, declaring: Holder) -> None:
        st = declaring.storage
        mu = as_multipart(st)
        if mu is None:
            assert not st.capabilities.multipart_uploads
            return
        write(st, "mp/done", blob(2 * PART + 1, 19))  # a completed multipart upload is not listed
        ups = mu.list_uploads("")
        assert all(isinstance(k, str) and isinstance(u, str) for k, u in ups)
        assert not any(k == "mp/done" for k, _ in ups)
        mu.abort_upload("mp/done", "no-such-upload")  # an unknown (completed or aborted) upload is not an error

    def test_probe(self, declaring: Holder) -> None:
        st = declaring.storage
        pr = as_probe(st)
        if pr is None:
            assert not st.capabilities.probe
            return
        pr.probe(write=False)

    def test_local_files(self, declaring: Holder) -> None:
        data = blob(5000, 20)
        st, key = declaring.make(data)
        lf = as_local_files(st)
        if lf is None:
            assert not st.capabilities.local_files
            return
        path = lf.file_path(key)
        assert os.path.isabs(path)
        with open(path, "rb") as f:
            assert f.read() == data
        with pytest.raises(ValueError):
            lf.file_path("../outside")
