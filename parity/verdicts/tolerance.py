"""Step-0 tolerance arithmetic: error measures, bands and the program shapes they scale with.

Error measure: for each tensor the normwise relative error ``||jax - torch||_2 / ||torch||_2``
(`relative_error`). Gradients and running statistics are floored by their group's scale
(`group_error`): a gradient that is zero up to cancellation (a conv bias before BatchNorm) is
measured against the largest gradient, not against its own rounding noise.

Tolerance (:func:`tolerance`)::

    band = SAFETY * depth * (sqrt(fan_in) * u(float32) + u(dtype))

where ``u(d) = eps(d) / 2`` is the unit roundoff. Why: a dot product or convolution of length
``n`` accumulated in a different order (another kernel, another framework) differs by about
``sqrt(n) * u`` relative (the probabilistic rounding bound; both frameworks accumulate in at
least float32 on CPU and GPU); storing the result in ``dtype`` adds up to one rounding ``u(dtype)``
where the two sides round a value near a tie differently. ``depth`` such layers in sequence add
their relative errors (normalised networks have gain ~1). ``fan_in`` is the longest contraction of
any matmul/conv in the computation and ``depth`` the number of matmuls/convs, both read from the
JAX program (``jaxpr``); gradients run the forward and the backward chain, so their depth is twice
the forward one and their fan-in includes the batch-sized contractions of the weight gradients.
``SAFETY`` (8) covers the constant of the bound and the cancellation in BatchNorm's backward pass
(``g - mean(g) - x_hat * mean(g * x_hat)``), which amplifies the rounding of low-precision
gradients: on the resnet pair (batch 4) bf16-mixed step-0 gradients differ by up to 0.23 between
the frameworks against a band of 0.62, its outputs by 0.007 against 0.31. In float32 the band is
~1e-4 for the built-in models, two or more orders of magnitude above what a correct port shows
(~1e-7..1e-6) and far below what a port bug gives (a shifted padding: ~1; a biased running
variance: ~1e-3).

Below float32 the gradient band carries an extra factor (`gradient_tolerance`): BatchNorm's
backward cancellation amplifies low-precision rounding.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from parity.core.losses import loss_jax
from parity.perf.flops import counted_equations, jax_matmul_flops

__all__ = [
    "FLOOR_FRACTION",
    "LOW_PRECISION_GRADIENT_FACTOR",
    "MIN_COMPUTE_FRACTION",
    "SAFETY",
    "examples_within",
    "forward_flops",
    "forward_jaxpr",
    "gradient_tolerance",
    "group_error",
    "group_errors",
    "group_scale",
    "program_shape",
    "program_shapes",
    "relative_error",
    "tolerance",
    "unit_roundoff",
]


SAFETY = 8.0


# Extra factor of the gradient band below float32 (BatchNorm's backward cancellation).
LOW_PRECISION_GRADIENT_FACTOR = 4.0


# Gradients / statistics below this fraction of their group's largest are compared at that floor.
FLOOR_FRACTION = 2.0**-10


# A compute-dtype verdict fails when less than this fraction of the matmul FLOPs ran in the dtype.
MIN_COMPUTE_FRACTION = 0.5


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def unit_roundoff(dtype: Any) -> float:
    """``eps / 2`` of a floating dtype (float32: 6.0e-8, bfloat16: 3.9e-3, float16: 4.9e-4).

    Example:
      >>> unit_roundoff("bfloat16")
      0.00390625
    """
    name = str(jnp.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name not in _DTYPES:
        raise ValueError(f"unit_roundoff: `dtype` must be one of {sorted(_DTYPES)}; got {dtype!r}.")
    return float(jnp.finfo(_DTYPES[name]).eps) / 2


def tolerance(dtype: Any, fan_in: int, depth: int, safety: float = SAFETY) -> float:
    """The step-0 band: ``safety * depth * (sqrt(fan_in) * u(float32) + u(dtype))``.

    Args:
      dtype: the dtype results are stored in (float32 for the fp32 check, the compute dtype at the
        run's precision).
      fan_in: the longest contraction (dot product length) of any matmul/conv.
      depth: the number of matmuls/convs in sequence.
      safety: the constant of the probabilistic bound.

    Returns:
      The relative tolerance.

    Example:
      >>> round(tolerance("float32", fan_in=256, depth=10), 7)
      8.11e-05
    """
    if fan_in < 1 or depth < 1:
        raise ValueError(f"tolerance: `fan_in` and `depth` must be >= 1; got {fan_in}, {depth}.")
    return safety * depth * (math.sqrt(fan_in) * unit_roundoff("float32") + unit_roundoff(dtype))


def gradient_tolerance(dtype: Any, fan_in: int, depth: int) -> float:
    """The gradient band: `tolerance`, times ``LOW_PRECISION_GRADIENT_FACTOR`` below float32.

    BatchNorm's backward pass (``g - mean(g) - x_hat * mean(g * x_hat)``) cancels, and cancellation
    amplifies the low-precision rounding of its inputs: measured at step 0 (batch 4), cnn_bn
    fp16-mixed gradients differ by 0.029 between the frameworks (1.2x the plain band), bf16-mixed
    by 0.098 (0.5x), resnet bf16-mixed by 0.23 (0.4x); float32 gradients stay at ~1e-6.

    Example:
      >>> gradient_tolerance("float32", 256, 10) == tolerance("float32", 256, 10)
      True
    """
    factor = (
        1.0 if unit_roundoff(dtype) <= unit_roundoff("float32") else LOW_PRECISION_GRADIENT_FACTOR
    )
    return factor * tolerance(dtype, fan_in, depth)


def _sum_of_squares(values: np.ndarray) -> float:
    """``sum(values**2)`` in float64 without BLAS: ``np.dot``'s threaded kernel spins its threads
    (measured: 7.8 ms of CPU for 131k values on a loaded 2-core machine, against 0.035 ms)."""
    return float(np.einsum("i,i->", values, values))


def relative_error(got: Any, expected: Any, floor: float = 0.0) -> float:
    """Normwise relative error ``||got - expected||_2 / max(||expected||_2, floor * sqrt(size))``
    in float64; inf on a shape mismatch or where the two sides are non-finite in different places.

    ``floor`` is a per-element scale below which values count as zero (cancellation noise).

    Example:
      >>> relative_error(np.array([3.0, 4.0]), np.array([3.0, 4.5]))  # 0.5 / 5.41
      0.0924...
    """
    a = np.asarray(got, dtype=np.float64).reshape(-1)
    b = np.asarray(expected, dtype=np.float64).reshape(-1)
    if np.shape(got) != np.shape(expected):
        return math.inf
    if a.size:  # the usual case, every value finite, in three passes (non-finite: see below)
        with np.errstate(all="ignore"):  # inf - inf: the careful path below decides
            delta = a - b
            squared, norm_squared = _sum_of_squares(delta), _sum_of_squares(b)
        if math.isfinite(squared) and math.isfinite(norm_squared):
            if squared == 0.0:
                return 0.0
            scale = max(math.sqrt(norm_squared), floor * math.sqrt(b.size))
            return math.sqrt(squared) / scale if scale > 0 else math.inf
    finite_b = np.isfinite(b)
    if not finite_b.all():  # the rare case: compare where each side is non-finite first
        finite_a = np.isfinite(a)
        if not np.array_equal(finite_a, finite_b):
            return math.inf
        bad = ~finite_b
        if not np.array_equal(a[bad], b[bad], equal_nan=True):
            return math.inf
        a, b = a[finite_b], b[finite_b]
    elif not np.isfinite(a).all():
        return math.inf
    if a.size == 0:
        return 0.0
    delta = a - b
    diff = math.sqrt(_sum_of_squares(delta))
    if diff == 0.0:
        return 0.0
    scale = max(math.sqrt(_sum_of_squares(b)), floor * math.sqrt(b.size))
    return diff / scale if scale > 0 else math.inf


def program_shape(closed_jaxpr: Any) -> tuple[int, int]:
    """``(fan_in, depth)`` of a JAX program: the longest contraction of any ``dot_general`` /
    ``conv_general_dilated`` and how many there are (sub-jaxprs entered; a scan body counts
    ``length`` times).

    Example:
      >>> program_shape(jax.make_jaxpr(lambda x: (x @ x) @ x)(jnp.ones((3, 3))))
      (3, 2)
    """
    fan_in, depth = 1, 0
    for eqn, times in counted_equations(closed_jaxpr.jaxpr):
        name = eqn.primitive.name
        if name == "dot_general":
            lhs = eqn.invars[0].aval
            (contract, _), _ = eqn.params["dimension_numbers"]
            fan_in = max(fan_in, int(math.prod(lhs.shape[a] for a in contract)))
            depth += times
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval
            spec = eqn.params["dimension_numbers"].rhs_spec
            fan_in = max(fan_in, int(math.prod(rhs.shape)) // int(rhs.shape[spec[0]]))
            depth += times
    return fan_in, max(depth, 1)


def group_scale(tensors: dict[str, np.ndarray]) -> float:
    """The largest magnitude in a group of tensors (all gradients, or all running statistics)."""
    return max((float(np.max(np.abs(t))) for t in tensors.values() if t.size), default=0.0)


def group_error(got: Any, expected: Any, scale: float) -> float:
    """`relative_error` of one tensor of a group whose largest magnitude is `scale`.

    A tensor whose root-mean-square is below ``FLOOR_FRACTION * scale`` is zero up to
    cancellation (the gradient of a conv bias before BatchNorm: the sum of a BatchNorm backward
    output, exactly zero in exact arithmetic); its error is measured against ``scale``, the scale
    its rounding noise comes from. Other tensors are floored at ``FLOOR_FRACTION * scale``.
    """
    b = np.asarray(expected, dtype=np.float64)
    finite = b[np.isfinite(b)]
    rms = float(np.sqrt(np.mean(np.square(finite)))) if finite.size else 0.0
    floor = scale if rms < FLOOR_FRACTION * scale else FLOOR_FRACTION * scale
    return relative_error(got, expected, floor)


def group_errors(
    jax_tensors: dict[str, np.ndarray], torch_tensors: dict[str, np.ndarray]
) -> tuple[dict[str, float], list[str]]:
    """Per-tensor errors of a group (`group_error`); and the names present on one side only."""
    missing = sorted(set(jax_tensors) ^ set(torch_tensors))
    scale = group_scale(torch_tensors)
    common = [k for k in torch_tensors if k in jax_tensors]
    return {k: group_error(jax_tensors[k], torch_tensors[k], scale) for k in common}, missing


def _forward_jaxpr(pair, variables, x) -> Any:
    """The jaxpr of the float32 train-mode forward pass, a function of the parameters."""
    stats = variables.get("batch_stats")

    def forward(params):
        full = {"params": params} | ({"batch_stats": stats} if stats is not None else {})
        return pair.flax_apply(full, x, train=True)[0]

    return jax.make_jaxpr(forward)(variables["params"])


def forward_flops(pair, variables, inputs) -> int:
    """The matmul and convolution FLOPs of the float32 forward pass on `inputs` (the probe's
    budget: `parity.verdicts.layer_probe.probe_examples`)."""
    return sum(jax_matmul_flops(_forward_jaxpr(pair, variables, jnp.asarray(inputs))).values())


def examples_within(size: int, flops: float, budget: float, least: int, most: int) -> int:
    """How many of a batch's first examples a pass of at most `budget` matmul FLOPs holds, given
    `flops` for the whole batch of `size`: never fewer than `least`, never more than `most` or
    the batch (step 0's comparison and the layer probe are bounded this way).

    Example:
      >>> examples_within(32, 5.4e8, 2**31, 2, 32), examples_within(8, 2.6e10, 2**30, 2, 8)
      (32, 2)
    """
    per_example = flops / max(size, 1)
    fits = int(budget // per_example) if per_example > 0 else most
    return min(size, most, max(least, fits))


def forward_jaxpr(pair, variables, inputs) -> Any:
    """The jaxpr of the float32 train-mode forward pass on `inputs`, a function of the
    parameters (what `program_shapes` and `forward_flops` read; pass it to `program_shapes` to
    read both from one trace)."""
    return _forward_jaxpr(pair, variables, jnp.asarray(inputs))


def program_shapes(pair, variables, inputs, targets, *, forward: Any = None) -> dict[str, Any]:
    """(fan-in, depth) of the float32 forward pass (``"forward"``) and of the gradient
    computation (``"grad"``); and the forward pass's matmul FLOPs (``"forward flops"``).
    `forward`: `forward_jaxpr` of the same pair, variables and inputs, when already traced."""
    params = variables["params"]
    x, y = jnp.asarray(inputs), jnp.asarray(targets)
    forward_jaxpr = _forward_jaxpr(pair, variables, x) if forward is None else forward
    fwd_fan, fwd_depth = program_shape(forward_jaxpr)
    # The gradient differentiates the traced forward program itself: the model's Python (Flax's
    # module machinery) is traced once, not again under jax.grad.
    replay = jax.extend.core.jaxpr_as_fun(forward_jaxpr)

    def loss(leaves):
        return loss_jax(pair.task, replay(*leaves)[0].astype(jnp.float32), y)

    grad_jaxpr = jax.make_jaxpr(jax.grad(loss))(jax.tree_util.tree_leaves(params))
    grad_fan, _ = program_shape(grad_jaxpr)
    return {
        "forward": (fwd_fan, fwd_depth),
        "grad": (max(grad_fan, fwd_fan), 2 * fwd_depth),
        "forward flops": sum(jax_matmul_flops(forward_jaxpr).values()),
    }
