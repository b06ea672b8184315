"""Run by tests/integration/test_jax.py with XLA_FLAGS=--xla_force_host_platform_device_count=8.

Saves arrays sharded over a 4x2 mesh and loads them into other meshes and shardings; prints one
JSON line of what it observed (the test asserts on it).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import zerostall
from zerostall import SaveOptions, WriterKind


def main(path: str) -> None:
    devs = np.array(jax.devices())
    assert devs.size == 8, devs
    mesh = Mesh(devs.reshape(4, 2), ("x", "y"))
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
    state = {
        "both": jax.device_put(x, NamedSharding(mesh, P("x", "y"))),  # 8 distinct shards
        "rows": jax.device_put(x.astype(jnp.bfloat16), NamedSharding(mesh, P("x"))),  # 4 shards, each twice
        "repl": jax.device_put(jnp.arange(6, dtype=jnp.int32), NamedSharding(mesh, P())),  # 1 shard, 8 copies
        "cols": jax.device_put(x * 2, NamedSharding(mesh, P(None, "y"))),  # 2 shards (columns)
    }
    zerostall.save_pytree(path, state, options=SaveOptions(writer=WriterKind.THREAD))
    with open(f"{path}/manifest.json") as f:
        tree = json.load(f)["items"]["pytree"]
    shards = {k: len(v["shards"]) for k, v in zip(tree["keys"], tree["values"], strict=True)}

    # another mesh (2x4, axes swapped), other partitionings, and an abstract template
    mesh2 = Mesh(devs[::-1].reshape(2, 4), ("a", "b"))
    want = {
        "both": NamedSharding(mesh2, P("b", "a")),
        "rows": NamedSharding(mesh2, P(None, "a")),
        "repl": NamedSharding(mesh2, P("a")),  # was replicated, now split 2 ways along a
        "cols": SingleDeviceSharding(devs[3]),
    }
    tmpl = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=want[k]) for k, v in state.items()}
    out = zerostall.load_pytree(path, tmpl)
    equal = {k: bool(np.array_equal(np.asarray(out[k]), np.asarray(state[k]))) for k in state}
    sharding_kept = {k: out[k].sharding == want[k] for k in state}
    # a concrete jax.Array template on the save-time mesh
    filled = zerostall.load_pytree(path, jax.tree.map(jnp.zeros_like, state))
    same_mesh = {k: bool(np.array_equal(np.asarray(filled[k]), np.asarray(state[k])))
                 and filled[k].sharding == state[k].sharding for k in state}
    # no template: assembled numpy; a torch template: the DTensor-style box reader
    raw = zerostall.load_pytree(path)
    as_numpy = {k: type(raw[k]).__name__ == "ndarray" and bool(np.array_equal(raw[k], np.asarray(state[k])))
                for k in state}
    t = zerostall.load_pytree(path, {"both": torch.zeros(8, 6), "cols": torch.zeros(8, 6)})
    as_torch = {k: bool(np.array_equal(t[k].numpy(), np.asarray(state[k]))) for k in t}
    print(json.dumps({"shards": shards, "equal": equal, "sharding_kept": sharding_kept, "same_mesh": same_mesh,
                      "as_numpy": as_numpy, "as_torch": as_torch}))


if __name__ == "__main__":
    main(sys.argv[1])
