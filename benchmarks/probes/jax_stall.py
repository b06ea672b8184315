"""JAX on CPU: how long ``save_pytree_async`` blocks a flax/optax trainer, background copy vs blocking.

    python -m benchmarks.probes.jax_stall [--size 512M] [--saves 5] [--dir /tmp/zsjax] [--no-donate]

The state is a flax ``TrainState`` of an MLP of square ``Dense`` layers with ``optax.adamw``
(parameters + two moments: ``--size`` in all), trained by a jitted step that donates its input
state (``donate_argnums=0``; ``--no-donate``: a step that does not). For each save, paired in one process and alternating which goes
first, each mode saves the same state:

* ``overlap`` (the default staging): the call holds a host view of each array and returns; the
  copy into the staging buffer runs on the engine's copier thread;
* ``overlap_wait``: the same, but ``response.wait_staged()`` before the next (donating) step, as
  ``examples/jax_train.py`` does; its ``stall_s`` includes that wait;
* ``blocking`` (``SaveOptions(staging="blocking")``): the copy is done before the call returns.

Per save and mode:

* ``stall_s``: time the ``save_pytree_async`` call blocked the training thread;
* ``staged_s``: from the call until every byte was in the staging buffer;
* ``next_step_s``: the donating train step right after the call (``overlap``: issued at once, no
  ``wait_staged()``), waited for; ``step_s`` is the same step with no save around it. With the
  background copy the step competes with the copy for the cores, and on CPU it cannot reuse the
  held buffers (XLA copies instead of donating them);
* ``memcpy_s``: a paired single-pass ``np.copyto`` of the same bytes into a warm buffer.

The machine's other users make single numbers noisy: compare modes within one run (ratios).
Prints a table on stderr and one JSON line on stdout.

What it showed (``--size 256M --saves 5``, one run each, a 2-core machine shared with other
jobs): the background copy cut the call's stall from 0.75-0.90x of a memcpy to 0.020x (donating
step) and 0.054x (a step that does not donate). Without donation the copy runs beside the next
step on the same cores: stall + next step 0.97x of blocking's. A donating step issued before the
copy was done took 1.28 s against 0.24 s with no save (5.3x): XLA does not donate a buffer under
a host view, and its fallback copies. Calling ``wait_staged()`` before a donating step costs what
blocking does (stall + next step 0.86x and 0.89x of blocking's): the rule in docs/guarantees.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import zerostall

MODES = ("overlap", "overlap_wait", "blocking")
STAGING = {"overlap": "overlap", "overlap_wait": "overlap", "blocking": "blocking"}
LAYERS = 4


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(LAYERS - 1):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(self.width)(x)


def new_state(size: int) -> TrainState:
    # parameters + adam's mu and nu: 3 float32 copies of LAYERS square kernels
    width = int(math.sqrt(size / 4 / 3 / LAYERS))
    model = MLP(width)
    params = model.init(jax.random.key(0), jnp.zeros((1, width)))
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-4))


def _train_step(state: TrainState) -> TrainState:
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), state.step), (8, state.params["params"]["Dense_0"]["kernel"].shape[0]))
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn(p, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)


STEPS = {True: jax.jit(_train_step, donate_argnums=0), False: jax.jit(_train_step)}


def nbytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="512M")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/zsjax")
    ap.add_argument("--no-donate", action="store_true", help="the train step does not donate its input")
    args = ap.parse_args()
    train_step = STEPS[not args.no_donate]

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    state = jax.block_until_ready(train_step(new_state(parse_size(args.size))))
    total = nbytes(state)
    flat = [np.asarray(x) for x in jax.tree.leaves(state)]
    scratch = [np.empty_like(a) for a in flat]
    for a, b in zip(flat, scratch, strict=True):  # warm the memcpy baseline's buffers
        np.copyto(b, a)
    del flat
    sys.stderr.write(f"state {total / 2**20:.0f} MiB in {len(jax.tree.leaves(state))} arrays\n")

    ckpts = {m: zerostall.Checkpointer(root / m, keep_last=1,
                                       save_options=zerostall.SaveOptions(staging=STAGING[m])) for m in MODES}
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for m in MODES:  # first saves allocate buffers and start writers: not measured
            ckpts[m].prepare(tree=state)
        for i in range(args.saves + 1):
            order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]
            for m in order:
                t0 = time.perf_counter()
                state = jax.block_until_ready(train_step(state))
                step_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                for a, b in zip(jax.tree.leaves(state), scratch, strict=True):
                    np.copyto(b, np.asarray(a))
                memcpy_s = time.perf_counter() - t0

                t0 = time.perf_counter()
                r = ckpts[m].save_pytree_async(int(state.step), state)
                if m == "overlap_wait":
                    r.wait_staged()
                stall_s = time.perf_counter() - t0
                state = jax.block_until_ready(train_step(state))
                next_step_s = time.perf_counter() - t0 - stall_s
                stats = r.result()
                if i == 0:
                    continue  # warm-up round
                rows[m].append({"stall_s": stall_s, "staged_s": float(stats.staged_s or 0.0),
                                "next_step_s": next_step_s, "step_s": step_s, "memcpy_s": memcpy_s})
    finally:
        for c in ckpts.values():
            c.close()
        shutil.rmtree(root, ignore_errors=True)

    def med(m: str, k: str) -> float:
        return statistics.median(r[k] for r in rows[m])

    out: dict[str, Any] = {"bytes": total, "saves": args.saves, "jax": jax.__version__, "donate": not args.no_donate}
    for m in MODES:
        out[m] = {k: med(m, k) for k in ("stall_s", "staged_s", "next_step_s", "step_s", "memcpy_s")}
        out[m]["stall_over_memcpy"] = statistics.median(r["stall_s"] / r["memcpy_s"] for r in rows[m])
        out[m]["stall_plus_next_step_s"] = statistics.median(r["stall_s"] + r["next_step_s"] for r in rows[m])
    for m in ("overlap", "overlap_wait"):
        out[f"stall_ratio_{m}_over_blocking"] = out[m]["stall_s"] / out["blocking"]["stall_s"]
        out[f"stall_plus_next_step_ratio_{m}_over_blocking"] = (out[m]["stall_plus_next_step_s"]
                                                                / out["blocking"]["stall_plus_next_step_s"])
    sys.stderr.write(f"{'mode':<12} {'stall_s':>8} {'staged_s':>8} {'next_step':>9} {'step_s':>7} "
                     f"{'memcpy_s':>8} {'stall/memcpy':>12} {'stall+next':>10}\n")
    for m in MODES:
        o = out[m]
        sys.stderr.write(f"{m:<12} {o['stall_s']:8.4f} {o['staged_s']:8.3f} {o['next_step_s']:9.3f} "
                         f"{o['step_s']:7.3f} {o['memcpy_s']:8.3f} {o['stall_over_memcpy']:12.3f} "
                         f"{o['stall_plus_next_step_s']:10.3f}\n")
    for m in ("overlap", "overlap_wait"):
        sys.stderr.write(f"{m}/blocking: stall {out[f'stall_ratio_{m}_over_blocking']:.3f}, stall + next step "
                         f"{out[f'stall_plus_next_step_ratio_{m}_over_blocking']:.3f}\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
