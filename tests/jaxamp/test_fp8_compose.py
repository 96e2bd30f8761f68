"""jaxamp.fp8 with the rest of jaxamp: loss scaling (a skipped step keeps the fp8 state),
gradient accumulation (states combine by max), checkpoints, and sharded batches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
import jaxamp.fp8 as f8

pytestmark = pytest.mark.standard_promotion  # optax internals


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"])
    return h @ params["w2"]


def _setup(seed=0, batch=16):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.standard_normal((12, 32)) * 0.3, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((32, 4)) * 0.3, jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((batch, 12)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((batch, 4)), jnp.float32)
    return params, x, y


DELAYED = f8.get_recipe("delayed", emulate=True, amax_history_length=8)


def _delayed_loss(params, state, x, y, scale=jnp.float32(1.0)):
    out = f8.convert(_mlp, DELAYED)(params, x, fp8_state=state)
    return jnp.mean((out - y) ** 2) * scale


def test_skipped_loss_scaled_step_keeps_fp8_state():
    params, x, y = _setup()
    state = f8.init_state(_mlp, DELAYED, params, x)
    tx = jaxamp.loss_scaled(optax.sgd(0.1), jaxamp.DynamicLossScale.create(init_scale=2.0**4))

    @jax.jit
    def step(params, state, opt_state, x, y):
        scale = jaxamp.get_loss_scale(opt_state).loss_scale
        grads, new_state = jax.grad(_delayed_loss, argnums=(0, 1))(params, state, x, y, scale)
        updates, opt_state = tx.update(grads, opt_state, params)
        applied = jaxamp.amp_info(opt_state).last_step_applied
        return (
            optax.apply_updates(params, updates),
            f8.select_state(applied, new_state, state),
            opt_state,
        )

    opt_state = tx.init(params)
    # a NaN in the batch makes the gradients non-finite (fp8 casts saturate overflows, NaN
    # stays NaN): the step is skipped, params and fp8 state kept (the NaN amax is not recorded)
    p1, s1, opt_state = step(params, state, opt_state, x.at[0, 0].set(jnp.nan), y)
    assert not bool(jaxamp.amp_info(opt_state).last_step_applied)
    jax.tree.map(np.testing.assert_array_equal, p1, params)
    jax.tree.map(np.testing.assert_array_equal, s1, state)
    # a clean batch applies and the history moves
    p2, s2, opt_state = step(p1, s1, opt_state, x, y)
    assert bool(jaxamp.amp_info(opt_state).last_step_applied)
    name = "dot_general"
    assert float(s2[name].input_amax_history[0]) == float(jnp.max(jnp.abs(x)))
    assert np.all(np.isfinite(np.asarray(s2[name].output_grad_amax_history)))
    assert not np.array_equal(np.asarray(p2["w1"]), np.asarray(p1["w1"]))


@pytest.mark.slow
def test_accumulation_combines_states_by_max_like_the_full_batch():
    params, x, y = _setup(batch=16)
    state = f8.init_state(_mlp, DELAYED, params, x)
    grad = jax.jit(jax.grad(_delayed_loss, argnums=(0, 1)))
    _, state = grad(params, state, x, y)  # one warm step: scales no longer the initial ones
    _, full = grad(params, state, x, y)
    micro = [grad(params, state, x[i : i + 8], y[i : i + 8])[1] for i in (0, 8)]
    combined = f8.combine_states(*micro)
    for name in full:
        a, b = full[name], combined[name]
        # forward histories and every scale: exactly the full batch's
        for field in ("input_amax_history", "kernel_amax_history", "input_scale", "kernel_scale"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        np.testing.assert_array_equal(a.output_grad_scale, b.output_grad_scale)
        if name == "dot_general#1":  # the last layer: its grad_output is the loss gradient,
            # and a micro-batch mean weighs each example twice as much as the full batch's
            np.testing.assert_array_equal(
                b.output_grad_amax_history[0], 2 * a.output_grad_amax_history[0]
            )
        np.testing.assert_array_equal(
            a.output_grad_amax_history[1:], b.output_grad_amax_history[1:]
        )


@pytest.mark.slow
def test_fp8_under_multi_steps_applies_once_per_window():
    params, x, y = _setup()
    loss = f8.convert(
        lambda p, x, y: jnp.mean((_mlp(p, x) - y) ** 2), f8.get_recipe("rowwise", emulate=True)
    )
    tx = jaxamp.multi_steps(jaxamp.loss_scaled(optax.sgd(0.1)), 2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        scale = jaxamp.get_loss_scale(opt_state).loss_scale
        grads = jax.grad(lambda p: loss(p, x, y) * scale)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    p1, opt_state = step(params, opt_state, x[:8], y[:8])
    jax.tree.map(np.testing.assert_array_equal, p1, params)  # inside the window: no update
    p2, opt_state = step(p1, opt_state, x[8:], y[8:])
    g = [jax.jit(jax.grad(loss))(params, x[i : i + 8], y[i : i + 8]) for i in (0, 8)]
    want = jax.tree.map(lambda p, a, b: p - 0.1 * (a + b) / 2, params, *g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p2, want)


def test_delayed_state_checkpoint_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params, x, y = _setup()
    state = f8.init_state(_mlp, DELAYED, params, x)
    grad = jax.jit(jax.grad(_delayed_loss, argnums=(0, 1)))
    _, state = grad(params, state, x, y)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "fp8", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "fp8", jax.tree.map(jnp.zeros_like, state))
    assert isinstance(restored["dot_general"], f8.DelayedScalingState)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    # the next step from the restored state is bit-identical
    jax.tree.map(
        np.testing.assert_array_equal, grad(params, restored, x, y), grad(params, state, x, y)
    )


@pytest.mark.slow
def test_fp8_with_a_sharded_batch_matches_one_device():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    params, x, y = _setup(batch=32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    loss = f8.convert(
        lambda p, x, y: jnp.mean((_mlp(p, x) - y) ** 2), f8.get_recipe("tensorwise", emulate=True)
    )
    grad = jax.jit(jax.value_and_grad(loss))
    want = grad(params, x, y)
    got = grad(params, jax.device_put(x, batch), jax.device_put(y, batch))
    # tensorwise scales use the global amax, so the fp8 operands agree; only the reduction
    # order of the float32 sums can differ
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), got, want)
    state = f8.init_state(_mlp, DELAYED, params, x)
    new = jax.jit(jax.grad(_delayed_loss, argnums=1))(
        params, state, jax.device_put(x, batch), jax.device_put(y, batch)
    )
    assert float(new["dot_general"].input_amax_history[0]) == float(jnp.max(jnp.abs(x)))
