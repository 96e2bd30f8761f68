"""Image classifier: a linen CNN with BatchNorm, trained under a jaxamp policy.

What jaxamp does here, in a few lines (see `create_train_state` and `train_step`):

* ``jf.linen.with_policy(model.init, policy)`` creates every param in its param dtype;
* ``jf.TrainState.create(..., policy=policy)`` runs ``apply_fn`` under per-module policies
  (BatchNorm computes in float32 by default) and wraps the optimizer in ``jaxamp.loss_scaled``
  (a dynamic loss scale for float16 policies, none otherwise);
* ``state.value_and_grad`` scales the loss; ``state.apply_gradients`` unscales, skips non-finite
  steps and adjusts the scale. The model code itself knows nothing about precision.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
import jaxamp.flax as jf
from examples import utils
from examples.image_classifier.config import Config
from parity import data as data_lib


class CNN(nn.Module):
    """conv-BatchNorm-relu-pool stages, global average pooling, a dense head."""

    widths: tuple[int, ...]
    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool):
        for width in self.widths:
            x = nn.Conv(width, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.mean(axis=(1, 2))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(self.num_classes)(x)


class TrainState(jf.TrainState):
    batch_stats: Any = None


def make_data(config: Config) -> data_lib.BatchStream:
    """Synthetic images by default; Fashion-MNIST or CIFAR-10 read from `config.data_dir`."""
    if config.dataset == "synthetic":
        shape = (config.image_size, config.image_size, 3)
        return data_lib.synthetic_images(config.seed, config.batch_size, shape, config.num_classes)
    if config.dataset in ("fashion_mnist", "cifar10"):
        if not config.data_dir:
            raise ValueError(
                f"dataset={config.dataset!r} needs data_dir (the folder with its files); "
                "nothing is downloaded. Use dataset='synthetic' to run without files."
            )
        loader = (
            data_lib.load_fashion_mnist
            if config.dataset == "fashion_mnist"
            else data_lib.load_cifar10
        )
        return loader(config.data_dir).stream(config.seed, config.batch_size)
    raise ValueError(
        f"dataset must be 'synthetic', 'fashion_mnist' or 'cifar10'; got {config.dataset!r}."
    )


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def create_train_state(config: Config, stream: data_lib.BatchStream) -> TrainState:
    policy = jaxamp.get_policy(config.precision)
    model = CNN(widths=tuple(config.widths), num_classes=stream.num_classes)
    example = jnp.zeros((1, *stream.input_shape), jnp.float32)
    init = jf.linen.with_policy(functools.partial(model.init, train=False), policy)
    variables = jax.jit(init)(jax.random.key(config.seed), example)  # one compile, not one per op
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        config.learning_rate,
        config.warmup_steps,
        max(config.num_steps, config.warmup_steps + 1),
    )
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.adamw(schedule, weight_decay=config.weight_decay),
        policy=policy,
    )


@jax.jit
def train_step(state: TrainState, images: jax.Array, labels: jax.Array):
    def loss_fn(params, images, labels):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            images,
            train=True,
            mutable=["batch_stats"],
        )
        return cross_entropy(logits, labels), updates["batch_stats"]

    (loss, batch_stats), grads = state.value_and_grad(loss_fn, has_aux=True)(
        state.params, images, labels
    )
    new_state = state.apply_gradients(grads=grads)
    # Unlike torch (whose forward pass updates BatchNorm statistics even on a skipped step),
    # a skipped step leaves the statistics alone too: they may hold the overflow.
    finite = new_state.amp_info().last_step_finite
    batch_stats = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old), batch_stats, state.batch_stats
    )
    return new_state.replace(batch_stats=batch_stats), loss, new_state.amp_info()


@jax.jit
def eval_step(state: TrainState, images: jax.Array, labels: jax.Array):
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    logits = state.apply_fn(variables, images, train=False)
    return cross_entropy(logits, labels), (logits.argmax(-1) == labels).mean()


def evaluate(state: TrainState, stream: data_lib.BatchStream) -> dict[str, float]:
    results = [eval_step(state, jnp.asarray(x), jnp.asarray(y)) for x, y in stream.eval_batches()]
    losses, accuracies = zip(*jax.device_get(results), strict=True)
    return {"loss": float(np.mean(losses)), "accuracy": float(np.mean(accuracies))}


def train_and_evaluate(config: Config, workdir: str) -> dict[str, Any]:
    """Trains, evaluates every `eval_every` steps, writes metrics.json and loss.png.

    Returns:
      The metrics dict written to ``workdir/metrics.json``.
    """
    workdir_path = Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    stream = make_data(config)
    state = create_train_state(config, stream)
    pending, steps, evals = [], [], []
    start = time.perf_counter()
    for step in utils.progress(
        range(config.num_steps), total=config.num_steps, enabled=config.progress, desc="train"
    ):
        images, labels = stream.batch(step)
        state, loss, info = train_step(state, jnp.asarray(images), jnp.asarray(labels))
        pending.append((step, loss, info))  # fetched in bulk: no host sync per step
        last = step == config.num_steps - 1
        if (step + 1) % config.eval_every == 0 or last:
            steps.extend(utils.fetch_step_records(pending))
            pending = []
            evals.append({"step": step + 1, **evaluate(state, stream)})
    elapsed = time.perf_counter() - start
    policy = state.policy
    metrics = {
        "example": "image_classifier",
        "precision": config.precision,
        "policy": str(policy),
        "config": dataclasses.asdict(config),
        "versions": {"jax": jax.__version__, "jaxamp": jaxamp.__version__},
        "num_params": int(sum(np.size(p) for p in jax.tree.leaves(state.params))),
        "steps": steps,
        "eval": evals,
        "summary": {
            "final_loss": steps[-1]["loss"] if steps else float("nan"),
            "eval_accuracy": evals[-1]["accuracy"] if evals else float("nan"),
            "eval_loss": evals[-1]["loss"] if evals else float("nan"),
            "skipped_steps": int(sum(s["skipped"] for s in steps)),
            "final_loss_scale": steps[-1]["loss_scale"] if steps else None,
            "wall_time_s": elapsed,
        },
    }
    utils.write_json_atomic(workdir_path / "metrics.json", metrics)
    utils.plot_losses(
        workdir_path / "loss.png",
        [s["step"] for s in steps],
        [s["loss"] for s in steps],
        title=f"image classifier ({config.dataset}, {config.precision})",
        loss_scales=[s["loss_scale"] for s in steps],
    )
    return metrics
