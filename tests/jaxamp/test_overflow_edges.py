"""Overflow at the top of float32's range: the check sees it, and unscaling stays exact.

* The inf/NaN check must see a gradient that overflows only once scaled, at every loss scale up
  to float32's maximum, eagerly and under `jit`, whatever the compiler may reassociate: a row
  sum of the scaled gradients, ``sum(g * scale)``, may legally be computed as
  ``scale * sum(g)`` under reassociation, which is finite.
* Unscaling must be exact at every reachable scale under `jit` with the scale a compile-time
  constant too (XLA folded the two reciprocal factors into one subnormal, flushed to 0).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxamp

F32_MAX = float(np.finfo(np.float32).max)
# Every binade edge a scale can sit on: 2**0 .. 2**127, and float32's maximum (the flax preset
# caps there; torch's, jmp's, keras' and megatron's rules reach 2**127 by growth).
EDGE_SCALES = [2.0**k for k in range(128)] + [F32_MAX]
# The issue's gradient row: one element overflows when scaled by float32's max, the row's sum
# (0.85) does not.
ROW = np.array([-0.3, -0.1, 1.45, -0.2], np.float32)


def _overflowing_row(scale: float, above: bool) -> np.ndarray:
    """A row whose largest element times `scale` is float32's largest finite value (`above`:
    the next float32 up, which overflows), and whose other elements cancel most of it."""
    scale32 = np.float32(scale)
    with np.errstate(over="ignore"):
        big = np.float32(F32_MAX) / scale32
        while np.isinf(big * scale32):
            big = np.nextafter(big, np.float32(0))
        while np.isfinite(np.nextafter(big, np.float32(np.inf)) * scale32):
            big = np.nextafter(big, np.float32(np.inf))
        row = np.array([-0.3, -0.1, 1.0, -0.2], np.float32) * big  # finite, cancels most
        # Above: the next float32 (inf itself at a scale of 1, where nothing else overflows).
        row[2] = np.nextafter(big, np.float32(np.inf)) if above else big
    return row


def _step(tx):
    def step(params, opt_state, x):
        _, grads = jaxamp.value_and_grad(lambda p, x: jnp.sum(p * x))(
            params, x, loss_scale=opt_state
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


# One optimizer for every edge: the loss scale lives in the state (traced under `jit`), so one
# compiled step per gradient shape serves every scale.
_FLAX_SGD = jaxamp.loss_scaled(optax.sgd(1e-3), "flax")
_FLAX_SGD_STEP = _step(_FLAX_SGD)
_FLAX_SGD_JIT_STEP = jax.jit(_FLAX_SGD_STEP)


def _expected_skip(x: np.ndarray, scale: float) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):
        return not bool(np.isfinite(x.astype(np.float32) * np.float32(scale)).all())


# --- a gradient that overflows only when scaled is skipped ----------------------------------------


@settings(max_examples=40, deadline=None)
@example(edge=128, above=True, sign=-1.0, rows=1)  # float32 max: the issue's case
@example(edge=127, above=True, sign=1.0, rows=1)
@example(edge=127, above=False, sign=1.0, rows=3)
@example(edge=0, above=True, sign=-1.0, rows=2)
@given(
    edge=st.integers(0, len(EDGE_SCALES) - 1),
    above=st.booleans(),
    sign=st.sampled_from([1.0, -1.0]),
    rows=st.integers(1, 3),
)
def test_overflow_when_scaled_is_skipped_at_every_binade_edge(edge, above, sign, rows):
    """Just below the edge the step applies (params move, finite); just above it the step
    is skipped (params bit for bit, scale backed off), eagerly, jitted with the scale traced."""
    scale = EDGE_SCALES[edge]
    x = np.tile(sign * _overflowing_row(scale, above), (rows, 1))
    skip = _expected_skip(x, scale)
    assert skip == above  # the row is built to sit on the edge
    loss_scale = jaxamp.DynamicLossScale.from_preset("flax", init_scale=scale)
    params = jnp.zeros(x.shape)
    opt_state = jaxamp.set_loss_scale(_FLAX_SGD.init(params), loss_scale)
    for run in (_FLAX_SGD_STEP, _FLAX_SGD_JIT_STEP):
        new_params, state = run(params, opt_state, jnp.asarray(x))
        assert float(jaxamp.amp_info(state).loss_scale) == float(
            loss_scale.adjust(jnp.array(not skip)).loss_scale
        )
        assert bool(jnp.isfinite(new_params).all())
        assert int(jaxamp.amp_info(state).skipped_steps) == int(skip)
        if skip:
            assert np.asarray(new_params).tobytes() == np.asarray(params).tobytes()
        else:
            assert bool(jnp.any(new_params != 0))


@pytest.mark.parametrize("scale", [2.0**126, 2.0**127, F32_MAX], ids=lambda s: f"{s:.4g}")
def test_overflow_skipped_with_the_scale_a_compile_time_constant(scale):
    """The loss scale closed over by the jitted step (a constant XLA may fold into the check)."""
    x = _overflowing_row(scale, above=True)
    loss_scale = jaxamp.DynamicLossScale.from_preset("flax", init_scale=scale)
    tx = jaxamp.loss_scaled(optax.sgd(1e-3), loss_scale)
    params = jnp.zeros(x.shape)
    opt_state = tx.init(params)
    new_params, state = jax.jit(lambda p, x: _step(tx)(p, opt_state, x))(params, jnp.asarray(x))
    assert np.asarray(new_params).tobytes() == np.asarray(params).tobytes()
    assert int(state.skipped_steps) == 1


def test_the_issues_step_is_skipped(maybe_jit):
    loss_scale = jaxamp.DynamicLossScale.from_preset("flax", init_scale=F32_MAX)
    tx = jaxamp.loss_scaled(optax.sgd(1e-3), loss_scale)
    params = jnp.zeros(4)
    new_params, state = maybe_jit(_step(tx))(params, tx.init(params), jnp.asarray(ROW))
    np.testing.assert_array_equal(np.asarray(new_params), np.zeros(4, np.float32))
    assert not bool(state.last_step_finite)


_REASSOCIATING = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax, jaxamp
    tx = jaxamp.loss_scaled(optax.sgd(1e-3), jaxamp.DynamicLossScale.from_preset("flax"))

    @jax.jit  # the scale is traced (a leaf of the state): one program per length
    def step(p, st, x):
        _, g = jaxamp.value_and_grad(lambda p, x: jnp.sum(p * x))(p, x, loss_scale=st)
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st

    out = []
    for scale in (2.0**126, 2.0**127, float(np.finfo(np.float32).max)):
        ls = jaxamp.DynamicLossScale.from_preset("flax", init_scale=scale)
        for n in (4, 64):
            x = np.resize(np.array([-0.3, -0.1, 1.45, -0.2], np.float32), n) * (
                np.float32(np.finfo(np.float32).max / scale))
            p = jnp.zeros(n)
            new, st = step(p, jaxamp.set_loss_scale(tx.init(p), ls), jnp.asarray(x))
            out.append((bool(jnp.isfinite(new).all()), int(st.skipped_steps)))
    print(out)
    import gc
    gc.freeze()  # exit without the final collection's walk over every JAX object
    """
)


@pytest.mark.integration
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's reassociation flags")
def test_check_survives_a_compiler_that_reassociates():
    """XLA:CPU allowed to reassociate (fast math that still honours inf and NaN): the old row
    sums said finite here and wrote NaN into the parameters; the bit-level check cannot be
    reassociated. Run in a fresh process (the flags are read once per process)."""
    flags = (
        "--xla_cpu_enable_fast_math=true --xla_cpu_fast_math_honor_infs=true "
        "--xla_cpu_fast_math_honor_nans=true"
    )
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", _REASSOCIATING],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert result.stdout.strip() == str([(True, 1)] * 6), result.stdout + result.stderr


def _computations(hlo: str) -> dict[str, str]:
    """Each computation of an HLO module's text, by name."""
    blocks = re.split(r"\n(?=(?:ENTRY )?%\S+ \()", hlo)
    named = {}
    for block in blocks:
        match = re.match(r"(?:ENTRY )?%(\S+) \(", block)
        if match:
            named[match.group(1)] = block
    return named


def test_compiled_check_has_no_float_arithmetic_reduction():
    """The optimized program of the check, scaled gradients computed in the same program (so
    the multiply is there to be moved): no reduction adds or multiplies floats (a sum could be
    refactored as scale * sum), the only float reduction is a maximum, and what it reduces
    comes out of an integer AND of the gradients' bits (nothing to factor a multiply out of)."""
    loss_scale = jaxamp.DynamicLossScale.create(init_scale=2.0**127)

    def check(x):
        grads = loss_scale.scale({"w": x, "b": x[0]})
        return jaxamp.all_finite(grads)

    hlo = jax.jit(check).lower(jnp.ones((8, 16))).compile().as_text()
    computations = _computations(hlo)
    reducers = set(re.findall(r"to_apply=%(\S+?)[,\s}]", hlo))
    assert reducers, "no reduction found: the check was not compiled as expected"
    float_type = r"(?:f16|bf16|f32|f64)\[\]"
    for name in reducers:
        body = computations[name]
        root = re.search(r"ROOT %\S+ = (\S+) (\w[\w-]*)\(", body)
        assert root, body
        dtype, op = root.groups()
        if re.fullmatch(float_type, dtype):
            assert op in ("maximum", "minimum"), f"a float {op} reduction: {body}"
    # The maximum's operand is the exponent field: bits of the gradients ANDed as integers.
    assert re.search(r"u32\[8,16\]\S* and\(", hlo), hlo
    if jax.default_backend() == "cpu":
        assert "bitcast-convert" in hlo
    else:  # XLA:GPU writes a same-width reinterpretation as a bitcast
        assert re.search(r"u32\[[\d,]*\]\S* bitcast(?:-convert)?\(", hlo), hlo


def test_all_finite_at_every_binade_edge(maybe_jit):
    """Scaled by the scale itself inside the program (a compile-time constant under `jit`),
    every edge: just below it finite, just above it not. Under `jit` one program holds every
    edge's check, each on its own input."""
    scales = [jaxamp.StaticLossScale(scale) for scale in EDGE_SCALES]
    check = maybe_jit(
        lambda rows: [jaxamp.all_finite(s.scale(row)) for s, row in zip(scales, rows, strict=True)]
    )
    for above in (False, True):
        rows = [jnp.asarray(_overflowing_row(scale, above)) for scale in EDGE_SCALES]
        wrong = [
            scale
            for scale, finite in zip(EDGE_SCALES, check(rows), strict=True)
            if bool(finite) is above
        ]
        assert not wrong, (above, wrong)


_EDGES_AT_DEFAULT_LEVEL = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, jaxamp
    rows = np.load(sys.argv[1])  # (edge, below/above, 4)
    scales = [jaxamp.StaticLossScale(float(s)) for s in np.load(sys.argv[2])]
    check = jax.jit(lambda rows: [jaxamp.all_finite(s.scale(r)) for s, r in zip(scales, rows)])
    print(json.dumps([[bool(f) for f in check(list(rows[:, side]))] for side in (0, 1)]))
    """
)


@pytest.mark.integration
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's optimisation level")
def test_all_finite_at_every_binade_edge_at_xla_default_optimisation(tmp_path):
    """The jitted edge check above with XLA:CPU at its default optimisation level whatever
    XLA_FLAGS the caller set: LLVM's passes at that level are what turned a row sum of scaled
    gradients into scale * sum (finite); at LLVM level 0 that defect goes unseen. The flags are
    read once per process: where the caller's set a level, the check runs in a fresh process
    without it; where they set none, this process is that process, and it runs here."""
    rows = np.stack(
        [[_overflowing_row(scale, above) for above in (False, True)] for scale in EDGE_SCALES]
    )
    given = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in given if not f.startswith("--xla_backend_optimization_level")]
    if flags == given:
        scales = [jaxamp.StaticLossScale(float(s)) for s in EDGE_SCALES]
        check = jax.jit(
            lambda rows: [jaxamp.all_finite(s.scale(r)) for s, r in zip(scales, rows, strict=True)]
        )
        below, above = ([bool(f) for f in check(list(rows[:, side]))] for side in (0, 1))
        output = ""
    else:
        np.save(tmp_path / "rows.npy", rows)
        np.save(tmp_path / "scales.npy", np.asarray(EDGE_SCALES, np.float64))
        env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                _EDGES_AT_DEFAULT_LEVEL,
                str(tmp_path / "rows.npy"),
                str(tmp_path / "scales.npy"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        below, above = json.loads(result.stdout)
        output = result.stdout + result.stderr
    assert below == [True] * len(EDGE_SCALES), output
    wrong = [scale for scale, finite in zip(EDGE_SCALES, above, strict=True) if finite]
    assert not wrong, wrong


# --- exact unscaling with the scale a compile-time constant ---------------------------------------


def _torch_rule(x: np.ndarray, scale: float) -> np.ndarray:
    """torch's unscaling: x * float32(1/scale), the reciprocal in float64 rounded to float32
    (a subnormal above 2**126), the product in float32 (numpy keeps subnormals)."""
    inverse = np.float32(1.0 / np.float64(np.float32(scale)))
    return x.astype(np.float32) * inverse


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _same_bits(a, b) -> bool:
    return np.array_equal(_bits(a), _bits(b))


def test_reciprocal_forms_agree_bit_for_bit_and_with_torch():
    """The two forms of the reciprocal (`lax.platform_dependent` picks one when the program is
    lowered: float division on CPU, integer long division elsewhere) give the same bits, and
    torch's scale.double().reciprocal().float(), for every fifth float32 scale above 2**126 (the
    two binades whose reciprocal is subnormal, where the CPU form rounds a float quotient and
    checks its halfway cases with an integer remainder; inf included) and, below, for every
    61st significand of one binade, the binade edges, random scales of every binade, 0,
    subnormal, negative and NaN scales: jitted and eagerly. (All 2**31 non-negative float32
    scales were checked so once, outside the suite.)"""
    torch = pytest.importorskip("torch")
    from jaxamp._numerics import (
        _reciprocal_by_division,
        _reciprocal_by_integers,
        reciprocal_factors,
    )

    tiny = np.finfo(np.float32).tiny
    rng = np.random.default_rng(0)
    exponents = rng.integers(-126, 128, 4096)
    random = (rng.uniform(1.0, 2.0, 4096) * np.exp2(exponents.astype(np.float64))).astype(
        np.float32
    )
    edges = np.float32(
        [0.0, tiny, np.nextafter(tiny, 1), 2.0**126, F32_MAX, np.inf, 1.0, 2.0**-149, 3e-39]
        + [np.nextafter(np.float32(2.0**126), np.float32(k)) for k in (0, np.inf)]
    )
    edges = np.concatenate([edges, -edges, np.float32([np.nan])])
    binades = np.exp2(np.arange(-126, 128)).astype(np.float32)
    above = np.arange(0x7E800001, 0x7F800001, 5, dtype=np.uint32).view(np.float32)
    one_binade = np.arange(0x3F800000, 0x40000000, 61, dtype=np.uint32).view(np.float32)
    few = np.concatenate([edges, above[:: 1 << 18], one_binade[:: 1 << 14]])
    scales = np.concatenate([above, one_binade, binades, random[np.isfinite(random)], few])

    forms = jax.jit(lambda s: (_reciprocal_by_division(s), _reciprocal_by_integers(s)))
    by_division, by_integers = forms(scales)
    assert _same_bits(by_division, by_integers)
    inv, post = (np.asarray(f) for f in jax.jit(reciprocal_factors)(scales))
    assert _same_bits(inv, by_integers)
    assert (post == np.where(scales > 2.0**126, 2.0**-64, 1.0)).all()

    # torch's value (numpy keeps its subnormals): inv * post, for every positive normal scale.
    want = torch.from_numpy(scales).double().reciprocal().float().numpy()
    normal = np.isfinite(scales) & (scales >= tiny)
    got = (inv.astype(np.float64) * post.astype(np.float64)).astype(np.float32)
    assert _same_bits(got[normal], want[normal])
    assert _same_bits(want[normal], 1.0 / scales[normal].astype(np.float64))

    # Eagerly (outside jit: a program of its own, lowered for this backend), one scalar scale at
    # a time, as a loss scale holds it: the edges and a sample of the others.
    for i in range(len(scales) - len(few), len(scales)):
        eager_inv, eager_post = reciprocal_factors(scales[i])
        assert (_bits(eager_inv), _bits(eager_post)) == (_bits(inv[i]), _bits(post[i])), scales[i]


# The scale traced: one compiled program for every scale.
_UNSCALE_TRACED = jax.jit(lambda loss_scale, x: loss_scale.unscale(x))


def _unscale_case(edge: int, significand: float):
    """A scale at (or past) a binade edge, gradients around it, torch's result for them and
    where that result is a normal float32."""
    scale = float(np.float32(min(EDGE_SCALES[edge] * significand, F32_MAX)))
    rng = np.random.default_rng(edge)
    x = (rng.uniform(1.0, 2.0, 16) * np.float32(min(scale, 2.0**126))).astype(np.float32)
    x[0] = np.float32(min(scale, F32_MAX)) / np.float32(2)
    expected = _torch_rule(x, scale)
    normal = np.abs(expected) >= np.finfo(np.float32).tiny
    assert normal.any()
    return jaxamp.DynamicLossScale.create(init_scale=scale), jnp.asarray(x), expected, normal


_EDGE_AND_SIGNIFICAND = st.tuples(st.integers(0, len(EDGE_SCALES) - 1), st.floats(1.0, 1.9999999))


@settings(max_examples=6, deadline=None)
@example(cases=[(127, 1.0), (128, 1.0), (126, 1.5)])
@given(cases=st.lists(_EDGE_AND_SIGNIFICAND, min_size=4, max_size=12))
def test_unscale_exact_with_a_constant_scale(cases):
    """`unscale` at every edge (and scales between, up to float32 max) equals torch's rule
    bit for bit wherever torch's result is a normal float32: eagerly, jitted with the scale
    traced and jitted with the scale a constant (one program holds every case's unscaling,
    each with its own constant scale and its own input)."""
    built = [_unscale_case(edge, significand) for edge, significand in cases]
    constant = jax.jit(
        lambda xs: [loss_scale.unscale(x) for (loss_scale, *_), x in zip(built, xs, strict=True)]
    )([x for _, x, _, _ in built])
    for (loss_scale, x, expected, normal), with_constant in zip(built, constant, strict=True):
        results = {
            "eager": loss_scale.unscale(x),
            "jit, traced scale": _UNSCALE_TRACED(loss_scale, x),
            "jit, constant scale": with_constant,
        }
        for how, out in results.items():
            out = np.asarray(out)
            assert out[normal].tobytes() == expected[normal].tobytes(), (
                how,
                float(loss_scale.loss_scale),
            )


def test_the_issues_unscale_is_one_half():
    loss_scale = jaxamp.DynamicLossScale.create(init_scale=2.0**127)
    out = jax.jit(lambda t: loss_scale.unscale(t))(jnp.float32(2.0**126))
    assert float(out) == 0.5
    assert float(loss_scale.unscale(jnp.float32(2.0**126))) == 0.5


def test_per_group_decisions_see_the_overflow_at_float32_max(maybe_jit):
    """With ``param_labels`` each group is checked as the whole step is: the group whose
    scaled gradient overflowed skips, the other applies."""
    x = _overflowing_row(F32_MAX, above=True)
    loss_scale = jaxamp.DynamicLossScale.from_preset("flax", init_scale=F32_MAX)
    tx = jaxamp.loss_scaled(
        {"a": optax.sgd(1e-3), "b": optax.sgd(1e-3)},
        loss_scale,
        param_labels={"bad": "a", "good": "b"},
    )
    params = {"bad": jnp.zeros(4), "good": jnp.zeros(4)}
    inputs = {"bad": jnp.asarray(x), "good": jnp.asarray(_overflowing_row(F32_MAX, above=False))}

    def step(params, opt_state, inputs):
        _, grads = jaxamp.value_and_grad(lambda p, x: sum(jnp.sum(p[k] * x[k]) for k in p))(
            params, inputs, loss_scale=opt_state
        )
        return jaxamp.apply_gradients(tx, grads, opt_state, params)

    new, state = maybe_jit(step)(params, tx.init(params), inputs)
    assert np.asarray(new["bad"]).tobytes() == np.asarray(params["bad"]).tobytes()
    assert bool(jnp.all(jnp.isfinite(new["good"]))) and bool(jnp.any(new["good"] != 0))
    assert not bool(state.last_step_finite) and bool(jaxamp.amp_info(state).last_step_applied)
