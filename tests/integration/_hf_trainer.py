"""A tiny deterministic Hugging Face run (GPT-2, CPU, no Hub), shared by test_transformers.py and its subprocesses.

As a script: ``_hf_trainer.py KIND OUT_DIR MAX_STEPS KILL_STEP RELEASE_FILE [memory]`` (KIND:
``trainer`` or ``sft``) trains with :class:`ZerostallCheckpointing`, saving every 2 steps (with
``memory``: into a memory tier that persists every 4th step). Right before the save
of ``KILL_STEP`` it waits for the earlier saves to commit and deletes ``RELEASE_FILE`` (the writer,
run with ``ZEROSTALL_FAULTS={"commit": "wait:RELEASE_FILE"}``, then holds every later save before
its commit); right after that save was staged it prints ``{"killed_at": step}`` and SIGKILLs itself.

Under torchrun (``_hf_trainer.py ddp OUT_DIR``) each rank runs: an uninterrupted run, a run that
stops after step 4, and a fresh trainer resuming that run; it prints the SHA-256 of the final
parameters of the uninterrupted and the resumed run, the steps saved and the final global step.

``_hf_trainer.py jit OUT_DIR MAX_STEPS NOTICE_STEP SAVE_STEPS READY_FILE [memory]`` trains with
``enable_jit_checkpoint=True`` (HF's SIGTERM handler) and :class:`ZerostallCheckpointing`, saving
every SAVE_STEPS steps. At the end of step NOTICE_STEP it creates READY_FILE (the test then sends
SIGTERM) and holds that step until HF's 3 s timer has requested the JIT checkpoint, so that HF acts
at a known hook: the next step's ``on_step_begin``. When ``train()`` returns it prints the final
global step and the steps committed at that moment, then exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import zerostall
from zerostall.integrations.transformers import ZerostallCheckpointing

VOCAB = 48
SEQ = 16
ROWS = 24
BATCH = 4  # 6 steps per epoch
MEMORY = zerostall.MemoryTier(persist_interval_steps=4, linger_s=120)


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def make_dataset() -> Dataset:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                     eos_token_id=1, pad_token_id=0)
    return GPT2LMHeadModel(cfg)  # dropout on: a resume needs the RNG states to match


def make_args(kind: str, out: str, max_steps: int, **kw: Any) -> Any:
    common = dict(output_dir=out, max_steps=max_steps, per_device_train_batch_size=BATCH, learning_rate=1e-2,
                  lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps", save_steps=2, logging_steps=1,
                  report_to=[], use_cpu=True, seed=7, dataloader_num_workers=0, disable_tqdm=True,
                  data_seed=11)
    common.update(kw)
    if kind == "sft":
        from trl import SFTConfig

        return SFTConfig(max_length=SEQ, packing=False, dataset_text_field="text", **common)
    return TrainingArguments(**common)


def make_trainer(kind: str, out: str, max_steps: int, callbacks: list[Any] | None = None,
                 compute_metrics: Any = None, **kw: Any) -> Any:
    """``compute_metrics`` given: the training set is the evaluation set too."""
    torch.set_num_threads(1)
    args = make_args(kind, out, max_steps, **kw)
    evals = make_dataset() if compute_metrics is not None else None
    if kind == "sft":
        from trl import SFTTrainer

        return SFTTrainer(model=make_model(), args=args, train_dataset=make_dataset(), eval_dataset=evals,
                          compute_metrics=compute_metrics, processing_class=make_tokenizer(), callbacks=callbacks)
    return Trainer(model=make_model(), args=args, train_dataset=make_dataset(), eval_dataset=evals,
                   compute_metrics=compute_metrics, callbacks=callbacks)


def params(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _KillAt(TrainerCallback):
    """Kills the process right after the save of ``step`` was staged (see the module doc)."""

    def __init__(self, step: int, release: str) -> None:
        self.step, self.release = step, release
        self.zs: ZerostallCheckpointing | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step and os.path.exists(self.release):
            assert self.zs is not None and self.zs.checkpointer is not None
            self.zs.checkpointer.wait()  # the earlier saves commit; this step's is then held before its commit
            os.remove(self.release)

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            assert self.zs is not None and self.zs.last_save is not None
            self.zs.last_save.wait_staged()  # in the writer's hands: it commits even after the kill
            print(json.dumps({"killed_at": state.global_step}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


class _HoldUntilJITNotice(TrainerCallback):
    """At the end of ``step``: creates ``ready``, then waits until HF's JIT checkpoint is requested
    (its timer runs out 3 s after the SIGTERM the test sends). It reads HF's JIT callback only to
    know when; what HF then does, it does on its own."""

    def __init__(self, step: int, ready: str) -> None:
        self.step, self.ready = step, ready
        self.jit: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step != self.step:
            return
        open(self.ready, "w").close()
        deadline = time.monotonic() + 120  # a bound on a hang, not a verdict on speed
        while not self.jit.jit_manager.is_checkpoint_requested:
            if time.monotonic() > deadline:
                print(json.dumps({"error": "no JIT checkpoint requested"}), flush=True)
                os._exit(3)
            time.sleep(0.01)


def _jit(out: str, max_steps: int, notice_step: int, save_steps: int, ready: str, memory: bool) -> None:
    hold = _HoldUntilJITNotice(notice_step, ready)
    trainer = make_trainer("trainer", out, max_steps, callbacks=[hold], enable_jit_checkpoint=True,
                           save_steps=save_steps)
    hold.jit = next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "JITCheckpointCallback")
    zs = ZerostallCheckpointing(trainer, memory_tier=MEMORY if memory else None)
    trainer.train()
    committed = sorted(n for n in os.listdir(zs.directory) if os.path.isfile(os.path.join(zs.directory, n, "manifest.json")))
    print(json.dumps({"global_step": trainer.state.global_step, "committed": committed}), flush=True)


def _ddp(out: str) -> None:
    import hashlib

    rank = int(os.environ["RANK"])

    def digest(model: Any) -> str:
        h = hashlib.sha256()
        for k, v in sorted(model.state_dict().items()):
            h.update(k.encode() + v.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    ref = make_trainer("trainer", os.path.join(out, "ref"), 6, ddp_backend="gloo")
    ZerostallCheckpointing(ref)
    ref.train()
    first = make_trainer("trainer", os.path.join(out, "run"), 6, callbacks=[_StopAt(4)], ddp_backend="gloo")
    ZerostallCheckpointing(first)
    first.train()
    resumed = make_trainer("trainer", os.path.join(out, "run"), 6, ddp_backend="gloo")
    ZerostallCheckpointing(resumed)
    resumed.train(resume_from_checkpoint=True)
    print(json.dumps({"rank": rank, "ref": digest(ref.model), "resumed": digest(resumed.model),
                      "steps": sorted(os.listdir(os.path.join(out, "run", "zerostall"))),
                      "global_step": resumed.state.global_step}), flush=True)


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if kind == "ddp":
        _ddp(out)
        return
    if kind == "jit":
        _jit(out, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7:] == ["memory"])
        return
    max_steps, kill_step, release = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    killer = _KillAt(kill_step, release)
    trainer = make_trainer(kind, out, max_steps, callbacks=[killer])
    killer.zs = ZerostallCheckpointing(trainer, memory_tier=MEMORY if sys.argv[6:] == ["memory"] else None)
    trainer.train()
    print(json.dumps({"error": "finished without being killed"}), flush=True)


if __name__ == "__main__":
    main()
