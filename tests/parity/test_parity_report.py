"""Verdict logic, the report's files and content, and the library entry point `compare_models`."""

from __future__ import annotations

import csv

import pytest

torch = pytest.importorskip("torch")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from conftest import fake_run  # noqa: E402

import parity  # noqa: E402
from parity.report.markdown import write_report  # noqa: E402
from parity.verdicts.judge import compare_runs  # noqa: E402

pytestmark = [pytest.mark.standard_promotion, pytest.mark.torch]


def _run(framework, precision="fp32", losses=None, scales=None, skipped=None, model="mlp"):
    """A measured run record: torch's steps 10 ms, JAX's 2 ms; each side's memory method."""
    losses = list(losses if losses is not None else np.linspace(2.3, 0.5, 30))
    jax_side = framework == "jax"
    time_s = 0.002 if jax_side else 0.01
    return fake_run(
        framework,
        losses,
        precision,
        scales=scales,
        skips=skipped,
        model=model,
        eval_metric=0.9,
        measured=True,
        steps_extra={i: {"time_s": time_s} for i in range(len(losses))},
        summary={
            "step_time_median_s": time_s if losses else None,
            "step_time_p10_s": time_s if losses else None,
            "step_time_p90_s": time_s if losses else None,
            "compile_time_s": 1.0 if jax_side else None,
            "throughput_samples_per_s": 100.0,
            "peak_memory_bytes": 3 * 2**20 if jax_side else 4 * 2**20,
            "peak_memory_method": "xla_memory_analysis"
            if jax_side
            else "torch_profiler_cpu_allocations",
            "stopped_reason": None,
        },
    )


def _by_check(verdicts):
    return {v.check: v for v in verdicts}


def test_fp32_tolerances_1e4_then_1e3():
    ref = _run("torch")
    close = [x * (1 + 5e-5) for x in np.linspace(2.3, 0.5, 30)]
    verdicts = _by_check(compare_runs([ref, _run("jax", losses=close)]))
    assert verdicts["per-step loss, steps 0-9"].passed
    assert verdicts["per-step loss, steps 10-29"].passed
    later = list(np.linspace(2.3, 0.5, 30))
    later[20] *= 1 + 5e-4  # fine after step 10, not before
    assert _by_check(compare_runs([ref, _run("jax", losses=later)]))[
        "per-step loss, steps 10-29"
    ].passed
    early = list(np.linspace(2.3, 0.5, 30))
    early[3] *= 1 + 5e-4
    assert not _by_check(compare_runs([ref, _run("jax", losses=early)]))[
        "per-step loss, steps 0-9"
    ].passed


def test_fp16_trajectory_must_follow_gradscaler_from_each_sides_skips():
    skipped = [True] + [False] * 29
    scales, scale, tracker = [], 2.0**16, 0  # GradScaler: x0.5 on a skip, x2 every 2 finite
    for skip in skipped:
        scales.append(scale)
        scale, tracker = (scale / 2, 0) if skip else (scale, tracker + 1)
        if tracker == 2:
            scale, tracker = scale * 2, 0
    settings = {"init_scale": 2.0**16, "growth_interval": 2}
    ref = _run("torch", "fp16-mixed", scales=scales, skipped=skipped)
    ref["config"] = settings
    jax = _run("jax", "fp16-mixed", scales=scales, skipped=skipped)
    jax["config"] = settings
    same = _by_check(compare_runs([ref, jax]))
    assert same["loss-scale trajectory"].passed and same["skip decisions"].passed
    other = list(scales)
    other[3] = 2.0**15
    moved = _run("jax", "fp16-mixed", scales=other, skipped=skipped)
    moved["config"] = settings
    moved = _by_check(compare_runs([ref, moved]))
    assert moved["loss-scale trajectory"].passed is False
    assert "step 3" in moved["loss-scale trajectory"].value


def test_bf16_final_loss_within_five_percent():
    ref = _run("torch", "bf16-mixed")
    near = _run("jax", "bf16-mixed", losses=[x * 1.04 for x in np.linspace(2.3, 0.5, 30)])
    far = _run("jax", "bf16-mixed", losses=[x * 1.07 for x in np.linspace(2.3, 0.5, 30)])
    assert _by_check(compare_runs([ref, near]))["final loss (mean of last 5)"].passed
    assert not _by_check(compare_runs([ref, far]))["final loss (mean of last 5)"].passed


def test_report_files_and_content(tmp_path):
    nan_losses = list(np.linspace(2.3, 1.0, 30))
    nan_losses[25:] = [float("nan")] * 5
    scales = [2.0**16] * 30
    runs = [
        _run("torch"),
        _run("jax"),
        _run("torch", "bf16-mixed"),
        _run("jax", "bf16-mixed", losses=nan_losses),
        _run("torch", "fp16-mixed", scales=scales),
        _run("jax", "fp16-mixed", scales=scales),
        _run("torch", "fp32", model="cnn"),  # no JAX partner: an informational row
    ]
    verdicts = compare_runs(runs)
    path = write_report(tmp_path, runs, verdicts)
    text = path.read_text()
    assert "| model | precision | device | check |" in text
    assert "**FAIL**" in text  # the diverged bf16 run
    assert "## Diverged runs" in text and "first non-finite loss at step 25" in text
    assert "xla_memory_analysis" in text and "torch_profiler_cpu_allocations" in text
    for name in ("loss_curves.png", "loss_scale.png", "step_time.png", "memory.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name})" in text
    with open(tmp_path / "steps.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 30 * len(runs)
    assert {r["run"] for r in rows} == {"torch", "jax"}
    assert sum(r["loss_finite"] == "False" for r in rows) == 5


class _TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x)


class _FlaxNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(3, name="fc")(x)


def _transfer(module):
    return {
        "params": {
            "fc": {
                "kernel": jnp.asarray(module.fc.weight.detach().numpy().T),
                "bias": jnp.asarray(module.fc.bias.detach().numpy()),
            }
        }
    }


def _batches(n, rows=8):
    """n batches of `rows` six-feature rows with 3-class labels, the same for every test."""
    rng = np.random.default_rng(0)
    return [
        (
            rng.normal(size=(rows, 6)).astype(np.float32),
            rng.integers(0, 3, size=(rows,)).astype(np.int32),
        )
        for _ in range(n)
    ]


@pytest.mark.integration
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_compare_models_library_entry(tmp_path, precision):
    torch.manual_seed(0)
    batches = _batches(12)
    result = parity.compare_models(
        _TorchNet(),
        _FlaxNet(),
        _transfer,
        batches,
        precision=precision,
        eval_batches=batches[:2],
        out_dir=tmp_path,
        plots=False,  # the report without its PNGs (the noise test below draws them)
        lr=1e-2,
    )
    assert result.passed, [v for v in result.verdicts if v.passed is False]
    assert [r["framework"] for r in result.runs] == ["torch", "jax"]
    assert len(result.runs[0]["steps"]) == 12
    assert result.report_path is not None and result.report_path.exists()
    assert "Not drawn (`--no-plots`)" in result.report_path.read_text()
    assert not list(tmp_path.glob("*.png"))
    with pytest.raises(ValueError, match="steps"):
        parity.compare_models(_TorchNet(), _FlaxNet(), _transfer, batches, steps=20)
    with pytest.raises(TypeError, match="batches"):
        parity.compare_models(_TorchNet(), _FlaxNet(), _transfer, 42)


# --- reports that cope with anything a run can record ---------------------------------------------


def _report_cases():
    nan = [float("nan")] * 3
    scales = [2.0**16] * 3
    return {
        "no finite loss": [_run("torch", losses=nan), _run("jax", losses=nan)],
        "one step": [_run("torch", losses=[2.3]), _run("jax", losses=[2.3])],
        "no steps": [_run("torch", losses=[]), _run("jax", losses=[])],
        "one framework": [_run("torch")],
        "fp16 all skipped": [
            _run("torch", "fp16-mixed", nan, scales, [True] * 3),
            _run("jax", "fp16-mixed", nan, scales, [True] * 3),
        ],
    }


@pytest.mark.parametrize("case", list(_report_cases()))
def test_report_is_written_for_degenerate_runs(tmp_path, case):
    runs = _report_cases()[case]
    verdicts = compare_runs(runs)
    path = write_report(tmp_path, runs, verdicts)
    text = path.read_text()
    overall = text.split("\n")[2]
    if case == "one step":  # one compared step is evidence: judged, with its own plots
        assert "**PASS**" in overall and "loss_curves.png" in text
    else:  # nothing degenerate is a pass
        assert "PASS" not in overall
    if case == "one framework":
        assert "NOTHING COMPARED" in text and "only torch" in text
    if case in ("no finite loss", "fp16 all skipped"):
        assert "no finite loss" in text
    if case == "no steps":
        assert "no steps recorded" in text
    assert (tmp_path / "steps.csv").exists()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("case", ["nan_batch_0", "all_nan"])
def test_compare_models_survives_nan_batches(tmp_path, precision, case):
    torch.manual_seed(0)
    # the library entry test's shapes and learning rate: its fp32 and bf16 programs, reused
    batches = _batches(4)
    poisoned = range(len(batches)) if case == "all_nan" else [0]
    for i in poisoned:
        batches[i][0][:] = np.nan
    result = parity.compare_models(
        _TorchNet(),
        _FlaxNet(),
        _transfer,
        batches,
        precision=precision,
        out_dir=tmp_path,
        plots=False,
        timing_warmup=0,
        init_scale=2.0**4,
        growth_interval=1,
        lr=1e-2,
    )
    assert not result.passed
    assert result.report_path.exists()
    assert any(v.check == "no divergence" and v.passed is False for v in result.verdicts)
    if precision == "fp16-mixed":
        for run in result.runs:  # the scaler skips every non-finite step on both sides
            assert run["steps"][0]["skipped"] and run["summary"]["skipped_steps"] >= len(poisoned)


@pytest.mark.integration
@pytest.mark.slow
def test_compare_models_with_noise_calibration(tmp_path):
    torch.manual_seed(0)
    batches = _batches(6)
    result = parity.compare_models(
        _TorchNet(), _FlaxNet(), _transfer, batches, noise="both", out_dir=tmp_path, lr=1e-2
    )
    assert sorted(r["variant"] for r in result.runs) == ["", "", "noise", "noise"]
    rows = [v for v in result.verdicts if v.check.startswith("per-step loss")]
    assert rows and all("self-divergence (torch~noise, jax~noise)" in v.detail for v in rows)
    assert result.passed and (tmp_path / "divergence.png").exists()
    with pytest.raises(ValueError, match="noise"):
        parity.compare_models(_TorchNet(), _FlaxNet(), _transfer, batches, noise="all", step0=False)


def test_a_distributed_cell_states_one_speed_ratio_per_jax_mode(tmp_path):
    from parity.report.markdown import speed_ratios

    def side(framework, label, time_s):
        run = _run(framework)
        for step in run["steps"]:
            step["time_s"] = time_s
        return {**run, "distributed": label, "arm": "ddp"}

    # jit 2x, multiprocess 4x torch's step time: two figures, each its own mode's.
    runs = [
        side("torch", "torch ddp", 0.010),
        side("jax", "jax:jit ddp", 0.020),
        side("jax", "jax:multiprocess ddp", 0.040),
    ]
    ratios = speed_ratios(runs)
    assert list(ratios) == ["jax:jit ddp vs torch ddp", "jax:multiprocess ddp vs torch ddp"]
    assert "2.00x slower" in ratios["jax:jit ddp vs torch ddp"]
    assert "4.00x slower" in ratios["jax:multiprocess ddp vs torch ddp"]
    text = write_report(tmp_path, runs, compare_runs(runs)).read_text()
    line = next(x for x in text.splitlines() if x.startswith("- **mlp fp32 (cpu)**"))
    assert "jax:jit ddp vs torch ddp: JAX 2.00x slower" in line
    assert "jax:multiprocess ddp vs torch ddp: JAX 4.00x slower" in line
    # a single-device cell keeps its one figure, unnamed
    single = [_run("torch"), _run("jax")]
    assert list(speed_ratios(single)) == ["jax vs torch"]
    text = write_report(tmp_path / "one", single, compare_runs(single)).read_text()
    assert "Speed: JAX" in text and " vs torch: " not in text
