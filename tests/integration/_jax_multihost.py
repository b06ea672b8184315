"""One of two JAX processes (tests/integration/test_jax_multihost.py), 4 CPU devices each.

``jax.distributed`` over localhost with gloo CPU collectives; ``join_processes`` gives zerostall
the same two processes. Saves arrays sharded over a mesh spanning both processes' 8 devices with
a background (overlapped) save, fails a second save by a donation on one process, then loads the
first into a different mesh; prints one JSON line.
"""

from __future__ import annotations

import functools
import json
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import zerostall
import zerostall.integrations.jax as zjax
from zerostall.integrations.jax import join_processes

GLOBAL = {
    "both": np.arange(16 * 8, dtype=np.float32).reshape(16, 8),  # P("x", "y"): 8 shards, 4 per process
    "rows": (np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 7).astype(jnp.bfloat16),  # P("x"): each twice
    "repl": np.arange(10, dtype=np.int32),  # P(): on all 8 devices, written once
}
SPECS = {"both": P("x", "y"), "rows": P("x"), "repl": P()}
# at load: another mesh (devices in another order, axes swapped) and other partitionings
LOAD_SPECS = {"both": P("b", "a"), "rows": P(None, "b"), "repl": P("a")}


@functools.partial(jax.jit, donate_argnums=0)
def donate(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return jax.tree.map(lambda a: a + 1, state)


def main(rank: int, port: int, path: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default; named as the test's premise
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=rank)
    join_processes(timeout_s=120)
    devs = np.array(jax.devices())
    assert devs.size == 8 and len(jax.local_devices()) == 4, (devs, jax.local_devices())
    mesh = Mesh(devs.reshape(4, 2), ("x", "y"))
    state = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, SPECS[k]), lambda i, v=v: v[i])
             for k, v in GLOBAL.items()}
    with zerostall.Checkpointer(path) as ckpt:
        r = ckpt.save_pytree_async(1, state)
        r.wait_staged()
        state = jax.tree.map(lambda a: a * 0, state)  # the saved arrays may go now
        r.result()
        with open(f"{path}/step_00000001/manifest.json") as f:
            manifest = json.load(f)

        # off CPU no host view is held from the call: a donation on process 1 before its copy fails the
        # save there (DonatedArrayError) and, through the collective decision, on process 0 too
        zjax.HOLD_CPU_VIEWS = False
        gate = threading.Event()
        if rank == 1:
            ckpt._engine._copier._put(lambda: gate.wait(60))
        state = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, SPECS[k]), lambda i, v=v: v[i])
                 for k, v in GLOBAL.items()}
        r = ckpt.save_pytree_async(2, state)
        if rank == 1:
            state = donate(state)
            gate.set()
        try:
            r.result()
            failed = None
        except Exception as exc:
            failed = type(exc).__name__
        zjax.HOLD_CPU_VIEWS = True
        steps = ckpt.steps()

        mesh2 = Mesh(devs[[5, 1, 6, 2, 7, 3, 4, 0]].reshape(2, 4), ("a", "b"))  # processes interleaved
        tmpl = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh2, LOAD_SPECS[k]))
                for k, v in GLOBAL.items()}
        out = ckpt.load_pytree(1, tmpl)
    equal = {k: all(np.asarray(sh.data).tobytes() == GLOBAL[k][sh.index].tobytes()
                    for sh in out[k].addressable_shards) and out[k].sharding == tmpl[k].sharding
             for k in GLOBAL}
    print(json.dumps({"rank": rank, "equal": equal, "manifest": manifest, "failed": failed, "steps": steps}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
