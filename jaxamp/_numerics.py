"""Pytree arithmetic shared by the loss scales, `loss_scaled`, `multi_steps` and the Flax glue.

One home for: finite checks, scaling and exact unscaling, torch's float32 rounding of scale
updates, identity updates, selects that keep skipped values bit for bit, saturating counters
(`optax.safe_increment`) and the check that a mapped axis is not forgotten. Private: its one
public name, `all_finite`, is exported by `jaxamp`.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, 2**-126
F32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = int(np.iinfo(np.int32).max)

AxisName = str | tuple[str, ...] | None


# Leaf and scalar numerics that jaxamp calls eagerly too (an eager loss-scaled step checks and
# unscales leaf by leaf): JAX compiles an eager call of a jitted function as ONE program per
# argument shape and dtype, where op by op it compiles each primitive it meets (a third of the
# compile time for a leaf's finiteness check). `inline=True`: inside a traced function the
# body is traced in place, so a jitted step's program is the same as without the decorator.
eager_as_one_program = functools.partial(jax.jit, inline=True)


def is_inexact_array(x: Any) -> bool:
    """Whether `x` is a float or complex array (numpy or JAX)."""
    return isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.inexact)


def is_inexact_leaf(x: Any) -> bool:
    # numpy/Python float scalars count too: under jit they arrive as float arrays, so ignoring
    # them eagerly would make the eager and jitted answers differ.
    return is_inexact_array(x) or (
        isinstance(x, (float, complex, np.inexact)) and not isinstance(x, bool)
    )


def wide_dtype(dtype: Any) -> np.dtype:
    """The dtype scaling arithmetic runs in: float32 for 16-bit floats, else the dtype itself.

    Not `jnp.promote_types`: under strict dtype promotion it refuses (bfloat16, float32).
    """
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return dtype
    return dtype if dtype.itemsize > 4 else np.dtype(jnp.float32)


# --- finite checks and mapped axes ---------------------------------------------------------------


def widen(x: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """`x` (a narrow float array, e.g. fp8 codes rounded in this program) as `dtype`, read through
    an optimization barrier. XLA:GPU deletes a wide -> narrow -> wide chain of converts
    (SimplifyFPConversions, on under its default xla_allow_excess_precision), so a jitted
    program would skip the narrow rounding; the barrier is opaque to that pass."""
    return jax.lax.optimization_barrier(x).astype(dtype)


def check_axis_name(axis_name: Any, caller: str) -> AxisName:
    """Validates an `axis_name` argument: None, a str, or a tuple of str (``()``: no axes)."""
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if isinstance(axis_name, tuple) and all(isinstance(a, str) for a in axis_name):
        return axis_name
    raise TypeError(
        f"{caller}(axis_name=...) takes None, an axis name (str) or a tuple of names; got "
        f"{type(axis_name).__name__} {axis_name!r}."
    )


def _mapped_axes_in_scope() -> tuple[str, ...] | None:
    """The names of the mapped axes being traced, or None where JAX cannot tell us."""
    # No public API tells whether we trace inside pmap / a named vmap; guard the private one.
    try:
        from jax._src import core

        names = core.unsafe_get_axis_names()
    except Exception:  # pragma: no cover - depends on the JAX version
        return None
    return tuple(str(n) for n in names)


def _check_axes_in_scope(axis_name: str | tuple[str, ...], caller: str) -> None:
    """Raises, naming the axes in scope, if `axis_name` names an axis that is not mapped here."""
    in_scope = _mapped_axes_in_scope()
    if in_scope is None:
        return
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    for name in names:
        if name in in_scope:
            continue
        shown = [n.replace("_internal_pmap_axis_name", "<pmap axis>") for n in in_scope]
        if shown:
            where = f"the mapped axes here are {shown}"
            close = difflib.get_close_matches(name, in_scope, n=1)
            hint = f" Did you mean axis_name={close[0]!r}?" if close else ""
        else:
            where = "no mapped axis is in scope (not inside shard_map or pmap)"
            hint = " Leave axis_name=None outside shard_map/pmap."
        raise ValueError(
            f"{caller}: axis_name={axis_name!r} names the axis {name!r}, but {where}. Pass the "
            f"axis name given to shard_map's mesh or pmap(..., axis_name=...).{hint}"
        )


def _varying_axes(tree: Any) -> set[str] | None:
    """The manual axes any leaf varies over, or None where JAX does not track it (pmap)."""
    axes: set[str] = set()
    tracked = False
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            vma = getattr(jax.typeof(leaf), "vma", None)
            if vma is not None:
                tracked = True
                axes.update(str(a) for a in vma)
    return axes if tracked else None


def check_replicas_agree(tree: Any, axis_name: AxisName, caller: str) -> None:
    """Raises if `tree` may differ across replicas of a mapped axis and no `axis_name` is given.

    Inside `shard_map` a leaf that varies over a manual axis is caught by its type; inside
    `pmap` (or a named `vmap`) any mapped axis in scope is. Without the axis name each replica
    would decide alone: one with inf skips, the others step, and the scales part ways.
    ``axis_name=()`` says that independent decisions are meant.
    """
    if axis_name is not None:
        _check_axes_in_scope(axis_name, caller)
        return
    in_scope = set(_mapped_axes_in_scope() or ())
    if not in_scope:
        return
    varying = _varying_axes(tree)
    # Where JAX tracks which axes a value varies over (shard_map), already psum-ed gradients
    # are fine; elsewhere (pmap, named vmap) any mapped axis in scope is suspicious.
    suspicious = varying if varying is not None else in_scope
    if suspicious:
        shown = ", ".join(
            sorted(n.replace("_internal_pmap_axis_name", "<pmap axis>") for n in suspicious)
        )
        raise ValueError(
            f"{caller}: called inside a mapped axis ({shown}) without axis_name: each replica "
            "would make its own skip decision and the loss scales would part ways. Pass "
            "axis_name=<the pmap/shard_map axis name> (pmap(..., axis_name='batch')), or "
            "axis_name=() if every replica is meant to decide on its own."
        )


# The float dtypes with IEEE-754's layout (inf: every exponent bit set, significand zero).
_IEEE_FLOATS = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def bits_dtype(dtype: np.dtype) -> Any:
    """The unsigned integer dtype as wide as `dtype`, or None for a float without infinities."""
    dtype = np.dtype(dtype)
    if dtype not in _IEEE_FLOATS:
        return None
    return {2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]


def _block_width(size: int) -> int:
    """The block length a magnitude maximum starts with along one axis: the largest of 16, 8,
    4, 2 that divides `size` (1 where none does)."""
    return next((w for w in (16, 8, 4, 2) if size % w == 0), 1)


@eager_as_one_program
def largest_magnitude(x: Any) -> jax.Array:
    """The largest magnitude among the elements of one real IEEE float array, +inf where an
    element is inf or NaN: a scalar of `x`'s dtype, decided element by element on the bits.

    Each element's sign bit is cleared (an integer AND on the bits) and the result capped at
    the bits of +inf, so NaN counts as +inf; as integers these order exactly as the magnitudes
    do. Why bits, not a sum: a sum of scaled gradients ``sum(g * scale)`` may legally be
    computed as ``scale * sum(g)`` under reassociation (XLA:CPU's reductions and fast-math
    flags allow it), which is finite when one product overflowed. Nothing can be factored out
    of an integer AND or an integer maximum.

    The reduction's shape is chosen per platform when the program is lowered
    (`lax.platform_dependent`, so a program lowered for GPU on a CPU machine is GPU's):
    XLA:CPU reduces 16 x 16 blocks first (`_largest_in_blocks`); GPU and TPU reduce the whole
    leaf at once (`_largest_at_once`): XLA:GPU emits a reduction over every element as one row
    reduction (one kernel reading the gradient once), where blocks over two non-adjacent axes
    would be split into a reduction per axis, with an intermediate buffer a sixteenth of the
    gradient between them (BENCHMARKS.md, "The skip path on GPU").
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        return _largest_at_once(x)
    return jax.lax.platform_dependent(x, cpu=_largest_in_blocks, default=_largest_at_once)


def _magnitude_bits(x: jax.Array) -> tuple[jax.Array, np.ndarray]:
    """Each element's magnitude as unsigned integer bits (sign cleared), and +inf's bits."""
    bits = bits_dtype(x.dtype)
    magnitude_mask = np.array(np.iinfo(bits).max >> 1, bits)
    inf_bits = np.array(np.inf, x.dtype).view(bits)
    return jax.lax.bitcast_convert_type(x, bits) & magnitude_mask, inf_bits


def _largest_at_once(x: jax.Array) -> jax.Array:
    """`largest_magnitude` as one integer maximum over every element, capped at +inf's bits."""
    magnitudes, inf_bits = _magnitude_bits(x)
    largest = jnp.max(magnitudes) if x.ndim else magnitudes
    return jax.lax.bitcast_convert_type(jnp.minimum(largest, inf_bits), x.dtype)


def _largest_in_blocks(x: jax.Array) -> jax.Array:
    """`largest_magnitude` as XLA:CPU reads it best: blocks reduced first as integers (XLA:CPU
    fuses the AND into that maximum and reads each gradient once, writing 1/16 to 1/256 of
    it), the rest as floats: non-negative values with no NaN among them, whose maximum has one
    answer whatever the max's NaN convention or evaluation order.

    Why blocks over the last two axes (16 x 16 where both divide), not rows of the flattened
    array: a weight gradient may be stored transposed. Under a 16-bit compute dtype cast by
    hand (``params.astype(bfloat16)``, a Flax module's ``dtype=``) XLA:CPU leaves each kernel's
    gradient as ``convert(transpose(dot))``; rows along the last axis then read it with a
    stride of a whole row, one cache line per element, while a square block reads the same
    cache lines in either layout (measured on BENCHMARKS.md's fp16-mixed MLP step with its
    casts written out; float32 unchanged). 1-d arrays take rows.
    """
    magnitudes, inf_bits = _magnitude_bits(x)
    if x.ndim == 1:
        blocks = jnp.max(magnitudes.reshape(-1, _block_width(x.size)), axis=-1)
    else:
        *leading, rows, cols = x.shape
        row_block, col_block = _block_width(rows), _block_width(cols)
        tiled = magnitudes.reshape(
            *leading, rows // row_block, row_block, cols // col_block, col_block
        )
        blocks = jnp.max(tiled, axis=(-3, -1))
    block_largest = jnp.minimum(blocks, inf_bits)
    return jnp.max(jax.lax.bitcast_convert_type(block_largest, x.dtype))


def _leaf_finite_after(x: Any, fn: Any) -> jax.Array:
    """Whether every element of one inexact array, and of `fn` of it, is finite."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.logical_and(_leaf_finite_after(x.real, fn), _leaf_finite_after(x.imag, fn))
    if x.size == 0:
        return jnp.array(True)
    if bits_dtype(x.dtype) is None:  # floats without infinities (fp8): element by element
        finite = jnp.isfinite(x).all()
        return finite if fn is None else jnp.logical_and(finite, jnp.isfinite(fn(x)).all())
    largest = largest_magnitude(x)
    finite = largest < np.array(np.inf, x.dtype)
    if fn is not None:
        # `fn` multiplies by a positive factor: it rounds monotonically in the magnitude, so
        # every element stays finite under `fn` exactly when the largest magnitude does.
        finite = jnp.logical_and(finite, jnp.isfinite(fn(largest)))
    return finite


def leaf_finite(x: Any) -> jax.Array:
    """Whether every element of one array is finite, decided element by element on its bits
    (`largest_magnitude`). Floats without IEEE infinities (fp8 formats) use `jnp.isfinite`."""
    return _leaf_finite_after(x, None)


def finite_after(tree: Any, fn: Any = None, axis_name: AxisName = None) -> jax.Array:
    """Whether every inexact leaf of `tree`, and of `tree_map(fn, tree)`, is finite.

    `fn` (leaf to leaf: unscaling, a multiplication by a positive factor rounded to the
    leaf's dtype) is never applied to a whole leaf: it rounds monotonically in the magnitude,
    so a leaf stays finite under it exactly when its largest magnitude does, and only that
    scalar is mapped (a scale below 1 makes a finite float16 gradient overflow once
    unscaled; a scale of at least 1 never does, and the check then costs nothing more).

    `tree` itself is always checked, not only `fn(tree)`: the check must not depend on how
    `fn(leaf)` is evaluated. Scaled gradients that overflowed are inf as they are stored; a
    compiler allowed to reassociate (``(g * s) * (1/s)`` as ``g * (s * (1/s))``) would make
    their unscaled recomputation finite again.
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_inexact_leaf(x)]
    if not leaves:
        finite = jnp.array(True)
    else:
        finite = jnp.stack([_leaf_finite_after(x, fn) for x in leaves]).all()
    if axis_name is not None and axis_name != ():
        # pmin over a bool is not defined: reduce as int32 (0 = some replica saw inf/nan).
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return finite


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
    """A scalar bool array: whether every float or complex leaf of `tree` is finite.

    Non-inexact leaves (ints, bools, PRNG keys) are ignored; an empty tree is finite. Complex
    leaves are finite when both parts are. Works on sharded arrays (XLA inserts the
    cross-device reduction).

    Args:
      tree: a pytree of arrays.
      axis_name: inside `shard_map`/`pmap`, the mapped axis name(s) to agree across: the result
        is then true only if the leaves are finite on every replica (``()``: no axes).

    Examples:
      >>> bool(jaxamp.all_finite({"w": jnp.ones(3), "step": jnp.int32(1)}))
      True
      >>> bool(jaxamp.all_finite([jnp.array([1.0, jnp.inf])])), bool(jaxamp.all_finite({}))
      (False, True)
    """
    axis_name = check_axis_name(axis_name, "all_finite")
    if axis_name:
        _check_axes_in_scope(axis_name, "all_finite")
    return finite_after(tree, axis_name=axis_name)


# --- scaling and exact unscaling -----------------------------------------------------------------


def scale_tree(tree: Any, scale: jax.Array) -> Any:
    """Multiplies inexact leaves by `scale` in float32 (never in float16, where 2**16 is inf).

    16-bit float leaves come back float32; float32/float64/complex leaves keep their dtype.
    """

    def mul(x):
        if is_inexact_array(x):
            wide = wide_dtype(x.dtype)
            return x.astype(wide) * jnp.asarray(scale, jnp.float32).astype(wide)
        return x

    return jax.tree_util.tree_map(mul, tree)


def _reciprocal_quotient(scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(e, q, r)`` for a float32 `scale` = m * 2**(e - 150) (m its 24-bit significand, e its
    biased exponent): q = floor(2**48 / m) and r the remainder, by long division in 8-bit steps
    (uint32: r < m < 2**24, so r * 2**8 fits). Integer division is exact on every backend;
    a float division is not (XLA:GPU divides float32 with PTX div.full, up to 2 ulps off)."""
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    e = (bits >> 23) & np.uint32(0xFF)
    m = (bits & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    q, r = jnp.zeros_like(m), jnp.ones_like(m)
    for _ in range(6):
        r = r << np.uint32(8)
        digit = r // m
        r = r - digit * m
        q = (q << np.uint32(8)) | digit
    return e, q, r


def _round_shift(q: jax.Array, r: jax.Array, k: jax.Array) -> jax.Array:
    """(q + r/m) / 2**k rounded to the nearest integer, ties to even (k >= 1; r the remainder)."""
    one = np.uint32(1)
    kept = q >> k
    guard = (q >> (k - one)) & one
    sticky = ((q & ((one << (k - one)) - one)) != 0) | (r != 0)
    return kept + (guard & (sticky.astype(jnp.uint32) | (kept & one)))


def _divide_by_integers(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 ``a / b`` correctly rounded (to nearest, ties to even) from the operands' bits:
    the significands' quotient by integer long division (exact on every backend). Where an
    operand is zero, subnormal, inf or NaN, or the quotient is subnormal, the float division."""
    one, mask = np.uint32(1), np.uint32(0x7FFFFF)
    bits_a = jax.lax.bitcast_convert_type(a, jnp.uint32)
    bits_b = jax.lax.bitcast_convert_type(b, jnp.uint32)
    ea = ((bits_a >> 23) & np.uint32(0xFF)).astype(jnp.int32)
    eb = ((bits_b >> 23) & np.uint32(0xFF)).astype(jnp.int32)
    ma = (bits_a & mask) | np.uint32(0x800000)
    mb = (bits_b & mask) | np.uint32(0x800000)
    # q = floor(ma * 2**25 / mb), in (2**24, 2**26): three 8-bit steps and one 1-bit step; the
    # remainder stays below mb < 2**24, so each shifted remainder fits in uint32.
    q, r = jnp.zeros_like(ma), ma
    for step in (8, 8, 8, 1):
        r = r << np.uint32(step)
        digit = r // mb
        r = r - digit * mb
        q = q * np.uint32(1 << step) + digit
    wide = q >= np.uint32(2**25)
    k = jnp.where(wide, np.uint32(2), one)
    significand = _round_shift(q, r, k)  # in [2**23, 2**24]; 2**24 carries into the exponent
    exponent = ea - eb + 125 + k.astype(jnp.int32)
    magnitude = (exponent.astype(jnp.uint32) << np.uint32(23)) + (significand - np.uint32(2**23))
    sign = (bits_a ^ bits_b) & np.uint32(0x80000000)
    quotient = jax.lax.bitcast_convert_type(magnitude | sign, jnp.float32)
    simple = (ea >= 1) & (ea <= 254) & (eb >= 1) & (eb <= 254)
    simple = simple & (exponent >= 1) & (exponent <= 254)
    return jnp.where(simple, quotient, a / b)


@eager_as_one_program
def divide(a: Any, b: Any) -> jax.Array:
    """float32 ``a / b`` correctly rounded, as torch divides, on every backend.

    XLA rewrites a division by a broadcast scalar (a constant or not) into a multiplication by
    its rounded reciprocal, which differs from IEEE division in the last bit for about a third of
    the quotients (XLA:CPU), and XLA:GPU divides float32 with PTX div.full (up to 2 ulps off).
    On CPU the divisor is broadcast to the quotient's shape behind an optimization barrier, so
    the division stays an IEEE division; elsewhere the quotient is computed from the operands'
    bits (`_divide_by_integers`). The form is chosen when the program is lowered."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jax.lax.optimization_barrier(jnp.broadcast_to(b, shape))
    if not shape:
        return _divide_by_integers(a, b)  # a scalar: the integer form costs nothing
    return jax.lax.platform_dependent(a, b, cpu=lambda a, b: a / b, default=_divide_by_integers)


@eager_as_one_program
def reciprocal_factors(loss_scale: Any) -> tuple[jax.Array, jax.Array]:
    """`(inv, post)` with torch's unscaling `x * float32(1/scale)` equal to `(x * inv) * post`.

    torch computes 1/scale in float64 and rounds it to float32 (for a float32 division that is
    the same number: float64 has more than 2*24+2 bits): 1/scale correctly rounded. Above 2**126
    that reciprocal is a float32 subnormal, which XLA flushes to zero on CPU and TPU, so
    unscaling would return zeros. There `inv` is the subnormal's significand times 2**64 (a
    normal number, rounded exactly as torch rounds into the subnormal range) and `post` is
    2**-64, so every result torch gets as a normal float32 comes out bit-identical. Elsewhere
    `post` is 1. Scales that are not positive normal floats (0, subnormal, NaN) divide as floats.

    The form is chosen when the program is lowered (`lax.platform_dependent`), both giving the
    same bits for every float32 scale: on CPU, whose float32 division is IEEE (correctly
    rounded), 1/scale is a float division and the subnormal's significand is rounded from a
    float quotient, checked against its integer remainder (`_subnormal_reciprocal`); elsewhere
    (XLA:GPU divides float32 with PTX div.full, up to 2 ulps off) both come from the scale's
    bits by integer long division (`_reciprocal_quotient`), a program about twice as long to
    compile.
    """
    scale = jnp.asarray(loss_scale, jnp.float32)
    big = scale > jnp.float32(2.0**126)
    inv = jax.lax.platform_dependent(
        scale, cpu=_reciprocal_by_division, default=_reciprocal_by_integers
    )
    post = jnp.where(big, jnp.float32(2.0**-64), jnp.float32(1.0))
    # With a compile-time constant scale both factors are constants, and XLA would fold
    # ``(x * inv) * post`` into ``x * (inv * post)``: the subnormal this split avoids, flushed
    # to 0. The barrier hides their values from the simplifier; the multiplies still fuse.
    return jax.lax.optimization_barrier((inv, post))


def _reciprocal_by_integers(scale: jax.Array) -> jax.Array:
    """`reciprocal_factors`' `inv` from the scale's bits by integer long division (exact on every
    backend)."""
    e, q, r = _reciprocal_quotient(scale)
    big = scale > jnp.float32(2.0**126)
    # Normal result: 1/scale = 2**(126 - e) * (q / 2**24), significand rounded from q's 25 bits.
    significand = _round_shift(q, r, np.uint32(1))  # in [2**23, 2**24]; 2**24 carries
    normal_bits = ((np.uint32(253) - e) << np.uint32(23)) + (significand - np.uint32(2**23))
    normal_inv = jax.lax.bitcast_convert_type(normal_bits, jnp.float32)
    positive_normal = (e >= 1) & (e <= 253) & (scale > 0)
    normal_inv = jnp.where(
        positive_normal, normal_inv, jnp.float32(1.0) / jnp.where(big, jnp.float32(1.0), scale)
    )
    # Subnormal result (e 253 or 254): torch's value is RN(2**149 / scale) * 2**-149, and
    # 2**149 / scale = (2**48 / m) / 2**(e - 251).
    subnormal = _round_shift(q, r, jnp.clip(e, 252, 254) - np.uint32(251))
    return jnp.where(big, subnormal.astype(jnp.float32) * jnp.float32(2.0**-85), normal_inv)


def _reciprocal_by_division(scale: jax.Array) -> jax.Array:
    """`reciprocal_factors`' `inv` with float32 divisions, for a backend whose division is IEEE
    (XLA:CPU): below 2**126 it is 1/scale; above, `_subnormal_reciprocal`.

    The result is divided by a 1.0 the compiler cannot see (exact: IEEE division by 1): XLA's
    fusion copies a chain of cheap scalar operations into every fusion that reads it, but
    never a division, so every consumer reads one computed reciprocal. Without it the
    subnormal form's 30-odd operations were copied into about two fusions per gradient leaf,
    each compiled again (BENCHMARKS.md, "Loss scaling: what XLA:CPU compiles")."""
    big = scale > jnp.float32(2.0**126)
    normal_inv = jnp.float32(1.0) / jnp.where(big, jnp.float32(1.0), scale)
    inv = jnp.where(big, _subnormal_reciprocal(scale), normal_inv)
    return inv / jax.lax.optimization_barrier(jnp.ones_like(inv))


def _subnormal_reciprocal(scale: jax.Array) -> jax.Array:
    """RN(2**149 / scale) * 2**-85 for a scale in (2**126, inf] (inf read as 2**127, as the
    integer form reads it), with one float division and one integer check.

    2**149 / scale = 2**(299 - e) / m (e the biased exponent, m the 24-bit significand) lies in
    (2**21, 2**23]: its float32 quotient `x` has 1 or 2 bits below the units. Rounding `x` to
    the nearest integer is rounding twice, which differs from rounding 2**149 / scale once only
    where `x` is exactly halfway between two integers (the quotient itself never is: m is not a
    power of two there). Then the exact remainder 2**(300 - e) - (2n + 1) * m decides; it is
    below 2**24 in magnitude and 2**(300 - e) is 0 modulo 2**32, so uint32 products (which wrap)
    give it exactly."""
    scale = jnp.where(scale == jnp.inf, jnp.float32(2.0**127), scale)
    x = (jnp.float32(2.0**100) / scale) * jnp.float32(2.0**49)  # exact scaling of a normal
    n = jnp.floor(x)
    halfway = (x - n) == jnp.float32(0.5)
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    m = (bits & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    odd = n.astype(jnp.uint32) * np.uint32(2) + np.uint32(1)
    remainder = jax.lax.bitcast_convert_type(np.uint32(0) - odd * m, jnp.int32)
    rounded = jnp.where(halfway, n + (remainder > 0).astype(jnp.float32), jnp.round(x))
    return rounded * jnp.float32(2.0**-85)


def unscaler(loss_scale: Any) -> Any:
    """The function that multiplies a tree's inexact leaves by torch's float32(1/scale).

    The reciprocal (`reciprocal_factors`) is computed here, once: every tree the function
    unscales in a step (each leaf's finiteness check, then the gradients themselves) reads the
    same two scalars, so the program holds one reciprocal, not one per call. Each leaf keeps its
    dtype; the product is computed in float32 (float64/complex in their own dtype) and rounded
    once to the leaf's dtype. Exact for every float32 scale, 2**127 and float32 max included,
    on backends that flush subnormals.
    """
    inv, post = reciprocal_factors(loss_scale)

    def mul(x):
        return _unscale_leaf(x, inv, post) if is_inexact_array(x) else x

    return lambda tree: jax.tree_util.tree_map(mul, tree)


@eager_as_one_program
def _unscale_leaf(x: jax.Array, inv: jax.Array, post: jax.Array) -> jax.Array:
    """`unscaler`'s product for one inexact leaf, rounded once to its dtype."""
    wide = wide_dtype(x.dtype)
    if jnp.issubdtype(wide, jnp.complexfloating):
        real_dtype = jnp.real(jnp.zeros((), wide)).dtype
        i, p = inv.astype(real_dtype), post.astype(real_dtype)
        return jax.lax.complex((x.real * i) * p, (x.imag * i) * p).astype(x.dtype)
    return ((x.astype(wide) * inv.astype(wide)) * post.astype(wide)).astype(x.dtype)


def unscale_tree(tree: Any, loss_scale: Any) -> Any:
    """`tree`'s inexact leaves multiplied by torch's float32(1/scale) (see `unscaler`)."""
    return unscaler(loss_scale)(tree)


def mul_like_torch(scale: jax.Array, factor: float) -> jax.Array:
    """float32(scale * factor) for a Python (float64) `factor`, as torch's scale update.

    Exact for power-of-two factors (every preset). For others the factor is split into float32
    hi + lo parts: within one float32 ulp of torch's float64 product, see the README.
    """
    hi = np.float32(factor)
    lo = np.float32(factor - float(hi))
    product = scale * hi
    if lo != 0:
        product = product + scale * lo
    return product


# --- skipping ------------------------------------------------------------------------------------


def branch_or_select(*args: Any, branch: Any, select: Any) -> Any:
    """``branch(*args)`` on XLA:CPU and TPU, ``select(*args)`` on GPU, chosen when the program
    is lowered for its platform (`lax.platform_dependent`: a program lowered for GPU on a CPU
    machine, ``jit(f).trace(...).lower(lowering_platforms=("cuda",))``, is GPU's, and the
    compiler sees one form only).

    `branch` holds a `lax.cond`: on CPU and TPU the predicate stays on the device, so a
    branch runs only the side taken. XLA:GPU reads a conditional's predicate on the host, a
    device-to-host copy and a wait on every step: there `select` computes both sides and
    selects, with no conditional in the program. Both return the same types."""
    return jax.lax.platform_dependent(*args, cpu=branch, tpu=branch, default=select)


def full_like_shapes(shapes: Any, value: Any) -> Any:
    """Arrays filled with `value` for a tree of `jax.ShapeDtypeStruct`, usable as a `lax.cond`
    branch inside `shard_map` (both branches must vary over the same axes)."""

    def full(shape: jax.ShapeDtypeStruct) -> jax.Array:
        out = jnp.full(shape.shape, value, shape.dtype)
        manual = getattr(shape, "manual_axis_type", None)
        varying = tuple(sorted(getattr(manual, "varying", ()) or ()))
        return jax.lax.pcast(out, varying, to="varying") if varying else out

    return jax.tree_util.tree_map(full, shapes)


def identity_updates(shapes: Any) -> Any:
    """-0.0 updates for a tree of `jax.ShapeDtypeStruct` (see `full_like_shapes`).

    -0.0, not +0.0: `p + 0.0` turns a parameter of -0.0 into +0.0, while `p + (-0.0)` is `p`
    for every normal p (subnormals are flushed by any arithmetic on CPU/TPU: `select_tree`
    keeps them).
    """
    return full_like_shapes(shapes, -0.0)


def skip_updates(applied: Any, updates: Any) -> Any:
    """`updates` where `applied`, else -0.0 (the identity update); `applied` a bool or a tree
    of scalar bools shaped like `updates`."""
    if isinstance(applied, jax.Array) or isinstance(applied, (bool, np.bool_)):
        return jax.tree_util.tree_map(
            lambda u: jnp.where(applied, u, jnp.asarray(-0.0, jnp.result_type(u))), updates
        )
    return jax.tree_util.tree_map(
        lambda a, u: jnp.where(a, u, jnp.asarray(-0.0, jnp.result_type(u))), applied, updates
    )


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """`optax.tree_utils.tree_where`: a select, so the kept values stay bit for bit (no
    arithmetic on them: subnormals, -0.0 and NaN payloads survive)."""
    return optax.tree_utils.tree_where(pred, on_true, on_false)


def select_leaves(applied: Any, new: Any, old: Any) -> Any:
    """Per leaf: `new` where that leaf's scalar `applied` is true, else `old` (a select: kept bit
    for bit); `applied` a tree of scalar bools shaped like `new`."""
    return jax.tree_util.tree_map(lambda a, n, o: jnp.where(a, n, o), applied, new, old)


def count_if(pred: jax.Array, count: jax.Array) -> jax.Array:
    """`count + 1` where `pred` (saturating at the dtype's max: `optax.safe_increment`), else
    `count` unchanged."""
    return jnp.where(pred, optax.safe_increment(count), count)


def fresh_buffers(tree: Any) -> Any:
    """`tree` with every `jax.Array` leaf copied into a buffer of its own (other leaves as they
    are). An `init` that hands out arrays it holds (a loss scale, a PRNG key) returns them
    through this: a jitted step that donates one state (``donate_argnums``) deletes its
    buffers, and the next `init` must not hand those back."""
    return jax.tree_util.tree_map(
        lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree
    )


# --- tracing a Python call over its array leaves -------------------------------------------------


def is_array(x: Any) -> bool:
    """Whether `x` is an array leaf (JAX, NumPy, a NumPy scalar or a tracer)."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.core.Tracer)


def over_array_leaves(fn, args: tuple, kwargs: dict, is_leaf_array=is_array):
    """`fn(*args, **kwargs)` as a function of its array leaves alone, and those leaves.

    Python scalars, strings and flags stay static, as they would be for a Python call; trace
    the returned function with the returned leaves (`jax.make_jaxpr(flat_fn)(*leaves)`). Used by
    autocast, `reduce_in` and fp8's convert.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if is_leaf_array(x)]

    def flat_fn(*dyn):
        full = list(leaves)
        for i, x in zip(dynamic, dyn, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*a, **k)

    return flat_fn, [leaves[i] for i in dynamic]
