"""autocast(overrides=...) applies wherever the op runs, Flax layers included."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jaxamp


def _dot_dtypes(record):
    return [(r.in_dtypes, r.out_dtypes) for r in record if r.op == "dot_general"]


def _conv_dtypes(record):
    return [(r.in_dtypes, r.out_dtypes) for r in record if r.op == "conv_general_dilated"]


X = jnp.ones((2, 4), jnp.float32)
LINEN_DENSE = nn.Dense(3)
LINEN_VARS = LINEN_DENSE.init(jax.random.key(0), X)


def _linen(variables, x):
    return LINEN_DENSE.apply(variables, x)


@pytest.mark.parametrize("key", ["dot_general", lax.dot_general_p, "linear"])
def test_override_reaches_linen_dense(key, float_dtype, maybe_jit):
    overrides = {key: "fp32"}
    record = jaxamp.autocast_trace(
        _linen, LINEN_VARS, X, device="cpu", dtype=float_dtype, overrides=overrides
    )
    assert _dot_dtypes(record) == [(("float32", "float32"), ("float32",))]
    out = maybe_jit(jaxamp.autocast(_linen, device="cpu", dtype=float_dtype, overrides=overrides))(
        LINEN_VARS, X
    )
    assert out.dtype == jnp.float32  # the whole linear runs in float32, bias add included
    np.testing.assert_allclose(out, _linen(LINEN_VARS, X), rtol=1e-6)
    # Without the override the Dense runs in the autocast dtype.
    plain = jaxamp.autocast_trace(_linen, LINEN_VARS, X, device="cpu", dtype=float_dtype)
    low = np.dtype(float_dtype).name
    assert _dot_dtypes(plain) == [((low, low), (low,))]


def test_override_reaches_nnx_linear_and_conv(float_dtype):
    linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    conv = nnx.Conv(2, 3, kernel_size=(3, 3), rngs=nnx.Rngs(0))
    graph, state = nnx.split((linear, conv))

    def f(state, x, img):
        lin, cv = nnx.merge(graph, state)
        return lin(x), cv(img)

    img = jnp.ones((1, 5, 5, 2))
    overrides = {"dot_general": "fp32", "conv_general_dilated": "fp32"}
    record = jaxamp.autocast_trace(
        f, state, X, img, device="cpu", dtype=float_dtype, overrides=overrides
    )
    assert _dot_dtypes(record) == [(("float32", "float32"), ("float32",))]
    assert _conv_dtypes(record) == [(("float32", "float32"), ("float32",))]
    out = jaxamp.autocast(f, device="cpu", dtype=float_dtype, overrides=overrides)(state, X, img)
    assert [o.dtype for o in out] == [jnp.float32, jnp.float32]


def test_torch_op_override_moves_only_that_op():
    # "linear" moves flax Dense (torch's F.linear) but not a bare matmul (torch's matmul).
    def f(variables, x):
        return _linen(variables, x), x @ x.T

    record = jaxamp.autocast_trace(f, LINEN_VARS, X, device="cpu", overrides={"linear": "fp32"})
    assert _dot_dtypes(record) == [
        (("float32", "float32"), ("float32",)),
        (("bfloat16", "bfloat16"), ("bfloat16",)),
    ]
    assert jaxamp.autocast_rules("cpu", {"linear": "fp32"})["dot_general"] == "lower_precision_fp"
    # A primitive override moves both.
    record = jaxamp.autocast_trace(
        f, LINEN_VARS, X, device="cpu", overrides={"dot_general": "fp32"}
    )
    assert [d[1] for d in _dot_dtypes(record)] == [("float32",), ("float32",)]


def test_override_inside_other_regions():
    # exp inside jax.nn.softmax (a cuda fp32 region) follows the primitive override.
    record = jaxamp.autocast_trace(
        lambda x: jax.nn.softmax(x @ x.T),
        X,
        device="cuda",
        dtype=jnp.float16,
        overrides={"exp": "lower_precision_fp"},
    )
    assert [r.in_dtypes for r in record if r.op == "exp"] == [("float16",)]


def test_full_precision_beats_overrides():
    f = jaxamp.full_precision(lambda a: a @ a)
    record = jaxamp.autocast_trace(
        f, X.T @ X, device="cpu", overrides={"dot_general": "lower_precision_fp"}
    )
    assert _dot_dtypes(record) == [(("float32", "float32"), ("float32",))]


@pytest.mark.parametrize(
    "key, suggestion",
    [
        ("dot_generl", "dot_general"),
        ("lineer", "linear"),
        ("conv_general_dilatd", "conv_general_dilated"),
    ],
)
def test_unknown_override_key_names_closest(key, suggestion):
    with pytest.raises(ValueError) as info:
        jaxamp.autocast(lambda a: a, overrides={key: "fp32"})
    message = str(info.value)
    assert f"did you mean {suggestion!r}?" in message
    assert "autocast_rules" in message and "overrides" in message
    with pytest.raises(ValueError, match="did you mean"):
        jaxamp.autocast_trace(lambda a: a, X, overrides={key: "fp32"})
    with pytest.raises(ValueError, match="did you mean"):
        jaxamp.autocast_rules("cpu", {key: "fp32"})


def test_unknown_category_names_closest():
    with pytest.raises(ValueError, match="did you mean 'fp32'"):
        jaxamp.autocast(lambda a: a, overrides={"exp": "fp23"})
    with pytest.raises(ValueError, match="not_a_key"):
        jaxamp.autocast(lambda a: a, overrides={"not_a_key": "fp32"})


# --- the op-hook extension point (used by jaxamp.fp8) ---------------------------------------------


def test_op_hooks_see_autocast_operands_and_can_replace_the_op(maybe_jit):
    from jaxamp._autocast.api import transform

    seen = []

    def hook(call):
        seen.append((call.torch_op, call.category, [a.dtype for a in call.args], call.device))
        if call.torch_op is None:
            return None  # fall through: autocast binds it as usual
        return [2 * b for b in call.bind()]

    def f(variables, x):
        return _linen(variables, x), x @ x.T

    g = maybe_jit(transform(f, device="cpu", hooks={"dot_general": hook}))
    dense, bare = g(LINEN_VARS, X)
    ref_dense, ref_bare = jaxamp.autocast(f, device="cpu")(LINEN_VARS, X)
    kernel = LINEN_VARS["params"]["kernel"].astype(jnp.bfloat16)
    bias = LINEN_VARS["params"]["bias"].astype(jnp.bfloat16)
    doubled = 2 * (X.astype(jnp.bfloat16) @ kernel) + bias
    np.testing.assert_array_equal(np.asarray(dense, np.float32), np.asarray(doubled, np.float32))
    np.testing.assert_array_equal(np.asarray(bare, np.float32), np.asarray(ref_bare, np.float32))
    assert ("linear", "lower_precision_fp", [jnp.bfloat16] * 2, "cpu") in seen
    assert (None, "lower_precision_fp", [jnp.bfloat16] * 2, "cpu") in seen
    record = jaxamp.autocast_trace(f, LINEN_VARS, X, device="cpu", hooks={"dot_general": hook})
    assert len(_dot_dtypes(record)) == 2
