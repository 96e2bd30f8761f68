"""``parity bisect``: the smallest set of Flax modules to keep in float32 for a cell to pass.

A low-precision cell fails at step 0 when some module of the JAX port is numerically fragile in
the compute dtype (a LayerNorm that takes its statistics in bfloat16, an ``exp`` without the max
subtracted) where torch's autocast keeps the matching op in float32. `bisect` finds a
1-minimal set of linen modules whose inputs, cast to float32, make the cell pass, by delta
debugging (Zeller and Hildebrandt's ddmin) over the modules the forward pass calls.

One *run* is the cell's step-0 judgement at the run's precision: the JAX side
(`parity.verdicts.sides.jax_side`, the harness's own, under the run's recipe) with the chosen
modules kept in float32, against torch's side (from a golden file, `bisect_golden`, or computed
once, `bisect_models`), judged by `parity.verdicts.step0_rows.stage_verdicts`. A module is kept
in float32 the way torch's autocast keeps an op on its float32 list: its floating inputs are
cast to float32 (autocast honours a cast the program writes) and the ops inside run on them;
matmuls inside stay under autocast. The result prints the rules to paste: jaxamp's per-module
policy (`jaxamp.flax.linen.with_policy(..., rules)`) for those modules.

Runs: 2 to start (all modules kept must pass; none kept must fail), then ddmin's, at most
``budget`` in all; each distinct set is run once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from parity.config import RunConfig
from parity.golden.check import BAD_INPUT, flax_pair
from parity.golden.format import Golden, load_golden
from parity.pairs.adapters import FlaxModel
from parity.verdicts.rows import Verdict
from parity.verdicts.sides import Side, jax_side
from parity.verdicts.step0_rows import stage_verdicts
from parity.verdicts.tolerance import program_shapes

__all__ = [
    "BisectResult",
    "add_bisect_parser",
    "bisect",
    "bisect_golden",
    "ddmin",
    "main",
    "run_bisect",
]

DEFAULT_BUDGET = 64


@dataclasses.dataclass(frozen=True)
class BisectResult:
    """What `bisect` returns.

    Attributes:
      keep: the modules to keep in float32 ("/"-joined linen paths), 1-minimal when `minimal`.
      runs: how many step-0 runs it took.
      candidates: every module the forward pass calls (what was searched).
      outcome: ``"found"``, ``"passes already"`` (nothing to keep), ``"no set passes"`` (even
        every module in float32 fails: not a float32 question) or ``"budget spent"``.
      minimal: whether `keep` is 1-minimal (removing any one module makes the cell fail).
      precision: the cell's precision.
      verdicts: the step-0 rows with `keep` in float32.
    """

    keep: list[str]
    runs: int
    candidates: list[str]
    outcome: str
    minimal: bool
    precision: str
    verdicts: list[Verdict]

    def rules_code(self) -> str:
        """The rules as code to paste (jaxamp's per-module policies)."""
        rules = ", ".join(f"{path!r}: 'fp32'" for path in self.keep)
        return (
            f"rules = {{{rules}}}  # parity bisect: {self.runs} runs\n"
            f"apply = jaxamp.flax.linen.with_policy(model.apply, {self.precision!r}, rules)"
        )

    def report(self) -> str:
        head = (
            f"bisect {self.precision}: {self.outcome}; {len(self.keep)} of "
            f"{len(self.candidates)} modules in float32 "
            f"({'1-minimal' if self.minimal else 'not shown minimal'}), {self.runs} runs"
        )
        if self.outcome != "found":
            return head
        return head + "\n" + self.rules_code()


def ddmin(items: Sequence[Any], passes: Callable[[list[Any]], bool]) -> tuple[list[Any], bool]:
    """A 1-minimal sublist of `items` for which ``passes`` holds (``passes(items)`` must).

    Zeller and Hildebrandt's ddmin: try each of n chunks, then each complement; on success
    continue from it, else double n until the chunks are single items.

    Returns:
      ``(sublist, minimal)``; `minimal` is False when `passes` raised `StopIteration` (a
      budget) before the search ended.

    Example:
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
    """Finds the smallest set of linen modules to keep in float32 for step 0 to pass.

    Args:
      pair: the JAX half of the pair (``flax_model``: a linen `parity.pairs.adapters.FlaxModel`,
        ``task``, ``name``).
      config: the cell at its low precision.
      batch: ``(inputs, targets)`` of step 0.
      torch_numbers: torch's step-0 `Side` at the run's precision.
      variables: the Flax variables both sides start from.
      loss_scale: the step-0 loss scale torch's side was taken at.
      budget: the most step-0 runs (>= 2).

    Returns:
      A `BisectResult`.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 2:
        raise ValueError(f"bisect: `budget` must be an integer >= 2 runs; got {budget!r}.")
    if config.recipe.baseline or config.compute_dtype == "float32":
        raise ValueError(
            f"bisect: precision {config.precision!r} computes in float32; bisect a low precision."
        )
    if getattr(pair.flax_model, "kind", "linen") != "linen":
        raise ValueError("bisect: the module search runs on flax.linen models only.")
    inputs, targets = (np.asarray(b) for b in batch)
    shapes = program_shapes(pair, variables, inputs, targets)
    candidates = _module_paths(pair.flax_model, variables, inputs)
    results: dict[frozenset, tuple[bool, list[Verdict]]] = {}

    def judge(keep: Sequence[str]) -> bool:
        key = frozenset(keep)
        if key not in results:
            if len(results) >= budget:
                raise StopIteration
            model = pair.flax_model
            fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(FlaxModel)}
            kept = dataclasses.replace(pair, flax_model=_KeptFloat32(**fields, keep=key))
            jax_numbers = jax_side(
                kept, variables, inputs, targets, config, loss_scale, trace_flops=False
            )
            rows, _, _ = stage_verdicts(
                kept,
                config,
                config.precision,
                config.compute_dtype,
                torch_numbers,
                jax_numbers,
                shapes,
            )
            results[key] = (all(v.passed is not False for v in rows), rows)
        return results[key][0]

    def done(keep, outcome, minimal):
        rows = results.get(frozenset(keep), (None, []))[1]
        return BisectResult(
            list(keep), len(results), candidates, outcome, minimal, config.precision, rows
        )

    if judge([]):
        return done([], "passes already", True)
    if not judge(candidates):
        return done(candidates, "no set passes", False)
    keep, minimal = ddmin(candidates, judge)
    return done(keep, "found" if minimal else "budget spent", minimal)


def bisect_golden(golden: Any, flax_model: Any = None, *, budget: int = DEFAULT_BUDGET):
    """`bisect` against a golden file's torch side (no torch needed).

    Args:
      golden: a golden file recorded at a low precision (or a loaded `Golden`).
      flax_model: as `parity.golden.check.check_golden`.
      budget: the most runs.
    """
    golden = golden if isinstance(golden, Golden) else load_golden(golden)
    config = golden.config
    stage = {s["stage"]: s for s in golden.stages}.get(config.precision)
    if stage is None or config.recipe.baseline:
        raise ValueError(
            f"bisect: the golden file was recorded at {config.precision!r}, which computes in "
            "float32: nothing to keep in float32."
        )
    pair = flax_pair(golden, flax_model)
    return bisect(
        pair,
        config,
        golden.batch(0),
        golden.side(stage["stage"]),
        golden.variables(),
        stage["loss_scale"],
        budget=budget,
    )


def add_bisect_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``bisect`` to `parity.cli.commands`'s subcommands."""
    parser = sub.add_parser(
        "bisect",
        help="the smallest set of Flax modules to keep in float32 for a low-precision golden "
        "cell to pass (delta debugging; no torch needed)",
    )
    parser.add_argument("--golden", required=True, help="golden file at a low precision")
    parser.add_argument("--flax-model", default=None, metavar="MODULE:ATTR")
    parser.add_argument(
        "--budget", type=int, default=DEFAULT_BUDGET, help="most step-0 runs (default 64)"
    )
    return parser


def run_bisect(args: argparse.Namespace) -> int:
    """``bisect``'s body: prints the rules and the run count; exit 0 when a set was found."""
    try:
        result = bisect_golden(args.golden, args.flax_model, budget=args.budget)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    print(result.report())
    return 0 if result.outcome in ("found", "passes already") else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m parity bisect ...`` where torch is not installed (`parity.__main__`)."""
    parser = argparse.ArgumentParser(prog="python -m parity")
    add_bisect_parser(parser.add_subparsers(dest="command", required=True))
    return run_bisect(parser.parse_args(["bisect", *(sys.argv[2:] if argv is None else argv)]))
