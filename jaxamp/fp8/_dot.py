"""The fp8 matmul: scales, casts and a custom-VJP ``dot_general`` for dynamic and delayed recipes."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jaxamp._numerics import divide, eager_as_one_program, widen
from jaxamp.fp8._recipes import E4M3, E5M2, Cast, Recipe
from jaxamp.fp8._recipes import get_recipe as _make_recipe

__all__ = [
    "DelayedScalingState",
    "check_hardware",
    "fp8_matmul_hardware",
    "amax_to_scale",
    "from_fp8",
    "dot_general",
    "fp8_max",
    "to_fp8_dynamic",
    "to_fp8",
]

# torchao's EPS (float8_utils.py): the amax is clamped to at least this before dividing.
_EPS = 1e-12
# amax (float32) < 1e-12 (float64) exactly when amax < the smallest float32 >= 1e-12.
_EPS32 = np.float32(_EPS)
if float(_EPS32) < _EPS:
    _EPS32 = np.nextafter(_EPS32, np.float32(np.inf))


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2).

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> jaxamp.fp8.fp8_max(jnp.float8_e5m2)
      57344.0
    """
    return float(ml_dtypes.finfo(np.dtype(dtype)).max)


def _half_gap_below_ln2() -> np.ndarray:
    # For each integer L in [-160, 160): half the gap from L down to the next float32, times
    # ln 2 (index L + 160). log2(x) for x just below 2**L rounds (in float32) up to L exactly
    # when 1 - x / 2**L < this value.
    ints = np.arange(-160, 160).astype(np.float32)
    below = np.nextafter(ints, np.float32(-np.inf))
    half = (ints.astype(np.float64) - below.astype(np.float64)) / 2
    return (half * np.log(2.0)).astype(np.float32)


_HALF_GAP_LN2 = _half_gap_below_ln2()


@eager_as_one_program
def _floor_pow2(x: jax.Array) -> jax.Array:
    """torchao's ``exp2(floor(log2(x)))`` with a correctly rounded float32 log2, exactly.

    Not the same as clearing the mantissa: just below a power of two ``2**L`` the float32 log2
    rounds up to ``L``, and torchao then returns ``2**L``. XLA's log2 is not correctly rounded
    (it can land 1 ulp below ``L``), so the rounding is decided here from the exact mantissa:
    with ``x = mant * 2**L``, ``mant`` in [0.5, 1), log2 rounds up iff ``1 - mant`` is below
    half the float32 gap under ``L`` times ln 2 (a first-order expansion; the decision is exact
    because the gap is ``2**(j-24)`` and ``2**j * ln 2`` is never within 1e-5 of an integer).
    """
    mant, expo = jnp.frexp(x)  # x = mant * 2**expo, mant in [0.5, 1)
    threshold = jnp.asarray(_HALF_GAP_LN2)[jnp.clip(expo, -160, 159) + 160]
    # log2(x) = expo + log2(mant) ~ expo - (1 - mant) / ln2; 1 - mant is exact (Sterbenz)
    n = expo - 1 + ((1.0 - mant) < threshold).astype(expo.dtype)
    p2 = jnp.ldexp(jnp.ones_like(x), n)
    special = (x == 0) | ~jnp.isfinite(x)
    return jnp.where(special, jnp.where(x == 0, jnp.zeros_like(x), x), p2)


def amax_to_scale(amax: jax.Array, dtype: Any, power_of_2: bool = False) -> jax.Array:
    """torchao's dynamic scale ``float32(fp8_max / max(float64(amax), 1e-12))``, in float32 only.

    JAX runs without float64 here; the float32 result is still bit-identical to torchao's: both
    operands are float32 numbers, and a correctly rounded float64 quotient rounded again to
    float32 equals the correctly rounded float32 quotient (53 >= 2*24 + 2 bits: double rounding
    is innocuous for division). The clamp compares against the float32 neighbour of 1e-12 that
    gives the same decision, and the clamped quotient is a float64-computed constant.

    Args:
      amax: the absolute maximum (any float dtype; a scalar or per-row values).
      dtype: the fp8 dtype the scale maps to.
      power_of_2: round down to a power of two (torchao's ``round_scales_to_power_of_2``).

    Returns:
      float32 scales, shaped like `amax`: ``x * scale`` fits the fp8 range.

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> float(jaxamp.fp8.amax_to_scale(jnp.float32(2.0), jnp.float8_e4m3fn))
      224.0
    """
    amax = jnp.asarray(amax).astype(jnp.float32)
    fmax = fp8_max(dtype)
    clamped = np.float32(fmax / _EPS)
    # correctly rounded on every backend, as torchao's float64 quotient rounded to float32
    scale = jnp.where(amax < _EPS32, clamped, divide(np.float32(fmax), amax))
    return _floor_pow2(scale) if power_of_2 else scale


def to_fp8(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """Casts `x` to fp8 with a given scale: ``float32(x) * scale``, clamped to the fp8 range,
    rounded to `dtype` (torchao's ``hp_tensor_and_scale_to_float8``).

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> q = jaxamp.fp8.to_fp8(jnp.array([1.0, 1e6]), jnp.float32(2.0), jnp.float8_e4m3fn)
      >>> q.astype(jnp.float32).tolist()  # saturates at 448
      [2.0, 448.0]
    """
    fmax = np.float32(fp8_max(dtype))
    scaled = x.astype(jnp.float32) * scale
    return jnp.clip(scaled, -fmax, fmax).astype(dtype)


@partial(eager_as_one_program, static_argnames="axis")
def _amax(x: jax.Array, axis: int | None) -> jax.Array:
    a = jnp.abs(x)
    return jnp.max(a) if axis is None else jnp.max(a, axis=axis, keepdims=True)


def to_fp8_dynamic(
    x: jax.Array, cast: Cast, axis: int | None = None, power_of_2: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Casts `x` to fp8 with a scale computed from its own amax (per tensor or per row, as `cast`
    says): returns ``(fp8 values, float32 scale)`` (torchao's ``hp_tensor_to_float8_dynamic``).

    Args:
      x: a float array.
      cast: the `Cast` (dtype and granularity).
      axis: for rowwise casts, the axis the amax is taken over (kept with size 1).
      power_of_2: round the scale down to a power of two.

    Returns:
      ``(q, scale)`` with ``q.dtype == cast.dtype`` and ``x ≈ q / scale``.

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> q, s = jaxamp.fp8.to_fp8_dynamic(jnp.ones((2, 3)), jaxamp.fp8.Cast("float8_e4m3fn"))
      >>> q.dtype, float(s)
      (dtype(float8_e4m3fn), 448.0)
    """
    if not cast.fp8:
        raise ValueError("jaxamp.fp8.to_fp8_dynamic: `cast` is high precision (dtype=None).")
    scale = amax_to_scale(
        _amax(x, None if cast.granularity == "tensorwise" else axis), cast.dtype, power_of_2
    )
    return to_fp8(x, scale, cast.dtype), scale


def from_fp8(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """Casts fp8 values back: ``q / scale`` in `dtype` (torchao's ``to_original_precision``).

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> float(jaxamp.fp8.from_fp8(jnp.array(448.0, jnp.float8_e4m3fn), jnp.float32(224.0)))
      2.0
    """
    return (widen(q) / scale).astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Operand:
    """One matmul operand: fp8 values and their scale, or a high-precision array."""

    value: jax.Array
    scale: jax.Array | None = None

    @property
    def T(self) -> _Operand:  # noqa: N802
        # a (M, 1) rowwise scale becomes (1, M); a scalar scale stays
        return _Operand(self.value.T, None if self.scale is None else self.scale.T)


def _cast(x: jax.Array, cast: Cast, axis: int, rec: Recipe) -> _Operand:
    if not cast.fp8:
        return _Operand(x)
    q, s = to_fp8_dynamic(x, cast, axis, rec.power_of_2_scales)
    return _Operand(q, s)


def _mm(a: _Operand, b: _Operand, out_dtype: Any, emulate: bool) -> jax.Array:
    """A 2-D matmul of two operands, both fp8 or both high precision."""
    hp = lax.Precision.HIGHEST
    if a.scale is None:
        return jnp.matmul(a.value, b.value, precision=hp).astype(out_dtype)
    if emulate:
        # torchao emulate=True: mm(a.float() / a_scale, b.float() / b_scale) in float32.
        out = jnp.matmul(
            widen(a.value) / a.scale,
            widen(b.value) / b.scale,
            precision=hp,
        )
        return out.astype(out_dtype)
    # fp8 operands into the matmul (tensor cores on sm89+), float32 accumulation, then the
    # inverse scales, as torch._scaled_mm with scale_a = 1/a_scale, scale_b = 1/b_scale.
    # DEFAULT precision, explicitly: a surrounding jax.default_matmul_precision("highest") must not
    # reach the fp8 GEMM (Flax's fp8 ops do the same).
    out = lax.dot_general(
        a.value,
        b.value,
        (((1,), (0,)), ((), ())),
        precision=lax.Precision.DEFAULT,
        preferred_element_type=jnp.float32,
    )
    return (out * ((1.0 / a.scale) * (1.0 / b.scale))).astype(out_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _linear_dynamic(x: jax.Array, w: jax.Array, rec: Recipe, out_dtype: Any) -> jax.Array:
    """``x (M, K) @ w (K, N)`` with torchao's dynamic scaling (its ``matmul_with_hp_or_float8_args``)."""
    return _mm(_cast(x, rec.input, -1, rec), _cast(w, rec.weight, 0, rec), out_dtype, rec.emulate)


def _linear_dynamic_fwd(x, w, rec, out_dtype):
    return _linear_dynamic(x, w, rec, out_dtype), (x, w)


def _linear_dynamic_bwd(rec, out_dtype, res, g):
    x, w = res
    # grad_input = grad_output (M, N) @ weight.T (N, K): rowwise amax over N for both.
    g_gi = _cast(g, rec.grad_output, -1, rec)
    w_gi = _cast(w, rec.weight_for_grad_input, -1, rec)
    grad_x = _mm(g_gi, w_gi.T, g.dtype, rec.emulate)
    # grad_weight.T = grad_output.T (N, M) @ input (M, K): rowwise amax over M for both.
    g_gw = _cast(g, rec.grad_output_for_grad_weight, 0, rec)
    x_gw = _cast(x, rec.input_for_grad_weight, 0, rec)
    grad_w = _mm(g_gw.T, x_gw, g.dtype, rec.emulate).T
    return grad_x.astype(x.dtype), grad_w.astype(w.dtype)


_linear_dynamic.defvjp(_linear_dynamic_fwd, _linear_dynamic_bwd)


# --- delayed scaling (Flax's Fp8DirectDotGeneralOp, same state layout) ----------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DelayedScalingState:
    """Delayed-scaling state of one fp8 matmul, laid out as Flax's fp8 ops variables.

    Field names, shapes and meaning are those of ``flax.linen.Fp8DirectDotGeneralOp``'s
    ``_overwrite_with_gradient`` collection: ``*_scale`` (shape ``(1,)``, float32) is the
    dequantization factor (``x ≈ q * scale``) and ``*_amax_history`` (shape ``(L,)``) holds the
    last L amaxes, newest first. Under `jax.grad` the gradient of this state *is* the updated
    state (Flax's overwrite-with-gradient convention).

    Examples:
      >>> import jax, jaxamp.fp8 as f8
      >>> jax.tree.map(jnp.shape, f8.DelayedScalingState.create(amax_history_length=4))
      DelayedScalingState(input_amax_history=(4,), kernel_amax_history=(4,),
      output_grad_amax_history=(4,), input_scale=(1,), kernel_scale=(1,), output_grad_scale=(1,))
    """

    input_amax_history: jax.Array
    kernel_amax_history: jax.Array
    output_grad_amax_history: jax.Array
    input_scale: jax.Array
    kernel_scale: jax.Array
    output_grad_scale: jax.Array

    @classmethod
    def create(cls, amax_history_length: int = 1024) -> DelayedScalingState:
        """Flax's initial values: scales 1, histories 0.

        Examples:
          >>> import jaxamp.fp8
          >>> jaxamp.fp8.DelayedScalingState.create(16).input_amax_history.shape
          (16,)
        """
        h = jnp.zeros((amax_history_length,), jnp.float32)
        s = jnp.ones((1,), jnp.float32)
        return cls(h, h, h, s, s, s)

    @classmethod
    def from_flax(cls, variables: Any) -> DelayedScalingState:
        """From a Flax fp8 op's variables (the dict under ``_overwrite_with_gradient/<op>``)."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in variables]
        if missing:
            raise ValueError(
                f"DelayedScalingState.from_flax: missing {missing}; got keys {sorted(variables)}."
            )
        return cls(**{n: jnp.asarray(variables[n], jnp.float32) for n in names})

    def to_flax(self) -> dict[str, jax.Array]:
        """The Flax fp8 op's variable dict (inverse of `from_flax`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# Bounds of the quantization factor (the reciprocal of the stored scale): the scale stays in
# [2**-126, 2**63], normal in float32 (a subnormal one is flushed to 0 on CPU/TPU), and the
# product of a matmul's two scales (<= 2**126) stays finite: a scale of 0 or a product of inf
# makes NaN outputs. Reached only for amaxes above 448 * 2**63 (or margins that push past it).
_SF_MIN = np.float32(2.0**-63)
_SF_MAX = np.float32(2.0**126)


def _flax_scale(amax, scale, fmax, margin):
    # Flax compute_scale, step for step (bit-identical for amaxes in [1e-12, 448 * 2**63]), on
    # reciprocals. Flax divides by any positive amax: 448 / 1e-37 is
    # inf in float32, the scale 1 / inf = 0, and the next outputs NaN. torchao clamps the amax
    # at 1e-12 (float8_utils.amax_to_scale): so does this, and the factor is clipped to the
    # scale's safe range (_SF_MIN), so that it stays finite and > 0 for any history.
    scale_inv = 1.0 / scale
    quotient = jnp.where(amax < _EPS32, np.float32(fmax / _EPS), np.float32(fmax) / amax)
    sf = jnp.clip(quotient / (2**margin), _SF_MIN, _SF_MAX)
    sf = jnp.where(amax > 0.0, sf, scale_inv)
    sf = jnp.where(jnp.isfinite(amax), sf, scale_inv)
    return 1.0 / sf


def _delayed_update(x, dtype, scale, history, margin):
    new_scale = _flax_scale(jnp.max(history, axis=0), scale, fp8_max(dtype), margin)
    amax = jnp.max(jnp.abs(x)).astype(history.dtype)
    new_history = jnp.roll(history, shift=-1, axis=0).at[0].set(amax)
    return new_scale, new_history


def _delayed_quantize(x, dtype, scale, compute_dtype):
    fmax = jnp.asarray(fp8_max(dtype), compute_dtype)
    scaled = x / jnp.broadcast_to(scale.astype(compute_dtype), x.shape)
    return jnp.clip(scaled, -fmax, fmax).astype(dtype)


def _delayed_mm(a, b, a_scale, b_scale, out_dtype, precision, emulate):
    # Flax's quantized_dot + out_dq: fp8 operands, then the product of the dequant scales.
    dn = (((1,), (0,)), ((), ()))
    if emulate:
        # fp8 values and their products are exact in float32: a float32 matmul of the fp8 values
        # is the fp8 hardware's product on any backend. A dot_general of fp8 arrays is not: where
        # XLA:GPU cannot hand it to cuBLASLt's fp8 GEMM it converts the operands to float16, and
        # 448 * 448 overflows there (inf outputs from saturated operands).
        out = lax.dot_general(
            widen(a),
            widen(b),
            dn,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
    else:
        out = lax.dot_general(a, b, dn, precision=precision, preferred_element_type=out_dtype)
    return out.astype(out_dtype) * jnp.broadcast_to(
        (a_scale.astype(jnp.float32) * b_scale.astype(jnp.float32)).astype(out_dtype), out.shape
    )


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _linear_delayed(x, w, state: DelayedScalingState, rec: Recipe, out_dtype: Any):
    return _linear_delayed_fwd(x, w, state, rec, out_dtype)[0]


def _linear_delayed_fwd(x, w, state, rec, out_dtype):
    cdt = w.dtype
    sx, hx = _delayed_update(x, E4M3, state.input_scale, state.input_amax_history, rec.margin)
    sw, hw = _delayed_update(w, E4M3, state.kernel_scale, state.kernel_amax_history, rec.margin)
    qx = _delayed_quantize(x, E4M3, sx, cdt)
    qw = _delayed_quantize(w, E4M3, sw, cdt)
    y = _delayed_mm(qx, qw, sx, sw, out_dtype, lax.Precision.DEFAULT, rec.emulate)
    return y, (qx, qw, sx, sw, hx, hw, state.output_grad_scale, state.output_grad_amax_history)


def _linear_delayed_bwd(rec, out_dtype, res, g):
    qx, qw, sx, sw, hx, hw, sg_old, hg_old = res
    sg, hg = _delayed_update(g, E5M2, sg_old, hg_old, rec.margin)
    qg = _delayed_quantize(g, E5M2, sg, out_dtype)
    hi = lax.Precision.HIGHEST
    grad_x = _delayed_mm(qg, qw.T, sw, sg, out_dtype, hi, rec.emulate)
    grad_w = _delayed_mm(qg.T, qx, sx, sg, out_dtype, hi, rec.emulate).T
    new_state = DelayedScalingState(hx, hw, hg, sx, sw, sg)
    return grad_x, grad_w, new_state


_linear_delayed.defvjp(_linear_delayed_fwd, _linear_delayed_bwd)


def fp8_matmul_hardware() -> str | None:
    """None if the default backend has fp8 matmul units (NVIDIA sm89+), else why not.

    Examples:
      >>> import jaxamp.fp8
      >>> jaxamp.fp8.fp8_matmul_hardware()  # on a CPU  # doctest: +SKIP
      "the 'cpu' backend has no fp8 matmul units"
    """
    backend = jax.default_backend()
    if backend == "gpu":
        device = jax.devices()[0]
        cc = getattr(device, "compute_capability", None)
        try:
            major, minor = (int(p) for p in str(cc).split(".")[:2])
        except ValueError:
            return f"GPU {device.device_kind} reports no CUDA compute capability ({cc!r})"
        if (major, minor) >= (8, 9):
            return None
        return f"GPU {device.device_kind} is sm{major}{minor}; fp8 matmuls need sm89 or newer"
    return f"the {backend!r} backend has no fp8 matmul units"


def check_hardware(rec: Recipe) -> None:
    """Raise unless `rec` can run here: fp8 hardware, or ``emulate=True``. Never falls back.

    Examples:
      >>> import jaxamp.fp8 as f8
      >>> f8.check_hardware(f8.get_recipe("tensorwise", emulate=True))  # emulation runs anywhere
      >>> def runs_here(rec):
      ...     try:
      ...         f8.check_hardware(rec)
      ...     except ValueError:  # the message says why and to pass emulate=True
      ...         return False
      ...     return True
      >>> runs_here(f8.get_recipe("tensorwise")) == (f8.fp8_matmul_hardware() is None)
      True
    """
    if rec.emulate:
        return
    why = fp8_matmul_hardware()
    if why:
        raise ValueError(
            f"jaxamp.fp8: recipe {rec.name!r} asks for fp8 matmuls, but {why}. Pass "
            f"emulate=True (jaxamp.fp8.get_recipe({rec.name!r}, emulate=True): fp8-rounded operands, "
            "float32 matmul, as torchao's emulate=True) or run on an sm89+ GPU."
        )


# --- dot_general front end ------------------------------------------------------------------------


def linear_like(dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int) -> str | None:
    """None if the dot is a linear layer's matmul fp8 can run (no batch dims), else why not."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb:
        return "it has batch dimensions (fp8 recipes cover linear layers, as torchao's)"
    if not lc:
        return "it contracts no dimension (an outer product)"
    if len(lc) == lhs_ndim or len(rc) == rhs_ndim:
        return "an operand has no free dimension"
    return None


def to_2d(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any):
    """``(x (M, K), w (K, N), output shape)`` of a dot without batch dimensions."""
    (lc, rc), _ = dimension_numbers
    lc, rc = tuple(int(d) for d in lc), tuple(int(d) for d in rc)
    lf = [d for d in range(lhs.ndim) if d not in lc]
    rf = [d for d in range(rhs.ndim) if d not in rc]
    out_shape = tuple(lhs.shape[d] for d in lf) + tuple(rhs.shape[d] for d in rf)
    k = int(np.prod([lhs.shape[d] for d in lc]))
    x2 = jnp.transpose(lhs, lf + list(lc)).reshape(-1, k)
    w2 = jnp.transpose(rhs, list(rc) + rf).reshape(k, -1)
    return x2, w2, out_shape


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    recipe: Recipe | str = "tensorwise",
    state: DelayedScalingState | None = None,
    out_sharding: Any = None,
) -> jax.Array:
    """``lax.dot_general`` in fp8 per `recipe`, with the recipe's casts in the backward pass too.

    `lhs` plays torchao's ``input`` and `rhs` the ``weight``. Any contraction without batch
    dimensions works (``x @ w``, ``x @ w.T``, several contracted axes): operands are brought to
    ``(M, K) @ (K, N)``, where rowwise scales are per row of ``input`` and per column of
    ``weight``. Also usable as Flax's ``dot_general=`` argument of ``Dense``/``nnx.Linear``.

    Args:
      lhs, rhs, dimension_numbers: as `jax.lax.dot_general`.
      precision: ignored for the fp8 matmuls (they set their own); kept for the signature.
      preferred_element_type: output dtype (default: the promoted operand dtype).
      recipe: a `Recipe` or a recipe name.
      state: delayed recipes only: this matmul's `DelayedScalingState`; its gradient is the
        updated state.
      out_sharding: as `jax.lax.dot_general`'s (applied as a sharding constraint on the output).

    Returns:
      The product, shaped as `lax.dot_general`'s.

    Raises:
      ValueError: batch dimensions, non-float operands, or a delayed recipe without `state`.

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
      >>> r = jaxamp.fp8.get_recipe("tensorwise", emulate=True)
      >>> jaxamp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=r).shape
      (4, 2)
    """
    del precision
    rec = _make_recipe(recipe)
    check_hardware(rec)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype in (E4M3, E5M2):
            raise ValueError(
                f"jaxamp.fp8.dot_general: `{name}` must be a high-precision float array; got {x.dtype}."
            )
    why = linear_like(dimension_numbers, lhs.ndim, rhs.ndim)
    if why:
        raise ValueError(f"jaxamp.fp8.dot_general: cannot run this dot in fp8: {why}.")
    x2, w2, out_shape = to_2d(lhs, rhs, dimension_numbers)
    out_dtype = np.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    if rec.scaling == "delayed":
        if not isinstance(state, DelayedScalingState):
            raise ValueError(
                "jaxamp.fp8.dot_general: a delayed recipe needs `state=` (a "
                f"DelayedScalingState, see jaxamp.fp8.init_state); got {type(state).__name__}."
            )
        cdt = w2.dtype
        y = _linear_delayed(x2.astype(cdt), w2, state, rec, out_dtype)
    else:
        if state is not None:
            raise ValueError("jaxamp.fp8.dot_general: `state` is for delayed recipes only.")
        y = _linear_dynamic(x2, w2, rec, out_dtype)
    y = y.reshape(out_shape)
    if out_sharding is not None:
        y = jax.lax.with_sharding_constraint(y, out_sharding)
    return y
