"""Defects once found in the loss-scaling core, each test failing before its fix: unscaling at
the largest scales, one skip mechanism for linen and NNX, float16 master weights refused, float16
overflow when unscaling, several optimizers under one scaler, and adversarial configurations,
states and gradients. Parity claims run torch's GradScaler("cpu") and flax's DynamicScale
themselves.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
import jaxamp.flax as jf
from jaxamp._optim import apply_updates

# optax's own arithmetic is not strict-promotion clean (float ** int32 in bias correction).
pytestmark = pytest.mark.standard_promotion

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
INT32_MAX = int(np.iinfo(np.int32).max)


def _bytes_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _all_finite_host(tree):
    return all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(tree))


# --- unscaling is exact at the largest scales -----------------------------------------------------

EXTREME_SCALES = [2.0**126, 1.5 * 2.0**126, 2.0**127, 1.75 * 2.0**127, F32_MAX]


def _torch_unscale(grad: np.ndarray, scale: float) -> np.ndarray:
    torch = pytest.importorskip("torch")
    tensor = torch.from_numpy(grad.astype(np.float32))
    param = torch.nn.Parameter(torch.zeros_like(tensor))
    param.grad = tensor.clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as in a training step
    scaler.unscale_(torch.optim.SGD([param], lr=1.0))
    return param.grad.numpy()


@pytest.mark.parametrize("scale", EXTREME_SCALES, ids=lambda s: f"{s:.4g}")
def test_unscale_exact_at_extreme_scales_like_torch(scale, float_dtype, maybe_jit):
    rng = np.random.default_rng(0)
    # Gradients of a scaled loss at these scales are themselves huge.
    grad = (rng.uniform(1, 2, 64) * 2.0 ** rng.integers(100, 127, 64)).astype(np.float32)
    grad[0] = 2.0**126
    grad = np.asarray(jnp.asarray(grad).astype(float_dtype).astype(jnp.float32))
    loss_scale = jaxamp.DynamicLossScale.create(init_scale=scale)
    out = maybe_jit(lambda s, g: s.unscale(g))(loss_scale, jnp.asarray(grad, float_dtype))
    assert out.dtype == float_dtype
    # torch computes in float32 and rounds once to the gradient's dtype (it refuses float16
    # gradients; bfloat16 ones it unscales the same way).
    ref = jnp.asarray(_torch_unscale(grad, scale)).astype(float_dtype)
    normal = np.abs(np.asarray(ref, np.float32)) >= F32_TINY
    assert normal.sum() > 10
    assert np.asarray(out)[normal].tobytes() == np.asarray(ref)[normal].tobytes(), (
        "unscaled gradients differ from torch's (a flushed subnormal reciprocal gives zeros)"
    )


def test_unscale_at_2_127_moves_parameters(maybe_jit):
    # The step must not count as applied while the parameters stay put.
    params = {"w": jnp.ones((3,), jnp.float32)}
    tx = jaxamp.loss_scaled(optax.sgd(0.5), jaxamp.DynamicLossScale.create(init_scale=2.0**127))
    state = tx.init(params)
    grads = {"w": jnp.full((3,), 2.0**126, jnp.float32)}  # unscaled: 0.5
    updates, state = maybe_jit(tx.update)(grads, state, params)
    new = apply_updates(params, updates, state)
    np.testing.assert_array_equal(np.asarray(new["w"]), np.full(3, 0.75, np.float32))
    assert bool(jaxamp.amp_info(state).last_step_applied)


# --- one skip mechanism, linen and NNX alike ------------------------------------------------------


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(8)(x))  # Dense_0
        return nn.Dense(3)(hidden)


class _NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.Dense_0 = nnx.Linear(4, 8, rngs=rngs)
        self.Dense_1 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.Dense_1(nnx.relu(self.Dense_0(x)))


X = jnp.linspace(-1.0, 1.0, 8 * 4, dtype=jnp.float32).reshape(8, 4)


def _poison(tree, on):
    return jax.tree.map(lambda g: jnp.where(on, jnp.nan, g), tree)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp32", "fp16-mixed"])
def test_nan_step_skips_completely_linen_and_nnx(policy, maybe_jit):
    model = _LinenMLP()
    params = jf.linen.with_policy(model.init, policy)(jax.random.key(0), X)["params"]
    state = jf.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-2), policy=policy
    )

    # The gradients compiled in each form (they have no eager-only path); what jit can change,
    # the skip decision (eagerly a concrete one), runs as given.
    @jax.jit
    def grads_of(state):
        def loss_fn(p, x):
            return state.apply_fn({"params": p}, x).astype(jnp.float32).mean()

        return state.value_and_grad(loss_fn)(state.params, X)[1]

    def linen_step(state, poison):
        return state.apply_gradients(grads=_poison(grads_of(state), poison))

    linen_step = maybe_jit(linen_step)
    state = linen_step(state, jnp.array(False))
    before = state
    state = linen_step(state, jnp.array(True))
    # Skipped completely: params, inner optimizer state, step; telemetry says so.
    _bytes_equal(state.params, before.params)
    _bytes_equal(state.opt_state.inner_state, before.opt_state.inner_state)
    assert int(state.step) == int(before.step) == 1
    info = state.amp_info()
    assert not bool(info.last_step_applied) and int(info.skipped_steps) == 1
    state = linen_step(state, jnp.array(False))  # the next finite step is clean
    assert _all_finite_host(state.params) and _all_finite_host(state.opt_state)
    assert int(state.step) == 2

    # NNX: the same weights, the same decisions, the same numbers.
    nnx_model = _NNXMLP(nnx.Rngs(0))
    for name in ("Dense_0", "Dense_1"):
        layer = getattr(nnx_model, name)
        layer.kernel[...] = params[name]["kernel"]
        layer.bias[...] = params[name]["bias"]
    jf.nnx.apply_policy(nnx_model, policy)
    optimizer = jf.Optimizer(nnx_model, optax.adam(1e-2), wrt=nnx.Param, policy=policy)

    @nnx.jit
    def nnx_grads_of(model, optimizer):
        grad_fn = jf.nnx_value_and_grad(lambda m, x: m(x).astype(jnp.float32).mean())
        return grad_fn(model, X, loss_scale=optimizer)[1]

    def nnx_step(model, optimizer, poison):
        optimizer.update(model, _poison(nnx_grads_of(model, optimizer), poison))
        return optimizer.amp_info()

    nnx_step = nnx.jit(nnx_step) if maybe_jit is jax.jit else nnx_step
    nnx_step(nnx_model, optimizer, jnp.array(False))
    params_before = nnx.state(nnx_model, nnx.Param)
    opt_before = jax.tree.map(np.asarray, nnx.as_pure(optimizer.opt_state))
    info = nnx_step(nnx_model, optimizer, jnp.array(True))
    _bytes_equal(nnx.state(nnx_model, nnx.Param), params_before)
    _bytes_equal(nnx.as_pure(optimizer.opt_state).inner_state, opt_before.inner_state)
    assert int(optimizer.step[...]) == 1
    assert not bool(info.last_step_applied) and int(info.skipped_steps) == 1
    nnx_step(nnx_model, optimizer, jnp.array(False))
    assert _all_finite_host(nnx.state(nnx_model, nnx.Param))
    assert int(optimizer.step[...]) == 2


def _loss_scales():
    return {
        "noop": jaxamp.NoOpLossScale(),
        "static": jaxamp.StaticLossScale(4.0),
        "dynamic": jaxamp.DynamicLossScale.create(),
    }


_FLOAT_DTYPE_NAMES = ("float16", "bfloat16", "float32")


@functools.cache
def _nan_steps(cases, jitted):
    """{(loss scale name, gradient dtype name): (state, updates, new state)} of one adam step on
    gradients with a NaN, for each case in `cases`: under jit every case in one program (nine
    near-identical updates: one XLA compile), shared by the tests."""
    params = {"w": jnp.ones((3,), jnp.float32)}
    txs = {case: jaxamp.loss_scaled(optax.adam(1e-2), _loss_scales()[case[0]]) for case in cases}
    states = {case: tx.init(params) for case, tx in txs.items()}
    grads = {case: {"w": jnp.array([1.0, jnp.nan, 1.0], case[1])} for case in cases}

    def update(grads, states, params):
        return {case: txs[case].update(grads[case], states[case], params) for case in cases}

    out = (jax.jit(update) if jitted else update)(grads, states, params)
    return {case: (states[case], *out[case]) for case in cases}


@pytest.mark.parametrize("loss_scale", ["noop", "static", "dynamic"])
def test_every_loss_scale_type_skips_a_nan_step(loss_scale, float_dtype, maybe_jit):
    params = {"w": jnp.ones((3,), jnp.float32)}
    jitted = maybe_jit is jax.jit
    cases = (
        tuple((n, d) for n in _loss_scales() for d in _FLOAT_DTYPE_NAMES)
        if jitted
        else ((loss_scale, float_dtype.name),)
    )
    state, updates, new_state = _nan_steps(cases, jitted)[loss_scale, float_dtype.name]
    _bytes_equal(new_state.inner_state, state.inner_state)
    new_params = apply_updates(params, updates, new_state)
    _bytes_equal(new_params, params)
    _bytes_equal(optax.apply_updates(params, updates), params)
    info = jaxamp.amp_info(new_state)
    assert not bool(info.last_step_applied) and int(info.skipped_steps) == 1


# --- params outside the policy's param dtype are refused ------------------------------------------


def test_float16_master_weights_are_refused():
    model = _LinenMLP()
    params = model.init(jax.random.key(0), X)["params"]
    half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    with pytest.raises(TypeError, match=r"Dense_0/kernel \(float16; expected float32\)") as err:
        jf.TrainState.create(
            apply_fn=model.apply, params=half, tx=optax.adam(1e-3), policy="fp16-mixed"
        )
    assert "cast_to_param" in str(err.value)
    # Under the policy's own dtype (or a per-module rule's) it is accepted.
    jf.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-3), policy="fp16-mixed"
    )
    jf.TrainState.create(apply_fn=model.apply, params=half, tx=optax.adam(1e-3), policy="fp16-true")
    nnx_model = _NNXMLP(nnx.Rngs(0))
    for layer in (nnx_model.Dense_0, nnx_model.Dense_1):
        layer.kernel.set_value(layer.kernel.get_value().astype(jnp.float16))
    with pytest.raises(TypeError, match=r"Dense_0/kernel \(float16; expected float32\)"):
        jf.Optimizer(nnx_model, optax.adam(1e-3), wrt=nnx.Param, policy="fp16-mixed")


# --- fp16 overflow when unscaling -----------------------------------------------------------------


def _overflowing_loss(p):
    # d(scale * loss)/dp = ((scale * 1e20) * 1e19): finite for a scale of 1/8, but the
    # unscaled gradient (1e39) overflows float32.
    return jnp.sum((p * jnp.float32(1e19)) * jnp.float32(1e20))


def test_flax_preset_below_one_skips_like_flax(maybe_jit):
    from flax.training.dynamic_scale import DynamicScale

    params = {"w": jnp.ones((2,), jnp.float32)}
    flax_scale = DynamicScale(scale=jnp.float32(0.125))
    _, flax_finite, _, _ = flax_scale.value_and_grad(lambda p: _overflowing_loss(p["w"]))(params)
    assert not bool(flax_finite)
    loss_scale = jaxamp.DynamicLossScale.from_preset("flax", init_scale=0.125)
    tx = jaxamp.loss_scaled(optax.sgd(1.0), loss_scale)
    state = tx.init(params)
    grads = jax.grad(lambda p: _overflowing_loss(p["w"]) * 0.125)(params)
    assert _all_finite_host(grads)  # the scaled gradients are finite: torch's check passes
    updates, state = maybe_jit(tx.update)(grads, state, params)
    new = apply_updates(params, updates, state)
    assert _all_finite_host(new), "a step wrote a non-finite value into the parameters"
    assert bool(jaxamp.amp_info(state).last_step_finite) == bool(flax_finite)
    assert float(jaxamp.get_loss_scale(state).loss_scale) == 0.0625


@pytest.mark.parametrize("inner", ["adam", "sgd"])
def test_fp16_gradient_overflowing_when_unscaled_is_skipped(inner, maybe_jit):
    params = {"w": jnp.ones((4,), jnp.float32)}
    tx = jaxamp.loss_scaled(
        optax.adam(1e-3) if inner == "adam" else optax.sgd(1.0),
        jaxamp.DynamicLossScale.create(init_scale=0.25),
    )
    state = tx.init(params)
    grads = {"w": jnp.array([30000.0, 1.0, 1.0, 1.0], jnp.float16)}  # / 0.25 > 65504
    updates, state = maybe_jit(tx.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert _all_finite_host(new) and _all_finite_host(state.inner_state)
    assert not bool(state.last_step_finite)


# --- several optimizers, one GradScaler (torch's test_grad_scaling_multiple) ----------------------


def test_per_group_skip_matches_torch_grad_scaling_multiple(maybe_jit):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    def make():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))

    mod0, mod1 = make(), make()
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    skip_iter = 2

    def to_jax(mod):
        return {
            f"l{i}": {
                "w": jnp.asarray(mod[i].weight.detach().numpy()),
                "b": jnp.asarray(mod[i].bias.detach().numpy()),
            }
            for i in (0, 1)
        }

    params = {"m0": to_jax(mod0), "m1": to_jax(mod1)}
    # torch's recipe, with a real GradScaler on the CPU.
    opt0 = torch.optim.SGD(mod0.parameters(), lr=1.0)
    opt1 = torch.optim.SGD(mod1.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_factor=2.0, growth_interval=1)
    loss_fn = torch.nn.MSELoss()
    torch_scales = []
    for i, (inp, tgt) in enumerate(data):
        opt0.zero_grad()
        opt1.zero_grad()
        out0, out1 = mod0(inp), mod1(inp)
        loss0 = loss_fn(0.3 * out0 + 0.7 * out1, tgt)
        loss1 = loss_fn(0.6 * out0 - 0.4 * out1, tgt)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if i == skip_iter:
            mod1[1].weight.grad.data.fill_(float("inf"))
        scaler.unscale_(opt0)
        scaler.step(opt0)
        scaler.step(opt1)
        scaler.update()
        torch_scales.append(scaler.get_scale())
    assert torch_scales[-1] == 128.0 * 2.0**3 * 0.5

    labels = {
        "m0": jax.tree.map(lambda _: "opt0", params["m0"]),
        "m1": jax.tree.map(lambda _: "opt1", params["m1"]),
    }
    tx = jaxamp.loss_scaled(
        {"opt0": optax.sgd(1.0), "opt1": optax.sgd(1.0)},
        jaxamp.DynamicLossScale.create(init_scale=128.0, growth_interval=1),
        param_labels=labels,
    )

    def forward(p, x):
        h = x @ p["l0"]["w"].T + p["l0"]["b"]
        return h @ p["l1"]["w"].T + p["l1"]["b"]

    def loss(p, x, y):
        out0, out1 = forward(p["m0"], x), forward(p["m1"], x)
        mse = lambda a: jnp.mean((a - y) ** 2)  # noqa: E731
        return mse(0.3 * out0 + 0.7 * out1) + mse(0.6 * out0 - 0.4 * out1)

    def step(params, state, x, y, poison):
        _, grads = jaxamp.value_and_grad(loss)(params, x, y, loss_scale=state)
        w = grads["m1"]["l1"]["w"]
        grads["m1"]["l1"]["w"] = jnp.where(poison, jnp.inf, w)
        updates, state = tx.update(grads, state, params)
        return apply_updates(params, updates, state), state

    step = maybe_jit(step)
    state = tx.init(params)
    jax_scales = []
    for i, (inp, tgt) in enumerate(data):
        params, state = step(
            params,
            state,
            jnp.asarray(inp.numpy()),
            jnp.asarray(tgt.numpy()),
            jnp.array(i == skip_iter),
        )
        jax_scales.append(float(jaxamp.get_loss_scale(state).loss_scale))
        if i == skip_iter:
            applied = state.group_applied
            assert all(bool(a) for a in jax.tree.leaves(applied["m0"]))
            assert not any(bool(a) for a in jax.tree.leaves(applied["m1"]))
    assert jax_scales == torch_scales
    # torch's own test compares with rtol=1e-5, atol=1e-7 (float32 SGD, 4 steps).
    for name, mod in (("m0", mod0), ("m1", mod1)):
        for i in (0, 1):
            np.testing.assert_allclose(
                params[name][f"l{i}"]["w"], mod[i].weight.detach().numpy(), rtol=1e-5, atol=1e-7
            )
            np.testing.assert_allclose(
                params[name][f"l{i}"]["b"], mod[i].bias.detach().numpy(), rtol=1e-5, atol=1e-7
            )


# --- adversarial configurations, state dicts, gradients and meshes --------------------------------


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: jaxamp.DynamicLossScale.create(init_scale=1e-50), ValueError, "0.0 in float32"),
        (lambda: jaxamp.StaticLossScale(1e50), ValueError, "inf in float32"),
        (
            lambda: jaxamp.DynamicLossScale.create(init_scale=8.0, min_scale=16.0),
            ValueError,
            "min_scale",
        ),
        (lambda: jaxamp.DynamicLossScale.create(min_scale=1e300), ValueError, "min_scale"),
        (
            lambda: jaxamp.DynamicLossScale.create(init_scale=8.0, max_scale=4.0),
            ValueError,
            "max_scale",
        ),
        (lambda: jaxamp.DynamicLossScale.create(init_scale="1"), TypeError, "init_scale"),
        (lambda: jaxamp.DynamicLossScale.create(init_scale=True), TypeError, "init_scale"),
        (lambda: jaxamp.StaticLossScale("5"), TypeError, "StaticLossScale"),
        (lambda: jaxamp.StaticLossScale(None), TypeError, "StaticLossScale"),
        (lambda: jaxamp.StaticLossScale([2.0]), TypeError, "StaticLossScale"),
        (lambda: jaxamp.StaticLossScale(jnp.array(-1.0)), ValueError, "StaticLossScale"),
        (lambda: jaxamp.StaticLossScale(jnp.array(jnp.inf)), ValueError, "StaticLossScale"),
        (lambda: jaxamp.multi_steps(None, 2), TypeError, "multi_steps"),
        (lambda: jaxamp.DynamicLossScale.create().adjust("yes"), TypeError, "grads_finite"),
        (lambda: jaxamp.loss_scaled(optax.sgd(1.0), axis_name=5), TypeError, "axis_name"),
    ],
)
def test_contradictory_or_mistyped_configuration_is_refused(build, error, match):
    with pytest.raises(error, match=match):
        build()


def _torch_state(**changes):
    state = jaxamp.DynamicLossScale.create().state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    "state_dict, error, match",
    [
        (_torch_state(scale=1e-60), ValueError, "scale"),
        (_torch_state(growth_interval=2.5), TypeError, "growth_interval"),
        (_torch_state(_growth_tracker=2000), ValueError, "_growth_tracker"),
        (_torch_state(scale=None), TypeError, "scale"),
        (_torch_state(growth_factor=None), TypeError, "growth_factor"),
        (
            _torch_state(jaxamp={"hysteresis": 2, "hysteresis_tracker": 3}),
            ValueError,
            "hysteresis_tracker",
        ),
    ],
)
def test_bad_state_dicts_are_refused(state_dict, error, match):
    with pytest.raises(error, match=match):
        jaxamp.DynamicLossScale.from_state_dict(state_dict)


def test_numpy_values_are_accepted():
    scale = jaxamp.DynamicLossScale.from_state_dict(_torch_state(scale=np.float32(1024.0)))
    assert float(scale.loss_scale) == 1024.0
    jaxamp.loss_scaled(optax.sgd(1.0), max_consecutive_skips=np.int64(3))
    jaxamp.DynamicLossScale.create(growth_interval=np.int64(5))


def test_growth_tracker_range_matches_torch():
    torch = pytest.importorskip("torch")
    # torch grows when its tracker reaches the interval: a saved tracker is at most interval-1,
    # and from interval-1 the next finite step grows, in torch and here.
    saved = {
        "scale": 4.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "_growth_tracker": 2,
    }
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(saved)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    torch._amp_update_scale_(
        scaler._scale, scaler._growth_tracker, torch.tensor([0.0]), 2.0, 0.5, 3
    )
    ours = jaxamp.DynamicLossScale.from_state_dict(saved).adjust(jnp.array(True))
    assert float(ours.loss_scale) == float(scaler._scale) == 8.0


def test_complex_gradients_are_checked_and_unscaled(maybe_jit):
    assert not bool(maybe_jit(jaxamp.all_finite)(jnp.array([jnp.nan + 0j])))
    assert not bool(maybe_jit(jaxamp.all_finite)(jnp.array([complex(1.0, np.inf)], jnp.complex64)))
    scale = jaxamp.DynamicLossScale.create(init_scale=65536.0)
    grad = jnp.array([65536.0 + 131072.0j], jnp.complex64)
    out = maybe_jit(lambda s, g: s.unscale(g))(scale, grad)
    assert out.dtype == jnp.complex64
    np.testing.assert_array_equal(np.asarray(out), np.array([1.0 + 2.0j], np.complex64))
    params = {"w": jnp.zeros((1,), jnp.complex64)}
    tx = jaxamp.loss_scaled(optax.sgd(1.0), scale)
    state = tx.init(params)
    updates, state = maybe_jit(tx.update)({"w": grad}, state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.array([-1.0 - 2.0j], np.complex64))
    updates, state = maybe_jit(tx.update)(
        {"w": jnp.array([jnp.nan + 0j], jnp.complex64)}, state, params
    )
    assert not bool(state.last_step_finite)


def test_pmap_without_axis_name_is_detected():
    n = jax.device_count()
    params = {"w": jnp.ones((n, 3), jnp.float32)}
    tx = jaxamp.loss_scaled(optax.sgd(1.0))
    state = jax.pmap(tx.init)(params)
    grads = {"w": jnp.ones((n, 3), jnp.float32).at[0, 0].set(jnp.inf)}
    with pytest.raises(ValueError, match="axis_name"):
        jax.pmap(tx.update)(grads, state, params)
    with_axis = jaxamp.loss_scaled(optax.sgd(1.0), axis_name="batch")
    _, new_state = jax.pmap(with_axis.update, axis_name="batch")(grads, state, params)
    assert not np.asarray(new_state.last_step_finite).any()  # every replica skips
    scales = np.asarray(new_state.loss_scale.loss_scale)
    assert (scales == scales[0]).all()
    independent = jaxamp.loss_scaled(optax.sgd(1.0), axis_name=())
    _, new_state = jax.pmap(independent.update)(grads, state, params)
    assert np.asarray(new_state.last_step_finite).sum() == n - 1  # asked for explicitly


def test_skip_counter_saturates(maybe_jit):
    params = {"w": jnp.ones((2,), jnp.float32)}
    tx = jaxamp.loss_scaled(optax.sgd(1.0))
    state = tx.init(params)._replace(
        skipped_steps=jnp.asarray(INT32_MAX, jnp.int32),
        consecutive_skips=jnp.asarray(INT32_MAX, jnp.int32),
    )
    update = maybe_jit(tx.update)
    _, state = update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    assert int(state.skipped_steps) == INT32_MAX and int(state.consecutive_skips) == INT32_MAX
    _, state = update({"w": jnp.ones((2,))}, state, params)
    assert int(state.skipped_steps) == INT32_MAX, "a saturated counter must not drop"
    assert int(state.consecutive_skips) == 0


def test_subnormal_params_kept_bit_exact_on_a_skip(maybe_jit):
    subnormal = np.array([1e-40, -3e-42, 0.0, -0.0, 1.0], np.float32)
    assert (np.abs(subnormal[:2]) < F32_TINY).all()
    params = {"w": jnp.asarray(subnormal)}
    tx = jaxamp.loss_scaled(optax.adam(1e-3))
    state = tx.init(params)
    bad = {"w": jnp.array([jnp.inf, 1.0, 1.0, 1.0, 1.0], jnp.float32)}

    def step(params, state):
        updates, state = tx.update(bad, state, params)
        return apply_updates(params, updates, state)

    new = maybe_jit(step)(params, state)
    assert np.asarray(new["w"]).tobytes() == subnormal.tobytes()
    # The Flax glue keeps them too.
    model = nn.Dense(5)
    glue = jf.TrainState.create(
        apply_fn=model.apply,
        params={"w": jnp.asarray(subnormal)},
        tx=optax.adam(1e-3),
        policy="fp32",
    )
    glue = maybe_jit(lambda s: s.apply_gradients(grads=bad))(glue)
    assert np.asarray(glue.params["w"]).tobytes() == subnormal.tobytes()


@pytest.mark.parametrize("factor_kind", ["growth", "backoff"])
def test_non_power_of_two_factors_within_one_ulp_of_torch(factor_kind, maybe_jit):
    """The documented bound (README): one float32 ulp per update from torch's float64 product."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    finite = factor_kind == "growth"
    cases, scales, theirs = [], [], []
    for _ in range(20):
        init = float(np.float32(rng.uniform(1.0, 1e4)))
        factor = float(rng.uniform(1.01, 3.0) if finite else rng.uniform(0.05, 0.99))
        kwargs = (
            {"growth_factor": factor, "growth_interval": 1}
            if finite
            else {"backoff_factor": factor}
        )
        cases.append((init, factor))
        scales.append(jaxamp.DynamicLossScale.create(init_scale=init, **kwargs))
        scaler = torch.amp.GradScaler("cpu", init_scale=init, **kwargs)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        found_inf = torch.tensor([0.0 if finite else 1.0])
        torch._amp_update_scale_(
            scaler._scale,
            scaler._growth_tracker,
            found_inf,
            scaler._growth_factor,
            scaler._backoff_factor,
            scaler._growth_interval,
        )
        theirs.append(float(scaler._scale))
    # The 20 adjustments in one program (each factor is a constant of its own scale's update).
    adjusted = maybe_jit(lambda ss, f: [s.adjust(f) for s in ss])(scales, jnp.array(finite))
    for case, new, want in zip(cases, adjusted, theirs, strict=True):
        ours = float(new.loss_scale)
        assert abs(ours - want) <= np.spacing(np.float32(want)), case


@functools.cache
def _skip_form_runs():
    """{form: {dtype name: (params1, state1, params2, state2)}}: an applied adam step on
    gradients in each float dtype, then one with an inf, in the branch form (``in_place=True``
    on CPU) and the select form. Per form one program for the three dtypes (each variant its
    own), shared by the tests; the two forms are two programs."""
    results = {}
    for form in ("branch", "select"):
        params = {"w": jnp.asarray([1.0, -0.0, 1e-40, 2.0], jnp.float32)}
        tx = jaxamp.loss_scaled(optax.adam(1e-2), in_place=form == "branch")
        state = tx.init(params)

        @jax.jit
        def steps(variants, tx=tx):
            out = []
            for params, state, grads in variants:
                updates, state = tx.update(grads, state, params)
                out.append((apply_updates(params, updates, state), state))
            return tuple(out)

        goods = [{"w": jnp.asarray([1.0, 2.0, 3.0, 4.0], d) * 1024} for d in _FLOAT_DTYPE_NAMES]
        first = steps([(params, state, g) for g in goods])
        second = steps(
            [
                (p1, s1, {"w": g["w"].at[1].set(jnp.inf)})
                for g, (p1, s1) in zip(goods, first, strict=True)
            ]
        )
        results[form] = {
            d: (params, *one, *two)
            for d, one, two in zip(_FLOAT_DTYPE_NAMES, first, second, strict=True)
        }
    return results


def test_skip_forms_agree(float_dtype):
    """The select form (the default; on GPU always: XLA:GPU syncs the host on a branch)
    equals the branch form (``in_place=True`` on CPU), bit for bit, on applied and on skipped
    steps."""
    if jax.default_backend() != "cpu":
        pytest.skip("the branch form is XLA:CPU's")
    results = {}
    for form, runs in _skip_form_runs().items():
        params, params1, state1, params2, state2 = runs[float_dtype.name]
        _bytes_equal(params2, params1)
        _bytes_equal(state2.inner_state, state1.inner_state)
        assert int(state2.skipped_steps) == 1 and bool(state1.last_step_finite)
        assert not np.array_equal(np.asarray(params1["w"]), np.asarray(params["w"]))
        results[form] = (params1, state1, params2, state2)
    _bytes_equal(results["branch"], results["select"])
