"""jaxamp.fp8: recipes, scales and casts bit-exact to torchao; the fp8 dot_general against torchao's
Float8Linear (emulate=True); convert's selection, report and refusals; delayed scaling against
Flax's Fp8DirectDotGeneralOp."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp.fp8 as f8

DN_XW = (((1,), (0,)), ((), ()))  # x (M, K) @ w (K, N)
EPS32 = float(np.finfo(np.float32).eps)


def _emu(name, **kw):
    return f8.get_recipe(name, emulate=True, **kw)


# --- recipes as data ---------------------------------------------------------------------------


def test_recipe_semantics_match_torchao_names():
    t = f8.get_recipe("tensorwise")
    assert (t.input.dtype, t.weight.dtype, t.grad_output.dtype) == (
        np.dtype(jnp.float8_e4m3fn),
        np.dtype(jnp.float8_e4m3fn),
        np.dtype(jnp.float8_e5m2),
    )
    assert t.input.granularity == "tensorwise" and not t.power_of_2_scales
    r = f8.get_recipe("rowwise")
    assert r.power_of_2_scales and r.grad_output.dtype == np.dtype(jnp.float8_e4m3fn)
    assert all(
        getattr(r, f).granularity == "rowwise"
        for f in ("input", "weight", "grad_output", "input_for_grad_weight")
    )
    g = f8.get_recipe("rowwise_with_gw_hp")
    assert not g.input_for_grad_weight.fp8 and not g.grad_output_for_grad_weight.fp8
    assert g.weight_for_grad_input.granularity == "tensorwise" and g.power_of_2_scales
    d = f8.get_recipe("delayed", amax_history_length=16)
    assert d.scaling == "delayed" and d.amax_history_length == 16
    assert f8.get_recipe(t, emulate=True).emulate and "e5m2" in t.describe()


def test_recipe_bad_input_names_parameter_and_closest():
    with pytest.raises(ValueError, match="rowwise"):
        f8.get_recipe("rowwse")
    with pytest.raises(ValueError, match="granularity"):
        f8.Cast("float8_e4m3fn", "colwise")
    with pytest.raises(ValueError, match="e5m2"):
        f8.Cast("float8_e5m3")
    with pytest.raises(ValueError, match="mixes fp8 and high precision"):
        f8.get_recipe("tensorwise", input_for_grad_weight=f8.Cast(None))
    with pytest.raises(ValueError, match="amax_history_length"):
        f8.get_recipe("delayed", amax_history_length=0)
    with pytest.raises(ValueError, match="delayed scaling is tensorwise"):
        f8.get_recipe("rowwise", scaling="delayed")


# --- scales and casts against torchao -----------------------------------------------------------

torch = pytest.importorskip("torch")
tao_utils = pytest.importorskip("torchao.float8.float8_utils")
tao_cfg = pytest.importorskip("torchao.float8.config")
TAO_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _amax_cases():
    rng = np.random.default_rng(0)
    f32 = np.float32
    eps = f32(1e-12)
    special = [
        0.0,
        1e-30,
        float(np.nextafter(eps, f32(0))),
        float(eps),
        float(np.nextafter(eps, f32(1))),
        1.0,
        7.0,
        448.0,
        57344.0,
        3.0e38,
        float(np.finfo(np.float32).tiny),
    ]
    # values whose scale lands next to a power of two (448 / (7 * 2**k) is one)
    near = [float(np.nextafter(f32(7 * 2.0**k), f32(d))) for k in range(-8, 8) for d in (0, 1e9)]
    wide = (10.0 ** rng.uniform(-14, 30, 4000)).astype(np.float32)
    return np.concatenate([np.array(special + near, np.float32), wide])


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("power_of_2", [False, True])
def test_amax_to_scale_bit_identical_to_torchao(dtype, power_of_2):
    amax = _amax_cases()
    want = tao_utils.amax_to_scale(torch.from_numpy(amax), TAO_DTYPES[dtype], power_of_2).numpy()
    for fn in (f8.amax_to_scale, jax.jit(f8.amax_to_scale, static_argnums=(1, 2))):
        got = np.asarray(fn(jnp.asarray(amax), jnp.dtype(dtype), power_of_2))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.torch
def test_power_of_two_rounding_matches_torch_next_to_every_power():
    # torchao rounds with exp2(floor(log2(s))): float32 log2 of values just below 2**k rounds up
    # to k, so those map to 2**k, not 2**(k-1); XLA's own log2 would disagree at some of them.
    from jaxamp.fp8._dot import _floor_pow2

    f32 = np.float32
    xs = []
    for k in range(-125, 127):
        x = lo = hi = f32(2.0**k)
        for _ in range(300):
            lo, hi = np.nextafter(lo, f32(0)), np.nextafter(hi, f32(np.inf))
            xs += [lo, hi]
        xs.append(x)
    xs = np.array(xs + [0.0, np.inf, np.nan], np.float32)
    t = torch.from_numpy(xs)
    want = torch.exp2(torch.floor(torch.log2(t))).numpy()
    got = np.asarray(jax.jit(_floor_pow2)(jnp.asarray(xs)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(
    "granularity,axis", [("tensorwise", None), ("rowwise", -1), ("rowwise", 0)]
)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_quantize_bits_and_scales_equal_torchao(in_dtype, granularity, axis, dtype):
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((24, 40)) * 10.0 ** rng.uniform(-3, 2, (24, 1))).astype(np.float32)
    x[3, 5] = 3e4  # one large value sets the tensorwise amax
    x = x.astype(getattr(ml_dtypes, in_dtype) if in_dtype == "bfloat16" else in_dtype)
    tx = torch.from_numpy(x.astype(np.float32)).to(getattr(torch, in_dtype))
    gran = (
        tao_cfg.ScalingGranularity.TENSORWISE
        if axis is None
        else tao_cfg.ScalingGranularity.AXISWISE
    )
    for power_of_2 in (False, True):
        t = hp_tensor_to_float8_dynamic(
            tx,
            TAO_DTYPES[dtype],
            LinearMMConfig(),
            scaling_granularity=gran,
            axiswise_dim=axis,
            round_scales_to_power_of_2=power_of_2,
        )
        q, s = f8.to_fp8_dynamic(jnp.asarray(x), f8.Cast(dtype, granularity), axis, power_of_2)
        np.testing.assert_array_equal(np.asarray(s), t._scale.numpy())
        np.testing.assert_array_equal(
            np.asarray(q).view(np.uint8), t._data.view(torch.uint8).numpy()
        )


def test_quantize_saturates_and_keeps_nan():
    s = jnp.float32(1.0)
    q = f8.to_fp8(jnp.array([1e6, -1e6, jnp.nan], jnp.float32), s, jnp.float8_e4m3fn)
    out = np.asarray(q.astype(jnp.float32))
    assert out[0] == 448.0 and out[1] == -448.0 and np.isnan(out[2])


# --- the fp8 matmul against torchao's Float8Linear ----------------------------------------------


def _torchao_linear(name, x, w, b, g):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    lin = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    m = torch.nn.Sequential(lin)
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=True)
    convert_to_float8_training(m, config=cfg)
    tx = torch.from_numpy(x).requires_grad_(True)
    y = m(tx)
    y.backward(torch.from_numpy(g))
    return y.detach().numpy(), tx.grad.numpy(), lin.weight.grad.numpy()


def _f32_band(a_abs, b_abs, k):
    # Both sides multiply the same dequantized float32 values; only the summation order of the
    # float32 matmul differs: |err| <= 2 * K * eps32 * (|a| @ |b|) (a loose worst-case bound).
    return 2 * k * EPS32 * (a_abs @ b_abs) + 1e-30


LINEAR_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _linear_case():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5, 48)).astype(np.float32)
    w = (rng.standard_normal((24, 48)) * 0.2).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    g = rng.standard_normal((3, 5, 24)).astype(np.float32)
    return x, w, b, g


def _forward_and_backward(name):
    """y, dL/dx and dL/dw of the fp8 linear under recipe `name` (emulated) for output cotangent g."""
    rec = _emu(name)

    def f(x, w, b):  # torch layout: x @ w.T, as flax's Dense would see w.T
        return f8.dot_general(x, w, (((2,), (1,)), ((), ())), recipe=rec) + b

    def forward_and_backward(x, w, b, g):
        y, vjp = jax.vjp(f, x, w, b)
        return y, *vjp(g)[:2]

    return forward_and_backward


@functools.cache
def _torchao_linear_case(names):
    """{name: (y, dx, dw)} of `_forward_and_backward` on `_linear_case()`, every recipe in
    `names` in one jitted program."""
    fns = {n: _forward_and_backward(n) for n in names}
    args = tuple(map(jnp.asarray, _linear_case()))
    return jax.jit(lambda *a: {n: fn(*a) for n, fn in fns.items()})(*args)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("name", LINEAR_RECIPES)
def test_dot_general_matches_torchao_float8_linear(name):
    x, w, b, g = _linear_case()
    y_t, gx_t, gw_t = _torchao_linear(name, x, w, b, g)

    k_fwd, k_gi, k_gw = 48, 24, 15
    # bands: the dequantized operands are bit-identical (tested above), so differences come only
    # from the float32 matmul's summation order.
    xa, wa, ga = (
        np.abs(x).reshape(15, 48) * 1.01,
        np.abs(w) * 1.01,
        np.abs(g).reshape(15, 24) * 1.01,
    )
    # Under jit, as a training step runs it; eagerly (op by op but for jaxamp's small numerics
    # helpers, a program each: several times the compile work) for one recipe: dot_general has
    # no eager-only code path.
    # Under jit the three recipes in one program (one compile), shared by the three tests.
    runs = [_torchao_linear_case(LINEAR_RECIPES)[name]]
    if name == "tensorwise":
        runs.append(_forward_and_backward(name)(*map(jnp.asarray, (x, w, b, g))))
    for y, gx, gw in runs:
        np.testing.assert_array_less(
            np.abs(np.asarray(y) - y_t).reshape(15, 24),
            _f32_band(xa, wa.T, k_fwd) + EPS32 * 4 * np.abs(b),
        )
        np.testing.assert_array_less(
            np.abs(np.asarray(gx) - gx_t).reshape(15, 48), _f32_band(ga, wa, k_gi)
        )
        np.testing.assert_array_less(np.abs(np.asarray(gw) - gw_t), _f32_band(ga.T, xa, k_gw))
        # and the fp8 rounding itself is visible: not the float32 result
        y32 = x.reshape(15, 48) @ w.T + b
        assert np.abs(np.asarray(y).reshape(15, 24) - y32).max() > 1e-4


def _dtypes_case():
    # `_linear_case`'s shapes and torch's weight layout (N, K): the eager float32 run below reuses
    # the operations the eager linear above compiled (the same quantizations and products).
    rng = np.random.default_rng(3)
    return rng.standard_normal((3, 5, 48)), rng.standard_normal((24, 48)) * 0.3


def _grad_and_layouts(name):
    """(value_and_grad of a loss through the fp8 dot_general under recipe `name`, the three
    layouts' outputs of one product: x @ w.T contracted on w's axis 1 (torch's layout), x @ w.T
    with the weight stored (K, N), and x flattened to rows)."""
    rec = _emu(name)
    dn = (((2,), (1,)), ((), ()))

    def loss(x, w):
        y = f8.dot_general(x, w, dn, recipe=rec)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    def layouts(x, w):
        y = f8.dot_general(x, w, dn, recipe=rec)
        y_t = f8.dot_general(x, w.T, (((2,), (0,)), ((), ())), recipe=rec)
        rows = (((1,), (1,)), ((), ()))
        y_r = f8.dot_general(x.reshape(15, 48), w, rows, recipe=rec).reshape(3, 5, 24)
        return y, y_t, y_r

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), layouts


DTYPES_3 = (jnp.float32, jnp.bfloat16, jnp.float16)


@functools.cache
def _dtypes_and_layouts(names):
    """{name: (the gradients for float32, bfloat16 and float16 operands, the three layouts'
    float32 outputs)}: every recipe in `names`, dtype and layout in one jitted program."""
    x32, w32 = _dtypes_case()
    inputs = [(jnp.asarray(x32, d), jnp.asarray(w32, d)) for d in DTYPES_3]
    fns = {n: _grad_and_layouts(n) for n in names}

    def each(pairs):
        return {
            n: ([grad(x, w) for x, w in pairs], layouts(*pairs[0]))
            for n, (grad, layouts) in fns.items()
        }

    return jax.jit(each)(inputs)


@pytest.mark.slow
@pytest.mark.parametrize("name", LINEAR_RECIPES)
def test_dot_general_dtypes_jit_and_layouts(name):
    x32, w32 = _dtypes_case()
    dtypes = list(DTYPES_3)
    # Under jit the three dtypes (and the three recipes, and the layouts below) in one program;
    # eagerly (tensorwise) float32.
    outs, (y, y_t, y_r) = _dtypes_and_layouts(LINEAR_RECIPES)[name]
    if name == "tensorwise":
        grad = _grad_and_layouts(name)[0]
        outs, dtypes = (
            [grad(jnp.asarray(x32, jnp.float32), jnp.asarray(w32, jnp.float32)), *outs],
            [jnp.float32, *dtypes],
        )
    for dtype, ((val, y_d), (gx, gw)) in zip(dtypes, outs, strict=True):
        assert y_d.dtype == dtype and gx.dtype == dtype and gw.dtype == dtype
        assert y_d.shape == (3, 5, 24) and np.isfinite(float(val))

    # the transposed weight layout and a flattened input give the same numbers (up to the float32
    # matmul's summation order: identical fp8 operands)
    band = 2 * 48 * EPS32 * (np.abs(x32).reshape(15, 48) @ np.abs(w32).T * 1.1).reshape(3, 5, 24)
    np.testing.assert_array_less(np.abs(np.asarray(y_t) - np.asarray(y)), band + 1e-30)
    np.testing.assert_array_less(np.abs(np.asarray(y_r) - np.asarray(y)), band + 1e-30)


def test_dot_general_native_formula_agrees_with_emulated():
    # The fp8-operand matmul (what an sm89+ GPU runs) against the emulated one, on CPU where
    # XLA computes fp8 dots exactly: products of two fp8 numbers are exact in float32.
    from jaxamp.fp8._dot import _linear_dynamic

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    names = ("tensorwise", "rowwise")
    # The four products in one program (each its own computation).
    runs = jax.jit(
        lambda x, w: {
            name: tuple(
                _linear_dynamic(x, w, recipe, np.dtype(np.float32))
                for recipe in (_emu(name), f8.get_recipe(name))
            )
            for name in names
        }
    )(x, w)
    for name in names:
        emu, nat = runs[name]
        band = 4 * 64 * EPS32 * (np.abs(np.asarray(x)) * 1.1) @ (np.abs(np.asarray(w)) * 1.1)
        np.testing.assert_array_less(np.abs(np.asarray(emu) - np.asarray(nat)), band)


def test_dot_general_refuses_what_it_cannot_do():
    x = jnp.ones((2, 4, 8))
    with pytest.raises(ValueError, match="batch dimensions"):
        f8.dot_general(x, x, (((2,), (2,)), ((0,), (0,))), recipe=_emu("tensorwise"))
    with pytest.raises(ValueError, match="high-precision float"):
        f8.dot_general(
            jnp.ones((2, 3), jnp.int32), jnp.ones((3, 2)), DN_XW, recipe=_emu("tensorwise")
        )
    with pytest.raises(ValueError, match="state="):
        f8.dot_general(jnp.ones((2, 3)), jnp.ones((3, 2)), DN_XW, recipe=_emu("delayed"))
    if f8.fp8_matmul_hardware() is not None:  # CPU here: no silent fallback without emulate
        with pytest.raises(ValueError, match="emulate=True"):
            f8.dot_general(jnp.ones((2, 3)), jnp.ones((3, 2)), DN_XW, recipe="tensorwise")


# --- convert: which matmuls, and the report -------------------------------------------------------


def _attention_mlp(params, x):
    h = x @ params["w_in"]  # linear
    q = h.reshape(2, 4, 8)
    att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, q), axis=-1)  # batched: not a linear
    h = jnp.einsum("bqk,bkd->bqd", att, q).reshape(8, 8)
    with jax.named_scope("head"):
        return h @ params["w_out"]


def _params():
    rng = np.random.default_rng(5)
    return {
        "w_in": jnp.asarray(rng.standard_normal((16, 8)) * 0.3, jnp.float32),
        "w_out": jnp.asarray(rng.standard_normal((8, 4)) * 0.3, jnp.float32),
    }


def test_convert_selects_linear_matmuls_and_reports_them(maybe_jit):
    p, x = _params(), jnp.ones((8, 16), jnp.float32)
    rec = _emu("tensorwise")
    rows = f8.report(_attention_mlp, p, x, recipe=rec)
    assert [(r.name, r.fp8) for r in rows] == [
        ("dot_general", True),
        ("bqd,bkd->bqk/dot_general", False),
        ("bqk,bkd->bqd/dot_general", False),
        ("head/dot_general", True),
    ]
    assert "not selected" in rows[1].how and "emulated" in rows[0].how and str(rows[0])
    out = maybe_jit(f8.convert(_attention_mlp, rec))(p, x)
    manual = maybe_jit(lambda p, x: _attention_mlp_fp8(p, x, rec))(p, x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(manual))
    # by path and by shape
    only_head = f8.report(_attention_mlp, p, x, recipe=rec, fp8_filter="head/*")
    assert [r.fp8 for r in only_head] == [False, False, False, True]
    wide = f8.report(
        _attention_mlp,
        p,
        x,
        recipe=rec,
        fp8_filter=lambda m: m.linear is None and m.rhs_shape[-1] >= 8,
    )
    assert [r.fp8 for r in wide] == [True, False, False, False]


def _attention_mlp_fp8(params, x, rec):
    h = f8.dot_general(x, params["w_in"], DN_XW, recipe=rec)
    q = h.reshape(2, 4, 8)
    att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, q), axis=-1)
    h = jnp.einsum("bqk,bkd->bqd", att, q).reshape(8, 8)
    return f8.dot_general(h, params["w_out"], DN_XW, recipe=rec)


def test_convert_never_falls_back_silently():
    p, x = _params(), jnp.ones((8, 16), jnp.float32)
    with pytest.raises(ValueError, match="batch dimensions"):
        f8.convert(_attention_mlp, _emu("tensorwise"), fp8_filter="*")(p, x)
    if f8.fp8_matmul_hardware() is not None:
        with pytest.raises(ValueError, match="emulate=True"):
            f8.convert(_attention_mlp, "tensorwise")(p, x)

    @jax.custom_vjp
    def custom(x, w):
        return x @ w

    custom.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    with pytest.raises(ValueError, match="custom_vjp"):
        f8.convert(lambda x, w: custom(x, w), _emu("tensorwise"))(x, p["w_in"])
    with pytest.raises(TypeError, match="fp8_filter"):
        f8.convert(_attention_mlp, _emu("tensorwise"), fp8_filter=3)


@pytest.mark.slow
def test_convert_reaches_into_scan_and_jit():
    w = jnp.asarray(np.random.default_rng(6).standard_normal((3, 8, 8)) * 0.3, jnp.float32)
    x = jnp.ones((4, 8), jnp.float32)
    rec = _emu("rowwise")

    def net(w, x):
        body = jax.jit(lambda h, wi: (jnp.tanh(h @ wi), None))
        return jax.lax.scan(body, x, w)[0]

    def net_fp8(w, x):
        return jax.lax.scan(
            lambda h, wi: (jnp.tanh(f8.dot_general(h, wi, DN_XW, recipe=rec)), None), x, w
        )[0]

    # Both under jit, in one program (each its own computation): convert is tested eagerly
    # above; here what it reaches.
    (out, grads), (ref, ref_grads) = jax.jit(
        lambda w: (
            jax.value_and_grad(lambda w: jnp.sum(f8.convert(net, rec)(w, x)))(w),
            jax.value_and_grad(lambda w: jnp.sum(net_fp8(w, x)))(w),
        )
    )(w)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(grads), np.asarray(ref_grads))
    rows = f8.report(net, w, x, recipe=rec)
    assert len(rows) == 1 and rows[0].fp8 and "inside scan" in rows[0].how
    with pytest.raises(ValueError, match="share one amax history"):
        f8.init_state(net, _emu("delayed"), w, x)


# --- delayed scaling: Flax's Fp8DirectDotGeneralOp, bit for bit -----------------------------------


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_delayed_matches_flax_fp8_ops_step_for_step():
    import flax.linen as nn
    from flax.linen import fp8_ops

    class Net(nn.Module):
        fp8: bool = False

        @nn.compact
        def __call__(self, x):
            kw = {"dot_general_cls": fp8_ops.Fp8DirectDotGeneralOp} if self.fp8 else {}
            return nn.Dense(8, **kw)(nn.gelu(nn.Dense(32, **kw)(x)))

    rng = np.random.default_rng(1)  # data made on the host: no random-number program
    x = jnp.asarray(rng.standard_normal((16, 12)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    flax_net, net = Net(True), Net(False)
    vf = jax.jit(flax_net.init)(jax.random.key(0), x)  # one program, not op by op
    rec = _emu("delayed", amax_history_length=1024)
    apply = f8.convert(net.apply, rec)
    state = f8.init_state(net.apply, rec, {"params": vf["params"]}, x)
    assert sorted(state) == ["Net/Dense_0/dot_general", "Net/Dense_1/dot_general"]
    names = {"Net/Dense_0/dot_general": "Dense_0", "Net/Dense_1/dot_general": "Dense_1"}
    for k, v in names.items():  # same initial state as Flax's variables
        flax_state = f8.DelayedScalingState.from_flax(
            vf["_overwrite_with_gradient"][v]["Fp8DirectDotGeneralOp_0"]
        )
        jax.tree.map(np.testing.assert_array_equal, flax_state, state[k])

    grad_flax = jax.jit(jax.grad(lambda v: jnp.mean((flax_net.apply(v, x) - y) ** 2)))
    grad_ours = jax.jit(
        jax.grad(
            lambda p, s: jnp.mean((apply({"params": p}, x, fp8_state=s) - y) ** 2), argnums=(0, 1)
        )
    )
    params = vf["params"]
    descend = jax.jit(lambda p, g: jax.tree.map(lambda p, g: p - 0.5 * g, p, g))
    for _ in range(4):
        gf = grad_flax(vf)
        gp, gs = grad_ours(params, state)
        jax.tree.map(np.testing.assert_array_equal, gf["params"], gp)
        for k, v in names.items():
            new_flax = gf["_overwrite_with_gradient"][v]["Fp8DirectDotGeneralOp_0"]
            assert gs[k].to_flax().keys() == new_flax.keys()
            jax.tree.map(np.testing.assert_array_equal, new_flax, gs[k].to_flax())
        vf = {
            "params": descend(vf["params"], gf["params"]),
            "_overwrite_with_gradient": gf["_overwrite_with_gradient"],
        }
        params = descend(params, gp)
        state = gs
    # the history moved: newest amax first, scales no longer 1
    assert float(state["Net/Dense_0/dot_general"].input_amax_history[0]) > 0
    assert float(state["Net/Dense_0/dot_general"].input_scale[0]) != 1.0


def test_delayed_state_errors_name_the_entry():
    rec = _emu("delayed", amax_history_length=4)
    x, w = jnp.ones((2, 3)), jnp.ones((3, 5))
    f = f8.convert(lambda x, w: x @ w, rec)
    with pytest.raises(ValueError, match="init_state"):
        f(x, w)
    state = f8.init_state(lambda x, w: x @ w, rec, x, w)
    with pytest.raises(ValueError, match="no entry 'dot_general'.*Closest: 'dot_generl'"):
        f(x, w, fp8_state={"dot_generl": state["dot_general"]})
    with pytest.raises(ValueError, match="match no fp8 matmul"):
        f(x, w, fp8_state={**state, "extra": state["dot_general"]})
    with pytest.raises(ValueError, match="not delayed"):
        f8.init_state(lambda x, w: x @ w, _emu("tensorwise"), x, w)


# --- through autocast and per module (Flax's dot_general= argument) ------------------------------


@pytest.mark.slow
def test_autocast_fp8_runs_selected_matmuls_on_autocast_operands():
    import jaxamp

    p, x = _params(), jnp.ones((8, 16), jnp.float32)
    rec = _emu("tensorwise")
    amp = jaxamp.autocast(_attention_mlp, device="cpu", dtype=jnp.bfloat16, fp8=rec)

    @jax.jit  # one program (each its own computation)
    def run(p, x):
        # the same as fp8 matmuls on bfloat16 operands, the rest in bfloat16 (CPU autocast lists)
        bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (p, x))
        grads = jax.grad(lambda p: jnp.sum(amp(p, x).astype(jnp.float32)))(p)
        return amp(p, x), _attention_mlp_fp8(*bf16, rec), grads

    out, want, grads = run(p, x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    assert grads["w_in"].dtype == jnp.float32
    with pytest.raises(ValueError, match="batch dimensions"):
        jaxamp.autocast(_attention_mlp, device="cpu", fp8=rec, fp8_filter="*")(p, x)
    with pytest.raises(ValueError, match="convert"):
        jaxamp.autocast(_attention_mlp, device="cpu", fp8=_emu("delayed"))
    with pytest.raises(ValueError, match="needs fp8"):
        jaxamp.autocast(_attention_mlp, device="cpu", fp8_filter="*")


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_per_module_fp8_in_linen_and_nnx():
    import functools

    import flax.linen as nn
    from flax import nnx

    rec = _emu("rowwise")
    dot = functools.partial(f8.dot_general, recipe=rec)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((4, 16)), jnp.float32)
    dense = nn.Dense(8, dot_general=dot)  # only this layer in fp8
    v = dense.init(jax.random.key(0), x)
    k, b = v["params"]["kernel"], v["params"]["bias"]
    want = f8.dot_general(x, k, DN_XW, recipe=rec) + b
    np.testing.assert_array_equal(np.asarray(dense.apply(v, x)), np.asarray(want))
    lin = nnx.Linear(16, 8, dot_general=dot, rngs=nnx.Rngs(0))
    want = f8.dot_general(x, lin.kernel[...], DN_XW, recipe=rec) + lin.bias[...]
    np.testing.assert_array_equal(np.asarray(lin(x)), np.asarray(want))


def test_fp8_public_names_are_pinned():
    assert sorted(f8.__all__) == sorted(
        [
            "RECIPE_NAMES",
            "Cast",
            "DelayedScalingState",
            "MatmulInfo",
            "MatmulOperands",
            "MatmulRecord",
            "Recipe",
            "amax_to_scale",
            "capture_operands",
            "check_hardware",
            "combine_states",
            "convert",
            "dot_general",
            "fp8_matmul_hardware",
            "fp8_max",
            "from_fp8",
            "get_recipe",
            "init_state",
            "report",
            "select_state",
            "to_fp8",
            "to_fp8_dynamic",
        ]
    )
    for name in f8.__all__:
        obj = getattr(f8, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), name
