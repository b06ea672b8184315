import json

import pytest

from zerostall.errors import CorruptCheckpointError, UnsupportedFormatError
from zerostall.format.manifest import encode_manifest, parse_manifest


def _doc(**over):
    doc = json.loads(encode_manifest(
        items={"pytree": {"type": "dict", "keys": ["w"], "values": [{"type": "array", "leaf": 0}]}},
        leaves=[{"key": "pytree/w", "kind": "torch", "dtype": "F32", "shape": [2, 2], "file": 0,
                 "offset": 64, "nbytes": 16, "crc32c": 5}],
        files=[{"path": "data/rank-00000.safetensors", "size": 80}]))
    doc.update(over)
    return doc


def _parse(doc):
    return parse_manifest(json.dumps(doc).encode(), path="/ck")


def test_round_trip():
    m = _parse(_doc())
    assert m.format_version == 1 and m.leaves[0].shape == (2, 2) and m.files[0].size == 80


def test_unknown_version():
    with pytest.raises(UnsupportedFormatError, match="format_version 2"):
        _parse(_doc(format_version=2))


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "data/../../x", "a//b", "data/./x"])
def test_path_traversal_refused(path):
    with pytest.raises(CorruptCheckpointError, match="plain relative path"):
        _parse(_doc(files=[{"path": path, "size": 80}]))


def test_range_outside_file():
    doc = _doc()
    doc["leaves"][0]["offset"] = 70
    with pytest.raises(CorruptCheckpointError, match="outside") as ei:
        _parse(doc)
    assert ei.value.key == "pytree/w" and ei.value.path == "/ck"


def test_nbytes_must_match_shape():
    doc = _doc()
    doc["leaves"][0]["shape"] = [10 ** 12, 10 ** 12]
    with pytest.raises(CorruptCheckpointError, match="does not match shape"):
        _parse(doc)


def test_not_utf8():
    with pytest.raises(CorruptCheckpointError, match="UTF-8"):
        parse_manifest(b"\xff\xfe{}", path="/ck")


def test_deep_nesting():
    with pytest.raises(CorruptCheckpointError):
        parse_manifest(b"[" * 100000 + b"]" * 100000, path="/ck")


def test_unknown_node_type():
    with pytest.raises(UnsupportedFormatError, match="node type"):
        _parse(_doc(items={"pytree": {"type": "pickle", "value": "x"}}))
