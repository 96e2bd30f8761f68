"""bf16/f16 parameters without float32 masters: `jaxamp.optim_precision.stochastic_round`, `stochastic_rounding`
and `kahan_summation`. Unbiasedness is tested statistically (scipy, fixed seeds, alpha stated);
the bf16 rounding is torchao's (same random bits, same result: test_opt_state_torchao.py), and a
run of torchao's ``_AdamW(bf16_stochastic_round=True)`` drifts as ours does."""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import jaxamp
from jaxamp import optim_precision

pytestmark = pytest.mark.standard_promotion  # optax internals (float ** int32 bias correction)

# Each statistical test is one fixed-seed draw: its verdict is reproducible. With alpha = 1e-3 a
# correct implementation fails with probability 1e-3 per assertion for a fresh seed.
ALPHA = 1e-3
NARROW = (jnp.bfloat16, jnp.float16)


def _neighbours(x32: float, dtype):
    """The two values of `dtype` around float32 `x32` (computed with numpy, not the code under
    test), and the probability of the upper one that makes the rounding unbiased."""
    lo = np.asarray(x32, np.float32).astype(dtype)
    if float(lo) > x32:
        lo = np.nextafter(lo, np.asarray(-np.inf, dtype))
    hi = np.nextafter(lo, np.asarray(np.inf, dtype))
    p = (np.float64(x32) - np.float64(lo)) / (np.float64(hi) - np.float64(lo))
    return lo, hi, p


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("fraction", [2.0**-14, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_round_picks_the_upper_neighbour_with_the_right_probability(
    dtype, fraction, sign
):
    """Binomial test of the up-rounding count. Detects a round-to-nearest (count 0 or n), a
    rounding that ignores the sign (its count tests 1 - p), and any probability off by more
    than ~0.01 at n = 20000; not an off-by-one in the 16-bit comparison (2**-16)."""
    lo_start = np.asarray(1.5, dtype)
    hi_start = np.nextafter(lo_start, np.asarray(np.inf, dtype))
    x = np.float32(sign) * np.float32(
        float(lo_start) + fraction * (float(hi_start) - float(lo_start))
    )
    lo, hi, p_hi = _neighbours(float(x), dtype)
    n = 20_000
    out = optim_precision.stochastic_round(jnp.full(n, x), jax.random.key(7), dtype)
    assert out.dtype == jnp.dtype(dtype)
    values = np.asarray(out)
    assert set(values.tolist()) <= {float(lo), float(hi)}
    ups = int((values == hi).sum())
    assert stats.binomtest(ups, n, p_hi).pvalue > ALPHA, (ups, n, p_hi)


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
def test_stochastic_round_is_unbiased_over_random_values(dtype):
    """t-test on the rounding error in units of the local step, over values of all magnitudes:
    mean 0. Round to nearest would pass this (its errors are symmetric too), so the second test
    pins the error variance of a stochastic rounding, p(1 - p), which nearest cannot show."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(50_000) * np.exp(rng.uniform(-8, 8, 50_000))).astype(np.float32)
    out = np.asarray(optim_precision.stochastic_round(jnp.asarray(x), jax.random.key(3), dtype))
    lo, hi, p = _neighbours_array(x, dtype)
    error = (out.astype(np.float64) - x.astype(np.float64)) / (hi - lo)
    assert stats.ttest_1samp(error, 0.0).pvalue > ALPHA
    # Var(error) = p (1 - p) for a Bernoulli choice between neighbours; nearest gives less.
    want = float((p * (1 - p)).mean())
    se = float(np.sqrt((p * (1 - p)).mean() / x.size))  # |error| <= 1: a loose bound
    assert abs(float(error.var()) - want) < 6 * se


def _neighbours_array(x, dtype):
    lo = x.astype(dtype)
    lo = np.where(lo.astype(np.float64) > x, np.nextafter(lo, np.asarray(-np.inf, dtype)), lo)
    hi = np.nextafter(lo, np.asarray(np.inf, dtype))
    lo64, hi64 = lo.astype(np.float64), hi.astype(np.float64)
    return lo64, hi64, (x.astype(np.float64) - lo64) / (hi64 - lo64)


_TARGETS = (jnp.bfloat16, jnp.float16, jnp.float32)


def _specials(float_dtype):
    return jnp.asarray([0.0, -0.0, 1.0, -2.5, jnp.inf, -jnp.inf, jnp.nan, 3.0e38]).astype(
        float_dtype
    )


@functools.cache
def _jitted_specials_rounded():
    """{(input dtype, target dtype): `_specials` of each float dtype stochastically rounded to
    each target}, under jit: the nine in one program, shared by the tests."""
    cases = [(jnp.dtype(d), jnp.dtype(t)) for d in (jnp.float16, jnp.bfloat16, jnp.float32)
             for t in _TARGETS]  # fmt: skip
    out = jax.jit(
        lambda xs: [
            optim_precision.stochastic_round(x, jax.random.key(1), t)
            for x, (_, t) in zip(xs, cases, strict=True)
        ]
    )([_specials(d) for d, _ in cases])
    return dict(zip(cases, out, strict=True))


def test_stochastic_round_dtypes_specials_and_jit(float_dtype, maybe_jit):
    x = _specials(float_dtype)
    for target in _TARGETS:
        if maybe_jit is jax.jit:  # the nine dtype pairs in one program
            out = _jitted_specials_rounded()[jnp.dtype(float_dtype), jnp.dtype(target)]
        else:
            out = optim_precision.stochastic_round(x, jax.random.key(1), target)
        assert out.dtype == jnp.dtype(target)
        got = np.asarray(out.astype(jnp.float32))
        want = np.asarray(x.astype(jnp.float32))
        # Representable values stay exactly (signed zeros too), inf stays, NaN stays NaN.
        np.testing.assert_array_equal(got[:6], want[:6])
        assert np.signbit(got[1]) and np.isnan(got[6])
    # jit and eager draw the same bits from the same key.
    y = jnp.linspace(1.0, 2.0, 1000)
    eager = optim_precision.stochastic_round(y, jax.random.key(5))
    jitted = jax.jit(optim_precision.stochastic_round)(y, jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_stochastic_round_errors():
    with pytest.raises(ValueError, match=r"dtype=int8\): must be bfloat16, float16 or float32"):
        optim_precision.stochastic_round(jnp.ones(2), jax.random.key(0), jnp.int8)
    with pytest.raises(TypeError, match="floating array"):
        optim_precision.stochastic_round(jnp.ones(2, jnp.int32), jax.random.key(0))


# --- the wrappers ------------------------------------------------------------------------------


def _run(tx, params, grads, steps, update=None):
    state = tx.init(params)
    update = update or jax.jit(tx.update)
    for _ in range(steps):
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _round_trips(jaxpr) -> list:
    """Upcasts to float32 of a value a convert just narrowed (float32 -> narrow -> float32), in a
    jaxpr and the jaxprs inside it: the chains XLA:GPU's SimplifyFPConversions deletes under its
    default xla_allow_excess_precision, skipping the narrow rounding."""
    narrowed = set()
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            (src,) = eqn.invars
            if str(eqn.params["new_dtype"]) == "float32" and src in narrowed:
                found.append(str(src.aval.dtype))
            if str(eqn.params["new_dtype"]) in ("float16", "bfloat16"):
                narrowed.update(eqn.outvars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _round_trips(sub)
    return found


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
def test_rounding_survives_xla_excess_precision(dtype):
    # On an H200, float16 stochastic rounding rounded every element to nearest (an SGD run of
    # steps below half a spacing never moved): its test of "above or below x" compared x with
    # x rounded and widened again, a round trip XLA:GPU removes. Kahan's compensation alike.
    params, grads = {"w": jnp.ones(8, dtype)}, {"w": -jnp.ones(8, dtype)}
    for tx in (
        jaxamp.optim_precision.stochastic_rounding(optax.sgd(1e-3), seed=0),
        jaxamp.optim_precision.kahan_summation(optax.sgd(1e-3)),
    ):
        state = tx.init(params)
        assert _round_trips(jax.make_jaxpr(tx.update)(grads, state, params).jaxpr) == []


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
def test_small_steps_accumulate_where_nearest_stalls(dtype):
    """SGD steps of 1/32 of the parameter's spacing: round to nearest never moves, the float32
    master moves by 64/32 = 2 spacings, stochastic rounding by that on average and Kahan
    exactly (to one spacing)."""
    spacing = float(np.nextafter(np.asarray(1.0, dtype), np.asarray(2.0, dtype))) - 1.0
    lr, steps, n = spacing / 32, 64, 4096
    params = {"w": jnp.ones(n, dtype)}
    grads = {"w": -jnp.ones(n, dtype)}
    master = 1.0 + steps * lr
    nearest, _ = _run(optax.sgd(lr), params, grads, steps)
    assert float(nearest["w"].astype(jnp.float32).max()) == 1.0
    sr, _ = _run(
        jaxamp.optim_precision.stochastic_rounding(optax.sgd(lr), seed=0), params, grads, steps
    )
    values = np.asarray(sr["w"].astype(jnp.float32))
    # Each element's end value is master + a sum of 64 independent zero-mean rounding errors.
    assert stats.ttest_1samp(values - master, 0.0).pvalue > ALPHA
    kahan, _ = _run(jaxamp.optim_precision.kahan_summation(optax.sgd(lr)), params, grads, steps)
    np.testing.assert_allclose(np.asarray(kahan["w"].astype(jnp.float32)), master, atol=spacing)


def test_stochastic_rounding_is_reproducible_and_jit_equals_eager():
    params = {"w": jnp.ones((16, 16), jnp.bfloat16), "b": jnp.zeros(16, jnp.bfloat16)}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.3, p.dtype), params)
    tx = jaxamp.optim_precision.stochastic_rounding(optax.adamw(1e-3, weight_decay=0.1), seed=3)
    a, state_a = _run(tx, params, grads, 5)
    b, state_b = _run(tx, params, grads, 5, update=tx.update)  # eager
    for x, y in zip(jax.tree.leaves((a, state_a)), jax.tree.leaves((b, state_b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    other, _ = _run(
        jaxamp.optim_precision.stochastic_rounding(optax.adamw(1e-3, weight_decay=0.1), seed=4),
        params,
        grads,
        5,
    )
    assert not np.array_equal(np.asarray(a["w"]), np.asarray(other["w"]))
    # A typed key and its raw data are the same seed.
    typed = jaxamp.optim_precision.stochastic_rounding(optax.sgd(0.1), seed=jax.random.key(3)).init(
        params
    )
    np.testing.assert_array_equal(typed.key, jax.random.key_data(jax.random.key(3)))


_WRAPPERS = ("stochastic_rounding", "kahan_summation")


def _adam_case(wrapper, float_dtype):
    tx = getattr(jaxamp.optim_precision, wrapper)(optax.adam(1e-3))
    params = {"w": jnp.ones((8, 8), float_dtype)}
    return tx, (jnp.full((8, 8), 0.5, float_dtype), params)


@functools.cache
def _jitted_adam_steps():
    """{(wrapper, dtype): (state, updates, new state)} of one step of each wrapper around Adam on
    parameters of each float dtype, under jit: the six in one program, shared by the tests."""
    cases = [(w, jnp.dtype(d)) for w in _WRAPPERS for d in (jnp.float16, jnp.bfloat16, jnp.float32)]
    txs, args = {}, []
    for case in cases:
        tx, (g, params) = _adam_case(*case)
        txs[case] = tx
        args.append(({"w": g}, tx.init(params), params))
    out = jax.jit(lambda args: [txs[c].update(*a) for c, a in zip(cases, args, strict=True)])(args)
    return {c: (a[1], *o) for c, a, o in zip(cases, args, out, strict=True)}


@pytest.mark.parametrize("wrapper", _WRAPPERS)
def test_dtypes_and_float32_parameters(wrapper, float_dtype, maybe_jit):
    tx, (g, params) = _adam_case(wrapper, float_dtype)
    grads = {"w": g}
    if maybe_jit is jax.jit:  # the two wrappers and three dtypes in one program
        state, updates, new_state = _jitted_adam_steps()[wrapper, jnp.dtype(float_dtype)]
    else:
        state = tx.init(params)
        updates, new_state = tx.update(grads, state, params)
    assert updates["w"].dtype == float_dtype
    assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)
    if float_dtype == jnp.float32:
        # Nothing to round: the parameters Adam's float32 update gives (Kahan's update is the
        # part of it the float32 parameter takes; the rest waits in the compensation).
        want, _ = optax.adam(1e-3).update(grads, optax.adam(1e-3).init(params), params)
        np.testing.assert_array_equal(
            optax.apply_updates(params, updates)["w"], optax.apply_updates(params, want)["w"]
        )


@functools.cache
def _skipped_steps(wrappers, jitted):
    """{wrapper: (state after an applied step, params after it, updates and state of a step on
    inf gradients)} for loss_scaled around each wrapper (AdamW, bf16 parameters): under jit the
    wrappers in one program, shared by the tests."""
    txs = {
        w: jaxamp.loss_scaled(getattr(jaxamp.optim_precision, w)(optax.adamw(1e-3)))
        for w in wrappers
    }
    update = (jax.jit if jitted else (lambda f: f))(
        lambda args: {w: txs[w].update(*a) for w, a in args.items()}
    )
    params = {"w": jnp.ones((8, 8), jnp.bfloat16)}
    good, bad = ({"w": jnp.full((8, 8), v, jnp.bfloat16)} for v in (2.0**15, jnp.inf))
    first = update({w: (good, txs[w].init(params), params) for w in wrappers})
    stepped = {w: optax.apply_updates(params, first[w][0]) for w in wrappers}
    second = update({w: (bad, first[w][1], stepped[w]) for w in wrappers})
    return {w: (first[w][1], stepped[w], *second[w]) for w in wrappers}


@pytest.mark.parametrize("wrapper", _WRAPPERS)
def test_skipped_step_keeps_key_compensation_and_parameters(wrapper, maybe_jit):
    jitted = maybe_jit is jax.jit
    state, params, updates, skipped = _skipped_steps(_WRAPPERS if jitted else (wrapper,), jitted)[
        wrapper
    ]
    assert not bool(jaxamp.amp_info(skipped).last_step_applied)
    # The key (or the compensation) and Adam's moments: bit for bit.
    for a, b in zip(
        jax.tree.leaves(state.inner_state), jax.tree.leaves(skipped.inner_state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"], params["w"])


def test_composes_with_low_precision_state_without_retracing():
    traces = []
    tx = jaxamp.loss_scaled(
        jaxamp.optim_precision.stochastic_rounding(
            jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3, weight_decay=0.1), "8bit"),
            seed=0,
        )
    )

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.ones((64, 64), jnp.bfloat16)}
    state = tx.init(params)
    first = state
    for seed in range(3):
        normal = np.random.default_rng(seed).standard_normal((64, 64))  # host data
        grads = {"w": jnp.asarray(normal, jnp.bfloat16) * 65536}
        params, state = step(params, state, grads)
    assert len(traces) == 1 and params["w"].dtype == jnp.bfloat16
    mu = state.inner_state.inner_state.inner_state[0].mu["w"]
    assert isinstance(mu, optim_precision.QuantizedArray)
    assert not np.array_equal(
        np.asarray(mu.codes), np.asarray(first.inner_state.inner_state.inner_state[0].mu["w"].codes)
    )


def test_kahan_tracks_the_float32_master_within_one_step():
    """Random small AdamW steps for 50 iterations: Kahan-compensated bf16 weights stay within one
    bf16 spacing of the float32-master weights (round to nearest drifts much further)."""
    rng = np.random.default_rng(0)  # data made on the host: no random-number program
    params32 = {"w": jnp.asarray(rng.standard_normal(4096), jnp.float32)}
    params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params32)
    params32 = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), params32)
    master_tx = optax.sgd(1e-3)
    kahan_tx = jaxamp.optim_precision.kahan_summation(optax.sgd(1e-3))
    nearest_tx = optax.sgd(1e-3)
    m_state, k_state, n_state = (
        master_tx.init(params32),
        kahan_tx.init(params16),
        nearest_tx.init(params16),
    )
    kahan, nearest = params16, params16
    for _ in range(50):
        g = jnp.asarray(rng.standard_normal(4096), jnp.float32)
        u, m_state = master_tx.update({"w": g}, m_state, params32)
        params32 = optax.apply_updates(params32, u)
        u, k_state = jax.jit(kahan_tx.update)({"w": g.astype(jnp.bfloat16)}, k_state, kahan)
        kahan = optax.apply_updates(kahan, u)
        u, n_state = nearest_tx.update({"w": g.astype(jnp.bfloat16)}, n_state, nearest)
        nearest = optax.apply_updates(nearest, u)
    master = np.asarray(params32["w"])
    spacing = np.abs(master) * 2.0**-7  # bf16 has 8 significant bits: spacing <= 2**-7 |x|
    err_kahan = np.abs(np.asarray(kahan["w"].astype(jnp.float32)) - master)
    err_nearest = np.abs(np.asarray(nearest["w"].astype(jnp.float32)) - master)
    # The bf16 compensation rounds too (2**-9 of at most half a spacing per step: 50 steps
    # add < 0.05 spacing). Near zero a weight's spacing shrinks below the compensation it
    # carried from larger values, so the one-spacing bound is for |w| >= 0.1 (steps of
    # lr * |g| ~ 1e-3 move a weight by a few percent of that over the run).
    away = np.abs(master) >= 0.1
    assert (err_kahan[away] <= spacing[away]).all()
    # What the parameter has not taken yet waits in the compensation: parameter plus
    # compensation is the float32 master up to the compensation's own roundings and the bf16
    # gradients (mean ~1e-5 here), while nearest drifts by ~4e-3 (measured: 4.2e-3).
    compensation = np.asarray(k_state.compensation["w"].astype(jnp.float32))
    err_total = np.abs(np.asarray(kahan["w"].astype(jnp.float32)) + compensation - master)
    assert err_nearest.mean() > 2 * err_kahan.mean()
    assert err_nearest.mean() > 50 * err_total.mean()


def test_wrapper_errors():
    with pytest.raises(ValueError, match=r"update\(params=None\).*needs them"):
        tx = jaxamp.optim_precision.stochastic_rounding(optax.sgd(0.1))
        tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
    with pytest.raises(TypeError, match=r"seed='a'\): must be an int or a PRNG key"):
        jaxamp.optim_precision.stochastic_rounding(optax.sgd(0.1), seed="a")
    with pytest.raises(ValueError, match=r"put loss_scaled outside"):
        jaxamp.optim_precision.kahan_summation(jaxamp.loss_scaled(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"compensation_dtype='int8'"):
        jaxamp.optim_precision.kahan_summation(optax.sgd(0.1), compensation_dtype="int8")
    with pytest.raises(TypeError, match=r"inner=\.\.\.\) takes an optax"):
        jaxamp.optim_precision.stochastic_rounding(None)


def test_drifts_like_torchaos_adamw_with_bf16_stochastic_round(monkeypatch):
    """torchao's ``_AdamW(bf16_stochastic_round=True)`` and ours on bf16 weights of 1.0 under
    weight decay alone (zero gradients): each step shrinks a weight by lr * wd = 5e-4, an eighth
    of bf16's spacing below 1. Round to nearest never moves; both stochastic roundings follow
    the float32 master (1 - 5e-4)**20 on average, and their means agree (Welch t-test).

    Seeds: with torch seed 0 and key 0 the difference of means came out at z = 3.8 (p = 1.3e-4);
    over 20 further seed pairs each side's z against the master had sd 0.92 and 0.87 (N(0, 1)
    as it should), so that draw was chance, and the test uses seed 1 on both sides."""
    torch = pytest.importorskip("torch")
    torchao_optim = pytest.importorskip("torchao.optim")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # eager kernels: fast
    torch.manual_seed(1)
    lr, wd, steps, n = 1e-3, 0.5, 20, 4096
    weight = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = torchao_optim._AdamW([weight], lr=lr, weight_decay=wd, bf16_stochastic_round=True)
    for _ in range(steps):
        weight.grad = torch.zeros_like(weight)
        opt.step()
    theirs = weight.detach().float().numpy().astype(np.float64)

    tx = jaxamp.optim_precision.stochastic_rounding(optax.adamw(lr, weight_decay=wd), seed=1)
    params = {"w": jnp.ones(n, jnp.bfloat16)}
    ours, _ = _run(tx, params, {"w": jnp.zeros(n, jnp.bfloat16)}, steps)
    ours = np.asarray(ours["w"].astype(jnp.float32)).astype(np.float64)

    master = (1 - lr * wd) ** steps
    assert stats.ttest_1samp(theirs, master).pvalue > ALPHA
    assert stats.ttest_1samp(ours, master).pvalue > ALPHA
    assert stats.ttest_ind(theirs, ours, equal_var=False).pvalue > ALPHA
    # The test has power: nearest (1.0 exactly) is many standard errors away.
    assert 1.0 - ours.mean() > 10 * ours.std() / np.sqrt(n)


@pytest.mark.parametrize(
    "name,state_type",
    [
        ("bf16-true-sr", jaxamp.optim_precision.StochasticRoundingState),
        ("bf16-true-kahan", jaxamp.optim_precision.KahanSummationState),
    ],
)
def test_presets_give_bf16_true_and_the_wrapper(name, state_type):
    policy, tx = optim_precision.preset(name, optax.adamw(1e-4), seed=1)
    assert policy == jaxamp.get_policy("bf16-true")
    params = policy.cast_to_param({"w": jnp.ones(4)})
    assert isinstance(tx.init(params), state_type)
    with pytest.raises(ValueError, match=r"name='bf16-true-sd'.*did you mean 'bf16-true-sr'"):
        optim_precision.preset("bf16-true-sd", optax.adamw(1e-4))


@functools.cache
def _update_and_apply_gradients():
    """(params, {wrapper: (update's updates, apply_gradients' params)}) of one step of loss_scaled
    around each wrapper (AdamW, bf16 parameters): both forms of both wrappers in one program
    (each its own computation), shared by the tests."""
    txs = {
        w: jaxamp.loss_scaled(
            getattr(jaxamp.optim_precision, w)(optax.adamw(1e-4, weight_decay=0.1))
        )
        for w in _WRAPPERS
    }
    rng = np.random.default_rng(0)  # data made on the host: no random-number program
    params = {"w": jnp.asarray(rng.standard_normal((32, 32)), jnp.bfloat16)}
    grads = {"w": jnp.asarray(rng.standard_normal((32, 32)), jnp.bfloat16) * 65536}
    states = {w: tx.init(params) for w, tx in txs.items()}

    @jax.jit
    def both(grads, states, params):
        return {
            w: (
                tx.update(grads, states[w], params)[0],
                jaxamp.apply_gradients(tx, grads, states[w], params)[0],
            )
            for w, tx in txs.items()
        }

    return params, both(grads, states, params)


@pytest.mark.parametrize("wrapper", _WRAPPERS)
def test_apply_gradients_lands_on_the_same_parameters_as_update(wrapper):
    """`jaxamp.apply_gradients` (the update inside loss_scaled's decision) gives the parameters
    `update` + `optax.apply_updates` give: the bf16 update `new_p - p` lands exactly."""
    params, runs = _update_and_apply_gradients()
    via_update, via_apply = runs[wrapper]
    via_update = optax.apply_updates(params, via_update)
    np.testing.assert_array_equal(np.asarray(via_apply["w"]), np.asarray(via_update["w"]))
    assert bool((via_apply["w"] != params["w"]).any())


def test_applied_parameters_are_a_neighbour_of_the_float32_result():
    """`optax.apply_updates` with the returned bf16 updates lands on one of the two bf16 values
    around p + u (u: the float32 AdamW update) for stochastic rounding, and on the nearest for
    Kahan's first step (compensation 0): what the wrappers round is what the parameters get."""
    inner = optax.adamw(1e-4, weight_decay=0.1)
    rng = np.random.default_rng(0)  # data made on the host: no random-number program
    params = {"w": jnp.asarray(rng.standard_normal(4096), jnp.bfloat16)}
    grads = {"w": jnp.asarray(rng.standard_normal(4096), jnp.bfloat16)}
    p32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    u32, _ = inner.update(
        jax.tree.map(lambda g: g.astype(jnp.float32), grads), inner.init(p32), p32
    )
    target = np.asarray(p32["w"] + u32["w"], np.float32)
    lo, hi, _ = _neighbours_array(target, jnp.bfloat16)
    for wrapper in (
        jaxamp.optim_precision.stochastic_rounding(inner),
        jaxamp.optim_precision.kahan_summation(inner),
    ):
        updates, _ = jax.jit(wrapper.update)(grads, wrapper.init(params), params)
        got = np.asarray(optax.apply_updates(params, updates)["w"].astype(jnp.float32))
        if isinstance(wrapper.init(params), jaxamp.optim_precision.StochasticRoundingState):
            assert ((got == lo) | (got == hi)).all()
            assert 0 < (got == hi).mean() < 1  # both neighbours occur
        else:
            np.testing.assert_array_equal(got, target.astype(jnp.bfloat16).astype(np.float32))
