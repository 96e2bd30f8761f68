"""The gradient signals the harness's JAX train step records (parity.training.steps.observed_step):
``grad_norm`` is the norm of the gradients the optimizer inside ``jaxamp.loss_scaled`` receives,
``max_scaled_grad`` each parameter's largest scaled gradient (only where asked: a run without loss
scaling records none), ``update_norm`` the norm of the parameters' change."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from parity.training import steps


class _Seen(NamedTuple):
    norm: jax.Array


def _seen() -> optax.GradientTransformation:
    """Passes its updates through and keeps their global float32 norm (torch's clip_grad_norm_
    formula, as the harness's clipping computes it) in its state."""

    def init(params):
        del params
        return _Seen(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None):
        del state, params
        leaves = jax.tree_util.tree_leaves(updates)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))
        return updates, _Seen(norm)

    return optax.GradientTransformation(init, update)


def _loss(params, x, y):
    hidden = jnp.tanh(x @ params["w"].astype(jnp.float32))
    return jnp.mean(jnp.square(hidden @ params["v"].astype(jnp.float32) - y))


@pytest.mark.parametrize(
    ("dtype", "loss_scale", "max_scaled_grad"),
    [
        ("float32", None, False),
        # a scale that is not a power of two: x / scale and x * float32(1 / scale) differ
        ("float32", 3000.0, True),
        ("bfloat16", None, False),
    ],
)
def test_signals_are_the_optimizers_gradients_and_the_parameters_change(
    dtype, loss_scale, max_scaled_grad
):
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(8, 16)), dtype),
        "v": jnp.asarray(rng.normal(size=(16, 4)), dtype),
    }
    scale = (
        jaxamp.NoOpLossScale()
        if loss_scale is None
        else jaxamp.DynamicLossScale.create(init_scale=loss_scale, growth_interval=2)
    )
    tx = jaxamp.loss_scaled(
        optax.chain(_seen(), steps.clip_by_global_norm_torch(1.0), optax.sgd(0.05, momentum=0.9)),
        scale,
    )
    grad_fn = jaxamp.value_and_grad(_loss)
    step = jax.jit(steps.observed_step(grad_fn, tx, feed_lr=False, max_scaled_grad=max_scaled_grad))
    scaled_grads = jax.jit(lambda p, s, x, y: grad_fn(p, x, y, loss_scale=s)[1])
    opt_state = tx.init(params)
    for _ in range(6):
        x = rng.normal(size=(6, 8)).astype(np.float32)
        y = rng.normal(size=(6, 4)).astype(np.float32)
        grads = scaled_grads(params, opt_state, x, y)
        new_params, opt_state, _, metrics = step(params, opt_state, jnp.float32(0), x, y)
        assert not bool(metrics["skipped"])
        seen = opt_state.inner_state[0]
        # the norm of what the optimizer received, bit for bit (torch: after unscale_)
        assert np.asarray(metrics["grad_norm"]).tobytes() == np.asarray(seen.norm).tobytes()
        change = [
            np.asarray(n, np.float64) - np.asarray(o, np.float64)
            for n, o in zip(jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True)
        ]
        expected = np.sqrt(sum(np.sum(np.square(c)) for c in change))
        assert float(metrics["update_norm"]) == pytest.approx(expected, rel=1e-6)
        if max_scaled_grad:
            assert metrics["max_scaled_grad"] == {
                k: np.max(np.abs(np.asarray(g, np.float32))) for k, g in grads.items()
            }
        else:
            assert "max_scaled_grad" not in metrics  # not computed: nothing records it
        params = new_params
