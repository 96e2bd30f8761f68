"""Step 0's optimizer-state rows of the low-bit AdamW recipes (adamw-8bit, adamw-4bit, adamw-fp8).

From identical gradients (torch's step-0 gradients, the JAX side given the same tensors through
the pair's weight mapping) and identical weights, one torchao step and one jaxamp step must give
the same quantized moments: torchao quantizes each moment of a large tensor block by block in the
torch tensor's row-major order, ``jaxamp.optim_precision.low_precision_state`` in the block order the recipe takes
from the pair's mapping, so the codes and scales are equal bit for bit. A state blocked in the
Flax layout, or with another block size, puts other elements under each scale: its codes and
scales differ from the first step on, which end to end at 4 bits is lost in rounding noise over
a training run. The rows gate like the fp8 code rows: a failing row stops the run at step 0.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from jaxamp.optim_precision import QuantizedArray
from parity.core.config import RunConfig
from parity.core.losses import loss_torch
from parity.training.steps import build_jax_optimizer, build_torch_optimizer
from parity.verdicts.rows import Verdict
from parity.verdicts.sides import flatten
from parity.verdicts.torch_side import torch_grads_to_flax

__all__ = ["optimizer_state_step0", "optimizer_state_verdicts"]

_MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}
# The two AdamW formulas (optax's and torchao's) round a few times differently per element.
WEIGHT_ULPS = 8


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    return tree


def _bits(codes: Any) -> np.ndarray:
    """Codes as bytes (4-bit: two codes per byte; fp8: the bit pattern), from torch or JAX."""
    if isinstance(codes, torch.Tensor):
        return codes.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)
    return np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8)).reshape(-1)


def _jax_moments(state: Any) -> dict[tuple[str, str], QuantizedArray]:
    """``{(moment, "/"-joined Flax path): QuantizedArray}`` of an optimizer state."""
    found = {}
    leaves = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, QuantizedArray)
    )[0]
    for path, leaf in leaves:
        if not isinstance(leaf, QuantizedArray):
            continue
        names = [getattr(k, "name", None) for k in path]
        moment = next((n for n in names if n in _MOMENTS), None)
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        if moment is not None:
            found[(moment, "/".join(keys))] = leaf
    return found


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


def _assemble(pieces: list[tuple[int, int, str]], ours: dict, moment: str, block: int):
    """The JAX side's codes (bytes) and scales of one torch tensor's moment, its pieces' states
    joined in torch's element order, or a string saying why they cannot be: a piece not
    quantized, or pieces that are not whole blocks of the torch tensor (a block of torchao's
    would straddle two JAX leaves: the two states cannot hold the same blocks)."""
    codes, scales, start = [], [], 0
    for first, size, path in pieces:
        mine = ours.get((moment, path))
        if mine is None:
            return f"{path} not quantized on the JAX side"
        if len(pieces) > 1 and (first != start or size % block):
            return (
                f"split into JAX leaves {[p for _, _, p in pieces]} whose pieces are not whole "
                f"blocks of {block} in torch's order: not comparable block for block"
            )
        codes.append(_bits(mine.codes))
        scales.append(np.asarray(mine.scale, np.float32).reshape(-1))
        start += size
    return np.concatenate(codes), np.concatenate(scales)


def optimizer_state_step0(
    pair: Any, config: RunConfig, inputs: np.ndarray, targets: np.ndarray
) -> list[dict]:
    """One torchao step and one jaxamp step from torch's step-0 gradients, compared.

    Both sides start from the pair's weights and a fresh state; the optimizers are the run's own
    (`build_torch_optimizer`, `build_jax_optimizer` with the pair), without gradient clipping
    (the step compares the optimizers, on the same gradient tensors). torchao's step runs eagerly.

    Returns:
      One dict per (torch tensor, moment) torchao quantizes: ``torch_name``, ``flax_path``,
      ``moment``, ``codes`` (count), ``codes_differing``, ``scales``, ``scales_differing``,
      ``detail`` (a shape or layout mismatch) and ``passed`` (codes and scales bit-identical);
      then one ``weights`` dict: ``max_abs_diff``, ``max_excess`` (the largest difference over
      its bound), ``worst`` (Flax path) and ``passed``.
    """
    config = dataclasses.replace(config, clip_norm=None)
    model = copy.deepcopy(pair.torch_model).float().cpu()
    before = pair.to_flax(model)["params"]
    x = torch.from_numpy(np.ascontiguousarray(inputs))
    y = torch.from_numpy(np.ascontiguousarray(targets))
    model.zero_grad(set_to_none=True)
    loss_torch(pair.task, pair.torch_forward(model, x, train=True), y).backward()
    grads = _unflatten(torch_grads_to_flax(pair, model))

    optimizer = build_torch_optimizer(config, model.parameters())
    with torch.compiler.set_stance("force_eager"):  # the step's numbers, without compiling it
        optimizer.step()
    after_torch = flatten(pair.to_flax(model)["params"])

    tx = build_jax_optimizer(config, pair=pair)
    params = jax.tree_util.tree_map(jnp.asarray, before)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    after_jax = flatten(optax.apply_updates(params, updates))
    ours = _jax_moments(state)

    pieces = _pieces(pair, {n: tuple(p.shape) for n, p in model.named_parameters()})
    rows = []
    for name, param in model.named_parameters():
        for moment, key in _MOMENTS.items():
            theirs = optimizer.state[param].get(key)
            if not hasattr(theirs, "codes"):
                continue  # torchao keeps small tensors' moments in float32
            found = pieces.get(name, [])
            paths = ", ".join(p for _, _, p in found) or None
            row = {"torch_name": name, "flax_path": paths, "moment": moment, "detail": ""}
            t_codes, t_scale = _bits(theirs.codes), theirs.scale.detach().cpu().numpy()
            row["codes"], row["scales"] = t_codes.size, t_scale.size
            mine = (
                _assemble(found, ours, moment, theirs.block_size)
                if found
                else "not mapped to a JAX parameter"
            )
            if isinstance(mine, str):
                row["detail"] = mine
            elif mine[1].size != t_scale.size or mine[0].size != t_codes.size:
                blocks = [ours[(moment, p)].block_size for _, _, p in found]
                row["detail"] = (
                    f"{mine[1].size} scales of {blocks[0]} elements, torchao "
                    f"{t_scale.size} of {theirs.block_size}"
                )
            if row["detail"]:
                row.update(codes_differing=t_codes.size, scales_differing=t_scale.size)
            else:
                row["codes_differing"] = int((mine[0] != t_codes).sum())
                row["scales_differing"] = int(
                    (mine[1].view(np.uint32) != t_scale.reshape(-1).view(np.uint32)).sum()
                )
            # pieces that cannot hold torchao's blocks are not comparable: undecided, not failed
            comparable = "not comparable" not in row["detail"]
            exact = row["codes_differing"] == 0 and row["scales_differing"] == 0
            row["passed"] = exact if comparable else None
            rows.append(row)

    worst, max_diff, max_excess = None, 0.0, -np.inf
    for key, theirs in after_torch.items():
        diff = np.abs(after_jax[key] - theirs)
        bound = WEIGHT_ULPS * np.finfo(np.float32).eps * (np.abs(theirs) + config.lr)
        excess = float((diff - bound).max())
        if excess > max_excess:
            worst, max_excess = key, excess
        max_diff = max(max_diff, float(diff.max()))
    rows.append(
        {
            "weights": True,
            "max_abs_diff": max_diff,
            "max_excess": max_excess,
            "worst": worst,
            "passed": max_excess <= 0,
        }
    )
    return rows


def optimizer_state_verdicts(
    pair: Any, config: RunConfig, inputs: np.ndarray, targets: np.ndarray
) -> list[Verdict] | None:
    """The step-0 rows ``step 0 <precision>: optimizer state codes and scales`` and ``...:
    weights after one optimizer step`` (`optimizer_state_step0`), or None for a recipe whose
    optimizer state is not torchao's low-bit one."""
    torchao_class = getattr(config.recipe, "torchao_class", None)
    if torchao_class is None:
        return None
    base = {"model": config.model, "precision": config.precision, "device": config.device}
    prefix = f"step 0 {config.precision}"
    compared = (
        f"jaxamp.optim_precision.low_precision_state vs torchao.optim.{torchao_class}, one step"
    )
    try:
        rows = optimizer_state_step0(pair, config, inputs, targets)
    except ValueError as e:  # no mapping to take the block order from
        return [
            Verdict(
                check=f"{prefix}: optimizer state codes and scales",
                compared=compared,
                value="not compared",
                tolerance="bit-identical",
                passed=False,
                detail=str(e)[:500],
                mode="step 0",
                **base,
            )
        ]
    states, weights = rows[:-1], rows[-1]
    failed = [r for r in states if r["passed"] is False]
    undecided = [r for r in states if r["passed"] is None]
    codes = sum(r["codes"] for r in states)
    differing = sum(r["codes_differing"] for r in states)
    scales = sum(r["scales"] for r in states)
    scales_differing = sum(r["scales_differing"] for r in states)
    detail = (
        f"{len(states)} quantized moments ({', '.join(sorted({r['torch_name'] for r in states}))}"
        f"); {differing}/{codes} code bytes and {scales_differing}/{scales} scales differ"
    )
    if failed:
        detail = (
            "failing: "
            + ", ".join(
                f"{r['torch_name']} {r['moment']} ("
                + (
                    r["detail"]
                    or f"{r['codes_differing']}/{r['codes']} code bytes, "
                    f"{r['scales_differing']}/{r['scales']} scales differ"
                )
                + ")"
                for r in failed[:3]
            )
            + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
            + "; "
            + detail
        )
    if undecided:
        detail += "; not comparable: " + ", ".join(
            f"{r['torch_name']} {r['moment']} ({r['detail']})" for r in undecided[:3]
        )
    verdicts = [
        Verdict(
            check=f"{prefix}: optimizer state codes and scales",
            compared=compared,
            value=f"{len(failed)}/{len(states)} moments off",
            tolerance="bit-identical, blocks in torch's element order",
            passed=False if failed else (None if undecided or not states else True),
            detail=detail if states else "torchao quantized no moment: nothing to compare",
            mode="step 0",
            power=0.0,
            **base,
        ),
        Verdict(
            check=f"{prefix}: weights after one optimizer step",
            compared=compared,
            value=weights["max_abs_diff"],
            tolerance=f"{WEIGHT_ULPS} float32 eps x (|w| + lr) per element",
            passed=weights["passed"],
            detail=f"worst {weights['worst']}: {weights['max_excess']:.3g} over its bound",
            mode="step 0",
            power=WEIGHT_ULPS * float(np.finfo(np.float32).eps),
            **base,
        ),
    ]
    return verdicts
