"""The optax port of `torch_loop` (imports no torch): the param groups become a mask, the
LambdaLR an optax schedule, the clipping the chain's first transformation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from examples.training_loop import CLIP, LR, SMOOTHING, STEPS, WARMUP, WEIGHT_DECAY

__all__ = ["forgot_the_mask", "loss", "optimizer"]

schedule = optax.warmup_cosine_decay_schedule(0.0, LR, WARMUP, STEPS)


def matrices_only(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def optimizer() -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(schedule, weight_decay=WEIGHT_DECAY, mask=matrices_only),
    )


def forgot_the_mask() -> optax.GradientTransformation:
    """The port people write first: weight decay on every tensor."""
    return optax.chain(
        optax.clip_by_global_norm(CLIP), optax.adamw(schedule, weight_decay=WEIGHT_DECAY)
    )


def loss(logits, targets):
    """torch's cross_entropy(label_smoothing=...), ignore_index -100 masked as torch does."""
    keep = targets != -100
    onehot = jax.nn.one_hot(jnp.where(keep, targets, 0), logits.shape[-1])
    losses = optax.softmax_cross_entropy(
        logits.astype(jnp.float32), optax.smooth_labels(onehot, SMOOTHING)
    )
    return jnp.sum(losses * keep) / jnp.maximum(keep.sum(), 1)
