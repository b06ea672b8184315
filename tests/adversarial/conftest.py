"""Helpers for the hostile-input tests: a small valid checkpoint to corrupt, and a way to load it.

Every hostile input must end in a :class:`zerostall.ZerostallError` (or load cleanly), never in a
bare ``KeyError`` / ``TypeError`` / ``RecursionError``, never allocate what the manifest merely
claims, and never read outside the checkpoint directory.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zerostall
from zerostall import LoadOptions, SaveOptions, WriterKind

THREAD = SaveOptions(writer=WriterKind.THREAD)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stress: runs longer under ZEROSTALL_STRESS=1 (selected by make stress)")


def sample_tree() -> dict[str, Any]:
    return {
        "a": torch.arange(16, dtype=torch.float32),
        "b": np.arange(8, dtype=np.int64),
        "c": {"d": torch.ones(2, 3, dtype=torch.bfloat16)},
        "n": 5,
        "f": 1.5,
        "raw": b"hello",
        "t": (1, [2, None]),
    }


@pytest.fixture(scope="session")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One valid checkpoint, saved once per session; tests corrupt copies of it."""
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    zerostall.save_pytree(path, sample_tree(), options=THREAD)
    return path


class Ckpt:
    """A corruptible copy of the pristine checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest_path = path / "manifest.json"
        self.data_path = path / "data" / "rank-00000.safetensors"

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest_path.read_bytes())

    def write_manifest(self, doc: Any) -> None:
        raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        self.manifest_path.write_bytes(raw)

    def leaf(self, key: str) -> dict[str, Any]:
        return next(lf for lf in self.manifest()["leaves"] if lf["key"] == key)

    def load(self, **opts: Any) -> Any:
        return zerostall.load_pytree(self.path, options=LoadOptions(**opts) if opts else None)


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Ckpt:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return Ckpt(dst)


@pytest.fixture
def opened_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path the local storage backend opens during the test, resolved."""
    from zerostall.storage import local

    seen: list[str] = []
    real_os_open = os.open

    def spy_os_open(path: Any, *a: Any, **k: Any) -> int:
        # os.open is patched process-wide: record only zerostall's calls (not Hypothesis's, ...)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("zerostall") and isinstance(path, (str, bytes, os.PathLike)):
            seen.append(os.path.realpath(os.fsdecode(path)))
        return real_os_open(path, *a, **k)

    def spy_open(path: Any, *a: Any, **k: Any) -> Any:
        seen.append(os.path.realpath(os.fsdecode(path)))
        return open(path, *a, **k)

    monkeypatch.setattr(local.os, "open", spy_os_open)
    monkeypatch.setattr(local, "open", spy_open, raising=False)
    return seen
