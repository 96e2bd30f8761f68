"""The check table row by row: for each kind of `parity.verdicts.checks.CHECKS` that a trained
pair's judging pass builds, a fake pair whose row of that kind passes and one whose row fails
(or, for an informational kind, one where it is shown and decides nothing), found by its kind,
never its label. Rows made outside the judging pass (the replay, the logits) are tested with
their own makers (test_parity_replay.py, test_parity_logits.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fake_run

from parity.verdicts.checks import CHECKS
from parity.verdicts.judge import compare_runs
from parity.verdicts.outcomes import overall_status

N = 12
BASE = np.linspace(2.3, 1.0, N)


def _pair(jax_losses=None, precision="fp32", **fields):
    """A torch run on BASE and a JAX run on `jax_losses` (BASE), both with `fields`."""
    jax_losses = BASE if jax_losses is None else jax_losses
    both = {k: v for k, v in fields.items() if not k.startswith(("torch_", "jax_"))}
    return [
        fake_run("torch", BASE, precision, **both, **_side(fields, "torch_")),
        fake_run("jax", jax_losses, precision, **both, **_side(fields, "jax_")),
    ]


def _side(fields, prefix):
    return {k[len(prefix) :]: v for k, v in fields.items() if k.startswith(prefix)}


def _bump(step, factor):
    losses = BASE.copy()
    losses[step:] *= factor
    return losses


def _signal(field, values):
    return {i: {field: float(v)} for i, v in enumerate(values)}


def _scaled(skips, init=1024.0, interval=3, maxima=None):
    """Per-step fields of an fp16 side whose scales follow GradScaler from its own `skips`."""
    extra, scale, tracker = {}, init, 0
    for i in range(N):
        extra[i] = {"loss_scale": scale, "skipped": i in skips}
        extra[i]["max_scaled_grad"] = (maxima or {}).get(i, {"w": 100.0})
        if i in skips:
            scale, tracker = scale / 2, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * 2, 0
    return extra


_FP16 = {"init_scale": 1024.0, "growth_interval": 3}
_OVERFLOW = {"w": None}


def _seeds(jax_shift, n_seeds=4, metric=False):
    runs = []
    for seed in range(n_seeds):
        wiggle = 1 + 0.001 * (seed - 1.5)
        for framework, shift in (("torch", 0.0), ("jax", jax_shift)):
            losses = BASE * wiggle * (1 + shift)
            runs.append(
                fake_run(
                    framework,
                    losses,
                    "bf16-mixed",
                    data_seed=seed,
                    eval_metric=(0.8 - shift) * wiggle if metric else None,
                )
            )
    return runs


# kind -> (runs whose row of that kind passes, runs whose row of that kind fails)
DECIDING = {
    "divergence": (_pair(), _pair([*BASE[:5], float("nan"), *BASE[6:]])),
    "loss": (_pair(BASE * (1 + 3e-5)), _pair(_bump(3, 1.01))),
    "fp8 loss": (
        _pair(_bump(1, 1.01), "fp8-tensorwise"),  # step 0 at float32's band, then e4m3's
        _pair(_bump(2, 1.2), "fp8-tensorwise"),
    ),
    "final loss": (
        _pair(BASE * 1.04, "bf16-mixed"),
        _pair(BASE * 1.07, "bf16-mixed"),
    ),
    "grad norm": (
        _pair(
            torch_steps_extra=_signal("grad_norm", BASE),
            jax_steps_extra=_signal("grad_norm", BASE * (1 + 1e-5)),
        ),
        _pair(
            torch_steps_extra=_signal("grad_norm", BASE),
            jax_steps_extra=_signal("grad_norm", _bump(4, 1.1)),
        ),
    ),
    "update norm": (
        _pair(
            config={"optimizer": "sgd"},
            torch_steps_extra=_signal("update_norm", BASE),
            jax_steps_extra=_signal("update_norm", BASE * (1 + 1e-5)),
        ),
        _pair(
            config={"optimizer": "sgd"},
            torch_steps_extra=_signal("update_norm", BASE),
            jax_steps_extra=_signal("update_norm", _bump(4, 1.1)),
        ),
    ),
    "scale": (
        _pair(precision="fp16-mixed", config=_FP16, steps_extra=_scaled({1})),
        _pair(
            precision="fp16-mixed",
            config=_FP16,
            torch_steps_extra=_scaled({1}),
            jax_steps_extra={**_scaled({1}), 6: {**_scaled({1})[6], "loss_scale": 8192.0}},
        ),
    ),
    "skips": (
        _pair(
            precision="fp16-mixed",
            config=_FP16,
            torch_steps_extra=_scaled({1, 5}, maxima={5: _OVERFLOW}),
            jax_steps_extra=_scaled({1}, maxima={5: {"w": 65500.0}}),  # a rounding flip
        ),
        _pair(
            precision="fp16-mixed",
            config=_FP16,
            torch_steps_extra=_scaled({1, 5}, maxima={5: _OVERFLOW}),
            jax_steps_extra=_scaled({1}, maxima={5: {"w": 30000.0}}),  # far from float16's max
        ),
    ),
    "equivalence loss": (_seeds(0.0), _seeds(0.2)),
    "equivalence eval": (_seeds(0.0, metric=True), _seeds(0.2, metric=True)),
}

# Kinds shown beside the deciding rows, never deciding a cell, and the runs that show them.
INFORMATIONAL = {
    "max gap": _pair(_bump(3, 1.01)),
    "eval": _pair(eval_metric=0.5),
    "welch loss": _seeds(0.2),
    "welch eval": _seeds(0.2, metric=True),
}


def _row(runs, kind):
    rows = [v for v in compare_runs(runs) if v.kind == kind]
    assert rows, f"no row of kind {kind!r}"
    return rows


@pytest.mark.parametrize("kind", sorted(DECIDING))
def test_each_deciding_check_passes_a_matching_pair_and_fails_a_differing_one(kind):
    good, bad = DECIDING[kind]
    assert all(r.passed is True for r in _row(good, kind)), [
        (r.check, r.detail) for r in _row(good, kind)
    ]
    assert any(r.passed is False for r in _row(bad, kind)), [
        (r.check, r.detail) for r in _row(bad, kind)
    ]
    assert overall_status(compare_runs(bad)) == "FAIL"


@pytest.mark.parametrize("kind", sorted(INFORMATIONAL))
def test_each_informational_check_is_shown_and_decides_nothing(kind):
    assert all(r.passed is None for r in _row(INFORMATIONAL[kind], kind))
    assert not CHECKS[kind].decisive or CHECKS[kind].rule in ("informational", "difference test")


def test_every_check_of_a_trained_pair_is_tested_here():
    made_elsewhere = {
        "completed",  # a run that raised: test_parity_robustness.py
        "left out",  # calibration runs with other settings: test_parity_power.py
        "logit tokens",  # eval logits: test_parity_logits.py
        "logit kl",
        "logit top1",
        "structural",  # folded tensors, padding rows: test_parity_power.py
        "padding rows",  # a step-0 row: test_parity_verdicts.py
        "replay optimizer",  # the replay's rows: test_parity_replay.py
        "replay loss",
        # step 0's rows: test_parity_step0.py, test_parity_mutations.py, test_fp8_parity.py,
        # test_mx_parity.py, test_parity_optim_state.py
        "step 0 output",
        "step 0 gradients",
        "layer probe",
        "stochastic",
        "folded",
        "dropout",
        "compute dtype",
        "quantized layers",
        "optimizer state",
        "step 0 ran",
        # what a cell holds besides checks, and a distributed run's own rows: below
        *ROWS_BESIDE_CHECKS,
    }
    assert set(CHECKS) == set(DECIDING) | set(INFORMATIONAL) | made_elsewhere


ROWS_BESIDE_CHECKS = (
    "comparable",
    "unsupported",
    "pair",
    "data finite",
    "jax mode",
    "ranks agree",
    "injected overflow",
    "replicated params",
    "reduction dtype",
)


def test_rows_beside_the_checks_have_kinds_of_the_table():
    """The rows that say why nothing (or not everything) was compared, the data's own row and
    a distributed arm's rows carry a kind of the table, as every check's row does."""
    from parity.cell import nonfinite_data_row
    from parity.core.config import RunConfig
    from parity.distributed.run import DistributedPlan, _rank_rows, _side_rows

    rows = compare_runs([fake_run("torch", BASE), fake_run("jax", BASE, config={"lr": 0.5})])
    rows += compare_runs([{**fake_run("torch", BASE), "status": "unsupported"}])
    rows += compare_runs([fake_run("torch", BASE, model="lone")])
    rows.append(nonfinite_data_row(RunConfig(), (np.array([np.nan]), np.array([0]))))
    result = {
        "steps": [{"step": 0, "loss_scale": 1.0, "skipped": True}],
        "params_digest": "same",
        "reduce_dtypes": ["float32"],
    }
    ranks = {"torch": [result, result], "jax:jit": [result, result]}
    arm = _rank_rows(
        RunConfig(), DistributedPlan(inject_overflow=(0, 1)), ranks, {"multiprocess": "no"}
    )
    rows += arm
    assert {v.kind for v in rows} >= set(ROWS_BESIDE_CHECKS)
    assert all(v.kind in CHECKS for v in rows), [(v.kind, v.check) for v in rows]
    # the arm's refused mode is stored with every side, found by its kind
    assert [v.kind for v in _side_rows(arm, "torch")].count("jax mode") == 1
