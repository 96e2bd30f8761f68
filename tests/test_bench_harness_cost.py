"""The harness-cost benchmark reads its figures from the phases a run record keeps: sizes parse
(or are refused by name), the ratios are the documented ones, the table renders (the benchmark
itself runs by hand, never in a test)."""

import pytest


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("bench_harness_cost")


def test_sizes_parse_or_are_refused_by_name(bench):
    assert bench.parse_size("512x8") == {"d_model": 512, "num_layers": 8, "num_heads": 8}
    assert bench.parse_size("gpt2-small") == {"size": "gpt2-small"}
    with pytest.raises(SystemExit, match="gpt2-small"):
        bench.parse_size("gpt2-smal")


def test_the_ratios_come_from_the_records_phases(bench):
    phases = [
        ("step 0", 6.0),
        ("step 0/layer probe", 2.0),
        ("step 0/outputs and gradients", 3.0),
        ("step 0/outputs and gradients/torch", 1.0),
        ("step 0/outputs and gradients/jax", 2.0),
        ("step 0/outputs and gradients/jax/compile", 1.5),
        ("train torch", 5.0),
        ("train torch/steps", 4.0),
        ("train jax", 5.0),
        ("train jax/compile", 3.0),
        ("train jax/steps", 1.0),
        ("report", 1.0),
        ("report/plots", 0.5),
    ]
    run = {"phases": [{"phase": p, "wall_s": 2 * c, "cpu_s": c} for p, c in phases]}
    row = bench.summarise(run, steps=10)
    assert row["total_cpu_s"] == 17.0 and row["train_steps_cpu_s"] == 5.0
    assert row["harness_over_steps"] == pytest.approx((17 - 5 - 3) / 5)
    assert row["harness_over_steps_at_300"] == pytest.approx(9 / (0.5 * 300))
    assert row["step0_over_one_step"] == pytest.approx(6 / (3 + 0.5))
    assert row["plots_share_of_wall"] == pytest.approx(1 / 34)
    meta = {"machine": "m", "date": "d", "steps": 10, "batch_size": 8, "seq_len": 64}
    text = bench.render(
        {
            "meta": meta | {"load_before": 1, "load_after": 2},
            "rows": [{"size": "64x2", "precision": "fp32", "verdict": "PASS"} | row],
        }
    )
    assert "| 64x2 | fp32 |" in text and "| 1.71 |" in text
    assert "| 6 (2; 1; 2, 1.5) |" in text  # step 0 (its probe; torch's, JAX's passes, compile)
    assert row["step0_examples"] is None  # the whole batch compared
    run["step0"] = {"examples": {"compared": 2, "batch": 8}}
    bounded = bench.summarise(run, steps=10)
    assert bounded["step0_examples"] == {"compared": 2, "batch": 8}
    cell = {"size": "512x8", "precision": "fp32", "verdict": "PASS"} | bounded
    text = bench.render({"meta": meta | {"load_before": 1, "load_after": 2}, "rows": [cell]})
    assert "| 6 (2; 1; 2, 1.5; 2 of 8 examples) |" in text
