"""All-or-nothing in-place loads (``LoadOptions.atomic``) against real corrupted files.

A load that raises leaves every template exactly as it was: a flipped byte in any leaf (large,
mid-size, small neighbours read with one vectored call, numpy), the file warm or evicted from the
page cache, through the local backend (verified in the page cache) and through a backend
without ``scan`` (verified in a staging copy); ``load_state_dict`` of a Stateful template is not
called. ``atomic=False`` (the default) streams and leaves what
docs/guarantees.md says it leaves, and its error says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zerostall
from zerostall import LoadOptions, SaveOptions, WriterKind
from zerostall.errors import ChecksumMismatchError, StorageError
from zerostall.restore import read as restore_read

MiB = 1 << 20
ATOMIC = LoadOptions(atomic=True)


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(3 * MiB, generator=g),  # 12 MiB: scanned through a mapping when cached
        "mid": torch.randn(MiB // 2, generator=g),  # 2 MiB
        "small": [torch.randn(100 + i, generator=g) for i in range(6)],  # one vectored run
        "np": np.arange(50_000, dtype=np.float64),
        "step": 7,
    }


def sentinel() -> dict[str, Any]:
    """A template of the state's layout holding values the checkpoint does not have."""
    s = state()
    return {"big": torch.full_like(s["big"], -7.0), "mid": torch.full_like(s["mid"], -7.0),
            "small": [torch.full_like(t, -7.0) for t in s["small"]], "np": np.full_like(s["np"], -7.0),
            "step": 0}


def untouched(tmpl: dict[str, Any]) -> bool:
    return (all(bool((t == -7.0).all()) for t in [tmpl["big"], tmpl["mid"], *tmpl["small"]])
            and bool((tmpl["np"] == -7.0).all()))


LEAVES = ["pytree/big", "pytree/mid", "pytree/small/0", "pytree/small/5", "pytree/np"]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    zerostall.save_pytree(path, state(), options=SaveOptions(writer=WriterKind.THREAD))
    return path


def data_file(path: Path) -> Path:
    return next((path / "data").iterdir())


def flip(path: Path, key: str, where: float = 0.5) -> None:
    m = json.loads((path / "manifest.json").read_bytes())
    leaf = next(lf for lf in m["leaves"] if lf["key"] == key)
    f = data_file(path)
    with open(f, "r+b") as fh:
        fh.seek(leaf["offset"] + int(leaf["nbytes"] * where))
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x40]))


def cache(path: Path, warm: bool) -> None:
    f = data_file(path)
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if warm:
            while os.read(fd, 8 * MiB):
                pass
    finally:
        os.close(fd)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("key", LEAVES)
@pytest.mark.parametrize("atomic", [True, "auto"])
def test_a_corrupt_leaf_leaves_every_template_untouched(ckpt: Path, key: str, warm: bool, atomic: Any) -> None:
    flip(ckpt, key)
    cache(ckpt, warm)
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError) as info:
        zerostall.load_pytree(ckpt, tmpl, options=LoadOptions(atomic=atomic))
    assert info.value.key == key
    assert untouched(tmpl)


def test_a_good_load_fills_every_template_in_place(ckpt: Path) -> None:
    for warm in (True, False):
        cache(ckpt, warm)
        tmpl = sentinel()
        ids = [id(tmpl["big"]), id(tmpl["mid"]), id(tmpl["np"]), *map(id, tmpl["small"])]
        out = zerostall.load_pytree(ckpt, tmpl)
        s = state()
        assert torch.equal(tmpl["big"], s["big"]) and torch.equal(tmpl["mid"], s["mid"])
        assert all(torch.equal(a, b) for a, b in zip(tmpl["small"], s["small"], strict=True))
        assert np.array_equal(tmpl["np"], s["np"]) and out["step"] == 7
        assert [id(out["big"]), id(out["mid"]), id(out["np"]), *map(id, out["small"])] == ids


def test_partial_template_and_fresh_items(ckpt: Path) -> None:
    """Leaves read into fresh memory fail the load just the same, before any template byte changes."""
    flip(ckpt, "pytree/mid")
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError) as info:
        zerostall.load_checkpointables(ckpt, {"pytree": {"big": tmpl["big"], "mid": None}}, options=ATOMIC)
    assert info.value.key == "pytree/mid" and bool((tmpl["big"] == -7.0).all())


def test_a_stateful_template_is_not_touched_and_not_called(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 1024)  # a 2 MiB weight
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    path = tmp_path / "ck"
    zerostall.save_pytree(path, {"model": model, "opt": opt}, options=SaveOptions(writer=WriterKind.THREAD))
    flip(path, "pytree/opt/state/0/exp_avg_sq")
    model2 = torch.nn.Linear(512, 1024)
    opt2 = torch.optim.Adam(model2.parameters())
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    calls: list[str] = []
    orig = model2.load_state_dict
    model2.load_state_dict = lambda *a, **k: (calls.append("model"), orig(*a, **k))[1]  # type: ignore[method-assign]
    with pytest.raises(ChecksumMismatchError):
        zerostall.load_pytree(path, {"model": model2, "opt": opt2}, options=ATOMIC)
    assert calls == [] and opt2.state_dict()["state"] == {}
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())


@pytest.fixture
def no_scan_url(tmp_path: Path) -> Iterator[str]:
    """A local directory whose backend cannot scan in place: atomic loads verify a staging copy."""
    from zerostall.storage import _REGISTERED, register_scheme
    from zerostall.storage.local import LocalStorage

    class NoScan(LocalStorage):
        # declares no scan (and so no mapping, which needs scan for evicted pages)
        capabilities = dataclasses.replace(LocalStorage.capabilities, scan=False, map_file=False)

    register_scheme("zsnoscan", lambda url: NoScan(url.split("://", 1)[1]))
    yield f"zsnoscan://{tmp_path}"
    _REGISTERED.pop("zsnoscan", None)


@pytest.mark.parametrize("key", ["pytree/big", "pytree/small/2", "pytree/np"])
def test_staging_copy_on_a_backend_without_scan(ckpt: Path, no_scan_url: str, key: str) -> None:
    url = f"{no_scan_url}/{ckpt.name}"
    tmpl = sentinel()
    zerostall.load_pytree(url, tmpl, options=ATOMIC)  # intact: the staged bytes are copied in
    assert torch.equal(tmpl["big"], state()["big"]) and np.array_equal(tmpl["np"], state()["np"])
    flip(ckpt, key)
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError) as info:
        zerostall.load_pytree(url, tmpl, options=ATOMIC)
    assert info.value.key == key and untouched(tmpl)


@pytest.mark.parametrize("options", [None, LoadOptions(atomic=False, io_threads=1)], ids=["default", "False"])
def test_streaming_leaves_earlier_leaves_overwritten(ckpt: Path, options: LoadOptions | None) -> None:
    """atomic=False (the default): one pass, largest leaf first; what guarantees.md says a failure
    leaves, and the error says the templates may be partly overwritten."""
    flip(ckpt, "pytree/small/5")
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError) as info:
        zerostall.load_pytree(ckpt, tmpl, options=options)
    assert info.value.key == "pytree/small/5"
    assert "partly overwritten" in str(info.value) and "atomic=True" in str(info.value)
    assert torch.equal(tmpl["big"], state()["big"])  # read (and verified) before the corrupt leaf
    assert not bool((tmpl["small"][5] == -7.0).all())  # the corrupt leaf's bytes landed too


def test_an_atomic_error_does_not_say_partly_overwritten(ckpt: Path) -> None:
    flip(ckpt, "pytree/small/5")
    with pytest.raises(ChecksumMismatchError) as info:
        zerostall.load_pytree(ckpt, sentinel(), options=ATOMIC)
    assert "overwritten" not in str(info.value)


def test_auto_streams_beyond_its_memory_bound_and_says_so(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(restore_read, "ATOMIC_MEMORY_FRACTION", 1e-9)  # any load exceeds it
    flip(ckpt, "pytree/small/5")
    tmpl = sentinel()
    with caplog.at_level(logging.INFO, logger="zerostall"), pytest.raises(ChecksumMismatchError):
        zerostall.load_pytree(ckpt, tmpl, options=LoadOptions(atomic="auto", io_threads=1))
    assert torch.equal(tmpl["big"], state()["big"])
    assert any("not all-or-nothing" in r.message for r in caplog.records)
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError):  # atomic=True holds whatever the bound says
        zerostall.load_pytree(ckpt, tmpl, options=LoadOptions(atomic=True))
    assert untouched(tmpl)


@pytest.mark.parametrize("via", ["fill_cache", "scan"])
def test_a_read_error_in_the_verify_pass_leaves_templates_untouched(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     via: str) -> None:
    """EIO while the first pass reads (into the page cache, or into the scratch buffer when the
    cache cannot be used): a typed error, every template untouched."""
    import errno

    from zerostall.storage.local import LocalStorage

    real = getattr(LocalStorage, via)

    def failing(self: Any, key: str, offset: int, length: int, *a: Any, **kw: Any) -> None:
        if via == "scan" and length < 4 * MiB:  # the run after the large leaf fails, the large one verifies
            raise OSError(errno.EIO, "injected read error")
        if via == "fill_cache" and offset + length > 8 * MiB:  # one 32 MiB piece: fails 8 MiB in
            if offset < 8 * MiB:
                real(self, key, offset, 8 * MiB - offset)
            raise OSError(errno.EIO, "injected read error")
        real(self, key, offset, length, *a, **kw)
        fd = os.open(data_file(ckpt), os.O_RDONLY)  # what readahead brought in past it: out again
        os.posix_fadvise(fd, offset + length + 4096, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    monkeypatch.setattr(LocalStorage, via, failing)
    if via == "scan":
        monkeypatch.setattr(LocalStorage, "fill_cache", lambda *a, **k: None)  # nothing cached: scan reads
        monkeypatch.setattr(LocalStorage, "map_file", lambda *a, **k: None)
    cache(ckpt, warm=False)
    tmpl = sentinel()
    with pytest.raises(StorageError) as info:  # one thread: the large leaf first, then the rest
        zerostall.load_pytree(ckpt, tmpl, options=LoadOptions(atomic=True, io_threads=1))
    assert info.value.errno == errno.EIO and untouched(tmpl)


def test_atomic_option_is_checked() -> None:
    with pytest.raises(ValueError, match="atomic"):
        LoadOptions(atomic="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="atomic"):
        LoadOptions(atomic=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("where", [0.3, 0.5, 0.9, 0.999])
def test_a_corrupt_byte_in_a_leaf_split_between_threads(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                        where: float, warm: bool) -> None:
    """The 12 MiB leaf is cut between three threads (restore.spans): a flipped byte in any part
    fails its own leaf's checksum, and no template byte changes."""
    monkeypatch.setattr(restore_read, "workers", lambda io_threads: 3)
    monkeypatch.setattr(restore_read, "_FILL_CHUNK", 4 * MiB)  # cold: the leaf is read in pieces too
    tmpl = sentinel()
    cache(ckpt, warm)
    zerostall.load_pytree(ckpt, tmpl, options=ATOMIC)  # intact: every part joins to the leaf's checksum
    assert torch.equal(tmpl["big"], state()["big"]) and np.array_equal(tmpl["np"], state()["np"])
    flip(ckpt, "pytree/big", where)
    cache(ckpt, warm)
    tmpl = sentinel()
    with pytest.raises(ChecksumMismatchError) as info:
        zerostall.load_pytree(ckpt, tmpl, options=ATOMIC)
    assert info.value.key == "pytree/big" and untouched(tmpl)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("where", [0.3, 0.999])
def test_a_streaming_load_checks_a_leaf_cut_between_threads(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                            where: float, warm: bool) -> None:
    """atomic=False reads, checksums and copies by byte ranges in one pass (restore.read.stream_spans):
    the parts of a leaf cut between threads and pieces join to its checksum, and a flipped byte in
    any part is reported for that leaf."""
    monkeypatch.setattr(restore_read, "workers", lambda io_threads: 3)
    monkeypatch.setattr(restore_read, "_FILL_CHUNK", 4 * MiB)
    stream = zerostall.LoadOptions(atomic=False)
    tmpl = sentinel()
    cache(ckpt, warm)
    zerostall.load_pytree(ckpt, tmpl, options=stream)
    assert torch.equal(tmpl["big"], state()["big"]) and np.array_equal(tmpl["np"], state()["np"])
    flip(ckpt, "pytree/big", where)
    cache(ckpt, warm)
    with pytest.raises(ChecksumMismatchError) as info:
        zerostall.load_pytree(ckpt, sentinel(), options=stream)
    assert info.value.key == "pytree/big"
