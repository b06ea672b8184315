import collections
import datetime

import numpy as np
import pytest
import torch

import zerostall
from zerostall.errors import UnsupportedLeafError
from zerostall.tree import flatten

Point = collections.namedtuple("Point", ["x", "y"])


def test_flatten_keys_and_structure():
    flat = flatten({"pytree": {"a": torch.zeros(2), "b": [np.ones(3), (1, 2.5)], 3: "s"}})
    assert [leaf.key for leaf in flat.leaves] == ["pytree/a", "pytree/b/0"]
    node = flat.items["pytree"]
    assert node["type"] == "dict" and node["keys"] == ["a", "b", 3]
    assert node["values"][1]["values"][1] == {"type": "tuple", "values": [
        {"type": "int", "value": 1}, {"type": "float", "value": (2.5).hex()}]}


def test_signature_tracks_layout_only():
    a = flatten({"p": {"w": torch.zeros(2, 3)}})
    b = flatten({"p": {"w": torch.ones(2, 3)}})
    c = flatten({"p": {"w": torch.ones(3, 2)}})
    assert a.signature == b.signature != c.signature


def test_unsupported_leaf_names_key():
    with pytest.raises(UnsupportedLeafError) as ei:
        flatten({"pytree": {"model": {"bad": {1, 2}}}})
    assert ei.value.key == "pytree/model/bad"
    assert "register_handler" in str(ei.value)


def test_unsupported_dict_key_type():
    with pytest.raises(UnsupportedLeafError, match="dict keys"):
        flatten({"pytree": {(1, 2): 3}})


def test_sparse_tensor_refused():
    with pytest.raises(UnsupportedLeafError, match="strided"):
        flatten({"pytree": {"s": torch.eye(3).to_sparse()}})


def test_duplicate_keys_refused():
    with pytest.raises(UnsupportedLeafError, match="same key"):
        flatten({"pytree": {"a/b": torch.zeros(1), "a": {"b": torch.zeros(1)}}})


def test_cycle_is_an_error_not_a_crash():
    d: dict = {}
    d["self"] = d
    with pytest.raises(UnsupportedLeafError, match="deeper"):
        flatten({"pytree": d})


def test_stateful_flattens_its_state_dict():
    m = torch.nn.Linear(2, 3)
    flat = flatten({"pytree": {"m": m}})
    assert [leaf.key for leaf in flat.leaves] == ["pytree/m/weight", "pytree/m/bias"]


def test_namedtuple_node():
    flat = flatten({"pytree": Point(1, torch.zeros(1))})
    assert flat.items["pytree"]["type"] == "namedtuple"
    assert flat.items["pytree"]["fields"] == ["x", "y"]


def test_custom_handler_json_and_bytes():
    zerostall.register_handler(datetime.date, name="test-date", encode=lambda d: d.isoformat(),
                               decode=datetime.date.fromisoformat)
    zerostall.register_handler(complex, name="test-cplx", format="bytes",
                               encode=lambda c: np.array([c.real, c.imag]).tobytes(),
                               decode=lambda b: complex(*np.frombuffer(b)))
    try:
        flat = flatten({"pytree": {"d": datetime.date(2024, 1, 2), "c": 1 + 2j}})
        assert flat.items["pytree"]["values"][0] == {"type": "custom", "handler": "test-date", "json": "2024-01-02"}
        assert flat.leaves[0].kind == "custom" and flat.leaves[0].nbytes == 16
    finally:
        zerostall.unregister_handler(datetime.date)
        zerostall.unregister_handler(complex)


def test_handler_returning_non_json_is_refused():
    class Foo:
        pass

    zerostall.register_handler(Foo, name="test-foo", encode=lambda f: object(), decode=lambda v: Foo())
    try:
        with pytest.raises(UnsupportedLeafError, match="plain JSON"):
            flatten({"pytree": {"f": Foo()}})
    finally:
        zerostall.unregister_handler(Foo)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.bool, torch.int8, torch.uint8, torch.int64,
                                   torch.uint16, torch.uint32, torch.uint64, torch.complex64])
def test_every_torch_dtype_has_a_name(dtype):
    flat = flatten({"p": torch.zeros(3, dtype=dtype)})
    assert flat.leaves[0].nbytes == 3 * torch.zeros(1, dtype=dtype).element_size()


@pytest.mark.parametrize("dtype", [torch.float4_e2m1fn_x2, torch.uint3, torch.int4, torch.bits16])
def test_a_packed_or_shell_dtype_is_told_to_save_its_bytes_and_that_round_trips(dtype, tmp_path):
    # The refusal used to suggest "t.to(torch.complex64) for complex32" for these too.
    t = torch.arange(8, dtype=torch.uint8).view(dtype)
    with pytest.raises(UnsupportedLeafError, match=r"t\.view\(torch\.uint8\)") as info:
        flatten({"p": {"t": t}})
    msg = str(info.value)
    assert "complex" not in msg and f".view({dtype})" in msg and info.value.key == "p/t"
    zerostall.save_pytree(tmp_path / "c", {"t": t.view(torch.uint8)})  # what it says to do
    back = zerostall.load_pytree(tmp_path / "c")["t"].view(dtype)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
