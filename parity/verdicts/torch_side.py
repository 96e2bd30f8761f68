"""Step 0's torch side: what torch computes on one batch, in the Flax layout.

`torch_side` runs the torch model at the run's precision exactly as `parity.training.train_torch` does
(the recipe converts the model, casts the inputs, opens autocast) and returns a
`parity.verdicts.sides.Side`. It lives apart from `parity.verdicts.sides` (the JAX side and the
`Side` record) so that the JAX side runs where torch is not installed (`parity.golden.check`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import numpy as np
import torch

from parity.core.config import RunConfig
from parity.core.losses import loss_torch
from parity.perf.phases import phase
from parity.training.dtype_trace import torch_matmul_flops
from parity.verdicts.layer_table import first_tensor
from parity.verdicts.sides import Side, flatten, pair_mapping, torch_device

__all__ = [
    "layer_arrays",
    "model_off_host",
    "torch_grads_to_flax",
    "torch_setup",
    "torch_side",
    "torch_stage_side",
]


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
    mapping = pair_mapping(pair)
    if mapping is not None:
        tree = mapping.grads_to_flax(named)
        tree = tree.get("params", tree) if isinstance(tree, dict) else tree
        return flatten(tree)
    holder = copy.deepcopy(model).float().cpu()
    with torch.no_grad():
        for name, p in holder.named_parameters():
            p.copy_(named[name])
    return flatten(pair.to_flax(holder)["params"])


def torch_setup(pair: Any, inputs: Any, config: RunConfig):
    """``(model copy, input tensor)`` as `parity.training.train_torch` sets them up: the recipe converts
    the model (bf16-true: ``model.to(torch.bfloat16)``) and casts floating inputs."""
    recipe = config.recipe
    device = torch_device(config)
    model, _ = recipe.torch_convert(copy.deepcopy(pair.torch_model).float().to(device), device)
    x = torch.from_numpy(np.ascontiguousarray(inputs)).to(device)
    low = recipe.torch_input_dtype()
    if low is not None and x.is_floating_point():
        x = x.to(low)
    return model, x


def model_off_host(model: torch.nn.Module) -> bool:
    """Whether the transfer needs a float32 CPU copy (low-precision params, or a CUDA model)."""
    first = next(model.parameters(), None)
    return first is not None and (first.dtype != torch.float32 or first.device.type != "cpu")


@contextlib.contextmanager
def _capturing(model: torch.nn.Module, names: list[str] | None, into: dict[str, torch.Tensor]):
    """Inside: each module of `names` leaves a copy of its first output in `into` (in execution
    order; nothing when `names` is None)."""

    def hook(name):
        def record(module, args, output):
            out = first_tensor(output)
            if torch.is_tensor(out) and name not in into:
                into[name] = out.detach().clone()

        return record

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names or ()]
    try:
        yield into
    finally:
        for handle in handles:
            handle.remove()


def layer_arrays(pair: Any, captured: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Captured layer outputs (`Side.layers`' halves) in Flax's layout: float32 numpy, NCHW
    transposed to NHWC for a channels-first pair."""
    arrays = {}
    for name, value in captured.items():
        array = value.float().cpu().numpy().copy()
        if pair.torch_channels_first and array.ndim == 4:
            array = array.transpose(0, 2, 3, 1)
        arrays[name] = array
    return arrays


def torch_side(pair, inputs, targets, config, loss_scale, trace_flops, layers=None) -> Side:
    """Torch's step-0 numbers at the run's precision (eval and train logits, loss, gradients of
    ``loss * loss_scale`` divided back, running statistics; matmul FLOPs by dtype).

    `layers` (torch module names): each one's first output in the eval and the train pass is
    kept as well (`Side.layers`): the per-layer diagnosis reads them instead of running the
    two passes again."""
    model, x = torch_setup(pair, inputs, config)
    y = torch.from_numpy(np.ascontiguousarray(targets)).to(x.device)
    recipe = config.recipe
    device_type = torch_device(config)
    captured: tuple[dict, dict] = ({}, {})

    with (
        torch.no_grad(),
        recipe.torch_autocast(device_type),
        _capturing(model, layers, captured[0]),
    ):
        eval_logits = pair.torch_forward(model, x, train=False).float().cpu().numpy().copy()
    out: dict[str, Any] = {}

    def train_step():
        model.zero_grad(set_to_none=True)
        with recipe.torch_autocast(device_type), _capturing(model, layers, captured[1]):
            logits = pair.torch_forward(model, x, train=True)
            loss = loss_torch(pair.task, logits, y)
        (loss * loss_scale).backward()
        out["logits"], out["loss"] = logits.detach().float().cpu().numpy().copy(), loss.item()

    if trace_flops:  # the train pass itself, under the FLOP counter
        with phase("dtype trace"):
            flops = torch_matmul_flops(train_step)
    else:
        flops = train_step() or None
    if loss_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(loss_scale)
    # The transfer reads float32 weights (a bf16-true model is copied up first).
    stats_model = copy.deepcopy(model).float().cpu() if model_off_host(model) else model
    stats = flatten(pair.to_flax(stats_model).get("batch_stats", {}))
    return Side(
        eval_logits,
        out["logits"],
        out["loss"],
        torch_grads_to_flax(pair, model),
        stats,
        flops,
        layers=captured if layers is not None else None,
    )


def torch_stage_side(
    pair, inputs, targets, config, trace_flops: bool, layers: list[str] | None = None
) -> tuple[Side, float]:
    """torch's step-0 `Side` at `config`'s precision and the loss scale it was taken at: the
    recipe's step-0 scale, halved (GradScaler's back-off) until torch's gradients are finite, so
    that step 0 is one torch would not skip. `parity.verdicts.step0` and `parity.golden.export` call it.
    `layers`: as `torch_side`'s.
    """
    scale = config.recipe.step0_loss_scale(config)
    side = torch_side(pair, inputs, targets, config, scale, trace_flops=trace_flops, layers=layers)
    while scale > 1 and not all(np.isfinite(g).all() for g in side.grads.values()):
        scale /= 2
        side = torch_side(
            pair, inputs, targets, config, scale, trace_flops=trace_flops, layers=layers
        )
    return side, scale
