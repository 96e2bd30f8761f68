"""loss_scaled, get_loss_scale, amp_info, value_and_grad: skips, clipping, accumulation, parameter
groups, sharding, optimizer state dtype, overflow reporting, wrapping and bad arguments."""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from conftest import FLOAT_DTYPES

import jaxamp
from jaxamp._optim import LossScaledTransformation

# optax's own arithmetic is not strict-promotion clean (float ** int32 in bias correction).
pytestmark = pytest.mark.standard_promotion


def _params(dtype=jnp.float32):
    key = jax.random.key(0)
    k1, k2 = jax.random.split(key)
    return {
        "w": jax.random.normal(k1, (4, 3), dtype),
        "b": jnp.zeros((3,), dtype),
        "s": jax.random.normal(k2, (), dtype),
    }


def _loss(params, x, y):
    pred = x @ params["w"] + params["b"] + params["s"]
    return jnp.mean((pred - y) ** 2)


def _batches(n, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return [
        (
            jnp.asarray(rng.normal(size=(8, 4)), dtype),
            jnp.asarray(rng.normal(size=(8, 3)), dtype),
        )
        for _ in range(n)
    ]


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _leaves_ulp_close(a, b, maxulp=4):
    """Equal up to a few ulps: two different XLA programs may contract a*b+c into an FMA
    differently (seen here even for SGD momentum), which no wrapper can control."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jnp.dtype(x.dtype) == jnp.bfloat16:  # numpy has no ulp count for bfloat16
            x32, y32 = np.asarray(x, np.float32), np.asarray(y, np.float32)
            spacing = float(jnp.finfo(jnp.bfloat16).eps) * np.maximum(abs(x32), abs(y32))
            np.testing.assert_array_less(abs(x32 - y32), maxulp * spacing + 1e-38)
        else:
            np.testing.assert_array_max_ulp(np.asarray(x), np.asarray(y), maxulp=maxulp)


def _inject(tree, value=jnp.inf, leaf="w"):
    tree = dict(tree)
    tree[leaf] = tree[leaf].at[(0,) * tree[leaf].ndim].set(value)
    return tree


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_schedule": lambda: optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
}


# --- a skipped step is a true no-op ---------------------------------------------------------------


def _each(fn, maybe_jit):
    """`fn` applied to each tuple of arguments in a sequence of them: under jit one program for
    all (one XLA compile instead of one per variant), each variant's result its own."""
    return maybe_jit(lambda variants: tuple(fn(*args) for args in variants))


@functools.cache
def _skipped_step_runs(names, jitted):
    """For each optimizer in `names`: one real step on gradients in each float dtype, then a step
    on them with -inf and one with NaN injected: {name: (states after the real step, [(bad value,
    outputs per dtype)])}. Under jit every optimizer and dtype in one program, shared by the
    tests (one XLA compile instead of one per optimizer)."""
    maybe_jit = jax.jit if jitted else (lambda f: f)
    params = _params()
    txs = {n: jaxamp.loss_scaled(OPTIMIZERS[n]()) for n in names}
    update = maybe_jit(
        lambda variants: {n: tuple(txs[n].update(*args) for args in v) for n, v in variants.items()}
    )
    grads = [jax.tree.map(lambda p, d=d: jnp.ones_like(p, d), params) for d in FLOAT_DTYPES]
    # one real step so the state is non-trivial
    first = update({n: [(g, txs[n].init(params), params) for g in grads] for n in names})
    states = {n: [s for _, s in first[n]] for n in names}
    runs = {n: (states[n], []) for n in names}
    for bad in (-jnp.inf, jnp.nan):
        stepped = update(
            {
                n: [(_inject(g, bad), s, params) for g, s in zip(grads, states[n], strict=True)]
                for n in names
            }
        )
        for n in names:
            runs[n][1].append((bad, stepped[n]))
    return runs


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_skipped_step_is_noop(name, maybe_jit):
    # Gradients in each float dtype (under jit the three, and every optimizer, in one program),
    # -inf and then NaN.
    params = _params()
    jitted = maybe_jit is jax.jit
    states, runs = _skipped_step_runs(tuple(OPTIMIZERS) if jitted else (name,), jitted)[name]
    for bad, stepped in runs:
        for dtype, state, (updates, new_state) in zip(FLOAT_DTYPES, states, stepped, strict=True):
            case = f"{jnp.dtype(dtype).name} gradients, {bad}"
            for u in jax.tree.leaves(updates):
                assert not np.any(np.asarray(u)), f"a skipped step must return zero updates: {case}"
                assert np.all(np.signbit(np.asarray(u, np.float32))), f"-0.0 (p + u exact): {case}"
            _leaves_equal(new_state.inner_state, state.inner_state)
            assert not bool(new_state.last_step_finite), case
            assert int(new_state.skipped_steps) == 1, case
            np.testing.assert_array_equal(
                new_state.loss_scale.loss_scale, state.loss_scale.loss_scale / 2, err_msg=case
            )
            new_params = optax.apply_updates(params, updates)
            _leaves_equal(new_params, params)


def test_skip_keeps_negative_zero_params_bitwise(maybe_jit):
    params = {"w": jnp.array([-0.0, 0.0, 1.0, -2.5], jnp.float32)}
    for tx in [jaxamp.loss_scaled(optax.adam(1e-2)), jaxamp.multi_steps(optax.adam(1e-2), 2)]:
        state = tx.init(params)
        grads = {"w": jnp.array([jnp.inf, 1.0, 1.0, 1.0], jnp.float32)}
        updates, _ = maybe_jit(tx.update)(grads, state, params)
        new = optax.apply_updates(params, updates)
        assert np.asarray(new["w"]).tobytes() == np.asarray(params["w"]).tobytes()


def test_adam_count_does_not_advance_on_skip():
    params = _params()
    tx = jaxamp.loss_scaled(optax.adam(1e-3))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, state = tx.update(grads, state, params)
    _, state = tx.update(_inject(grads, jnp.nan), state, params)
    assert int(state.inner_state[0].count) == 1  # as torch: Adam's step is not taken


# --- an injected overflow equals leaving the step out ---------------------------------------------


_OVERFLOW_K = 3


@functools.cache
def _overflow_runs(names):
    """For each optimizer in `names`: (params, skipped steps, loss scales) of a loss-scaled run of
    6 steps whose step k overflows, and the parameters of the unwrapped run without step k. Each
    kind of step (scaled, reference) one jitted program for every optimizer, shared by the
    tests."""
    batches = _batches(6)
    txs = {
        n: jaxamp.loss_scaled(OPTIMIZERS[n](), jaxamp.DynamicLossScale.create(growth_interval=2))
        for n in names
    }
    reference_txs = {n: OPTIMIZERS[n]() for n in names}

    grad_fn = jax.jit(jax.grad(_loss))  # one gradient program for both runs: same reductions

    @jax.jit
    def scaled_step(params, states, grads, poison):
        out = {}
        for n, tx in txs.items():
            scale = jaxamp.get_loss_scale(states[n]).loss_scale
            g = jax.tree.map(lambda g, s=scale: jnp.where(poison, jnp.inf, g * s), grads[n])
            updates, state = tx.update(g, states[n], params[n])
            out[n] = (optax.apply_updates(params[n], updates), state)
        return out

    @jax.jit
    def reference_step(params, states, grads):
        out = {}
        for n, tx in reference_txs.items():
            updates, state = tx.update(grads[n], states[n], params[n])
            out[n] = (optax.apply_updates(params[n], updates), state)
        return out

    params = {n: _params() for n in names}
    states = {n: txs[n].init(_params()) for n in names}
    ref_params = {n: _params() for n in names}
    ref_states = {n: reference_txs[n].init(_params()) for n in names}
    scales = {n: [] for n in names}
    for i, (x, y) in enumerate(batches):
        grads = {n: grad_fn(params[n], x, y) for n in names}
        out = scaled_step(params, states, grads, jnp.array(i == _OVERFLOW_K))
        params, states = {n: o[0] for n, o in out.items()}, {n: o[1] for n, o in out.items()}
        for n in names:
            scales[n].append(float(states[n].loss_scale.loss_scale))
        if i != _OVERFLOW_K:
            ref_grads = {n: grad_fn(ref_params[n], x, y) for n in names}
            out = reference_step(ref_params, ref_states, ref_grads)
            ref_params = {n: o[0] for n, o in out.items()}
            ref_states = {n: o[1] for n, o in out.items()}
    return {n: (params[n], int(states[n].skipped_steps), scales[n], ref_params[n]) for n in names}


@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "clip_adam"])
def test_overflow_at_step_k_equals_run_without_step_k(name):
    params, skipped, scales, ref_params = _overflow_runs(("adam", "sgd_momentum", "clip_adam"))[
        name
    ]
    # Power-of-two scales make the scaling itself exact; the rest is FMA contraction.
    _leaves_ulp_close(params, ref_params)
    assert skipped == 1
    assert scales == [2.0**16, 2.0**17, 2.0**17, 2.0**16, 2.0**16, 2.0**17]


# --- NoOp is the identity -------------------------------------------------------------------------


@pytest.mark.parametrize("loss_scale", [jaxamp.NoOpLossScale(), jmp.NoOpLossScale()])
def test_noop_run_equals_unwrapped_run(loss_scale, maybe_jit):
    batches = _batches(4)
    tx = jaxamp.loss_scaled(optax.adam(1e-2), loss_scale)
    plain = optax.adam(1e-2)
    params, state = _params(), tx.init(_params())
    ref_params, ref_state = _params(), plain.init(_params())
    for x, y in batches:
        grads = jax.grad(_loss)(params, x, y)
        updates, state = maybe_jit(tx.update)(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_grads = jax.grad(_loss)(ref_params, x, y)
        ref_updates, ref_state = maybe_jit(plain.update)(ref_grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
    _leaves_equal(params, ref_params)
    _leaves_equal(state.inner_state, ref_state)
    noop = jaxamp.NoOpLossScale()
    tree = _params(jnp.bfloat16)
    assert noop.scale(tree) is tree and noop.unscale(tree) is tree
    assert noop.adjust(jnp.array(False)) is noop


# --- clipping after unscaling ---------------------------------------------------------------------


def test_clipping_after_unscaling_equals_fp32_clipping(maybe_jit):
    params = _params()
    x, y = _batches(1)[0]
    grads = jax.grad(_loss)(params, x, y)
    clip_adam = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    tx = jaxamp.loss_scaled(clip_adam)
    state = tx.init(params)
    scaled = state.loss_scale.scale(grads)
    updates, _ = maybe_jit(tx.update)(scaled, state, params)
    ref_updates, _ = clip_adam.update(grads, clip_adam.init(params), params)
    _leaves_ulp_close(updates, ref_updates)
    # Non-finite gradients are skipped, not clipped into a finite update.
    updates, new_state = maybe_jit(tx.update)(_inject(scaled, jnp.inf), state, params)
    assert not np.any(np.asarray(updates["w"]))
    assert int(new_state.skipped_steps) == 1


# --- gradient accumulation ------------------------------------------------------------------------


@pytest.mark.parametrize("poison_micro_step", [None, 0, 2])
def test_multi_steps_accumulation(poison_micro_step, maybe_jit):
    k = 3
    tx = jaxamp.multi_steps(jaxamp.loss_scaled(optax.adam(1e-2)), every_k=k)
    params = _params()
    state = tx.init(params)
    update = maybe_jit(tx.update)
    scales = []
    for i, (x, y) in enumerate(_batches(3 * k)):
        _, grads = jaxamp.value_and_grad(_loss)(params, x, y, loss_scale=state)
        if i == poison_micro_step:
            grads = _inject(grads, jnp.nan)
        before = jaxamp.get_loss_scale(state).loss_scale
        updates, state = update(grads, state, params)
        after = jaxamp.get_loss_scale(state).loss_scale
        scales.append(float(after))
        if (i + 1) % k:
            assert float(after) == float(before), "scale must be constant inside a window"
            assert not np.any(np.asarray(updates["w"]))
        params = optax.apply_updates(params, updates)
    info = jaxamp.amp_info(state)
    adam_count = int(state.inner_state.inner_state[0].count)
    if poison_micro_step is None:
        assert scales == [2.0**16] * (3 * k)
        assert int(info.skipped_steps) == 0 and adam_count == 3
    else:
        # The poisoned window is skipped whole (one backoff at its end); later windows step.
        assert scales == [2.0**16] * (k - 1) + [2.0**15] * (2 * k + 1)
        assert int(info.skipped_steps) == 1 and adam_count == 2
    assert all(np.all(np.isfinite(np.asarray(p))) for p in jax.tree.leaves(params))


def test_multi_steps_matches_large_batch_step():
    params = _params()
    batches = _batches(4)
    tx = jaxamp.multi_steps(optax.sgd(0.1), every_k=4)
    state = tx.init(params)
    for x, y in batches:
        updates, state = tx.update(jax.grad(_loss)(params, x, y), state, params)
    mean_grads = jax.tree.map(
        lambda *g: sum(g) / 4, *[jax.grad(_loss)(params, x, y) for x, y in batches]
    )
    ref_updates, _ = optax.sgd(0.1).update(mean_grads, optax.sgd(0.1).init(params), params)
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="every_k"):
        jaxamp.multi_steps(optax.sgd(0.1), every_k=0)


def test_multi_steps_compiles_nothing_after_its_first_window(maybe_jit):
    """An eager `multi_steps` update once built a `lax.cond` from new closures on every call,
    so XLA compiled a program per micro-step (about a second each). Once one window has run
    (every eager op and the jitted step compiled), later micro-steps compile nothing."""
    k = 2
    tx = jaxamp.multi_steps(jaxamp.loss_scaled(optax.adam(1e-2)), every_k=k)
    params = _params()
    state = tx.init(params)
    grads = jax.grad(_loss)(params, *_batches(1)[0])
    update = maybe_jit(tx.update)
    compiles = []

    def on_event(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        for window in range(3):
            if window == 1:
                compiles.clear()  # the first window compiles every op once
            for _ in range(k):
                updates, state = update(grads, state, params)
                params = optax.apply_updates(params, updates)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiles == [], f"{len(compiles)} compilations in {2 * k} micro-steps after warm-up"
    assert int(state.inner_state.inner_state[0].count) == 3


def test_optax_multisteps_never_recovers_from_an_overflow():
    """Why jaxamp.multi_steps exists: optax.MultiSteps clears its accumulator with `0 * acc`.

    If this starts failing, optax fixed it and `optax.MultiSteps` becomes usable again."""
    k = 2
    tx = optax.MultiSteps(jaxamp.loss_scaled(optax.adam(1e-2)), every_k_schedule=k)
    params = _params()
    state = tx.init(params)
    ones = jax.tree.map(jnp.ones_like, params)
    update = jax.jit(tx.update)  # optax's rule, the same eagerly: one compile, not one per call
    for i in range(3 * k):
        _, state = update(_inject(ones, jnp.nan) if i == 0 else ones, state, params)
    assert int(jaxamp.amp_info(state).skipped_steps) == 3  # every window after the NaN is lost


# --- parameter groups -----------------------------------------------------------------------------


def test_multi_transform_global_skip():
    params = _params()
    labels = {"w": "a", "b": "b", "s": "b"}
    tx = jaxamp.loss_scaled(
        optax.multi_transform({"a": optax.adam(1e-2), "b": optax.sgd(1e-2, momentum=0.9)}, labels)
    )
    state = tx.init(params)
    grads = _inject(jax.tree.map(jnp.ones_like, params), jnp.inf, leaf="w")
    updates, new_state = tx.update(grads, state, params)
    # One optimizer, one decision: the overflow in group "a" skips group "b" too (torch).
    assert not np.any(np.asarray(updates["b"])) and not np.any(np.asarray(updates["w"]))
    _leaves_equal(new_state.inner_state, state.inner_state)


def test_multi_transform_per_group_skip():
    params = _params()
    labels = {"w": "a", "b": "b", "s": "b"}
    tx = optax.multi_transform(
        {
            "a": jaxamp.loss_scaled(optax.adam(1e-2)),
            "b": jaxamp.loss_scaled(optax.sgd(1e-2, momentum=0.9)),
        },
        labels,
    )
    state = tx.init(params)
    grads = _inject(jax.tree.map(jnp.ones_like, params), jnp.inf, leaf="w")
    updates, new_state = tx.update(grads, state, params)
    assert not np.any(np.asarray(updates["w"]))
    assert np.all(np.asarray(updates["b"]) != 0)  # group "b" is finite: it steps
    states = jaxamp.loss_scaled_states(new_state)
    assert len(states) == 2
    finite = sorted(bool(s.last_step_finite) for s in states.values())
    assert finite == [False, True]
    with pytest.raises(ValueError, match="found 2 loss-scaled states"):
        jaxamp.get_loss_scale(new_state)


# --- sharded and replicated -----------------------------------------------------------------------


def test_sharded_nan_in_one_shard_makes_every_shard_skip(replica_devices):
    n = len(replica_devices)
    mesh = jax.sharding.Mesh(np.array(replica_devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    params = {"w": jax.device_put(jnp.ones((2 * n, 4)), sharding)}
    tx = jaxamp.loss_scaled(optax.adam(1e-2))
    state = tx.init(params)
    # Row 2n - 3 lives on device n - 2 (device 6 of 8): one shard of several.
    grads = {"w": jnp.ones((2 * n, 4)).at[2 * n - 3, 2].set(jnp.nan)}
    grads = jax.device_put(grads, sharding)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    assert new_params["w"].sharding.is_equivalent_to(sharding, 2)
    for shard in new_params["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), 1.0)
    assert float(new_state.loss_scale.loss_scale) == 2.0**15


def test_shard_map_axis_name_makes_every_replica_skip(replica_devices):
    n = len(replica_devices)
    mesh = jax.sharding.Mesh(np.array(replica_devices), ("d",))
    spec = jax.sharding.PartitionSpec("d")
    tx = jaxamp.loss_scaled(optax.sgd(0.5), axis_name="d")
    params = jnp.ones((n, 2))
    # Per-replica gradients (not yet reduced): only the last replica sees a NaN.
    grads = jnp.ones((n, 2)).at[n - 1, 0].set(jnp.nan)

    def step(p, g):
        state = tx.init(p)
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state.loss_scale.loss_scale[None]

    stepped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
    new_params, scales = stepped(params, grads)
    np.testing.assert_array_equal(np.asarray(new_params), 1.0)  # every replica skipped
    np.testing.assert_array_equal(np.asarray(scales), 2.0**15)  # and agrees on the scale
    # Independent decisions (axis_name=(), the explicit opt-out; leaving axis_name out here
    # raises): the replicas disagree, the finite ones step.
    tx_local = jaxamp.loss_scaled(optax.sgd(0.5), axis_name=())

    def local_step(p, g):
        updates, _ = tx_local.update(g, tx_local.init(p), p)
        return optax.apply_updates(p, updates)

    local = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    out = np.asarray(local(params, grads))
    assert np.all(out[n - 1] == 1.0) and np.all(out[0] != 1.0)


# --- optimizer state stays float32 under a mixed policy -------------------------------------------


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_optimizer_state_float32_and_no_nan_on_zero_grads(policy, maybe_jit):
    params = _params()
    tx = jaxamp.loss_scaled(optax.adam(1e-3))
    state = tx.init(params)
    x, y = _batches(1)[0]
    _, grads = jaxamp.value_and_grad(_loss, policy=policy)(params, x, y, loss_scale=state)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    zero_grads = jax.tree.map(jnp.zeros_like, grads)
    updates, state = maybe_jit(tx.update)(zero_grads, state, params)
    for leaf in jax.tree.leaves(state.inner_state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))


# --- a model that overflows forever is reported ---------------------------------------------------


# The report itself (once, at the limit, eager / jit / donated): tests/jaxamp/test_max_skips_report.py


def test_consecutive_counter_resets_on_finite_step():
    params = _params()
    tx = jaxamp.loss_scaled(optax.sgd(1e-2))
    state = tx.init(params)
    ones = jax.tree.map(jnp.ones_like, params)
    for grads in [_inject(ones, jnp.nan), _inject(ones, jnp.nan), ones]:
        _, state = tx.update(grads, state, params)
    info = jaxamp.amp_info(state)
    assert int(info.consecutive_skips) == 0 and int(info.skipped_steps) == 2
    assert bool(info.last_step_applied)


# --- wrapping and bad arguments -------------------------------------------------------------------


def test_wrapping_a_loss_scaled_optimizer_raises():
    inner = jaxamp.loss_scaled(optax.adam(1e-3))
    assert isinstance(inner, LossScaledTransformation)
    with pytest.raises(ValueError, match="already loss-scaled"):
        jaxamp.loss_scaled(inner)
    nested = jaxamp.loss_scaled(optax.chain(optax.clip(1.0), inner))
    with pytest.raises(ValueError, match="already contains a loss-scaled"):
        nested.init(_params())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"loss_scale": 3.0}, TypeError, "loss_scale"),
        ({"loss_scale": "bogus"}, ValueError, "unknown preset"),
        ({"max_consecutive_skips": 0}, ValueError, "max_consecutive_skips"),
        ({"max_consecutive_skips": 2.5}, ValueError, "max_consecutive_skips"),
        ({"on_max_skips": "explode"}, ValueError, "on_max_skips"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxamp.loss_scaled(optax.sgd(1.0), **kwargs)
    with pytest.raises(TypeError, match="GradientTransformation"):
        jaxamp.loss_scaled(lambda g: g)


# --- state saved without loss scaling -------------------------------------------------------------


def test_state_without_loss_scaling_is_rejected_clearly():
    params = _params()
    plain_state = optax.adam(1e-3).init(params)
    tx = jaxamp.loss_scaled(optax.adam(1e-3))
    with pytest.raises(TypeError, match="saved without loss scaling"):
        tx.update(jax.tree.map(jnp.ones_like, params), plain_state, params)
    with pytest.raises(ValueError, match="no loss-scaled optimizer state"):
        jaxamp.amp_info(plain_state)
    # The documented reset: keep the inner state, start a fresh scale.
    state = tx.init(params)._replace(inner_state=plain_state)
    state = jaxamp.set_loss_scale(state, jaxamp.DynamicLossScale.create(init_scale=8.0))
    assert float(jaxamp.get_loss_scale(state).loss_scale) == 8.0


# --- composition, telemetry, protocol -------------------------------------------------------------


def test_get_loss_scale_finds_nested_states():
    params = _params()
    for tx in [
        optax.chain(jaxamp.loss_scaled(optax.adam(1e-3))),
        optax.MultiSteps(jaxamp.loss_scaled(optax.adam(1e-3)), 2),
        jaxamp.multi_steps(jaxamp.loss_scaled(optax.adam(1e-3)), 2),
        optax.inject_hyperparams(lambda lr: jaxamp.loss_scaled(optax.sgd(lr)))(lr=0.1),
    ]:
        state = tx.init(params)
        assert float(jaxamp.get_loss_scale(state).loss_scale) == 2.0**16
    scale = jaxamp.StaticLossScale(4.0)
    assert jaxamp.get_loss_scale(scale) is scale


def _other_loss_scales():
    return {
        "jmp-dynamic": jmp.DynamicLossScale(jnp.float32(2.0**15)),
        "jmp-static": jmp.StaticLossScale(jnp.float32(128.0)),
        "jaxamp-static": jaxamp.StaticLossScale(128.0),
        "megatron": "megatron",
    }


@functools.cache
def _other_loss_scale_steps(names, jitted):
    """{name: (updates, state)} after an overflowing sgd step under each loss scale in `names`:
    under jit every one in one program, shared by the tests."""
    params = _params()
    scales = _other_loss_scales()
    txs = {n: jaxamp.loss_scaled(optax.sgd(1e-2), scales[n]) for n in names}
    grads = _inject(jax.tree.map(jnp.ones_like, params), jnp.inf)

    def step(grads, states, params):
        return {n: txs[n].update(grads, states[n], params) for n in names}

    states = {n: txs[n].init(params) for n in names}
    return (jax.jit(step) if jitted else step)(grads, states, params)


@pytest.mark.parametrize(
    "loss_scale, expected_after_overflow",
    [
        ("jmp-dynamic", 2.0**14),
        ("jmp-static", 128.0),
        ("jaxamp-static", 128.0),
        ("megatron", 2.0**32),  # hysteresis 2: the first overflow does not back off
    ],
)
def test_other_loss_scales_are_accepted(loss_scale, expected_after_overflow, maybe_jit):
    jitted = maybe_jit is jax.jit
    names = tuple(_other_loss_scales()) if jitted else (loss_scale,)
    updates, state = _other_loss_scale_steps(names, jitted)[loss_scale]
    assert float(jaxamp.amp_info(state).loss_scale) == expected_after_overflow
    assert not np.any(np.asarray(updates["w"]))


@functools.cache
def _identity_updates(dtypes, jitted):
    """{dtype: the updates an identity inner transformation receives} from loss_scaled, for
    gradients of 3 * 2**10 at the default scale of 2**16 in each of `dtypes`: under jit the
    dtypes in one program, shared by the tests."""
    params = _params()
    identity = optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s)
    )
    tx = jaxamp.loss_scaled(identity)
    state = tx.init(params)

    def each(grads, state, params):  # a tuple: dtypes do not sort as a dict's keys must
        return tuple(tx.update(g, state, params)[0] for g in grads)

    grads = [
        jax.tree.map(lambda p, d=d: jnp.full(p.shape, 3.0 * 2.0**10, d), params) for d in dtypes
    ]
    updates = (jax.jit(each) if jitted else each)(grads, state, params)
    return dict(zip(dtypes, updates, strict=True))


@pytest.mark.parametrize("grad_dtype", FLOAT_DTYPES)
def test_unscaled_grads_reach_inner_exactly(grad_dtype, maybe_jit):
    jitted = maybe_jit is jax.jit
    updates = _identity_updates(FLOAT_DTYPES if jitted else (grad_dtype,), jitted)[grad_dtype]
    for leaf in jax.tree.leaves(updates):
        assert leaf.dtype == grad_dtype  # unscale keeps each leaf's dtype
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), 3.0 * 2.0**-6)


def test_amp_info_fields_and_types():
    params = _params()
    tx = jaxamp.loss_scaled(optax.adam(1e-3))
    info = jax.jit(jaxamp.amp_info)(tx.init(params))
    assert info.loss_scale.dtype == jnp.float32 and float(info.loss_scale) == 2.0**16
    assert info.skipped_steps.dtype == jnp.int32 and info.consecutive_skips.dtype == jnp.int32
    assert bool(info.last_step_finite) and bool(info.last_step_applied)


# --- value_and_grad -------------------------------------------------------------------------------


VALUE_AND_GRAD_POLICIES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", None)


@functools.cache
def _value_and_grads(policies, jitted):
    """{policy: (loss, grads)} of jaxamp.value_and_grad under each of `policies` at a static
    scale of 2**10: under jit every policy in one program, shared by the tests."""
    scale = jaxamp.StaticLossScale(2.0**10)

    def each(p, x, y):  # a tuple: None and the names do not sort as a dict's keys must
        return tuple(
            jaxamp.value_and_grad(_loss, policy=policy)(p, x, y, loss_scale=scale)
            for policy in policies
        )

    out = (jax.jit(each) if jitted else each)(_params(), *_batches(1)[0])
    return dict(zip(policies, out, strict=True))


@pytest.mark.parametrize("policy", VALUE_AND_GRAD_POLICIES)
def test_value_and_grad_dtypes_and_scaling(policy, maybe_jit):
    params = _params()
    x, y = _batches(1)[0]
    jitted = maybe_jit is jax.jit
    loss, grads = _value_and_grads(VALUE_AND_GRAD_POLICIES if jitted else (policy,), jitted)[policy]
    assert loss.dtype == jnp.float32
    ref_loss, ref_grads = jax.value_and_grad(_loss)(params, x, y)
    compute = jaxamp.get_policy(policy).compute_dtype if policy else jnp.float32
    rtol = {jnp.float32: 1e-6, jnp.bfloat16: 3e-2, jnp.float16: 3e-3}[jnp.dtype(compute).type]
    np.testing.assert_allclose(loss, ref_loss, rtol=rtol)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert g.dtype == jnp.float32  # float32 params get float32 grads through the cast
        np.testing.assert_allclose(np.asarray(g) / 2.0**10, r, rtol=rtol * 4, atol=rtol)


def test_value_and_grad_has_aux_and_argnums():
    params = _params()
    x, y = _batches(1)[0]

    def loss_with_aux(x, params, y):
        loss = _loss(params, x, y)
        return loss, {"pred_dtype": jnp.zeros((), x.dtype), "count": jnp.int32(3)}

    (loss, aux), grads = jaxamp.value_and_grad(
        loss_with_aux, policy="bf16-mixed", has_aux=True, argnums=1
    )(x, params, y, loss_scale=jaxamp.StaticLossScale(2.0))
    assert aux["count"].dtype == jnp.int32  # non-float aux untouched
    assert aux["pred_dtype"].dtype == jnp.float32  # float aux cast to the output dtype
    assert set(grads) == {"w", "b", "s"}
    with pytest.raises(TypeError, match="scalar loss"):
        jaxamp.value_and_grad(lambda p: p["w"])(params)
    with pytest.raises(ValueError, match="argnums=3"):
        jaxamp.value_and_grad(_loss, argnums=3)(params, x, y)


def test_fp16_scaled_loss_is_float32():
    # Through the helper: a float16 loss times 2**16 is inf in float16, not in float32.
    params = {"w": jnp.full((2,), 100.0, jnp.float32)}

    def loss_fn(p):
        return jnp.sum(p["w"] * p["w"])  # 20000 in float16: finite; x 2**16 would overflow

    loss, grads = jaxamp.value_and_grad(loss_fn, policy="fp16-mixed")(
        params, loss_scale=jaxamp.DynamicLossScale.create()
    )
    assert loss.dtype == jnp.float32 and float(loss) == 20000.0
    assert grads["w"].dtype == jnp.float32


# --- no retrace -----------------------------------------------------------------------------------


def test_jitted_train_step_does_not_retrace():
    traces = []
    tx = jaxamp.loss_scaled(optax.adamw(1e-3))

    @jax.jit
    def train_step(params, state, x, y):
        traces.append(1)
        loss, grads = jaxamp.value_and_grad(_loss, policy="bf16-mixed")(
            params, x, y, loss_scale=state
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    params = _params()
    state = tx.init(params)
    for x, y in _batches(3):
        params, state, _ = train_step(params, state, x, y)
    assert len(traces) == 1


# --- apply_gradients: update + apply as one decision ----------------------------------------------


def _fused_and_split(txs, maybe_jit):
    """apply_gradients and update + apply_updates, both in one step (jitted: one program),
    taking {name: a sequence of (grads, state, params)}, one per variant, for the optimizers
    `txs` ({name: transformation}): (fused outputs, split outputs), each variant's result its own
    (see `_each`). The two forms are separate computations of one program: a difference between
    them is a difference in their values, whatever XLA shares between them."""

    def fused(variants):
        return {
            n: tuple(jaxamp.apply_gradients(txs[n], g, s, p) for g, s, p in v)
            for n, v in variants.items()
        }

    def split(variants):
        out = {}
        for n, v in variants.items():
            out[n] = []
            for g, s, p in v:
                updates, new_state = txs[n].update(g, s, p)
                out[n].append((jaxamp.apply_updates(p, updates, new_state), new_state))
            out[n] = tuple(out[n])
        return out

    return maybe_jit(lambda variants: (fused(variants), split(variants)))


@functools.cache
def _fused_and_split_runs(names, jitted):
    """Three steps of apply_gradients and of update + apply_updates for each optimizer in `names`,
    parameters in each float dtype: {name: [(fused outputs, split outputs) per step]}, each a
    tuple over FLOAT_DTYPES. Under jit every optimizer, dtype and both forms in one program (one
    XLA compile for all; each variant's result its own), shared by the tests."""
    maybe_jit = jax.jit if jitted else (lambda f: f)
    # A scale at which the float16 loss stays finite: every step here is applied.
    txs = {
        n: jaxamp.loss_scaled(OPTIMIZERS[n](), jaxamp.DynamicLossScale.create(init_scale=1024.0))
        for n in names
    }
    both = _fused_and_split(txs, maybe_jit)
    params = {
        n: [jax.tree.map(lambda p, d=d: p.astype(d), _params()) for d in FLOAT_DTYPES]
        for n in names
    }
    states = {n: [txs[n].init(p) for p in params[n]] for n in names}
    scale = jaxamp.get_loss_scale(states[names[0]][0])
    batches = [_batches(3, d) for d in FLOAT_DTYPES]
    runs = {n: [] for n in names}
    for step in range(3):
        # Gradients of the scaled loss, in the parameters' dtype (as autodiff returns them).
        variants = {}
        for n in names:
            variants[n] = []
            for dtype, p, s, b in zip(FLOAT_DTYPES, params[n], states[n], batches, strict=True):
                x, y = b[step]
                g = jax.grad(lambda p, x=x, y=y, d=dtype: scale.scale(_loss(p, x, y)).astype(d))(p)
                variants[n].append((g, s, p))
        fused_out, split_out = both(variants)
        for n in names:
            runs[n].append((fused_out[n], split_out[n]))
            params[n] = [p for p, _ in fused_out[n]]
            states[n] = [s for _, s in fused_out[n]]
    return runs


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_apply_gradients_equals_update_then_apply(name, maybe_jit):
    # Parameters in each float dtype; under jit the three, and every optimizer, in one program.
    jitted = maybe_jit is jax.jit
    runs = _fused_and_split_runs(tuple(OPTIMIZERS) if jitted else (name,), jitted)[name]
    for fused_out, split_out in runs:
        for dtype, (fused_params, fused_state), (split_params, split_state) in zip(
            FLOAT_DTYPES, fused_out, split_out, strict=True
        ):
            if jitted:
                # Two XLA programs may contract a*b+c into an FMA differently.
                _leaves_ulp_close(fused_params, split_params)
                _leaves_ulp_close(fused_state.inner_state, split_state.inner_state)
            else:
                _leaves_equal((fused_params, fused_state), (split_params, split_state))
            for p in jax.tree.leaves(fused_params):
                assert p.dtype == dtype
            assert bool(fused_state.last_step_finite), jnp.dtype(dtype).name
            _leaves_equal(fused_state.loss_scale, split_state.loss_scale)


def test_apply_gradients_skip_keeps_params_and_state_bitwise(maybe_jit):
    # -0.0, a float32 subnormal and normal values: a skipped step must not touch any of them.
    # Each float dtype (the three in one program under jit); inf, -inf and NaN.
    # The leaves have `_params`' shapes: the eager form reuses the other tests' compiled ops.
    w = jnp.tile(jnp.asarray([-0.0, 0.0, 1e-40, -2.5], jnp.float32)[:, None], (1, 3))
    params = [{"w": w.astype(d), "b": jnp.ones((3,), d)} for d in FLOAT_DTYPES]
    tx = jaxamp.loss_scaled(optax.adam(1e-2))
    step = _each(lambda g, s, p: jaxamp.apply_gradients(tx, g, s, p), maybe_jit)
    good = [jax.tree.map(lambda p: jnp.full(p.shape, 1024.0, p.dtype), p) for p in params]
    first = step([(g, tx.init(p), p) for g, p in zip(good, params, strict=True)])
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        bad_grads = [{"w": g["w"].at[2].set(bad), "b": g["b"]} for g in good]
        second = step([(g, s, p) for g, (p, s) in zip(bad_grads, first, strict=True)])
        for dtype, (params1, state1), (params2, state2) in zip(
            FLOAT_DTYPES, first, second, strict=True
        ):
            case = f"{jnp.dtype(dtype).name}, {bad}"
            for new, old in zip(jax.tree.leaves(params2), jax.tree.leaves(params1), strict=True):
                assert np.asarray(new).tobytes() == np.asarray(old).tobytes(), case
            _leaves_equal(state2.inner_state, state1.inner_state)
            assert not bool(state2.last_step_finite) and int(state2.skipped_steps) == 1, case
            assert float(state2.loss_scale.loss_scale) == float(state1.loss_scale.loss_scale) / 2


@functools.cache
def _select_and_branch_runs():
    """{form: {dtype name: (params1, state1, params2, state2)}}: an applied apply_gradients step
    on gradients in each float dtype, then one with a NaN, in the branch form (``in_place=True``
    on CPU) and the select form. Per form one program for the three dtypes (each variant its
    own), shared by the tests; the two forms are two programs."""
    results = {}
    for form in ("branch", "select"):
        params = {"w": jnp.asarray([1.0, -0.0, 1e-40, 2.0], jnp.float32)}
        tx = jaxamp.loss_scaled(optax.adamw(1e-2, weight_decay=0.1), in_place=form == "branch")
        state = tx.init(params)
        step = _each(lambda g, s, p, tx=tx: jaxamp.apply_gradients(tx, g, s, p), jax.jit)
        goods = [{"w": jnp.asarray([1.0, 2.0, 3.0, 4.0], d) * 1024} for d in FLOAT_DTYPES]
        first = step([(g, state, params) for g in goods])
        second = step(
            [
                ({"w": g["w"].at[1].set(jnp.nan)}, s1, p1)
                for g, (p1, s1) in zip(goods, first, strict=True)
            ]
        )
        results[form] = {
            jnp.dtype(d).name: (*one, *two)
            for d, one, two in zip(FLOAT_DTYPES, first, second, strict=True)
        }
    return results


def test_apply_gradients_select_form_agrees_with_branch(float_dtype):
    """The select form (the default, and GPU's) gives the branch form's (``in_place=True`` on
    CPU) values bit for bit."""
    if jax.default_backend() != "cpu":
        pytest.skip("the branch form is XLA:CPU's")
    results = {}
    for form, runs in _select_and_branch_runs().items():
        params1, state1, params2, state2 = runs[float_dtype.name]
        assert np.asarray(params2["w"]).tobytes() == np.asarray(params1["w"]).tobytes()
        results[form] = (params1, state1, params2, state2)
    _leaves_equal(results["branch"], results["select"])


def test_apply_gradients_per_group_skip():
    params = {"a": jnp.ones(3), "b": jnp.full(2, 2.0)}
    labels = {"a": "a", "b": "b"}
    tx = jaxamp.loss_scaled({"a": optax.sgd(0.5), "b": optax.sgd(0.5)}, param_labels=labels)
    state = tx.init(params)
    grads = {"a": jnp.array([jnp.inf, 1.0, 1.0]), "b": jnp.full(2, 65536.0)}
    for fn in (lambda f: f, jax.jit):
        new_params, new_state = fn(lambda g, s, p: jaxamp.apply_gradients(tx, g, s, p))(
            grads, state, params
        )
        np.testing.assert_array_equal(new_params["a"], params["a"])  # its group skipped
        np.testing.assert_array_equal(new_params["b"], jnp.full(2, 1.5))  # applied
        assert float(new_state.loss_scale.loss_scale) == 32768.0


def test_apply_gradients_on_other_transformations(maybe_jit):
    params = {"w": jnp.ones(3)}
    # A transformation around one whole loss_scaled: update + apply_updates (skips keep params).
    wrapped = optax.inject_hyperparams(lambda lr: jaxamp.loss_scaled(optax.sgd(lr)))(lr=0.5)
    state = wrapped.init(params)
    new, state = maybe_jit(lambda g, s, p: jaxamp.apply_gradients(wrapped, g, s, p))(
        {"w": jnp.array([jnp.nan, 1.0, 1.0])}, state, params
    )
    np.testing.assert_array_equal(new["w"], params["w"])
    assert int(jaxamp.amp_info(state).skipped_steps) == 1
    # A plain optimizer, or loss_scaled beside others in a chain: refused.
    plain = optax.sgd(0.5)
    with pytest.raises(TypeError, match="not loss-scaled"):
        maybe_jit(lambda g, s, p: jaxamp.apply_gradients(plain, g, s, p))(
            params, plain.init(params), params
        )


def test_apply_gradients_bad_arguments():
    params = {"w": jnp.ones(3)}
    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"apply_gradients\(tx=...\).*GradientTransformation"):
        jaxamp.apply_gradients(lambda g: g, params, state, params)
    with pytest.raises(ValueError, match=r"apply_gradients\(params=None\)"):
        jaxamp.apply_gradients(tx, params, state, None)
    with pytest.raises(TypeError, match=r"apply_gradients\(state=...\)"):
        jaxamp.apply_gradients(tx, params, optax.sgd(0.1).init(params), params)


def test_apply_gradients_fuses_the_parameter_update():
    """The jitted program writes no separate updates array: `p + u` fuses into the update
    inside the branch (XLA:CPU, ``in_place=True``), as in an unwrapped step."""
    if jax.default_backend() != "cpu":
        pytest.skip("the branch form is XLA:CPU's")
    params = {"w": jnp.ones((64, 64))}
    tx = jaxamp.loss_scaled(optax.adam(1e-3), in_place=True)
    state = tx.init(params)
    grads = {"w": jnp.ones((64, 64))}
    fused = jax.jit(lambda g, s, p: jaxamp.apply_gradients(tx, g, s, p), donate_argnums=(1, 2))
    hlo = fused.lower(grads, state, params).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    # Outside the branch nothing of the parameters' shape is computed any more.
    outside = [line for line in entry.splitlines() if "f32[64,64]" in line.split("=")[0]]
    assert not [line for line in outside if " fusion(" in line], outside
    # One branch, the update's: the finite check (unscaled overflow included) has none.
    assert entry.count("conditional(") == 1


_NON_FINITE = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}


def _reduce_max_inputs(jaxpr) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(operand shape, axes) of every reduce_max in `jaxpr`, nested jaxprs included, in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_max":
            found.append((eqn.invars[0].aval.shape, tuple(eqn.params["axes"])))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_reduce_max_inputs(sub))
    return found


@pytest.mark.parametrize(
    ("shape", "blocks"),
    [
        ((32, 48), (2, 16, 3, 16)),
        ((48, 32), (3, 16, 2, 16)),  # the transpose: the same blocks, transposed
        ((3, 64, 16), (3, 4, 16, 1, 16)),
        ((24, 10), (3, 8, 5, 2)),
    ],
)
def test_check_reads_a_matrix_in_square_blocks_whichever_way_it_is_stored(
    shape, blocks, float_dtype
):
    """Under a 16-bit compute dtype cast by hand, XLA:CPU stores each kernel's gradient
    transposed (``convert(transpose(dot))``). The inf/NaN check first reduces blocks of the
    last two axes (16 x 16 where both divide): the same cache lines in either layout. Rows of
    the flattened array read a transposed gradient with a stride of a whole row, and cost a
    fp16-mixed MLP step a fifth of its time (BENCHMARKS.md)."""
    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    params = {"w": jnp.zeros(shape, jnp.float32)}
    grads = {"w": jnp.ones(shape, float_dtype)}
    for traced in (jaxamp.all_finite, lambda g: tx.update(g, tx.init(params), params)):
        first_reduce = _reduce_max_inputs(jax.make_jaxpr(traced)(grads).jaxpr)[0]
        assert first_reduce == (blocks, (len(blocks) - 3, len(blocks) - 1))


def test_a_transposed_16_bit_gradient_is_checked_element_by_element(maybe_jit):
    """The case the blocks are for, end to end: a kernel's gradient through a hand-written
    narrowing cast (as a Flax module's ``dtype=``), which XLA:CPU stores transposed. One
    non-finite input element makes one row of the 32 x 48 gradient inf/NaN; the step skips
    exactly then, and the parameters stay finite. Each float dtype (one program under jit)."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(32, 48)) * 0.1, jnp.float32)}
    tx = jaxamp.loss_scaled(optax.adam(1e-2))

    def grads_of(params, opt_state, x):
        grads = []
        for dtype in FLOAT_DTYPES:

            def loss(p, x, dtype=dtype):
                y = x.astype(dtype) @ p["w"].astype(dtype)
                return jnp.mean(y.astype(jnp.float32) ** 2)

            grads.append(jaxamp.value_and_grad(loss)(params, x, loss_scale=opt_state)[1])
        return grads

    def apply_each(params, opt_state, grads):
        return tuple(jaxamp.apply_gradients(tx, g, opt_state, params) for g in grads)

    if maybe_jit is jax.jit:  # gradients and check in one program: XLA stores them transposed
        each = jax.jit(lambda p, s, x: apply_each(p, s, grads_of(p, s, x)))
    else:  # the decision eagerly; the gradients (no eager-only path) compiled
        compiled_grads = jax.jit(grads_of)

        def each(p, s, x):
            return apply_each(p, s, compiled_grads(p, s, x))

    for bad in (None, *_NON_FINITE):
        x = rng.normal(size=(8, 32)).astype(np.float32)
        if bad is not None:
            x[5, 19] = _NON_FINITE[bad]
        for dtype, (new_params, opt_state) in zip(
            FLOAT_DTYPES, each(params, tx.init(params), jnp.asarray(x)), strict=True
        ):
            case = (jnp.dtype(dtype).name, bad)
            assert bool(jaxamp.amp_info(opt_state).last_step_applied) is (bad is None), case
            assert np.isfinite(np.asarray(new_params["w"])).all(), case
            changed = not np.array_equal(np.asarray(new_params["w"]), np.asarray(params["w"]))
            assert changed is (bad is None), case
