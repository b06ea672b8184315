"""``fit(ckpt_path="last")`` when ``last.ckpt`` never committed: resume from the newest committed sibling.

The plugin makes a Lightning checkpoint's directory when its first save starts (Lightning wants the
path at once), so a trainer killed during the first save to ``last.ckpt`` leaves it empty while the
top-k checkpoints beside it hold committed saves. Lightning's "last" picks ``last.ckpt`` at every
restart; the plugin loads the newest committed sibling instead, with a ``ZerostallWarning`` that
names it, and with no committed sibling the error says so.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from zerostall.errors import CheckpointNotFoundError, ZerostallWarning
from zerostall.lightning import ZerostallCheckpointIO

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import _lightning_trainer as lt  # noqa: E402
from test_lightning import EPOCHS, assert_same_tensors, fit  # noqa: E402


def _empty_like_a_killed_first_save(container: Path) -> None:
    """What a trainer killed during the first save to ``container`` leaves: the directory, and
    at most a hidden partial save inside it."""
    shutil.rmtree(container)
    container.mkdir()
    (container / ".step_00000001.zs-tmp-killed").mkdir()


def test_fit_last_resumes_from_the_newest_committed_sibling_bit_for_bit(tmp_path: Path) -> None:
    ref_trainer, reference, _ = fit(str(tmp_path / "reference"))
    run = tmp_path / "run"
    first = lt.make_trainer(str(run), 3, ZerostallCheckpointIO())  # epochs 0-2: top-2 are epochs 1 and 2
    first.fit(lt.make_module(), lt.make_data())
    _empty_like_a_killed_first_save(run / "last.ckpt")
    assert {"epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"} <= set(os.listdir(run))

    with pytest.warns(ZerostallWarning, match=r"epoch=2-step=12\.ckpt.*global step 12"):
        trainer, resumed, loaded = fit(str(run), ckpt_path="last")
    assert loaded.global_step == 12  # the newest sibling, not epoch=1 (sorted first) nor a fresh start
    assert trainer.global_step == EPOCHS * lt.BATCHES
    assert_same_tensors(reference.state_dict(), resumed.state_dict())
    assert_same_tensors(ref_trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict())
    # the run went on saving to last.ckpt: it holds the final step now, and loads without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ZerostallCheckpointIO().load_checkpoint(run / "last.ckpt")["global_step"] == EPOCHS * lt.BATCHES


def test_the_sibling_is_chosen_by_global_step_and_only_among_plugin_checkpoints(tmp_path: Path) -> None:
    io = ZerostallCheckpointIO()
    for name, step in [("b-early.ckpt", 30), ("a-late.ckpt", 40), ("z-earliest.ckpt", 10)]:
        io.save_checkpoint({"state_dict": {"w": torch.full((2,), float(step))}, "epoch": 0, "global_step": step},
                           tmp_path / name)
    io.teardown()
    (tmp_path / "not-ours").mkdir()  # a directory the plugin did not make: never a candidate
    (tmp_path / "not-ours" / "notes.txt").write_text("x")
    (tmp_path / "model.pt").write_bytes(b"torch.save")  # a file beside them
    (tmp_path / "last.ckpt").mkdir()
    with pytest.warns(ZerostallWarning, match="a-late.ckpt"):
        got = io.load_checkpoint(tmp_path / "last.ckpt")
    assert got["global_step"] == 40 and torch.equal(got["state_dict"]["w"], torch.full((2,), 40.0))

    for name in ("a-late.ckpt", "b-early.ckpt", "z-earliest.ckpt"):  # no committed sibling: the error
        shutil.rmtree(tmp_path / name)
    with pytest.raises(CheckpointNotFoundError, match="nothing beside it holds a committed save"):
        io.load_checkpoint(tmp_path / "last.ckpt")


def test_lightning_last_ckpt_left_empty_by_a_kill_names_the_checkpoints_to_resume_from(tmp_path: Path) -> None:
    # A trainer SIGKILLed during a checkpoint event: epoch=0-step=7.ckpt committed, last.ckpt made
    # (the plugin makes the path at once) while its save still waited for the first one's slot.
    # The committed sibling is loaded with a warning naming it; with none beside it, the error
    # says that nothing beside it holds a committed save.
    io = ZerostallCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0, "global_step": 7},
                       tmp_path / "epoch=0-step=7.ckpt")
    io.teardown()
    (tmp_path / "last.ckpt").mkdir()
    with pytest.warns(ZerostallWarning) as caught:
        assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 7
    msg = str(caught[0].message)
    assert "first save never committed" in msg and "epoch=0-step=7.ckpt" in msg, msg
    assert io.load_checkpoint(tmp_path / "epoch=0-step=7.ckpt")["global_step"] == 7
    (tmp_path / "epoch=0-step=7.ckpt").rename(tmp_path / ".gone")
    with pytest.raises(CheckpointNotFoundError, match="nothing beside it holds a committed save"):
        io.load_checkpoint(tmp_path / "last.ckpt")
