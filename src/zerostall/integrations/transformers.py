"""Hugging Face ``Trainer`` integration: checkpoints through zerostall instead of HF's synchronous save.

Two lines in a stock training script (``trl``'s ``SFTTrainer`` and other ``Trainer`` subclasses too)::

    from zerostall.integrations.transformers import ZerostallCheckpointing
    ZerostallCheckpointing(trainer)              # then trainer.train(resume_from_checkpoint=True) as usual

HF decides when to save (``save_strategy``, ``save_steps``, evaluation and ``SaveStrategy.BEST``,
``enable_jit_checkpoint``'s SIGTERM save) exactly as before; each save is a
``Checkpointer.save_checkpointables_async`` of step ``global_step`` in ``{output_dir}/zerostall``
(``step_00000010/`` ...) and HF writes no ``checkpoint-N`` folder. ``trainer.train(resume_from_checkpoint=True)``
resumes from the newest committed zerostall step (from memory when a :class:`~zerostall.MemoryTier`
holds it) and otherwise does what HF does (an HF ``checkpoint-N`` folder, or HF's error when there is none).

How it plugs into ``Trainer``: :data:`HF_METHODS` is the table of the ``Trainer`` methods it
depends on. On the trainer object it replaces four private ones (``_save_checkpoint``,
``_load_from_checkpoint``, ``_load_rng_state``, ``_load_best_model``) and wraps two public ones
(``train``, and ``create_scheduler``, which HF documents as a method to override); it leaves
``_load_optimizer_and_scheduler`` and ``_load_scaler`` to HF, whose own do nothing for a
zerostall resume. Each row says why no public extension point suffices, and the transformers
releases it was read and tested in (:data:`TESTED_TRANSFORMERS`). HF says of its private methods
that they "may change without notice", so :class:`ZerostallCheckpointing` refuses a transformers
release outside :data:`TESTED_TRANSFORMERS` (and, for a trl trainer, a trl release outside
:data:`TESTED_TRL`) unless ``allow_untested_transformers=True``, and refuses any release in which
a method of the table lacks the signature the table gives.

What one save holds (items of the zerostall checkpoint):

* ``model``: ``trainer.model``'s state dict (HF key names; DTensor shards under FSDP2);
* ``optimizer``, ``scheduler``: their state dicts (the parameters and optimizer state are copied
  in the background while the next forward and backward run; the next ``optimizer.step()``
  waits for that copy);
* ``scaler``: the ``GradScaler``'s state, where the accelerator has one;
* ``rng``: Python's, numpy's, torch's CPU and (where present) every CUDA device's generator, per rank;
* ``trainer_state``: ``TrainerState`` as HF's ``trainer_state.json`` text (global step, epoch,
  log history, best metric and step, callback states). The data position is HF's: on resume HF
  skips the ``global_step``'s batches of the current epoch (``ignore_data_skip``), as it does
  from its own checkpoints;
* ``hf_config``: the model's ``config.json`` text, so that ``zerostall export CKPT OUT --hf`` can
  write a ``save_pretrained`` directory.

``save_only_model=True`` saves only ``model``, ``trainer_state`` and ``hf_config``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import random
import shutil
import tempfile
import types
import warnings
from collections.abc import Callable
from typing import Any, cast

import numpy as np

import zerostall
from zerostall.errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    MissingDependencyError,
    ZerostallWarning,
)
from zerostall.format.layout import STEP_RE

#: the transformers releases (major.minor, any final patch release of them) that :data:`HF_METHODS`
#: was read in and the tests ran against
TESTED_TRANSFORMERS = ("5.24",)
#: the trl releases tested (every trl trainer overrides ``_save_checkpoint``, which this replaces)
TESTED_TRL = ("1.16",)

try:
    import torch
    import transformers
    from packaging.version import InvalidVersion, Version
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import SaveStrategy
except ImportError as exc:  # depends on the environment (tests/integration/test_transformers.py blocks it)
    if isinstance(exc, ModuleNotFoundError):
        raise MissingDependencyError(
            "zerostall.integrations.transformers needs the `transformers` package (and `accelerate`), which is not "
            "installed: pip install 'zerostall[transformers]'", name=(exc.name or "transformers").split(".")[0]) from exc
    # installed, but a name this integration uses is missing: a release older than it supports
    import importlib.metadata as _md

    try:
        _found = _md.version("transformers")
    except _md.PackageNotFoundError:
        _found = "unknown"
    raise MissingDependencyError(
        f"zerostall.integrations.transformers needs transformers {TESTED_TRANSFORMERS[-1]}.x, found {_found} ({exc}): "
        f"pip install 'transformers=={TESTED_TRANSFORMERS[-1]}.*'", name="transformers") from exc

__all__ = ["ZerostallCheckpointing", "HF_METHODS", "HFMethod", "TESTED_TRANSFORMERS", "TESTED_TRL"]

log = logging.getLogger("zerostall")

#: the subdirectory of ``args.output_dir`` that holds the zerostall checkpoints by default
SUBDIR = "zerostall"
_RESUME_PREFIX = "zerostall-hf-resume-"


@dataclasses.dataclass(frozen=True)
class HFMethod:
    """A ``transformers.Trainer`` method the integration depends on: one row of :data:`HF_METHODS`.

    ``replaced``: the integration installs its own on the trainer object (it calls the original
    for anything that is not a zerostall checkpoint); otherwise HF's own runs, and the integration
    relies on what it does. ``signature``: ``Trainer``'s parameters, as :func:`inspect.signature`
    renders them without annotations; HF's calls and the integration's assume them. ``callers``:
    the functions of ``transformers`` (module, qualified name) that call it by this name.
    ``tested``: the transformers releases it was read and tested in.
    """

    name: str
    public: bool
    replaced: bool
    signature: str
    callers: tuple[tuple[str, str], ...]
    why: str
    tested: tuple[str, ...] = TESTED_TRANSFORMERS


_T = "transformers.trainer"

#: Every ``Trainer`` method the integration replaces, wraps or relies on, and why no public
#: extension point (a ``TrainerCallback`` event, ``train()``'s arguments, a method HF documents as
#: one to override) does what it does.
HF_METHODS: tuple[HFMethod, ...] = (
    HFMethod(
        "train", public=True, replaced=True,
        signature="(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None)", callers=(),
        why="Wrapped (public). resume_from_checkpoint=True, or a step's path, must become the zerostall step before "
            "HF searches output_dir for checkpoint-N folders; the Checkpointer must close (raising a background "
            "save's failure) when train() returns or raises, and no callback runs when it raises."),
    HFMethod(
        "create_scheduler", public=True, replaced=True, signature="(self, num_training_steps, optimizer=None)",
        callers=((_T, "Trainer._prepare_for_training"),),
        why="Wrapped (public: documented to override). On a zerostall resume it loads the optimizer's, "
            "scheduler's and GradScaler's state right after HF built the scheduler, where HF's own loaders "
            "run and before any callback's on_train_begin (a callback restoring them there would come after "
            "the callbacks listed before it)."),
    HFMethod(
        "_save_checkpoint", public=False, replaced=True, signature="(self, model, trial)",
        callers=((_T, "Trainer._maybe_log_save_evaluate"),
                 ("transformers.trainer_jit_checkpoint", "CheckpointManager.execute_jit_checkpoint")),
        why="HF saves inside _maybe_log_save_evaluate, after it logged and evaluated the step (SaveStrategy.BEST "
            "decides there, after every callback, whether to save); on_save runs only after HF's own synchronous "
            "save. A callback taking the save over at on_step_end (control.should_save = False) would save before "
            "the step's loss is in the log history and before its evaluation chose the best step, and never for "
            "SaveStrategy.BEST. enable_jit_checkpoint calls it directly."),
    HFMethod(
        "_load_from_checkpoint", public=False, replaced=True, signature="(self, resume_from_checkpoint, model=None)",
        callers=((_T, "Trainer.train"), (_T, "Trainer._prepare_for_training")),
        why="HF reads the weights only from its own files in the resume folder (model.safetensors, shards, "
            "adapters) and raises ValueError without them; it runs in train() before any callback. The resume "
            "folder holds only trainer_state.json, which HF reads by path."),
    HFMethod(
        "_load_rng_state", public=False, replaced=True, signature="(self, checkpoint)",
        callers=((_T, "Trainer._run_epoch"),),
        why="HF restores the RNG states where its data skipping puts them: at the resumed epoch's start, or after "
            "the first batch past the skipped ones is drawn. Those are two hooks (on_epoch_begin, the first "
            "on_step_begin) and which one applies is decided from locals of the training loop."),
    HFMethod(
        "_load_best_model", public=False, replaced=True, signature="(self)",
        callers=((_T, "Trainer._finalize_training"),),
        why="HF loads the best model from its own files in _finalize_training, before on_train_end; a callback "
            "loading it at on_train_end would come after the callbacks before it (the report_to integrations, "
            "which log or upload the model there) and after HF's loader warned that the step has no weights file."),
    HFMethod(
        "_load_optimizer_and_scheduler", public=False, replaced=False, signature="(self, checkpoint)",
        callers=((_T, "Trainer._prepare_for_training"),),
        why="Left to HF: without optimizer.pt and scheduler.pt in the resume folder it loads nothing "
            "(create_scheduler loads that state instead)."),
    HFMethod(
        "_load_scaler", public=False, replaced=False, signature="(self, checkpoint)",
        callers=((_T, "Trainer._prepare_for_training"),),
        why="Left to HF: without scaler.pt in the resume folder it loads nothing (create_scheduler loads it)."),
)


def signature_of(fn: Callable[..., Any]) -> str:
    """``fn``'s parameters as :data:`HF_METHODS` writes them (no annotations)."""
    sig = inspect.signature(fn)
    return str(sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                           return_annotation=inspect.Signature.empty))


def _tested(found: str, tested: tuple[str, ...]) -> bool:
    try:
        v = Version(found)
    except InvalidVersion:  # "unknown" or a malformed version string: untested
        return False
    return not v.is_prerelease and f"{v.major}.{v.minor}" in tested


def _releases(package: str, tested: tuple[str, ...]) -> str:
    return " or ".join(f"{package} {t}.x" for t in tested)


def check_versions(trainer: Any = None, *, allow_untested: bool = False) -> None:
    """Refuse a transformers (or, for a trl trainer, trl) release outside the tested ones, unless
    ``allow_untested`` (then warn); refuse, either way, one whose ``Trainer`` lacks a method of
    :data:`HF_METHODS` with its signature.

    Raises:
        MissingDependencyError: naming the package and the version found.
    """
    found = getattr(transformers, "__version__", "unknown")
    untested: list[tuple[str, str]] = []
    if not _tested(found, TESTED_TRANSFORMERS):
        untested.append(("transformers", f"is tested with {_releases('transformers', TESTED_TRANSFORMERS)}; found "
                                         f"transformers {found}. It replaces private Trainer methods (HF_METHODS), "
                                         f"which a release may rename or change: pip install "
                                         f"'transformers=={TESTED_TRANSFORMERS[-1]}.*'"))
    if trainer is not None and type(trainer).__module__.split(".")[0] == "trl":
        import trl  # a trl trainer exists, so trl is importable

        found_trl = getattr(trl, "__version__", "unknown")
        if not _tested(found_trl, TESTED_TRL):
            untested.append(("trl", f"is tested with {_releases('trl', TESTED_TRL)}; found trl {found_trl}. trl's "
                                    f"trainers override Trainer methods this integration replaces: pip install "
                                    f"'trl=={TESTED_TRL[-1]}.*'"))
    for name, what in untested:
        message = f"zerostall.integrations.transformers {what}"
        if not allow_untested:
            raise MissingDependencyError(
                f"{message}, or pass ZerostallCheckpointing(trainer, allow_untested_transformers=True) to run it "
                "anyway", name=name)
        warnings.warn(f"{message} (running anyway: allow_untested_transformers=True)", ZerostallWarning,
                      stacklevel=3)
    for m in HF_METHODS:
        fn = getattr(Trainer, m.name, None)
        have = signature_of(fn) if callable(fn) else None
        if have != m.signature:
            raise MissingDependencyError(
                f"transformers {found}: Trainer.{m.name} " + ("does not exist" if have is None else f"is {m.name}{have}")
                + f", where zerostall.integrations.transformers relies on {m.name}{m.signature} (read in "
                f"{_releases('transformers', m.tested)}): pip install 'transformers=={m.tested[-1]}.*'",
                name="transformers")


@dataclasses.dataclass
class _Resume:
    """A resume in progress: the step, and the folder HF is given as ``resume_from_checkpoint``
    (it holds only ``trainer_state.json``, which HF reads by path; everything else comes from
    the zerostall checkpoint)."""

    step: int
    folder: str
    items: frozenset[str]
    #: the optimizer's, scheduler's and scaler's state are loaded (``create_scheduler``)
    restored: bool = False


class ZerostallCheckpointing:
    """Make ``trainer`` checkpoint through zerostall (see the module documentation).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass: ``trl.SFTTrainer`` ...), before ``train()``.
        directory: where the checkpoints go (a path or storage URL); default ``{output_dir}/zerostall``.
        memory_tier: a :class:`~zerostall.MemoryTier`: every save goes to this host's memory, some
            to storage; a restarted trainer resumes from memory.
        save_options / load_options: see :class:`~zerostall.SaveOptions` / :class:`~zerostall.LoadOptions`.
        prepare: allocate the staging buffers after the first optimizer step (the optimizer's
            state then exists), so that the first save only copies, like the later ones.
        allow_untested_transformers: run with a transformers (or trl) release outside
            :data:`TESTED_TRANSFORMERS` (:data:`TESTED_TRL`), with a
            :class:`~zerostall.errors.ZerostallWarning` instead of the refusal. A release whose
            ``Trainer`` lacks a method of :data:`HF_METHODS` with its signature is refused all the same.

    ``save_total_limit`` keeps that many newest steps (zerostall's ``keep_last``); with
    ``load_best_model_at_end`` the best step is kept too, as HF keeps its best checkpoint. The
    :class:`~zerostall.Checkpointer` opens when ``train()`` starts and closes when it ends
    (every save committed or its failure raised; with a memory tier, the newest step persisted).

    Raises:
        MissingDependencyError: a transformers (or trl) release outside the tested ones, naming
            the version found; or one whose ``Trainer`` lacks a method of :data:`HF_METHODS`.
        InvalidArgumentError: ``trainer`` is not a ``transformers.Trainer``, already has one, or is
            already training (wrap it before ``train()``: the running ``train()`` would never close
            the checkpointer, nor raise a background save's failure).
    """

    def __init__(self, trainer: Any, *, directory: str | os.PathLike[str] | None = None,
                 memory_tier: zerostall.MemoryTier | None = None, save_options: zerostall.SaveOptions | None = None,
                 load_options: zerostall.LoadOptions | None = None, prepare: bool = True,
                 allow_untested_transformers: bool = False) -> None:
        if not isinstance(trainer, Trainer):
            raise InvalidArgumentError(f"expected a transformers.Trainer, got {type(trainer).__name__}",
                                       argument="trainer")
        check_versions(trainer, allow_untested=allow_untested_transformers)
        if isinstance(getattr(trainer, "_zerostall", None), ZerostallCheckpointing):
            raise InvalidArgumentError("this trainer already checkpoints through zerostall", argument="trainer")
        if getattr(trainer, "is_in_train", False):
            raise InvalidArgumentError("this trainer is already training: call ZerostallCheckpointing(trainer) before "
                                       "trainer.train()", argument="trainer")
        self.trainer: Any = cast(Any, trainer)  # typed loosely: Trainer subclasses differ, and HF annotates few attributes
        self.directory = os.fspath(directory) if directory is not None else os.path.join(
            self.trainer.args.output_dir, SUBDIR)
        self.memory_tier = memory_tier
        self.save_options = save_options
        self.load_options = load_options
        self.checkpointer: zerostall.Checkpointer | None = None
        #: the response of the newest save (``wait_staged()``, ``result()``), None before the first
        self.last_save: zerostall.Response | None = None
        self._resume: _Resume | None = None
        # The step the trainer's state is at since it was last saved or loaded: HF asking to save
        # it again (a JIT save right after a regular one) gets that checkpoint.
        self._last_step: int | None = None
        # Steps that exist or are being saved (with the best-keeping retention, those found at open
        # too), minus the ones deleted: the candidates for retention and for the best step's path.
        self._known: set[int] = set()
        self._prepare = prepare
        self._prepared = False
        self._originals: dict[str, Callable[..., Any]] = {}
        for m in HF_METHODS:
            if m.replaced:
                self._originals[m.name] = getattr(self.trainer, m.name)
                setattr(self.trainer, m.name, types.MethodType(getattr(type(self), "_hf_" + m.name.lstrip("_")), self))
        self.trainer._zerostall = self
        self.trainer.add_callback(_Hooks(self))

    # -- the Checkpointer ----------------------------------------------------------------------

    def _keep_best(self) -> bool:
        args = self.trainer.args
        return bool(args.load_best_model_at_end) and args.save_total_limit is not None

    def open(self) -> zerostall.Checkpointer:
        """The :class:`~zerostall.Checkpointer` (opened here if it is not; collective under torch.distributed)."""
        if self.checkpointer is None:
            limit = self.trainer.args.save_total_limit
            self.checkpointer = zerostall.Checkpointer(
                self.directory, keep_last=None if self._keep_best() else limit, save_options=self.save_options,
                load_options=self.load_options, memory_tier=self.memory_tier)
            self.directory = self.checkpointer.directory
            self._known = set(self.checkpointer.steps()) if self._keep_best() else set()
            self._last_step = None
            self._prepared = False
        return self.checkpointer

    def close(self) -> None:
        """Wait for every save, then close the Checkpointer (raises a save's background failure)."""
        ck, self.checkpointer = self.checkpointer, None
        if ck is not None:
            ck.close()

    def latest_step(self) -> int | None:
        """The newest committed step (collective under torch.distributed)."""
        return self.open().latest_step()

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}")

    # -- train ---------------------------------------------------------------------------------

    def _hf_train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        train = self._originals["train"]
        ck = self.open()
        try:
            step = self._resolve(resume_from_checkpoint)
            if step is None:
                out = train(resume_from_checkpoint, *args, **kwargs)
            else:
                out = self._train_from(ck, step, train, *args, **kwargs)
        except BaseException:  # keep the exception being raised; a background failure is logged by the Checkpointer
            self.checkpointer = None
            ck.__exit__(RuntimeError, None)
            raise
        try:
            if self._keep_best() and self.trainer.args.process_index == 0:
                ck.wait()  # the last saves' commits: then the steps they made surplus go
                self._rotate()
        finally:
            self.close()  # raises the failure of a save that failed in the background
        return out

    def _resolve(self, resume: str | bool | None) -> int | None:
        """The zerostall step ``resume`` names, or None for HF's own handling."""
        if resume is True:
            return self.open().latest_step()
        if isinstance(resume, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(resume))
            m = STEP_RE.match(os.path.basename(path))
            if m is not None and os.path.dirname(path) == os.path.abspath(self.directory):
                return int(m.group(1))
            if m is not None:  # a zerostall step of another directory: HF's loader cannot read it
                raise InvalidArgumentError(
                    f"resume_from_checkpoint={os.fspath(resume)!r} is a zerostall step outside this trainer's "
                    f"checkpoint directory {self.directory!r}: pass ZerostallCheckpointing(trainer, "
                    f"directory={os.path.dirname(path)!r}) to resume from it", path=path, argument="resume_from_checkpoint")
        return None

    def _train_from(self, ck: zerostall.Checkpointer, step: int, train: Callable[..., Any], *args: Any,
                    **kwargs: Any) -> Any:
        meta = ck.metadata(step).get("transformers", {})
        items = frozenset(meta.get("items", ()))
        text = ck.load_checkpointables(step, {"trainer_state": None})["trainer_state"]
        folder = tempfile.mkdtemp(prefix=_RESUME_PREFIX)
        try:
            with open(os.path.join(folder, "trainer_state.json"), "w", encoding="utf-8") as f:
                f.write(text)
            self._resume = _Resume(step, folder, items)
            self._last_step = step
            log.info("zerostall: resuming %s from %s", type(self.trainer).__name__, self.step_path(step))
            return train(folder, *args, **kwargs)
        finally:
            self._resume = None
            shutil.rmtree(folder, ignore_errors=True)

    def _ours(self, checkpoint: Any) -> _Resume | None:
        r = self._resume
        return r if r is not None and checkpoint is not None and os.fspath(checkpoint) == r.folder else None

    # -- saving --------------------------------------------------------------------------------

    def _hf_save_checkpoint(self, model: Any, trial: Any) -> None:
        t = self.trainer
        if trial is not None or t.hp_search_backend is not None:  # HF names trial folders; keep its own save there
            self._originals["_save_checkpoint"](model, trial)
            return
        ck = self.open()
        args, state = t.args, t.state
        step = int(state.global_step)
        if step == self._last_step:
            # Nothing trained since that save (or the resume): HF asked again for the same step (a
            # JIT save noticed right after a regular one). That checkpoint is this state, taken at
            # HF's regular save point; zerostall never writes a step twice.
            log.info("zerostall: step %d is already saved (%s); not saving it again", step, self.step_path(step))
            return
        t.store_flos()
        best = state.best_global_step
        if (args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and best
                and (best == step or best in self._known)):
            state.best_model_checkpoint = self.step_path(best)
        for cb in [*t.callback_handler.callbacks, t.control]:  # as HF: the callbacks' state goes into TrainerState
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(state.stateful_callbacks.get(name), list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()
        items = self._items(full=not args.save_only_model)
        items["trainer_state"] = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
        meta = {"transformers": {"global_step": step, "epoch": state.epoch, "items": sorted(items),
                                 "transformers_version": transformers.__version__,
                                 "trainer": type(t).__name__}}
        self.last_save = ck.save_checkpointables_async(step, items, metadata=meta)
        self._last_step = step
        self._known.add(step)
        if self._keep_best() and args.process_index == 0:
            self._rotate()

    def _items(self, *, full: bool) -> dict[str, Any]:
        t = self.trainer
        items: dict[str, Any] = {"model": t.model}
        config = getattr(getattr(t.model, "config", None), "to_json_string", None)
        if callable(config):
            items["hf_config"] = config()
        if full:
            items["optimizer"] = t.optimizer
            if t.lr_scheduler is not None:
                items["scheduler"] = t.lr_scheduler
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                items["scaler"] = scaler
            items["rng"] = _rng_state()
        return items

    def _rotate(self) -> None:
        """``save_total_limit`` newest steps (in flight ones count), and the best one
        (``load_best_model_at_end``), survive; only committed steps are deleted (a step still in
        flight is deleted by a later call, at the latest the one after the end of ``train()``)."""
        assert self.checkpointer is not None
        limit = int(self.trainer.args.save_total_limit)
        best = self.trainer.state.best_global_step
        keep = set(sorted(self._known)[-limit:]) | ({best} if best else set())
        for s in sorted(self._known - keep):
            try:
                self.checkpointer.delete(s)
            except CheckpointNotFoundError:
                continue  # not committed (yet): in flight, failed, or deleted by another process of this run
            self._known.discard(s)

    def _prepare_now(self) -> None:
        if (not self._prepare or self._prepared or self.checkpointer is None
                or self.trainer.args.save_strategy == SaveStrategy.NO):
            return
        self._prepared = True
        items = self._items(full=not self.trainer.args.save_only_model)
        items["trainer_state"] = ""
        self.checkpointer.prepare(items)

    # -- loading -------------------------------------------------------------------------------

    def _hf_load_from_checkpoint(self, checkpoint: str, model: Any = None) -> None:
        r = self._ours(checkpoint)
        if r is None:
            self._originals["_load_from_checkpoint"](checkpoint, model)
            return
        target = model if model is not None else self.trainer.model
        self.open().load_checkpointables(r.step, {"model": target})

    def _hf_create_scheduler(self, *args: Any, **kwargs: Any) -> Any:
        scheduler = self._originals["create_scheduler"](*args, **kwargs)
        r = self._resume
        if r is not None:
            t = self.trainer
            want: dict[str, Any] = {}
            if "optimizer" in r.items:
                want["optimizer"] = t.optimizer
            if "scheduler" in r.items and t.lr_scheduler is not None:
                want["scheduler"] = t.lr_scheduler
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None and "scaler" in r.items:
                want["scaler"] = scaler
            if want:
                self.open().load_checkpointables(r.step, want)
            r.restored = True
        return scheduler

    def _check_restored(self) -> None:
        """At ``on_train_begin``: a resume from a zerostall step has its optimizer state by now."""
        r = self._resume
        if r is not None and not r.restored:
            raise MissingDependencyError(
                f"transformers {transformers.__version__} began training without calling Trainer.create_scheduler, "
                f"where zerostall.integrations.transformers loads the optimizer's, scheduler's and scaler's state "
                f"of {self.step_path(r.step)}: pip install 'transformers=={TESTED_TRANSFORMERS[-1]}.*'",
                name="transformers")

    def _hf_load_rng_state(self, checkpoint: str | None) -> None:
        r = self._ours(checkpoint)
        if r is None:
            self._originals["_load_rng_state"](checkpoint)
            return
        if "rng" not in r.items:
            log.info("zerostall: %s holds no RNG state (save_only_model); reproducibility is not guaranteed",
                     self.step_path(r.step))
            return
        _set_rng_state(self.open().load_checkpointables(r.step, {"rng": None})["rng"])

    def _hf_load_best_model(self) -> None:
        best = self.trainer.state.best_model_checkpoint
        m = STEP_RE.match(os.path.basename(best or ""))
        if best is None or m is None or os.path.dirname(os.path.abspath(best)) != os.path.abspath(self.directory):
            self._originals["_load_best_model"]()
            return
        ck = self.open()
        ck.wait()  # the best step may still be in flight
        log.info("zerostall: loading the best model from %s (score: %s)", best, self.trainer.state.best_metric)
        ck.load_checkpointables(int(m.group(1)), {"model": self.trainer.model})


class _Hooks(TrainerCallback):
    """The integration's callback: checks that a resume restored the optimizer state before
    training begins, and allocates the staging buffers once the optimizer has its state (after
    the first step)."""

    def __init__(self, owner: ZerostallCheckpointing) -> None:
        self.owner = owner

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.owner._check_restored()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.owner._prepare_now()


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": {"version": version, "state": np.asarray(internal, dtype=np.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": np.asarray(keys, dtype=np.uint32), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def _set_rng_state(s: dict[str, Any]) -> None:
    py = s["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in np.asarray(py["state"]).tolist()), py["gauss"]))
    n = s["numpy"]
    np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), int(n["pos"]), int(n["has_gauss"]),
                         float(n["cached_gaussian"])))
    torch.random.set_rng_state(torch.as_tensor(s["cpu"], dtype=torch.uint8))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(x, dtype=torch.uint8) for x in s["cuda"]])
