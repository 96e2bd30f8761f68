"""The loss and the evaluation metric of each task, one definition per framework side by side.

Both return float32 scalars: mean cross-entropy in float32 (``lm``: over all tokens), mean squared
error in float32 (``regression``); the metric is accuracy for classification, else the loss.
This module imports no torch at import time (`parity.training.train_jax` and `parity.core.records` use it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "TASKS",
    "check_task",
    "eval_metric_jax",
    "eval_metric_name",
    "eval_metric_torch",
    "loss_jax",
    "loss_torch",
]

TASKS = ("classification", "lm", "regression")


def check_task(task: Any) -> None:
    """Raises ValueError unless `task` is one of `TASKS`."""
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}, got {task!r}.")


def loss_torch(task: str, logits: Any, targets: Any) -> Any:
    """Mean cross-entropy in float32 (LM: over all tokens); regression: mean squared error in
    float32. Returns a float32 scalar."""
    import torch  # torch: optional for JAX users (the JAX trainer never imports it)

    check_task(task)
    logits = logits.float()
    if task == "regression":
        return torch.mean(torch.square(logits - targets.float()))
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long()
    )


def loss_jax(task: str, logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy in float32 (LM: over all tokens); regression: mean squared error in
    float32. Returns a float32 scalar."""
    check_task(task)
    if task == "regression":
        return jnp.mean(jnp.square(logits.astype(jnp.float32) - targets.astype(jnp.float32)))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, targets.astype(jnp.int32)[..., None], axis=-1)
    return -jnp.mean(picked)


def eval_metric_name(task: str) -> str:
    """``"accuracy"`` (higher is better) for classification, ``"loss"`` (lower) for lm and
    regression (mean squared error)."""
    check_task(task)
    return "accuracy" if task == "classification" else "loss"


def eval_metric_torch(task: str, logits: Any, targets: Any) -> Any:
    """Accuracy (classification) or mean cross-entropy (lm) of one batch, float32 scalar."""
    check_task(task)
    if task == "classification":
        return (logits.argmax(dim=-1) == targets.long()).float().mean()
    return loss_torch(task, logits, targets)


def eval_metric_jax(task: str, logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Accuracy (classification) or mean cross-entropy (lm) of one batch, float32 scalar."""
    check_task(task)
    if task == "classification":
        hits = jnp.argmax(logits, axis=-1).astype(jnp.int32) == targets.astype(jnp.int32)
        return jnp.mean(hits.astype(jnp.float32))
    return loss_jax(task, logits, targets)
