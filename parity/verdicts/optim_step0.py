"""Step 0's optimizer-state rows of the low-bit AdamW recipes (adamw-8bit, adamw-4bit, adamw-fp8).

From identical gradients (torch's step-0 gradients, the JAX side given the same tensors through
the pair's weight mapping) and identical weights, one torchao step and one jaxamp step must give
the same quantized moments: torchao quantizes each moment of a large tensor block by block in the
torch tensor's row-major order, ``jaxamp.optim_precision.low_precision_state`` in the block order the recipe takes
from the pair's mapping, so the codes and scales are equal bit for bit. A state blocked in the
Flax layout, or with another block size, puts other elements under each scale: its codes and
scales differ from the first step on, which end to end at 4 bits is lost in rounding noise over
a training run. The rows gate like the fp8 code rows: a failing row stops the run at step 0.

This module runs torchao's step (`torch_optimizer_step`); `parity.verdicts.optim_judge` runs
jaxamp's and judges, without torch (a golden file's check judges a recorded torchao step).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch

from parity.core.config import RunConfig
from parity.core.losses import loss_torch
from parity.training.steps import build_torch_optimizer
from parity.verdicts.optim_judge import (
    MOMENTS,
    OptimizerRecord,
    TorchMoment,
    compare_optimizer_step,
    optimizer_state_rows,
)
from parity.verdicts.rows import Verdict
from parity.verdicts.sides import flatten
from parity.verdicts.torch_side import torch_grads_to_flax

__all__ = ["optimizer_state_step0", "optimizer_state_verdicts", "torch_optimizer_step"]


def _bits(codes: torch.Tensor) -> np.ndarray:
    """torchao's codes as bytes (4-bit: two codes per byte; fp8: the bit pattern)."""
    return codes.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)


def _pieces(pair: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[tuple[int, int, str]]]:
    """``{torch name: [(first element, element count, Flax path), ...]}`` in torch's element
    order: the Flax leaves each torch tensor maps to (several where the mapping splits it, e.g.
    attention's fused ``in_proj_weight`` into query, key and value kernels)."""
    pieces: dict[str, list[tuple[int, int, str]]] = {}
    for path, found in pair.mapping.element_index(shapes).items():
        if path[0] != "params":
            continue
        for torch_name, index in found:
            piece = (int(index.min()), int(index.size), "/".join(path[1:]))
            pieces.setdefault(torch_name, []).append(piece)
    return {name: sorted(found) for name, found in pieces.items()}


def torch_optimizer_step(
    pair: Any, config: RunConfig, inputs: np.ndarray, targets: np.ndarray
) -> OptimizerRecord:
    """One torchao step from the pair's weights, a fresh state and torch's step-0 gradients
    (the run's own optimizer, `build_torch_optimizer`, without gradient clipping), recorded in
    the Flax layout: what `parity.verdicts.optim_judge.compare_optimizer_step` compares
    jaxamp's step with (without a weight mapping, no moment has its pieces: jaxamp's side then
    refuses to build, as the run does). torchao's step runs eagerly.
    """
    model = copy.deepcopy(pair.torch_model).float().cpu()
    before = flatten(pair.to_flax(model)["params"])
    x = torch.from_numpy(np.ascontiguousarray(inputs))
    y = torch.from_numpy(np.ascontiguousarray(targets))
    model.zero_grad(set_to_none=True)
    loss_torch(pair.task, pair.torch_forward(model, x, train=True), y).backward()
    grads = torch_grads_to_flax(pair, model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    pieces = _pieces(pair, shapes) if pair.mapping is not None else {}

    config = dataclasses.replace(config, clip_norm=None)
    optimizer = build_torch_optimizer(config, model.parameters())
    with torch.compiler.set_stance("force_eager"):  # the step's numbers, without compiling it
        optimizer.step()
    moments = []
    for name, param in model.named_parameters():
        for moment, key in MOMENTS.items():
            theirs = optimizer.state[param].get(key)
            if not hasattr(theirs, "codes"):
                continue  # torchao keeps small tensors' moments in float32
            moments.append(
                TorchMoment(
                    torch_name=name,
                    moment=moment,
                    codes=_bits(theirs.codes),
                    scale=theirs.scale.detach().cpu().numpy().astype(np.float32).reshape(-1),
                    block_size=int(theirs.block_size),
                    pieces=tuple(pieces.get(name, [])),
                )
            )
    after = flatten(pair.to_flax(model)["params"])
    return OptimizerRecord(before, grads, after, moments)


def optimizer_state_step0(
    pair: Any, config: RunConfig, inputs: np.ndarray, targets: np.ndarray
) -> list[dict]:
    """One torchao step and one jaxamp step from torch's step-0 gradients, compared
    (`torch_optimizer_step`, then `parity.verdicts.optim_judge.compare_optimizer_step`, whose
    rows it returns)."""
    record = torch_optimizer_step(pair, config, inputs, targets)
    return compare_optimizer_step(record, pair, config)


def optimizer_state_verdicts(
    pair: Any, config: RunConfig, inputs: np.ndarray, targets: np.ndarray
) -> list[Verdict] | None:
    """The step-0 rows ``step 0 <precision>: optimizer state codes and scales`` and ``...:
    weights after one optimizer step`` (`optimizer_state_step0`,
    `parity.verdicts.optim_judge.optimizer_state_rows`), or None for a recipe whose optimizer
    state is not torchao's low-bit one."""
    if "optimizer state" not in config.recipe.step0_checks:
        return None
    try:
        rows = optimizer_state_step0(pair, config, inputs, targets)
    except ValueError as e:  # no mapping to take the block order from
        return optimizer_state_rows(config, str(e))
    return optimizer_state_rows(config, rows)
