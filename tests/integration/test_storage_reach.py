"""A wrong local location fails when it is opened, not as an empty run; ``read_only=True`` starts
no writer and refuses to save; loading never starts a writer; a location zerostall cannot use
(``file://`` with two slashes, ``memory://`` with the writer process) is refused before anything
starts; a folder it may not read or write is named in the error.

Unwritable locations are made with a regular file where a directory should be (``ENOTDIR``),
which fails for root too (tests may run as root, for whom permission bits do not apply); the
permission tests run their code in an interpreter without CAP_DAC_OVERRIDE (``_permissions``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _permissions import as_user_without_dac

import zerostall
from zerostall import Checkpointer, api
from zerostall.errors import CheckpointNotFoundError, InvalidArgumentError, ReadOnlyError, StorageError, ZerostallError


def state(seed: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(seed)), "step": seed}


def writer_children() -> set[int]:
    """Pids of this process's children that run a zerostall writer."""
    me = os.getpid()
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == me and b"zerostall.persist.server" in cmd:
            out.add(int(pid))
    return out


@pytest.mark.parametrize("where", ["parent_is_file", "is_file"])
def test_directory_that_cannot_be_created_fails_at_open(tmp_path: Path, where: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    target = blocker / "run" if where == "parent_is_file" else blocker
    before = writer_children()
    with pytest.raises(StorageError) as ei:
        Checkpointer(target)
    err = ei.value
    assert isinstance(err, ZerostallError) and isinstance(err, OSError)
    assert err.errno == errno.ENOTDIR
    assert err.path == str(target)
    assert "cannot be created or written" in str(err)
    assert writer_children() <= before  # the writer it had started is stopped again


def test_read_only_starts_no_writer_and_refuses_saves(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with Checkpointer(d) as ck:
        ck.save_pytree(3, state(3))
    before = writer_children()
    with Checkpointer(d, read_only=True) as ro:
        assert writer_children() == before
        assert ro.steps() == [3]
        assert ro.load_pytree()["step"] == 3
        for save in (lambda: ro.save_pytree_async(4, state(4)), lambda: ro.save_pytree(4, state(4)),
                     lambda: ro.save_checkpointables(4, {"a": state(4)}), lambda: ro.prepare(tree=state(4))):
            with pytest.raises(ReadOnlyError) as ei:
                save()
            assert isinstance(ei.value, StorageError)
            assert ei.value.errno == errno.EROFS
            assert "read_only" in str(ei.value)
        assert writer_children() == before
        ro.wait()
    assert sorted(os.listdir(d)) == ["step_00000003"]


def test_read_only_does_not_create_the_directory(tmp_path: Path) -> None:
    d = tmp_path / "typo"
    with pytest.raises(CheckpointNotFoundError) as ei:
        Checkpointer(d, read_only=True)
    assert ei.value.path == str(d)
    assert not d.exists()


def test_read_only_on_a_file_is_a_storage_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(StorageError) as ei:
        Checkpointer(f, read_only=True)
    assert ei.value.errno == errno.ENOTDIR


def test_loading_starts_no_writer(tmp_path: Path) -> None:
    zerostall.save_pytree(tmp_path / "ckpt", state(1))
    engines = dict(api._engines)
    before = writer_children()
    assert zerostall.load_pytree(tmp_path / "ckpt")["step"] == 1
    assert zerostall.load_checkpointables(tmp_path / "ckpt")["pytree"]["step"] == 1
    with pytest.raises(CheckpointNotFoundError):
        zerostall.load_pytree(tmp_path / "nothing")
    assert dict(api._engines) == engines
    assert writer_children() == before


def test_load_under_a_file_is_a_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(StorageError) as ei:
        zerostall.load_pytree(blocker / "run" / "ckpt")
    assert not isinstance(ei.value, CheckpointNotFoundError)
    assert ei.value.errno == errno.ENOTDIR


def test_local_probe(tmp_path: Path) -> None:
    from zerostall.storage.local import LocalStorage

    fresh = tmp_path / "a" / "b"
    LocalStorage(str(fresh)).probe(write=False)  # missing: nothing committed, not unreachable
    assert not fresh.exists()
    LocalStorage(str(fresh)).probe(write=True)
    assert fresh.is_dir() and os.listdir(fresh) == []  # created, and the probe left nothing
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    for write in (False, True):
        with pytest.raises(NotADirectoryError):
            LocalStorage(str(blocker)).probe(write=write)
    with pytest.raises(NotADirectoryError):
        LocalStorage(str(blocker / "sub")).probe(write=True)


def test_memory_backend_opens(tmp_path: Path) -> None:
    from zerostall import SaveOptions, WriterKind

    with Checkpointer("memory://reach-test/run", save_options=SaveOptions(writer=WriterKind.THREAD)) as ck:
        ck.save_pytree(1, state(1))
    with Checkpointer("memory://reach-test/run", read_only=True) as ro:
        assert ro.load_pytree()["step"] == 1


def test_a_file_in_place_of_the_run_directory_is_not_a_directory(tmp_path: Path) -> None:
    # Python's makedirs reports it as FileExistsError, which would read as CheckpointExistsError.
    from zerostall.storage.local import LocalStorage

    blocker = tmp_path / "run"
    blocker.write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        LocalStorage(str(blocker)).put("lease.json", b"{}")  # makedirs(root): a file is there
    with pytest.raises(StorageError) as ei:
        zerostall.save_pytree(blocker / "ckpt", state(1))
    assert ei.value.errno == errno.ENOTDIR
    assert not isinstance(ei.value, FileExistsError)


def test_writer_is_up_when_the_constructor_returns(tmp_path: Path) -> None:
    # The first save's slot is freed only once the writer has written it: a writer still booting
    # would add its start-up to the second save's stall (make bench's "saves right after Checkpointer()" row).
    with Checkpointer(tmp_path / "run") as ck:
        writer = ck._engine.writer
        assert writer.alive() and writer.pid in writer_children()
        assert writer.wait_ready(timeout=0)  # said hello already: no waiting left


def test_a_step_whose_manifest_cannot_be_checked_is_an_error_not_an_older_latest_step(
        run_with_unreadable_newest: Path) -> None:
    # Permission denied on step 2's folder: os.path.lexists hides EACCES, and a latest_step() of 1
    # would make a resume load the older step without a word.
    code = ("import zerostall\n"
            f"c = zerostall.Checkpointer({str(run_with_unreadable_newest)!r}, read_only=True)\n"
            "try:\n    print('LATEST', c.latest_step())\n"
            "except zerostall.errors.StorageError as e:\n    print('ERR', e.errno, e)\n")
    out = as_user_without_dac(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR 13 "), out.stdout
    assert "step_00000002" in out.stdout and "Permission denied" in out.stdout


def test_a_save_into_a_directory_it_may_not_write_names_that_directory_not_the_lease_temp_file(
        tmp_path: Path) -> None:
    # The first write of a save is its lease's temporary file: the error must name the directory
    # the user chose, not ".zs-lease-....json.tmp-PID-...".
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        out = as_user_without_dac(
            "import torch, zerostall\n"
            f"try:\n    zerostall.save_pytree({str(locked / 'a')!r}, {{'w': torch.ones(2)}})\n"
            "except zerostall.errors.StorageError as e:\n    print('ERR', e.errno, e)\n")
    finally:
        locked.chmod(0o755)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERR 13 "), out.stdout + out.stderr
    assert f"lease file in {locked}" in out.stdout and ".tmp-" not in out.stdout


def test_a_file_url_with_two_slashes_is_refused_instead_of_becoming_a_relative_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "file://tmp/run" names host "tmp", path "/run"; read as a path it would be ./tmp/run under
    # the working directory.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"file:///tmp/run, three slashes") as info:
        zerostall.Checkpointer("file://tmp/run")
    assert info.value.path == "file://tmp/run"
    assert not (tmp_path / "tmp").exists()
    zerostall.save_pytree(f"file://localhost{tmp_path}/a", {"x": 1})  # the one host a file URL may name
    assert zerostall.load_pytree(f"file://{tmp_path}/a") == {"x": 1}


def test_memory_url_with_the_writer_process_is_refused_before_anything_starts() -> None:
    # memory:// lives in this process: a writer process would write into its own memory, and the
    # save would vanish with it.
    from zerostall import SaveOptions, WriterKind

    thread = SaveOptions(writer=WriterKind.THREAD)
    with pytest.raises(InvalidArgumentError, match=r"SaveOptions\(writer=WriterKind.THREAD\)") as info:
        zerostall.save_pytree("memory://writer-kind/a", {"w": torch.ones(2)})
    assert info.value.path == "memory://writer-kind/a" and info.value.argument == "options"
    with pytest.raises(InvalidArgumentError, match="memory://"):
        Checkpointer("memory://writer-kind/run")
    # what the message says to do works, and a read-only Checkpointer needs no writer at all
    zerostall.save_pytree("memory://writer-kind/b", {"w": torch.ones(2)}, options=thread)
    assert torch.equal(zerostall.load_pytree("memory://writer-kind/b")["w"], torch.ones(2))
    with Checkpointer("memory://writer-kind/run2", save_options=thread) as ck:
        ck.save_pytree(1, {"w": torch.ones(2)})
    with Checkpointer("memory://writer-kind/run2", read_only=True) as ro:
        assert ro.latest_step() == 1
