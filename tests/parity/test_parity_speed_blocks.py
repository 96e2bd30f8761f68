"""Speed a study can quote: alternating-block statistics on synthetic timings (steady -> a ratio
with an interval over the blocks; disagreeing blocks -> "not reproducible here"; an oversubscribed
machine -> refused), the bottom line never led by an unquotable figure, the plots' caveats, the
measured fp16 probe, thread settings, and one real alternating-block timing."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

from parity.core.hardware import torch_matmul_probe
from parity.perf import measure, speed
from parity.report import plots

matplotlib.use("Agg")


def _blocks(median, *, blocks=6, steps=8, noise=0.02, drift=None, seed=0):
    """Synthetic block timings: `drift` multiplies block i's times (load that moved)."""
    rng = np.random.default_rng(seed)
    drift = drift or [1.0] * blocks
    return [list(median * d * (1 + noise * rng.standard_normal(steps))) for d in drift]


def _trial(jax_blocks, torch_blocks, *, others=0.05, threads=2, cores=2, xla_threads=None):
    return {
        "device": "cpu",
        "torch_label": "torch",
        "times": {"jax": jax_blocks, "torch": torch_blocks},
        "others_cpu_cores_total": others,
        "threads": {
            "available_cpus": cores,
            "torch_intra_op_threads": threads,
            "xla_cpu_intra_op_threads": xla_threads or threads,
        },
        "load_average_before": [0.5, 0.5, 0.5],
    }


def _run(framework, trial=None, *, median=0.01, n=30, noise=0.02, seed=0, precision="fp32"):
    rng = np.random.default_rng(seed)
    times = median * (1 + noise * rng.standard_normal(n))
    run = {
        "framework": framework,
        "model": "transformer",
        "precision": precision,
        "policy": {"fp32": "p=f32,c=f32,o=f32", "fp16-mixed": "p=f32,c=f16,o=f32"}[precision],
        "device": "cpu",
        "status": "completed",
        "config": {"timing_warmup": 0},
        "hardware": {"cpu": {"available_cpus": 2, "load_average": [0.5]}},
        "steps": [{"step": i, "time_s": float(t)} for i, t in enumerate(times)],
        "summary": {"peak_memory_bytes": 2**20, "peak_memory_method": "xla_memory_analysis"},
    }
    if trial is not None:
        run["speed_blocks"] = trial
    return run


# --- the statistics ------------------------------------------------------------------------------


def test_steady_blocks_give_a_ratio_whose_interval_holds_the_truth():
    verdict = speed.block_verdict(_blocks(0.008), _blocks(0.010, seed=1))
    assert verdict["status"] == "ratio" and verdict["reason"] is None
    assert verdict["low"] < 0.8 < verdict["high"] and verdict["high"] / verdict["low"] < 1.1
    assert len(verdict["block_ratios"]) == 6


def test_the_interval_includes_the_between_block_spread():
    """Load that moved between rounds (alike for both frameworks within a round) must widen the
    interval relative to a run where it did not; a bootstrap over pooled steps would not see it
    as clearly, as it pools the rounds."""
    drift = [1.0, 1.3, 0.9, 1.25, 1.05, 0.95]
    moved = speed.block_verdict(
        _blocks(0.008, drift=[d * 1.1 for d in drift]), _blocks(0.010, drift=drift, seed=1)
    )
    steady = speed.block_verdict(_blocks(0.008), _blocks(0.010, seed=1))
    # Within a round both frameworks moved alike: the paired ratio is steady -> still a ratio...
    assert moved["status"] == "ratio"
    # ...but a framework hit alone in some rounds spreads the rounds and so the interval.
    hit = [1.0, 1.25, 1.0, 1.2, 1.0, 1.15]
    uneven = speed.block_verdict(_blocks(0.008, drift=hit), _blocks(0.010, seed=1))
    assert uneven["status"] == "ratio"
    width = uneven["high"] / uneven["low"]
    assert width > 1.1 and width > 2 * (steady["high"] / steady["low"] - 1) + 1
    assert uneven["low"] < 0.8 * float(np.mean(hit)) < uneven["high"]


def test_disagreeing_blocks_are_not_reproducible():
    # the blocks' ratios span 2x: beyond any interval over six rounds
    swing = speed.block_verdict(_blocks(0.01, drift=[1, 2, 1, 2, 1, 2]), _blocks(0.01, seed=1))
    assert swing["status"] == "not reproducible" and swing["ratio"] is None
    assert "span 2.0" in swing["reason"] and "beyond their 95% CI" in swing["reason"]
    # who is faster flips in one block while the interval says "faster"
    flip = speed.block_verdict(
        _blocks(0.01, drift=[0.8, 0.8, 0.8, 0.8, 0.8, 1.05], noise=0.001),
        _blocks(0.01, noise=0.001, seed=1),
    )
    assert flip["status"] == "not reproducible"
    assert "other framework ahead" in flip["reason"]


def test_oversubscribed_machine_and_too_few_blocks_are_refused():
    reason = speed.oversubscribed(1.4, 2, 2)
    assert reason.startswith("machine oversubscribed: other processes used 1.4 of the 2 cores")
    assert speed.oversubscribed(0.2, 2, 2) is None
    assert speed.oversubscribed(1.2, 2, 1) is None  # one thread each: 0.8 free cores is enough
    assert speed.oversubscribed(None, 2, 2, load_average=3.5).startswith(
        "machine oversubscribed: 1-minute load 3.5"
    )
    refused = speed.block_verdict(_blocks(0.008), _blocks(0.010), refused=reason)
    assert refused["status"] == "refused" and refused["ratio"] is None
    few = speed.block_verdict(_blocks(0.008, blocks=2), _blocks(0.010, blocks=2))
    assert few["status"] == "refused" and "only 2 alternating blocks" in few["reason"]
    with pytest.raises(ValueError, match="as many JAX blocks"):
        speed.block_verdict(_blocks(0.01, blocks=3), _blocks(0.01, blocks=4))
    with pytest.raises(ValueError, match="must be finite"):
        speed.block_verdict([[float("nan")]] * 3, _blocks(0.01, blocks=3))


# --- the bottom line --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trial_kwargs", "drift", "status", "start"),
    [
        ({}, None, "ratio", "JAX 1.25x faster than torch eager (95% CI"),
        ({}, [1, 2, 1, 2, 1, 2], "not reproducible", "not reproducible here: the block ratios"),
        ({"others": 1.6}, None, "refused", "no speed ratio: machine oversubscribed"),
        ({"xla_threads": 1}, None, "refused", "no speed ratio: unequal threads (torch 2, XLA"),
    ],
)
def test_speed_figure_statuses_and_only_a_quotable_ratio_leads(trial_kwargs, drift, status, start):
    trial = _trial(_blocks(0.008, drift=drift), _blocks(0.010, seed=1), **trial_kwargs)
    figure = speed.speed_figure(_run("jax", trial), _run("torch", trial, seed=1))
    assert figure["status"] == status
    assert figure["text"].startswith(start)
    if status == "ratio":
        assert "over 6 alternating blocks" in figure["text"]


def test_sequential_runs_with_warnings_lead_with_unreliable():
    figure = speed.speed_figure(
        _run("jax", median=0.001, noise=0.8), _run("torch", median=0.03, seed=1)
    )
    assert figure["status"] == "unreliable" and figure["text"].startswith("UNRELIABLE: jax:")
    steady = speed.speed_figure(_run("jax"), _run("torch", seed=1))
    assert steady["status"] == "sequential" and "not in alternating blocks" in steady["text"]


def test_fp16_caveat_is_the_measured_probe_never_a_fixed_factor():
    probe = {"dtype": "float16", "n": 256, "ratio_to_fp32": 6.8}
    trial = {**_trial(_blocks(0.008), _blocks(0.010)), "torch_probe": probe}
    measured = speed.cell_caveats(_run("torch", trial, precision="fp16-mixed"))
    assert any("float16 matmul takes 6.8x its float32 time" in c for c in measured)
    unmeasured = " ".join(speed.cell_caveats(_run("torch", precision="fp16-mixed")))
    assert "not measured" in unmeasured and "200x" not in unmeasured


def test_torch_matmul_probe_measures_both_dtypes():
    pytest.importorskip("torch")
    probe = torch_matmul_probe("float16", 32, 1)
    assert probe["n"] == 32 and probe["float32_s"] > 0 and probe["dtype_s"] > 0
    assert probe["ratio_to_fp32"] == pytest.approx(probe["dtype_s"] / probe["float32_s"])


# --- the plots -----------------------------------------------------------------------------------


def test_step_time_plot_marks_figures_not_to_quote(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "_savefig", lambda fig, path: drawn.append(fig))
    swing = _trial(_blocks(0.008, drift=[1, 2, 1, 2, 1, 2]), _blocks(0.010, seed=1))
    steady = _trial(_blocks(0.008), _blocks(0.010, seed=1))
    cells = [
        [_run("jax", swing), _run("torch", swing, seed=1)],
        [_run("jax", steady), _run("torch", steady, seed=1)],
        [_run("jax", median=0.001, noise=0.8), _run("torch", median=0.03, seed=1)],
    ]
    marks = []
    for runs in cells:
        members = speed.cells(runs)[("transformer", "fp32", "cpu")]
        marks.append(plots.step_time_caveat(members))
        assert plots.plot_step_times(runs, tmp_path / "t.png")
        texts = [t.get_text() for ax in drawn[-1].axes for t in ax.texts]
        assert any(t.replace("\n", " ").startswith(marks[-1] or "\0") for t in texts) == bool(
            marks[-1]
        )
    assert marks[0].startswith("NOT REPRODUCIBLE HERE: the block ratios span")
    assert marks[1] is None
    assert marks[2].startswith("UNRELIABLE: jax:")


def test_memory_plot_never_sets_profiler_bytes_beside_an_xla_plan():
    torch_cpu = _run("torch")
    torch_cpu["summary"] = {
        "peak_memory_bytes": 3 * 2**20,
        "peak_memory_method": "torch_profiler_cpu_allocations",
    }
    panels = plots.memory_panels([torch_cpu, _run("jax")])
    assert [[b[2] for b in bars] for _, bars in panels] == [
        ["torch_profiler_cpu_allocations"],
        ["xla_memory_analysis"],
    ]
    assert all("not comparable" in title for title, _ in panels)
    gpu = [
        {
            **_run(fw),
            "device": "gpu",
            "summary": {"peak_memory_bytes": 2**20, "peak_memory_method": m},
        }
        for fw, m in (
            ("torch", "torch_cuda_max_memory_allocated"),
            ("jax", "jax_gpu_peak_bytes_in_use"),
        )
    ]
    ((title, bars),) = plots.memory_panels(gpu)  # allocator peaks compare: one panel
    assert len(bars) == 2 and "not comparable" not in title


# --- threads, contention, blocks -------------------------------------------------------------------


def test_thread_warnings_name_spinning_openmp_threads():
    spinning = {"torch_intra_op_threads": 2, "xla_cpu_intra_op_threads": 2, "omp_wait_policy": None}
    assert "may spin-wait" in measure.thread_warnings(spinning)[0]
    passive = {**spinning, "omp_wait_policy": "PASSIVE"}
    assert measure.thread_warnings(passive) == []


def test_time_blocks_alternates_rotates_and_measures_other_processes():
    calls = []
    record = measure.time_blocks(
        {"torch": lambda: calls.append("t"), "jax": lambda: calls.append("j")},
        blocks=3,
        block_steps=2,
        warmup=1,
    )
    assert calls == ["t", "j"] + ["t", "t", "j", "j"] + ["j", "j", "t", "t"] + ["t", "t", "j", "j"]
    assert record["order"] == [["torch", "jax"], ["jax", "torch"], ["torch", "jax"]]
    assert [len(b) for b in record["times"]["jax"]] == [2, 2, 2]
    others = record["others_cpu_cores_total"]
    assert others is None or others >= 0
    with pytest.raises(ValueError, match="`blocks` must be an integer >= 1"):
        measure.time_blocks({"a": lambda: None}, blocks=0, block_steps=1)


@pytest.mark.torch
@pytest.mark.standard_promotion  # optax's AdamW bias correction promotes a Python float
def test_time_cell_alternates_the_trainers_own_steps():
    """One real alternating-block timing: the trainers' steps (JAX's executable reused from the
    run), the record's fields, and a verdict that is one of the three statuses."""
    pytest.importorskip("torch")
    from parity.core.config import RunConfig
    from parity.models import get_model_pair
    from parity.training.blocks import time_cell
    from parity.training.train_jax import train_jax

    tiny = {"image_shape": (8, 8, 3), "hidden": 16}
    config = RunConfig(
        model="mlp", precision="fp32", steps=3, batch_size=4, eval=False, model_overrides=tiny
    )
    pair = get_model_pair("mlp", seed=0, **tiny)
    stream = pair.make_data(config.stream_seed, config.batch_size)
    train_jax(config, pair, stream)
    record = time_cell(config, pair, stream, blocks=3, block_steps=2, warmup=1)
    assert record["jax_compile_time_s"] is None  # the run's executable, not a second compile
    assert [len(b) for b in record["times"]["torch"]] == [2, 2, 2]
    assert record["order"][1] == ["jax", "torch"]
    assert record["threads"]["torch_intra_op_threads"] is not None
    assert record["verdict"]["status"] in ("ratio", "not reproducible", "refused")
    assert record["verdict"] == speed.blocks_verdict(record)


def test_speed_section_tabulates_the_rounds_with_threads_and_load():
    steady = _trial(_blocks(0.008), _blocks(0.010, seed=1))
    text = "\n".join(speed.speed_section([_run("jax", steady), _run("torch", steady, seed=1)]))
    assert "JAX 1.25x faster than torch eager (95% CI" in text and "over 6 alternating" in text
    assert "| transformer | fp32 | cpu | 6 x ? | 0.8" in text
    assert "| 2 / 2 (OMP default) | 0.05 of 2 | 0.5 |" in text
    swing = _trial(_blocks(0.008, drift=[1, 2, 1, 2, 1, 2]), _blocks(0.010, seed=1))
    text = "\n".join(speed.speed_section([_run("jax", swing), _run("torch", swing, seed=1)]))
    assert "- **transformer fp32 (cpu)**: Not reproducible here:" in text
    assert "| not reproducible |" in text


def test_the_reproduction_benchmark_concludes_from_words_and_intervals(benchmark_script):
    bench = benchmark_script("bench_speed_repro")
    fast = {"status": "ratio", "ratio": 0.8, "low": 0.75, "high": 0.85, "reason": None}
    assert bench.conclusion([fast, {**fast, "low": 0.8, "high": 0.9}])[0] == "REPRODUCED"
    # the three "JAX faster" runs of the issue: one word, disjoint intervals
    issue = [(0.17, 0.2), (0.013, 0.015), (0.0128, 0.0151)]
    runs = [{**fast, "ratio": (a + b) / 2, "low": a, "high": b} for a, b in issue]
    assert bench.conclusion(runs) == (
        "NOT REPRODUCIBLE HERE",
        "2 pairs of runs have disjoint intervals",
    )
    tie = {**fast, "low": 0.9, "high": 1.1, "ratio": 1.0}
    assert "verdict words differ" in bench.conclusion([fast, tie])[1]
    refused = {"status": "refused", "reason": "machine oversubscribed: ..."}
    assert bench.conclusion([fast, refused])[0] == "REFUSED"
    swing = {"status": "not reproducible", "reason": "..."}
    assert bench.conclusion([fast, swing, refused])[0] == "NOT REPRODUCIBLE HERE"


@pytest.mark.torch
def test_speed_blocks_option_is_checked_before_any_work(tmp_path, capsys):
    from parity.cli.commands import main

    args = ["run", "--model", "mlp", "--steps", "2", "--out", str(tmp_path / "x"), "--no-progress"]
    assert main([*args, "--speed-blocks", "2"]) == 2
    assert "--speed-blocks must be 0 (no alternating-block timing) or an integer >= 3" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "x" / "results.json").exists()


def test_a_refused_figure_withholds_every_speed_figure_measured_with_it():
    """Oversubscribed: the ratio is refused, so neither torch's matmul probe (measured at the
    same load) nor the Speed table's JAX/torch ratio is quoted; each carries the same mark."""
    probe = {"dtype": "float16", "n": 256, "ratio_to_fp32": 330.0, "load_average": 6.8}
    loaded = {**_trial(_blocks(0.008), _blocks(0.010), others=1.6), "torch_probe": probe}
    jax_run = _run("jax", loaded, precision="fp16-mixed")
    torch_run = _run("torch", loaded, seed=1, precision="fp16-mixed")
    figure = speed.speed_figure(jax_run, torch_run)
    assert figure["status"] == "refused"
    assert "330x" not in figure["text"] and "not quoted (NO RATIO" in figure["text"]
    text = "\n".join(speed.speed_section([jax_run, torch_run]))
    row = next(
        line for line in text.splitlines() if line.startswith("| transformer") and "torch" in line
    )
    assert "withheld (NO RATIO)" in row and row.count("NO RATIO") == 2, row
    # The probe's own load above the cores withholds it even beside a quotable ratio.
    quiet = {**_trial(_blocks(0.008), _blocks(0.010)), "torch_probe": probe}
    caveats = speed.cell_caveats(_run("torch", quiet, precision="fp16-mixed"))
    assert any("measured at load 6.8 on 2 cores" in c for c in caveats) and not any(
        "330x" in c for c in caveats
    )
    steady = speed.speed_figure(_run("jax", quiet), _run("torch", quiet, seed=1))
    assert steady["status"] == "ratio"
    table = "\n".join(speed.speed_section([_run("jax", quiet), _run("torch", quiet, seed=1)]))
    assert "withheld" not in table.split("| model |")[1].split("\n\n")[0]
