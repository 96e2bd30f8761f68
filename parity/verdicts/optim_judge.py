"""Step 0's optimizer-state rows of the low-bit AdamW recipes, judged from torch's recorded step.

torchao's side of the step (`parity.verdicts.optim_step0.torch_optimizer_step`: torch's step-0
gradients in the Flax layout, each quantized moment's codes and scales, the weights after the
step) is an `OptimizerRecord`; `compare_optimizer_step` runs jaxamp's step from the same weights
and gradients and compares, and `optimizer_state_rows` writes the two rows. The harness records
and judges in one go (`parity.verdicts.step0.check_step0`); a golden file records torch's side
where torch is installed and the check judges it where it is not (`parity.golden.step0`). No
torch here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp.optim_precision import QuantizedArray
from parity.core.config import RunConfig
from parity.training.steps import build_jax_optimizer
from parity.verdicts.qualifiers import verdict
from parity.verdicts.rows import Verdict, cell_fields
from parity.verdicts.sides import flatten

__all__ = [
    "MOMENTS",
    "WEIGHT_ULPS",
    "OptimizerRecord",
    "TorchMoment",
    "codes_bytes",
    "compare_optimizer_step",
    "optimizer_state_rows",
    "unflatten",
]

# optax's AdamW moment -> torchao's state key
MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}
# The two AdamW formulas (optax's and torchao's) round a few times differently per element.
WEIGHT_ULPS = 8


@dataclasses.dataclass(frozen=True)
class TorchMoment:
    """One moment of one torch tensor as torchao quantized it after the step.

    Attributes:
      torch_name: the torch parameter.
      moment: ``"mu"`` or ``"nu"`` (optax's name; torchao's ``exp_avg`` / ``exp_avg_sq``).
      codes: the codes as bytes (4-bit: two codes per byte; fp8: the bit pattern), row-major.
      scale: the block scales (float32).
      block_size: torchao's elements per block.
      pieces: ``(first element, element count, Flax path)`` of each Flax leaf the tensor maps
        to, in torch's element order (several where the mapping splits it); empty: not mapped.
    """

    torch_name: str
    moment: str
    codes: np.ndarray
    scale: np.ndarray
    block_size: int
    pieces: tuple[tuple[int, int, str], ...]


@dataclasses.dataclass(frozen=True)
class OptimizerRecord:
    """torchao's side of one optimizer step from torch's step-0 gradients.

    Attributes:
      params: the weights before the step (Flax layout, ``{"a/b": array}`` under ``params``).
      grads: torch's step-0 gradients in the same layout.
      after: torch's weights after the step, in the same layout.
      moments: every quantized moment (`TorchMoment`), in torch's parameter order.
    """

    params: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    after: dict[str, np.ndarray]
    moments: list[TorchMoment]


def unflatten(flat: dict[str, Any]) -> dict:
    """`parity.verdicts.sides.flatten`'s reverse, leaves as ``jnp`` arrays.

    Example:
      >>> sorted(unflatten({"fc/kernel": np.ones(2), "fc/bias": np.zeros(1)})["fc"])
      ['bias', 'kernel']
    """
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    return tree


def codes_bytes(codes: Any) -> np.ndarray:
    """JAX codes as bytes (4-bit: two codes per byte; fp8: the bit pattern), row-major."""
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
        moment = next((n for n in names if n in MOMENTS), None)
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        if moment is not None:
            found[(moment, "/".join(keys))] = leaf
    return found


def _assemble(pieces, ours: dict, moment: str, block: int):
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
        codes.append(codes_bytes(mine.codes))
        scales.append(np.asarray(mine.scale, np.float32).reshape(-1))
        start += size
    return np.concatenate(codes), np.concatenate(scales)


def compare_optimizer_step(record: OptimizerRecord, pair: Any, config: RunConfig) -> list[dict]:
    """jaxamp's step from the recorded weights and gradients, compared with torchao's.

    The optimizer is the run's own (`build_jax_optimizer` with the pair: the low-bit state
    blocked as the pair says), without gradient clipping (the step compares the optimizers, on
    the same gradient tensors).

    Returns:
      One dict per quantized moment: ``torch_name``, ``flax_path``, ``moment``, ``codes``
      (count), ``codes_differing``, ``scales``, ``scales_differing``, ``detail`` (a shape or
      layout mismatch) and ``passed`` (codes and scales bit-identical; None where the pieces
      cannot hold torchao's blocks); then one ``weights`` dict: ``max_abs_diff``,
      ``max_excess`` (the largest difference over its bound), ``worst`` (Flax path), ``passed``.
    """
    config = dataclasses.replace(config, clip_norm=None)
    tx = build_jax_optimizer(config, pair=pair)
    params = unflatten(record.params)
    updates, state = jax.jit(tx.update)(unflatten(record.grads), tx.init(params), params)
    after_jax = flatten(optax.apply_updates(params, updates))
    ours = _jax_moments(state)
    rows = []
    for theirs in record.moments:
        found = list(theirs.pieces)
        paths = ", ".join(p for _, _, p in found) or None
        row = {
            "torch_name": theirs.torch_name,
            "flax_path": paths,
            "moment": theirs.moment,
            "detail": "",
            "codes": theirs.codes.size,
            "scales": theirs.scale.size,
        }
        mine = (
            _assemble(found, ours, theirs.moment, theirs.block_size)
            if found
            else "not mapped to a JAX parameter"
        )
        if isinstance(mine, str):
            row["detail"] = mine
        elif mine[1].size != theirs.scale.size or mine[0].size != theirs.codes.size:
            blocks = [ours[(theirs.moment, p)].block_size for _, _, p in found]
            row["detail"] = (
                f"{mine[1].size} scales of {blocks[0]} elements, torchao "
                f"{theirs.scale.size} of {theirs.block_size}"
            )
        if row["detail"]:
            row.update(codes_differing=theirs.codes.size, scales_differing=theirs.scale.size)
        else:
            row["codes_differing"] = int((mine[0] != theirs.codes).sum())
            t_scale = np.asarray(theirs.scale, np.float32).reshape(-1)
            row["scales_differing"] = int(
                (mine[1].view(np.uint32) != t_scale.view(np.uint32)).sum()
            )
        # pieces that cannot hold torchao's blocks are not comparable: undecided, not failed
        comparable = "not comparable" not in row["detail"]
        exact = row["codes_differing"] == 0 and row["scales_differing"] == 0
        row["passed"] = exact if comparable else None
        rows.append(row)

    worst, max_diff, max_excess = None, 0.0, -np.inf
    for key, theirs in record.after.items():
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


def optimizer_state_rows(config: RunConfig, rows: list[dict] | str) -> list[Verdict]:
    """The step-0 rows ``step 0 <precision>: optimizer state codes and scales`` and ``...:
    weights after one optimizer step`` from `compare_optimizer_step`'s rows, or one failing
    row when the step could not be compared (`rows`: why)."""
    torchao_class = getattr(config.recipe, "torchao_class", "")
    prefix = f"step 0 {config.precision}"
    row = functools.partial(
        verdict,
        kind="optimizer state",
        compared="jaxamp.optim_precision.low_precision_state vs "
        f"torchao.optim.{torchao_class}, one step",
        mode="step 0",
        **cell_fields(config),
    )
    if isinstance(rows, str):  # e.g. no mapping to take the block order from
        return [
            row(
                check=f"{prefix}: optimizer state codes and scales",
                value="not compared",
                tolerance="bit-identical",
                passed=False,
                detail=rows[:500],
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
    return [
        row(
            check=f"{prefix}: optimizer state codes and scales",
            value=f"{len(failed)}/{len(states)} moments off",
            tolerance="bit-identical, blocks in torch's element order",
            passed=False if failed else (None if undecided or not states else True),
            detail=detail if states else "torchao quantized no moment: nothing to compare",
            power=0.0,
        ),
        row(
            check=f"{prefix}: weights after one optimizer step",
            value=weights["max_abs_diff"],
            tolerance=f"{WEIGHT_ULPS} float32 eps x (|w| + lr) per element",
            passed=weights["passed"],
            detail=f"worst {weights['worst']}: {weights['max_excess']:.3g} over its bound",
            power=WEIGHT_ULPS * float(np.finfo(np.float32).eps),
        ),
    ]
