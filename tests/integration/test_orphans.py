"""No orphans: partial saves of dead writers are removed on any host, live ones never touched.

Writers of "another host" (``ZEROSTALL_HOST_ID``) are killed at every phase of a save (see
``_orphans.py``); ``zerostall gc`` run here removes their partials only once their leases have
expired, keeps a live writer's partial (held at a phase for longer than a lease lasts: it renews
it), and never touches a committed step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.cli import main as cli_main
from zerostall.commit import step_name
from zerostall.format.layout import LEASE_TMP_RE
from zerostall.lease import HOST_ENV, LEASE_MARK, host_id, read_leases
from zerostall.persist.faults import PHASES
from zerostall.persist.gc import collect_garbage
from zerostall.storage import open_storage

sys.path.insert(0, os.path.dirname(__file__))
import _orphans as orph
from memtier_procs import stop

THREAD = SaveOptions(writer=WriterKind.THREAD)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _fake_partial(run: Path, host: str, pid: int, *, expires: float) -> tuple[str, str]:
    staging = f".step_00000005.zs-tmp-{host}-{pid}-{uuid.uuid4().hex[:12]}"
    (run / staging / "data").mkdir(parents=True)
    (run / staging / "data" / "rank-00000.safetensors").write_bytes(b"x" * 100)
    lease = f"{LEASE_MARK}{host}-{pid}-{uuid.uuid4().hex[:12]}.json"
    (run / lease).write_text(json.dumps({"v": 1, "host": host, "pid": pid, "expires": expires,
                                         "renewed": time.time(), "targets": [staging]}))
    return staging, lease


def test_dead_pid_on_this_host_is_collected_before_its_lease_expires(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    pid = _dead_pid()
    mine = _fake_partial(run, host_id(), pid, expires=time.time() + 3600)
    theirs = _fake_partial(run, "elsewhere", pid, expires=time.time() + 3600)  # the same pid, another host
    report = collect_garbage(open_storage(str(run)))
    assert report.removed == [mine[0]] and report.leases_removed == [mine[1]]
    assert sorted(os.listdir(run)) == sorted(theirs)  # nothing proves the other host's writer dead
    later = collect_garbage(open_storage(str(run)), now=time.time() + 3601)
    assert later.removed == [theirs[0]] and later.leases_removed == [theirs[1]]
    assert os.listdir(run) == []


def test_a_lease_temporary_goes_with_its_lease(tmp_path: Path) -> None:
    """A writer killed while writing or renewing its lease leaves ``<lease>.tmp-<pid>-<hex>``: kept
    while the lease is live, removed once it is dead, or when no lease exists and no live process
    of this host can be writing it."""
    run = tmp_path / "run"
    run.mkdir()
    now = time.time()
    dead_pid = _dead_pid()
    _, expired = _fake_partial(run, "elsewhere", 11, expires=now - 1)
    _, live = _fake_partial(run, "elsewhere", 12, expires=now + 3600)
    gone_other = f"{LEASE_MARK}elsewhere-13-{uuid.uuid4().hex[:12]}.json"  # killed during its first write
    gone_dead = f"{LEASE_MARK}{host_id()}-{dead_pid}-{uuid.uuid4().hex[:12]}.json"
    gone_alive = f"{LEASE_MARK}{host_id()}-{os.getpid()}-{uuid.uuid4().hex[:12]}.json"  # first write in flight
    tmps = {k: f"{k}.tmp-{k.split('-')[-2]}-7f25b6330ac0" for k in (expired, live, gone_other, gone_dead, gone_alive)}
    for t in tmps.values():
        (run / t).write_text('{"v": 1, "ho')
    report = collect_garbage(open_storage(str(run)))
    assert sorted(report.removed) == sorted(
        [*(n for n in report.removed if ".zs-tmp-" in n), tmps[expired], tmps[gone_other], tmps[gone_dead]])
    assert tmps[live] in report.kept_live and tmps[gone_alive] in report.kept_live
    assert expired in report.leases_removed and live in report.live_leases
    left = set(os.listdir(run))
    assert {tmps[live], tmps[gone_alive], live} <= left and not {tmps[expired], tmps[gone_other], expired} & left


def test_unreadable_lease_of_another_host_is_treated_as_live(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    staging, lease = _fake_partial(run, "elsewhere", 4242, expires=0.0)
    (run / lease).write_text('{"v": 1, "host": "elsew')  # torn mid-renewal
    report = collect_garbage(open_storage(str(run)), now=time.time() + 10**6)
    assert report.removed == [] and report.kept_live == [staging]
    assert lease in report.errors[0]  # said, not silently skipped


def test_deletion_leftovers_and_unleased_partials_are_removed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with Checkpointer(run, save_options=THREAD) as ck:
        ck.save_pytree(1, orph.state(1))
    (run / ".step_00000000.zs-del-elsewhere-77-0123456789ab" / "data").mkdir(parents=True)
    (run / ".step_00000003.zs-decision-0123456789ab-4").write_text('{"decision": "abort"}')
    report = collect_garbage(open_storage(str(run)), dry_run=True)
    assert len(report.removed) == 2 and len(os.listdir(run)) == 3  # dry run: nothing deleted
    with Checkpointer(run, save_options=THREAD) as ck:
        assert ck.gc_report is not None and len(ck.gc_report.removed) == 2
        assert ck.steps() == [1]
    assert os.listdir(run) == [step_name(1)]


def test_writers_killed_at_every_phase_on_another_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    url = str(run)
    with Checkpointer(url, save_options=THREAD) as ck:
        ck.save_pytree(1, orph.state(1))
        ck.save_pytree(2, orph.state(2))
    doomed = {ph: orph.start_held(url, tmp_path, 10 + i, ph, "sleep:300") for i, ph in enumerate(PHASES)}
    gate = tmp_path / "gate"
    live = orph.start_held(url, tmp_path, 30, "manifest", f"wait:{gate}")
    try:
        for ph, t in doomed.items():
            orph.wait_mark(t.mark, ph)  # type: ignore[attr-defined]
        orph.wait_mark(live.mark, "manifest")  # type: ignore[attr-defined]
        for t in doomed.values():
            t.kill()
        storage = open_storage(url)
        leases = read_leases(storage)
        assert {ls.host for ls in leases} == {orph.OTHER}
        dead = [ls for ls in leases if ls.pid != live.writer]
        # A lease from the first file the writer creates to its commit: none at "begin" (before the
        # attempt), none at "retention" (after the commit).
        assert sorted(ls.pid for ls in dead) == sorted(doomed[ph].writer for ph in PHASES[1:5])
        partials = sorted(n for n in os.listdir(run) if ".zs-tmp-" in n and f"-{live.writer}-" not in n)
        assert len(partials) == 3  # checksum, manifest, commit (at "write" no file existed yet)
        # a writer killed while renewing its lease leaves that lease's temporary: it goes with the lease
        lease_tmps = [n for n in os.listdir(run) if (m := LEASE_TMP_RE.match(n)) and int(m["pid"]) != live.writer]
        # Before the leases expire nothing proves those writers dead: nothing is touched.
        early = collect_garbage(storage, dry_run=True, now=min(ls.expires or 0 for ls in dead) - 0.01)
        assert early.removed == [] and early.leases_removed == [] and early.kept_live
        while time.time() <= max(ls.expires or 0 for ls in dead) + 0.05:
            time.sleep(0.05)
        assert cli_main(["gc", url, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert sorted(report["removed"]) == sorted(partials + lease_tmps)
        assert len(report["leases_removed"]) == 4
        live_lease = [ls.key for ls in read_leases(storage)]
        assert len(live_lease) == 1 and f"-{live.writer}-" in live_lease[0]
        hidden = sorted(n for n in os.listdir(run) if n.startswith(".") and not LEASE_TMP_RE.match(n))
        assert len(hidden) == 2 and live_lease[0] in hidden  # the live writer's lease and partial
        assert any(".step_00000030.zs-tmp-" in n for n in report["kept_live"])
        # the committed steps, the one killed at retention (after its commit) included, are whole
        with Checkpointer(url, save_options=THREAD) as ck:
            assert ck.steps() == [1, 2, 15]
            for s in ck.steps():
                np.testing.assert_array_equal(ck.load_pytree(s)["w"], orph.state(s)["w"])
        gate.touch()
        assert "COMMITTED 30" in live.finish()  # the live writer, never touched, commits
    finally:
        for t in [*doomed.values(), live]:
            if t.proc.poll() is None:
                t.kill()
    with Checkpointer(url, save_options=THREAD) as ck:
        assert ck.steps() == [2, 15, 30]  # keep_last=3 applied by the live writer's commit
        np.testing.assert_array_equal(ck.load_pytree(30)["w"], orph.state(30)["w"])
    assert not [n for n in os.listdir(run) if n.startswith(".")]


def test_host_env_names_partials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_ENV, "node-a")
    assert host_id() == "node-a"


def test_cli_gc_text_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    staging, _ = _fake_partial(run, host_id(), _dead_pid(), expires=time.time() + 3600)
    assert cli_main(["gc", str(run), "--dry-run"]) == 0
    assert f"would remove {staging}" in capsys.readouterr().out and (run / staging).exists()
    assert cli_main(["gc", str(run)]) == 0
    assert f"removed {staging}" in capsys.readouterr().out and os.listdir(run) == []
    assert cli_main(["gc", str(tmp_path / "missing")]) == 1
    assert "no such directory" in capsys.readouterr().err


def test_a_writer_whose_lease_lapsed_does_not_commit(tmp_path: Path) -> None:
    """A writer suspended past its lease (SIGSTOP) may have lost its partial to a collector: on
    resuming it fails the save instead of committing (no torn checkpoint)."""
    import signal

    run = tmp_path / "run"
    url = str(run)
    gate = tmp_path / "gate"
    t = orph.start_held(url, tmp_path, 7, "manifest", f"wait:{gate}")
    try:
        orph.wait_mark(t.mark, "manifest")  # type: ignore[attr-defined]
        stop(t.writer)
        try:
            storage = open_storage(url)
            (lease,) = read_leases(storage)
            while time.time() <= (lease.expires or 0) + 0.05:
                time.sleep(0.05)
            report = collect_garbage(storage)
            assert len(report.removed) == 1 and report.leases_removed == [lease.key]
        finally:
            os.kill(t.writer, signal.SIGCONT)
        gate.touch()
        out, err = t.proc.communicate(timeout=120)
    finally:
        if t.proc.poll() is None:
            t.kill()
    assert t.proc.returncode != 0 and "COMMITTED" not in out
    assert "WriterError" in err and "lease" in err, err[-2000:]
    assert os.listdir(run) == []  # nothing committed, nothing left (its renewed lease released too)


def test_lease_check_raises_after_a_lapse(tmp_path: Path) -> None:
    from zerostall.errors import WriterError
    from zerostall.lease import Lease

    lease = Lease(open_storage(str(tmp_path)), ["x"], duration_s=0.2).acquire()
    lease.check()
    lease._stop.set()  # renewals stop, as in a stalled process
    assert lease._thread is not None
    lease._thread.join()
    time.sleep(0.3)
    with pytest.raises(WriterError, match="lapsed"):
        lease.check("/ckpt/step_1")
    lease.release()
    assert os.listdir(tmp_path) == []


def test_a_first_lease_write_whose_temporary_is_collected_is_written_again(tmp_path: Path) -> None:
    """Another host's collector may remove the temporary of a first lease write (no lease exists
    yet to say it is live): the writer writes it once more instead of failing the save."""
    from zerostall.lease import Lease

    storage = open_storage(str(tmp_path))
    put = storage.put
    calls: list[str] = []

    def collected_once(key: str, data: bytes, *, if_absent: bool = False) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory", f"{tmp_path / key}.tmp-1-0")
        put(key, data, if_absent=if_absent)

    storage.put = collected_once  # type: ignore[method-assign]
    lease = Lease(storage, ["x"], duration_s=60).acquire()
    assert [ls.key for ls in read_leases(storage)] == [lease.key] and calls == [lease.key, lease.key]
    lease.release()
    assert os.listdir(tmp_path) == []
