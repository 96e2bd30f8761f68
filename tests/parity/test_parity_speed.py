"""parity.perf.speed: bootstrap CIs, the bottom line per cell, reliability warnings, linear charts that
never crash, memory comparability statements."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

from parity.perf import speed
from parity.report import memory as memory_report
from parity.report import plots

matplotlib.use("Agg")

CPU_AVX2 = {
    "cpu": {"model": "test CPU", "flags": ["avx2"], "available_cpus": 2, "load_average": [0.5]},
    "torch": {"version": "2.13.0", "cpu_capability": "AVX2", "intra_op_threads": 2},
    "jax": {"version": "0.10.2", "devices": ["cpu:cpu"], "cpu_intra_op_threads": 2},
    "torch_bf16_emulated": True,
}


def _run(framework, precision, median, *, n=40, noise=0.02, seed=0, hardware=CPU_AVX2, **extra):
    rng = np.random.default_rng(seed)
    times = median * (1 + noise * rng.standard_normal(n + 3))
    policy = {"fp32": "p=f32,c=f32,o=f32", "bf16-mixed": "p=f32,c=bf16,o=f32"}[precision]
    run = {
        "framework": framework,
        "model": "cnn",
        "precision": precision,
        "policy": policy,
        "device": "cpu",
        "status": "completed",
        "hardware": hardware,
        "config": {"timing_warmup": 3},
        "steps": [{"step": i, "time_s": float(t)} for i, t in enumerate(times)],
        "summary": {
            "peak_memory_bytes": extra.pop("memory", 2**20),
            "peak_memory_method": "xla_memory_analysis"
            if framework == "jax"
            else "torch_profiler_cpu_allocations",
        },
    }
    run.update(extra)
    return run


def test_median_ci_covers_the_true_median_at_about_95_percent():
    """Coverage checked by simulation (lognormal step times, true median 1.0)."""
    rng = np.random.default_rng(1)
    hits = 0
    trials = 200
    for seed in range(trials):
        sample = np.exp(0.2 * rng.standard_normal(41))
        _, low, high = speed.median_ci(sample, n_resamples=500, seed=seed)
        hits += low <= 1.0 <= high
    assert 0.88 <= hits / trials <= 0.995


def test_ratio_ci_brackets_the_ratio_and_shrinks_with_more_steps():
    rng = np.random.default_rng(2)
    a_small, b_small = 2 + 0.2 * rng.standard_normal(10), 1 + 0.1 * rng.standard_normal(10)
    a_big, b_big = 2 + 0.2 * rng.standard_normal(400), 1 + 0.1 * rng.standard_normal(400)
    ratio, low, high = speed.ratio_ci(a_small, b_small)
    assert low <= ratio <= high
    _, big_low, big_high = speed.ratio_ci(a_big, b_big)
    assert big_low <= 2.0 <= big_high
    assert big_high - big_low < high - low


def test_constant_and_single_samples_give_degenerate_intervals():
    assert speed.median_ci([3.0]) == (3.0, 3.0, 3.0)
    assert speed.median_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)
    assert speed.ratio_ci([2.0, 2.0], [1.0, 1.0]) == (2.0, 2.0, 2.0)


def test_bad_samples_raise_value_errors():
    with pytest.raises(ValueError, match="at least one timing"):
        speed.median_ci([])
    with pytest.raises(ValueError, match="finite"):
        speed.median_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        speed.median_ci([1.0, 2.0], confidence=1.5)
    with pytest.raises(ValueError, match="denominator's median must be > 0"):
        speed.ratio_ci([1.0], [0.0])


def test_bottom_line_says_who_is_faster_with_the_ci_and_the_cpu_caveat():
    slower = speed.bottom_line(_run("jax", "fp32", 0.0137), _run("torch", "fp32", 0.010, seed=1))
    assert slower.startswith("JAX 1.3") and "x slower than torch eager (95% CI 1." in slower
    assert "emulated" not in slower and "UNRELIABLE" not in slower
    faster = speed.bottom_line(
        _run("jax", "bf16-mixed", 0.010), _run("torch", "bf16-mixed", 0.060, seed=1)
    )
    assert faster.startswith("JAX 6.") and "x faster than torch eager" in faster
    assert "torch's bf16 is emulated on this CPU" in faster
    same = speed.bottom_line(
        _run("jax", "fp32", 0.010, noise=0.2), _run("torch", "fp32", 0.010, noise=0.2, seed=1)
    )
    assert same.startswith("no clear difference")
    compiled = speed.bottom_line(
        _run("jax", "fp32", 0.02), _run("torch", "fp32", 0.01, torch_mode="compile")
    )
    assert "than torch.compile" in compiled


def test_unreliable_figures_are_flagged():
    loaded = {**CPU_AVX2, "cpu": {**CPU_AVX2["cpu"], "load_average": [9.1]}}
    warnings = speed.reliability_warnings(_run("torch", "fp32", 0.01, hardware=loaded))
    assert warnings == ["torch: machine load 9.1 on 2 cores"]
    noisy = speed.reliability_warnings(_run("jax", "fp32", 0.01, noise=0.6))
    assert any("95% CI" in w for w in noisy)
    assert speed.reliability_warnings(_run("jax", "fp32", 0.01, n=4)) == ["jax: only 4 timed steps"]
    unequal = {**CPU_AVX2, "jax": {**CPU_AVX2["jax"], "cpu_intra_op_threads": 1}}
    assert (
        "unequal threads"
        in speed.reliability_warnings(_run("jax", "fp32", 0.01, hardware=unequal))[0]
    )
    line = speed.bottom_line(
        _run("jax", "fp32", 0.01, hardware=loaded), _run("torch", "fp32", 0.02, hardware=loaded)
    )
    assert "UNRELIABLE: jax: machine load 9.1" in line


def test_sections_and_memory_notes():
    runs = [
        _run("torch", "fp32", 0.01),
        _run("jax", "fp32", 0.014, memory=2 * 2**20),
        _run("torch", "bf16-mixed", 0.06),
        _run("jax", "bf16-mixed", 0.014, memory=int(2.1 * 2**20)),
        _run("jax", "fp32", 0.01, variant="noise"),  # calibration runs are not timed figures
        {**_run("torch", "fp32", 0.01), "status": "error"},
    ]
    text = "\n".join(speed.speed_section(runs))
    assert text.count("- **cnn") == 2 and "JAX" in text and "95% CI" in text
    memory = "\n".join(memory_report.memory_section(runs))
    assert "Not directly comparable" in memory
    assert "bf16-mixed plans 2.10 MiB against fp32's 2.00 MiB" in memory
    hw = "\n".join(speed.hardware_section(runs))
    assert "AVX2" in hw and "no AVX-512" in hw
    assert memory_report.memory_comparability(
        "torch_cuda_max_memory_allocated", "jax_gpu_peak_bytes_in_use"
    ).startswith("Comparable")


def test_plots_are_linear_and_survive_no_data(tmp_path):
    runs = [_run("torch", "fp32", 0.01), _run("jax", "fp32", 0.014)]
    assert plots.plot_step_times(runs, tmp_path / "t.png")
    assert plots.plot_memory(runs, tmp_path / "m.png")
    # nothing timed (every run failed): a PNG that says so, no matplotlib log-scale crash
    failed = [{**r, "status": "error", "steps": []} for r in runs]
    assert not plots.plot_step_times(failed, tmp_path / "t0.png")
    assert not plots.plot_memory(failed, tmp_path / "m0.png")
    for name in ("t.png", "m.png", "t0.png", "m0.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_a_distributed_cell_shows_each_jax_mode_against_torch(tmp_path):
    """Every JAX mode of a distributed arm is its own row and bottom line (it was one "jax" row:
    the last mode recorded stood for all of them)."""
    runs = [
        _run("torch", "fp32", 0.010, distributed="torch ddp", arm="ddp"),
        _run("jax", "fp32", 0.020, seed=1, distributed="jax:jit ddp", arm="ddp"),
        _run("jax", "fp32", 0.005, seed=2, distributed="jax:shard_map ddp", arm="ddp"),
    ]
    members = speed.cells(runs)[("cnn", "fp32", "cpu")]
    assert speed.ordered_labels(members) == ["torch ddp", "jax:jit ddp", "jax:shard_map ddp"]
    assert speed.torch_reference(members)[0] == "torch ddp"
    text = "\n".join(speed.speed_section(runs))
    jit_line = next(line for line in text.splitlines() if "jax:jit ddp vs torch ddp" in line)
    shard_line = next(line for line in text.splitlines() if "jax:shard_map ddp vs" in line)
    assert "slower than torch eager (ddp)" in jit_line
    assert "faster than torch eager (ddp)" in shard_line
    rows = [line for line in text.splitlines() if line.startswith("| cnn | fp32 | cpu |")]
    assert [row.split(" | ")[3] for row in rows] == [
        "torch ddp",
        "jax:jit ddp",
        "jax:shard_map ddp",
    ]
    torch_row = rows[0]
    assert "jax:jit ddp: 2.0" in torch_row and "jax:shard_map ddp: 0.5" in torch_row
    memory = "\n".join(memory_report.memory_section(runs))
    assert memory.count("| cnn | fp32 | cpu |") == 3
    assert plots.plot_step_times(runs, tmp_path / "t.png")
