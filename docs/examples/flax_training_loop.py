"""A complete mixed-precision Flax training loop: linen model, `jf.TrainState`, gradient clipping,
gradient accumulation, a learning-rate schedule, checkpoints and `amp_info` logging.

Run: ``python docs/examples/flax_training_loop.py --workdir /tmp/loop``. The documentation page
"A complete training loop" shows this file as it is; a test runs it.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import numpy as np
import optax

import jaxamp
import jaxamp.flax as jf


class Classifier(nn.Module):
    hidden: int = 64
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden, name="hidden")(x))
        x = nn.LayerNorm(name="norm")(x)  # normalisation layers compute in float32 by default
        return nn.Dense(self.classes, name="head")(x)


def make_batches(seed, steps, batch_size, features=16, classes=10):
    """Synthetic data (host arrays, as a data loader gives them): labels from a fixed random
    linear teacher, so the loss can fall."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(features, classes)).astype(np.float32)
    x = rng.normal(size=(steps, batch_size, features)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=-1).astype(np.int32)


def create_state(key, x, *, policy, learning_rate, accumulate):
    model = Classifier()
    rules = {"head": "fp32"}  # per-module rules: the output layer computes in float32
    init = jax.jit(jf.linen.with_policy(model.init, policy, rules))  # one program, not op by op
    params = init(key, x)["params"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, 2, 200)
    # Clipping goes inside the loss-scaled optimizer (it must see unscaled gradients), and
    # accumulation outside it: the loss scale stays constant within a window of micro-batches.
    tx = jaxamp.multi_steps(
        jaxamp.loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))),
        every_k=accumulate,
    )
    # TrainState wraps a plain optimizer in jaxamp.loss_scaled itself; this one already is.
    return jf.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, policy=policy, rules=rules
    )


@jax.jit
def train_step(state, x, y):
    def loss_fn(params, x, y):
        logits = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)  # grads of the scaled loss
    state = state.apply_gradients(grads=grads)  # unscale, check, skip or step, adjust the scale
    return state, loss, state.amp_info()


def train(
    workdir,
    *,
    steps=40,
    batch_size=32,
    policy="fp16-mixed",
    learning_rate=3e-3,
    accumulate=2,
    checkpoint_every=20,
    log_every=10,
):
    """Trains, logs `amp_info`, checkpoints; returns the log (one dict per logged step)."""
    key = jax.random.key(0)
    xs, ys = make_batches(0, steps, batch_size)
    state = create_state(
        key, xs[0], policy=policy, learning_rate=learning_rate, accumulate=accumulate
    )
    log = []
    for step in range(steps):
        state, loss, info = train_step(state, xs[step], ys[step])
        if (step + 1) % log_every == 0:
            log.append(
                {
                    "step": step + 1,
                    "loss": float(loss),
                    "loss_scale": float(info.loss_scale),
                    "last_step_applied": bool(info.last_step_applied),
                    "skipped_steps": int(info.skipped_steps),
                }
            )
            print(log[-1])
        if (step + 1) % checkpoint_every == 0:
            jf.checkpoint.save(workdir, state, step=step + 1)  # the loss scale travels with it
    return state, log


def resume(workdir, *, batch_size=32, policy="fp16-mixed", learning_rate=3e-3, accumulate=2):
    """A fresh state of the same configuration, restored from the newest checkpoint."""
    key = jax.random.key(0)
    xs, _ = make_batches(0, 1, batch_size)
    template = create_state(
        key, xs[0], policy=policy, learning_rate=learning_rate, accumulate=accumulate
    )
    return jf.checkpoint.restore(workdir, template)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--policy", default="fp16-mixed")
    args = parser.parse_args()
    state, _ = train(args.workdir, steps=args.steps, policy=args.policy)
    restored = resume(args.workdir, policy=args.policy)
    print("restored step", int(restored.step), "loss scale", float(restored.loss_scale.loss_scale))


if __name__ == "__main__":
    main()
