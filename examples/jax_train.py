"""Train a small flax MLP with optax, checkpointing a flax TrainState asynchronously; resume from the latest step.

    pip install "zerostall[jax]" flax optax     # flax and optax are this example's, not zerostall's
    python examples/jax_train.py --dir /tmp/jax_run --steps 40 --save-every 5 --out final.npz

Run it again with the same ``--dir`` after a crash (``--kill-at N`` SIGKILLs the process right
after the save of step N returned) and it resumes from the latest committed step; the final
parameters are bit for bit those of an uninterrupted run.

``save_pytree_async`` returns holding references to the state's arrays; their copy to host runs
in the background. The train step donates its input state (``donate_argnums``), so before the
next step the loop calls ``response.wait_staged()``: a donated array cannot be read any more, and
a save whose array was donated first (off CPU) fails with ``zerostall.errors.DonatedArrayError``; on
CPU the step runs without donating, much slower.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import zerostall


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(64)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(1)(x)


def batch(step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The batch of a step depends on the step only, so a resumed run sees the same data."""
    kx, kn = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
    x = jax.random.normal(kx, (32, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True)) + 0.01 * jax.random.normal(kn, (32, 1))
    return x, y


def new_state() -> TrainState:
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8)))
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3))


@functools.partial(jax.jit, donate_argnums=0)  # the old state's buffers are reused for the new one
def train_step(state: TrainState) -> tuple[TrainState, jax.Array]:
    x, y = batch(state.step)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads), loss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, help="checkpoint directory")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--kill-at", type=int, help="SIGKILL this process right after the save of this step returned")
    ap.add_argument("--out", help="write the final parameters here (.npz, keyed by pytree path)")
    args = ap.parse_args()

    state = new_state()
    with zerostall.Checkpointer(args.dir, keep_last=3) as ckpt:
        start = ckpt.latest_step()
        if start is not None:
            state = ckpt.load_pytree(start, template=state)  # same TrainState class, apply_fn and tx
            print(f"resumed from step {start}", flush=True)
        saving: zerostall.Response | None = None
        while int(state.step) < args.steps:
            if saving is not None:
                saving.wait_staged()  # the step below donates the arrays the save still copies
                saving = None
            state, loss = train_step(state)
            step = int(state.step)
            if step % args.save_every == 0:
                saving = ckpt.save_pytree_async(step, state, metadata={"loss": float(loss)})
                if step == args.kill_at:
                    saving.wait_staged()  # staged: from here the writer process commits it without us
                    os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()
    if args.out:
        flat, _ = jax.tree_util.tree_flatten_with_path(state.params)
        np.savez(args.out, step=np.asarray(state.step),
                 **{jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat})
    print(f"done at step {int(state.step)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
