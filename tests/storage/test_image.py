"""A memory-tier image (memtier.image) read by an all-or-nothing load: verified by byte ranges.

The image here is what the keeper hands over -- the data file's bytes in a memfd and the
manifest -- built from a saved checkpoint, so a byte can be flipped anywhere in it.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zerostall
from zerostall import LoadOptions, SaveOptions, WriterKind
from zerostall.errors import ChecksumMismatchError
from zerostall.memtier.image import open_image
from zerostall.restore import read as restore_read
from zerostall.restore.load import load_items

MiB = 1 << 20


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {"big": torch.randn(4 * MiB, generator=g), "small": [torch.randn(300 + i, generator=g) for i in range(5)]}


def sentinel() -> dict[str, Any]:
    s = state()
    return {"big": torch.full_like(s["big"], -7.0), "small": [torch.full_like(t, -7.0) for t in s["small"]]}


def untouched(t: dict[str, Any]) -> bool:
    return all(bool((x == -7.0).all()) for x in [t["big"], *t["small"]])


def load_from_image(ckpt: Path, tmpl: dict[str, Any], flip_at: tuple[str, float] | None = None,
                    options: LoadOptions | None = None) -> None:
    manifest = (ckpt / "manifest.json").read_bytes()
    m = json.loads(manifest)
    data = next((ckpt / "data").iterdir())
    raw = bytearray(data.read_bytes())
    if flip_at is not None:
        leaf = next(lf for lf in m["leaves"] if lf["key"] == flip_at[0])
        raw[leaf["offset"] + int(leaf["nbytes"] * flip_at[1])] ^= 0x10
    fd = os.memfd_create("zerostall-test-image")
    size = (len(raw) + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    os.ftruncate(fd, size)
    os.pwrite(fd, raw, 0)
    with open_image(ckpt.name, manifest, [(data.name, len(raw), size, fd)]) as image:
        load_items(image.url, ckpt.name, {"pytree": tmpl}, options)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    zerostall.save_pytree(path, state(), options=SaveOptions(writer=WriterKind.THREAD))
    return path


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("where", [("pytree/big", 0.01), ("pytree/big", 0.5), ("pytree/big", 0.99),
                                   ("pytree/small/3", 0.5)])
def test_a_flipped_byte_anywhere_in_the_image_leaves_the_template_untouched(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch, threads: int, where: tuple[str, float]) -> None:
    monkeypatch.setattr(restore_read, "workers", lambda io_threads: threads)  # the 16 MiB leaf cut in 3
    tmpl = sentinel()
    load_from_image(ckpt, tmpl)
    s = state()
    assert torch.equal(tmpl["big"], s["big"])
    assert all(torch.equal(a, b) for a, b in zip(tmpl["small"], s["small"], strict=True))
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError) as info:
        load_from_image(ckpt, tmpl, where, LoadOptions(atomic=True))
    assert info.value.key == where[0] and untouched(tmpl)


def test_streaming_and_unverified_loads_read_the_image_too(ckpt: Path) -> None:
    """atomic=False and verify=False read through ImageStorage.read_into (copies without the GIL)."""
    s = state()
    for opts in (LoadOptions(atomic=False), LoadOptions(verify=False)):
        tmpl = sentinel()
        load_from_image(ckpt, tmpl, options=opts)
        assert torch.equal(tmpl["big"], s["big"])
        assert all(torch.equal(a, b) for a, b in zip(tmpl["small"], s["small"], strict=True))
    with pytest.raises(ChecksumMismatchError) as info:
        load_from_image(ckpt, sentinel(), ("pytree/big", 0.7), LoadOptions(atomic=False))
    assert info.value.key == "pytree/big"
