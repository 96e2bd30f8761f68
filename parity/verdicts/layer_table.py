"""The per-layer diagnosis table from torch's layer outputs: torch-free.

`parity.verdicts.diagnose` captures torch's layer outputs and calls `layer_rows`; a golden file
records them (`parity.golden.export`) and `parity.golden.check` calls it without torch. The
method (matching, bands, the first diverging layer) is `parity.verdicts.diagnose`'s docstring's.
`explain_failure` names the cause of a failed step 0 on the diagnosis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parity.core.config import RunConfig
from parity.core.once import once_jit
from parity.pairs.adapters import intercept_calls
from parity.verdicts.rows import Verdict
from parity.verdicts.sides import Side, jax_device
from parity.verdicts.tolerance import (
    gradient_tolerance,
    group_error,
    group_scale,
    relative_error,
    tolerance,
)

__all__ = [
    "FOLDED_CHECK",
    "KINDS",
    "PROBE_CHECK",
    "STOCHASTIC_CHECK",
    "Diagnosis",
    "explain_failure",
    "first_failing",
    "first_tensor",
    "layer_rows",
    "mask_padding_rows",
    "shaped_error",
]

KINDS = ("eval output", "train output", "running stats", "gradients")
PROBE_CHECK = "step 0 fp32: each layer on its operating range"
STOCHASTIC_CHECK = "step 0: deterministic train-mode forward (torch)"
FOLDED_CHECK = "step 0: tensors folded by the mapping"


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
      first_failing_input: the divergence is in that layer's *input*, not the layer: the layer
        agrees when fed torch's input (the layer probe), so what runs before it differs (a
        weightless op: an attention core, an activation, a pool, a residual).
      unmatched: torch modules with parameters that have no Flax counterpart.
      cause: a failing check that is not a layer's (``"compute dtype (jax): ..."``, a stochastic
        layer, a folded parameter): named before any layer, since the layers cannot explain it.
      notes: what else the reader needs (structural differences of the mapping).
    """

    rows: list[dict[str, Any]]
    first_failing: str | None
    first_failing_stage: str | None = None
    first_failing_kind: str | None = None
    first_failing_input: bool = False
    unmatched: list[str] = dataclasses.field(default_factory=list)
    cause: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def headline(self) -> str | None:
        """Where the two models first part, in execution order: ``"first diverging layer: X
        (kind, stage)"``, or ``"first divergence: the input of X (...)"`` where X itself agrees
        on torch's input and what runs before it does not; None when every layer agrees."""
        if self.first_failing is None:
            return None
        where = f"({self.first_failing_kind}, {self.first_failing_stage})"
        if self.first_failing_input:
            return (
                f"first divergence: the input of {self.first_failing} {where}: the layer agrees "
                "on torch's input, what runs before it (no weights of its own) does not"
            )
        return f"first diverging layer: {self.first_failing} {where}"

    def summary(self) -> str:
        """One line: the non-layer cause if there is one, else where the models first part
        (`headline`), or that all layers agree."""
        headline = self.headline()
        if self.cause is not None:
            return f"cause: {self.cause}" + (f"; {headline}" if headline else "")
        return headline or "per-layer diagnosis: every layer within its band"

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
            "first_failing_input": self.first_failing_input,
            "unmatched": self.unmatched,
            "cause": self.cause,
            "notes": self.notes,
            "markdown": self.to_markdown(),
        }


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
            once_jit(run)(variables["params"], variables.get("batch_stats"), np.asarray(inputs))
        )
    return tuple({k: np.asarray(v) for k, v in outs.items()} for outs in both)


def _subtree_error(jax_flat, torch_flat, prefix: str, scale: float) -> float | None:
    keys = [k for k in torch_flat if k.startswith(prefix + "/")]
    if not keys:
        return None
    return max(
        group_error(jax_flat[k], torch_flat[k], scale) if k in jax_flat else math.inf for k in keys
    )


def layer_rows(
    pair, config: RunConfig, stage: str, torch_outputs, variables, inputs, pairs, shapes, sides
) -> list[dict[str, Any]]:
    """The per-layer rows of one stage from torch's layer outputs (``(eval, train)``, each
    ``{torch module: array in Flax's layout}`` in execution order) and both sides' step-0
    numbers (``sides``: ``(torch, jax)``); the Flax layer outputs are computed here."""
    flax_of = {t: "/".join(f) for t, f in pairs}
    names = [t for t, _ in pairs]
    torch_eval, torch_train = torch_outputs
    flax_eval, flax_train = _flax_outputs(pair, variables, inputs, config)
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


def first_failing(rows) -> tuple[str, str, str] | None:
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


_FORWARD = ("eval output", "train output", "running stats")


def _probe_first(probe: Any) -> tuple[str, bool, dict[str, Any]] | None:
    """The layer probe's first failure in execution order: ``(layer, input?, row)``. A layer
    whose own input (the Flax model's forward, on probe weights) differs from torch's is
    named as its input, before its output is looked at: what runs before it parted."""
    failed = [r for r in probe.rows if not r["passed"]]
    for layer in dict.fromkeys(r["layer"] for r in probe.rows):  # first scale: execution order
        here = [r for r in failed if r["layer"] == layer]
        if here:
            inputs = [r for r in here if r["kind"] == "input"]
            return layer, bool(inputs), (inputs or here)[0]
    return None


def explain_failure(diagnosis: Any, verdicts: list[Verdict], probe: Any) -> None:
    """Names the cause of a failed step 0 on `diagnosis` (in place): a failed non-layer check
    first (stochastic layers, the compute dtype), then where the models first part in
    execution order: the layer probe's first failure (a layer that disagrees on torch's input,
    or the input of one that agrees on it) unless the table's first forward divergence comes
    earlier; a gradient-only table divergence (named last-first, as the backward pass runs)
    gives way to a probe failure, which is the first in execution order."""
    failed = [v for v in verdicts if v.passed is False]
    failed_kinds = {v.kind for v in failed}
    stochastic = [v for v in failed if v.kind == "stochastic"]
    dtype = [v for v in failed if v.kind == "compute dtype"]
    if stochastic:
        diagnosis.cause = f"stochastic torch modules: {stochastic[0].value}"
    elif dtype:
        diagnosis.cause = f"{dtype[0].check}: {dtype[0].detail}"
    probed = "layer probe" in failed_kinds and probe is not None
    first = _probe_first(probe) if probed else None
    if first is not None:
        layer, is_input, row = first
        order = [r["layer"] for r in diagnosis.rows if r["stage"] == diagnosis.first_failing_stage]
        earlier = (
            diagnosis.first_failing is not None
            and diagnosis.first_failing_kind in _FORWARD
            and diagnosis.first_failing in order
            and layer in order
            and order.index(diagnosis.first_failing) < order.index(layer)
        )
        same = layer == diagnosis.first_failing and not is_input  # the table named it already
        if not earlier and not same:
            diagnosis.first_failing = layer
            diagnosis.first_failing_stage = "fp32"
            diagnosis.first_failing_input = is_input
            diagnosis.first_failing_kind = (
                f"{row['kind']} on probe weights ({row['mode']}, layer outputs at RMS "
                f"{row['scale']:g})"
            )
    for verdict in verdicts:
        if verdict.kind == "folded":
            diagnosis.notes.append(f"{verdict.value} folded: {verdict.detail}")
        if verdict.kind == "padding rows":
            diagnosis.notes.append(f"{verdict.value} with a padding row: {verdict.detail}")


def mask_padding_rows(side: Side, rows: dict[str, tuple[str, int]]) -> Side:
    """`side` with each padding row (`padding_rows`) left out of its gradients."""
    if not rows:
        return side
    grads = dict(side.grads)
    for key, (_, index) in rows.items():
        grad = grads.get(key)
        if grad is not None and grad.ndim == 2 and index < grad.shape[0]:
            grads[key] = np.delete(grad, index, axis=0)
    return dataclasses.replace(side, grads=grads)
