"""``parity bisect``: the fewest Flax modules, then primitives, to keep in float32 for a cell to pass.

A low-precision cell fails at step 0 when some module of the JAX port is numerically fragile in
the compute dtype (a LayerNorm that takes its statistics in bfloat16, an ``exp`` without the max
subtracted) where torch's autocast keeps the matching op in float32, or torch's kernel is
stable. `bisect` delta debugs (Zeller and Hildebrandt's ddmin) in two stages:

1. **modules**: a 1-minimal set of the linen modules the forward pass calls whose inputs, cast to
   float32, make the cell pass. A module is kept in float32 the way torch's autocast keeps an op
   on its float32 list: its floating inputs are cast to float32 (autocast honours a cast the
   program writes) and the ops inside run on them; matmuls inside stay under autocast. Printed as
   jaxamp's per-module rules (`jaxamp.flax.linen.with_policy(..., rules)`).
2. **primitives** (where the modules stage found a set and the recipe's JAX forward pass is
   ``jaxamp.autocast``): the primitives that ran on bfloat16/float16 operands inside those modules
   and run in float32 once they are kept are the candidates; a 1-minimal set of them whose
   ``jaxamp.autocast`` override to ``"fp32"`` (everywhere in the model, no module kept) makes the
   cell pass. An override holds wherever the primitive runs, so candidates that run least
   outside the kept modules come first, and the printed ``overrides`` say how many runs outside
   they also move: one fragile op (an unguarded ``exp``) comes out alone; for a LayerNorm whose
   mean is rounded by the cast inside ``jnp.mean`` no primitive of its own suffices, and the
   answer (``add``, which moves every bias add too) is coarser than the module rule.

A model that is not linen (flax.nnx, Hugging Face) has no module tree to intercept: the primitives
stage runs alone, over every primitive that runs on low-precision operands except those autocast
runs in low precision by design (matmuls, convolutions), fewest runs first.

One *run* is the cell's step-0 judgement at the run's precision: the JAX side
(`parity.verdicts.sides.jax_side`, the harness's own, under the run's recipe) with the chosen
modules or overrides, against torch's side (from a golden file, `bisect_golden`, or given to
`bisect`), judged by `parity.verdicts.step0_rows.stage_verdicts`. With
``bisect_golden(judge="cell")`` a run is the golden's whole check instead
(`parity.golden.check.check_pair`: step 0, training on the recorded batches, the trajectory's
verdicts), which passes only on PASS: a cell that fails or is INCONCLUSIVE after step 0.

Runs, at most ``budget`` over both stages, each distinct set once: 2 to start (every module kept
must pass; none kept must fail), ddmin's over the modules, then 1 for every candidate primitive
overridden (must pass) and ddmin's over them.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from parity.core.config import RunConfig
from parity.core.recipes import Recipe, get_recipe
from parity.golden.check import bad_input, check_fits, check_pair, flax_pair
from parity.golden.format import Golden, load_golden
from parity.pairs.adapters import FlaxModel
from parity.training.steps import jax_forward
from parity.verdicts.rows import Verdict
from parity.verdicts.sides import Side, jax_side, torch_device
from parity.verdicts.step0_rows import stage_verdicts
from parity.verdicts.tolerance import program_shapes

__all__ = [
    "FLOAT32_FAILS",
    "JUDGES",
    "BisectResult",
    "PrimitiveStage",
    "add_bisect_parser",
    "bisect",
    "bisect_golden",
    "ddmin",
    "main",
    "run_bisect",
]

DEFAULT_BUDGET = 64
NOT_SEARCHED = "not searched (not a linen model: primitives only)"
# bisect_golden's outcome when the float32 stage of step 0 fails: a port bug, not a precision one
FLOAT32_FAILS = "float32 fails"
# what one run judges: the step-0 rows, or a golden's whole check (step 0, training, trajectory)
JUDGES = ("step0", "cell")
_LOW_PRECISION = frozenset({jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)})
_CASTS = frozenset({"convert_element_type", "jaxamp_explicit_cast"})


@dataclasses.dataclass(frozen=True)
class PrimitiveStage:
    """The primitives stage of `bisect`.

    Attributes:
      keep: the primitive names whose ``jaxamp.autocast`` override to ``"fp32"`` makes the cell
        pass, 1-minimal when `minimal`.
      candidates: the primitives the modules stage moved to float32 (what was searched).
      outcome: as `BisectResult.outcome` (``"no set passes"``: every candidate overridden still
        fails; the module rules are the answer).
      minimal: whether `keep` is 1-minimal.
      runs: the runs this stage took.
      verdicts: the step-0 rows with `keep` overridden.
      outside: for each primitive in `keep`, how many of its low-precision runs lie outside the
        kept modules (an autocast override moves them too; candidates with fewest come first).
    """

    keep: list[str]
    candidates: list[str]
    outcome: str
    minimal: bool
    runs: int
    verdicts: list[Verdict]
    outside: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class BisectResult:
    """What `bisect` returns.

    Attributes:
      keep: the modules to keep in float32 ("/"-joined linen paths), 1-minimal when `minimal`.
      runs: how many step-0 runs it took, both stages.
      candidates: every module the forward pass calls (what was searched).
      outcome: ``"found"``, ``"passes already"`` (nothing to keep), ``"no set passes"`` (even
        every module in float32 fails: not a float32 question), ``"budget spent"`` or
        `NOT_SEARCHED` (an NNX or Hugging Face model: the primitives stage alone ran), or
        `FLOAT32_FAILS` (`bisect_golden`: the float32 stage of step 0 already fails, so no
        search: its rows are `verdicts`).
      minimal: whether `keep` is 1-minimal (removing any one module makes the cell fail).
      precision: the cell's precision.
      verdicts: the step-0 rows with `keep` in float32.
      primitives: the primitives stage, or None where it did not run (no module set found, or
        the recipe's JAX forward pass is not ``jaxamp.autocast``).
      autocast_args: the recipe's ``jaxamp.autocast`` arguments (``dtype``, ``device``) for the
        overrides' code.
      judged_by: what one run judged (`JUDGES`): ``"step0"`` (the step-0 rows at the run's
        precision) or ``"cell"`` (a golden's whole check: step 0, training on the recorded
        batches, the trajectory's verdicts; a run passes only on PASS, so INCONCLUSIVE cells
        are bisected too).
    """

    keep: list[str]
    runs: int
    candidates: list[str]
    outcome: str
    minimal: bool
    precision: str
    verdicts: list[Verdict]
    primitives: PrimitiveStage | None = None
    autocast_args: str = ""
    judged_by: str = "step0"

    @property
    def found(self) -> bool:
        """A set that passes was found (modules or primitives), or none is needed: the
        command's exit 0."""
        if self.outcome in ("found", "passes already"):
            return True
        return self.primitives is not None and self.primitives.outcome == "found"

    def rules_code(self) -> str:
        """The rules as code to paste (jaxamp's per-module policies)."""
        rules = ", ".join(f"{path!r}: 'fp32'" for path in self.keep)
        return (
            f"rules = {{{rules}}}  # parity bisect: {self.runs} runs\n"
            f"apply = jaxamp.flax.linen.with_policy(model.apply, {self.precision!r}, rules)"
        )

    def overrides_code(self) -> str | None:
        """The primitives stage's autocast overrides as code to paste, or None (none found)."""
        stage = self.primitives
        if stage is None or stage.outcome != "found":
            return None
        overrides = ", ".join(f"{name!r}: 'fp32'" for name in stage.keep)
        also = ", ".join(f"{n} {name}" for name, n in stage.outside.items() if n)
        also = f"; also moves {also} outside {', '.join(self.keep)}" if also and self.keep else ""
        return (
            f"overrides = {{{overrides}}}  # parity bisect: {self.runs} runs{also}\n"
            f"forward = jaxamp.autocast(forward, {self.autocast_args}, overrides=overrides)"
        )

    def report(self) -> str:
        judged = "" if self.judged_by == "step0" else " (judged by the whole cell)"
        if self.outcome == NOT_SEARCHED:
            head = f"bisect {self.precision}{judged}: modules {self.outcome}, {self.runs} runs"
        else:
            head = (
                f"bisect {self.precision}{judged}: {self.outcome}; {len(self.keep)} of "
                f"{len(self.candidates)} modules in float32 "
                f"({'1-minimal' if self.minimal else 'not shown minimal'}), {self.runs} runs"
            )
        if self.outcome == FLOAT32_FAILS:
            return (
                f"bisect {self.precision}{judged}: not searched: the float32 stage of step 0 "
                f"already fails ({_worst(self.verdicts)}): the port differs from torch in "
                "float32, which no module kept in float32 can fix; find that first (parity "
                "check names the first diverging layer)"
            )
        if self.outcome == "no set passes":
            head += f"; the last run's worst row: {_worst(self.verdicts)}"
        if self.outcome not in ("found", NOT_SEARCHED):
            return head
        lines = [head, self.rules_code()] if self.outcome == "found" else [head]
        stage = self.primitives
        if stage is not None:
            alternative = "or, " if self.keep else ""
            lines.append(
                f"{alternative}primitives: {stage.outcome}; {len(stage.keep)} of "
                f"{len(stage.candidates)} primitives overridden to float32 "
                f"({'1-minimal' if stage.minimal else 'not shown minimal'}), "
                f"{stage.runs} of the runs ({', '.join(stage.candidates) or 'no candidates'})"
            )
            if stage.outcome == "found":
                lines.append(self.overrides_code())
            elif stage.outcome == "no set passes":
                lines.append(
                    "with every candidate primitive in float32, the worst row: "
                    f"{_worst(stage.verdicts)}"
                )
        return "\n".join(lines)


def _worst(verdicts: Sequence[Verdict]) -> str:
    """The failing row furthest past its tolerance, as ``check: value > tolerance``."""
    failed = [v for v in verdicts if v.passed is False]
    if not failed:
        return "no row failed"

    def ratio(v: Verdict) -> float:
        if isinstance(v.value, int | float) and isinstance(v.tolerance, int | float):
            return float(v.value) / float(v.tolerance) if v.tolerance else math.inf
        return math.inf  # a non-numeric failure (an error, a NaN) is the worst

    worst = max(failed, key=ratio)
    return f"{worst.check}: {worst.value_text} > {worst.tolerance_text}"


def ddmin(items: Sequence[Any], passes: Callable[[list[Any]], bool]) -> tuple[list[Any], bool]:
    """A 1-minimal sublist of `items` for which ``passes`` holds (``passes(items)`` must).

    Zeller and Hildebrandt's ddmin: try each of n chunks, then each complement; on success
    continue from it, else double n until the chunks are single items.

    Returns:
      ``(sublist, minimal)``; `minimal` is False when `passes` raised `StopIteration` (a
      budget) before the search ended.

    Examples:
      >>> ddmin(list(range(8)), lambda s: 5 in s)
      ([5], True)
    """
    items = list(items)
    n = 2
    try:
        while len(items) >= 2:
            size = math.ceil(len(items) / n)
            chunks = [items[i : i + size] for i in range(0, len(items), size)]
            for chunk in chunks:
                if passes(chunk):
                    items, n = chunk, 2
                    break
            else:
                for chunk in chunks if len(chunks) > 2 else ():
                    rest = [x for x in items if x not in chunk]
                    if passes(rest):
                        items, n = rest, max(n - 1, 2)
                        break
                else:
                    if n >= len(items):
                        break
                    n = min(2 * n, len(items))
        return items, True
    except StopIteration:
        return items, False


def _module_paths(flax_model: Any, variables: dict, inputs: Any) -> list[str]:
    """The "/"-joined paths of the linen submodules one train-mode forward pass calls."""
    seen: list[str] = []

    def record(next_fun, args, kwargs, context):
        path = "/".join(context.module.path)
        if context.method_name == "__call__" and path and path not in seen:
            seen.append(path)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        flax_model.apply(variables, jnp.asarray(inputs), True)
    return seen


def _to_float32(x: Any) -> Any:
    floating = isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)
    return x.astype(jnp.float32) if floating else x


@dataclasses.dataclass
class _KeptFloat32(FlaxModel):
    """A `parity.pairs.adapters.FlaxModel` whose modules at the paths `keep` take float32 inputs."""

    keep: frozenset = frozenset()

    def apply(self, variables, inputs, train):
        def to_float32(next_fun, args, kwargs, context):
            path = "/".join(context.module.path)
            if context.method_name == "__call__" and path in self.keep:
                # ``x.astype``: a cast autocast sees being written (and honours) even where x
                # is float32 while it traces
                args, kwargs = jax.tree.map(_to_float32, (args, kwargs))
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(to_float32):
            return super().apply(variables, inputs, train)


@dataclasses.dataclass(frozen=True)
class _OverriddenConfig(RunConfig):
    """The cell's `RunConfig` whose recipe runs ``jaxamp.autocast`` with `autocast_overrides`.

    `RunConfig.recipe` is looked up by the precision's name; only bisect's runs change the
    recipe's autocast rules, so they alone carry them.
    """

    autocast_overrides: tuple[tuple[str, str], ...] = ()

    @property
    def recipe(self) -> Recipe:
        recipe = get_recipe(self.precision)
        if recipe.baseline:  # a golden's float32 stage of step 0: no autocast to override
            return recipe
        return recipe.with_autocast_overrides(dict(self.autocast_overrides))

    def to_dict(self) -> dict[str, Any]:
        # the run record's config, comparable with torch's recorded one; the overrides show in
        # the record's JAX method (`Recipe.jax_method`)
        out = super().to_dict()
        del out["autocast_overrides"]
        return out


def _low_precision_primitives(jaxpr: Any) -> Counter:
    """How many times each primitive of `jaxpr` (nested ones included) runs on a bfloat16 or
    float16 operand; casts are not counted (they are what moves a value between dtypes)."""
    counts: Counter = Counter()
    for eqn in jaxpr.eqns:
        inner = list(jex_core.jaxprs_in_params(eqn.params))
        for sub in inner:
            counts += _low_precision_primitives(sub)
        if inner or eqn.primitive.name in _CASTS:
            continue
        if any(getattr(v.aval, "dtype", None) in _LOW_PRECISION for v in eqn.invars):
            counts[eqn.primitive.name] += 1
    return counts


def _primitive_candidates(
    pair: Any,
    config: RunConfig,
    variables: dict,
    inputs: Any,
    keep: Sequence[str],
    whole_model: bool = False,
) -> dict[str, int]:
    """The primitives that run on low-precision operands in the cell's forward pass and no longer
    (or fewer times) with the modules `keep` in float32 (those the modules stage moved), each
    with how many low-precision runs of it remain outside `keep` (what a global override would
    also move): fewest of those first, then in program order. `whole_model` (no module tree):
    every primitive on low-precision operands, matmuls (``dot_general``) and convolutions
    included, with all their runs counted as outside."""

    def counts(model_pair):
        forward = jax_forward(model_pair, config.recipe, config.device, train=True)
        args = (variables["params"], variables.get("batch_stats"), jnp.asarray(inputs))
        return _low_precision_primitives(jax.make_jaxpr(forward)(*args).jaxpr)

    before = counts(pair)
    if whole_model:
        # no module tree to narrow it down: every primitive on low-precision operands, matmuls
        # and convolutions included (an attention matmul that overflows is a candidate too)
        after = before
        moved = list(after)
    else:
        after = counts(_kept(pair, frozenset(keep)))
        moved = [name for name in before if before[name] > after[name]]
    return {name: after[name] for name in sorted(moved, key=lambda name: after[name])}


def _kept(pair: Any, keep: frozenset) -> Any:
    fields = {f.name: getattr(pair.flax_model, f.name) for f in dataclasses.fields(FlaxModel)}
    return dataclasses.replace(pair, flax_model=_KeptFloat32(**fields, keep=keep))


def bisect(
    pair: Any,
    config: RunConfig,
    batch: tuple[Any, Any],
    torch_numbers: Side,
    variables: dict,
    loss_scale: float = 1.0,
    *,
    budget: int = DEFAULT_BUDGET,
) -> BisectResult:
    """Finds the fewest linen modules, then primitives, to keep in float32 for step 0 to pass.

    Args:
      pair: the JAX half of the pair (``flax_model``: a `parity.pairs.adapters.FlaxModel`,
        ``task``, ``name``); linen: both stages; NNX or Hugging Face: the primitives stage alone.
      config: the cell at its low precision.
      batch: ``(inputs, targets)`` of step 0.
      torch_numbers: torch's step-0 `Side` at the run's precision.
      variables: the Flax variables both sides start from.
      loss_scale: the step-0 loss scale torch's side was taken at.
      budget: the most step-0 runs over both stages (>= 2).

    Returns:
      A `BisectResult` (its ``primitives`` holds the second stage).
    """
    inputs, targets = (np.asarray(b) for b in batch)
    _check_cell(pair, config, budget)
    shapes = program_shapes(pair, variables, inputs, targets)

    def step0(kept: Any, cell: RunConfig) -> tuple[bool, list[Verdict]]:
        jax_numbers = jax_side(
            kept, variables, inputs, targets, cell, loss_scale, trace_flops=False
        )
        rows, _, _ = stage_verdicts(
            kept, cell, cell.precision, cell.compute_dtype, torch_numbers, jax_numbers, shapes
        )
        return all(v.passed is not False for v in rows), rows

    return _search(pair, config, variables, inputs, step0, budget, "step0")


def _check_cell(pair: Any, config: RunConfig, budget: Any) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 2:
        raise ValueError(f"bisect: `budget` must be an integer >= 2 runs; got {budget!r}.")
    if config.recipe.baseline or config.compute_dtype == "float32":
        raise ValueError(
            f"bisect: precision {config.precision!r} computes in float32; bisect a low precision."
        )
    if getattr(pair.flax_model, "kind", "linen") != "linen":
        try:
            config.recipe.with_autocast_overrides({})
        except ValueError as e:
            raise ValueError(
                f"bisect: the module search runs on flax.linen models only, and for this "
                f"{pair.flax_model.kind} model the primitives stage cannot run: {e}"
            ) from None


def _search(
    pair: Any,
    config: RunConfig,
    variables: dict,
    inputs: Any,
    judge: Callable[[Any, RunConfig], tuple[bool, list[Verdict]]],
    budget: int,
    judged_by: str,
) -> BisectResult:
    """Both stages of delta debugging; `judge(pair, config)` is one run: (passes, rows)."""
    linen = getattr(pair.flax_model, "kind", "linen") == "linen"
    candidates = _module_paths(pair.flax_model, variables, inputs) if linen else None
    results: dict[tuple[frozenset, frozenset], tuple[bool, list[Verdict]]] = {}

    def run(keep: Sequence[str] = (), overrides: Sequence[str] = ()) -> bool:
        key = (frozenset(keep), frozenset(overrides))
        if key not in results:
            if len(results) >= budget:
                raise StopIteration
            cell = config
            if overrides:
                fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(RunConfig)}
                cell = _OverriddenConfig(
                    **fields, autocast_overrides=tuple((name, "fp32") for name in sorted(key[1]))
                )
            results[key] = judge(_kept(pair, key[0]), cell)
        return results[key][0]

    def rows(keep=(), overrides=()):
        return results.get((frozenset(keep), frozenset(overrides)), (None, []))[1]

    def done(keep, outcome, minimal, primitives=None):
        return BisectResult(
            list(keep),
            len(results),
            candidates or [],
            outcome,
            minimal,
            config.precision,
            rows(keep),
            primitives,
            autocast_args,
            judged_by,
        )

    try:  # the primitives stage needs a recipe whose JAX forward pass is jaxamp.autocast
        config.recipe.with_autocast_overrides({})
        autocast_args = f"dtype=jnp.{config.compute_dtype}, device={torch_device(config)!r}"
    except ValueError:
        autocast_args = ""
    if run():
        return done([], "passes already", True)
    if candidates is None:  # not linen: no module tree to search, the primitives stage alone
        keep, module_outcome = [], NOT_SEARCHED
    else:
        try:
            everything_passes = run(candidates)
        except StopIteration:
            return done([], "budget spent", False)
        if not everything_passes:
            return done(candidates, "no set passes", False)
        keep, minimal = ddmin(candidates, run)
        if not minimal or not autocast_args:
            return done(keep, "found" if minimal else "budget spent", minimal)
        module_outcome = "found"

    module_runs = len(results)
    outside = _primitive_candidates(pair, config, variables, inputs, keep, candidates is None)
    primitives = list(outside)

    def override(names: Sequence[str]) -> bool:
        return run((), names)

    def stage(found, outcome, stage_minimal):
        return PrimitiveStage(
            list(found),
            primitives,
            outcome,
            stage_minimal,
            len(results) - module_runs,
            rows((), found),
            {name: outside[name] for name in found},
        )

    modules_minimal = module_outcome == "found"
    try:
        all_pass = bool(primitives) and override(primitives)
    except StopIteration:
        return done(keep, module_outcome, modules_minimal, stage([], "budget spent", False))
    if not all_pass:  # its rows are the last run's: every candidate overridden
        failed_stage = dataclasses.replace(
            stage([], "no set passes", False), verdicts=rows((), primitives)
        )
        return done(keep, module_outcome, modules_minimal, failed_stage)
    found, found_minimal = ddmin(primitives, override)
    outcome = "found" if found_minimal else "budget spent"
    return done(keep, module_outcome, modules_minimal, stage(found, outcome, found_minimal))


def _float32_stage(golden: Golden, pair: Any, config: RunConfig) -> list[Verdict]:
    """The golden's float32 step-0 rows when one fails (else []): outputs and gradients against
    torch's recorded float32 stage."""
    fp32 = config.replace(precision="fp32")
    inputs, targets = golden.batch(0)
    variables = golden.variables()
    shapes = program_shapes(pair, variables, inputs, targets)
    scale = next(s["loss_scale"] for s in golden.stages if s["stage"] == "fp32")
    jax_numbers = jax_side(pair, variables, inputs, targets, fp32, scale, trace_flops=False)
    rows, _, _ = stage_verdicts(
        pair, config, "fp32", "float32", golden.side("fp32"), jax_numbers, shapes
    )
    return rows if any(v.passed is False for v in rows) else []


def bisect_golden(
    golden: Any, flax_model: Any = None, *, budget: int = DEFAULT_BUDGET, judge: str = "step0"
) -> BisectResult:
    """`bisect` against a golden file's torch side (no torch needed).

    Args:
      golden: a golden file recorded at a low precision (or a loaded `Golden`).
      flax_model: as `parity.golden.check.check_golden`.
      budget: the most runs.
      judge: one of `JUDGES`: ``"step0"`` (a run is the step-0 rows at the run's precision) or
        ``"cell"`` (a run is `parity.golden.check.check_pair`: step 0, then training on the
        recorded batches and the trajectory's verdicts; it passes only on PASS, so a cell that
        fails or is INCONCLUSIVE after step 0 is bisected too, at a run's cost of training).
    """
    if judge not in JUDGES:
        close = difflib.get_close_matches(str(judge), JUDGES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"bisect: `judge` must be one of {JUDGES}; got {judge!r}{hint}.")
    golden = golden if isinstance(golden, Golden) else load_golden(golden)
    config = golden.config
    stage = {s["stage"]: s for s in golden.stages}.get(config.precision)
    if stage is None or config.recipe.baseline:
        raise ValueError(
            f"bisect: {golden.path}: recorded at {config.precision!r}, which computes in "
            "float32: nothing to keep in float32."
        )
    pair = flax_pair(golden, flax_model)
    check_fits(golden, pair)
    failing = _float32_stage(golden, pair, config)
    if failing:  # a port bug, not a precision one: no module kept in float32 can fix it
        return BisectResult([], 1, [], FLOAT32_FAILS, False, config.precision, failing)
    if judge == "step0":
        return bisect(
            pair,
            config,
            golden.batch(0),
            golden.side(stage["stage"]),
            golden.variables(),
            stage["loss_scale"],
            budget=budget,
        )
    _check_cell(pair, config, budget)

    def whole_cell(kept: Any, cell: RunConfig) -> tuple[bool, list[Verdict]]:
        result = check_pair(golden, kept, cell)
        return result.passed, result.verdicts

    inputs = np.asarray(golden.batch(0)[0])
    return _search(pair, config, golden.variables(), inputs, whole_cell, budget, "cell")


def add_bisect_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``bisect`` to `parity.cli.commands`'s subcommands."""
    parser = sub.add_parser(
        "bisect",
        help="the fewest Flax modules, then autocast primitives, to keep in float32 for a "
        "low-precision golden cell to pass (delta debugging; no torch needed)",
    )
    parser.add_argument("--golden", required=True, help="golden file at a low precision")
    parser.add_argument("--flax-model", default=None, metavar="MODULE:ATTR")
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="most runs (default 64)")
    parser.add_argument(
        "--judge",
        choices=JUDGES,
        default="step0",
        help="one run: the step-0 rows (default), or the whole cell (step 0, training on the "
        "recorded batches, the trajectory's verdicts; PASS only passes, so a FAIL or "
        "INCONCLUSIVE after step 0 is bisected too)",
    )
    return parser


def run_bisect(args: argparse.Namespace) -> int:
    """``bisect``'s body: prints the rules and the run count; exit 0 when a set was found."""
    try:
        result = bisect_golden(args.golden, args.flax_model, budget=args.budget, judge=args.judge)
    except ValueError as e:  # GoldenFileError included: a damaged or wrong file is bad input
        return bad_input(e)
    print(result.report())
    return 0 if result.found else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m parity bisect ...`` where torch is not installed (`parity.__main__`)."""
    parser = argparse.ArgumentParser(prog="python -m parity")
    add_bisect_parser(parser.add_subparsers(dest="command", required=True))
    return run_bisect(parser.parse_args(["bisect", *(sys.argv[2:] if argv is None else argv)]))
