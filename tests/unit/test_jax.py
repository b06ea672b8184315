"""JAX leaves and pytrees (one CPU device here; sharding runs in tests/integration/test_jax.py)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import torch
from flax import struct

import zerostall
from zerostall import Checkpointer, SaveOptions, WriterKind
from zerostall.errors import MismatchError, MissingKeyError, UnsupportedLeafError

THREAD = SaveOptions(writer=WriterKind.THREAD)


@struct.dataclass
class Model:
    params: dict[str, jax.Array]
    opt: Any
    step: jax.Array
    name: str = struct.field(pytree_node=False, default="mlp")


def model(seed: int) -> Model:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w": jax.random.normal(k1, (5, 3)), "b": jax.random.normal(k2, (3,)).astype(jnp.bfloat16)}
    opt = optax.adamw(1e-3).init(params)
    return Model(params=params, opt=opt, step=jnp.asarray(seed, jnp.int32))


def same(a: Any, b: Any) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        type(x) is type(y) and np.asarray(x).dtype == np.asarray(y).dtype
        and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True))


def test_pytree_roundtrip_into_jax_template(tmp_path: Path) -> None:
    saved = model(1)
    zerostall.save_pytree(tmp_path / "c", saved, options=THREAD)
    out = zerostall.load_pytree(tmp_path / "c", model(2))
    assert same(out, saved)
    assert isinstance(out, Model) and out.name == "mlp"
    assert isinstance(out.opt[0], optax.ScaleByAdamState)
    assert isinstance(out.params["w"], jax.Array)


def test_shape_dtype_struct_template(tmp_path: Path) -> None:
    saved = model(3)
    zerostall.save_pytree(tmp_path / "c", saved, options=THREAD)
    abstract = jax.eval_shape(lambda: model(0))
    out = zerostall.load_pytree(tmp_path / "c", abstract)
    assert same(out, saved)
    assert out.params["w"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_a_jax_eval_shape_template_restores_a_python_step_counter(tmp_path: Path) -> None:
    # The Orbax way to build a restore template, jax.eval_shape(lambda: state), turns the state's
    # Python `step` into a 0-d ShapeDtypeStruct: a saved Python scalar loads into it as an array
    # of the template's dtype, and one that does not fit that dtype is refused, never truncated.
    state = {"w": jnp.arange(4.0), "step": 7, "lr": 0.5, "done": True}
    zerostall.save_pytree(tmp_path / "c", state)
    out = zerostall.load_pytree(tmp_path / "c", jax.eval_shape(lambda: state))
    assert isinstance(out["step"], jax.Array) and int(out["step"]) == 7 and out["step"].dtype == jnp.int32
    assert float(out["lr"]) == 0.5 and bool(out["done"]) is True
    assert bool(jnp.array_equal(out["w"], state["w"]))
    with pytest.raises(MismatchError, match="float 0.5") as err:  # never truncated silently
        zerostall.load_pytree(tmp_path / "c", {"lr": jax.ShapeDtypeStruct((), jnp.int32)})
    assert err.value.key == "pytree/lr"
    with pytest.raises(MismatchError, match="does not fit"):
        zerostall.save_pytree(tmp_path / "d", {"step": 2**40})
        zerostall.load_pytree(tmp_path / "d", {"step": jax.ShapeDtypeStruct((), jnp.int32)})


def test_no_template_gives_numpy_and_dicts(tmp_path: Path) -> None:
    saved = model(4)
    zerostall.save_pytree(tmp_path / "c", saved, options=THREAD)
    raw = zerostall.load_pytree(tmp_path / "c")
    assert set(raw) == {"params", "opt", "step"}  # the static field is not saved
    assert raw["params"]["b"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(raw["params"]["b"], np.asarray(saved.params["b"]))
    np.testing.assert_array_equal(raw["opt"][0][1]["w"], np.asarray(saved.opt[0].mu["w"]))


def test_checkpointer_async(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "run") as c:
        c.save_pytree_async(1, model(1)).result()
        c.save_pytree_async(2, model(2))
        c.wait()
        assert same(c.load_pytree(1, model(0)), model(1))
        assert same(c.load_pytree(template=model(0)), model(2))


def test_donating_step_after_wait_staged(tmp_path: Path) -> None:
    @functools.partial(jax.jit, donate_argnums=0)
    def step(p: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return jax.tree.map(lambda x: x * 2 + 1, p)

    params = {"w": jnp.arange(1 << 16, dtype=jnp.float32), "v": jnp.ones((256, 256))}
    expect = jax.tree.map(np.array, params)
    with Checkpointer(tmp_path / "run") as c:
        r = c.save_pytree_async(1, params)
        r.wait_staged()  # the copy to host runs in the background; the step below donates its sources
        saved = params
        for _ in range(5):
            params = step(params)
        # the save kept no host view of the buffers, so the step really reused them (no extra memory)
        assert all(a.is_deleted() for a in saved.values())
        r.result()
        out = c.load_pytree(1)
    for k in expect:
        np.testing.assert_array_equal(out[k], expect[k])


def test_donated_array_is_refused_by_key(tmp_path: Path) -> None:
    @functools.partial(jax.jit, donate_argnums=0)
    def step(x: jax.Array) -> jax.Array:
        return x + 1

    x = jnp.ones(1024)
    step(x)
    assert x.is_deleted()
    with pytest.raises(UnsupportedLeafError, match="donated") as ei:
        zerostall.save_pytree(tmp_path / "c", {"opt": {"x": x}}, options=THREAD)
    assert ei.value.key == "pytree/opt/x"


def test_a_donated_jax_array_says_to_save_before_the_donating_step(tmp_path: Path) -> None:
    gone = jnp.ones(4)
    gone.delete()
    with pytest.raises(UnsupportedLeafError, match=r"save the state before the jitted step .*wait_staged\(\)") as info:
        zerostall.save_pytree(tmp_path / "j", {"w": gone})
    assert info.value.key == "pytree/w"
    with pytest.raises(UnsupportedLeafError, match=r"astype\(jnp\.int8\)"):
        zerostall.save_pytree(tmp_path / "k", {"q": jnp.zeros(4, dtype=jnp.int4)})


def test_torch_to_jax_and_back(tmp_path: Path) -> None:
    t = {"w": torch.randn(4, 6).to(torch.bfloat16), "i": torch.arange(5, dtype=torch.int32),
         "f8": torch.randn(3).to(torch.float8_e4m3fn)}
    zerostall.save_pytree(tmp_path / "t", t, options=THREAD)
    tmpl = {k: jax.ShapeDtypeStruct(tuple(v.shape), jnp.dtype(str(v.dtype).removeprefix("torch.")))
            for k, v in t.items()}
    j = zerostall.load_pytree(tmp_path / "t", tmpl)
    for k, v in t.items():
        assert isinstance(j[k], jax.Array)
        np.testing.assert_array_equal(np.asarray(j[k]).view(np.uint8), v.view(torch.uint8).numpy())
    as_numpy = zerostall.load_pytree(tmp_path / "t", {"w": np.zeros((4, 6), ml_dtypes.bfloat16)})
    np.testing.assert_array_equal(as_numpy["w"], np.asarray(j["w"]))
    zerostall.save_pytree(tmp_path / "j", j, options=THREAD)
    back = zerostall.load_pytree(tmp_path / "j", {k: torch.zeros_like(v) for k, v in t.items()})
    for k, v in t.items():
        assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8))


def test_template_mismatch_and_missing_key(tmp_path: Path) -> None:
    zerostall.save_pytree(tmp_path / "c", model(1), options=THREAD)
    bad = model(1).replace(step=jnp.zeros((), jnp.float32))
    with pytest.raises(MismatchError, match="dtype") as ei:
        zerostall.load_pytree(tmp_path / "c", bad)
    assert ei.value.key == "pytree/step"

    @struct.dataclass
    class Wider:
        params: Any
        extra: jax.Array
    with pytest.raises(MissingKeyError) as ei2:
        zerostall.load_pytree(tmp_path / "c", Wider(params=model(1).params, extra=jnp.zeros(1)))
    assert ei2.value.key == "pytree/extra"


def test_registered_pytree_class_and_unsupported_dtype(tmp_path: Path) -> None:
    @jax.tree_util.register_pytree_with_keys_class
    class Pair:
        def __init__(self, a: Any, b: Any) -> None:
            self.a, self.b = a, b

        def tree_flatten_with_keys(self) -> Any:
            return ((jax.tree_util.GetAttrKey("a"), self.a), (jax.tree_util.GetAttrKey("b"), self.b)), None

        @classmethod
        def tree_unflatten(cls, aux: Any, children: Any) -> Pair:
            return cls(*children)

    zerostall.save_pytree(tmp_path / "c", Pair(jnp.ones(2), Pair(jnp.zeros(1), 7)), options=THREAD)
    out = zerostall.load_pytree(tmp_path / "c", Pair(jnp.zeros(2), Pair(jnp.ones(1), 0)))
    assert isinstance(out.b, Pair) and out.b.b == 7
    np.testing.assert_array_equal(np.asarray(out.a), np.ones(2))
    with pytest.raises(UnsupportedLeafError, match="int4") as ei:
        zerostall.save_pytree(tmp_path / "d", {"q": jnp.zeros(4, jnp.int4)}, options=THREAD)
    assert ei.value.key == "pytree/q"


def test_integration_loads_lazily(tmp_path: Path) -> None:
    """``import zerostall`` imports no jax; a save after ``import jax`` works without importing the integration."""
    code = (
        "import sys, zerostall; assert 'jax' not in sys.modules\n"
        "import jax.numpy as jnp\n"
        "assert 'zerostall.integrations.jax' not in sys.modules\n"
        f"zerostall.save_pytree({str(tmp_path / 'c')!r}, {{'x': jnp.arange(3.0)}})\n"
        f"print(zerostall.load_pytree({str(tmp_path / 'c')!r}, {{'x': jnp.zeros(3)}})['x'].tolist())\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[0.0, 1.0, 2.0]"


def test_typed_prng_keys(tmp_path: Path) -> None:
    keys = {"one": jax.random.key(7), "many": jax.random.split(jax.random.key(1), 4),
            "rbg": jax.random.key(3, impl="rbg")}
    zerostall.save_pytree(tmp_path / "c", keys, options=THREAD)
    tmpl = {"one": jax.random.key(0), "many": jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 4)),
            "rbg": jax.random.key(0, impl="rbg")}
    out = zerostall.load_pytree(tmp_path / "c", tmpl)
    for k, v in keys.items():
        assert out[k].dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(out[k])), np.asarray(jax.random.key_data(v)))
    np.testing.assert_array_equal(zerostall.load_pytree(tmp_path / "c")["many"], jax.random.key_data(keys["many"]))
    with pytest.raises(MismatchError) as ei:
        zerostall.load_pytree(tmp_path / "c", {"many": jax.random.split(jax.random.key(0), 5)})
    assert ei.value.key == "pytree/many"


@pytest.mark.parametrize("staging", ["blocking", "overlap"])
def test_jax_leaves_are_checksummed_by_their_staging_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          staging: str) -> None:
    import crc32c

    import zerostall.memcopy as memcopy
    import zerostall.persist.job as job

    if not memcopy.CRC_COPY:
        pytest.fail("the copy kernel is not built here (tests/unit/test_memcopy.py says why)")
    summed: list[int] = []
    real = job.checksum
    monkeypatch.setattr(job, "checksum", lambda view, *a: summed.append(len(view)) or real(view, *a))
    big = jax.random.normal(jax.random.key(3), (512, 512))  # 1 MiB: the staging kernel's
    small = jnp.arange(5.0)
    with Checkpointer(tmp_path, save_options=SaveOptions(writer=WriterKind.THREAD, staging=staging)) as ck:
        ck.save_pytree_async(1, {"big": big, "small": small}).result()
        got = ck.load_pytree(1, {"big": big, "small": small})  # verifies every leaf
    assert np.array_equal(np.asarray(got["big"]), np.asarray(big))
    assert [n for n in summed if n >= (1 << 20)] == [], "the writer checksummed the jax leaf staging had summed"
    doc = __import__("json").loads((tmp_path / "step_00000001" / "manifest.json").read_text())
    crc = {lf["key"]: lf["crc32c"] for lf in doc["leaves"]}
    assert crc[next(k for k in crc if k.endswith("big"))] == crc32c.crc32c(np.asarray(big).tobytes())
