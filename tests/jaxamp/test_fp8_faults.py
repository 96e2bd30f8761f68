"""fp8 faults: delayed scales finite and > 0 for any amax history, range-checked
recipe options, filters that select nothing refused, the operand capture, the documentation page's snippet."""

import dataclasses
import functools
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
import jaxamp.fp8 as f8
import jaxamp.mx

FP8_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "fp8.md"
DELAYED = f8.get_recipe("delayed", emulate=True, amax_history_length=4)
TENSORWISE = f8.get_recipe("tensorwise", emulate=True)


def _matmul(x, w):
    return x @ w


def _with_history(state, amax):
    name = next(iter(state))
    entry = state[name]
    entry = dataclasses.replace(
        entry,
        input_amax_history=entry.input_amax_history.at[0].set(amax),
        kernel_amax_history=entry.kernel_amax_history.at[0].set(amax),
        output_grad_amax_history=entry.output_grad_amax_history.at[0].set(amax),
    )
    return {name: entry}


F32_TINY = float(np.finfo(np.float32).tiny)


@pytest.mark.parametrize("amax", [1e-37, 1e-45, 0.0, 1e-12, 3e38, np.inf, np.nan])
def test_delayed_scales_stay_finite_and_positive(amax, maybe_jit):
    # On main an amax of 1e-37 gave 448 / 1e-37 = inf, a scale of 0 and NaN outputs.
    x, w = jnp.full((2, 3), 0.5), jnp.full((3, 5), 0.25)
    f = f8.convert(_matmul, DELAYED)
    state = _with_history(f8.init_state(_matmul, DELAYED, x, w), amax)

    @maybe_jit
    def step(x, state):
        return jax.value_and_grad(lambda x, s: jnp.sum(f(x, w, fp8_state=s)), argnums=(0, 1))(
            x, state
        )

    out, (grad_x, new_state) = step(x, state)
    (entry,) = new_state.values()
    for scale in (entry.input_scale, entry.kernel_scale, entry.output_grad_scale):
        assert bool(jnp.all(jnp.isfinite(scale))) and bool(jnp.all(scale > 0)), (amax, scale)
        assert float(scale[0]) >= F32_TINY  # normal: not flushed to 0 on the next step
    assert bool(jnp.isfinite(out)) and bool(jnp.all(jnp.isfinite(grad_x)))
    # The step after it (the new scales in use) stays finite too.
    out2, (grad2, _) = step(x, new_state)
    assert bool(jnp.isfinite(out2)) and bool(jnp.all(jnp.isfinite(grad2)))


def _dot_operand_dtypes(jaxpr) -> list:
    """The operand dtypes of every dot_general in a jaxpr and the jaxprs inside it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dot_operand_dtypes(sub)
    return found


@pytest.mark.parametrize("recipe", [DELAYED, TENSORWISE], ids=["delayed", "tensorwise"])
def test_emulated_matmuls_take_float32_operands(recipe):
    # emulate=True promises a float32 matmul of the fp8 values. A dot_general of fp8 arrays is
    # not one: XLA:GPU turns the fp8 dots it cannot give cuBLASLt into float16 dots, where two
    # saturated e4m3 operands (448 * 448) overflow to inf.
    x, w = jnp.full((2, 3), 0.5), jnp.full((3, 5), 0.25)
    f = f8.convert(_matmul, recipe)
    kwargs = {}
    if recipe.scaling == "delayed":
        kwargs["fp8_state"] = f8.init_state(_matmul, recipe, x, w)
    closed = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x, w, **kwargs))))(x)
    dots = _dot_operand_dtypes(closed.jaxpr)
    assert len(dots) == 3, dots  # forward, grad_input, grad_weight
    assert all(d == ("float32", "float32") for d in dots), dots


def _unguarded_fp8_upcasts(jaxpr) -> list:
    """Upcasts of an fp8 array to float32 whose operand is not an optimization_barrier's output,
    in a jaxpr and the jaxprs inside it."""
    producer = {}
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            (src,) = eqn.invars
            if "float8" in str(src.aval.dtype) and str(eqn.params["new_dtype"]) == "float32":
                if producer.get(src) != "optimization_barrier":
                    found.append(producer.get(src, "an input of the jaxpr"))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _unguarded_fp8_upcasts(sub)
        for v in eqn.outvars:
            producer[v] = eqn.primitive.name
    return found


@pytest.mark.parametrize("recipe", [DELAYED, TENSORWISE], ids=["delayed", "tensorwise"])
def test_emulated_fp8_rounding_survives_xla_excess_precision(recipe):
    # XLA:GPU deletes a float32 -> fp8 -> float32 chain of converts (SimplifyFPConversions, on
    # under the default xla_allow_excess_precision): a jitted emulated matmul would then multiply
    # unrounded values (on an H200 the captured grad_output differed by up to 16% from the eager
    # one). Each fp8 array is widened through an optimization barrier, which the pass cannot
    # see through.
    x, w = jnp.full((2, 3), 0.5), jnp.full((3, 5), 0.25)
    f = f8.convert(_matmul, recipe)
    kwargs = {}
    if recipe.scaling == "delayed":
        kwargs["fp8_state"] = f8.init_state(_matmul, recipe, x, w)
    closed = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x, w, **kwargs))))(x)
    assert _unguarded_fp8_upcasts(closed.jaxpr) == []
    q = f8.to_fp8(x, jnp.float32(3.0), jnp.float8_e4m3fn)
    assert _unguarded_fp8_upcasts(jax.make_jaxpr(f8.from_fp8)(q, jnp.float32(3.0)).jaxpr) == []
    # the block-scaled formats' dequantize (their emulated matmuls run on it) likewise
    for fmt in ("mxfp8", "nvfp4"):

        def round_trip(v, fmt=fmt):
            return jaxamp.mx.from_block_scaled(*jaxamp.mx.to_block_scaled(v, fmt), fmt)

        blocks = jnp.linspace(-1.0, 1.0, 64).reshape(2, 32)
        assert _unguarded_fp8_upcasts(jax.make_jaxpr(round_trip)(blocks).jaxpr) == [], fmt


def test_tiny_amax_clamped_as_torchao():
    """torchao 0.18 float8_utils.amax_to_scale: fp8_max / clamp(amax, 1e-12) in float64, then
    float32; the delayed scale (its reciprocal, Flax's layout) uses the same clamp."""
    torch = pytest.importorskip("torch")
    torchao_amax_to_scale = pytest.importorskip("torchao.float8.float8_utils").amax_to_scale

    x, w = jnp.ones((2, 3)), jnp.ones((3, 5))
    f = f8.convert(_matmul, DELAYED)
    for amax in (1e-37, 1e-20, 9.9e-13):
        state = _with_history(f8.init_state(_matmul, DELAYED, x, w), amax)
        _, new_state = jax.grad(lambda x, s: jnp.sum(f(x, w, fp8_state=s)), argnums=(0, 1))(
            x, state
        )
        (entry,) = new_state.values()
        expected = torchao_amax_to_scale(
            torch.tensor(amax, dtype=torch.float32), torch.float8_e4m3fn
        ).numpy()
        assert entry.input_scale[0] == np.float32(1.0) / np.float32(expected)
    # amax 0 (an empty history) keeps the previous scale, as Flax does.
    state = f8.init_state(_matmul, DELAYED, x, w)
    _, new_state = jax.grad(lambda x, s: jnp.sum(f(x, w, fp8_state=s)), argnums=(0, 1))(x, state)
    assert float(next(iter(new_state.values())).input_scale[0]) == 1.0


@pytest.mark.parametrize(
    ("margin", "error", "match"),
    [
        (200, ValueError, r"margin must be in \[0, 17\.807\); got 200"),
        (-200, ValueError, r"margin must be in \[0, 17\.807\); got -200"),
        (-0.5, ValueError, "saturating"),
        (17.9, ValueError, "smallest subnormal"),
        (True, TypeError, "got bool True"),
        ("2", TypeError, "real number"),
        (None, TypeError, "real number"),
    ],
)
def test_recipe_margin_range_checked(margin, error, match):
    with pytest.raises(error, match=match):
        f8.get_recipe("delayed", margin=margin)


def test_recipe_margin_in_range_is_used(maybe_jit):
    for margin in (0, 2, np.float32(3.0), 17.5):
        assert f8.get_recipe("delayed", margin=margin).margin == float(margin)
    # the margin divides the factor: one more power of two of headroom, one more in the scale
    x, w = jnp.full((2, 3), 0.5), jnp.full((3, 5), 0.25)
    scales = []
    for margin in (0, 1):
        rec = f8.get_recipe(DELAYED, margin=margin)
        f = f8.convert(_matmul, rec)
        state = _with_history(f8.init_state(_matmul, rec, x, w), 2.0)
        grad = maybe_jit(jax.grad(lambda x, s, f=f: jnp.sum(f(x, w, fp8_state=s)), argnums=(0, 1)))
        scales.append(float(next(iter(grad(x, state)[1].values())).input_scale[0]))
    assert scales[1] == 2 * scales[0]


def test_recipe_power_of_2_scales_must_be_bool():
    with pytest.raises(TypeError, match="power_of_2_scales must be a bool; got 1"):
        f8.get_recipe("tensorwise", power_of_2_scales=1)


# --- filters that select nothing ------------------------------------------------------------------


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _MLP(name="mlp")(nn.Dense(8, name="embed")(x))


@functools.cache
def _model_problem():
    """(loss, params, x, y) of a small Flax net, shared by the tests (its initialisation one
    compiled program, not op by op)."""
    model = _Net()
    x, y = jnp.ones((8, 12)), jnp.arange(8) % 4
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn, params, x, y


@pytest.mark.standard_promotion
def test_autocast_fp8_filter_selecting_nothing_raises_naming_paths(maybe_jit):
    loss_fn, params, x, y = _model_problem()
    loss8 = maybe_jit(jaxamp.autocast(loss_fn, fp8=TENSORWISE, fp8_filter="*/mpl/*"))
    with pytest.raises(ValueError, match=r"selects none .*'_Net/embed', '_Net/mlp/Dense_0'") as err:
        loss8(params, x, y)
    assert "Closest path: '_Net/mlp/Dense_" in str(err.value)
    # A filter that matches runs, under jit and without, on every call (names do not drift).
    good = maybe_jit(jaxamp.autocast(loss_fn, fp8=TENSORWISE, fp8_filter="*/mlp/*"))
    first, second = good(params, x, y), good(params, x, y)
    assert first == second and bool(jnp.isfinite(first))


@pytest.mark.standard_promotion
def test_convert_filter_selecting_nothing_raises(maybe_jit):
    loss_fn, params, x, y = _model_problem()
    with pytest.raises(ValueError, match=r"fp8_filter='decoder/\*' selects none"):
        maybe_jit(f8.convert(loss_fn, TENSORWISE, fp8_filter="decoder/*"))(params, x, y)
    with pytest.raises(ValueError, match="has no matmul"):
        f8.convert(lambda x: jnp.sum(x), TENSORWISE, fp8_filter="*")(x)
    # report is the diagnostic: it lists what a filter saw instead of raising.
    rows = f8.report(loss_fn, params, x, y, recipe=TENSORWISE, fp8_filter="decoder/*")
    assert [r.fp8 for r in rows] == [False, False, False]


# --- the public operand capture -------------------------------------------------------------------


@pytest.mark.standard_promotion
def test_capture_operands_gives_each_matmuls_three_tensors():
    loss_fn, params, x, y = _model_problem()
    ops = f8.capture_operands(loss_fn, params, x, y, recipe=TENSORWISE)
    assert list(ops) == [r.name for r in f8.report(loss_fn, params, x, y, recipe=TENSORWISE)]
    embed = ops["_Net/embed/dot_general"]
    np.testing.assert_array_equal(embed.input, x)
    np.testing.assert_array_equal(embed.weight, params["embed"]["kernel"])
    # grad_output is the cotangent at the matmul's output: embed's output feeds only the bias add,
    # so it is the bias gradient summed over rows. Compiled, as capture_operands runs: an eager
    # run may sum in another order (GPU), and a last-bit difference can move an fp8 rounding.
    grads = jax.jit(jax.grad(f8.convert(loss_fn, TENSORWISE)))(params, x, y)
    np.testing.assert_allclose(
        embed.grad_output.sum(0), grads["embed"]["bias"], rtol=1e-6, atol=1e-7
    )
    # The quantized codes it feeds are those the fp8 matmul used: dynamic tensorwise scale.
    _, scale = f8.to_fp8_dynamic(embed.input, TENSORWISE.input, -1, False)
    assert float(scale) == float(f8.amax_to_scale(jnp.max(jnp.abs(x)), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="outside jit"):
        jax.jit(lambda p: f8.capture_operands(loss_fn, p, x, y, recipe=TENSORWISE))(params)
    with pytest.raises(ValueError, match="selects none"):
        f8.capture_operands(loss_fn, params, x, y, recipe=TENSORWISE, fp8_filter="nothing")
    with pytest.raises(ValueError, match="argnums=5"):
        f8.capture_operands(loss_fn, params, x, y, recipe=TENSORWISE, argnums=5)


# --- the documentation page's snippet -------------------------------------------------------------


@pytest.mark.standard_promotion
def test_fp8_page_snippet_runs_on_cpu():
    block = re.search(r"```python\n(.*?)```", FP8_PAGE.read_text(), flags=re.S).group(1)
    assert 'recipe("tensorwise", emulate=True)' in block
    loss_fn, params, x, y = _model_problem()
    namespace = {"jax": jax, "jnp": jnp, "jaxamp": jaxamp, "optax": optax}
    namespace.update(loss_fn=loss_fn, params=params, x=x, y=y)
    exec(compile(block, str(FP8_PAGE), "exec"), namespace)  # noqa: S102
    grads = namespace["grads"]
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
