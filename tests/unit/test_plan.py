import dataclasses
import json
import struct

import torch

from zerostall.stage.plan import DATA_ALIGN, make_plan
from zerostall.tree import flatten


def test_plan_is_a_valid_safetensors_layout():
    flat = flatten({"p": {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(5), "c": torch.zeros(0)}})
    plan = make_plan(flat)
    f = plan.files[0]
    (n,) = struct.unpack("<Q", f.header[:8])
    header = json.loads(f.header[8:8 + n])
    assert f.data_start == 8 + n and f.data_start % DATA_ALIGN == 0
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    # contiguous, no holes: what safetensors requires
    pos = 0
    for b, e in spans:
        assert b == pos
        pos = e
    assert f.size == f.data_start + pos
    for slot in plan.leaves:
        assert (slot.offset - f.data_start) % DATA_ALIGN == 0
    assert f.alloc % 4096 == 0 and f.alloc >= f.size
    assert plan.nbytes == 3 + 20


def test_the_planned_leaf_entry_reaches_the_writer_and_the_manifest_unchanged(tmp_path):
    """One record per leaf: the plan's entry is the wire's row and, with its checksum, the manifest's."""
    import crc32c
    import numpy as np

    import zerostall
    from zerostall.format.header import decode_header, header_length, tensor_entries
    from zerostall.format.manifest import LeafEntry, parse_manifest
    from zerostall.messages import LeafLayout, LeafRow, decode, encode

    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": np.arange(5, dtype=np.int16),
             "s": np.float64(2.5), "b": b"xyz"}
    flat = flatten({"pytree": state})
    plan = make_plan(flat)
    assert LeafRow is LeafEntry
    assert [lf.crc32c for lf in plan.leaves] == [None] * 4  # the plan knows where, not what

    sent = decode(encode(LeafLayout(id=1, leaves=plan.leaves, items=flat.items)))
    assert isinstance(sent, LeafLayout) and sent.leaves == plan.leaves

    zerostall.save_pytree(str(tmp_path / "c"), state)
    m = parse_manifest((tmp_path / "c" / "manifest.json").read_bytes(), path="c")
    data = (tmp_path / "c" / "data" / "rank-00000.safetensors").read_bytes()
    assert [dataclasses.replace(lf, crc32c=None) for lf in m.leaves] == list(plan.leaves)
    for lf in m.leaves:  # the writer added the checksum of exactly those bytes, and nothing else
        assert lf.crc32c == crc32c.crc32c(data[lf.offset:lf.offset + lf.nbytes])
    doc = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    assert doc["leaves"] == [dataclasses.replace(lf, crc32c=c).to_json()
                             for lf, c in zip(plan.leaves, [lf.crc32c for lf in m.leaves], strict=True)]

    # the data file's header is the one derived from the same records
    f = plan.files[0]
    n = header_length(data[:8], len(data))
    _, tensors = tensor_entries(decode_header(data[8:8 + n]), len(data) - f.data_start)
    assert f.header == data[:f.data_start]
    assert [t for t in tensors if t.name in {lf.key for lf in plan.leaves}] == \
        [lf.header_entry(f.data_start) for lf in plan.leaves]
