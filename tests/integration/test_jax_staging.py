"""JAX arrays staged in the background: the save returns holding references, the copy to host runs
on the engine's copier thread, and a train step that donates the saved arrays never tears a save.

On CPU the save call holds a host view of each buffer (no copy), under which XLA does not donate:
a donating step right after the call is safe by construction. Off CPU the copier takes the view
when it copies, and an array donated before that fails the save with ``DonatedArrayError``;
``HOLD_CPU_VIEWS = False`` gives CPU arrays that path, so it runs here too.

The copier thread is held back with a gate queued on it (a real item of its queue), so "donated
before the copy" and "copied before the donation" are both certain, not left to timing.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerostall.integrations.jax as zjax
from zerostall import BackgroundSaveError, Checkpointer, SaveOptions
from zerostall.errors import DonatedArrayError, TornSnapshotError


@functools.partial(jax.jit, donate_argnums=0)
def step(p: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return jax.tree.map(lambda x: x * 2 + 1, p)


def params() -> dict[str, jax.Array]:
    p = {"w": jnp.arange(1 << 18, dtype=jnp.float32), "b": jnp.ones((64, 64), jnp.bfloat16)}
    return jax.block_until_ready(p)


@contextmanager
def copier_held(c: Checkpointer) -> Iterator[threading.Event]:
    """Hold ``c``'s copier thread until the block ends (or the gate is set)."""
    gate = threading.Event()
    c._engine._copier._put(lambda: gate.wait(60))
    try:
        yield gate
    finally:
        gate.set()


def equal(out: dict[str, np.ndarray], expect: dict[str, np.ndarray]) -> bool:
    return sorted(out) == sorted(expect) and all(
        out[k].dtype == expect[k].dtype and out[k].tobytes() == expect[k].tobytes() for k in expect)


def test_save_returns_before_the_copy_and_donation_after_wait_staged_is_bit_for_bit(tmp_path: Path) -> None:
    p = params()
    expect = jax.tree.map(np.array, p)
    step(params())  # compiled outside the timed part
    with Checkpointer(tmp_path / "run") as c:
        with copier_held(c) as gate:
            r = c.save_pytree_async(1, p)
            assert not r.staged()  # returned holding references; nothing copied yet
            gate.set()
            r.wait_staged()
        assert r.staged()
        saved = p
        p = step(p)
        # the copy dropped its host views, so the step really donated the buffers (no extra copy)
        assert all(a.is_deleted() for a in saved.values())
        r.result()
        assert equal(c.load_pytree(1), expect)


def test_donation_right_after_the_call_is_safe_on_cpu(tmp_path: Path) -> None:
    p = params()
    expect = jax.tree.map(np.array, p)
    step(params())
    with Checkpointer(tmp_path / "run") as c:
        with copier_held(c):
            r = c.save_pytree_async(1, p)
            saved = p
            p = step(p)  # before the copy: XLA copies the held buffers instead of donating them
            assert not any(a.is_deleted() for a in saved.values())
            assert not r.staged()
        r.result()
        assert equal(c.load_pytree(1), expect)
        assert equal(jax.tree.map(np.array, p), jax.tree.map(lambda x: np.array(x * 2 + 1), expect))
        # once copied the views are gone: the next donating step reuses the buffers again
        saved = p
        p = step(p)
        assert all(a.is_deleted() for a in saved.values())


@pytest.fixture
def unheld(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU arrays take the accelerator path: no host view held from the call."""
    monkeypatch.setattr(zjax, "HOLD_CPU_VIEWS", False)


@pytest.mark.usefixtures("unheld")
def test_donation_before_the_copy_fails_that_save_by_key_and_commits_nothing(tmp_path: Path) -> None:
    p = params()
    step(params())
    with Checkpointer(tmp_path / "run") as c:
        c.save_pytree_async(1, p).result()  # a committed step before, untouched by the failure
        with copier_held(c) as gate:
            r = c.save_pytree_async(2, p)
            p = step(p)  # donates the arrays save 2 has not copied yet
            gate.set()
            with pytest.raises(DonatedArrayError, match="wait_staged") as ei:
                r.result()
        assert isinstance(ei.value, TornSnapshotError) and isinstance(ei.value, RuntimeError)
        assert ei.value.key in ("pytree/w", "pytree/b")
        assert ei.value.path is not None and ei.value.path.endswith("2")
        assert c.steps() == [1]
        # the next save is not affected; the failed step can be saved again
        c.save_pytree_async(2, p).result()
        assert equal(c.load_pytree(2), jax.tree.map(np.array, p))


@pytest.mark.usefixtures("unheld")
def test_unreceived_donation_failure_reaches_the_next_save_and_close(tmp_path: Path) -> None:
    p = params()
    step(params())
    c = Checkpointer(tmp_path / "run")
    with copier_held(c) as gate:
        c.save_pytree_async(1, p)
        p = step(p)
        gate.set()
    c._engine._copier.drain()
    with pytest.raises(BackgroundSaveError) as ei:
        c.save_pytree_async(2, p)
    assert isinstance(ei.value.cause, DonatedArrayError) and ei.value.step == 1
    with copier_held(c) as gate:
        c.save_pytree_async(3, p)
        p = step(p)
    with pytest.raises(BackgroundSaveError) as ei:
        c.close()
    assert isinstance(ei.value.cause, DonatedArrayError) and ei.value.step == 3
    with Checkpointer(tmp_path / "run", read_only=True) as r:
        assert r.steps() == []


def test_blocking_staging_copies_before_return(tmp_path: Path) -> None:
    p = params()
    expect = jax.tree.map(np.array, p)
    step(params())
    with Checkpointer(tmp_path / "run", save_options=SaveOptions(staging="blocking")) as c:
        with copier_held(c):  # the copy does not need the copier thread
            r = c.save_pytree_async(1, p)
            assert r.staged()
            p = step(p)
        r.result()
        assert equal(c.load_pytree(1), expect)


@pytest.mark.usefixtures("unheld")
def test_donation_racing_the_copy_never_commits_a_wrong_checkpoint(tmp_path: Path) -> None:
    p = {"w": jnp.arange(4 << 20, dtype=jnp.float32)}  # 16 MiB: the copy takes a while
    step(jax.block_until_ready({"w": jnp.zeros(4 << 20)}))
    outcomes = set()
    with Checkpointer(tmp_path / "run") as c:
        for s in range(1, 5):
            expect = np.array(p["w"])
            r = c.save_pytree_async(s, p)
            p = step(p)  # no wait_staged(): whichever comes first
            try:
                r.result()
            except DonatedArrayError:
                outcomes.add("refused")
                assert s not in c.steps()
            else:
                outcomes.add("copied")
                assert c.load_pytree(s)["w"].tobytes() == expect.tobytes()
    assert outcomes  # both are allowed; a committed step is always the state of its call


def test_jax_only_overlapped_save_imports_no_torch(tmp_path: Path) -> None:
    code = ("import sys, jax.numpy as jnp, zerostall\n"
            f"with zerostall.Checkpointer({str(tmp_path / 'run')!r}) as c:\n"
            "    r = c.save_pytree_async(1, {'w': jnp.ones(1000)})\n"
            "    r.result()\n"
            "    assert r.stats.staged_s >= r.stats.stall_s\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
