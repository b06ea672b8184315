import collections
import datetime
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import zerostall
from zerostall.errors import UnsupportedLeafError, ZerostallError
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
    # Each gets the remedy for packed dtypes (view as uint8), not complex32's "t.to(torch.complex64)".
    t = torch.arange(8, dtype=torch.uint8).view(dtype)
    with pytest.raises(UnsupportedLeafError, match=r"t\.view\(torch\.uint8\)") as info:
        flatten({"p": {"t": t}})
    msg = str(info.value)
    assert "complex" not in msg and f".view({dtype})" in msg and info.value.key == "p/t"
    zerostall.save_pytree(tmp_path / "c", {"t": t.view(torch.uint8)})  # what it says to do
    back = zerostall.load_pytree(tmp_path / "c")["t"].view(dtype)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


# -- leaves that cannot be saved: the refusal names the key and says what to store instead -------


@pytest.mark.parametrize("value, fix", [
    (np.zeros(2, dtype=">f4"), r"astype\(x\.dtype\.newbyteorder"),
    (np.array(["a", "b"]), r"x\.tolist\(\)"),
    (np.str_("a"), r"x\.item\(\)"),
])
def test_numpy_values_that_cannot_be_saved_say_how_to_store_them(tmp_path: Path, value: object, fix: str) -> None:
    # Big-endian and string arrays, and np.str_ (a str subclass, not a str leaf): each gets the
    # conversion that makes it savable.
    with pytest.raises(ZerostallError, match=fix) as info:
        zerostall.save_pytree(tmp_path / "n", {"x": value})
    assert info.value.key == "pytree/x"


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_tensor_dtypes_that_cannot_be_saved_say_what_to_store(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedLeafError, match=r"t\.to\(torch\.complex64\)") as info:
        zerostall.save_pytree(tmp_path / "c", {"z": torch.ones(2, dtype=torch.complex32)})
    assert info.value.key == "pytree/z"


@pytest.mark.parametrize("key, fix", [(np.int64(1), "int(key)"), (np.str_("a"), "str(key)")])
def test_numpy_dict_keys_say_how_to_convert(tmp_path: Path, key: object, fix: str) -> None:
    with pytest.raises(UnsupportedLeafError, match=re.escape(fix)):
        zerostall.save_pytree(tmp_path / "k", {key: 1})


def test_an_empty_tensor_no_load_could_allocate_is_refused_at_save(tmp_path: Path) -> None:
    # torch.empty(0, 2**62) holds no bytes, but its shape is more than any array a load can
    # allocate: committed, every load of it would fail as a malformed manifest.
    with pytest.raises(UnsupportedLeafError, match="no load could allocate") as info:
        zerostall.save_pytree(tmp_path / "e", {"x": torch.empty(0, 2**62)})
    assert info.value.key == "pytree/x"
    assert not (tmp_path / "e").exists()
    zerostall.save_pytree(tmp_path / "ok", {"x": torch.empty(0, 2**40)})
    assert zerostall.load_pytree(tmp_path / "ok")["x"].shape == (0, 2**40)


def test_nested_tensor_is_refused_by_key_not_by_a_torch_internal_error(tmp_path: Path) -> None:
    # A strided nested tensor has no single shape (torch raises "NestedTensorImpl doesn't support
    # sizes"): it is refused by key before anything asks for one.
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    try:
        zerostall.save_pytree(tmp_path / "n", {"batch": nt})
    except UnsupportedLeafError as exc:
        assert exc.key == "pytree/batch" and "unbind" in str(exc)
    else:  # pragma: no cover - the assertion below says what went wrong
        raise AssertionError("a nested tensor was saved")


def test_random_generators_are_told_what_to_save_and_that_works(tmp_path: Path) -> None:
    # None of these has a state_dict(): each refusal names the state accessor it does have.
    r, g, t = random.Random(5), np.random.default_rng(7), torch.Generator().manual_seed(3)
    for obj, advice in ((t, "get_state()"), (g, "bit_generator.state"), (r, "getstate()")):
        try:
            zerostall.save_pytree(tmp_path / "bad", {"rng": obj})
        except UnsupportedLeafError as exc:
            assert advice in str(exc) and "state_dict()" not in str(exc), str(exc)
        else:  # pragma: no cover
            raise AssertionError(f"{type(obj)} was saved")
    # what the message says to do round-trips
    zerostall.save_pytree(tmp_path / "ok", {"r": r.getstate(), "g": g.bit_generator.state, "t": t.get_state()})
    d = zerostall.load_pytree(tmp_path / "ok")
    r2, g2, t2 = random.Random(), np.random.default_rng(), torch.Generator()
    r2.setstate(d["r"])
    g2.bit_generator.state = d["g"]
    t2.set_state(d["t"])
    assert r2.random() == r.random() and g2.random() == g.random()
    assert torch.equal(torch.rand(3, generator=t2), torch.rand(3, generator=t))
