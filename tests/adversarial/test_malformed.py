"""A corpus of malformed manifests and data files: each one fails with a specific ZerostallError.

Each case says what it breaks and which error it must raise. None may end in a bare builtin
exception, allocate what the manifest merely declares, read outside the checkpoint, or import
anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zerostall
from zerostall import CorruptCheckpointError, LoadOptions, ZerostallError
from zerostall.errors import ChecksumMismatchError, UnsupportedFormatError
from zerostall.format.manifest import parse_manifest

from .conftest import Ckpt

Doc = dict[str, Any]


def _set(path: str, value: Any) -> Callable[[Doc], Doc]:
    """A mutation setting ``doc[a][b]...`` (``path`` like ``leaves.0.shape``) to ``value``."""
    def mutate(doc: Doc) -> Doc:
        parts = path.split(".")
        node: Any = doc
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return doc
    return mutate


def _del(path: str) -> Callable[[Doc], Doc]:
    def mutate(doc: Doc) -> Doc:
        parts = path.split(".")
        node: Any = doc
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        del node[parts[-1]]
        return doc
    return mutate


def _nest(depth: int) -> Callable[[Doc], Doc]:
    def mutate(doc: Doc) -> Doc:
        node: Doc = {"type": "none"}
        for _ in range(depth):
            node = {"type": "dict", "keys": ["k"], "values": [node]}
        doc["items"]["deep"] = node
        return doc
    return mutate


def _overlap(doc: Doc) -> Doc:
    doc["leaves"][1]["offset"] = doc["leaves"][0]["offset"] + 8
    return doc


def _huge_shape(doc: Doc) -> Doc:
    # Self-consistent but absurd: one TiB declared in the manifest, a file of 645 bytes on disk.
    lf = doc["leaves"][0]
    lf.update(shape=[1 << 38], nbytes=1 << 40, offset=0)
    doc["files"][0]["size"] = 1 << 41
    for other in doc["leaves"][1:]:
        other["offset"] += 1 << 40
    return doc


B = CorruptCheckpointError
U = UnsupportedFormatError

#: (id, mutation of the parsed manifest or raw bytes, expected error, words in the message)
MANIFEST_CASES: list[tuple[str, Any, type[ZerostallError], str]] = [
    ("empty", b"", B, "not JSON"),
    ("truncated-json", None, B, "not JSON"),  # filled in by the test: first half of the real one
    ("not-utf8", b"\xff\xfe{\"format\": 1}", B, "not UTF-8"),
    ("latin1", '{"format": "zerostall", "format_version": 1, "x": "\xe9"}'.encode("latin-1"), B, "not UTF-8"),
    ("top-level-list", b"[]", B, "top level"),
    ("top-level-null", b"null", B, "top level"),
    ("nan", b'{"format":"zerostall","format_version":NaN}', B, "format_version"),
    ("deep-json", b"[" * 100_000 + b"]" * 100_000, B, "nested"),
    ("deep-json-objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, B, "nested"),
    ("huge-int-literal", b'{"format":"zerostall","format_version":' + b"9" * 10_000 + b"}", B, "not JSON"),
    ("wrong-format-name", _set("format", "orbax"), B, "not a zerostall manifest"),
    ("no-format-name", _del("format"), B, "not a zerostall manifest"),
    ("unknown-version", _set("format_version", 2), U, "format_version 2"),
    ("version-zero", _set("format_version", 0), U, "format_version 0"),
    ("version-string", _set("format_version", "1"), B, "format_version"),
    ("version-float", _set("format_version", 1.0), B, "format_version"),
    ("version-bool", _set("format_version", True), B, "format_version"),
    ("version-huge", _set("format_version", 10**300), U, "not supported"),
    ("files-missing", _del("files"), B, "'files'"),
    ("files-object", _set("files", {"path": "data"}), B, "'files'"),
    ("file-entry-string", _set("files.0", "data/rank-00000.safetensors"), B, "files[0]"),
    ("file-path-parent", _set("files.0.path", "../../../etc/passwd"), B, "plain relative path"),
    ("file-path-absolute", _set("files.0.path", "/etc/passwd"), B, "plain relative path"),
    ("file-path-inner-parent", _set("files.0.path", "data/../../outside"), B, "plain relative path"),
    ("file-path-dot", _set("files.0.path", "./data/rank-00000.safetensors"), B, "plain relative path"),
    ("file-path-backslash", _set("files.0.path", "data\\..\\..\\x"), B, "plain relative path"),
    ("file-path-nul", _set("files.0.path", "data/rank\x00.safetensors"), B, "plain relative path"),
    ("file-path-empty", _set("files.0.path", ""), B, "plain relative path"),
    ("file-path-trailing-slash", _set("files.0.path", "data/"), B, "plain relative path"),
    ("file-path-number", _set("files.0.path", 7), B, "files[0]"),
    ("file-size-negative", _set("files.0.size", -1), B, "files[0].size"),
    ("file-size-float", _set("files.0.size", 645.0), B, "files[0].size"),
    ("file-size-2**64", _set("files.0.size", 2**64), B, "files[0].size"),
    ("leaves-object", _set("leaves", {}), B, "'leaves'"),
    ("leaf-null", _set("leaves.0", None), B, "leaves[0]"),
    ("leaf-key-int", _set("leaves.0.key", 3), B, "key must be a string"),
    ("leaf-kind-pickle", _set("leaves.0.kind", "pickle"), U, "unknown leaf kind"),
    ("leaf-kind-list", _set("leaves.0.kind", ["torch"]), U, "unknown leaf kind"),
    ("leaf-kind-missing", _del("leaves.0.kind"), U, "unknown leaf kind"),
    ("dtype-object", _set("leaves.0.dtype", "object"), U, "unknown dtype"),
    ("dtype-numpy-name", _set("leaves.0.dtype", "float32"), U, "unknown dtype"),
    ("dtype-dict", _set("leaves.0.dtype", {"F32": 1}), U, "unknown dtype"),
    ("dtype-wrong-size", _set("leaves.0.dtype", "F64"), B, "does not match shape"),
    ("shape-string", _set("leaves.0.shape", "16"), B, "shape"),
    ("shape-negative", _set("leaves.0.shape", [-16]), B, "shape entries"),
    ("shape-float", _set("leaves.0.shape", [16.0]), B, "shape entries"),
    ("shape-too-many-dims", _set("leaves.0.shape", [1] * 65), B, "at most 64"),
    ("shape-overflows-int64", lambda d: _set("leaves.0.nbytes", 0)(_set("leaves.0.shape", [2**62, 2**62, 0])(d)),
     B, "too large"),
    ("shape-product-huge", _set("leaves.0.shape", [10**12, 10**12]), B, "does not match shape"),
    ("shape-dim-2**64", _set("leaves.0.shape", [2**64]), B, "shape entries"),
    ("nbytes-mismatch", _set("leaves.0.nbytes", 60), B, "does not match shape"),
    ("nbytes-missing", _del("leaves.0.nbytes"), B, "nbytes"),
    ("offset-negative", _set("leaves.0.offset", -8), B, "offset"),
    ("offset-past-end", _set("leaves.0.offset", 640), B, "lies outside"),
    ("offset-float", _set("leaves.0.offset", 448.0), B, "offset"),
    ("overlapping-ranges", _overlap, B, "overlap"),
    ("file-index-out-of-range", _set("leaves.0.file", 1), B, "file index"),
    ("file-index-negative", _set("leaves.0.file", -1), B, "file"),
    ("crc-string", _set("leaves.0.crc32c", "0xdeadbeef"), B, "crc32c"),
    ("crc-float", _set("leaves.0.crc32c", 1.5), B, "crc32c"),
    ("crc-negative", _set("leaves.0.crc32c", -1), B, "crc32c"),
    ("crc-2**32", _set("leaves.0.crc32c", 2**32), B, "crc32c"),
    ("crc-bool", _set("leaves.0.crc32c", True), B, "crc32c"),
    ("crc-null", _set("leaves.0.crc32c", None), B, "no checksum"),
    ("crc-wrong", _set("leaves.0.crc32c", 12345), ChecksumMismatchError, "pytree/a"),
    ("items-list", _set("items", []), B, "'items'"),
    ("item-node-string", _set("items.pytree", "dict"), B, "tree node"),
    ("node-type-unknown", _set("items.pytree.type", "pickle"), U, "unknown tree node type"),
    ("node-type-object", _set("items.pytree.type", {"a": 1}), U, "unknown tree node type"),
    ("node-type-class-path", _set("items.pytree.values.0", {"type": "torch.nn.Linear"}), U, "unknown tree node"),
    ("node-leaf-out-of-range", _set("items.pytree.values.0.leaf", 99), B, "leaf index"),
    ("node-leaf-negative", _set("items.pytree.values.0.leaf", -1), B, "leaf index"),
    ("node-leaf-string", _set("items.pytree.values.0.leaf", "0"), B, "leaf index"),
    ("node-leaf-shared", _set("items.pytree.values.5", {"type": "array", "leaf": 0}), B, "more than one tree node"),
    ("node-leaf-fan-out", _set("items.pytree.values.6", {"type": "list", "values": [{"type": "array", "leaf": 0}] * 1000}),
     B, "more than one tree node"),
    ("node-leaf-missing", _set("items.pytree.values.0", {"type": "array"}), B, "leaf index"),
    ("dict-keys-missing", _del("items.pytree.keys"), B, "keys"),
    ("dict-keys-short", _set("items.pytree.keys", ["a"]), B, "keys"),
    ("dict-key-float", _set("items.pytree.keys.0", 1.5), B, "keys"),
    ("dict-values-object", _set("items.pytree.values", {}), B, "values"),
    ("int-value-string", _set("items.pytree.values.3.value", "5"), B, "int node"),
    ("float-value-number", _set("items.pytree.values.4.value", 1.5), B, "float node"),
    ("float-value-not-hex", _set("items.pytree.values.4.value", "one point five"), B, "hex float"),
    ("namedtuple-bad-fields", _set("items.pytree.values.6", {
        "type": "namedtuple", "name": "os.system", "fields": ["__import__('os')"], "values": [{"type": "none"}]}),
        B, "identifier"),
    ("custom-no-handler-name", _set("items.pytree.values.6", {"type": "custom", "json": 1}), B, "handler"),
    ("custom-unregistered", _set("items.pytree.values.6", {"type": "custom", "handler": "os.system", "json": "id"}),
        U, "no handler named"),
    ("custom-module-path", _set("items.pytree.values.6", {
        "type": "custom", "handler": "zerostall_evil_module_for_tests:main", "json": 1}), U, "no handler named"),
    ("tree-nested-too-deep", _nest(250), B, "nested deeper"),
    ("metadata-list", _set("metadata", [1]), B, "'metadata'"),
    ("huge-shape-tiny-file", _huge_shape, B, "the manifest says"),
]


def _apply(c: Ckpt, mutation: Any, case: str) -> None:
    if case == "truncated-json":
        raw = c.manifest_path.read_bytes()
        c.write_manifest(raw[: len(raw) // 2])
    elif isinstance(mutation, bytes):
        c.write_manifest(mutation)
    else:
        c.write_manifest(mutation(c.manifest()))


@pytest.mark.parametrize(("case", "mutation", "error", "words"), MANIFEST_CASES, ids=[c[0] for c in MANIFEST_CASES])
def test_malformed_manifest(ckpt: Ckpt, case: str, mutation: Any, error: type[ZerostallError], words: str,
                            opened_paths: list[str]) -> None:
    _apply(ckpt, mutation, case)
    before = set(sys.modules)
    with pytest.raises(error) as info:
        ckpt.load()
    message = str(info.value)
    assert words in message, message
    assert str(ckpt.path) in message  # the error names the checkpoint
    assert len(message) < 1000
    assert set(sys.modules) - before == set()  # nothing was imported
    root = os.path.realpath(ckpt.path)
    assert all(p == root or p.startswith(root + os.sep) for p in opened_paths), opened_paths


def test_corpus_cases_load_when_unmutated(ckpt: Ckpt) -> None:
    """The corpus starts from a checkpoint that loads: each case fails because of its mutation."""
    out = ckpt.load()
    assert torch.equal(out["a"], torch.arange(16, dtype=torch.float32))
    assert out["raw"] == b"hello"


def test_tree_at_max_depth_loads(ckpt: Ckpt) -> None:
    """Nesting up to the limit is accepted and loads without a RecursionError."""
    from zerostall.format.manifest import MAX_DEPTH

    doc = ckpt.manifest()
    node: dict[str, Any] = {"type": "int", "value": 1}
    for _ in range(MAX_DEPTH - 1):
        node = {"type": "list", "values": [node]}
    doc["items"]["pytree"]["values"][6] = node
    ckpt.write_manifest(doc)
    out = ckpt.load()
    v = out["t"]
    for _ in range(MAX_DEPTH - 1):
        v = v[0]
    assert v == 1


def test_huge_declared_shape_allocates_nothing(ckpt: Ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leaf declaring a terabyte fails on the data file's real size before any buffer exists."""
    sizes: list[int] = []
    real_torch_empty, real_np_empty = torch.empty, np.empty

    def spy_torch(*shape: Any, **kw: Any) -> Any:
        t = real_torch_empty(*shape, **kw)
        sizes.append(t.numel() * t.element_size())
        return t

    def spy_np(shape: Any, *a: Any, **kw: Any) -> Any:
        arr = real_np_empty(shape, *a, **kw)
        sizes.append(arr.nbytes)
        return arr

    monkeypatch.setattr(torch, "empty", spy_torch)
    monkeypatch.setattr(np, "empty", spy_np)
    doc = _huge_shape(ckpt.manifest())
    ckpt.write_manifest(doc)
    with pytest.raises(CorruptCheckpointError, match="the manifest says"):
        ckpt.load()
    assert all(s < 1 << 20 for s in sizes), sizes


def test_manifest_larger_than_limit(ckpt: Ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    import zerostall.format.manifest as manifest

    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(CorruptCheckpointError, match="allowed"):
        ckpt.load()


def test_same_size_dtype_swap_is_not_a_checksum_error(ckpt: Ckpt) -> None:
    """A checksum covers bytes, not their meaning: F32 relabelled I32 loads (``verify`` catches it
    by comparing the data file's own header); it never crashes."""
    doc = ckpt.manifest()
    doc["leaves"][0]["dtype"] = "I32"
    ckpt.write_manifest(doc)
    out = ckpt.load()
    assert out["a"].dtype == torch.int32


def test_parse_manifest_never_evaluates(tmp_path: Path) -> None:
    """Strings that look like code or class paths stay strings."""
    doc = {"format": "zerostall", "format_version": 1, "files": [], "leaves": [], "metadata": {
        "x": "__import__('os').system('touch pwned')"}, "items": {"p": {"type": "str", "value": "os.system"}}}
    m = parse_manifest(json.dumps(doc).encode(), path="x")
    assert m.items["p"]["value"] == "os.system"
    assert not (tmp_path / "pwned").exists()


# -- the data files and the directory ------------------------------------------------------


def test_data_file_missing(ckpt: Ckpt) -> None:
    ckpt.data_path.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        ckpt.load()


def test_data_file_truncated(ckpt: Ckpt) -> None:
    raw = ckpt.data_path.read_bytes()
    ckpt.data_path.write_bytes(raw[:500])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ckpt.load()


def test_data_file_extended(ckpt: Ckpt) -> None:
    with open(ckpt.data_path, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(CorruptCheckpointError, match="the manifest says"):
        ckpt.load()


def test_data_file_emptied(ckpt: Ckpt) -> None:
    ckpt.data_path.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError):
        ckpt.load()


@pytest.mark.parametrize("key", ["pytree/a", "pytree/b", "pytree/c/d", "pytree/raw"])
def test_flipped_byte_names_the_key(ckpt: Ckpt, key: str) -> None:
    leaf = ckpt.leaf(key)
    raw = bytearray(ckpt.data_path.read_bytes())
    raw[leaf["offset"] + leaf["nbytes"] - 1] ^= 0x01
    ckpt.data_path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError) as info:
        ckpt.load()
    assert info.value.key == key
    assert key in str(info.value)
    ckpt.load(verify=False)  # verify=False skips the check and loads the flipped bytes


def test_verify_false_returns_the_flipped_bytes(ckpt: Ckpt) -> None:
    leaf = ckpt.leaf("pytree/raw")
    raw = bytearray(ckpt.data_path.read_bytes())
    raw[leaf["offset"]] = ord("J")
    ckpt.data_path.write_bytes(bytes(raw))
    assert ckpt.load(verify=False)["raw"] == b"Jello"


def test_corruption_outside_the_requested_keys_is_not_read(ckpt: Ckpt) -> None:
    leaf = ckpt.leaf("pytree/a")
    raw = bytearray(ckpt.data_path.read_bytes())
    raw[leaf["offset"]] ^= 0xFF
    ckpt.data_path.write_bytes(bytes(raw))
    out = zerostall.load_pytree(ckpt.path, {"b": np.zeros(8, dtype=np.int64)})
    assert out["b"].tolist() == list(range(8))


def test_data_file_symlink_outside_is_refused(ckpt: Ckpt, tmp_path: Path, opened_paths: list[str]) -> None:
    """Even a byte-identical copy outside the checkpoint is refused: nothing outside is read."""
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(ckpt.data_path.read_bytes())
    ckpt.data_path.unlink()
    ckpt.data_path.symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        ckpt.load()
    assert str(outside) not in opened_paths


def test_data_file_symlink_inside_is_refused(ckpt: Ckpt) -> None:
    inner = ckpt.path / "data" / "copy.safetensors"
    os.rename(ckpt.data_path, inner)
    ckpt.data_path.symlink_to(inner.name)
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        ckpt.load()


def test_data_dir_symlink_outside_is_refused(ckpt: Ckpt, tmp_path: Path, opened_paths: list[str]) -> None:
    outside = tmp_path / "elsewhere"
    os.rename(ckpt.path / "data", outside)
    (ckpt.path / "data").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint"):
        ckpt.load()
    assert not any(p.startswith(str(outside)) for p in opened_paths)


def test_manifest_symlink_outside_is_refused(ckpt: Ckpt, tmp_path: Path, opened_paths: list[str]) -> None:
    outside = tmp_path / "manifest-elsewhere.json"
    outside.write_bytes(ckpt.manifest_path.read_bytes())
    ckpt.manifest_path.unlink()
    ckpt.manifest_path.symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        ckpt.load()
    assert str(outside) not in opened_paths


def test_checkpoint_reached_through_a_symlink_loads(ckpt: Ckpt, tmp_path: Path) -> None:
    """The checkpoint directory itself may be a link (``latest -> step_...``)."""
    link = tmp_path / "latest"
    link.symlink_to(ckpt.path, target_is_directory=True)
    assert zerostall.load_pytree(link)["n"] == 5


def test_data_file_is_a_directory(ckpt: Ckpt) -> None:
    ckpt.data_path.unlink()
    ckpt.data_path.mkdir()
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        ckpt.load()


def test_manifest_is_a_directory(ckpt: Ckpt) -> None:
    ckpt.manifest_path.unlink()
    ckpt.manifest_path.mkdir()
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        ckpt.load()


@pytest.mark.parametrize("which", ["manifest", "data"])
def test_fifo_is_refused_without_blocking(ckpt: Ckpt, which: str) -> None:
    """A FIFO would block a reader forever; run in a subprocess so a regression cannot hang the suite."""
    target = ckpt.manifest_path if which == "manifest" else ckpt.data_path
    target.unlink()
    os.mkfifo(target)
    code = textwrap.dedent(f"""
        import zerostall
        try:
            zerostall.load_pytree({str(ckpt.path)!r})
        except zerostall.CorruptCheckpointError as exc:
            print("refused:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "refused:" in proc.stdout and "not a regular file" in proc.stdout, proc.stdout + proc.stderr


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    with pytest.raises(zerostall.errors.CheckpointNotFoundError):
        zerostall.load_pytree(tmp_path / "nothing")


def test_unfinished_temporary_directory_is_not_a_checkpoint(ckpt: Ckpt) -> None:
    ckpt.manifest_path.unlink()
    with pytest.raises(zerostall.errors.CheckpointNotFoundError):
        ckpt.load()


def test_load_options_verify_false_still_checks_structure(ckpt: Ckpt) -> None:
    ckpt.write_manifest(_set("leaves.0.offset", 640)(ckpt.manifest()))
    with pytest.raises(CorruptCheckpointError):
        zerostall.load_pytree(ckpt.path, options=LoadOptions(verify=False))
