"""The memory tier's step mapped once, at adoption, and pre-faulted in the background.

A trainer subprocess saves memory-only steps and is SIGKILLed; the test process plays the
restarted trainer: its ``Checkpointer`` adopts the keeper, a background thread maps the held step
and pre-faults it, and loads copy out of that one mapping. What is checked is what a user sees
(the loaded bytes, errors) and what the process holds (``/proc/self/maps``, ``/proc/self/fd``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
from memtier_procs import (
    DEADLINE_S,
    assert_state,
    fds_of,
    held_inodes,
    killed_trainer,
    mappings_of,
    memory_tier,
    parse_trainer_output,
    run_trainer,
    running,
    start_trainer,
    wait_for,
)

from zerostall import Checkpointer, LoadOptions
from zerostall.errors import ChecksumMismatchError
from zerostall.persist.faults import ENV as FAULTS_ENV
from zerostall.persist.faults import MARK_ENV

sys.path.insert(0, str(Path(__file__).parent))
from _memory_trainer import state


def test_first_load_after_adoption_reuses_the_premapped_step(tmp_path: Path) -> None:
    d = tmp_path / "run"
    keeper = killed_trainer(d)
    ck = Checkpointer(d, memory_tier=memory_tier(every=1000))
    assert ck._engine.writer.pid == keeper and ck._memory.premap is not None
    tmpl = state(0)
    w = tmpl["w"]
    out = ck.load_pytree(3, template=tmpl)  # the restart's first load, right after the adoption
    assert_state(out, state(3))
    assert out["w"] is w
    assert ck._memory.premap.reused == 1  # it copied out of the mapping made at adoption
    inodes = held_inodes(ck)
    assert ck._memory.premap.join(DEADLINE_S) and ck._memory.premap.populated > 0
    held = mappings_of(inodes)
    assert len(held) == len(inodes) >= 1  # each memfd mapped once, and kept for the next load
    assert all(kib > 0 for kib in held.values())  # pre-faulted
    assert_state(ck.load_pytree(), state(3))
    assert ck._memory.premap.reused == 2
    assert mappings_of(inodes).keys() == held.keys()  # the same mappings: none made, none left behind
    # Nothing of the step stays mapped or open here once the Checkpointer is closed.
    ck.close()
    assert mappings_of(inodes) == {} and fds_of(inodes) == []
    wait_for(lambda: not running(keeper), "the keeper to exit after close()")


def test_a_save_releases_the_premapped_step(tmp_path: Path) -> None:
    d = tmp_path / "run"
    killed_trainer(d)
    with Checkpointer(d, memory_tier=memory_tier(every=1000)) as ck:
        premap = ck._memory.premap
        assert premap is not None
        assert_state(ck.load_pytree(3), state(3))
        inodes = held_inodes(ck)
        assert len(mappings_of(inodes)) == len(inodes)
        # The keeper lets go of step 3 once step 4 is in memory: a mapping here would keep it.
        ck.save_pytree(4, state(4))
        assert ck._memory.premap is None and mappings_of(inodes) == {}
        assert ck.latest_step() == 4
        assert_state(ck.load_pytree(4), state(4))
        assert premap.reused == 1  # step 4 was mapped by its own load


def test_a_load_while_the_premap_is_not_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load starts while the keeper still checks the step (nothing mapped yet), and
    copies out of the mapping while the pre-fault is still to run: it takes the mapping over."""
    d, marks, go_check, go_fault = tmp_path / "run", tmp_path / "marks", tmp_path / "go-check", tmp_path / "go-fault"
    marks.mkdir()
    env = dict(os.environ, **{FAULTS_ENV: json.dumps({"keeper_check": f"wait:{go_check}"}), MARK_ENV: str(marks)})
    p = start_trainer(d, 1, 3, 1000, 60, "kill", env=env)
    out_text, _ = p.communicate(timeout=DEADLINE_S)
    keeper, saved = parse_trainer_output(out_text.splitlines())
    assert p.returncode == -signal.SIGKILL and saved == dict.fromkeys((1, 2, 3), "memory")
    wait_for(lambda: (marks / f"keeper_check-{keeper}").exists(), "the keeper's check to start")
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"premap_populate": f"wait:{go_fault}"}))
    monkeypatch.setenv(MARK_ENV, str(marks))
    with Checkpointer(d, memory_tier=memory_tier(every=1000)) as ck:
        premap = ck._memory.premap
        assert premap is not None
        got: list[dict] = []
        loader = threading.Thread(target=lambda: got.append(ck.load_pytree(3, template=state(0))))
        loader.start()
        loader.join(0.3)
        assert loader.is_alive() and not got  # waits for the keeper's check, as every load does
        go_check.touch()
        loader.join(DEADLINE_S)
        assert len(got) == 1
        assert_state(got[0], state(3))
        assert (marks / f"premap_populate-{os.getpid()}").exists()  # mapped, pre-fault held back
        assert premap.reused == 1 and premap.populated == 0
        # The load read through the mapping made at adoption (its pages are now in this process's
        # page tables there; a load that mapped the step itself would have left them empty).
        held = mappings_of(held_inodes(ck))
        assert len(held) >= 1 and sum(held.values()) * 1024 >= state(3)["w"].nbytes
        # The load stopped the pre-fault: released now, the thread faults nothing more.
        go_fault.touch()
        assert premap.join(DEADLINE_S) and premap.populated == 0
        for _ in range(3):
            assert_state(ck.load_pytree(3, template=state(0)), state(3))
        assert premap.reused == 4 and len(mappings_of(held_inodes(ck))) == len(held)


def test_close_while_the_premap_waits_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d, marks, go = tmp_path / "run", tmp_path / "marks", tmp_path / "go"
    marks.mkdir()
    keeper = killed_trainer(d)
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"premap_populate": f"wait:{go}"}))
    monkeypatch.setenv(MARK_ENV, str(marks))
    ck = Checkpointer(d, memory_tier=memory_tier(every=1000))
    premap = ck._memory.premap
    assert premap is not None
    inodes = held_inodes(ck)
    wait_for(lambda: (marks / f"premap_populate-{os.getpid()}").exists(), "the step to be mapped")
    assert set(mappings_of(inodes).values()) == {0}  # mapped, nothing read through it yet
    assert len(mappings_of(inodes)) == len(inodes)
    ck.close()  # the pre-fault has not started: the close unmaps, the thread then does nothing
    assert mappings_of(inodes) == {} and fds_of(inodes) == []
    go.touch()
    assert premap.join(DEADLINE_S) and premap.populated == 0
    assert mappings_of(inodes) == {}
    wait_for(lambda: not running(keeper), "the keeper to exit after close()")


def test_a_corrupted_step_is_still_caught(tmp_path: Path) -> None:
    d = tmp_path / "run"
    rc, keeper, saved = run_trainer(d, 1, 2, 5, 60, "corrupt")  # flips a byte of leaf "w" after the save
    assert rc == -signal.SIGKILL and saved == {1: "memory", 2: "memory"}
    with Checkpointer(d, memory_tier=memory_tier(every=5), load_options=LoadOptions(atomic=True)) as ck:
        assert ck._engine.writer.pid == keeper and ck._memory.premap is not None
        tmpl = state(0)
        with pytest.raises(ChecksumMismatchError) as err:
            ck.load_pytree(2, template=tmpl)
        assert err.value.key is not None and err.value.key.split("/")[-1] == "w"
        assert "zsimage" not in str(err.value)
        assert ck._memory.premap.reused == 1  # the pre-mapped bytes, verified by the load as before
        assert tmpl["w"].tobytes() == state(0)["w"].tobytes()  # all or nothing


def test_a_forked_child_does_not_inherit_the_premapped_step(tmp_path: Path) -> None:
    """A DataLoader's workers fork after the load: their copy of the mapping would keep the
    step's memory alive after the next save lets go of it."""
    d = tmp_path / "run"
    killed_trainer(d)
    with Checkpointer(d, memory_tier=memory_tier(every=1000)) as ck:
        assert_state(ck.load_pytree(3), state(3))
        inodes = held_inodes(ck)
        assert len(mappings_of(inodes)) == len(inodes)  # held here, for the next load
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its mappings of the step, then close what it inherited
            try:
                n = len(mappings_of(inodes))
                assert ck._memory.premap is not None
                ck._memory.premap.close()
                os.write(w, f"{n}".encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            got = f.read()
        assert os.waitpid(pid, 0)[1] == 0
        assert got == "0"
        assert_state(ck.load_pytree(3), state(3))  # the parent's mapping is untouched
        assert ck._memory.premap is not None and ck._memory.premap.reused == 2
