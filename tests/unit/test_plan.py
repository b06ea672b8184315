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
    for slot in plan.slots:
        assert (slot.offset - f.data_start) % DATA_ALIGN == 0
    assert f.alloc % 4096 == 0 and f.alloc >= f.size
    assert plan.nbytes == 3 + 20
