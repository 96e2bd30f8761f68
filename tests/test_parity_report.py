"""Verdict logic, the report's files and content, and the library entry point `compare_models`."""

from __future__ import annotations

import csv
import math

import pytest

torch = pytest.importorskip("torch")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import parity  # noqa: E402
from parity.compare import compare_runs  # noqa: E402
from parity.report import write_report  # noqa: E402

pytestmark = [pytest.mark.standard_promotion, pytest.mark.torch]


def _run(framework, precision="fp32", losses=None, scales=None, skipped=None, model="mlp"):
    losses = list(losses if losses is not None else np.linspace(2.3, 0.5, 30))
    steps = []
    for i, loss in enumerate(losses):
        steps.append(
            {
                "step": i,
                "loss": None if loss is None or not math.isfinite(loss) else float(loss),
                "loss_finite": loss is not None and math.isfinite(loss),
                "loss_scale": None if scales is None else float(scales[i]),
                "skipped": bool(skipped[i]) if skipped else False,
                "time_s": 0.01 if framework == "torch" else 0.002,
            }
        )
    bad = [s["step"] for s in steps if not s["loss_finite"]]
    run = {
        "framework": framework,
        "model": model,
        "precision": precision,
        "device": "cpu",
        "versions": {"jax": "x", "torch": "y"},
        "config": {},
        "steps": steps,
        "summary": {
            "step_time_median_s": steps[0]["time_s"],
            "step_time_p10_s": steps[0]["time_s"],
            "step_time_p90_s": steps[0]["time_s"],
            "compile_time_s": 1.0 if framework == "jax" else None,
            "throughput_samples_per_s": 100.0,
            "peak_memory_bytes": 3 * 2**20 if framework == "jax" else 4 * 2**20,
            "peak_memory_method": "xla_memory_analysis"
            if framework == "jax"
            else "torch_profiler_cpu_allocations",
            "final_loss": steps[-1]["loss"],
            "eval_metric": 0.9,
            "eval_metric_name": "accuracy",
            "skipped_steps": sum(s["skipped"] for s in steps),
            "diverged": bool(bad),
            "first_nonfinite_step": bad[0] if bad else None,
            "stopped_reason": None,
        },
    }
    if framework == "torch":
        run["torch_mode"] = "eager"
    return run


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


def test_fp16_trajectory_must_be_identical():
    scales = [2.0**16, 2.0**15, 2.0**15, 2.0**16] + [2.0**16] * 26
    skipped = [True] + [False] * 29
    ref = _run("torch", "fp16-mixed", scales=scales, skipped=skipped)
    same = _by_check(compare_runs([ref, _run("jax", "fp16-mixed", scales=scales, skipped=skipped)]))
    assert same["loss-scale trajectory"].passed and same["skip decisions"].passed
    other = list(scales)
    other[3] = 2.0**15
    moved = _by_check(compare_runs([ref, _run("jax", "fp16-mixed", scales=other, skipped=skipped)]))
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


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_compare_models_library_entry(tmp_path, precision):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 3, size=(8,)).astype(np.int32))
        for _ in range(12)
    ]
    result = parity.compare_models(
        _TorchNet(),
        _FlaxNet(),
        _transfer,
        batches,
        precision=precision,
        eval_batches=batches[:2],
        out_dir=tmp_path,
        lr=1e-2,
    )
    assert result.passed, [v for v in result.verdicts if v.passed is False]
    assert [r["framework"] for r in result.runs] == ["torch", "jax"]
    assert len(result.runs[0]["steps"]) == 12
    assert result.report_path is not None and result.report_path.exists()
    with pytest.raises(ValueError, match="steps"):
        parity.compare_models(_TorchNet(), _FlaxNet(), _transfer, batches, steps=20)
    with pytest.raises(TypeError, match="batches"):
        parity.compare_models(_TorchNet(), _FlaxNet(), _transfer, 42)
