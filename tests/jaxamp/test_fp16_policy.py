"""A float16 policy at the default loss scale: the loss is float32 before it
is scaled, so 2**16 (inf in float16) never makes a step's gradients inf by the loss's own dtype;
checked against torch.autocast(float16) + GradScaler step by step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

F16_MAX = float(jnp.finfo(jnp.float16).max)


def _linear_ce(params, x, y):
    logits = x @ params["w"].T + params["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _problem(steps=6, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(4, 8)) * 0.3).astype(np.float32)
    b = np.zeros(4, np.float32)
    xs = rng.normal(size=(steps, 16, 8)).astype(np.float32)
    ys = rng.integers(0, 4, (steps, 16))
    return w, b, xs, ys


def test_default_scale_gradients_are_finite(maybe_jit):
    # On main the float16 loss took the cotangent 65536 = inf: every gradient was inf.
    w, b, xs, ys = _problem(steps=1)
    params = {"w": jnp.asarray(w), "b": jnp.asarray(b)}
    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    state = tx.init(params)
    grad_fn = maybe_jit(jaxamp.value_and_grad(_linear_ce, policy="fp16-mixed"))
    loss, grads = grad_fn(params, jnp.asarray(xs[0]), jnp.asarray(ys[0]), loss_scale=state)
    assert loss.dtype == jnp.float32
    for leaf in jax.tree.leaves(grads):
        assert leaf.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(leaf)))
    # The scaled gradients carry the scale: unscaled, they are the float32 gradients' size.
    reference = jax.jit(jax.grad(_linear_ce))  # the float32 reference, compiled once
    grads32 = reference(params, jnp.asarray(xs[0]), jnp.asarray(ys[0]))
    np.testing.assert_allclose(
        np.asarray(grads["w"]) / 65536.0, np.asarray(grads32["w"]), rtol=0, atol=2e-3
    )
    new_params, state = jaxamp.apply_gradients(tx, grads, state, params)
    assert bool(jaxamp.amp_info(state).last_step_finite)
    assert float(jaxamp.get_loss_scale(state).loss_scale) == 65536.0
    assert not np.array_equal(np.asarray(new_params["w"]), w)


def test_float16_loss_ops_run_in_float32_under_the_policy(maybe_jit):
    # torch's float16 autocast runs softmax/log/exp and losses in float32: so does the policy.
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32))

    def fn(p, x):
        return jnp.mean(jnp.exp(x * p))

    loss, grad = maybe_jit(jaxamp.value_and_grad(fn, policy="fp16-mixed"))(
        jnp.float32(1.5), x, loss_scale=jaxamp.StaticLossScale(2.0**16)
    )
    x16 = np.asarray(x.astype(jnp.float16).astype(jnp.float32))
    prod16 = (x16 * np.float32(1.5)).astype(np.float16).astype(np.float32)  # mul keeps float16
    expected = np.mean(np.exp(prod16, dtype=np.float32), dtype=np.float32)
    np.testing.assert_allclose(float(loss), expected, rtol=4 * 2.0**-24)
    assert bool(jnp.isfinite(grad))


def _torch_run(torch, steps=6, lr=0.1):
    """torch.autocast("cpu", float16) + GradScaler("cpu", growth_interval=3) on `_problem`."""
    w, b, xs, ys = _problem(steps)
    linear = torch.nn.Linear(8, 4)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w))
        linear.bias.copy_(torch.from_numpy(b))
    opt = torch.optim.SGD(linear.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    scales, gmax = [], []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(
                linear(torch.from_numpy(x)), torch.from_numpy(y)
            )
        assert loss.dtype == torch.float32  # torch computes the loss in float32
        scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        gmax.append(float(linear.weight.grad.abs().max()))
        scaler.step(opt)
        scaler.update()
    return scales, gmax, linear.weight.detach().numpy()


@pytest.mark.torch
def test_fp16_policy_follows_torch_gradscaler_from_the_default_scale(maybe_jit):
    """torch.autocast("cpu", float16) + GradScaler("cpu") against policy="fp16-mixed" +
    loss_scaled: no step skipped on either side, the same scale trajectory (growth every 3
    steps), the same scaled gradients' maxima to float16 rounding and params that agree."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order (the float16 weight gradient's sum)
    try:
        torch_scales, torch_gmax, torch_weight = _torch_run(torch)
    finally:
        torch.set_num_threads(threads)
    steps, lr = 6, 0.1
    w, b, xs, ys = _problem(steps)

    params = {"w": jnp.asarray(w), "b": jnp.asarray(b)}
    tx = jaxamp.loss_scaled(optax.sgd(lr), jaxamp.DynamicLossScale.create(growth_interval=3))
    state = tx.init(params)
    grad_fn = jaxamp.value_and_grad(_linear_ce, policy="fp16-mixed")

    @maybe_jit
    def step(params, state, x, y):
        _, grads = grad_fn(params, x, y, loss_scale=state)
        gmax = jnp.max(jnp.abs(grads["w"]))
        params, state = jaxamp.apply_gradients(tx, grads, state, params)
        return params, state, gmax

    jax_scales, jax_gmax = [], []
    for x, y in zip(xs, ys, strict=True):
        jax_scales.append(float(jaxamp.get_loss_scale(state).loss_scale))
        params, state, gmax = step(params, state, jnp.asarray(x), jnp.asarray(y))
        jax_gmax.append(float(gmax))
        assert bool(jaxamp.amp_info(state).last_step_finite)

    assert jax_scales == torch_scales == [65536.0] * 3 + [131072.0] * 3
    # The decisions are not near float16's edge (else the comparison would be a coin toss).
    assert max(torch_gmax) < F16_MAX / 1.5
    # float16 weight gradients (scaled) agree to a few float16 ulps.
    np.testing.assert_allclose(jax_gmax, torch_gmax, rtol=4 * 2.0**-10)
    # Each step moves params by lr * grad; float16 gradients carry 2**-10 relative error.
    atol = (
        steps
        * lr
        * 4
        * 2.0**-10
        * max(g / s for g, s in zip(torch_gmax, torch_scales, strict=True))
    )
    np.testing.assert_allclose(np.asarray(params["w"]), torch_weight, atol=atol)


def test_float16_master_params_refused(maybe_jit):
    # Params outside the policy's param dtype, for the bare helper (the Flax glue refused them already).
    params = {"w": jnp.ones((8, 4), jnp.float16), "b": jnp.zeros(4, jnp.float32)}
    grad_fn = maybe_jit(
        jaxamp.value_and_grad(
            lambda p, x: jnp.sum(x @ p["w"]) + jnp.sum(p["b"]), policy="fp16-mixed"
        )
    )
    with pytest.raises(
        TypeError, match=r"w \(float16; expected float32 or float64\).*cast_to_param"
    ):
        grad_fn(params, jnp.ones((2, 8)), loss_scale=jaxamp.DynamicLossScale.create())
    # In the policy's param dtype they are accepted (float16 params under fp16-true).
    half = jax.tree.map(lambda a: a.astype(jnp.float16), params)
    loss, grads = maybe_jit(
        jaxamp.value_and_grad(
            lambda p, x: jnp.sum(x @ p["w"]) + jnp.sum(p["b"]), policy="fp16-true"
        )
    )(half, jnp.ones((2, 8), jnp.float16))
    assert grads["w"].dtype == jnp.float16


def test_autocast_composites_do_not_round_through_the_traced_dtype(maybe_jit):
    """torch's mean of float32 values (exp's output on autocast's float32 list) is float32
    throughout, and its cross_entropy runs in float32 entirely: jnp.mean and optax's loss,
    traced with float16 inputs, must not cast back to float16 inside (on main they did, then
    cast up again: the value rounded to float16 and a 2**16 cotangent became inf)."""
    rng = np.random.default_rng(2)
    x16 = jnp.asarray(rng.normal(size=(4, 3)), jnp.float16)
    x32 = np.asarray(x16, np.float32)
    mean_exp = maybe_jit(
        jaxamp.autocast(lambda x: jnp.mean(jnp.exp(x)), device="cuda", dtype=jnp.float16)
    )
    out = mean_exp(x16)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(float(out), np.mean(np.exp(x32)), rtol=16 * 2.0**-24)

    labels = jnp.array([0, 2, 1, 1])
    ce = maybe_jit(
        jaxamp.autocast(
            lambda z: optax.softmax_cross_entropy_with_integer_labels(z, labels).mean(),
            device="cuda",
            dtype=jnp.float16,
        )
    )
    expected = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(x32), labels).mean()
    np.testing.assert_allclose(float(ce(x16)), float(expected), rtol=16 * 2.0**-24)
    # The scaled cotangent reaches the float16 logits divided by the batch: finite at 2**16.
    grad = jax.grad(lambda z: ce(z).astype(jnp.float32) * 65536.0)(x16)
    assert grad.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(grad)))
