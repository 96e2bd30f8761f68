"""FP8 precisions for the harness: torchao on the torch side, `jaxamp.fp8` on the JAX side.

``fp8-tensorwise``, ``fp8-rowwise`` and ``fp8-rowwise-gw-hp`` are torchao's three float8
training recipes. Everything outside the converted linear layers runs in float32 on both sides
(policy ``fp32``). The torch side swaps ``nn.Linear`` modules for torchao's ``Float8Linear``
(``convert_to_float8_training``; ``emulate=True`` where the device has no fp8 matmuls: CPU, GPUs
before sm89); the JAX side runs the forward pass through ``jaxamp.fp8.convert`` with the same
recipe. Both sides convert the same layers: every linear layer except those under an attention
module, because ``torch.nn.MultiheadAttention`` calls ``F.linear`` on its own weights and never
its ``out_proj.forward`` (torchao's swap would change nothing there).

This module never imports torch at import time (``parity.training.train_jax`` uses it).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp.fp8
from parity.core.losses import loss_jax, loss_torch
from parity.pairs.mapping import apply_transform
from parity.pairs.variables import flatten_variables

# One compiled quantizer per (shape, cast, axis), not one program per primitive run eagerly.
_quantize = jax.jit(jaxamp.fp8.to_fp8_dynamic, static_argnums=(1, 2, 3))

__all__ = [
    "FP8_PRECISIONS",
    "EXCLUDED_MODULES",
    "captured_jax_operands",
    "convert_torch",
    "fp8_method",
    "jax_filter",
    "jax_recipe",
    "recipe_name",
    "step0_fp8",
    "torch_emulate",
    "torch_module_filter",
    "wrap_jax_forward",
]

FP8_PRECISIONS: dict[str, str] = {
    "fp8-tensorwise": "tensorwise",
    "fp8-rowwise": "rowwise",
    "fp8-rowwise-gw-hp": "rowwise_with_gw_hp",
}
# Module names (path components) whose matmuls neither side converts: attention (see the
# docstring) and recurrent cells (torch's nn.LSTM is not an nn.Linear; the Flax twin's gates are).
EXCLUDED_MODULES: tuple[str, ...] = ("attn", "lstm")


def recipe_name(precision: str) -> str:
    """torchao's recipe name for an fp8 precision (``"fp8-rowwise-gw-hp"`` -> ``"rowwise_with_gw_hp"``)."""
    if precision not in FP8_PRECISIONS:
        raise ValueError(
            f"parity.core.fp8: precision {precision!r} is not fp8; fp8 precisions: {tuple(FP8_PRECISIONS)}."
        )
    return FP8_PRECISIONS[precision]


def jax_recipe(precision: str, device: str | None = None) -> jaxamp.fp8.Recipe:
    """The `jaxamp.fp8` recipe: emulated exactly where torch's is (no fp8 matmul hardware).

    `device` is the harness device (``"cpu"`` always emulates, as torch on CPU does; None or
    ``"gpu"``: JAX's default backend decides).
    """
    emulate = device == "cpu" or jaxamp.fp8.fp8_matmul_hardware() is not None
    return jaxamp.fp8.get_recipe(recipe_name(precision), emulate=emulate)


def _excluded(parts: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(p, pattern) for p in parts for pattern in EXCLUDED_MODULES)


def jax_filter(info: jaxamp.fp8.MatmulInfo) -> bool:
    """Linear-layer matmuls outside attention modules (the layers torchao converts and runs)."""
    return info.linear is None and not _excluded(info.path.split("/"))


def torch_module_filter(module: Any, fqn: str) -> bool:
    """torchao ``module_filter_fn``: every ``nn.Linear`` outside attention modules."""
    del module
    return not _excluded(fqn.split("."))


def wrap_jax_forward(forward: Callable, precision: str, device: str | None = None) -> Callable:
    """`forward` with its linear layers in fp8 (``jaxamp.fp8.convert``) for an fp8 precision."""
    return jaxamp.fp8.convert(forward, jax_recipe(precision, device), fp8_filter=jax_filter)


def torch_emulate(device: Any) -> bool:
    """torchao's ``emulate``: True unless `device` is a CUDA GPU with fp8 matmuls (sm89+)."""
    import torch  # torch: optional for JAX users (parity.training.train_jax imports this module)

    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)


def convert_torch(model: Any, precision: str, device: Any) -> list[str]:
    """Swaps `model`'s linear layers for torchao ``Float8Linear`` in place; returns their names."""
    import torch  # torch: optional for JAX users (parity.training.train_jax imports this module)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe_name(precision))
    config = dataclasses.replace(config, emulate=torch_emulate(device))
    before = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    convert_to_float8_training(model, config=config, module_filter_fn=torch_module_filter)
    return sorted(
        n for n, m in model.named_modules() if n in before and type(m).__name__ == "Float8Linear"
    )


def fp8_method(precision: str, framework: str, device: str | None = None) -> str:
    """How a side realises an fp8 precision (logged in the run record)."""
    name = recipe_name(precision)
    if framework == "torch":
        return f"torchao convert_to_float8_training(recipe={name!r}), attention excluded"
    emulate = jax_recipe(precision, device).emulate
    return (
        f"jaxamp.fp8.convert(recipe={name!r}{', emulate=True' if emulate else ''}), "
        "attention excluded"
    )


# --- step 0: per-layer scales and fp8 bit patterns, both frameworks --------------------------------


def _torch_step0(pair: Any, precision: str, inputs: np.ndarray, targets: np.ndarray) -> dict:
    """Per converted layer: torchao's own scales and fp8 codes of input, weight and grad_output."""
    import torch  # torch: optional for JAX users (parity.training.train_jax imports this module)
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    model = copy.deepcopy(pair.torch_model)
    convert_torch(model, precision, "cpu")
    seen: dict[str, dict] = {}

    def cast(t, cc, axis, pow2):
        gran = cc.scaling_granularity
        out = hp_tensor_to_float8_dynamic(
            t.detach(),
            cc.target_dtype,
            LinearMMConfig(),
            scaling_granularity=gran,
            axiswise_dim=axis if gran is ScalingGranularity.AXISWISE else None,
            round_scales_to_power_of_2=pow2,
        )
        scale, codes = out._scale.numpy().copy(), out._data.view(torch.uint8).numpy().copy()
        return scale, codes, t.detach().numpy().copy()

    hooks = []
    for name, mod in model.named_modules():
        if type(mod).__name__ != "Float8Linear":
            continue
        c = mod.config
        pow2 = c.round_scales_to_power_of_2

        def fwd_hook(mod, args, out, name=name, c=c, pow2=pow2):
            x = args[0].reshape(-1, args[0].shape[-1])
            seen.setdefault(name, {})["input"] = cast(x, c.cast_config_input, -1, pow2)
            seen[name]["weight"] = cast(mod.weight.t(), c.cast_config_weight, 0, pow2)

        def bwd_hook(mod, grad_in, grad_out, name=name, c=c, pow2=pow2):
            g = grad_out[0].reshape(-1, grad_out[0].shape[-1])
            seen[name]["grad_output"] = cast(g, c.cast_config_grad_output, -1, pow2)

        hooks.append(mod.register_forward_hook(fwd_hook))
        hooks.append(mod.register_full_backward_hook(bwd_hook))
    try:
        with warnings.catch_warnings():
            # integer token inputs: the hook fires on module outputs only, which is what we read
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            logits = pair.torch_forward(model, torch.from_numpy(np.asarray(inputs)), train=True)
            loss = loss_torch(pair.task, logits, torch.from_numpy(np.asarray(targets)))
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return seen


def captured_jax_operands(
    pair: Any, inputs: np.ndarray, targets: np.ndarray, capture: Callable
) -> dict[str, tuple[str, Any]]:
    """The Flax side's train-mode loss on `inputs` run once through `capture` (jaxamp.fp8's or
    jaxamp.mx's ``capture_operands`` with the recipe and filter bound): per captured matmul, its
    Flax module path and its operands."""
    variables = pair.torch_to_flax()

    def forward(params, x):
        full = dict(variables)
        full["params"] = params
        logits = pair.flax_apply(full, x, train=True)[0]
        return loss_jax(pair.task, logits.astype(jnp.float32), jnp.asarray(targets))

    captured = capture(forward, variables["params"], jnp.asarray(inputs))
    weights = {
        "/".join(path[1:-1]): np.asarray(leaf)
        for path, leaf in flatten_variables({"params": variables["params"]}).items()
    }
    return {
        name: (_module_path(name, np.asarray(ops.weight), weights), ops)
        for name, ops in captured.items()
    }


def _jax_step0(pair: Any, precision: str, inputs: np.ndarray, targets: np.ndarray) -> dict:
    """Per fp8 matmul of the JAX side: jaxamp.fp8's scales and codes of the same three tensors."""
    rec = jax_recipe(precision, "cpu")
    capture = functools.partial(jaxamp.fp8.capture_operands, recipe=rec, fp8_filter=jax_filter)
    out = {}
    for name, (module, ops) in captured_jax_operands(pair, inputs, targets, capture).items():
        entry = {"module": module}
        for key, value, cast, axis in (
            ("input", ops.input, rec.input, -1),
            ("weight", ops.weight, rec.weight, 0),
            ("grad_output", ops.grad_output, rec.grad_output, -1),
        ):
            q, s = _quantize(value, cast, axis, rec.power_of_2_scales)
            entry[key] = (np.asarray(s), np.asarray(q).view(np.uint8))
        out[name] = entry
    return out


def _module_path(name: str, weight2d: np.ndarray, weights: dict[str, np.ndarray]) -> str:
    """The Flax module path of fp8 matmul `name`: its name stack, else the parameter it multiplies.

    Linen modules push their names onto JAX's name stack (``"Model/blocks_0/fc1/dot_general"``);
    ``flax.nnx`` modules push nothing, so their matmuls are named ``"dot_general"``,
    ``"dot_general#1"``, ... There the module is the one whose parameter equals the matmul's
    weight operand bit for bit (both sides start from the torch weights); no match or several
    matches raise instead of guessing.
    """
    if name.endswith("/dot_general"):
        return name[: -len("/dot_general")]
    if name.split("#")[0] != "dot_general":  # a repeat inside a named module: kept whole
        return name
    hits = sorted(
        module
        for module, leaf in weights.items()
        if leaf.size == weight2d.size
        and leaf.dtype == weight2d.dtype
        and (
            np.array_equal(leaf.reshape(weight2d.shape), weight2d)
            or (
                leaf.ndim == 2
                and leaf.T.shape == weight2d.shape
                and np.array_equal(leaf.T, weight2d)
            )
        )
    )
    if len(hits) != 1:
        raise ValueError(
            f"step0_fp8: JAX fp8 matmul {name!r} carries no module name (flax.nnx pushes no name "
            f"scope) and its weight operand {weight2d.shape} equals "
            f"{'no parameter' if not hits else f'several parameters {hits}'}; cannot tell its layer."
        )
    return hits[0]


def _feature_orders(pair: Any, torch_module: str, kernel2d_shape: tuple[int, int]):
    """``(in_order, out_order)``: the JAX kernel's row j is torch input feature ``in_order[j]``,
    its column n torch output feature ``out_order[n]``, read off the pair's weight mapping.

    The mapping moves the torch weight ``(out, in)`` to the Flax kernel through its transform
    (``linear``: a transpose; ``linear|chw(C,H,W)``: also the rows from torch's NCHW flatten order
    to Flax's NHWC one). Pushing index grids through the same transform gives the feature order
    of each side, so torch's codes can be compared element for element with JAX's.
    """
    names = [e for e in pair.mapping.entries if e.torch_name == f"{torch_module}.weight"]
    if len(names) != 1:
        raise ValueError(
            f"step0_fp8: the weight mapping has {len(names)} entries for {torch_module}.weight "
            "(need exactly one to align the fp8 codes)."
        )
    transform = names[0].transform
    n_in, n_out = kernel2d_shape
    rows = apply_transform(transform, np.broadcast_to(np.arange(n_in), (n_out, n_in)))
    cols = apply_transform(transform, np.broadcast_to(np.arange(n_out)[:, None], (n_out, n_in)))
    if rows.size != n_in * n_out:
        raise ValueError(
            f"step0_fp8: {torch_module}.weight's transform {transform!r} is not a permutation."
        )
    rows, cols = rows.reshape(n_in, n_out), cols.reshape(n_in, n_out)
    in_order, out_order = rows[:, 0], cols[0, :]
    if not (np.all(rows == in_order[:, None]) and np.all(cols == out_order[None, :])):
        raise ValueError(
            f"step0_fp8: {torch_module}.weight's transform {transform!r} mixes input and output "
            "features; the fp8 codes cannot be aligned."
        )
    return in_order, out_order


def _to_jax_order(tensor: str, scale: np.ndarray, codes: np.ndarray, in_order, out_order):
    """torch's scale and codes of `tensor`, features permuted into the JAX side's order."""
    if tensor == "input":  # (M, K): features along columns, rowwise scales (M, 1)
        return scale, codes[:, in_order]
    if tensor == "weight":  # (K, N) = weight.t(): rowwise scales (1, N), one per output
        scale = scale[..., out_order] if scale.size == out_order.size else scale
        return scale, codes[in_order][:, out_order]
    return scale, codes[:, out_order]  # grad_output (M, N), rowwise scales (M, 1)


def _code_steps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance between fp8 codes in representable steps (sign-magnitude ordering)."""

    def ordinal(c):
        c = c.astype(np.int32)
        mag = c & 0x7F
        return np.where(c & 0x80, -mag, mag)

    return np.abs(ordinal(a) - ordinal(b))


def _mantissa_bits(fp8_dtype) -> int:
    """3 for e4m3, 2 for e5m2: one fp8 step at magnitude m is ``2**(floor(log2 m) - bits)``."""
    return 3 if np.dtype(fp8_dtype) == np.dtype(jaxamp.fp8.Cast("e4m3").dtype) else 2


def _within_one_step_of_row_max(a, b, fp8_dtype, rowwise: bool) -> bool:
    """|a - b| (as fp8 values) <= one fp8 step at the row's (or tensor's) largest magnitude."""
    va = a.view(fp8_dtype).astype(np.float32)
    vb = b.view(fp8_dtype).astype(np.float32)
    top = np.maximum(np.abs(va), np.abs(vb))
    top = top.max(axis=-1, keepdims=True) if rowwise else top.max()
    step = np.exp2(np.floor(np.log2(np.maximum(top, 1e-30))) - _mantissa_bits(fp8_dtype))
    return bool(np.all(np.abs(va - vb) <= step))


_TENSORS = ("input", "weight", "grad_output")


def _quantizer_exact(hp: np.ndarray, scale: np.ndarray, codes: np.ndarray, cast, axis, rec) -> bool:
    """jaxamp.fp8.to_fp8_dynamic of torch's own high-precision tensor gives torchao's scale and codes."""
    q, s = _quantize(hp, cast, axis, rec.power_of_2_scales)
    s, q = np.asarray(s), np.asarray(q).view(np.uint8)
    return (
        s.size == scale.size
        and q.size == codes.size
        and np.array_equal(s.reshape(scale.shape), scale)
        and np.array_equal(q.reshape(codes.shape), codes)
    )


def step0_fp8(pair: Any, precision: str, inputs: np.ndarray, targets: np.ndarray) -> list[dict]:
    """Step-0 fp8 check: per layer and tensor, torchao's scales and codes against jaxamp.fp8's.

    Two comparisons per (layer, tensor):

    * the quantizer, on one tensor: jaxamp.fp8 quantizes torch's own high-precision input,
      weight and grad_output of the layer; its scale and codes must equal torchao's bit for bit
      (``quantizer_exact``). This is where a wrong scale rounding, amax axis or dtype shows.
    * end to end: each side's codes of its own tensors, torch's brought into the JAX side's
      feature order through the pair's weight mapping (a Linear after an NCHW flatten sees its
      features permuted). Weights and the first layer's input are the same float32 numbers on both
      sides, so their scales and codes must be equal. Further in, activations and gradients come
      out of float32 matmuls summed in another order, so they may differ in the last bit: their
      scales by a few float32 ulps (8 eps), an input code by one fp8 step where a value sits on a
      rounding boundary, and a gradient by one fp8 step at its row's (tensorwise: tensor's)
      largest magnitude, because the gradient is itself the output of fp8 matmuls whose operands
      may have flipped by one step upstream. Once a code has flipped, every tensor computed after
      it (later layers' inputs in forward order; every gradient, since the loss sees the flip) is
      the output of fp8 matmuls fed different codes, and that difference grows through the layers
      (a one-step flip in a transformer's block-0 fc2 input moves block-1 values near zero by
      tens of fp8 steps): those tensors (``downstream_of_flip``) are held to the gradient's rule,
      codes within one fp8 step at the row's largest magnitude, and their scales to the same
      step relative to the amax (``2**-mantissa_bits``).

    Returns:
      One dict per (layer, tensor): ``torch_module``, ``jax_name``, ``tensor``, ``scales_equal``,
      ``scale_max_rel_diff``, ``codes_differing`` (count), ``codes`` (total),
      ``max_code_steps``, ``exact_expected``, ``quantizer_exact``, ``downstream_of_flip`` and
      ``passed``.
    """
    torch_side = _torch_step0(pair, precision, inputs, targets)
    jax_side = _jax_step0(pair, precision, inputs, targets)
    by_path = {}
    for name, entry in jax_side.items():
        path = entry["module"]
        if path in by_path:
            raise ValueError(
                f"step0_fp8: JAX fp8 matmuls {by_path[path]!r} and {name!r} are both in {path!r}."
            )
        by_path[path] = name
    rec = jax_recipe(precision, "cpu")
    rec_casts = {
        "input": (rec.input, -1),
        "weight": (rec.weight, 0),
        "grad_output": (rec.grad_output, -1),
    }
    forward_order = list(torch_side)  # forward hooks fire in execution order
    rows, arrays = [], []
    for torch_module, flax_module in pair.mapping.module_pairs():
        if torch_module not in torch_side:
            continue
        suffix = "/".join(flax_module)
        hits = [p for p in by_path if p == suffix or p.endswith("/" + suffix)]
        if len(hits) != 1:
            raise ValueError(
                f"step0_fp8: torch layer {torch_module!r} converted by torchao has "
                f"{'no' if not hits else 'several'} fp8 matmul on the JAX side "
                f"(looked for {suffix!r} among {sorted(by_path)})."
            )
        jax_name = by_path.pop(hits[0])
        orders = _feature_orders(pair, torch_module, torch_side[torch_module]["weight"][1].shape)
        for tensor in _TENSORS:
            ts, tc, hp = torch_side[torch_module][tensor]
            row = {
                "torch_module": torch_module,
                "jax_name": jax_name,
                "tensor": tensor,
                "exact_expected": tensor == "weight",
                "quantizer_exact": _quantizer_exact(hp, ts, tc, *rec_casts[tensor], rec),
                "downstream_of_flip": False,
            }
            ts, tc = _to_jax_order(tensor, ts, tc, *orders)
            js, jc = jax_side[jax_name][tensor]
            if ts.size != js.size or tc.size != jc.size or tc.dtype != jc.dtype:
                row.update(
                    scales_equal=False,
                    scale_max_rel_diff=float("inf"),
                    codes_differing=int(tc.size),
                    codes=int(tc.size),
                    max_code_steps=255,
                    passed=False,
                    detail=f"scale shapes differ: torch {ts.shape}, jax {js.shape}",
                )
                rows.append(row)
                arrays.append(None)
                continue
            ts = ts.reshape(js.shape)
            rel = float(np.max(np.abs(js.astype(np.float64) - ts) / np.abs(ts))) if ts.size else 0.0
            jc = jc.reshape(tc.shape)
            steps = _code_steps(jc, tc)
            row.update(
                scales_equal=bool(np.array_equal(js.reshape(ts.shape), ts)),
                scale_max_rel_diff=rel,
                codes_differing=int(np.count_nonzero(steps)),
                codes=int(steps.size),
                max_code_steps=int(steps.max()),
            )
            rows.append(row)
            arrays.append((jc, tc, js.size > 1))
    if by_path:
        raise ValueError(
            f"step0_fp8: JAX fp8 matmuls {sorted(by_path.values())} have no torchao layer."
        )
    if not rows:
        raise ValueError("step0_fp8: no layer was converted on the torch side: nothing compared.")
    # Which tensors were computed after a code had flipped (forward order, then backward).
    position = {r["torch_module"]: forward_order.index(r["torch_module"]) for r in rows}
    forward_flips = [
        position[r["torch_module"]]
        for r in rows
        if r["tensor"] != "grad_output" and r["codes_differing"]
    ]
    grad_flips = [
        position[r["torch_module"]]
        for r in rows
        if r["tensor"] == "grad_output" and r["codes_differing"]
    ]
    eps8 = 8 * float(np.finfo(np.float32).eps)
    for row, pair_arrays in zip(rows, arrays, strict=True):
        if pair_arrays is None:
            continue
        jc, tc, rowwise = pair_arrays
        i, tensor = position[row["torch_module"]], row["tensor"]
        if tensor == "input":
            row["downstream_of_flip"] = any(j < i for j in forward_flips)
        elif tensor == "grad_output":  # backward runs last layer first; the loss sees every flip
            row["downstream_of_flip"] = bool(forward_flips) or any(j > i for j in grad_flips)
        rel, fp8_dtype = row["scale_max_rel_diff"], rec_casts[tensor][0].dtype
        if tensor == "weight":
            ok = rel == 0.0 and row["max_code_steps"] == 0
        elif row["downstream_of_flip"]:
            ok = rel <= 2.0 ** -_mantissa_bits(fp8_dtype) and _within_one_step_of_row_max(
                jc, tc, fp8_dtype, rowwise
            )
        elif tensor == "input":  # same fp8 math upstream: flips only at a boundary
            ok = rel <= eps8 and row["max_code_steps"] <= 1
        else:  # grad_output: upstream fp8 roundings differ by a step, so allow one
            ok = rel <= eps8 and _within_one_step_of_row_max(jc, tc, fp8_dtype, rowwise)
        row["passed"] = bool(row["quantizer_exact"] and ok)
    return rows
