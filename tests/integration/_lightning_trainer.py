"""A tiny deterministic Lightning run, shared by test_lightning.py and the trainer it kills.

As a script: ``_lightning_trainer.py CKPT_DIR MAX_EPOCHS KILL_EPOCH RELEASE_FILE`` trains with
``ZerostallCheckpointIO``. Right before the first save of epoch ``KILL_EPOCH`` it waits for the
earlier saves to commit and deletes ``RELEASE_FILE`` (the writer, run with
``ZEROSTALL_FAULTS={"commit": "wait:RELEASE_FILE"}``, then holds every later save before its
commit); right after that epoch's ``last.ckpt`` save has returned it prints
``{"global_step": ...}`` and SIGKILLs itself.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerostall.lightning import ZerostallCheckpointIO

BATCHES = 4


class TinyModule(pl.LightningModule):
    """Linear regression with momentum SGD and an epoch-interval LR schedule (so optimizer and
    scheduler state matter on resume), and hyper-parameters that need converting."""

    def __init__(self, lr: float = 0.05, options: argparse.Namespace | None = None,
                 data_dir: pathlib.Path | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def make_module() -> TinyModule:
    pl.seed_everything(0)
    return TinyModule(options=argparse.Namespace(width=16, tags=("a", "b")), data_dir=pathlib.Path("/data/tiny"))


def make_data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * 4, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def make_checkpoint_callback(ckpt_dir: str) -> pl.callbacks.ModelCheckpoint:
    # monitor="epoch" with mode="max": every epoch enters the top 2 and pushes the oldest out, so
    # each epoch saves a top-k checkpoint, removes one, and saves last.ckpt
    return pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, monitor="epoch", mode="max", save_top_k=2,
                                        every_n_epochs=1, save_last=True)


def make_trainer(ckpt_dir: str, max_epochs: int, plugin: Any, callbacks: list[Any] | None = None) -> pl.Trainer:
    torch.set_num_threads(1)
    return pl.Trainer(
        max_epochs=max_epochs, accelerator="cpu", devices=1, deterministic=True, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=ckpt_dir,
        callbacks=[make_checkpoint_callback(ckpt_dir), *(callbacks or [])], plugins=[plugin])


class KillingCheckpointIO(ZerostallCheckpointIO):
    def __init__(self, kill_epoch: int, release: str) -> None:
        super().__init__()
        self.kill_epoch = kill_epoch
        self.release = release

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if checkpoint["epoch"] == self.kill_epoch and os.path.exists(self.release):
            self.teardown()  # the saves before this epoch's commit (with one staging slot, a held save
            os.remove(self.release)  # queued ahead of this epoch's would stall its second save forever)
        super().save_checkpoint(checkpoint, path, storage_options)
        if checkpoint["epoch"] == self.kill_epoch and os.path.basename(path) == "last.ckpt":
            # With overlapped staging a save reaches the writer once its copy is done; a trainer
            # killed before that loses it (docs/guarantees.md). This test is about the kill after.
            for saves in list(self._saves.values()):
                for s in saves:
                    s.response.wait_staged()
            print(json.dumps({"global_step": checkpoint["global_step"]}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ckpt_dir, max_epochs, kill_epoch, release = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    trainer = make_trainer(ckpt_dir, max_epochs, KillingCheckpointIO(kill_epoch, release))
    trainer.fit(make_module(), make_data())
    print(json.dumps({"error": "finished without being killed"}), flush=True)


if __name__ == "__main__":
    main()
