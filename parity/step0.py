"""Step-0 verdicts: do the two models agree before any training?

On one batch, from the same weights, both frameworks compute

- the eval-mode logits, the train-mode logits and loss, and the running statistics a train-mode
  forward pass leaves behind (BatchNorm);
- the gradient of the loss with respect to every parameter (mapped into the Flax layout by the
  pair's weight mapping, so the k-th number of a torch gradient meets the k-th number of the
  matching Flax gradient);

first in float32 at the highest matmul precision on both sides
(``torch.set_float32_matmul_precision("highest")``, ``jax.default_matmul_precision("highest")``),
then at the run's precision (autocast / bf16-true casting, exactly as the trainers do). At the
run's precision it also measures which dtype the matmul and convolution FLOPs ran in on each side
(the compute-dtype verdict: a bf16 run whose matmuls ran in float32 fails and says so). For the
fp8 precisions (whose policy is fp32 outside the converted linear layers) the run-precision rows
are `parity.fp8.step0_fp8`'s instead: every converted layer's scales and fp8 codes of input,
weight and output gradient, torchao against jaxamp.fp8.

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

A failure names the worst parameter and the worst output, and (``diagnose=True``) the per-layer
diagnosis of `parity.diagnose` names the first layer whose error exceeds its band.

Example::

    from parity.models import get_model_pair
    from parity.step0 import check_step0

    result = check_step0(get_model_pair("resnet"), "bf16-mixed")
    print(result.passed, result.summary())
    for verdict in result.verdicts:
        print(verdict.check, verdict.value, verdict.tolerance, verdict.passed)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from parity.compare import Verdict
from parity.config import RunConfig
from parity.fp8 import is_fp8

__all__ = [
    "SAFETY",
    "Step0Failure",
    "Step0Result",
    "check_step0",
    "gradient_tolerance",
    "program_shape",
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
      8.15e-05
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


def relative_error(got: Any, expected: Any, floor: float = 0.0) -> float:
    """Normwise relative error ``||got - expected||_2 / max(||expected||_2, floor * sqrt(size))``
    in float64; inf on a shape mismatch or where the two sides are non-finite in different places.

    ``floor`` is a per-element scale below which values count as zero (cancellation noise).

    Example:
      >>> relative_error(np.array([3.0, 4.0]), np.array([3.0, 4.5]))  # 0.5 / 6.02
      0.0830...
    """
    a = np.asarray(got, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(finite_a, finite_b):
        return math.inf
    bad = ~finite_b
    if bad.any() and not np.array_equal(a[bad], b[bad], equal_nan=True):
        return math.inf
    a, b = a[finite_b], b[finite_b]
    if a.size == 0:
        return 0.0
    diff = float(np.linalg.norm(a - b))
    if diff == 0.0:
        return 0.0
    scale = max(float(np.linalg.norm(b)), floor * math.sqrt(b.size))
    return diff / scale if scale > 0 else math.inf


def program_shape(closed_jaxpr: Any) -> tuple[int, int]:
    """``(fan_in, depth)`` of a JAX program: the longest contraction of any ``dot_general`` /
    ``conv_general_dilated`` and how many there are (sub-jaxprs entered; a scan body counts
    ``length`` times).

    Example:
      >>> program_shape(jax.make_jaxpr(lambda x: (x @ x) @ x)(jnp.ones((3, 3))))
      (3, 2)
    """
    from parity.dtype_trace import _sub_jaxprs

    fan_in, depth = 1, 0

    def visit(jaxpr: Any, times: int) -> None:
        nonlocal fan_in, depth
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                lhs = eqn.invars[0].aval
                (contract, _), _ = eqn.params["dimension_numbers"]
                fan_in = max(fan_in, int(math.prod(lhs.shape[a] for a in contract)))
                depth += times
                continue
            if name == "conv_general_dilated":
                rhs = eqn.invars[1].aval
                spec = eqn.params["dimension_numbers"].rhs_spec
                fan_in = max(fan_in, int(math.prod(rhs.shape)) // int(rhs.shape[spec[0]]))
                depth += times
                continue
            inner = times * int(eqn.params.get("length", 1)) if name == "scan" else times
            for value in eqn.params.values():
                for sub in _sub_jaxprs(value):
                    visit(sub, inner)

    visit(closed_jaxpr.jaxpr, 1)
    return fan_in, max(depth, 1)


class Step0Failure(RuntimeError):
    """Raised by the run flow when the step-0 checks fail: training would compare a broken port.

    Attributes:
      result: the `Step0Result` (verdicts, worst parameter and output, diagnosis).
    """

    def __init__(self, result: Step0Result):
        super().__init__(result.summary())
        self.result = result


@dataclasses.dataclass
class Step0Result:
    """What `check_step0` returns.

    Attributes:
      verdicts: `parity.compare.Verdict` rows (check names start with ``"step 0"``).
      passed: no verdict failed.
      worst_output: ``(name, relative error)`` of the worst output of the first failing (or
        else the fp32) stage.
      worst_parameter: ``(name, relative error)`` of the worst gradient, likewise.
      compute_flops: ``{"torch": {dtype: FLOPs}, "jax": {...}}`` at the run's precision.
      diagnosis: the `parity.diagnose.Diagnosis` made when a check failed (None otherwise).
      diagnosis_error: why the diagnosis could not be made, if it could not.
    """

    verdicts: list[Verdict]
    passed: bool
    worst_output: tuple[str, float] | None = None
    worst_parameter: tuple[str, float] | None = None
    compute_flops: dict[str, dict[str, int]] | None = None
    diagnosis: Any = None
    diagnosis_error: str | None = None

    def summary(self) -> str:
        """One line: pass, or the failed checks with their worst output/parameter, and the first
        diverging layer."""
        failed = [v for v in self.verdicts if v.passed is False]
        if not failed:
            return "step 0: all checks pass"
        parts = [
            f"{v.check}: {v.value_text} > {v.tolerance_text} ({v.detail.split(';')[0]})"
            for v in failed
        ]
        head = "step 0 FAILED"
        if self.diagnosis is not None and getattr(self.diagnosis, "first_failing", None):
            head = f"{head} ({self.diagnosis.summary()})"
        return f"{head}: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (for run records and reports)."""
        return {
            "passed": self.passed,
            "summary": self.summary(),
            "verdicts": [v.to_dict() for v in self.verdicts],
            "worst_output": list(self.worst_output) if self.worst_output else None,
            "worst_parameter": list(self.worst_parameter) if self.worst_parameter else None,
            "compute_flops": self.compute_flops,
            "diagnosis": self.diagnosis.to_dict() if self.diagnosis is not None else None,
            "diagnosis_error": self.diagnosis_error,
        }


# --- the two sides ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Side:
    eval_logits: np.ndarray
    train_logits: np.ndarray
    loss: float
    grads: dict[str, np.ndarray]  # "/"-joined Flax param path -> gradient (Flax layout)
    stats: dict[str, np.ndarray]  # "/"-joined Flax batch_stats path -> value after train forward
    flops: dict[str, int] | None = None


def flatten(tree: Any) -> dict[str, np.ndarray]:
    """``{"a/b/c": float32 numpy}`` for a nested dict of arrays."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        out[key] = np.asarray(leaf).astype(np.float32)  # host-side: no device op per leaf
    return out


def _mapping(pair: Any) -> Any:
    mapping = getattr(pair, "mapping", None)
    return mapping if mapping is not None and hasattr(mapping, "grads_to_flax") else None


def torch_grads_to_flax(pair: Any, model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The gradients of ``model`` (after ``backward``) in the Flax layout, flattened by path.

    With the pair's `WeightMapping` this is ``mapping.grads_to_flax``; without one, the pair's
    weight transfer is applied to a copy of the model whose parameters hold their gradients
    (layout transforms are linear, so they carry gradients like weights).
    """
    named = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu()
        for name, p in model.named_parameters()
    }
    mapping = _mapping(pair)
    if mapping is not None:
        tree = mapping.grads_to_flax(named)
        tree = tree.get("params", tree) if isinstance(tree, dict) else tree
        return flatten(tree)
    holder = copy.deepcopy(model).float().cpu()
    with torch.no_grad():
        for name, p in holder.named_parameters():
            p.copy_(named[name])
    return flatten(pair.to_flax(holder)["params"])


def torch_device(config: RunConfig) -> str:
    """torch's device type for the run (``"cuda"`` for ``device="gpu"``)."""
    return "cuda" if config.device == "gpu" else "cpu"


def jax_device(config: RunConfig) -> Any:
    """The JAX device of the run (``"gpu"``: the first GPU, else the first CPU)."""
    return jax.devices("gpu" if config.device == "gpu" else "cpu")[0]


def torch_setup(pair: Any, inputs: Any, config: RunConfig):
    """``(model copy, input tensor, autocast dtype or None)`` as `parity.train_torch` sets them up
    for the run's policy and device (a low param dtype casts the model and the inputs:
    bf16-true)."""
    device = torch_device(config)
    model = copy.deepcopy(pair.torch_model).float().to(device)
    x = torch.from_numpy(np.ascontiguousarray(inputs)).to(device)
    if config.param_dtype != "float32":
        low = getattr(torch, config.param_dtype)
        model = model.to(low)
        x = x.to(low) if x.is_floating_point() else x
    return model, x, (getattr(torch, config.compute_dtype) if config.mixed else None)


def model_off_host(model: torch.nn.Module, config: RunConfig) -> bool:
    """Whether the transfer needs a float32 CPU copy (bf16-true, or a CUDA model)."""
    return config.param_dtype != "float32" or torch_device(config) != "cpu"


def _torch_side(pair, inputs, targets, config, loss_scale, trace_flops) -> _Side:
    from parity.dtype_trace import torch_matmul_flops
    from parity.models import loss_torch

    model, x, autocast_dtype = torch_setup(pair, inputs, config)
    y = torch.from_numpy(np.ascontiguousarray(targets)).to(x.device)

    def autocast():
        return torch.autocast(
            torch_device(config),
            dtype=autocast_dtype or torch.bfloat16,
            enabled=bool(autocast_dtype),
        )

    with torch.no_grad(), autocast():
        eval_logits = pair.torch_forward(model, x, train=False).float().cpu().numpy().copy()
    out: dict[str, Any] = {}

    def train_step():
        model.zero_grad(set_to_none=True)
        with autocast():
            logits = pair.torch_forward(model, x, train=True)
            loss = loss_torch(pair.task, logits, y)
        (loss * loss_scale).backward()
        out["logits"], out["loss"] = logits.detach().float().cpu().numpy().copy(), loss.item()

    flops = torch_matmul_flops(train_step) if trace_flops else (train_step() or None)
    if loss_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(loss_scale)
    # The transfer reads float32 weights (a bf16-true model is copied up first).
    stats_model = copy.deepcopy(model).float().cpu() if model_off_host(model, config) else model
    stats = flatten(pair.to_flax(stats_model).get("batch_stats", {}))
    return _Side(
        eval_logits, out["logits"], out["loss"], torch_grads_to_flax(pair, model), stats, flops
    )


def _jax_forward(pair, config: RunConfig) -> Callable:
    """``forward(params, batch_stats, inputs, train) -> (logits, new_stats)`` at the run's
    precision, as `parity.train_jax` runs it."""
    from parity.train_jax import autocast_available, autocast_forward

    def forward(params, batch_stats, inputs, train):
        variables = {"params": params}
        if batch_stats is not None:
            variables["batch_stats"] = batch_stats
        return pair.flax_apply(variables, inputs, train=train)

    if config.mixed and not autocast_available():
        policy = config.policy
        inner = forward

        def forward(params, batch_stats, inputs, train):
            return inner(
                policy.cast_to_compute(params), batch_stats, policy.cast_to_compute(inputs), train
            )

        return forward
    wrapped = autocast_forward(
        lambda params, batch_stats, inputs, *, train: forward(params, batch_stats, inputs, train),
        config,
    )
    return lambda params, batch_stats, inputs, train: wrapped(
        params, batch_stats, inputs, train=train
    )


def _jax_side(pair, variables, inputs, targets, config, loss_scale, trace_flops):
    import jaxamp
    from parity.dtype_trace import jax_matmul_flops
    from parity.models import loss_jax

    low = jnp.dtype(config.param_dtype) if config.param_dtype != "float32" else None
    forward = _jax_forward(pair, config)

    def train_grads(params, batch_stats, x, y):
        if low is not None:  # bf16-true: params, statistics and inputs in low precision
            params = jaxamp.cast_floating(params, low)
            batch_stats = jaxamp.cast_floating(batch_stats, low)
            x = x.astype(low) if jnp.issubdtype(x.dtype, jnp.floating) else x

        def loss_fn(params):
            logits, new_stats = forward(params, batch_stats, x, True)
            loss = loss_jax(pair.task, logits.astype(jnp.float32), y)
            return loss * jnp.float32(loss_scale), (loss, logits, new_stats)

        grads, aux = jax.grad(loss_fn, has_aux=True)(params)
        return grads, aux, (params, batch_stats, x)

    def run(params, batch_stats, x, y):
        grads, (loss, logits, new_stats), (params, batch_stats, x) = train_grads(
            params, batch_stats, x, y
        )
        eval_logits, _ = forward(params, batch_stats, x, False)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / jnp.float32(loss_scale), grads)
        as32 = functools.partial(jax.tree.map, lambda v: v.astype(jnp.float32))
        return as32(eval_logits), loss, as32(logits), as32(new_stats), grads

    args = (
        variables["params"],
        variables.get("batch_stats"),
        np.asarray(inputs),
        np.asarray(targets),
    )
    with jax.default_matmul_precision("highest"), jax.default_device(jax_device(config)):
        eval_logits, loss, logits, new_stats, grads = jax.device_get(jax.jit(run)(*args))
        flops = jax_matmul_flops(jax.make_jaxpr(train_grads)(*args)) if trace_flops else None
    return _Side(
        np.asarray(eval_logits),
        np.asarray(logits),
        float(loss),
        flatten(grads),
        flatten(new_stats if new_stats is not None else {}),
        flops,
    )


# --- verdicts -----------------------------------------------------------------------------------


def _worst(errors: dict[str, float]) -> tuple[str, float] | None:
    if not errors:
        return None
    name = max(errors, key=lambda k: errors[k])
    return name, errors[name]


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


def _group_errors(
    jax_tensors: dict[str, np.ndarray], torch_tensors: dict[str, np.ndarray]
) -> tuple[dict[str, float], list[str]]:
    """Per-tensor errors of a group (`group_error`); and the names present on one side only."""
    missing = sorted(set(jax_tensors) ^ set(torch_tensors))
    scale = group_scale(torch_tensors)
    common = [k for k in torch_tensors if k in jax_tensors]
    return {k: group_error(jax_tensors[k], torch_tensors[k], scale) for k in common}, missing


def _torch_name(pair: Any, flax_key: str) -> str:
    """``"flax/path (torch name)"`` when the mapping knows the torch parameter."""
    mapping = _mapping(pair)
    if mapping is None:
        return flax_key
    for entry in getattr(mapping, "entries", ()):
        path = tuple(entry.flax_path)
        if path and path[0] in ("params", "batch_stats"):
            path = path[1:]
        if "/".join(path) == flax_key:
            return f"{entry.torch_name} (flax {flax_key})"
    return flax_key


def _stage_verdicts(
    pair, config, stage: str, dtype: str, t: _Side, j: _Side, shapes: dict[str, tuple[int, int]]
) -> tuple[list[Verdict], tuple[str, float] | None, tuple[str, float] | None]:
    base = {"model": config.model, "precision": config.precision, "device": config.device}
    compared = "jax vs torch, step 0"
    rows: list[Verdict] = []
    fwd_fan, fwd_depth = shapes["forward"]
    grad_fan, grad_depth = shapes["grad"]
    out_tol = tolerance(dtype, fwd_fan, fwd_depth)
    grad_tol = gradient_tolerance(dtype, grad_fan, grad_depth)
    formula = f"band = {SAFETY:g} x depth x (sqrt(fan-in) x u(float32) + u({dtype}))"

    outputs = {
        "eval logits": relative_error(j.eval_logits, t.eval_logits),
        "train logits": relative_error(j.train_logits, t.train_logits),
        "loss": relative_error(j.loss, t.loss),
    }
    stat_errors, stat_missing = _group_errors(j.stats, t.stats)
    outputs.update({f"running stats {k}": v for k, v in stat_errors.items()})
    if stat_missing:
        outputs.update({f"running stats {k} (only on one side)": math.inf for k in stat_missing})
    worst_output = _worst(outputs)
    for check, keys in (
        ("eval-mode output", ["eval logits"]),
        ("train-mode output", [k for k in outputs if k != "eval logits"]),
    ):
        errs = {k: outputs[k] for k in keys}
        name, value = _worst(errs)
        rows.append(
            Verdict(
                check=f"step 0 {stage}: {check}",
                compared=compared,
                value=value,
                tolerance=out_tol,
                passed=bool(value <= out_tol),
                detail=f"worst: {name} (||jax - torch|| / ||torch||); fan-in {fwd_fan}, depth "
                f"{fwd_depth}; {formula}",
                **base,
            )
        )
    grad_errors, grad_missing = _group_errors(j.grads, t.grads)
    for k in grad_missing:
        grad_errors[k] = math.inf
    worst_param = _worst(grad_errors)
    if worst_param is not None:
        name, value = worst_param
        rows.append(
            Verdict(
                check=f"step 0 {stage}: gradients",
                compared=compared,
                value=value,
                tolerance=grad_tol,
                passed=bool(value <= grad_tol),
                detail=f"worst parameter: {_torch_name(pair, name)} of {len(grad_errors)}"
                + (f"; missing on one side: {grad_missing}" if grad_missing else "")
                + f"; fan-in {grad_fan}, depth {grad_depth}; {formula}"
                + (
                    f", x {LOW_PRECISION_GRADIENT_FACTOR:g} for gradients below float32"
                    if grad_tol != tolerance(dtype, grad_fan, grad_depth)
                    else ""
                ),
                **base,
            )
        )
        worst_param = (_torch_name(pair, name), value)
    return rows, worst_output, worst_param


def _compute_verdicts(config, t: _Side, j: _Side) -> list[Verdict]:
    from parity.dtype_trace import requested_fraction

    want = config.compute_dtype
    base = {"model": config.model, "precision": config.precision, "device": config.device}
    rows = []
    for framework, flops in (("torch", t.flops), ("jax", j.flops)):
        fraction = requested_fraction(flops or {}, want)
        total = sum((flops or {}).values())
        by_dtype = ", ".join(
            f"{d} {n / max(total, 1):.0%}" for d, n in sorted((flops or {}).items())
        )
        if fraction is None:
            rows.append(
                Verdict(
                    check=f"compute dtype ({framework})",
                    compared=f"{framework} step 0 matmul/conv FLOPs",
                    value="no matmul/conv FLOPs",
                    tolerance=f">= {MIN_COMPUTE_FRACTION:.0%} in {want}",
                    passed=None,
                    detail="nothing to judge",
                    **base,
                )
            )
            continue
        passed = fraction >= MIN_COMPUTE_FRACTION
        detail = f"{total / 1e6:.3g} MFLOP forward+backward: {by_dtype}"
        if not passed:
            detail += f"; the run asked for {want} but its matmuls ran mostly in other dtypes"
        rows.append(
            Verdict(
                check=f"compute dtype ({framework})",
                compared=f"{framework} step 0 matmul/conv FLOPs in {want}",
                value=fraction,
                tolerance=MIN_COMPUTE_FRACTION,
                passed=passed,
                detail=detail,
                **base,
            )
        )
    return rows


_FP8_TOLERANCES = {
    "weight": "scales and codes equal",
    "input": "scales within 8 float32 eps, codes within 1 fp8 step",
    "grad_output": "scales within 8 float32 eps, codes within 1 fp8 step of the row's largest",
}


def _fp8_verdicts(pair, config: RunConfig, inputs, targets) -> list[Verdict]:
    """Step-0 rows of an fp8 run: `parity.fp8.step0_fp8` (torchao's scales and fp8 codes against
    jaxamp.fp8's, every converted layer), one row per tensor (input, weight, grad_output).

    The generic run-precision rows would compare two float32 models (an fp8 precision's policy
    is fp32 outside the converted layers, and neither side applies fp8 there), so they say
    nothing about the fp8 recipes. A layer converted on one side only fails the run.
    """
    from parity.fp8 import step0_fp8

    base = {"model": config.model, "precision": config.precision, "device": config.device}
    prefix = f"step 0 {config.precision}"
    try:
        rows = step0_fp8(pair, config.precision, inputs, targets)
    except ValueError as e:  # the two sides convert different layers
        return [
            Verdict(
                check=f"{prefix}: fp8 layers",
                compared="torchao Float8Linear layers vs jaxamp.fp8 matmuls",
                value="mismatch",
                tolerance="same layers",
                passed=False,
                detail=str(e)[:500],
                mode="step 0",
                **base,
            )
        ]
    verdicts = []
    for tensor, tol in _FP8_TOLERANCES.items():
        group = [r for r in rows if r["tensor"] == tensor]
        if not group:
            continue
        failed = [r for r in group if not r["passed"]]
        steps = max(r["max_code_steps"] for r in group)
        rel = max(r["scale_max_rel_diff"] for r in group)
        differing = sum(r["codes_differing"] for r in group)
        total = sum(r["codes"] for r in group)
        detail = (
            f"{len(group)} layers ({', '.join(r['torch_module'] for r in group)}); "
            f"scales max rel diff {rel:.3g}; {differing}/{total} codes differ, "
            f"by at most {steps} fp8 steps"
        )
        if failed:
            detail = (
                "failing layers: "
                + ", ".join(
                    f"{r['torch_module']} (scale rel diff {r['scale_max_rel_diff']:.3g}, "
                    f"{r['codes_differing']}/{r['codes']} codes differ"
                    + (f", {r['detail']}" if r.get("detail") else "")
                    + ")"
                    for r in failed[:3]
                )
                + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
                + "; "
                + detail
            )
        verdicts.append(
            Verdict(
                check=f"{prefix}: fp8 {tensor} scales and codes",
                compared="jaxamp.fp8 vs torchao, every converted layer",
                value=f"{len(failed)}/{len(group)} layers off",
                tolerance=tol,
                passed=not failed,
                detail=detail,
                mode="step 0",
                **base,
            )
        )
    return verdicts


def step0_loss_scale(config: RunConfig) -> float:
    """The first loss scale of the step-0 gradients: 1 unless the run scales its loss (fp16), then
    the run's initial scale capped at torch's default 2**16 (a stress setting such as 2**24 makes
    step 0 overflow on purpose). Without a scale, fp16 gradients underflow. `check_step0` halves
    it (GradScaler's back-off) until torch's gradients are finite and gives JAX the same scale."""
    if not config.loss_scaling:
        return 1.0
    return float(min(config.init_scale, 2.0**16))


def _as_config(pair: Any, precision_or_config: Any) -> RunConfig:
    if isinstance(precision_or_config, RunConfig):
        return precision_or_config
    if isinstance(precision_or_config, str):
        return RunConfig(model=pair.name, precision=precision_or_config)
    raise TypeError(
        "check_step0: `config` must be a RunConfig or a precision string (e.g. 'bf16-mixed'); "
        f"got {type(precision_or_config).__name__}."
    )


def check_step0(
    pair: Any,
    config: RunConfig | str = "fp32",
    batch: tuple[Any, Any] | None = None,
    *,
    variables: dict | None = None,
    diagnose: bool = True,
) -> Step0Result:
    """Step-0 verdicts for a model pair: outputs and gradients, fp32 first, then the run's precision.

    Args:
      pair: a `parity.models.ModelPair` (built-in or user; ``pair.mapping`` is used when present).
      config: a `RunConfig`, or just its precision (``"fp32"``, ``"bf16-mixed"``, ...).
      batch: ``(inputs, targets)`` numpy arrays (default: batch 0 of the pair's data at
        ``config.seed``/``config.batch_size``).
      variables: the Flax variables to start from (default: converted from the torch model).
      diagnose: on a failure, run `parity.diagnose.diagnose_pair` at the failing stage's precision
        and keep its table in the result.

    Returns:
      A `Step0Result`: rows ``step 0 fp32: eval-mode output``, ``... train-mode output`` (logits,
      loss, running statistics), ``... gradients``; the same with ``step 0 <precision>`` for a
      low-precision run, then ``compute dtype (torch)``, ``compute dtype (jax)``. For an fp8
      precision the run-precision rows are ``step 0 <precision>: fp8 {input,weight,grad_output}
      scales and codes`` from `parity.fp8.step0_fp8` (torchao against jaxamp.fp8, every
      converted layer; mode ``"step 0"``) instead.

    Example:
      >>> result = check_step0(get_model_pair("resnet", wrong_port="padding"))
      >>> result.passed, result.diagnosis.first_failing
      (False, 'blocks.1.conv1')
    """
    config = _as_config(pair, config)
    if batch is None:
        batch = pair.make_data(config.seed, config.batch_size).batch(0)
    inputs, targets = (np.asarray(b) for b in batch)
    if variables is None:
        variables = pair.torch_to_flax()
    previous = torch.get_float32_matmul_precision()
    previous_cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False  # convolutions at full float32 too
    try:
        stages = [("fp32", dataclasses.replace(config, precision="fp32"))]
        if config.precision != "fp32":
            stages.append((config.precision, config))
        verdicts: list[Verdict] = []
        worst_output = worst_param = None
        flops = None
        failed_stage = None
        fp8_failed = False
        shapes = _program_shapes(pair, variables, inputs, targets)
        sides: dict[str, tuple[_Side, _Side]] = {}
        for stage, stage_config in stages:
            low = stage_config.precision != "fp32"
            if is_fp8(stage_config.precision):  # fp32 stage passed: compare the fp8 recipes
                verdicts.extend(_fp8_verdicts(pair, stage_config, inputs, targets))
                if any(v.passed is False for v in verdicts):
                    fp8_failed = True
                break
            scale = step0_loss_scale(stage_config)
            t = _torch_side(pair, inputs, targets, stage_config, scale, trace_flops=low)
            while scale > 1 and not all(np.isfinite(g).all() for g in t.grads.values()):
                scale /= 2  # GradScaler's back-off, until torch's step 0 would not be skipped
                t = _torch_side(pair, inputs, targets, stage_config, scale, trace_flops=low)
            j = _jax_side(pair, variables, inputs, targets, stage_config, scale, trace_flops=low)
            sides[stage] = (t, j)
            rows, w_out, w_param = _stage_verdicts(
                pair, config, stage, stage_config.compute_dtype, t, j, shapes
            )
            verdicts.extend(rows)
            if low:
                verdicts.extend(_compute_verdicts(stage_config, t, j))
                flops = {"torch": t.flops or {}, "jax": j.flops or {}}
            stage_failed = any(v.passed is False for v in verdicts)
            if worst_output is None or (stage_failed and failed_stage is None):
                worst_output, worst_param = w_out, w_param
            if stage_failed and failed_stage is None:
                failed_stage = stage_config
                break  # a broken fp32 port makes the low-precision comparison meaningless
        passed = not any(v.passed is False for v in verdicts)
        result = Step0Result(verdicts, passed, worst_output, worst_param, flops)
        # an fp8 failure is already per layer; the float32 diagnosis would not apply fp8
        if not passed and diagnose and not fp8_failed:
            from parity.diagnose import diagnose_pair

            try:
                result.diagnosis = diagnose_pair(
                    pair,
                    failed_stage or config,
                    (inputs, targets),
                    variables=variables,
                    sides=sides,
                    shapes=shapes,
                )
            except Exception as e:  # the verdicts stand without the table
                result.diagnosis_error = f"{type(e).__name__}: {str(e)[:300]}"
        return result
    finally:
        torch.backends.cudnn.allow_tf32 = previous_cudnn_tf32
        torch.set_float32_matmul_precision(previous)


def _program_shapes(pair, variables, inputs, targets) -> dict[str, tuple[int, int]]:
    """(fan-in, depth) of the float32 forward pass and of the gradient computation."""
    from parity.models import loss_jax

    params, stats = variables["params"], variables.get("batch_stats")
    x, y = jnp.asarray(inputs), jnp.asarray(targets)

    def forward(params):
        full = {"params": params} | ({"batch_stats": stats} if stats is not None else {})
        return pair.flax_apply(full, x, train=True)[0]

    fwd_fan, fwd_depth = program_shape(jax.make_jaxpr(forward)(params))
    grad_jaxpr = jax.make_jaxpr(
        jax.grad(lambda p: loss_jax(pair.task, forward(p).astype(jnp.float32), y))
    )(params)
    grad_fan, _ = program_shape(grad_jaxpr)
    return {"forward": (fwd_fan, fwd_depth), "grad": (max(grad_fan, fwd_fan), 2 * fwd_depth)}


# --- the run flow -------------------------------------------------------------------------------


def run_step0(
    config: RunConfig,
    pair: Any,
    stream: Any = None,
    *,
    frameworks: tuple[str, ...] = ("torch", "jax"),
    echo: bool = True,
) -> Step0Result | None:
    """The step-0 gate of a training run (`parity.cli.run_pair`, `parity.compare_models`).

    Runs `check_step0` on the run's first batch when both frameworks are trained (one side alone
    has nothing to compare with: returns None), and prints the one-line summary (and, on a
    failure, the per-layer table) to stderr when `echo`.

    Args:
      config: the run's configuration.
      pair: the model pair.
      stream: the run's `BatchStream` (default: the pair's data at the run's data seed).
      frameworks: the frameworks the run trains.
      echo: print the outcome.

    Returns:
      The `Step0Result`, or None when fewer than two frameworks run. When the checks themselves
      raise (say, torch has no kernel for the dtype on this CPU), a passing result with one
      informational row saying why: the trainers then record the cell's real outcome.

    Example:
      >>> result = run_step0(config, pair)
      >>> if result is not None and not result.passed: runs = blocked_records(config, result)
    """
    import sys

    if set(frameworks) != {"torch", "jax"}:
        return None
    if stream is None:
        seed = getattr(config, "stream_seed", config.seed)
        stream = pair.make_data(seed, config.batch_size)
    try:
        result = check_step0(pair, config, stream.batch(0))
    except Exception as e:  # e.g. no kernel for this dtype here: training reports it, not step 0
        reason = f"{type(e).__name__}: {str(e)[:300]}"
        row = Verdict(
            model=config.model,
            precision=config.precision,
            device=config.device,
            check="step 0",
            compared="jax vs torch, step 0",
            value=f"not run ({reason})",
            tolerance="-",
            passed=None,
            detail="the step-0 checks raised; training goes on and records its own outcome",
        )
        result = Step0Result([row], True)
    if echo:
        print(f"{config.model} {config.precision}: {result.summary()}", file=sys.stderr)
        if result.diagnosis is not None:
            print(result.diagnosis.to_markdown(), file=sys.stderr)
    return result


def blocked_records(
    config: RunConfig, result: Step0Result, frameworks: tuple[str, ...] = ("torch", "jax")
) -> list[dict[str, Any]]:
    """Error records for a run stopped before training by a failed step 0 (``compare`` fails
    them with the step-0 summary: the worst output, parameter and first diverging layer), each
    carrying the full step-0 result under ``"step0"``.

    Example:
      >>> runs = blocked_records(config, result)   # instead of training
    """
    from parity.records import build_error_record

    return attach_step0(
        [build_error_record(fw, config, Step0Failure(result)) for fw in frameworks], result
    )


def attach_step0(runs: list[dict[str, Any]], result: Step0Result | None) -> list[dict[str, Any]]:
    """Stores ``result.to_dict()`` under ``"step0"`` in every run record (None: unchanged)."""
    if result is not None:
        for run in runs:
            run["step0"] = result.to_dict()
    return runs
