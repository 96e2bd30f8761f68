"""Step 0's torch side: what torch computes on one batch, in the Flax layout.

`torch_side` runs the torch model at the run's precision exactly as `parity.training.train_torch` does
(the recipe converts the model, casts the inputs, opens autocast) and returns a
`parity.verdicts.sides.Side`. It lives apart from `parity.verdicts.sides` (the JAX side and the
`Side` record) so that the JAX side runs where torch is not installed (`parity.golden.check`).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from parity.core.config import RunConfig
from parity.core.losses import loss_torch
from parity.perf.phases import phase
from parity.training.dtype_trace import torch_matmul_flops
from parity.verdicts.sides import Side, flatten, pair_mapping, torch_device

__all__ = [
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


def torch_side(pair, inputs, targets, config, loss_scale, trace_flops) -> Side:
    """Torch's step-0 numbers at the run's precision (eval and train logits, loss, gradients of
    ``loss * loss_scale`` divided back, running statistics; matmul FLOPs by dtype)."""
    model, x = torch_setup(pair, inputs, config)
    y = torch.from_numpy(np.ascontiguousarray(targets)).to(x.device)
    recipe = config.recipe
    device_type = torch_device(config)

    with torch.no_grad(), recipe.torch_autocast(device_type):
        eval_logits = pair.torch_forward(model, x, train=False).float().cpu().numpy().copy()
    out: dict[str, Any] = {}

    def train_step():
        model.zero_grad(set_to_none=True)
        with recipe.torch_autocast(device_type):
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
        eval_logits, out["logits"], out["loss"], torch_grads_to_flax(pair, model), stats, flops
    )


def torch_stage_side(pair, inputs, targets, config, trace_flops: bool) -> tuple[Side, float]:
    """torch's step-0 `Side` at `config`'s precision and the loss scale it was taken at: the
    recipe's step-0 scale, halved (GradScaler's back-off) until torch's gradients are finite, so
    that step 0 is one torch would not skip. `parity.verdicts.step0` and `parity.golden.export` call it.
    """
    scale = config.recipe.step0_loss_scale(config)
    side = torch_side(pair, inputs, targets, config, scale, trace_flops=trace_flops)
    while scale > 1 and not all(np.isfinite(g).all() for g in side.grads.values()):
        scale /= 2
        side = torch_side(pair, inputs, targets, config, scale, trace_flops=trace_flops)
    return side, scale
