"""Verdicts with power (parity.verdicts.judge, parity.verdicts.rows): a check whose tolerance is
above its bound decides nothing, PASS needs a decisive check past step 0, every step is judged,
chaotic trajectories stop at their horizon, seed statistics decide by equivalence, and
compare_models takes the command line's options."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import shlex

import flax.linen as fnn
import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.standard_promotion, pytest.mark.torch]  # optax/flax internals train

from conftest import fake_run as _run  # noqa: E402

import parity  # noqa: E402
from parity.cli import commands as cli  # noqa: E402
from parity.core import flags  # noqa: E402
from parity.core.records import run_seed, validate_run  # noqa: E402
from parity.verdicts.builders import equivalence  # noqa: E402
from parity.verdicts.fp16 import skip_differences  # noqa: E402
from parity.verdicts.judge import compare_runs  # noqa: E402
from parity.verdicts.outcomes import (  # noqa: E402
    cell_bottom_lines,
    cell_configs,
    format_verdicts,
    overall_status,
)
from parity.verdicts.qualifiers import verdict  # noqa: E402
from parity.verdicts.rows import Verdict  # noqa: E402
from parity.verdicts.tolerances import POWER_BOUNDS, step_tolerances  # noqa: E402

CELL = ("m", "fp32", "cpu")


def _judged(runs):
    return compare_runs(runs)


def _chaos(n, start_gap, seed, rate=1.6):
    rng = np.random.default_rng(seed)
    base = 2.0 * np.exp(-np.arange(n) / 40) + 0.3
    gap = np.minimum(start_gap * rate ** np.arange(n), 0.3)
    return base, base * (1 + rng.choice([-1, 1], n) * gap)


def _row(check, tolerance, passed=True, kind="loss", **fields):
    """A row made outside a judging pass, judged by the qualifiers that read no pair."""
    return verdict(*CELL, check, "jax vs torch", 0.0, tolerance, passed, kind=kind, **fields)


# --- power ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "check, kind, tolerance, decides",
    [
        ("step 0 bf16-mixed: gradients", "step 0 gradients", 3.25, False),  # all-zero scores 1
        ("step 0 bf16-mixed: gradients", "step 0 gradients", 0.9, True),
        ("final loss (mean of last 5)", "final loss", 21.23, False),  # the ResNet bf16 2,123%
        ("final loss (mean of last 5)", "final loss", 0.05, True),
    ],
)
def test_a_pass_above_the_bound_is_inconclusive_never_a_pass(check, kind, tolerance, decides):
    row = _row(check, tolerance, kind=kind, detail="measured", mode="step 0")
    assert row.power == tolerance
    if decides:
        assert row.passed is True and row.mode == "step 0" and not row.qualified_by
    else:
        assert row.passed is None and row.mode == "inconclusive"
        assert row.qualified_by == "no power"
        assert "no power" in row.detail and "measured" in row.detail
    # A failing row stays a failure whatever its power.
    assert _row(check, tolerance, kind=kind, passed=False).passed is False
    # A frozen row is never rewritten: read back, it is the row that was stored; and a
    # Verdict judges nothing when built (the qualifiers do, before it is frozen).
    stored = Verdict.from_dict(row.to_dict())
    assert stored == row
    built = Verdict(*CELL, check, "jax vs torch", 0.0, tolerance, True, kind=kind)
    assert built.passed is True and built.power is None and not built.detail


def test_three_outcomes_and_their_exit_codes():
    step0 = _row("step 0 fp32: gradients", 1e-4, kind="step 0 gradients", mode="step 0")
    blind = _row("per-step loss, steps 10-29", 1.22)  # resnet's calibrated 122%
    decisive = _row("per-step loss, steps 0-9", 1e-4, mode="fixed bands")
    failing = _row("per-step loss, steps 10-29", 1e-3, passed=False)

    only_step0 = [step0, blind]
    assert overall_status(only_step0) == "INCONCLUSIVE"
    line = cell_bottom_lines(only_step0)[CELL]
    assert line.startswith("parity INCONCLUSIVE") and "--seeds 5" in line
    assert "above the bound" in line and "INCONCLUSIVE" in format_verdicts(only_step0)

    passing = [step0, decisive, blind]
    assert overall_status(passing) == "PASS"
    line = cell_bottom_lines(passing)[CELL]
    assert "decisive after step 0: per-step loss, steps 0-9" in line and "0.0001" in line

    assert overall_status([*passing, failing]) == "FAIL"
    assert [cli._exit_code(s) for s in ("PASS", "FAIL", "NOTHING COMPARED", "INCONCLUSIVE")] == [
        0,
        1,
        3,
        4,
    ]


def test_the_deciding_command_reruns_the_cells_own_run_with_only_the_deciding_options(tmp_path):
    from parity.core.config import RunConfig
    from parity.report.markdown import write_report

    config = RunConfig(
        model="resnet",
        precision="fp32",
        steps=20,
        batch_size=8,
        seed=4,
        data="digits",
        optimizer="sgd",
        lr=1e-2,
        weight_decay=0.05,
        momentum=0.8,
        schedule="constant",
        lr_warmup_steps=3,
        clip_norm=None,
        timing_warmup=1,
        init_scale=2.0**10,
        growth_interval=7,
        torch_compile=True,
        eval=False,
        model_overrides={"image_shape": (8, 8, 3), "channels": (4, 8, 8)},
    )
    cell = ("resnet", "fp32", "cpu")
    rows = [
        verdict(
            *cell,
            "step 0 fp32: gradients",
            "jax vs torch",
            0.0,
            1e-4,
            True,
            kind="step 0 gradients",
            mode="step 0",
        ),
        verdict(*cell, "per-step loss, steps 10-19", "jax vs torch", 0.0, 1.22, True, kind="loss"),
    ]
    runs = [
        {**_run(fw, [2.0, 1.5, 1.2]), "model": "resnet", "config": config.to_dict()}
        for fw in ("torch", "jax")
    ]
    # the report's bottom line reads the cell's config from its runs
    report = write_report(tmp_path, runs, rows).read_text()
    line = next(x for x in report.splitlines() if x.startswith("- **resnet fp32 (cpu)**"))
    assert "parity INCONCLUSIVE" in line
    assert cell_bottom_lines(rows, {cell: config.to_dict()})[cell] in line
    command = line.split("to decide: ", 1)[1].split(" (your own pair", 1)[0]
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "parity", "run"]
    args = cli.build_parser().parse_args(argv[3:])
    # the run's own config, every setting, and only the deciding options added
    assert cli._config_from_args(args, args.model, args.precision) == config
    assert (args.noise, args.seeds, args.framework) == ("torch", 5, "both")
    settings = {flags.option(f.name) for f in dataclasses.fields(RunConfig)}
    settings |= {"--torch-compile", "--no-eval"}
    options = {a for a in argv[4:] if a.startswith("--")}
    assert options - settings == {"--noise", "--seeds", "--out"}
    # the terminal's table (write_outputs, golden check, parity.testing, the distributed runner)
    # prints the same command, from the runs' configs
    assert cell_configs(runs) == {cell: config.to_dict()}
    undecided = Verdict(*cell, "final loss", "jax vs torch", 0.1, 0.05, None, mode="inconclusive")
    rows_undecided = [*rows, undecided]
    assert overall_status(rows_undecided) == "INCONCLUSIVE"
    printed = format_verdicts(rows_undecided, cell_configs(runs))
    assert cell_bottom_lines(rows_undecided, {cell: config.to_dict()})[cell] in printed
    assert "--steps 20" in printed and "--steps" not in format_verdicts(rows_undecided)
    # without a config, the cell alone; a setting the command line cannot set is named
    assert "--steps" not in cell_bottom_lines(rows)[cell]
    betas = {**config.to_dict(), "betas": [0.8, 0.9]}
    assert (
        "not settable from the command line: betas=[0.8, 0.9]"
        in (cell_bottom_lines(rows, {cell: betas})[cell])
    )


# --- every step judged, chaos stops at its horizon ---------------------------------------------


def test_every_step_of_a_long_fp32_run_is_judged():
    base = np.linspace(2.3, 1.0, 40)
    cand = base * (1 + 3e-5)
    cand[35] = base[35] * (1 + 5e-3)  # past the fixed bands' 30 steps
    judged = _judged([_run("torch", base), _run("jax", cand)])
    (late,) = [v for v in judged if v.check == "per-step loss, steps 30-39"]
    # Judged, and named; uncalibrated past step 30 a gap cannot be told from the model's own
    # chaotic growth (the README's 300-step cnn fp32 cell, a correct port, reaches 1.5% by step
    # 249), so the row exceeded its band and is excused, not failed; the cell is INCONCLUSIVE
    # with the command that decides, never a PASS.
    assert late.passed is None and late.mode == "exceeded"
    assert late.first_failing_step == 35 and "--noise torch" in late.detail
    assert overall_status(judged) == "INCONCLUSIVE"
    line = cell_bottom_lines(judged)[CELL]
    assert "per-step loss, steps 30-39 exceeded its band" in line and "--noise torch" in line
    # within the band past step 30, the same rows decide a PASS
    cand[35] = base[35] * (1 + 3e-5)
    assert overall_status(_judged([_run("torch", base), _run("jax", cand)])) == "PASS"


def test_a_chaotic_trajectory_decides_up_to_its_horizon_only():
    n = 40
    base, noisy = _chaos(n, 1e-7, seed=1)
    _, jax = _chaos(n, 2e-6, seed=2)
    runs = [_run("torch", base), _run("jax", jax), _run("torch", noisy, variant="noise")]
    judged = _judged(runs)
    per_step = [v for v in judged if v.check.startswith("per-step loss")]
    bound = POWER_BOUNDS["loss"]
    # No row passes with a tolerance above the bound; the blind steps are inconclusive.
    assert all(v.power is not None and v.power <= bound for v in per_step if v.passed)
    beyond = [v for v in per_step if "beyond the horizon" in v.check]
    assert beyond and all(v.passed is None and v.mode == "inconclusive" for v in beyond)
    # Every step 0..n-1 is in exactly one row.
    covered = []
    for v in per_step:
        first, last = v.check.split("steps ")[1].split(" ")[0].split("-")
        covered += range(int(first), int(last) + 1)
    assert sorted(covered) == list(range(n))
    # The decisive steps are those whose calibrated tolerance is within the bound.
    tolerances = step_tolerances(
        [abs(a - b) / a for a, b in zip(base, jax, strict=True)],
        [
            max(abs(a - b) / a for a, b in zip(base[: s + 1], noisy[: s + 1], strict=True))
            for s in range(n)
        ],
    )
    horizon = next(s for s, t in enumerate(tolerances) if s >= 10 and t > bound)
    assert any(v.check == f"per-step loss, steps 10-{horizon - 1} (horizon)" for v in per_step)
    line = cell_bottom_lines(judged)[CELL]
    assert line.startswith("parity PASS") and "inconclusive" in line


def test_a_chaotic_run_with_nothing_decisive_is_inconclusive_not_pass():
    # A gap that saturates at once: the calibrated tolerance is above the bound from step 1.
    n = 12
    base, noisy = _chaos(n, 0.05, seed=1, rate=3.0)
    _, jax = _chaos(n, 0.05, seed=2, rate=3.0)
    jax[0] = base[0] * (1 + 1e-6)
    noisy[0] = base[0]
    runs = [_run("torch", base), _run("jax", jax), _run("torch", noisy, variant="noise")]
    raw = compare_runs(runs)
    judged = raw
    assert overall_status(judged) == "INCONCLUSIVE"
    assert cli._exit_code(overall_status(judged)) == 4
    assert "--noise torch --seeds 5" in cell_bottom_lines(judged)[CELL]


# --- seed statistics: equivalence, not a failure to reject --------------------------------------


def test_equivalence_decides_three_ways():
    assert equivalence([1.0, 1.01, 0.99, 1.0], [1.0, 1.02, 0.98, 1.01], margin=0.05)[0] is True
    assert equivalence([1.0, 1.01, 0.99], [1.5, 1.51, 1.49], margin=0.05)[0] is False
    # Three seeds with a wide spread: a t-test would not reject equal means; that proves nothing.
    assert equivalence([1.0, 1.4, 0.7], [1.1, 0.8, 1.3], margin=0.05)[0] is None
    assert equivalence([2.0, 2.0], [2.0, 2.0], margin=0.01)[0] is True  # no spread


def _seed_cell(torch_finals, jax_finals):
    runs = []
    for seed, (a, b) in enumerate(zip(torch_finals, jax_finals, strict=True)):
        runs.append(_run("torch", [2.3, 1.5, a], "bf16-mixed", data_seed=seed))
        runs.append(_run("jax", [2.3, 1.5, b], "bf16-mixed", data_seed=seed))
    judged = _judged(runs)
    (row,) = [v for v in judged if v.check.startswith("final loss over seeds (equivalence)")]
    welch = [v for v in judged if "Welch" in v.check]
    assert welch and all(v.passed is None for v in welch)  # shown, never deciding
    return row, judged


def test_seed_statistics_pass_only_on_shown_equivalence():
    row, judged = _seed_cell([1.00, 1.01, 0.99, 1.00], [1.005, 1.0, 0.995, 1.01])
    assert row.passed is True and overall_status(judged) == "PASS"
    assert "equivalence" in cell_bottom_lines(judged)[("m", "bf16-mixed", "cpu")]
    row, judged = _seed_cell([1.0, 1.4, 0.7], [1.1, 0.8, 1.3])
    assert row.passed is None and overall_status(judged) == "INCONCLUSIVE"
    assert "seeds per framework would decide" in row.detail
    row, judged = _seed_cell([1.0, 1.01, 0.99], [1.5, 1.51, 1.49])
    assert row.passed is False and overall_status(judged) == "FAIL"


def test_an_undecided_equivalence_asks_for_the_seeds_its_spread_needs():
    # Re-running the default --seeds 5 after five undecided seeds would decide nothing again.
    row, judged = _seed_cell([1.0, 1.6, 0.5, 1.4, 0.6], [1.2, 0.5, 1.5, 0.7, 1.3])
    assert row.passed is None
    needed = int(row.detail.split("about ")[1].split(" seeds")[0])
    assert needed > 5
    line = cell_bottom_lines(judged)[("m", "bf16-mixed", "cpu")]
    assert f"--seeds {needed} " in line and f"seeds={needed})" in line


# --- fp16: which parameter overflowed, and whether it was a rounding flip ----------------------


def _fp16_pair(other_max):
    skip = {"skipped": True, "max_scaled_grad": {"fc.weight": None, "fc.bias": 10.0}}
    applied = {"skipped": False, "max_scaled_grad": {"fc.weight": other_max, "fc.bias": 9.0}}
    torch_run = _run("torch", [2.3, 2.0, 1.9], "fp16-mixed", steps_extra={1: skip})
    jax_run = _run("jax", [2.3, 2.0, 1.9], "fp16-mixed", steps_extra={1: applied})
    return torch_run, jax_run


def test_a_differing_skip_names_the_parameter_and_a_rounding_flip():
    (flip,) = skip_differences(*_fp16_pair(65500.0))
    assert flip.explained and "rounding flip" in flip.text
    assert "fc.weight" in flip.text and flip.step == 1
    (real,) = skip_differences(*_fp16_pair(1000.0))
    assert not real.explained and "fc.weight" in real.text
    assert "not within 4 float16 ulps" in real.text
    assert math.isclose(real.ratio, 1000.0 / 65504.0)


# --- compare_models takes the command line's options --------------------------------------------


class _TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x)


class _FlaxNet(fnn.Module):
    @fnn.compact
    def __call__(self, x):
        return fnn.Dense(3, name="fc")(x)


@pytest.mark.integration
def test_compare_models_takes_seeds_threads_and_a_budget(tmp_path):
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 3, 8)) for _ in range(3)
    ]
    result = parity.compare_models(
        _TorchNet(),
        _FlaxNet(),
        batches=batches,
        precision="bf16-mixed",
        seeds=2,
        budget=3,
        threads=len(os.sched_getaffinity(0)),
        fp16_stress=True,
        step0=False,
        out_dir=tmp_path,
        plots=False,  # the report's text is checked, not its plots
    )
    seeds = sorted({(r["framework"], run_seed(r)) for r in result.runs})
    assert len(seeds) in (4, 6)  # 2 orders, and a third when 2 did not decide
    assert result.status in ("PASS", "INCONCLUSIVE") and result.passed == (result.status == "PASS")
    assert any("equivalence" in v.check for v in result.verdicts)
    assert "over seeds (equivalence)" in result.report_path.read_text()
    with pytest.raises(ValueError, match="budget"):
        parity.compare_models(_TorchNet(), _FlaxNet(), batches=batches, budget=0)


# --- per-step signals in every run record --------------------------------------------------------


def test_both_trainers_record_gradient_and_update_norms_and_scaled_maxima():
    from parity.core.config import RunConfig
    from parity.models import get_model_pair
    from parity.training.trainers import train_framework

    tiny = {"image_shape": (4, 4, 3), "hidden": 8}
    config = RunConfig(
        model="mlp", precision="fp16-mixed", steps=2, batch_size=4, eval=False, model_overrides=tiny
    )
    pair = get_model_pair("mlp", seed=0, **tiny)
    torch_run, jax_run = (train_framework(fw, config, pair) for fw in ("torch", "jax"))
    for run in (torch_run, jax_run):
        validate_run(run)
        for step in run["steps"]:
            assert step["grad_norm"] > 0 and step["update_norm"] > 0
            assert len(step["max_scaled_grad"]) == 6  # three layers' weights and biases
    for a, b in zip(torch_run["steps"], jax_run["steps"], strict=True):
        # fp16 forward on both sides: the unscaled norms agree to float16 rounding.
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2)
        assert max(b["max_scaled_grad"].values()) == pytest.approx(
            max(a["max_scaled_grad"].values()), rel=1e-2
        )
    assert {"fc1.weight", "fc3.bias"} <= set(torch_run["steps"][0]["max_scaled_grad"])
    assert {"fc1/kernel", "fc3/bias"} <= set(jax_run["steps"][0]["max_scaled_grad"])
    rows = _judged([torch_run, jax_run])
    (norm_row,) = [v for v in rows if v.check.startswith("per-step gradient norm")]
    # Judged (a gap above 50% fails), but below fp32 its tolerance is above the 20% bound of a
    # norm: it never makes a PASS.
    assert norm_row.power == 0.5 and norm_row.passed is None and norm_row.mode == "inconclusive"


# --- structural differences and the report --------------------------------------------------------


def test_a_folded_mapping_makes_a_later_trajectory_failure_inconclusive_with_the_reason():
    base = np.linspace(2.3, 1.0, 12)
    cand = base * (1 + 3e-5)
    cand[7:] = base[7:] * (1 + 5e-3)  # parts at step 7: the two models train differently
    folded = [
        {
            "torch": "rnn.bias_hh_l0",
            "flax": "cell/hn/bias",
            "note": "summed with rnn.bias_ih_l0",
            "folded_into": "params/cell/hn/bias",  # what the judge reads, not the note's words
        }
    ]
    runs = [_run("torch", base), _run("jax", cand)]
    assert overall_status(_judged(runs)) == "FAIL"
    for run in runs:
        run["weight_mapping"] = folded
    judged = _judged(runs)
    (row,) = [v for v in judged if v.check == "per-step loss, steps 0-9"]
    assert row.passed is None and "folds trainable tensors (rnn.bias_hh_l0)" in row.detail
    assert any(v.check == "structural difference (weight mapping)" for v in judged)
    assert overall_status(judged) == "INCONCLUSIVE"
    # A gap at step 0 (same weights on both sides) still fails.
    wrong = base * 1.01
    runs = [_run("torch", base), _run("jax", wrong)]
    for run in runs:
        run["weight_mapping"] = folded
    assert overall_status(_judged(runs)) == "FAIL"


def test_a_padding_row_torch_never_trains_makes_a_later_failure_inconclusive_with_the_reason():
    from parity.verdicts.rows import PADDING_CHECK

    base = np.linspace(2.3, 1.0, 12)
    cand = base * (1 + 3e-5)
    cand[7:] = base[7:] * (1 + 5e-3)
    named = Verdict(
        *CELL,
        PADDING_CHECK,
        "the weight mapping",
        "1 embedding(s)",
        "-",
        None,
        detail="emb.weight row 0 -> emb/embedding",
        mode="informational",
        kind="padding rows",  # the row's identity: its kind, not its label
    ).to_dict()
    runs = [_run("torch", base), _run("jax", cand)]
    assert overall_status(_judged(runs)) == "FAIL"
    for run in runs:
        run["step0"] = {"passed": True, "verdicts": [named]}
    judged = _judged(runs)
    assert overall_status(judged) != "FAIL"
    (late,) = [v for v in judged if v.first_failing_step == 7]
    assert late.mode == "exceeded" and "padding rows" in late.detail
    assert any(v.check == "structural difference (embedding padding rows)" for v in judged)
    # A gap at step 0 still fails.
    runs = [_run("torch", base), _run("jax", base * 1.01)]
    for run in runs:
        run["step0"] = {"passed": True, "verdicts": [named]}
    assert overall_status(_judged(runs)) == "FAIL"


def test_the_report_shows_power_inconclusive_rows_and_the_gap_panel(tmp_path):
    from parity.report.markdown import write_report

    n = 12
    base, noisy = _chaos(n, 0.05, seed=1, rate=3.0)
    _, jax = _chaos(n, 0.05, seed=2, rate=3.0)
    jax[0], noisy[0] = base[0] * (1 + 1e-6), base[0]
    runs = [_run("torch", base), _run("jax", jax), _run("torch", noisy, variant="noise")]
    path = write_report(tmp_path, runs, _judged(runs))
    text = path.read_text()
    assert "Overall: **INCONCLUSIVE**" in text and "could detect" in text
    assert "**inconclusive**" in text and "--seeds 5" in text
    assert (tmp_path / "gaps.png").exists() and "gaps.png" in text


# --- a departure from the rounding floor (a threshold crossed), not a port difference ----------


def _departing(gaps):
    base = np.linspace(2.3, 1.5, len(gaps))
    return base, base * (1 + np.asarray(gaps))


def test_a_departure_from_the_rounding_floor_is_inconclusive_a_gap_from_step_1_fails():
    n = 12
    floor = [1e-7 * (-1) ** i for i in range(n)]  # the noise run: float32 rounding, no chaos
    base, noisy = _departing(floor)
    # The built-in resnet at lr 1e-2, a correct port: at rounding for two steps, then a ReLU
    # input crossed by rounding parts the runs (3e-5 at step 2, 2.9% at step 14).
    crossed = [1e-7, 2e-7, 3e-5, 4e-6, 4e-4, 9e-4, 1e-5, 2e-3, 2e-3, 1e-3, 8e-4, 2e-2]
    _, jax = _departing(crossed)
    runs = [_run("torch", base), _run("jax", jax), _run("torch", noisy, variant="noise")]
    raw = compare_runs(runs)
    judged = raw
    per_step = [v for v in judged if v.check.startswith("per-step loss")]
    assert per_step and all(v.passed is None and v.mode == "exceeded" for v in per_step)
    assert "left it at step 2" in per_step[0].detail and "--seeds 5" in per_step[0].detail
    assert overall_status(judged) == "INCONCLUSIVE"
    assert "--seeds 5" in cell_bottom_lines(judged)[CELL]
    # A gap above the floor from step 1 on is a port difference: it fails.
    _, systematic = _departing([1e-7, 5e-5, 1e-4, 3e-4, 6e-4] + [1e-3] * (n - 5))
    runs = [_run("torch", base), _run("jax", systematic), _run("torch", noisy, variant="noise")]
    assert overall_status(_judged(runs)) == "FAIL"
    # Where seed runs left the equivalence undecided, the departure's note and the cell's
    # deciding command ask for the same seeds: those the equivalence row's spread needs.
    runs = [_run("torch", base), _run("jax", jax), _run("torch", noisy, variant="noise")]
    rng = np.random.default_rng(0)
    for seed in range(1, 5):
        runs.append(_run("torch", base * (1 + rng.normal(0, 0.1)), data_seed=seed))
        runs.append(_run("jax", base * (1 + rng.normal(0, 0.1)), data_seed=seed))
    judged = _judged(runs)
    (equivalence_row,) = [v for v in judged if v.check.startswith("final loss over seeds (eq")]
    needed = int(re.search(r"about (\d+) seeds", equivalence_row.detail).group(1))
    assert needed > 5
    per_step = [v for v in judged if v.check.startswith("per-step loss")]
    assert per_step and all(f"--seeds {needed} (equivalence)" in v.detail for v in per_step)
    assert f"--seeds {needed} " in cell_bottom_lines(judged)[CELL]
    # Without a noise run nothing measured the floor: the fixed bands decide.
    assert overall_status(_judged([_run("torch", base), _run("jax", jax)])) == "FAIL"


def _scaled_runs(torch_skips, jax_skips, maxima, steps=10, init=1024.0, interval=3):
    """An fp16 pair whose recorded scales follow GradScaler from each side's own skips;
    `maxima[(framework, step)]` is that side's {parameter: largest |scaled gradient|}."""
    runs = []
    for framework, skips in (("torch", torch_skips), ("jax", jax_skips)):
        scale, tracker, extra = init, 0, {}
        for i in range(steps):
            default = {"fc.weight": 100.0, "fc.bias": 10.0}
            extra[i] = {
                "loss_scale": scale,
                "skipped": i in skips,
                "max_scaled_grad": maxima.get((framework, i), default),
            }
            if i in skips:
                scale, tracker = scale / 2, 0
            else:
                tracker += 1
                if tracker == interval:
                    scale, tracker = scale * 2, 0
        run = _run(
            "torch" if framework == "torch" else "jax",
            [2.0] * steps,
            "fp16-mixed",
            steps_extra=extra,
        )
        run["config"].update(init_scale=init, growth_interval=interval)
        runs.append(run)
    return runs


def test_after_a_rounding_flip_the_scales_are_realigned_and_the_comparison_goes_on():
    overflow = {"fc.weight": None, "fc.bias": 10.0}
    flip = {("torch", 2): overflow, ("jax", 2): {"fc.weight": 65490.0, "fc.bias": 9.0}}
    # After the flip the sides back off and grow at different steps: at step 7 jax's scale is
    # 4x torch's, and jax overflows where torch holds 40000 (160000 at jax's scale: explained).
    later = {("jax", 7): overflow, ("torch", 7): {"fc.weight": 40000.0, "fc.bias": 9.0}}
    runs = _scaled_runs({2, 6}, {6, 7}, {**flip, **later})
    judged = _judged(runs)
    cell = ("m", "fp16-mixed", "cpu")
    by_check = {v.check: v for v in judged if v.cell == cell}
    # The skips part at the flip and at step 7, each explained at the skipping side's scale;
    # each side's scale follows its own skips (they part from step 3).
    skips = by_check["skip decisions"]
    assert skips.passed is True and "[2, 7]" in skips.value and skips.mode == "flip window"
    scale = by_check["loss-scale trajectory"]
    assert scale.passed is True and scale.value.endswith("apart from step 3")
    assert overall_status(judged) != "FAIL"
    # A later difference the scales do not explain fails, naming the step and the parameter.
    later[("torch", 7)] = {"fc.weight": 10000.0, "fc.bias": 9.0}  # 40000 at jax's scale
    judged = _judged(_scaled_runs({2, 6}, {6, 7}, {**flip, **later}))
    (row,) = [v for v in judged if v.check == "skip decisions"]
    assert row.passed is False and row.first_failing_step == 7 and "(fc.weight)" in row.detail
    assert "rounding flips at steps [2]" in row.detail
    assert overall_status(judged) == "FAIL"
    # A side whose scale does not follow its own skips fails the scale rule.
    runs = _scaled_runs({2, 6}, {6}, flip)
    runs[1]["steps"][8]["loss_scale"] *= 4
    (row,) = [v for v in _judged(runs) if v.check == "loss-scale trajectory"]
    assert row.passed is False and row.first_failing_step == 8 and "jax step 8" in row.detail


def test_an_overflow_in_an_intermediate_is_named_as_such():
    applied = {"fc.weight": 65500.0, "fc.bias": 9.0}
    for skipper, words in (
        ({"fc.weight": None, "fc.bias": None}, "every parameter's gradient (2 of 2)"),
        ({"fc.weight": 5.0, "fc.bias": 1.0}, "no parameter's gradient overflowed"),
    ):
        runs = _scaled_runs({2}, set(), {("torch", 2): skipper, ("jax", 2): applied})
        (difference,) = skip_differences(*runs)
        assert words in difference.text and "intermediate" in difference.text
        assert "fc.weight" not in difference.text.split("applied")[0]
    # A flip with nothing after it: the skips rule tested the flip (a pass within the window).
    runs = _scaled_runs({2}, set(), {("torch", 2): {"fc.weight": None}, ("jax", 2): applied})
    (row,) = [v for v in _judged(runs) if v.check == "skip decisions"]
    assert row.passed is True and "step 2: torch skipped" in row.detail


def test_a_skip_flip_within_the_models_own_noise_is_explained_and_one_beyond_fails():
    """resnet fp16-mixed (matrix, seed 0): torch skipped at step 5 while JAX's largest |scaled
    gradient| sat at 0.931 of float16's max; torch's own 1-ulp noise run had moved the
    per-parameter maxima by 8.7% by then. A flip within twice that spread is the model's
    rounding, not a port difference; the same gap without a calibration run, or with a quiet
    one, still fails."""
    overflow = {"fc.weight": None, "fc.bias": 10.0}
    flip = {("torch", 2): overflow, ("jax", 2): {"fc.weight": 61000.0, "fc.bias": 9.0}}
    runs = _scaled_runs({2}, set(), flip)

    def noise_run(spread):
        run = copy.deepcopy(runs[0])
        run["variant"] = "noise"
        for step in run["steps"]:
            maxima = step["max_scaled_grad"]
            step["max_scaled_grad"] = {
                k: (v * (1 + spread) if isinstance(v, float) else v) for k, v in maxima.items()
            }
        return run

    def skips(judged):
        (row,) = [v for v in judged if v.check == "skip decisions"]
        return row

    # no calibration: 0.931 of the max is far outside 4 ulps
    judged = _judged(runs)
    assert skips(judged).passed is False and skips(judged).first_failing_step == 2
    assert overall_status(judged) == "FAIL"
    # the model's own noise moves the maxima 5%: the window is 10%, 0.931 is inside it
    judged = _judged([*runs, noise_run(0.05)])
    row = skips(judged)
    assert row.passed is True and row.mode == "flip window" and "1-ulp noise run" in row.detail
    assert "within 0.1 of float16 max" in row.tolerance
    assert overall_status(judged) != "FAIL"
    # a quiet noise run (0.5%: window 1%) does not explain a gap of 7%
    judged = _judged([*runs, noise_run(0.005)])
    assert skips(judged).passed is False
    assert overall_status(judged) == "FAIL"


def test_a_late_skip_flip_without_a_noise_run_is_exceeded_not_failed():
    """cnn fp16-mixed, 60 steps (matrix seed 0): torch skipped at step 49 while JAX's largest
    |scaled gradient| sat at 0.985 of float16's max, outside the 4-ulp window; by then the sides'
    gradient maxima had parted by percent (chaos), and with both frameworks' 1-ulp noise runs the
    window was 0.14: a flip. Without a noise run, past step 30, the row is exceeded (the cell
    INCONCLUSIVE, deciding with --noise torch), never a pass; a noise run decides it."""
    overflow = {"fc.weight": None, "fc.bias": 10.0}
    late = {("torch", 35): overflow, ("jax", 35): {"fc.weight": 64544.0, "fc.bias": 9.0}}
    runs = _scaled_runs({35}, set(), late, steps=40)
    judged = _judged(runs)
    (row,) = [v for v in judged if v.check == "skip decisions"]
    assert row.passed is None and row.mode == "exceeded" and "--noise torch" in row.detail
    assert overall_status(judged) == "INCONCLUSIVE"
    assert "--noise torch" in cell_bottom_lines(judged)[("m", "fp16-mixed", "cpu")]
    # the gradient-norm row leaves the step out: the skip row judges it
    assert all(v.passed is not False for v in judged)
    noisy = copy.deepcopy(runs[0])
    noisy["variant"] = "noise"
    for step in noisy["steps"]:
        step["max_scaled_grad"] = {
            k: (v * 1.01 if isinstance(v, float) else v) for k, v in step["max_scaled_grad"].items()
        }
    (row,) = [v for v in _judged([*runs, noisy]) if v.check == "skip decisions"]
    assert row.passed is True and row.mode == "flip window"
    # the same difference early (step 5) is a failure
    runs = _scaled_runs(
        {5}, set(), {("torch", 5): overflow, ("jax", 5): late[("jax", 35)]}, steps=40
    )
    assert overall_status(_judged(runs)) == "FAIL"


def test_an_exceeded_row_a_noise_run_decides_makes_the_cell_run_it(monkeypatch):
    """The harness decides an uncalibrated chaotic cell itself: run_cell(escalate=True) runs
    the 1-ulp torch calibration run (here faked) when a row exceeded its band past step 30, and
    the cell is decided; without escalation it stays INCONCLUSIVE."""
    from parity import cell
    from parity.core.config import RunConfig
    from parity.golden.format import BatchList
    from parity.verdicts.qualifiers import escalation

    n = 40
    base = np.linspace(2.3, 1.0, n)
    jax, noisy = base.copy(), base.copy()
    jax[33:] *= 1.01  # parts past step 30: beyond the fixed bands' reach, within chaos
    noisy[31:] *= 1.005  # torch's own 1-ulp run parts there too
    trained = {"torch": _run("torch", base), "jax": _run("jax", jax)}
    judged = _judged(list(trained.values()))
    assert overall_status(judged) == "INCONCLUSIVE" and escalation(judged)
    asked = []

    def calibration_runs(config, pair, *, noise, **_):
        asked.append(noise)
        return [_run("torch", noisy, variant="noise")] if noise == "torch" else []

    monkeypatch.setattr(cell, "train_framework", lambda fw, *a, **k: copy.deepcopy(trained[fw]))
    monkeypatch.setattr(cell, "calibration_runs", calibration_runs)
    monkeypatch.setattr(cell, "nonfinite_data_row", lambda *a: None)

    class Pair:
        torch_model = None

        def make_data(self, seed, batch_size):
            return BatchList([(np.zeros((1, 2)), np.zeros(1))])

    config = RunConfig(model="mlp", precision="fp32", steps=n)
    options = dict(pair=Pair(), step0_checks=False, echo=False)
    runs = cell.run_cell(config, **options, escalate=True)
    assert asked == ["torch"] and overall_status(compare_runs(runs)) == "PASS"
    runs = cell.run_cell(config, **options)
    assert asked[-1] == "none" and overall_status(compare_runs(runs)) == "INCONCLUSIVE"


def test_gradient_norm_rows_take_their_own_noise_calibration_where_it_outruns_the_losss():
    """resnet adamw-4bit (matrix): the gradient norm parts from torch by 1.4e-3 at step 6, as far
    as torch's own 1-ulp noise run does, while the losses agree to 1e-7; the gradient-norm row
    (10 x the loss tolerance, 1e-3) failed a correct port. With the signal's own envelope it
    passes; a gradient-norm gap 30 x the noise still fails, and so does the same gap without the
    noise run."""
    losses = [2.0 - 0.01 * i for i in range(12)]
    gn = [1.0 + 0.1 * i for i in range(12)]

    def run(framework, gap, variant=""):
        extra = {i: {"grad_norm": g * (1 + (gap if i >= 6 else 0.0))} for i, g in enumerate(gn)}
        return _run(framework, losses, variant=variant, steps_extra=extra)

    def gn_rows(runs):
        judged = _judged(runs)
        return [v for v in judged if v.check.startswith("per-step gradient norm")], judged

    rows, judged = gn_rows([run("torch", 0.0), run("jax", 1.4e-3), run("torch", 1.4e-3, "noise")])
    assert rows and all(v.passed is not False for v in rows)
    assert "own noise-calibrated tolerance" in rows[0].detail
    assert overall_status(judged) != "FAIL"
    rows, judged = gn_rows([run("torch", 0.0), run("jax", 4.2e-2), run("torch", 1.4e-3, "noise")])
    assert any(v.passed is False and v.first_failing_step == 6 for v in rows)
    rows, judged = gn_rows([run("torch", 0.0), run("jax", 1.4e-3)])
    assert any(v.passed is False for v in rows)
