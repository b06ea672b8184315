"""The fault matrix: every writer phase × every failure, then the restore side.

For each (phase, action) the save's ``result()`` raises the original error type (``StorageError``
with the errno, ``WriterError`` when the writer dies) naming the checkpoint; the previous
committed steps still load bit-exact; no partial step is visible; and the next save works.
docs/guarantees.md reproduces this table with its results.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zerostall
from zerostall import Checkpointer, CorruptCheckpointError, LoadOptions, SaveOptions, WriterKind
from zerostall.commit import step_name
from zerostall.errors import ChecksumMismatchError, StorageError, WriterError
from zerostall.persist.faults import ENV, PHASES

#: action -> what result() does: ("error", class, errno) or ("ok",)
ACTIONS: dict[str, tuple[Any, ...]] = {
    "raise:ENOSPC": ("error", StorageError, errno.ENOSPC),
    "raise:EIO": ("error", StorageError, errno.EIO),
    "sleep:0.3": ("ok",),
    "exit": ("error", WriterError, None),
}
#: phases at which the step is already committed when the fault hits
AFTER_COMMIT = {"retention"}


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=g),
        "h": torch.randn(16, generator=g).to(torch.bfloat16),
        "mask": torch.rand(10, generator=g) > 0.5,
        "np": np.arange(seed, seed + 12, dtype=np.int32),
        "step": seed,
        "blob": bytes([seed % 256]) * 7,
    }


def assert_bit_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            assert g.dtype == v.dtype and g.shape == v.shape, k
            assert torch.equal(g.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
        elif isinstance(v, np.ndarray):
            assert g.dtype == v.dtype and g.tobytes() == v.tobytes(), k
        else:
            assert g == v, k


def visible(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


def check_no_partial(directory: Path, ckpt: Checkpointer) -> None:
    """Every visible step directory is committed, and steps() lists exactly those."""
    names = visible(directory)
    assert all((directory / n / "manifest.json").is_file() for n in names), names
    assert [step_name(s) for s in ckpt.steps()] == names



CASES = [(w, p, a) for w in ("process", "thread") for p in PHASES for a in ACTIONS
         if not (w == "thread" and a == "exit")]  # exit in a thread writer would kill the test run


@pytest.mark.parametrize(("writer", "phase", "action"), CASES, ids=[f"{w}-{p}-{a}" for w, p, a in CASES])
def test_fault_matrix(run_dir: Path, monkeypatch: pytest.MonkeyPatch, writer: str, phase: str, action: str) -> None:
    kind = WriterKind.PROCESS if writer == "process" else WriterKind.THREAD
    opts = SaveOptions(writer=kind)
    monkeypatch.setenv(ENV, json.dumps({phase: action}))
    expect = ACTIONS[action]
    ckpt = Checkpointer(run_dir, keep_last=2, save_options=opts)  # a process writer reads the env here
    try:
        r = ckpt.save_pytree_async(3, state(3))
        target = str(run_dir / step_name(3))
        if phase in AFTER_COMMIT and action != "sleep:0.3":
            # The step is committed before retention runs: a retention failure (or a writer that
            # dies there) must not make a committed save look failed. It is reported instead.
            stats = r.result(timeout=60)
            assert stats.path == target
            assert r._writer is not None and r._writer.retention_error
        elif expect[0] == "ok":
            r.result(timeout=60)
        else:
            with pytest.raises(expect[1]) as info:
                r.result(timeout=60)
            exc = info.value
            if expect[1] is StorageError:
                assert exc.errno == expect[2]
                assert exc.path == target, exc.path
                assert f"injected {action.split(':')[1]} at {phase}" in str(exc)
            else:
                assert "writer process" in str(exc)

        committed = expect[0] == "ok" or phase in AFTER_COMMIT
        steps = ckpt.steps()
        if committed:
            assert steps[-1] == 3
            assert_bit_exact(ckpt.load_pytree(3), state(3))
        else:
            assert steps == [1, 2], steps
            assert not (run_dir / step_name(3)).exists()
        # The newest earlier step is never touched by a failing save (retention may remove
        # step 1 once step 3 is committed: keep_last=2).
        assert_bit_exact(ckpt.load_pytree(2), state(2))
        if 1 in steps:
            assert_bit_exact(ckpt.load_pytree(1), state(1))
        check_no_partial(run_dir, ckpt)
        if expect[0] == "error" and expect[1] is StorageError and phase not in AFTER_COMMIT:
            # the failed attempt removed its temporary directory
            assert not [n for n in os.listdir(run_dir) if ".zs-tmp-" in n]

        # The next save works: a thread writer reads the (now cleared) variable live; a killed
        # process writer is replaced by a fresh one, which inherits the cleared environment.
        monkeypatch.delenv(ENV)
        if kind is WriterKind.PROCESS and action != "exit":
            ckpt.close()
            ckpt = Checkpointer(run_dir, keep_last=2, save_options=opts)
        ckpt.save_pytree(4, state(4))
        assert ckpt.latest_step() == 4
        assert_bit_exact(ckpt.load_pytree(), state(4))
        check_no_partial(run_dir, ckpt)
    finally:
        monkeypatch.delenv(ENV, raising=False)
        ckpt.close()


def test_writer_crash_error_names_the_checkpoint(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, json.dumps({"write": "exit"}))
    with Checkpointer(run_dir) as ckpt, pytest.raises(WriterError) as info:
        ckpt.save_pytree(3, state(3))
    assert info.value.path == str(run_dir / step_name(3))


SYSCALL_CASES = [
    ("pwrite", "raise:ENOSPC", errno.ENOSPC),
    ("pwrite", "raise:EIO", errno.EIO),
    ("fsync", "raise:EIO", errno.EIO),
    ("fsync", "raise:ENOSPC", errno.ENOSPC),
    ("pwrite", "short", None),
]


@pytest.mark.parametrize(("call", "action", "code"), SYSCALL_CASES, ids=[f"{c}-{a}" for c, a, _ in SYSCALL_CASES])
def test_syscall_faults(run_dir: Path, monkeypatch: pytest.MonkeyPatch, call: str, action: str,
                        code: int | None) -> None:
    """Failures of the real write and fsync calls (a full disk, a dying disk, short writes)."""
    monkeypatch.setenv(ENV, json.dumps({call: action}))
    big = {"w": torch.randn(300_000), "b": torch.arange(5000, dtype=torch.int16)}  # several write calls
    with Checkpointer(run_dir, save_options=SaveOptions(chunk_bytes=1 << 20)) as ckpt:
        r = ckpt.save_pytree_async(3, big)
        if code is None:
            r.result(timeout=60)
            assert ckpt.steps() == [1, 2, 3]
            assert_bit_exact(ckpt.load_pytree(3), big)
        else:
            with pytest.raises(StorageError) as info:
                r.result(timeout=60)
            assert info.value.errno == code
            assert info.value.path == str(run_dir / step_name(3))
            assert ckpt.steps() == [1, 2]
            assert not [n for n in os.listdir(run_dir) if n.startswith(".")]
        assert_bit_exact(ckpt.load_pytree(2), state(2))


def test_fault_in_one_save_leaves_the_queue_working(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves queued behind a failing one still commit (the writer survives an I/O error)."""
    monkeypatch.setenv(ENV, json.dumps({"commit": "raise:EIO"}))
    opts = SaveOptions(writer=WriterKind.THREAD, max_in_flight=2)
    with Checkpointer(run_dir, save_options=opts) as ckpt:
        bad = ckpt.save_pytree_async(3, state(3))
        with pytest.raises(StorageError):
            bad.result(timeout=60)
        monkeypatch.delenv(ENV)
        ckpt.save_pytree_async(4, state(4))
        ckpt.save_pytree_async(5, state(5))
        ckpt.wait()
        assert ckpt.steps() == [1, 2, 4, 5]


# -- the restore side ----------------------------------------------------------------------


def _data_file(run_dir: Path, step: int) -> Path:
    return run_dir / step_name(step) / "data" / "rank-00000.safetensors"


def _leaf(run_dir: Path, step: int, key: str) -> dict[str, Any]:
    m = json.loads((run_dir / step_name(step) / "manifest.json").read_bytes())
    return next(lf for lf in m["leaves"] if lf["key"] == key)


def test_restore_truncated_data_file(run_dir: Path) -> None:
    f = _data_file(run_dir, 2)
    f.write_bytes(f.read_bytes()[:-10])
    with Checkpointer(run_dir) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="truncated") as info:
            ckpt.load_pytree(2)
        assert info.value.path == str(run_dir / step_name(2))
        assert_bit_exact(ckpt.load_pytree(1), state(1))  # other steps are unaffected


def test_restore_missing_data_file(run_dir: Path) -> None:
    _data_file(run_dir, 2).unlink()
    with Checkpointer(run_dir) as ckpt, pytest.raises(CorruptCheckpointError, match="missing"):
        ckpt.load_pytree(2)


@pytest.mark.parametrize("key", ["pytree/w", "pytree/h", "pytree/mask", "pytree/np", "pytree/blob"])
def test_restore_flipped_byte(run_dir: Path, key: str) -> None:
    f = _data_file(run_dir, 2)
    leaf = _leaf(run_dir, 2, key)
    raw = bytearray(f.read_bytes())
    raw[leaf["offset"] + leaf["nbytes"] // 2] ^= 0x10
    f.write_bytes(bytes(raw))
    with Checkpointer(run_dir) as ckpt:
        with pytest.raises(ChecksumMismatchError) as info:
            ckpt.load_pytree(2)
        assert info.value.key == key and key in str(info.value)
    # verify=False skips the check: the load succeeds with the flipped bytes
    out = zerostall.load_pytree(run_dir / step_name(2), options=LoadOptions(verify=False))
    assert out.keys() == state(2).keys()


def test_restore_read_error_keeps_errno(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zerostall.storage.local import LocalStorage

    def failing_read(self: Any, key: str, offset: int, buf: memoryview) -> None:
        raise OSError(errno.EIO, "injected read error")

    def failing_sequential(self: Any, key: str, offset: int, buf: memoryview, **kw: Any) -> None:
        raise OSError(errno.EIO, "injected read error")

    def failing_vectored(self: Any, key: str, offset: int, bufs: Any, **kw: Any) -> None:
        raise OSError(errno.EIO, "injected read error")

    monkeypatch.setattr(LocalStorage, "read_into", failing_read)
    monkeypatch.setattr(LocalStorage, "read_sequential", failing_sequential)
    monkeypatch.setattr(LocalStorage, "read_vectored", failing_vectored)
    monkeypatch.setattr(LocalStorage, "map_file", lambda *a, **k: None)  # else read by fill_cache and a mapping
    with pytest.raises(StorageError) as info:
        zerostall.load_pytree(run_dir / step_name(2))
    assert info.value.errno == errno.EIO
    assert info.value.key is not None and info.value.key.startswith("pytree/")


# -- the same matrix under the manifest-last commit (object stores: no rename) --------------


@pytest.fixture
def no_rename_url(tmp_path: Path) -> str:
    """A local directory whose backend claims no atomic rename, so commits go manifest-last."""
    from zerostall.storage import _REGISTERED, register_scheme
    from zerostall.storage.local import LocalStorage

    class NoRenameLocal(LocalStorage):
        atomic_rename = False

    register_scheme("zsnorename", lambda url: NoRenameLocal(url.split("://", 1)[1]))
    d = tmp_path / "run"
    d.mkdir()
    url = f"zsnorename://{d}"
    with Checkpointer(url, save_options=SaveOptions(writer=WriterKind.THREAD)) as c:
        c.save_pytree(1, state(1))
        c.save_pytree(2, state(2))
    yield url
    _REGISTERED.pop("zsnorename", None)


ML_CASES = [(p, a) for p in PHASES for a in ACTIONS if a != "exit"]


@pytest.mark.parametrize(("phase", "action"), ML_CASES, ids=[f"{p}-{a}" for p, a in ML_CASES])
def test_fault_matrix_manifest_last(no_rename_url: str, monkeypatch: pytest.MonkeyPatch, phase: str,
                                    action: str) -> None:
    from zerostall.commit import protocol_for
    from zerostall.storage import open_storage

    storage = open_storage(no_rename_url)
    assert type(protocol_for(storage)).__name__ == "ManifestLastCommit"
    directory = Path(no_rename_url.split("://", 1)[1])
    monkeypatch.setenv(ENV, json.dumps({phase: action}))
    expect = ACTIONS[action]
    with Checkpointer(no_rename_url, keep_last=2, save_options=SaveOptions(writer=WriterKind.THREAD)) as ckpt:
        r = ckpt.save_pytree_async(3, state(3))
        if phase in AFTER_COMMIT and action != "sleep:0.3":
            # The step is committed before retention runs: a retention failure (or a writer that
            # dies there) must not make a committed save look failed. It is reported instead.
            stats = r.result(timeout=60)
            assert stats.path.endswith(step_name(3))
            assert r._writer is not None and r._writer.retention_error
        elif expect[0] == "ok":
            r.result(timeout=60)
        else:
            with pytest.raises(StorageError) as info:
                r.result(timeout=60)
            assert info.value.errno == expect[2]
            assert info.value.path == f"{no_rename_url}/{step_name(3)}"
        committed = expect[0] == "ok" or phase in AFTER_COMMIT
        assert (ckpt.steps()[-1] == 3) if committed else (ckpt.steps() == [1, 2])
        if committed:
            assert_bit_exact(ckpt.load_pytree(3), state(3))
        else:
            # Without rename the step's directory may exist, but it has no manifest and no data.
            assert not (directory / step_name(3) / "manifest.json").exists()
            assert not any((directory / step_name(3)).glob("data-*"))
            with pytest.raises(zerostall.errors.CheckpointNotFoundError):
                ckpt.load_pytree(3)
        assert_bit_exact(ckpt.load_pytree(2), state(2))
        monkeypatch.delenv(ENV)
        ckpt.save_pytree(4, state(4))
        assert ckpt.latest_step() == 4
        assert_bit_exact(ckpt.load_pytree(), state(4))
