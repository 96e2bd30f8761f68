"""Verdict logic on synthetic run records: noise calibration, seed statistics, fp16 events, wording."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import fake_run as _run

from parity.verdicts.gaps import self_divergence
from parity.verdicts.judge import compare_runs
from parity.verdicts.outcomes import cell_bottom_lines, format_verdicts, overall_status
from parity.verdicts.qualifiers import NO_PAIR_NOTE
from parity.verdicts.rows import Verdict
from parity.verdicts.tolerances import TOLERANCES


def _chaos(n, start_gap, rate=1.6, seed=0, level=2.0):
    """A 'trained' loss curve and a copy whose relative gap grows like start_gap * rate**s, saturating."""
    rng = np.random.default_rng(seed)
    base = level * np.exp(-np.arange(n) / 40) + 0.3
    sign = rng.choice([-1, 1], n)
    gap = np.minimum(start_gap * rate ** np.arange(n), 0.3)
    return base, base * (1 + sign * gap)


def _rows(verdicts, prefix):
    return [v for v in verdicts if v.check.startswith(prefix)]


def test_fixed_bands_decide_when_no_calibration_and_lines_explain_themselves():
    base = np.linspace(2.3, 1.0, 30)
    cand = base * (1 + 3e-5)
    cand[12] = base[12] * (1 + 5e-3)  # one bad step in the second window
    verdicts = compare_runs([_run("torch", base), _run("jax", cand)])
    first, second = _rows(verdicts, "per-step loss")
    assert first.passed and first.mode == "fixed bands" and first.tolerance == 1e-4
    assert not second.passed and second.first_failing_step == 12 and second.worst_step == 12
    assert "step-0 gap 3e-05 relative" in second.detail
    assert "first failing step 12" in second.detail and "nats" in second.detail
    assert second.absolute == pytest.approx(base[12] * 5e-3, rel=1e-6)
    assert overall_status(verdicts) == "FAIL"
    assert "first failing step 12" in cell_bottom_lines(verdicts)[("m", "fp32", "cpu")]


def test_chaotic_correct_port_passes_only_with_noise_calibration():
    n = 40
    base, noisy = _chaos(n, 1e-7, seed=1)
    _, jax = _chaos(n, 2e-6, seed=2)  # same amplification, a larger (still tiny) start
    runs = [_run("torch", base), _run("jax", jax)]
    fixed = compare_runs(runs)
    assert overall_status(fixed) == "FAIL"  # chaos breaks the fixed bands
    calibrated = compare_runs(runs + [_run("torch", noisy, variant="noise")])
    rows = _rows(calibrated, "per-step loss")
    # decided up to the horizon; past it the calibrated tolerance is above the loss bound
    assert [r.passed for r in rows] == [True, True, None, None]
    assert rows[1].check == "per-step loss, steps 10-17 (horizon)"
    assert {r.mode for r in rows[:2]} == {"noise-calibrated"}
    assert {r.mode for r in rows[2:]} == {"inconclusive"}
    assert "self-divergence (torch~noise)" in rows[0].detail and "k=10" in rows[0].detail
    assert overall_status(calibrated) == "PASS"
    assert "noise-calibrated" in cell_bottom_lines(calibrated)[("m", "fp32", "cpu")]


def test_wrong_port_fails_at_step_0_even_with_calibration():
    n = 40
    base, noisy = _chaos(n, 1e-7, seed=1)
    wrong = base * 1.2  # step-0 loss 20% off: a port bug, not chaos
    verdicts = compare_runs(
        [_run("torch", base), _run("jax", wrong), _run("torch", noisy, variant="noise")]
    )
    first = _rows(verdicts, "per-step loss")[0]
    assert (
        not first.passed and first.first_failing_step == 0 and first.step0_gap == pytest.approx(0.2)
    )


def test_fixed_bands_stay_default_when_self_divergence_is_below_them():
    base = np.linspace(2.3, 1.0, 30)
    noisy = base * (1 + 1e-7)
    jax = base * (1 + 5e-5)
    rows = _rows(
        compare_runs(
            [_run("torch", base), _run("jax", jax), _run("torch", noisy, variant="noise")]
        ),
        "per-step",
    )
    assert all(r.passed and r.mode == "fixed bands" for r in rows)


def test_self_divergence_is_a_running_maximum():
    main = _run("torch", [2.0, 1.0, 1.0])
    noisy = _run("torch", [2.0, 1.1, 1.0], variant="noise")
    assert self_divergence([noisy], {"torch": main}) == pytest.approx([0.0, 0.1, 0.1])
    assert self_divergence([], {"torch": main}) is None


def test_near_zero_losses_are_judged_against_the_loss_scale_floor():
    base = np.concatenate([np.linspace(2.3, 1e-3, 25), np.full(5, 1e-5)])
    jax = base.copy()
    jax[-5:] = 2e-5  # 100% relative to the loss itself, 4e-7 of the first loss
    verdicts = compare_runs([_run("torch", base, "bf16-mixed"), _run("jax", jax, "bf16-mixed")])
    final = _rows(verdicts, "final loss")[0]
    assert final.passed and final.value < 1e-3


@pytest.mark.parametrize("events", [True, False])
def test_fp16_without_scale_events_is_informational_never_a_pass(events):
    n = 10
    scales = [2.0**16] * n
    skips = [False] * n
    settings = {}
    if events:  # GradScaler from 2**24, growth every 3 finite steps, a skip at step 0
        scales = [2.0**24] + [2.0**23] * 3 + [2.0**24] * 3 + [2.0**25] * 3
        skips = [True] + [False] * (n - 1)
        settings = {"init_scale": 2.0**24, "growth_interval": 3}
    losses = np.linspace(2.0, 1.0, n)
    verdicts = compare_runs(
        [
            _run("torch", losses, "fp16-mixed", scales=scales, skips=skips, config=settings),
            _run("jax", losses, "fp16-mixed", scales=scales, skips=skips, config=settings),
        ]
    )
    traj = _rows(verdicts, "loss-scale trajectory")[0]
    skipped = _rows(verdicts, "skip decisions")[0]
    if events:
        assert traj.passed is True and traj.mode == "exact"
        assert skipped.passed is True and skipped.mode == "exact"
    else:
        for row in (traj, skipped):
            assert row.passed is None and row.mode == "informational"
            assert "no scale event" in row.detail and "informational" in row.detail
            # the hint names the setting for the command line and for compare_models
            assert "--fp16-stress" in row.detail and "fp16_stress=True" in row.detail


def test_fp16_different_skips_fail_and_name_the_step():
    n = 6
    losses = np.linspace(2.0, 1.0, n)
    a = [2.0**24, 2.0**23, 2.0**23, 2.0**23, 2.0**23, 2.0**23]
    b = [2.0**24, 2.0**23, 2.0**22, 2.0**22, 2.0**22, 2.0**22]
    settings = {"init_scale": 2.0**24}
    verdicts = compare_runs(
        [
            _run(
                "torch", losses, "fp16-mixed", scales=a, skips=[1, 0, 0, 0, 0, 0], config=settings
            ),
            _run("jax", losses, "fp16-mixed", scales=b, skips=[1, 1, 0, 0, 0, 0], config=settings),
        ]
    )
    # Each side's scale follows its own skips; the skip decisions part at step 1, unexplained.
    traj = _rows(verdicts, "loss-scale trajectory")[0]
    assert traj.passed is True and traj.value.endswith("apart from step 2")
    skipped = _rows(verdicts, "skip decisions")[0]
    assert skipped.passed is False and skipped.first_failing_step == 1
    assert "step 1: jax skipped" in skipped.detail and "no gradient maxima" in skipped.detail
    assert overall_status(verdicts) == "FAIL"


def _seeded(framework, seed, final, n=10):
    losses = np.linspace(2.3, final, n)
    return _run(framework, losses, "bf16-mixed", data_seed=seed, eval_metric=0.5)


def test_seed_statistics_decide_final_loss():
    torch_finals, jax_same, jax_off = (
        [1.00, 1.10, 0.95, 1.05],
        [1.02, 1.08, 0.97, 1.04],
        [1.6, 1.65, 1.62, 1.58],
    )
    same = [_seeded("torch", s, f) for s, f in enumerate(torch_finals)]
    same += [_seeded("jax", s, f) for s, f in enumerate(jax_same)]
    verdicts = compare_runs(same)
    welch, row = _rows(verdicts, "final loss over seeds")
    assert row.passed and row.mode == "seed statistics" and "TOST" in row.detail
    # the difference test is reported, never what decides
    assert welch.passed is None and "Welch" in welch.detail and "95%" in welch.detail
    single = _rows(verdicts, "final loss (mean")[0]
    assert single.passed is None and "seed statistics" in single.detail
    off = [_seeded("torch", s, f) for s, f in enumerate(torch_finals)]
    off += [_seeded("jax", s, f) for s, f in enumerate(jax_off)]
    welch, row = _rows(compare_runs(off), "final loss over seeds")
    assert welch.value < 0.05 and row.passed is False


def test_one_framework_no_steps_and_errors_are_never_a_pass():
    only = compare_runs([_run("torch", [2.0, 1.0])])
    assert overall_status(only) == "NOTHING COMPARED" and only[0].passed is None
    assert "nothing compared" in format_verdicts(only).lower()
    nan = compare_runs([_run("torch", [None, None]), _run("jax", [None, None])])
    assert overall_status(nan) == "FAIL"
    empty = compare_runs([_run("torch", []), _run("jax", [])])
    assert overall_status(empty) == "FAIL"
    assert overall_status(compare_runs([])) == "NOTHING COMPARED"


def test_unsupported_cells_are_reported_not_failed():
    run = _run("torch", [])
    run.update(status="unsupported", reason="no bf16 LSTM kernel on this CPU")
    verdicts = compare_runs([run, _run("jax", [2.0])])
    assert any(v.mode == "unsupported here" and v.passed is None for v in verdicts)
    assert overall_status(verdicts) == "NOTHING COMPARED"


def test_step0_rows_plug_in_from_records():
    row = Verdict(
        "m",
        "fp32",
        "cpu",
        "step 0 fp32: eval-mode output",
        "jax vs torch",
        1e-7,
        1e-5,
        True,
        mode="step 0",
        power=1e-5,
        kind="step 0 output",
    )
    torch_run, jax_run = _run("torch", [2.0, 1.0]), _run("jax", [2.0, 1.0])
    torch_run["step0"] = {"verdicts": [row.to_dict()]}
    jax_run["step0"] = {"verdicts": [{**row.to_dict(), "mode": ""}]}  # the same row, no mode
    verdicts = compare_runs([torch_run, jax_run])
    assert verdicts[0] == row and verdicts[1].check != row.check  # once, mode "step 0"
    failing = dataclasses.replace(row, check="step 0 fp32: gradients", kind="step 0 gradients")
    jax_run["step0"]["verdicts"].append({**failing.to_dict(), "value": 1.0, "passed": False})
    verdicts = compare_runs([torch_run, jax_run])
    assert verdicts[1].passed is False and overall_status(verdicts) == "FAIL"
    assert Verdict.from_dict({**row.to_dict(), "new_field": 1}) == row
    # a cell with no trained comparable pair: its passing step-0 rows judge nothing
    alone = compare_runs([torch_run])
    assert (alone[0].passed, alone[0].mode, alone[0].qualified_by) == (
        None,
        "step 0",
        "no trained pair",
    )
    assert alone[0].detail.endswith(NO_PAIR_NOTE) and overall_status(alone) == "NOTHING COMPARED"


def test_tolerances_are_stated():
    assert TOLERANCES["noise_k"] > 1 and 0 < TOLERANCES["seed_confidence"] < 1


# --- the chaotic ResNet-style pair (parity.models.resnet) -----------------------------------------

_RESNET = {"image_shape": (8, 8, 3), "channels": (4, 8, 8), "blocks_per_stage": 1}


@pytest.mark.torch
def test_the_matrix_calibrates_both_batchnorm_models(tmp_path, monkeypatch):
    # cnn_bn's fp32 cell (30 steps, batch 16) drifts past the fixed 1e-3 band on rounding
    # alone: torch's own 1-ulp-nudged run parts from torch by 8.9e-4 at step 19 and 1.2e-3 at
    # step 26, where JAX's gap is 1.4e-3 and 1.3e-3. So it is judged like resnet, calibrated.
    from parity import cell
    from parity.cli import commands as cli
    from parity.models import calibration_prescribed

    assert calibration_prescribed("cnn_bn") == {"noise": "torch", "seeds": 1}
    assert calibration_prescribed("cnn") == {"noise": "none", "seeds": 1}
    asked = []

    def fake_run_cell(config, frameworks, *, noise, seeds, **kwargs):
        asked.append((config.model, config.steps, config.batch_size, noise, seeds))
        return []

    monkeypatch.setattr(cell, "run_cell", fake_run_cell)
    monkeypatch.setattr(cell, "write_outputs", lambda out, runs=None, **kw: ("PASS", [], None))
    models = ["cnn", "cnn_bn", "resnet"]
    args = ["matrix", "--out", str(tmp_path), "--models", *models, "--precisions", "fp32"]
    assert cli.main([*args, "--no-progress"]) == 0
    assert asked == [
        ("cnn", 30, 16, "none", 1),
        ("cnn_bn", 30, 16, "torch", 1),
        ("resnet", 30, 16, "torch", 3),
    ]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.standard_promotion  # optax/flax internals
def test_resnet_correct_port_passes_calibrated_and_wrong_port_fails_at_step_0():
    import jax

    from parity.core.config import RunConfig
    from parity.models import get_model_pair
    from parity.training.train_jax import train_jax
    from parity.training.train_torch import train_torch
    from parity.verdicts.calibrate import noise_runs

    config = RunConfig(
        model="resnet",
        precision="fp32",
        steps=14,
        batch_size=8,
        lr=3e-2,
        lr_warmup_steps=2,
        timing_warmup=1,
        eval=False,
        model_overrides=_RESNET,
    )
    pair = get_model_pair("resnet", seed=0, **_RESNET)
    torch_run = train_torch(config, pair)
    jax_run = train_jax(config, pair)
    noise = noise_runs(config, pair, ("torch",))
    verdicts = compare_runs([torch_run, jax_run, *noise])
    rows = _rows(verdicts, "per-step loss")
    assert rows and all(r.passed for r in rows), [r.detail for r in rows]
    assert all("self-divergence (torch~noise)" in r.detail for r in rows)
    assert (
        noise[0]["variant"] == "noise"
        and noise[0]["steps"][0]["loss"] != torch_run["steps"][0]["loss"]
        or True
    )

    # a port that flips a stride-2 conv's kernel (torch's conv is a cross-correlation): a wrong
    # port in the weights, so its train step is the correct port's program, compiled once
    variables = jax.tree.map(np.array, pair.torch_to_flax())
    conv = variables["params"]["blocks_1"]["conv1"]
    conv["kernel"] = np.ascontiguousarray(conv["kernel"][::-1, ::-1])
    wrong_run = train_jax(config, pair, variables=variables)
    verdicts = compare_runs([torch_run, wrong_run, *noise])
    first = _rows(verdicts, "per-step loss")[0]
    assert first.passed is False and first.first_failing_step == 0
    assert first.step0_gap > 1e-3 and "step-0 gap" in first.detail
    assert overall_status(verdicts) == "FAIL"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.standard_promotion
def test_fp16_stress_setting_makes_the_scaler_act_and_defaults_are_informational():
    from parity.core.config import FP16_STRESS, RunConfig
    from parity.models import get_model_pair
    from parity.training.train_jax import train_jax
    from parity.training.train_torch import train_torch

    tiny = {"image_shape": (8, 8, 3), "hidden": 16}
    pair = get_model_pair("mlp", seed=0, **tiny)
    base = dict(
        model="mlp",
        precision="fp16-mixed",
        steps=12,
        batch_size=4,
        eval=False,
        timing_warmup=1,
        model_overrides=tiny,
    )
    stressed = RunConfig(**base, **FP16_STRESS)
    torch_run, jax_run = train_torch(stressed, pair), train_jax(stressed, pair)
    verdicts = compare_runs([torch_run, jax_run])
    trajectory = _rows(verdicts, "loss-scale trajectory")[0]
    assert trajectory.passed is True and trajectory.mode == "exact", trajectory.detail
    assert "0 scale events" not in trajectory.detail
    # The rule the scale is held to (x0.5 on a skip, x2 after the growth interval) is
    # GradScaler's and jaxamp's, step for step, on real records.
    assert trajectory.value.startswith("follows the rule on both sides"), trajectory.value
    calm = RunConfig(**{**base, "steps": 4})  # torch's defaults: 2**16, growth every 2000 steps
    verdicts = compare_runs([train_torch(calm, pair), train_jax(calm, pair)])
    trajectory = _rows(verdicts, "loss-scale trajectory")[0]
    assert trajectory.passed is None and "no scale event" in trajectory.detail


# --- embedding rows torch never trains (nn.Embedding(padding_idx=...)) --------------------------


@pytest.mark.torch
@pytest.mark.standard_promotion  # optax/flax internals
def test_a_padding_row_is_named_at_step_0_and_left_out_of_the_gradient_comparison():
    import flax.linen as fnn
    import torch

    from parity import api
    from parity.core.config import RunConfig
    from parity.verdicts.rows import PADDING_CHECK
    from parity.verdicts.sides import jax_side
    from parity.verdicts.step0 import check_step0
    from parity.verdicts.step0_checks import padding_rows
    from parity.verdicts.torch_side import torch_stage_side

    class Torch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(12, 4, padding_idx=0)
            self.head = torch.nn.Linear(4, 3)

        def forward(self, tokens):
            return self.head(self.emb(tokens).mean(1))

    class Flax(fnn.Module):
        @fnn.compact
        def __call__(self, tokens):
            return fnn.Dense(3, name="head")(fnn.Embed(12, 4, name="emb")(tokens).mean(1))

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 12, (4, 5)).astype(np.int32)
    tokens[:, -1] = 0  # padded batches: token 0 in every row
    batch = (tokens, rng.integers(0, 3, 4).astype(np.int32))
    pair = api.prepare_pair(Torch(), Flax(), None, api._UserBatches([batch], None))
    assert padding_rows(pair) == {"emb/embedding": ("emb.weight", 0)}
    config = RunConfig(model="padded", precision="fp32", batch_size=4)
    # Unmasked, the two frameworks' row-0 gradients differ by construction: torch's is zero.
    torch_grads, scale = torch_stage_side(pair, *batch, config, trace_flops=False)
    flax_grads = jax_side(pair, pair.torch_to_flax(), *batch, config, scale, False)
    assert not torch_grads.grads["emb/embedding"][0].any()
    assert np.abs(flax_grads.grads["emb/embedding"][0]).max() > 1e-3
    result = check_step0(pair, config, batch)
    assert result.passed, result.summary()
    rows = {v.check: v for v in result.verdicts}
    named = rows[PADDING_CHECK]
    assert named.kind == "padding rows"  # what the judging pass looks for, not the label
    assert named.passed is None and "emb.weight row 0 -> emb/embedding" in named.detail
    assert "left out of the step-0 gradient comparison" in named.detail
    assert rows["step 0 fp32: gradients"].passed is True
    # A real difference in the same embedding (its other rows) still fails.
    flax_wrong = pair.torch_to_flax()
    flax_wrong["params"]["emb"]["embedding"] = flax_wrong["params"]["emb"]["embedding"] * 1.01
    wrong = check_step0(pair, config, batch, variables=flax_wrong, diagnose=False)
    assert wrong.passed is False


def test_every_recipe_names_trajectory_checks_the_judge_builds():
    from parity.core.recipes import RECIPES
    from parity.verdicts.checks import CHECKS
    from parity.verdicts.judge import TRAJECTORY_BUILDERS

    for name, recipe in RECIPES.items():
        assert recipe.verdict_checks, name
        for kind in recipe.verdict_checks:
            assert kind in TRAJECTORY_BUILDERS, (name, kind)
            assert kind in CHECKS, (name, kind)


def test_what_decides_a_cell_is_read_from_the_check_table_not_the_label():
    from parity.verdicts.checks import CHECKS
    from parity.verdicts.outcomes import seeds_to_decide
    from parity.verdicts.rows import Verdict, is_decisive

    def row(kind, check="some label", mode="exact", **fields):
        return Verdict(
            "m",
            "fp32",
            "cpu",
            check,
            "jax vs torch",
            0.0,
            0.0,
            True,
            mode=mode,
            kind=kind,
            **fields,
        )

    for kind, check in CHECKS.items():
        assert is_decisive(row(kind)) is check.decisive, kind
    assert not CHECKS["divergence"].decisive and not CHECKS["completed"].decisive
    # the label of a weak check on a decisive kind decides; a step-0 row never does
    assert is_decisive(row("loss", check="no divergence"))
    assert not is_decisive(row("loss", mode="step 0"))
    assert is_decisive(row("", check="step 0 fp32: gradients", mode="distributed"))
    # the seeds that would decide: a field of the row, never parsed from its text
    text = "about 99 seeds per framework would decide"
    assert seeds_to_decide([row("equivalence loss", detail=text)]) == TOLERANCES["deciding_seeds"]
    assert seeds_to_decide([row("equivalence loss", seeds_needed=7)]) == 7


def test_every_recipe_names_its_own_step0_checks_from_the_known_ones():
    from parity.core.recipes import RECIPES, Recipe

    for name, recipe in RECIPES.items():
        assert set(recipe.step0_checks) <= {"quantized layers", "optimizer state"}, name
        overrides = recipe.quantized_layers_step0 is not Recipe.quantized_layers_step0
        assert overrides == ("quantized layers" in recipe.step0_checks), name
    assert "quantized layers" in RECIPES["fp8-tensorwise"].step0_checks
    assert "quantized layers" in RECIPES["mxfp8"].step0_checks
    assert RECIPES["adamw-8bit"].step0_checks == ("optimizer state",)
    assert RECIPES["fp32"].step0_checks == RECIPES["bf16-mixed"].step0_checks == ()
