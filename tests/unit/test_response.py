"""``Response`` (what ``save_pytree_async`` returns): ``wait_staged`` refuses a timeout that is not a
finite number >= 0 instead of waiting on it, and ``result``'s timeout names the checkpoint it waited on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerostall
from zerostall import SaveOptions, WriterKind
from zerostall.errors import InvalidArgumentError


@pytest.fixture
def response(tmp_path: Path) -> zerostall.Response:
    return zerostall.save_pytree_async(tmp_path / "a", {"w": torch.ones(3)},
                                       options=SaveOptions(writer=WriterKind.THREAD))


@pytest.mark.parametrize("timeout", ["5", True, float("nan"), float("inf")])
def test_wait_staged_refuses_a_timeout_that_is_not_a_finite_number(response: zerostall.Response,
                                                                    timeout: object) -> None:
    with pytest.raises(InvalidArgumentError, match="timeout"):
        response.wait_staged(timeout=timeout)  # type: ignore[arg-type]
    response.result()


def test_wait_staged_refuses_a_negative_timeout(response: zerostall.Response) -> None:
    # A negative timeout is a caller's mistake, not a staging that took too long: a TimeoutError
    # would claim the copy had not finished while it goes on.
    with pytest.raises(InvalidArgumentError, match="timeout must be >= 0"):
        response.wait_staged(timeout=-1)
    response.wait_staged(timeout=60.0)  # a valid one still works
    response.result()


def test_result_timeout_names_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # concurrent.futures' TimeoutError has no message; this one says which save is still going on.
    go = tmp_path / "go"
    monkeypatch.setenv("ZEROSTALL_FAULTS", json.dumps({"commit": f"wait:{go}"}))
    r = zerostall.save_pytree_async(tmp_path / "held", {"w": torch.ones(3)},
                                    options=SaveOptions(writer=WriterKind.THREAD))
    with pytest.raises(TimeoutError, match=r"held.*not committed within 0\.1 s \(the save goes on\)"):
        r.result(timeout=0.1)
    go.touch()
    assert r.result().nbytes > 0
