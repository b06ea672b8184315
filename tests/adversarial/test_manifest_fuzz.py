"""Hypothesis fuzzing of manifest bytes and values: a load either succeeds or raises ZerostallError.

Default example counts keep this under a few seconds; ``ZEROSTALL_STRESS=1`` runs many more.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerostall
from zerostall import ZerostallError
from zerostall.format.manifest import parse_manifest

from .conftest import Ckpt

STRESS = bool(os.environ.get("ZEROSTALL_STRESS"))
pytestmark = pytest.mark.stress  # `make stress` (-k "crash or stress") runs these with many more examples
FAST = settings(max_examples=2000 if STRESS else 150, deadline=None, derandomize=not STRESS,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every address inside a JSON document."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


def _load_or_zerostall_error(c: Ckpt) -> None:
    try:
        zerostall.load_pytree(c.path)
    except ZerostallError as exc:
        assert str(exc)  # a message, never empty
    except Exception as exc:  # pragma: no cover - the failure being hunted
        pytest.fail(f"bare {type(exc).__name__} escaped: {exc!r}")


@FAST
@given(data=st.data())
def test_value_replaced_anywhere(ckpt: Ckpt, data: st.DataObject, opened_paths: list[str]) -> None:
    """Replace any one value (or key's value) of a real manifest with arbitrary JSON, then load;
    nothing outside the checkpoint is opened."""
    if not hasattr(ckpt, "_original"):
        ckpt._original = ckpt.manifest_path.read_bytes()  # type: ignore[attr-defined]
    doc = json.loads(ckpt._original)  # type: ignore[attr-defined]
    paths = _paths(doc)
    where = data.draw(st.sampled_from(paths), label="path")
    value = data.draw(json_values, label="value")
    ckpt.write_manifest(json.dumps(_replace(doc, where, value)).encode())
    _load_or_zerostall_error(ckpt)
    root = os.path.realpath(ckpt.path)
    assert all(p == root or p.startswith(root + os.sep) for p in opened_paths), opened_paths


@FAST
@given(data=st.data())
def test_bytes_mutated(ckpt: Ckpt, data: st.DataObject) -> None:
    """Flip, drop or insert bytes of a real manifest, then load."""
    if not hasattr(ckpt, "_original"):
        ckpt._original = ckpt.manifest_path.read_bytes()  # type: ignore[attr-defined]
    raw = bytearray(ckpt._original)  # type: ignore[attr-defined]
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        i = data.draw(st.integers(0, len(raw) - 1), label="at")
        op = data.draw(st.sampled_from(["flip", "drop", "insert", "digit"]), label="op")
        if op == "flip":
            raw[i] ^= data.draw(st.integers(1, 255), label="mask")
        elif op == "drop":
            del raw[i:i + data.draw(st.integers(1, 16), label="n")]
        elif op == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
        else:  # digits are where sizes and offsets live
            raw[i:i] = data.draw(st.sampled_from([b"9", b"99999999999", b"-", b"0"]), label="digits")
        if not raw:
            break
    ckpt.write_manifest(bytes(raw))
    _load_or_zerostall_error(ckpt)


@settings(max_examples=3000 if STRESS else 300, deadline=None, derandomize=not STRESS)
@given(doc=st.dictionaries(st.sampled_from(
    ["format", "format_version", "files", "leaves", "items", "metadata", "created_unix", "library_version"]),
    json_values, max_size=8))
def test_arbitrary_documents(doc: dict[str, Any]) -> None:
    """Documents built from the manifest's own field names and random values."""
    doc.setdefault("format", "zerostall")
    try:
        parse_manifest(json.dumps(doc).encode(), path="fuzz")
    except ZerostallError:
        pass


@settings(max_examples=2000 if STRESS else 200, deadline=None, derandomize=not STRESS)
@given(raw=st.binary(max_size=512))
def test_arbitrary_bytes(raw: bytes) -> None:
    try:
        parse_manifest(raw, path="fuzz")
    except ZerostallError:
        pass


def test_fuzz_fixture_checkpoint_is_valid(ckpt: Ckpt, tmp_path: Path) -> None:
    assert zerostall.load_pytree(ckpt.path)["n"] == 5
