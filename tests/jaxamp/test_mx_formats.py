"""jaxamp.mx formats: scales and element codes bit-identical to torchao's ``to_mx`` and
``nvfp4_quantize`` for every format and scale mode, on random, adversarial and special inputs,
compiled and eager; dequantization against torchao's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp.mx as mx
from jaxamp.mx import _bits
from jaxamp.mx._scales import rceil_thresholds

torch = pytest.importorskip("torch")
mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")
mx_kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")

MODES = ("floor", "rceil", "ceil", "even")
MX_FORMATS = ("mxfp8", "mxfp8_e5m2", "mxfp4")
TORCH_ELEMENT = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e2m1": "float4_e2m1fn_x2"}


# --- formats as data ---------------------------------------------------------------------------


def test_formats_as_data():
    f = mx.get_format("mxfp8")
    assert (f.element, f.block_size, f.scale, f.scale_mode) == ("e4m3", 32, "e8m0", "floor")
    assert f.dtype == np.dtype(jnp.float8_e4m3fn) and (f.max, f.emax) == (448.0, 8)
    f4 = mx.get_format("mxfp4")
    assert f4.packed and f4.dtype == np.dtype(jnp.float4_e2m1fn) and (f4.max, f4.emax) == (6.0, 2)
    nv = mx.get_format("nvfp4")
    assert (nv.block_size, nv.scale, nv.scale_mode) == (16, "e4m3", None)
    assert mx.get_format(f, scale_mode="rceil").scale_mode == "rceil"
    assert mx.get_format("mxfp8_e5m2").emax == 15
    assert mx.Format("mine", "float8_e4m3fn", 64).element == "e4m3"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mx.get_format("mxfp9"), "Did you mean 'mxfp8'"),
        (lambda: mx.get_format("mxfp8", scale_mode="RCEIL"), "Did you mean 'rceil'"),
        (lambda: mx.get_format("mxfp8", scale_mode="round"), "scale_mode must be one of"),
        (lambda: mx.Format("x", "e3m4"), "element must be one of"),
        (lambda: mx.Format("x", block_size=31), "block_size must be an even int"),
        (lambda: mx.Format("x", "e4m3", 16, "e4m3", None), "elements are e2m1"),
        (lambda: mx.Format("x", "e2m1", 16, "e4m3", "floor"), "no scale_mode"),
        (lambda: mx.Format("x", scale="fp32"), "scale must be 'e8m0'"),
    ],
)
def test_format_bad_input_names_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_quantize_bad_input():
    with pytest.raises(ValueError, match="multiple of mxfp8's block size 32"):
        mx.to_block_scaled(jnp.ones((2, 48)), "mxfp8")
    with pytest.raises(ValueError, match="must be float32, bfloat16 or float16"):
        mx.to_block_scaled(jnp.ones((2, 32), jnp.int32), "mxfp8")
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        mx.to_block_scaled(jnp.ones((2, 32)), "mxfp8", axis=2)
    with pytest.raises(ValueError, match="per_tensor_scale is NVFP4's"):
        mx.to_block_scaled(jnp.ones((2, 32)), "mxfp8", per_tensor_scale=1.0)


# --- the inputs --------------------------------------------------------------------------------


def _adversarial_values() -> np.ndarray:
    vals = []
    for k in range(-149, 128):
        p = np.float32(2.0**k)
        vals += [p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf))]
    vals += [448, 447.9, 449, 464, 6, 5.99, 5.0, 57344, 61440, 0, 3e-39, 1e-45]
    vals.append(np.finfo(np.float32).max)
    v = np.array(vals, np.float32)
    return np.concatenate([v, -v])


def _inputs(block: int) -> np.ndarray:
    """Rows of `block` elements (one block each): random magnitudes over float32's range,
    blocks of adversarial values, each adversarial value as the maximum of its own block (the
    rest at 0.37 of it: subnormal ones too), each RCEIL threshold and the float below it as a
    block maximum, and blocks with inf and NaN."""
    rng = np.random.default_rng(0)
    adv = _adversarial_values()
    rows = [
        rng.standard_normal((64, block)).astype(np.float32)
        * (10.0 ** rng.integers(-40, 36, (64, 1))).astype(np.float32),
        rng.choice(adv, (400, block)),
    ]
    single = np.repeat((adv * np.float32(0.37))[:, None], block, axis=1)
    single[:, 0] = adv
    rows.append(single)
    for fmax in (448.0, 57344.0, 6.0):
        t = rceil_thresholds(fmax)
        amax = np.concatenate([t, t - 1]).view(np.float32)
        amax = amax[np.isfinite(amax)]
        blk = np.repeat((amax * np.float32(0.5))[:, None], block, axis=1)
        blk[:, 1] = amax
        rows.append(blk)
    special = np.ones((5, block), np.float32)
    special[0, 3] = np.inf
    special[0, 4] = 1e38
    special[1, 5] = np.nan
    special[2, 7] = -np.inf
    special[2, 9] = 3.0
    special[3, :] = -np.nan
    special[4, :] = 0.0
    special[4, ::2] = -0.0
    rows.append(special)
    return np.concatenate(rows).astype(np.float32)


_X32 = _inputs(32)
_X16 = _inputs(16)


def _torch_mx(x: np.ndarray, fmt: mx.Format):
    elem = getattr(torch, TORCH_ELEMENT[fmt.element])
    mode = mx_config.ScaleCalculationMode(fmt.scale_mode)
    scale, data = mx_tensor.to_mx(torch.from_numpy(x), elem, fmt.block_size, mode)
    return scale.view(torch.uint8).numpy(), data.view(torch.uint8).numpy()


def _jax_bits(codes, scales) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(codes)
    return np.asarray(scales).view(np.uint8), (c if c.dtype == np.uint8 else c.view(np.uint8))


def _assert_same(jax_pair, torch_pair, what: str):
    (js, jc), (ts, tc) = jax_pair, torch_pair
    ts, tc = ts.reshape(js.shape), tc.reshape(jc.shape)
    bad_s, bad_c = np.argwhere(js != ts), np.argwhere(jc != tc)
    assert not bad_s.size, f"{what}: {len(bad_s)} scales differ, first at {bad_s[:3].tolist()}"
    assert not bad_c.size, f"{what}: {len(bad_c)} codes differ, first at {bad_c[:3].tolist()}"


# --- bit-exact against torchao -----------------------------------------------------------------


def _bf16_input():
    xb = torch.from_numpy(_X32[:200]).to(torch.bfloat16)
    return xb, jnp.asarray(xb.view(torch.int16).numpy()).view(jnp.bfloat16)


@functools.cache
def _quantized_every_format():
    """{(format name, scale mode): (codes and scales of _X32, of its first 200 rows in
    bfloat16)}: every format and mode in one jitted program (one XLA compile for the 24
    quantizations instead of one each), shared by the tests."""
    fmts = {(n, m): mx.get_format(n, scale_mode=m) for n in MX_FORMATS for m in MODES}

    def quantize(x, xb):
        return {
            case: (mx.to_block_scaled(x, fmt), mx.to_block_scaled(xb, fmt))
            for case, fmt in fmts.items()
        }

    return jax.jit(quantize)(jnp.asarray(_X32), _bf16_input()[1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MX_FORMATS)
def test_mx_quantize_bit_exact_to_torchao(name, mode):
    fmt = mx.get_format(name, scale_mode=mode)
    quantized, quantized_bf16 = _quantized_every_format()[name, mode]
    _assert_same(_jax_bits(*quantized), _torch_mx(_X32, fmt), f"{fmt} float32")
    xb, _ = _bf16_input()
    _assert_same(_jax_bits(*quantized_bf16), _torch_mx_bf16(xb, fmt), f"{fmt} bfloat16")


def _torch_mx_bf16(xb, fmt):
    elem = getattr(torch, TORCH_ELEMENT[fmt.element])
    mode = mx_config.ScaleCalculationMode(fmt.scale_mode)
    scale, data = mx_tensor.to_mx(xb, elem, fmt.block_size, mode)
    return scale.view(torch.uint8).numpy(), data.view(torch.uint8).numpy()


def test_mx_quantize_eager():
    # eagerly (op by op; jaxamp's bit helpers a program each): subnormal, threshold and special
    # blocks
    fmt = mx.get_format("mxfp8", scale_mode="rceil")
    x = _X32[-40:]
    _assert_same(_jax_bits(*mx.to_block_scaled(x, fmt)), _torch_mx(x, fmt), f"{fmt} eager")


@pytest.mark.parametrize("pts", [None, 0.01, 1e-30])
def test_nvfp4_quantize_bit_exact_to_torchao(pts):
    tpts = None if pts is None else torch.tensor(pts, dtype=torch.float32)
    ts, tc = nvfp4_tensor.nvfp4_quantize(torch.from_numpy(_X16), 16, tpts)
    jpts = None if pts is None else jnp.float32(pts)
    codes, scales = jax.jit(lambda x: mx.to_block_scaled(x, "nvfp4", per_tensor_scale=jpts))(_X16)
    _assert_same(
        _jax_bits(codes, scales), (ts.view(torch.uint8).numpy(), tc.numpy()), f"nvfp4 {pts}"
    )


def test_per_tensor_scale_is_torchaos():
    amax = np.float32([1.0, 2688.0, 3.7e-3, 1e30])
    ours = np.asarray(jax.jit(mx.per_tensor_scale)(amax))
    theirs = nvfp4_tensor.per_tensor_amax_to_scale(torch.from_numpy(amax)).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_quantize_along_an_axis_is_the_transpose_quantized():
    x = _X32[:64].reshape(64, 32)
    fmt = mx.get_format("mxfp4", scale_mode="rceil")
    c0, s0 = jax.jit(lambda a: mx.to_block_scaled(a, fmt, axis=0))(x.T.copy())
    c1, s1 = jax.jit(lambda a: mx.to_block_scaled(a, fmt))(x)
    np.testing.assert_array_equal(np.asarray(c0).T, np.asarray(c1))
    np.testing.assert_array_equal(np.asarray(s0).T, np.asarray(s1))
    assert c0.shape == (16, 64) and s0.shape == (1, 64)


# --- dequantize against torchao ----------------------------------------------------------------


@pytest.mark.parametrize("name", MX_FORMATS)
def test_mx_dequantize_matches_torchao(name):
    fmt = mx.get_format(name, scale_mode="rceil")
    x = _X32[:500]
    ts, td = _torch_mx(x, fmt)
    elem = getattr(torch, TORCH_ELEMENT[fmt.element])
    tdata = torch.from_numpy(td)
    tdata = tdata if fmt.packed else tdata.view(elem)
    ref = mx_tensor.to_dtype(
        tdata, torch.from_numpy(ts).view(torch.float8_e8m0fnu), elem, 32, torch.float32
    ).numpy()
    codes, scales = jax.jit(lambda a: mx.to_block_scaled(a, fmt))(x)
    ours = np.asarray(jax.jit(lambda c, s: mx.from_block_scaled(c, s, fmt))(codes, scales))
    # XLA:CPU flushes float32 subnormal results to zero; torch keeps them
    tiny = np.abs(ref) < np.finfo(np.float32).tiny
    np.testing.assert_array_equal(ours, np.where(tiny, np.copysign(np.float32(0.0), ref), ref))


def test_nvfp4_dequantize_matches_torchao():
    x = _X16[:400]
    pts = torch.tensor(0.02, dtype=torch.float32)
    ref = nvfp4_tensor.NVFP4Tensor.to_nvfp4(torch.from_numpy(x), per_tensor_scale=pts)
    pts32 = jnp.float32(0.02)

    @jax.jit
    def round_trip(a):
        codes, scales = mx.to_block_scaled(a, "nvfp4", per_tensor_scale=pts32)
        return mx.from_block_scaled(codes, scales, "nvfp4", per_tensor_scale=pts32)

    ours = round_trip(x)
    np.testing.assert_array_equal(np.asarray(ours), ref.dequantize(torch.float32).numpy())


def test_e2m1_codes_and_packing_match_torchao_kernels():
    v = np.concatenate([_adversarial_values(), np.linspace(-7, 7, 1001, dtype=np.float32)])
    v = np.concatenate([v, np.float32([np.nan, -np.nan, np.inf])])
    v = v[: v.size // 2 * 2]
    ours = np.asarray(jax.jit(_bits.e2m1_codes)(v))
    np.testing.assert_array_equal(ours, mx_kernels.f32_to_f4_unpacked(torch.from_numpy(v)).numpy())
    packed = np.asarray(_bits.pack_nibbles(ours))
    np.testing.assert_array_equal(
        packed, mx_kernels.pack_uint4(torch.from_numpy(ours.copy())).numpy()
    )
    np.testing.assert_array_equal(np.asarray(_bits.unpack_nibbles(packed)), ours)


def test_scales_to_float32():
    s = jnp.array([0, 1, 120, 127, 254, 255], jnp.uint8)
    out = np.asarray(jax.jit(mx.scales_to_float32)(s))
    np.testing.assert_array_equal(out[1:5], np.float32([2.0**-126, 2.0**-7, 1.0, 2.0**127]))
    assert out[0] == 0.0 and np.isnan(out[5])  # 2**-127 is subnormal: flushed on XLA:CPU


def test_mul_pow2_is_exact_for_subnormal_inputs():
    x = np.float32([1e-45, -3e-39, 1.2e-38, 5.0, -7.5])
    p = np.int32([149, 130, 100, -3, 2])
    expected = (x.astype(np.float64) * 2.0 ** p.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(_bits.mul_pow2)(x, p)), expected)


def test_divide_is_ieee_division_by_a_scalar():
    x = np.random.default_rng(1).uniform(0, 100, 4096).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(_bits.divide)(x, np.float32(6.0))), x / np.float32(6.0)
    )
