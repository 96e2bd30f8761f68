"""One judging pass: runs paired once, every applicable check evaluated, one list of qualifiers
applied, each row frozen once. The verdict rules are written once, in the documentation page
"What a PASS means" (``docs/harness/verdicts.md``); this module is the order they are applied in.

`compare_runs(runs)` groups the run records by cell (model, precision, device). In a cell it
pairs each torch run with the JAX run of the same data seed (each torch mode, eager and
torch.compile, separately) and builds one `Pair`: the two main runs, the calibration runs
usable against them (``variant="noise"``: the same framework from weights nudged by one ulp)
and the self-divergence envelope they give, the per-step loss gaps and tolerances, the seed
groups, the steps whose skip decisions differ (loss scaling), the structural differences of the two models and where the loss gap left
the rounding floor. Then:

- ``comparable configs`` first: the two runs must agree on every setting that shapes the
  trajectory (`parity.core.records.TRAJECTORY_FIELDS`) and record the same number of steps
  (unless one stopped early on a non-finite loss, which fails ``no divergence``); otherwise one
  row names each differing field, nothing is judged, never a pass. A run that raised fails
  ``run completed``; a cell this hardware cannot run is ``unsupported here``.
- every check of `parity.verdicts.checks.CHECKS` that applies: the trajectory checks the
  recipe names (`parity.core.recipes.Recipe.verdict_checks`), the final-loss summary, the
  recorded per-step signals, the eval metric and logits, the seed statistics where K >= 2
  data seeds per framework were run;
- `parity.verdicts.qualifiers.QUALIFIERS`, in order, on every row.

The rows a run record stores (step 0's, `parity.verdicts.step0`, as ``run["step0"]["verdicts"]``;
a distributed run's own checks) are judged in their cell and come first in it; where the cell
has no trained comparable pair a passing one is informational (the qualifier ``"no trained
pair"``), never its PASS.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from parity.core.recipes import get_recipe
from parity.core.records import (
    comparable_labels,
    config_differences,
    run_label,
    run_seed,
    run_status,
)
from parity.core.stored_rows import stored_rows
from parity.verdicts import builders, fp16
from parity.verdicts.checks import CHECKS
from parity.verdicts.gaps import loss_floor, loss_gaps, relative_gaps, run_losses, self_divergence
from parity.verdicts.logits import logit_rows
from parity.verdicts.outcomes import seeds_to_decide
from parity.verdicts.qualifiers import qualify, verdict
from parity.verdicts.rows import Row, Verdict, fmt_value
from parity.verdicts.tolerances import TOLERANCES, envelope_ratio, step_tolerances

__all__ = ["Pair", "compare_runs", "judged_pairs"]

# The trajectory checks a recipe may name (`Recipe.verdict_checks`), and what builds their rows.
TRAJECTORY_BUILDERS = {
    "fp8 loss": builders.fp8_loss,
    "loss": builders.loss_windows,
    "scale": fp16.scale_rows,
    "skips": fp16.skip_rows,
    "final loss": builders.final_loss,
}


@dataclasses.dataclass
class Pair:
    """Everything the checks of one torch/JAX pair read, computed once."""

    cell: tuple[str, str, str]
    ref: Mapping[str, Any]
    cand: Mapping[str, Any]
    noise: list[Mapping[str, Any]]
    mains: dict[str, Mapping[str, Any]]
    seed_refs: list[Mapping[str, Any]]
    seed_cands: list[Mapping[str, Any]]
    envelope: list[float] | None
    calibrated_by: str
    recipe_checks: tuple[str, ...]
    ref_losses: list[float | None] = dataclasses.field(default_factory=list)
    cand_losses: list[float | None] = dataclasses.field(default_factory=list)
    floor: float = 0.0
    gaps: list[float] = dataclasses.field(default_factory=list)
    tolerances: list[float] = dataclasses.field(default_factory=list)
    ratio: float = 1.0
    skips: list[fp16.SkipDifference] = dataclasses.field(default_factory=list)
    structural: list[Structural] = dataclasses.field(default_factory=list)
    departure: tuple[int, str] | None = None

    def __post_init__(self) -> None:
        self.ref_losses, self.cand_losses = run_losses(self.ref), run_losses(self.cand)
        self.floor = loss_floor(self.ref_losses)
        self.gaps = relative_gaps(self.ref_losses, self.cand_losses, self.floor)
        self.tolerances = step_tolerances(self.gaps, self.envelope)
        self.ratio = envelope_ratio(self.gaps, self.envelope)
        self.structural = _structural(self.ref, self.cand)

    def final_band(self) -> tuple[float, float | None]:
        """The band of the final loss: `final_loss_rel`, or ``k`` times the self-divergence
        envelope at the end where larger; and that envelope's value (None: uncalibrated)."""
        band = TOLERANCES["final_loss_rel"]
        if not self.envelope:
            return band, None
        end = self.envelope[min(len(self.envelope), len(self.ref_losses)) - 1]
        noise = TOLERANCES["noise_k"] * end
        return (noise if noise > band else band), end

    @property
    def compared(self) -> str:
        return f"{run_label(self.cand)} vs {run_label(self.ref)}"

    @property
    def calibrated(self) -> bool:
        return self.envelope is not None

    @property
    def fp32(self) -> bool:
        """The recipe's trajectory is judged step by step at float32's bands."""
        return "loss" in self.recipe_checks

    @property
    def skipped_apart(self) -> list[int]:
        """Steps where one side skipped and the other applied its update: one side's gradients
        are non-finite there by design; the skip decisions' own row judges them, and per-step
        gradient rows leave them out."""
        n = min(len(self.ref["steps"]), len(self.cand["steps"]))
        return [
            i
            for i in range(n)
            if bool(self.ref["steps"][i].get("skipped"))
            != bool(self.cand["steps"][i].get("skipped"))
        ]

    @property
    def seeds_decide(self) -> bool:
        return len(self.seed_refs) >= 2

    @property
    def adaptive(self) -> bool:
        return (self.ref.get("config") or {}).get("optimizer", "adamw") != "sgd"

    def base(self, seeds: bool = False) -> dict[str, Any]:
        compared = self.compared
        if seeds:
            compared += f", {len(self.seed_refs)}+{len(self.seed_cands)} seeds"
        model, precision, device = self.cell
        return {"model": model, "precision": precision, "device": device, "compared": compared}


# --- rows outside a judged pair -----------------------------------------------------------------


def _not_comparable(ref, cand, differences: list[str]) -> Verdict:
    return verdict(
        ref["model"],
        ref["precision"],
        ref["device"],
        check="comparable configs",
        compared=f"{run_label(cand)} vs {run_label(ref)}",
        value="differ: " + "; ".join(differences),
        tolerance="the same trajectory settings",
        passed=None,
        detail="not comparable: the runs differ in settings that shape the trajectory, so their "
        "gap would measure the settings, not the port; rerun one side with the other's settings "
        "(nothing judged, never a pass)",
        mode="not comparable",
        kind="comparable",
    )


def _left_out(ref, run, differences: list[str]) -> Verdict:
    return verdict(
        ref["model"],
        ref["precision"],
        ref["device"],
        check="calibration run left out",
        compared=f"{run_label(run)} (data seed {run_seed(run)})",
        value="differs: " + "; ".join(differences),
        tolerance="the main run's settings",
        passed=None,
        detail="a calibration or seed run made with other settings says nothing about this "
        "cell's noise; rerun it",
        mode="informational",
        kind="left out",
    )


# --- the pair's context ---------------------------------------------------------------------------


def _envelope(noise, mains) -> tuple[list[float] | None, list[str]]:
    """The self-divergence envelope of the calibration runs against their frameworks' main
    runs (the steps all have, where one stopped early), and the runs it comes from."""
    used = [run for run in noise if loss_gaps(mains[run["framework"]], run)]
    return self_divergence(used, mains), [run_label(run) for run in used]


def _folded(run) -> list[dict[str, Any]]:
    rows = run.get("weight_mapping") or []
    return [r for r in rows if isinstance(r, Mapping) and r.get("folded_into")]


def _padding(run) -> Mapping[str, Any] | None:
    """The step-0 row naming embedding rows torch never trains (kind ``padding rows``), read as
    every stored row is (`parity.core.stored_rows`)."""
    return next((row for _, row in stored_rows(run) if row["kind"] == "padding rows"), None)


class Structural(NamedTuple):
    """A structural difference of the two models: its row's label and value, why a trajectory
    row cannot tell it from a port bug (the qualifier ``"structural difference"``), and the
    step-0 row's note."""

    check: str
    value: str
    reason: str
    note: str


def _structural(ref, cand) -> list[Structural]:
    """Where the weight mapping folds trainable tensors (torch's b_ih + b_hh summed into one
    Flax bias), or torch never trains an embedding row the Flax model trains (``padding_idx``,
    named by step 0), the two models are different models from step 1 on."""
    folded = _folded(ref) or _folded(cand)
    padding = _padding(ref) or _padding(cand)
    found = []
    if folded:
        names = ", ".join(str(r.get("torch")) for r in folded)
        reason = (
            f"the weight mapping folds trainable tensors ({names}): the Flax model trains one "
            "tensor where torch trains several, so the trajectories part by construction; past "
            "step 0 this row cannot tell that from a port bug (step 0 decides)"
        )
        found.append(
            Structural(
                "structural difference (weight mapping)",
                f"{len(folded)} folded",
                reason,
                folded[0].get("note", ""),
            )
        )
    if padding is not None:
        reason = (
            f"torch never trains its embeddings' padding rows ({padding.get('value')}; "
            "nn.Embedding(padding_idx=...)), the Flax Embed trains them: past step 0 the models "
            "train differently wherever a batch holds that token, and this row cannot tell that "
            "from a port bug (step 0 decides)"
        )
        found.append(
            Structural(
                "structural difference (embedding padding rows)",
                str(padding.get("value")),
                reason,
                padding.get("detail", ""),
            )
        )
    return found


# Measured on the built-in resnet at lr 1e-2 (AdamW, batch 8, 20 steps), a correct port: loss gap
# 1e-7, 2e-7, then 3e-5 at step 2 and 2.9% at step 14, while torch's 1-ulp noise run stayed
# within 2.3e-7; torch itself, run from JAX's step-2 parameters, reproduces JAX's gradient jump:
# one ReLU input of blocks.0.bn1 sat 1e-6 from zero.
DEPARTURE_NOTE = (
    "exceeded, not failed: the loss gap stayed within {k:g} x the model's own rounding "
    "divergence through step {last} and left it at step {step} ({gap} against {floor}); runs "
    "that agree to float32 rounding part only where rounding crosses a threshold (a ReLU input "
    "near 0, whose gradient jump AdamW scales per element), which a 1-ulp noise run does not "
    "date; decide with --seeds {seeds} (equivalence)"
)


def _departure(pair: Pair, seeds: int) -> tuple[int, str] | None:
    """``(step, note)`` where a calibrated fp32 loss gap left the rounding floor (``k`` times
    the envelope, at least ``k`` float32 half-ulps) after agreeing to it for at least one step
    past step 0; None when it never agreed past step 0 or never left it."""
    envelope, gaps = pair.envelope, pair.gaps
    if not pair.fp32 or not envelope or len(gaps) < 3:
        return None
    k = TOLERANCES["noise_k"]

    def floor(s):
        level = envelope[min(s, len(envelope) - 1)]
        return k * max(level if math.isfinite(level) else math.inf, TOLERANCES["noise_floor"])

    step = next((s for s in range(1, len(gaps)) if not gaps[s] <= floor(s)), None)
    if step is None or step < 2:
        return None
    note = DEPARTURE_NOTE.format(
        k=k,
        last=step - 1,
        step=step,
        gap=fmt_value(gaps[step]),
        floor=fmt_value(floor(step)),
        seeds=seeds,
    )
    return step, note


# --- one pair -------------------------------------------------------------------------------------


def _pair_rows(pair: Pair) -> list[Verdict]:
    """Every row of one comparable, completed pair, qualified and frozen, in the table's
    order: the pair's own checks, then the seed statistics' difference test, then the rows
    that look past them (signals, equivalence, structural differences)."""
    ref, cand = pair.ref, pair.cand
    bad = []
    for run in (ref, cand):
        s = run["summary"]
        nonfinite = [st["step"] for st in run["steps"] if st.get("loss") is None]
        if s.get("diverged") or nonfinite:
            first = s.get("first_nonfinite_step", nonfinite[0] if nonfinite else None)
            bad.append(f"{run_label(run)} at step {first}")
    rows: list[Row] = [
        Row(
            "divergence",
            "no divergence",
            "diverged: " + ", ".join(bad) if bad else "all losses finite",
            "finite",
            not bad,
            "a non-finite loss is recorded and reported, not compared" if bad else "",
            mode="exact",
        )
    ]
    for kind in pair.recipe_checks:
        rows += TRAJECTORY_BUILDERS[kind](pair)
    rows += builders.max_gap(pair)
    rows += builders.eval_metric(pair)
    rows += logit_rows(pair)
    if pair.seeds_decide:
        rows += builders.welch(pair)
    rows += builders.signals(pair)
    if pair.seeds_decide:
        rows += builders.seed_equivalence(pair)
    rows += builders.structural(pair)
    pair.departure = _departure(pair, seeds_to_decide(rows))
    ordered = [r for r in rows if not r.late] + [r for r in rows if r.late]
    return [qualify(r, pair).freeze(pair.base(seeds=CHECKS[r.kind].over_seeds)) for r in ordered]


# --- all runs -------------------------------------------------------------------------------------


def _stored_rows(runs: Iterable[Mapping[str, Any]]) -> list[tuple[dict[str, Any], Row]]:
    """The rows run records store (step 0's, a distributed run's own checks:
    `parity.core.stored_rows`), each once (the same row stored in both frameworks' records),
    with their cell and pair, to judge in their cell."""
    seen, out = set(), []
    for run in runs:
        for _, data in stored_rows(run):
            base, row = Row.stored(data)
            key = json.dumps([base, dataclasses.asdict(row)], sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                out.append((base, row))
    return out


def _cell_rows(key, members) -> tuple[list[Verdict], bool, list[Pair]]:
    """The rows of one cell's runs, whether a trained comparable pair was judged, and the
    pairs whose checks were evaluated."""
    rows: list[Verdict] = []
    pairs: list[Pair] = []
    for run in members:
        if run_status(run) == "unsupported":
            rows.append(
                verdict(
                    *key,
                    check="unsupported here",
                    compared=run_label(run),
                    value=run.get("reason", ""),
                    tolerance="—",
                    passed=None,
                    detail="this hardware cannot run the cell: reported, not failed, not passed",
                    mode="unsupported here",
                    kind="unsupported",
                )
            )
    usable = [r for r in members if run_status(r) != "unsupported"]
    main = [r for r in usable if not r.get("variant")]
    noise = [r for r in usable if r.get("variant") == "noise"]
    label_pairs = comparable_labels(main)
    primary = None
    for seed in sorted({run_seed(r) for r in main}):
        here = {run_label(r) for r in main if run_seed(r) == seed}
        if any(a in here and b in here for a, b in label_pairs):
            primary = seed
            break
    compared_any = judged_any = False
    reported: set[int] = set()
    for label, jax_label in label_pairs if primary is not None else ():
        at_seed = [r for r in main if run_seed(r) == primary]
        ref = next((r for r in at_seed if run_label(r) == label), None)
        cand = next((r for r in at_seed if run_label(r) == jax_label), None)
        if ref is None or cand is None:
            continue
        mains = {"torch": ref, "jax": cand}
        by_seed: dict[str, dict[int, Mapping[str, Any]]] = {"torch": {}, "jax": {}}
        for run in main:
            if run_label(run) not in (label, jax_label):
                continue
            differences = config_differences(mains[run["framework"]], run)
            if differences:
                if run_seed(run) != primary and id(run) not in reported:
                    reported.add(id(run))
                    rows.append(_left_out(mains[run["framework"]], run, differences))
                continue
            by_seed[run["framework"]].setdefault(run_seed(run), run)
        compared_any = True
        errors = [
            f"{run_label(r)}: {r['summary']['error']}"
            for r in (ref, cand)
            if run_status(r) == "error" or r["summary"].get("error")
        ]
        if errors:
            rows.append(
                verdict(
                    *key,
                    check="run completed",
                    compared=f"{run_label(cand)} vs {run_label(ref)}",
                    value="; ".join(errors),
                    tolerance="no error",
                    passed=False,
                    mode="exact",
                    kind="completed",
                )
            )
            judged_any = True
            continue
        differences = config_differences(ref, cand)
        if differences:
            rows.append(_not_comparable(ref, cand, differences))
            continue
        judged_any = True
        left_out, usable_noise = [], []
        for run in noise:
            if run_seed(run) != primary or run["framework"] not in mains:
                continue
            differences = config_differences(mains[run["framework"]], run)
            if differences:
                left_out.append(_left_out(mains[run["framework"]], run, differences))
            else:
                usable_noise.append(run)
        envelope, sources = _envelope(usable_noise, mains)
        common = sorted(set(by_seed["torch"]) & set(by_seed["jax"]))
        pair = Pair(
            cell=key,
            ref=ref,
            cand=cand,
            noise=usable_noise,
            mains=mains,
            seed_refs=[by_seed["torch"][s] for s in common] if len(common) >= 2 else [],
            seed_cands=[by_seed["jax"][s] for s in common] if len(common) >= 2 else [],
            envelope=envelope,
            calibrated_by=", ".join(sources),
            recipe_checks=get_recipe(ref["precision"]).verdict_checks,
        )
        if "skips" in pair.recipe_checks:
            calibration = [(mains[r["framework"]], r) for r in usable_noise]
            pair.skips = fp16.skip_differences(ref, cand, calibration)
        pairs.append(pair)
        pair_rows = _pair_rows(pair)
        rows += pair_rows[:1] + left_out + pair_rows[1:]
    if not compared_any and usable:
        present = ", ".join(sorted({run_label(r) for r in usable}))
        rows.append(
            verdict(
                *key,
                check="pair",
                compared=present,
                value="only " + present,
                tolerance="torch and jax",
                passed=None,
                detail="nothing compared: a cell needs a torch run and a JAX run with the "
                "same data seed (never a pass)",
                mode="nothing compared",
                kind="pair",
            )
        )
    return rows, judged_any, pairs


def compare_runs(runs: Sequence[dict[str, Any]]) -> list[Verdict]:
    """Verdicts for every torch/JAX pair among `runs`, grouped by (model, precision, device).

    Args:
      runs: run records (results.json's ``runs``): main runs, calibration runs
        (``variant="noise"``) and seed runs (other ``config.data_seed``) alike; the rows they
        store (step 0's) come first in their cell, informational where a passing one's cell has
        no trained comparable pair (the qualifier ``"no trained pair"``).

    Returns:
      `Verdict` rows; a cell without both frameworks gets one row with ``passed=None`` saying so,
      and a pair that is not comparable (`parity.core.records.config_differences`) one row
      (``mode="not comparable"``) naming each differing setting.

    Example:
      >>> compare_runs([])
      []
    """
    groups = _groups(runs)
    stored = _stored_rows(runs)

    def judged(rows, cell_judged):
        return [qualify(row, cell_judged, "stored").freeze(base) for base, row in rows]

    verdicts: list[Verdict] = []
    for key in sorted(groups):
        cell_rows, judged_any, _ = _cell_rows(key, groups[key])
        here = [(base, row) for base, row in stored if _cell(base) == key]
        verdicts.extend(judged(here, judged_any) + cell_rows)
    verdicts.extend(judged([(b, r) for b, r in stored if _cell(b) not in groups], False))
    return verdicts


def judged_pairs(runs: Sequence[dict[str, Any]]) -> list[Pair]:
    """The trained torch/JAX pairs `compare_runs` judges, in cell order, each with its one
    context (loss gaps, per-step tolerances, the calibration runs it uses and their envelope):
    what the report plots.

    Example:
      >>> judged_pairs([])
      []
    """
    groups = _groups(runs)
    return [pair for key in sorted(groups) for pair in _cell_rows(key, groups[key])[2]]


def _groups(runs) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    groups: dict[tuple, list] = {}
    for run in runs:
        groups.setdefault((run["model"], run["precision"], run["device"]), []).append(run)
    return groups


def _cell(base: Mapping[str, Any]) -> tuple[str, str, str]:
    return (base["model"], base["precision"], base["device"])
