"""zerostall.memcopy: streaming-store copies, byte for byte what memmove gives, and built where it can be."""

from __future__ import annotations

import importlib
import platform
import shutil

import crc32c
import numpy as np
import pytest
import torch

import zerostall.memcopy as memcopy
from zerostall.checksum import join_crcs
from zerostall.stage.stager import CpuCopyEngine, _streamable

_SIZES = [0, 1, 15, 16, 63, 64, 65, 4095, memcopy.MIN_STREAM - 1, memcopy.MIN_STREAM, memcopy.MIN_STREAM + 13,
          (3 << 20) + 7]


@pytest.fixture(params=[True, False], ids=["streaming", "memmove"])
def streaming(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param and memcopy._ext is None:
        pytest.fail("the streaming copy is not built here (see test_the_extension_is_built_where_it_can_be)")
    monkeypatch.setattr(memcopy, "STREAMING", request.param)
    monkeypatch.setattr(memcopy, "CRC_COPY", request.param and memcopy._crc_ext is not None)
    return bool(request.param)


@pytest.fixture(params=[True, False], ids=["fold", "crc32-instruction"])
def kernel(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Each kernel test runs with the carry-less-multiply kernels on (where the CPU has them) and off."""
    ext = memcopy._crc_ext
    if ext is None:
        pytest.fail("the copy-and-checksum kernel is not built here (see test_the_extension_is_built_where_it_can_be)")
    was = ext.set_fold(request.param)
    yield ext
    ext.set_fold(was)


def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_the_fold_kernels_are_used_exactly_where_the_cpu_has_them() -> None:
    ext = memcopy._crc_ext
    if ext is None:
        pytest.fail("the copy-and-checksum kernel is not built here (see test_the_extension_is_built_where_it_can_be)")
    has = {"avx512f", "avx512bw", "avx512vl", "vpclmulqdq", "pclmulqdq", "sse4_2"} <= _cpu_flags()
    was = ext.set_fold(True)
    try:
        assert ext.set_fold(True) is has  # on where the CPU can, else it stays off
        assert ext.set_fold(False) is has
        assert ext.set_fold(False) is False
    finally:
        ext.set_fold(was)


def test_the_extension_is_built_where_it_can_be() -> None:
    # The build is optional (an install without a C compiler still works, only slower); where a
    # compiler exists on x86-64 it must have been built, or every copy silently falls back.
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None:
        assert memcopy._ext is None or memcopy._ext.NONTEMPORAL
        return
    ext = importlib.import_module("zerostall._memcopy")
    assert ext.NONTEMPORAL == 1
    assert memcopy._ext is ext
    if "sse4_2" in open("/proc/cpuinfo").read():
        assert ext.CRC32C == 1 and memcopy._crc_ext is ext


@pytest.mark.parametrize("n", _SIZES)
def test_copy_is_memmove_at_every_alignment(streaming: bool, kernel: object, n: int) -> None:
    rng = np.random.default_rng(n)
    src_buf = rng.integers(0, 256, n + 64, dtype=np.uint8)
    for so, do in [(0, 0), (1, 0), (0, 3), (7, 9), (16, 1), (33, 48)]:
        dst_buf = np.zeros(n + 64, dtype=np.uint8)
        memcopy.copy(dst_buf.ctypes.data + do, src_buf.ctypes.data + so, n)
        assert np.array_equal(dst_buf[do:do + n], src_buf[so:so + n])
        assert not dst_buf[:do].any() and not dst_buf[do + n:].any()  # not a byte outside the range


def test_copy_array_falls_back_for_what_it_cannot_stream(streaming: bool) -> None:
    n = memcopy.MIN_STREAM * 2
    src = np.arange(n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    memcopy.copy_array(dst, src)
    assert np.array_equal(dst, src)
    strided = np.zeros(2 * n, dtype=np.uint8)[::2]  # not contiguous: numpy's copy
    memcopy.copy_array(strided, src)
    assert np.array_equal(strided, src)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_many_cuts_items_into_pieces_on_every_thread(streaming: bool, threads: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memcopy, "PIECE", 4096 * 3 + 5)  # pieces that end anywhere
    rng = np.random.default_rng(threads)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 70_000, memcopy.MIN_STREAM + 1, 0, 123_457)]
    dsts = [np.zeros_like(s) for s in srcs]
    memcopy.copy_many([(d.ctypes.data, s.ctypes.data, s.nbytes) for d, s in zip(dsts, srcs, strict=True)], threads)
    for d, s in zip(dsts, srcs, strict=True):
        assert np.array_equal(d, s)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_many_checksums_each_item_across_its_pieces(streaming: bool, threads: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memcopy, "PIECE", 4096 * 3 + 5)  # each item's CRC joins pieces that end anywhere
    rng = np.random.default_rng(threads)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 70_000, 0, 123_457)]
    dsts = [np.zeros_like(s) for s in srcs]
    parts = memcopy.copy_many([(d.ctypes.data, s.ctypes.data, s.nbytes) for d, s in zip(dsts, srcs, strict=True)],
                              threads, crc=True)
    for d, s in zip(dsts, srcs, strict=True):
        assert np.array_equal(d, s)
    # without the kernel the copy still happens, and says it did not checksum
    if not streaming:
        assert parts is None
        return
    assert parts is not None and len(parts) > len(srcs)  # items cut into pieces, each checksummed
    # an empty item has no piece (join_crcs: None; its CRC is 0)
    assert [c or 0 for c in join_crcs(parts, len(srcs))] == [crc32c.crc32c(s.tobytes()) for s in srcs]


def test_combine_joins_crcs_of_any_lengths() -> None:
    if memcopy._crc_ext is None:
        pytest.fail("the copy kernel is not built here (see test_the_extension_is_built_where_it_can_be)")
    rng = np.random.default_rng(5)
    for la, lb in [(0, 0), (0, 9), (9, 0), (1, 1), (4096, 12_289), (1 << 20, 3)]:
        a, b = rng.bytes(la), rng.bytes(lb)
        assert memcopy.combine(crc32c.crc32c(a), crc32c.crc32c(b), lb) == crc32c.crc32c(a + b), (la, lb)
    with pytest.raises(ValueError, match="not a 32-bit value"):
        memcopy.combine(1 << 32, 0, 1)


def test_checksum_combine_is_the_same_with_and_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    import zerostall.checksum as cks

    cases = [(crc32c.crc32c(b"ab" * n), crc32c.crc32c(b"cd" * m), 2 * m) for n, m in ((0, 1), (5, 0), (7, 4096), (1, 3 << 20))]
    fast = [cks.checksum_combine(*c) for c in cases]
    monkeypatch.setattr(cks, "combine", lambda *a: None)  # as where the extension is not built
    assert [cks.checksum_combine(*c) for c in cases] == fast


def test_copy_with_crc_returns_the_crc_only_where_it_checksummed(streaming: bool) -> None:
    src = np.random.default_rng(1).integers(0, 256, 50_001, dtype=np.uint8)
    dst = np.zeros_like(src)
    got = memcopy.copy(dst.ctypes.data, src.ctypes.data, src.nbytes, 0)
    assert np.array_equal(dst, src)
    assert got == (crc32c.crc32c(src.tobytes()) if streaming else None)
    assert memcopy.copy(dst.ctypes.data, src.ctypes.data, src.nbytes) is None


def test_the_extension_refuses_bad_arguments() -> None:
    ext = importlib.import_module("zerostall._memcopy")
    with pytest.raises(ValueError, match="null address"):
        ext.copy(0, 0, 5)
    with pytest.raises(TypeError):
        ext.copy(1, 2)
    with pytest.raises(OverflowError):
        ext.copy(1, 2, -1)
    if ext.CRC32C:
        with pytest.raises(ValueError, match="null address"):
            ext.copy_crc32c(0, 0, 5, 0)
        with pytest.raises(ValueError, match="not a 32-bit value"):
            ext.copy_crc32c(1, 2, 0, 1 << 32)
        with pytest.raises(TypeError):
            ext.copy_crc32c(1, 2, 3)
        assert ext.copy_crc32c(0, 0, 0, 7) == 7  # nothing copied: the CRC goes on unchanged


def test_the_cpu_engine_streams_plain_tensors_and_leaves_the_rest_to_copy_(streaming: bool) -> None:
    big = memcopy.MIN_STREAM // 4 + 3
    plain = torch.randn(big)
    param = torch.nn.Parameter(torch.randn(big))
    cplx = torch.randn(big, dtype=torch.complex64)
    conj = cplx.conj()  # a lazy conjugate: its bytes are cplx's, its values are not
    neg = torch.randn(big, dtype=torch.complex64).conj().imag  # a lazy negation
    strided = torch.randn(big, 2).t()
    small = torch.randn(7)
    srcs = [plain, param, conj, neg, strided, small]
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    expected = [0 if not streaming else plain.nbytes, 0 if not streaming else param.nbytes, 0, 0, 0, 0]
    assert [_streamable(d, s) for d, s in zip(dsts, srcs, strict=True)] == expected
    engine = CpuCopyEngine()
    with torch.no_grad():
        for d, s in zip(dsts, srcs, strict=True):
            engine.copy(d, s)
        engine.finish()
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s.resolve_conj().resolve_neg())
    assert not engine._queued


def test_copy_array_casts_nothing_and_takes_array_likes(streaming: bool) -> None:
    n = memcopy.MIN_STREAM
    dst = np.zeros(n, dtype=np.float32)
    with pytest.raises(TypeError):
        memcopy.copy_array(dst, np.ones(n, dtype=np.float64))  # same shape, another dtype: refused

    class Like:
        def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
            return np.full(n, 3, dtype=np.float32)

    memcopy.copy_array(dst, Like())
    assert (dst == 3).all()
    src = np.arange(n, dtype=np.float32).reshape(64, -1)
    out = np.zeros_like(src)
    memcopy.copy_array(out, src)
    assert np.array_equal(out, src)


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("verify", [True, False])
def test_loads_copy_the_same_bytes_either_way(streaming: bool, verify: bool, atomic: bool, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Streaming decides the path of a warm verify=False load (byte ranges through a mapping, or
    # group by group) and the copy of every other one: each must land every byte.
    import zerostall

    state = {"w": torch.randn(300_001), "b": torch.randn(7, 5).t(), "h": torch.randn(65_536, dtype=torch.float64)}
    zerostall.save_pytree(str(tmp_path / "c"), state)
    tmpl = {k: torch.zeros_like(v) for k, v in state.items()}
    got = zerostall.load_pytree(str(tmp_path / "c"), tmpl, options=zerostall.LoadOptions(verify=verify, atomic=atomic))
    for k, v in state.items():
        assert torch.equal(got[k], v) and torch.equal(tmpl[k], v)


@pytest.mark.parametrize("n", _SIZES + [12_288, 12_289, 2 * 12_288 + 17, 3 * 12_288, 3 * 12_288 + 31, 100_003])
def test_copy_crc32c_is_the_crc32c_package_at_every_length_and_alignment(kernel: object, n: int) -> None:
    ext = kernel
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, n + 64, dtype=np.uint8)
    for so in (0, 1, 7, 8):
        for do in (0, 1, 5, 8, 15, 16, 63, 64):
            dst = np.zeros(n + 64, dtype=np.uint8)
            init = int(rng.integers(0, 1 << 32))
            got = ext.copy_crc32c(dst.ctypes.data + do, src.ctypes.data + so, n, init)
            assert got == crc32c.crc32c(src[so:so + n].tobytes(), init), (n, so, do)
            assert np.array_equal(dst[do:do + n], src[so:so + n]) and not dst[:do].any() and not dst[do + n:].any()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 255, 256, 257, 511, 512, 4095, 12_289, 65_536 + 129, (1 << 20) + 3])
def test_crc32c_is_the_crc32c_package_at_every_length_alignment_and_start(kernel: object, n: int) -> None:
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, n + 64, dtype=np.uint8)
    for so in (0, 1, 7, 8, 63):
        init = int(rng.integers(0, 1 << 32))
        data = src[so:so + n].tobytes()
        assert memcopy.crc32c(memoryview(src)[so:so + n], init) == crc32c.crc32c(data, init), (n, so)
        assert memcopy.crc32c(data) == crc32c.crc32c(data), (n, so)
        cut = n // 3  # continued from a CRC the other kernel computed
        assert memcopy.crc32c(data[cut:], crc32c.crc32c(data[:cut])) == crc32c.crc32c(data)


def test_crc32c_takes_any_contiguous_buffer_and_refuses_the_rest() -> None:
    a = np.arange(1000, dtype=np.float32)
    assert memcopy.crc32c(memoryview(a)) == crc32c.crc32c(a.tobytes())  # not bytes-shaped: its bytes
    assert memcopy.crc32c(bytearray(b"123456789")) == 0xE3069283
    with pytest.raises(BufferError):
        memcopy.crc32c(memoryview(a)[::2])
    with pytest.raises(ValueError, match="not a 32-bit value"):
        memcopy.crc32c(b"x", 1 << 32)


def test_copy_array_checksums_in_its_pass_only_where_it_can(streaming: bool) -> None:
    from zerostall.checksum import checksum

    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    got = memcopy.copy_array(dst, src, 0)
    assert np.array_equal(dst, src)
    assert got == (checksum(src.tobytes()) if streaming else None)
    assert memcopy.copy_array(dst[::2], src[::2], 0) is None  # not contiguous: copied, not checksummed
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("atomic", [True, False])
def test_a_flipped_byte_fails_the_load_whichever_pass_checksums(streaming: bool, atomic: bool, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import zerostall
    from zerostall.errors import ChecksumMismatchError

    state = {"w": torch.randn(1 << 20), "v": torch.randn(4096)}
    zerostall.save_pytree(str(tmp_path / "c"), state)
    data = next((tmp_path / "c" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    tmpl = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(ChecksumMismatchError, match="w"):
        zerostall.load_pytree(str(tmp_path / "c"), tmpl, options=zerostall.LoadOptions(atomic=atomic))


def test_copy_many_does_not_wait_for_a_busy_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pool is shared with the load's passes: a copy must not queue behind their tasks.
    import threading

    from zerostall.cpus import shared_pool

    release = threading.Event()
    busy = shared_pool(1).submit(release.wait, 30)
    try:
        src = np.arange(1 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        monkeypatch.setattr(memcopy, "PIECE", 1 << 16)
        done = threading.Event()
        t = threading.Thread(target=lambda: (memcopy.copy_many([(dst.ctypes.data, src.ctypes.data, src.nbytes)], 2),
                                             done.set()))
        t.start()
        assert done.wait(10), "copy_many waited for the pool's other task"
        assert np.array_equal(dst, src)
    finally:
        release.set()
        busy.result()


def test_checksum_is_the_same_with_and_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    import zerostall.checksum as cks

    if memcopy._crc_only is None:
        pytest.fail("the CRC kernel is not built here (see test_the_extension_is_built_where_it_can_be)")
    rng = np.random.default_rng(9)
    cases = [(rng.bytes(n), int(rng.integers(0, 1 << 32))) for n in (0, 3, 255, 4096 + 7, 1 << 20)]
    fast = [cks.checksum(b, v) for b, v in cases]
    monkeypatch.setattr(cks, "_fast_crc", lambda *a: None)  # as where the extension is not built
    assert [cks.checksum(b, v) for b, v in cases] == fast == [crc32c.crc32c(b, v) for b, v in cases]
