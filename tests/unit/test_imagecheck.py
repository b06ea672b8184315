"""The keeper's check of a held step (memtier.imagecheck): every leaf against its manifest's CRC32C."""

from __future__ import annotations

import numpy as np

from zerostall.checksum import checksum
from zerostall.format.manifest import encode_manifest
from zerostall.memtier.imagecheck import cpus, first_bad_leaf


def _image(sizes: list[int]) -> tuple[bytes, bytearray]:
    """A manifest of leaves of ``sizes`` bytes laid end to end (64-byte aligned) in one file, and the file."""
    rng = np.random.default_rng(0)
    offsets, pos = [], 64
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // 64) * 64
    data = bytearray(rng.integers(0, 256, pos, dtype=np.uint8).tobytes())
    leaves = [{"key": f"k{i}", "kind": "numpy", "dtype": "U8", "shape": [n], "file": 0, "offset": o, "nbytes": n,
               "crc32c": checksum(memoryview(data)[o:o + n])} for i, (n, o) in enumerate(zip(sizes, offsets, strict=True))]
    items = {"t": {"type": "dict", "keys": [f"k{i}" for i in range(len(sizes))],
                   "values": [{"type": "array", "leaf": i} for i in range(len(sizes))]}}
    return encode_manifest(items=items, leaves=leaves, files=[{"path": "data/f.safetensors", "size": pos}]), data


def test_every_leaf_checked_when_one_large_leaf_is_cut_between_threads() -> None:
    sizes = [9 << 20, 0, 100, 3 << 20]  # the 9 MiB leaf is split between threads, joined by checksum_combine
    manifest, data = _image(sizes)
    for threads in (1, 2, 4):
        assert first_bad_leaf(manifest, {"f.safetensors": memoryview(data)}, threads, path="m") is None
    m_off = 64 + (8 << 20) + 12345  # inside the large leaf, past where a 2- or 4-way cut falls
    data[m_off] ^= 1
    for threads in (1, 2, 4):
        assert first_bad_leaf(manifest, {"f.safetensors": memoryview(data)}, threads, path="m") == "k0"
    data[m_off] ^= 1
    data[-1 - ((-sizes[3]) % 64) - 1] ^= 0x80  # the last byte but one of the last leaf
    assert first_bad_leaf(manifest, {"f.safetensors": memoryview(data)}, 2, path="m") == "k3"
    assert cpus() >= 1
