"""A real Lightning fit with ``ZerostallCheckpointIO``: the overlapped copy runs beside the closure.

Lightning's automatic optimization hands ``training_step`` + backward to ``optimizer.step()`` as a
closure. The guard orders the update at the end of the closure's first call (stage.overlap), so the
next batch's forward and backward run while the parameters and optimizer state are still being
copied; each checkpoint then holds the state of its own step, bit for bit.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from zerostall.lightning import ZerostallCheckpointIO
from zerostall.stage import overlap


class _Model(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.copied_at_closure: list[bool] = []

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        with overlap.GUARD._lock:
            tasks = list(overlap.GUARD._tasks)
        if tasks:
            self.copied_at_closure.append(all(t.cpu_done.is_set() for t in tasks))
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _Snapshots(pl.Callback):  # type: ignore[misc]
    """The weights right after each optimizer step (what the checkpoint of that step must hold)."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.by_step[trainer.global_step] = copy.deepcopy(module.net.state_dict())


def test_lightning_fit_overlaps_the_closure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = overlap._Pieces.work

    def late_copier(self: Any) -> int:  # the copier starts late: only a guard could copy before the closure
        if threading.current_thread().name.startswith("zerostall-copier"):
            time.sleep(0.2)
        return work(self)

    monkeypatch.setattr(overlap._Pieces, "work", late_copier)
    ds = torch.utils.data.TensorDataset(torch.randn(128, 64), torch.randn(128, 1))
    model, snaps = _Model(), _Snapshots()
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1,
                                           filename="{step}")
    trainer = pl.Trainer(max_steps=8, plugins=[ZerostallCheckpointIO()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[snaps, ckpt_cb])
    trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=16))
    # the saves after steps 2, 4, 6 were followed by a step whose closure (training_step) ran before
    # the copy was done; the first save may only learn the optimizer (nothing overlapped then)
    assert model.copied_at_closure.count(False) >= 2, model.copied_at_closure
    io = ZerostallCheckpointIO()
    for step in (2, 4, 6, 8):
        got = io.load_checkpoint(tmp_path / f"step={step}.ckpt")["state_dict"]
        for k, v in snaps.by_step[step].items():
            assert torch.equal(got[f"net.{k}"], v), (step, k)
