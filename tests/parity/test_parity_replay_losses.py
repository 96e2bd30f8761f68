"""Losses on identical logits: torch's cross-entropy (mean over non-ignored tokens, optional
label smoothing) against JAX ports; each loss bug planted on the JAX side is named, correct
ports pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from parity.replay.losses import IGNORE_INDEX, compare_losses, loss_cases

pytestmark = pytest.mark.standard_promotion

B, T, V = 4, 16, 50


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    logits = [rng.normal(size=(B, T, V)).astype(np.float32) for _ in range(2)]
    targets = [rng.integers(0, V, size=(B, T)) for _ in range(2)]
    targets[1][:, -3:] = IGNORE_INDEX  # padding: the real data holds ignored targets
    return logits, targets


def torch_ce(smoothing=0.0):
    def loss(x, y):
        return torch.nn.functional.cross_entropy(
            x.float().reshape(-1, V), y.reshape(-1).long(), label_smoothing=smoothing
        )

    return loss


def _masked(y):
    mask = y != IGNORE_INDEX
    return mask, jnp.where(mask, y, 0)


def jax_ce(smoothing=0.0):
    def loss(x, y):
        mask, safe = _masked(y)
        labels = optax.smooth_labels(jax.nn.one_hot(safe, V), smoothing)
        per_token = optax.softmax_cross_entropy(x.astype(jnp.float32), labels)
        return jnp.sum(per_token * mask) / jnp.maximum(mask.sum(), 1)

    return loss


def jax_sum(x, y):
    mask, safe = _masked(y)
    per_token = optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), safe)
    return jnp.sum(per_token * mask)


def jax_all_tokens(x, y):
    mask, safe = _masked(y)
    per_token = optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), safe)
    return jnp.mean(per_token * mask)


def jax_unmasked(x, y):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), y))


def jax_sequence_weighted(x, y):
    mask, safe = _masked(y)
    per_token = optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), safe)
    return jnp.mean((per_token * mask).sum(1) / jnp.maximum(mask.sum(1), 1))


def jax_naive_softmax(x, y):
    mask, safe = _masked(y)
    probs = jnp.exp(x) / jnp.exp(x).sum(-1, keepdims=True)
    picked = jnp.take_along_axis(probs, safe[..., None], -1)[..., 0]
    return jnp.sum(-jnp.log(picked) * mask) / jnp.maximum(mask.sum(), 1)


def jax_z_loss(x, y):
    mask, safe = _masked(y)
    x = x.astype(jnp.float32)
    per_token = optax.softmax_cross_entropy_with_integer_labels(x, safe)
    per_token = per_token + 1e-4 * jax.nn.logsumexp(x, -1) ** 2
    return jnp.sum(per_token * mask) / jnp.maximum(mask.sum(), 1)


CORRECT = {
    "mean over non-ignored tokens": (torch_ce(), jax_ce()),
    "label smoothing 0.1 both sides": (torch_ce(0.1), jax_ce(0.1)),
}

MUTATIONS = {
    "sum vs mean": (torch_ce(), jax_sum, "value", "sum vs mean: ratio 64/52 = non-ignored tokens"),
    "label smoothing missing on JAX": (
        torch_ce(0.1),
        jax_ce(),
        "value",
        "label smoothing 0.1 on the torch side",
    ),
    "label smoothing on JAX only": (
        torch_ce(),
        jax_ce(0.1),
        "value",
        "label smoothing 0.1 on the JAX side",
    ),
    "ignored tokens in the divisor": (
        torch_ce(),
        jax_all_tokens,
        "value",
        "divides by every token",
    ),
    "ignore-index not masked": (torch_ce(), jax_unmasked, "finite", "not masked on the JAX side"),
    "sequence-weighted mean": (torch_ce(), jax_sequence_weighted, "value", "sequence-weighted"),
    "unstabilised softmax": (torch_ce(), jax_naive_softmax, "finite", "extreme logits"),
    "z-loss on JAX only": (torch_ce(), jax_z_loss, "value", "z-loss (0.0001 x logsumexp^2)"),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_losses_pass(batches, name, jit):
    torch_loss, jax_loss = CORRECT[name]
    finding, rows = compare_losses("lm", torch_loss, jax_loss, *batches, jit=jit)
    assert finding is None, finding.message
    assert [r["case"] for r in rows] == [
        "batch 0",
        "batch 1",
        "ignore-index",
        "all-masked row",
        "extreme logits bfloat16",
        "extreme logits float16",
    ]


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_loss_mutation_named(batches, name):
    torch_loss, jax_loss, quantity, words = MUTATIONS[name]
    # every other mutation jitted (the unstabilised softmax among them): eager and jitted alike
    jit = list(MUTATIONS).index(name) % 2 == 0
    finding, _ = compare_losses("lm", torch_loss, jax_loss, *batches, jit=jit)
    assert finding is not None, f"{name}: not caught"
    assert finding.quantity == quantity, finding.message
    assert words in finding.message, finding.message


def test_classification_cases():
    logits = [np.random.default_rng(1).normal(size=(8, 5)).astype(np.float32)]
    targets = [np.arange(8) % 5]
    names = [c[0] for c in loss_cases("classification", logits, targets)]
    assert names == ["batch 0", "ignore-index", "extreme logits bfloat16", "extreme logits float16"]
    # regression has no class targets: the real batches only
    assert [c[0] for c in loss_cases("regression", logits, logits)] == ["batch 0"]


def test_ignored_targets_decide_only_where_the_data_has_them(batches):
    logits, targets = batches
    clean = [np.where(y == IGNORE_INDEX, 0, y) for y in targets]
    finding, _ = compare_losses("lm", torch_ce(), jax_all_tokens, logits, clean, jit=False)
    assert finding.case == "ignore-index" and finding.decisive is False
    assert "hold no -100 targets" in finding.message
    finding, _ = compare_losses("lm", torch_ce(), jax_all_tokens, logits, targets, jit=False)
    assert finding.decisive is True


def test_an_edge_case_torch_does_not_survive_is_informational(batches):
    """torch's label-smoothed loss computed in float16 overflows on extreme logits; a JAX loss
    that upcasts does not: a note, not the port's failure."""

    def torch_in_input_dtype(x, y):
        return torch.nn.functional.cross_entropy(
            x.reshape(-1, V), y.reshape(-1).long(), label_smoothing=0.1
        )

    finding, _ = compare_losses("lm", torch_in_input_dtype, jax_ce(0.1), *batches, jit=False)
    assert finding is not None and finding.decisive is False
    assert finding.case == "extreme logits float16"
    assert "torch's own loss overflows here" in finding.message
