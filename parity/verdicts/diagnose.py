"""Per-layer diagnosis: where do the torch model and its Flax twin part ways?

On one batch and from the same weights, every layer's output is captured on both sides (torch
forward hooks; `parity.pairs.adapters.intercept_calls` on the Flax side, linen or NNX), in eval and
in train mode, together with
each layer's parameter gradients and the running statistics a train-mode pass leaves behind.
Layers are matched through the pair's weight mapping (``pair.mapping.module_pairs()``: torch
module name <-> Flax module path); without a mapping, a torch module ``blocks.1.conv1`` is matched
with the Flax module ``blocks_1/conv1`` (Flax's naming of list members) where that exists.

Each layer's error (``parity.verdicts.step0.relative_error``: normwise relative difference, floored by the
scale) is judged against the step-0 band (``parity.verdicts.step0.tolerance``) with the layer's depth (its
position among the matched layers in torch's execution order), in float32 at the highest matmul
precision and, for a low-precision run, at the run's precision.

The first diverging layer is the first layer, in execution order, whose forward output (eval or
train) exceeds its band; if every output agrees, the first whose running statistics do; else the
last one, in execution order, whose gradients do (the backward pass runs in reverse, so that is
where gradients start to differ).

It runs automatically when a step-0 verdict fails (`parity.verdicts.step0.check_step0`); call
`diagnose_pair` yourself (e.g. when a trajectory verdict fails, with the failing step's batch and
weights), or `diagnose_config` for a built-in model.

Example::

    from parity.verdicts.diagnose import diagnose_pair
    from parity import models

    diagnosis = diagnose_pair(get_model_pair("resnet", wrong_port="padding"), "fp32")
    print(diagnosis.first_failing)   # blocks.1.conv1
    print(diagnosis.to_markdown())
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from parity import models
from parity.core.config import RunConfig
from parity.pairs.adapters import intercept_calls
from parity.verdicts.sides import (
    as_config,
    flatten,
    jax_device,
    jax_side,
    torch_device,
)
from parity.verdicts.tolerance import (
    gradient_tolerance,
    group_error,
    group_scale,
    program_shapes,
    relative_error,
    tolerance,
)
from parity.verdicts.torch_side import torch_setup, torch_side

__all__ = [
    "Diagnosis",
    "diagnose_config",
    "diagnose_pair",
    "diagnose_run",
    "first_tensor",
    "module_pairs",
    "shaped_error",
]

KINDS = ("eval output", "train output", "running stats", "gradients")


@dataclasses.dataclass
class Diagnosis:
    """The per-layer table of `diagnose_pair`.

    Attributes:
      rows: one dict per (stage, layer): ``stage`` (``"fp32"`` or the precision), ``layer``
        (torch module), ``flax`` (Flax module path), ``depth``, and for each kind in ``KINDS``
        its relative error (None when the layer has nothing of that kind), plus ``band``
        (forward), ``grad_band`` and ``passed``.
      first_failing: the torch name of the first diverging layer (None if all agree).
      first_failing_stage: the stage in which it diverges.
      first_failing_kind: which kind exceeded its band there.
      unmatched: torch modules with parameters that have no Flax counterpart.
      cause: a failing check that is not a layer's (``"compute dtype (jax): ..."``, a stochastic
        layer, a folded parameter): named before any layer, since the layers cannot explain it.
      notes: what else the reader needs (structural differences of the mapping).
    """

    rows: list[dict[str, Any]]
    first_failing: str | None
    first_failing_stage: str | None = None
    first_failing_kind: str | None = None
    unmatched: list[str] = dataclasses.field(default_factory=list)
    cause: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        """One line: the non-layer cause if there is one, else the first diverging layer, or
        that all layers agree."""
        if self.cause is not None:
            layer = (
                f"; first diverging layer: {self.first_failing} ({self.first_failing_kind}, "
                f"{self.first_failing_stage})"
                if self.first_failing is not None
                else ""
            )
            return f"cause: {self.cause}{layer}"
        if self.first_failing is None:
            return "per-layer diagnosis: every layer within its band"
        return (
            f"first diverging layer: {self.first_failing} ({self.first_failing_kind}, "
            f"{self.first_failing_stage})"
        )

    def to_markdown(self) -> str:
        """The table as markdown (errors in 3 significant digits, failures marked)."""
        lines = [
            "| stage | layer (torch) | flax | depth | "
            + " | ".join(KINDS)
            + " | band (fwd / grad) | |",
            "|---|---|---|---|" + "---|" * len(KINDS) + "---|---|",
        ]
        for row in self.rows:
            cells = []
            for kind in KINDS:
                value = row[kind]
                cells.append("" if value is None else f"{value:.3g}")
            mark = "" if row["passed"] else "**FAIL**"
            if row["layer"] == self.first_failing and row["stage"] == self.first_failing_stage:
                mark = "**FIRST**"
            if row.get("note"):
                mark = f"{mark} {row['note']}".strip()
            lines.append(
                f"| {row['stage']} | `{row['layer']}` | `{row['flax']}` | {row['depth']} | "
                + " | ".join(cells)
                + f" | {row['band']:.2g} / {row['grad_band']:.2g} | {mark} |"
            )
        text = "\n".join(lines) + "\n\n" + self.summary() + "\n"
        if self.unmatched:
            text += f"\nNo Flax counterpart found for: {', '.join(self.unmatched)}\n"
        for note in self.notes:
            text += f"\n{note}\n"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {
            "rows": [
                {
                    k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in r.items()
                }
                | {
                    "nonfinite_error": any(
                        isinstance(r[k], float) and math.isinf(r[k])
                        for k in KINDS
                        if r[k] is not None
                    )
                }
                for r in self.rows
            ],
            "first_failing": self.first_failing,
            "first_failing_stage": self.first_failing_stage,
            "first_failing_kind": self.first_failing_kind,
            "unmatched": self.unmatched,
            "cause": self.cause,
            "notes": self.notes,
            "markdown": self.to_markdown(),
        }


# --- matching layers ----------------------------------------------------------------------------


def _guess_flax_path(torch_name: str) -> tuple[str, ...]:
    """``blocks.1.conv1`` -> ``("blocks_1", "conv1")`` (Flax names list members ``name_i``)."""
    parts: list[str] = []
    for part in torch_name.split("."):
        if re.fullmatch(r"\d+", part) and parts:
            parts[-1] = f"{parts[-1]}_{part}"
        else:
            parts.append(part)
    return tuple(parts)


def module_pairs(pair: Any, variables: dict) -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
    """``([(torch module, Flax module path), ...], unmatched torch modules)``.

    From ``pair.mapping.module_pairs()`` when the pair has a `WeightMapping`; otherwise every
    torch module that owns parameters or buffers directly is matched with the Flax module of the
    guessed path (`_guess_flax_path`) if the Flax variables have it.
    """
    mapping = getattr(pair, "mapping", None)
    if mapping is not None and hasattr(mapping, "module_pairs"):
        return [(t, tuple(f)) for t, f in mapping.module_pairs()], []
    flax_modules = set()
    for key in list(flatten(variables.get("params", {}))) + list(
        flatten(variables.get("batch_stats", {}))
    ):
        parts = tuple(key.split("/"))[:-1]
        for i in range(1, len(parts) + 1):
            flax_modules.add(parts[:i])
    pairs, unmatched = [], []
    for name, module in pair.torch_model.named_modules():
        owns = any(True for _ in module.parameters(recurse=False)) or any(
            b is not None for b in module.buffers(recurse=False)
        )
        if not name or not owns:
            continue
        path = _guess_flax_path(name)
        if path in flax_modules:
            pairs.append((name, path))
        else:
            unmatched.append(name)
    return pairs, unmatched


# --- capturing layer outputs --------------------------------------------------------------------


def first_tensor(value: Any) -> Any:
    """The first tensor/array of a layer's output (a tuple's first element, recursively)."""
    if isinstance(value, tuple | list):
        return first_tensor(value[0]) if value else None
    return value


def shaped_error(got: Any, expected: Any) -> tuple[float, str]:
    """``(relative error, note)``, broadcast-aware.

    Equal shapes: `relative_error` and ``""``. Shapes that broadcast to one of the two (torch's
    position embedding ``(1, T, H)`` against Flax's ``(B, T, H)``): both broadcast to it, and the
    note says so. Shapes that do not: ``(inf, "shapes differ: ...")``, a row of its own, never
    judged as a numeric difference.

    Example:
      >>> shaped_error(np.ones((2, 3, 4)), np.ones((1, 3, 4)))
      (0.0, 'torch (1, 3, 4) broadcast to flax (2, 3, 4)')
    """
    a, b = np.asarray(got), np.asarray(expected)
    if a.shape == b.shape:
        return relative_error(a, b), ""
    try:
        shape = np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        shape = None
    if shape is not None and shape in (a.shape, b.shape):
        return (
            relative_error(np.broadcast_to(a, shape), np.broadcast_to(b, shape)),
            f"torch {b.shape} broadcast to flax {a.shape}",
        )
    return math.inf, f"shapes differ: torch {b.shape}, flax {a.shape}"


def _torch_outputs(pair, names, inputs, config: RunConfig, train: bool) -> dict[str, np.ndarray]:
    model, x = torch_setup(pair, inputs, config)
    captured: dict[str, np.ndarray] = {}
    order: list[str] = []

    def hook(name):
        def record(module, args, output):
            out = first_tensor(output)
            if isinstance(out, torch.Tensor) and name not in captured:
                array = out.detach().float().cpu().numpy().copy()
                if pair.torch_channels_first and array.ndim == 4:
                    array = array.transpose(0, 2, 3, 1)
                captured[name] = array
                order.append(name)

        return record

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        with torch.no_grad(), config.recipe.torch_autocast(torch_device(config)):
            pair.torch_forward(model, x, train=train)
    finally:
        for handle in handles:
            handle.remove()
    return {n: captured[n] for n in order}


def _flax_outputs(pair, variables, inputs, config: RunConfig) -> tuple[dict, dict]:
    """Every Flax module's first output, ``({module path: array}, ...)`` for eval and train mode
    (one compiled program for both), read through `parity.pairs.adapters.intercept_calls`: linen
    modules, Hugging Face Flax models and NNX modules alike."""
    recipe = config.recipe

    def capture(params, stats, x, train):
        full = {"params": params} | ({"batch_stats": stats} if stats is not None else {})
        out: dict[str, Any] = {}

        def record(path, next_fun, args, kwargs):
            result = next_fun(*args, **kwargs)
            key = "/".join(path)
            leaves = [leaf for leaf in jax.tree_util.tree_leaves(result) if hasattr(leaf, "dtype")]
            if key not in out and leaves:  # the first output of the first call
                out[key] = leaves[0].astype(jnp.float32)
            return result

        with intercept_calls(record):
            pair.flax_apply(full, x, train)
        return out

    def forward(params, stats, x):
        return capture(params, stats, x, False), capture(params, stats, x, True)

    # The forward pass and casts of the trainer: the recipe's.
    forward = recipe.jax_forward(forward, config.device)

    def run(params, stats, x):
        return forward(*recipe.jax_cast((params, stats, x)))

    with jax.default_matmul_precision("highest"), jax.default_device(jax_device(config)):
        both = jax.device_get(
            jax.jit(run)(variables["params"], variables.get("batch_stats"), np.asarray(inputs))
        )
    return tuple({k: np.asarray(v) for k, v in outs.items()} for outs in both)


# --- the diagnosis ------------------------------------------------------------------------------


def _subtree_error(jax_flat, torch_flat, prefix: str, scale: float) -> float | None:
    keys = [k for k in torch_flat if k.startswith(prefix + "/")]
    if not keys:
        return None
    return max(
        group_error(jax_flat[k], torch_flat[k], scale) if k in jax_flat else math.inf for k in keys
    )


def _stage_rows(
    pair, config: RunConfig, stage: str, inputs, targets, variables, pairs, shapes, sides
):
    flax_of = {t: "/".join(f) for t, f in pairs}
    names = [t for t, _ in pairs]
    torch_eval = _torch_outputs(pair, names, inputs, config, train=False)
    torch_train = _torch_outputs(pair, names, inputs, config, train=True)
    flax_eval, flax_train = _flax_outputs(pair, variables, inputs, config)
    if sides is None:
        scale = config.recipe.step0_loss_scale(config)
        sides = (
            torch_side(pair, inputs, targets, config, scale, trace_flops=False),
            jax_side(pair, variables, inputs, targets, config, scale, trace_flops=False),
        )
    t, j = sides
    grad_scale, stat_scale = group_scale(t.grads), group_scale(t.stats)
    # Execution order from the train-mode hooks; modules never called go last.
    ordered = [n for n in torch_train if n in flax_of] + [n for n in names if n not in torch_train]
    fwd_fan, _ = shapes["forward"]
    grad_fan, grad_depth = shapes["grad"]
    dtype = config.compute_dtype
    rows = []
    for depth, name in enumerate(ordered, start=1):
        flax = flax_of[name]
        row: dict[str, Any] = {"stage": stage, "layer": name, "flax": flax, "depth": depth}
        notes = []
        for kind, tside, fside in (
            ("eval output", torch_eval, flax_eval),
            ("train output", torch_train, flax_train),
        ):
            row[kind] = None
            if name in tside and flax in fside:
                error, note = shaped_error(fside[flax], tside[name])
                if math.isinf(error) and note:  # a row of its own, not a numeric difference
                    row["shape"] = note
                else:
                    row[kind] = error
                if note and note not in notes:
                    notes.append(note)
            elif name in tside or flax in fside:
                side = "torch" if name in tside else "flax"
                note = f"{kind} captured on the {side} side only"
                row["shape"] = note
                notes.append(note)
        row["note"] = "; ".join(notes)
        row["running stats"] = _subtree_error(j.stats, t.stats, flax, stat_scale)
        row["gradients"] = _subtree_error(j.grads, t.grads, flax, grad_scale)
        row["band"] = tolerance(dtype, fwd_fan, depth)
        row["grad_band"] = gradient_tolerance(dtype, grad_fan, grad_depth)
        row["failed_kinds"] = [
            kind
            for kind in KINDS
            if row[kind] is not None
            and row[kind] > (row["grad_band"] if kind == "gradients" else row["band"])
        ] + (["shape"] if row.get("shape") else [])
        row["passed"] = not row["failed_kinds"]
        rows.append(row)
    return rows


def _first_failing(rows) -> tuple[str, str, str] | None:
    for kinds, reverse in (
        (("eval output", "train output"), False),
        (("running stats",), False),
        (("gradients",), True),
        (("shape",), False),  # explained on its row; named only when nothing else differs
    ):
        for row in reversed(rows) if reverse else rows:
            hit = [k for k in kinds if k in row["failed_kinds"]]
            if hit:
                return row["layer"], row["stage"], hit[0]
    return None


def diagnose_pair(
    pair: Any,
    config: RunConfig | str = "fp32",
    batch: tuple[Any, Any] | None = None,
    *,
    variables: dict | None = None,
    sides: dict[str, tuple[Any, Any]] | None = None,
    shapes: dict[str, tuple[int, int]] | None = None,
) -> Diagnosis:
    """Compares every matched layer of a pair on one batch, in fp32 and at the run's precision.

    Args:
      pair: a `parity.models.ModelPair` (linen, Hugging Face Flax or NNX on the Flax side).
      config: a `RunConfig` or a precision string.
      batch: ``(inputs, targets)`` (default: batch 0 of the pair's data).
      variables: Flax variables holding the torch model's weights (default: converted from it);
        pass the weights of a later step to diagnose a trajectory failure (and load the same
        weights into ``pair.torch_model``).
      sides, shapes: results `parity.verdicts.step0.check_step0` already computed (internal reuse).

    Returns:
      A `Diagnosis` (rows in execution order, fp32 first; the first diverging layer).

    Example:
      >>> diagnose_pair(get_model_pair("resnet", wrong_port="padding")).first_failing
      'blocks.1.conv1'
    """
    config = as_config(pair, config)
    if batch is None:
        batch = pair.make_data(config.seed, config.batch_size).batch(0)
    inputs, targets = (np.asarray(b) for b in batch)
    if variables is None:
        variables = pair.torch_to_flax()
    pairs, unmatched = module_pairs(pair, variables)
    if shapes is None:
        shapes = program_shapes(pair, variables, inputs, targets)
    sides = sides or {}
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        rows = _stage_rows(
            pair,
            dataclasses.replace(config, precision="fp32"),
            "fp32",
            inputs,
            targets,
            variables,
            pairs,
            shapes,
            sides.get("fp32"),
        )
        if not config.recipe.baseline:
            rows += _stage_rows(
                pair,
                config,
                config.precision,
                inputs,
                targets,
                variables,
                pairs,
                shapes,
                sides.get(config.precision),
            )
    finally:
        torch.set_float32_matmul_precision(previous)
    first = _first_failing([r for r in rows if r["stage"] == "fp32"]) or _first_failing(rows)
    if first is None:
        return Diagnosis(rows, None, unmatched=unmatched)
    return Diagnosis(rows, first[0], first[1], first[2], unmatched)


def diagnose_config(config: RunConfig, pair: Any = None, step: int = 0) -> Diagnosis:
    """`diagnose_pair` for a run's configuration: the built-in pair of ``config.model`` (unless
    `pair` is given), on the batch of `step` of the run's data (``config.data`` at the run's
    data seed), from the initial weights.

    Example:
      >>> diagnose_config(RunConfig(model="resnet", precision="bf16-mixed")).summary()
      'per-layer diagnosis: every layer within its band'
    """
    if pair is None:
        pair = models.get_model_pair(
            config.model, seed=config.seed, data=config.data, **config.model_overrides
        )
    batch = pair.make_data(config.stream_seed, config.batch_size).batch(step)
    return diagnose_pair(pair, config, batch)


def diagnose_run(run: dict[str, Any], pair: Any = None, step: int = 0) -> Diagnosis:
    """`diagnose_config` for a run record (``results.json``): what `parity.verdicts.judge` calls when a
    trajectory verdict fails, to put the per-layer table in the report.

    Args:
      run: a run record (its ``config`` is read back with `RunConfig.from_dict`).
      pair: the model pair (default: the built-in pair the record names).
      step: whose batch to use (the initial weights are compared: the table says whether the
        models already differ before training, and where).

    Example:
      >>> diagnose_run(load_results("runs/x")["runs"][0]).to_markdown()
    """
    return diagnose_config(RunConfig.from_dict(run["config"]), pair=pair, step=step)
