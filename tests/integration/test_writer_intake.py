"""The hand-off to a busy writer never blocks the training thread on the socket.

A save's ``SaveJob`` message grows with its leaves (~170 bytes each): for a few thousand leaves
it is larger than the unix socket's buffer, so a writer that read nothing while running a job
left the trainer stuck in ``send`` until the previous save had committed. The writer here is a
real process held at the start of its first job (fault hook ``begin: wait:<file>``).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from zerostall import Checkpointer, MemoryTier, Response, SaveOptions
from zerostall.persist.faults import ENV as FAULTS_ENV
from zerostall.persist.faults import MARK_ENV

#: enough leaves that one SaveJob (~510 KB) overflows the socket buffer (~208 KB) several times
LEAVES = 3000


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i:04d}": torch.randn(4, generator=g) for i in range(LEAVES)} | {"step": seed}


def assert_bit_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("tier", ["storage", "memory"])
def test_save_returns_while_the_writer_is_busy(tmp_path: Path, monkeypatch: Any, tier: str) -> None:
    # storage: a second slot from max_in_flight=2; memory: the keeper's extra slot (its writer
    # process is the keeper, which persists every step here)
    go, marks = tmp_path / "go", tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"begin": f"wait:{go}"}))
    monkeypatch.setenv(MARK_ENV, str(marks))
    d = tmp_path / "run"
    # the writer reads the environment at its start, here
    ck = (Checkpointer(d, save_options=SaveOptions(max_in_flight=2)) if tier == "storage"
          else Checkpointer(d, memory_tier=MemoryTier(persist_interval_steps=1, linger_s=0)))
    try:
        first = ck.save_pytree_async(1, state(1))
        # Wait (untimed) until the writer is inside job 1: from here on it reads only if it can
        # read while a job runs.
        while not any(marks.iterdir()) and not first.done():  # done: it failed, reported below
            threading.Event().wait(0.01)
        assert not first.done(), first.exception()
        second: list[Response] = []
        t = threading.Thread(target=lambda: second.append(ck.save_pytree_async(2, state(2))), daemon=True)
        t.start()
        t.join(timeout=20)  # generous: the writer stays held until `go` exists, whatever it takes
        returned, held = not t.is_alive(), not first.done()
        go.touch()  # release the writer whatever happened, so a failure does not hang close()
        t.join(timeout=120)
        assert returned, "save_pytree_async blocked while the writer was busy with the previous save"
        assert held  # job 1 was still held when the call returned: it did not wait for it
        first.result(timeout=120)
        second[0].result(timeout=120)
        assert ck.steps() == [1, 2]
        assert_bit_exact(ck.load_pytree(1), state(1))
        assert_bit_exact(ck.load_pytree(2), state(2))
    finally:
        go.touch()
        ck.close()
