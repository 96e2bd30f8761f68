"""`init` hands back fresh buffers on every call: a jitted step that donates one state must not
delete the buffers of the next state `init` makes (accelerator users donate every step)."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.optim_precision import adamw_4bit, adamw_8bit, adamw_fp8

PARAMS = {"w": jnp.ones((4, 64), jnp.float32), "b": jnp.ones((4,), jnp.float32)}
BF16_PARAMS = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)

# Every jaxamp transformation whose state holds arrays, with the params it steps.
TRANSFORMATIONS = {
    "loss_scaled_dynamic": (lambda: jaxamp.loss_scaled(optax.adam(1e-3)), PARAMS),
    "loss_scaled_static": (
        lambda: jaxamp.loss_scaled(optax.sgd(0.1), jaxamp.StaticLossScale(8.0)),
        PARAMS,
    ),
    "loss_scaled_noop": (
        lambda: jaxamp.loss_scaled(optax.sgd(0.1), jaxamp.NoOpLossScale()),
        PARAMS,
    ),
    "loss_scaled_jmp_dynamic": (
        lambda: jaxamp.loss_scaled(
            optax.sgd(0.1), jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float32))
        ),
        PARAMS,
    ),
    "loss_scaled_jmp_static": (
        lambda: jaxamp.loss_scaled(optax.sgd(0.1), jmp.StaticLossScale(jnp.float32(4.0))),
        PARAMS,
    ),
    "loss_scaled_provenance": (
        lambda: jaxamp.loss_scaled(optax.sgd(0.1), provenance=True),
        PARAMS,
    ),
    "loss_scaled_groups": (
        lambda: jaxamp.loss_scaled(
            {"a": optax.sgd(0.1), "b": optax.adam(1e-3)}, param_labels={"w": "a", "b": "b"}
        ),
        PARAMS,
    ),
    "multi_steps": (lambda: jaxamp.multi_steps(jaxamp.loss_scaled(optax.sgd(0.1)), 2), PARAMS),
    "stochastic_rounding_int_seed": (
        lambda: jaxamp.optim_precision.stochastic_rounding(optax.sgd(0.1), seed=3),
        BF16_PARAMS,
    ),
    "stochastic_rounding_key": (
        lambda: jaxamp.optim_precision.stochastic_rounding(optax.sgd(0.1), seed=jax.random.key(3)),
        BF16_PARAMS,
    ),
    "kahan_summation": (
        lambda: jaxamp.optim_precision.kahan_summation(optax.sgd(0.1)),
        BF16_PARAMS,
    ),
    "low_precision_state_bf16": (
        lambda: jaxamp.optim_precision.low_precision_state(optax.adam(1e-3), "bf16"),
        PARAMS,
    ),
    "adamw_8bit": (lambda: adamw_8bit(1e-3, min_size=0), PARAMS),
    "adamw_4bit": (lambda: adamw_4bit(1e-3, min_size=0), PARAMS),
    "adamw_fp8": (lambda: adamw_fp8(1e-3, min_size=0), PARAMS),
}


def _live(tree) -> list[str]:
    """The paths of the array leaves of `tree` that were deleted (donated elsewhere)."""
    return [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if isinstance(leaf, jax.Array) and leaf.is_deleted()
    ]


@pytest.mark.standard_promotion
@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_init_after_a_donated_step_returns_live_buffers(name):
    """Donate the state `init` made, then `init` again: every leaf of the new state is a
    live buffer of its own, and the next donated step runs."""
    make, params = TRANSFORMATIONS[name]
    tx = make()
    grads = jax.tree.map(jnp.ones_like, params)
    step = jax.jit(lambda s: tx.update(grads, s, params), donate_argnums=(0,))
    first = tx.init(params)
    # Host (NumPy) leaves are copied to the device on every call: only device arrays count.
    first_ids = {id(x) for x in jax.tree.leaves(first) if isinstance(x, jax.Array)}
    jax.block_until_ready(step(first))
    second = tx.init(params)
    assert _live(second) == [], f"{name}: init returned donated buffers"
    shared = [x for x in jax.tree.leaves(second) if isinstance(x, jax.Array) and id(x) in first_ids]
    assert shared == [], f"{name}: init handed back {len(shared)} array(s) of an earlier state"
    updates, third = jax.block_until_ready(step(second))
    assert all(np.isfinite(np.asarray(u, np.float32)).all() for u in jax.tree.leaves(updates))
    assert _live(third) == []
