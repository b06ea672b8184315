"""LocalStorage's read paths: cold ranges through O_DIRECT, cached ranges through the page cache, and
the loads that use them.

These need a filesystem with a page cache and O_DIRECT (the test's tmp_path on a disk, as in CI);
the premise is asserted, not assumed, so a tmpfs tmp_path fails loudly instead of passing vacuously.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import numpy as np
import pytest
import torch

import zerostall
from zerostall.errors import ChecksumMismatchError
from zerostall.storage.local import LocalStorage

MiB = 1 << 20


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident(path: str) -> int:
    """Bytes of the file in the page cache, by util-linux's fincore (mincore; reads nothing)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path],
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def _read(st: LocalStorage, key: str, offset: int, n: int) -> tuple[bytes, list[bytes]]:
    dest = np.zeros(n, dtype=np.uint8)
    pieces: list[bytes] = []
    st.read_sequential(key, offset, memoryview(dest), chunk=4 * MiB, on_piece=lambda p: pieces.append(bytes(p)))
    return dest.tobytes(), pieces


@pytest.fixture(scope="module")
def blob() -> bytes:
    return np.random.default_rng(7).integers(0, 256, size=40 * MiB + 1234, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("offset,n", [(0, 8 * MiB), (4097, 8 * MiB + 1), (123, 17 * MiB + 4095),
                                      (40 * MiB + 1234 - 9 * MiB - 7, 9 * MiB + 7)])
def test_cold_range_is_read_direct_and_left_uncached(tmp_path, blob: bytes, offset: int, n: int) -> None:
    _write(str(tmp_path / "f"), blob)
    _evict(str(tmp_path / "f"))
    assert _resident(str(tmp_path / "f")) == 0, "premise: DONTNEED evicts on this filesystem"
    got, pieces = _read(LocalStorage(str(tmp_path)), "f", offset, n)
    assert got == blob[offset:offset + n]
    assert b"".join(pieces) == got  # every byte handed to on_piece once, in order
    # O_DIRECT went around the page cache: reading did not pull the range into memory.
    assert _resident(str(tmp_path / "f")) < MiB


def test_cached_range_is_read_through_the_page_cache(tmp_path, blob: bytes) -> None:
    _write(str(tmp_path / "f"), blob)  # a buffered write leaves the pages cached
    assert _resident(str(tmp_path / "f")) == len(blob) // 4096 * 4096 + 4096
    got, pieces = _read(LocalStorage(str(tmp_path)), "f", 5, 30 * MiB)
    assert got == blob[5:5 + 30 * MiB] and b"".join(pieces) == got
    assert all(len(p) == 4 * MiB for p in pieces[:-1])  # the buffered path's pieces are `chunk` long


def test_cold_range_past_the_end_raises_eof(tmp_path, blob: bytes) -> None:
    _write(str(tmp_path / "f"), blob[:12 * MiB])
    _evict(str(tmp_path / "f"))
    with pytest.raises(EOFError, match="ends before byte"):
        _read(LocalStorage(str(tmp_path)), "f", 1000, 12 * MiB)


def test_a_streaming_load_reads_cold_bytes_through_the_page_cache_verified(tmp_path) -> None:
    # A load that is not all-or-nothing reads cold bytes through the page cache (fill, checksum,
    # copy, piece by piece): O_DIRECT reads ran at a third of its rate on the VM measured
    # (benchmarks/probes/cold_read_probe.py). It must still check every byte it copies.
    from zerostall.storage.release import wait_unmapped

    state = {"big": torch.arange(6 * MiB, dtype=torch.float32), "small": torch.ones(3)}
    path = str(tmp_path / "ck")
    zerostall.save_pytree(path, state)
    data = next((tmp_path / "ck" / "data").iterdir())
    assert _resident(str(data)) < MiB, "premise: the O_DIRECT save left nothing cached"
    tmpl = {k: torch.zeros_like(v) for k, v in state.items()}
    stream = zerostall.LoadOptions(atomic=False)
    zerostall.load_pytree(path, tmpl, options=stream)
    assert torch.equal(tmpl["big"], state["big"]) and torch.equal(tmpl["small"], state["small"])
    assert _resident(str(data)) >= 24 * MiB, "the streaming load read through the page cache"

    # One flipped byte deep inside the large leaf, evicted again so the cold path reads it.
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 5 * MiB)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    assert wait_unmapped(10)  # a page still mapped by the load would survive the eviction
    _evict(str(data))
    assert _resident(str(data)) < MiB
    with pytest.raises(ChecksumMismatchError) as ei:
        zerostall.load_pytree(path, {k: torch.zeros_like(v) for k, v in state.items()}, options=stream)
    assert ei.value.key == "pytree/big" and path in str(ei.value)


def test_a_read_error_in_a_streaming_fill_keeps_its_errno(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from zerostall.errors import StorageError

    state = {"big": torch.arange(6 * MiB, dtype=torch.float32)}
    path = str(tmp_path / "ck")
    zerostall.save_pytree(path, state)

    def failing_fill(self: LocalStorage, key: str, offset: int, length: int, **kw: Any) -> None:
        raise OSError(errno.EIO, "injected read error")

    monkeypatch.setattr(LocalStorage, "fill_cache", failing_fill)
    with pytest.raises(StorageError) as ei:
        zerostall.load_pytree(path, {"big": torch.zeros_like(state["big"])}, options=zerostall.LoadOptions(atomic=False))
    assert ei.value.errno == errno.EIO and ei.value.key == "pytree/big"


def test_residency_by_cachestat_agrees_with_mincore(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MappedFile.cached (cachestat where the kernel has it) says what mincore says, range by range."""
    from zerostall.storage import local

    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, 1 << 20, 2 << 20)  # [2 MiB, 3 MiB) cached (readahead may add more after it)
    finally:
        os.close(fd)
    st = LocalStorage(str(tmp_path))
    ranges = [(2 << 20, 1 << 20), (2 << 20, 100), ((2 << 20) + 5, 4000), (0, 4096), (0, 8 << 20)]
    mf = st.map_file("f")
    assert mf is not None
    try:
        by_cachestat = [mf.cached(o, n) for o, n in ranges]
        monkeypatch.setattr(local, "_cachestat_ok", False)
        by_mincore = [mf.cached(o, n) for o, n in ranges]
    finally:
        mf.close()
    assert by_cachestat == by_mincore
    assert by_cachestat[:3] == [True, True, True] and by_cachestat[3] is False


def test_unmap_later_closes_large_mappings_in_the_background() -> None:
    import mmap
    import time

    from zerostall.storage.release import unmap_later

    small, large = mmap.mmap(-1, 1 << 20), mmap.mmap(-1, 128 << 20)
    unmap_later(small)
    assert small.closed
    unmap_later(large)
    deadline = time.monotonic() + 10
    while not large.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert large.closed
