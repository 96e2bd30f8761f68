"""The loss-scaling benchmark compares like with like: every variant trains the same model to
the same parameters (the benchmark itself is timed by hand, never in a test)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# optax's own arithmetic is not strict-promotion clean (float ** int32 in bias correction).
pytestmark = pytest.mark.standard_promotion


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("bench_loss_scaled")


# XLA:CPU's code generation for the value check: its legacy fusion emitters, without LLVM's
# optimisations. Each variant's program (its HLO, donation included) is the benchmark's; only
# the machine code XLA makes of it differs: a fifth of the compile time (0.9 against 4.0 CPU s
# for the ten float32 steps), the same values up to float32 rounding (an FMA contracted or not),
# which the tolerances below allow. The benchmark's own runs (tests below) keep XLA's defaults.
_CHECK_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0}


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_every_variant_trains_to_the_same_parameters(bench, policy):
    # The tiny MLP: the same code paths as the benchmark's 784-1024-1024-1024-10 one.
    params, x, y, loss_fn = bench._problem("mlp", 8, tiny=True)
    results = {}
    for variant in bench.VARIANTS + bench.DIAGNOSTICS:
        # Donation changes buffers, not values: both forms once (fp32) for the two forms of
        # loss_scaled (its in_place branch is the donated step's), donated elsewhere.
        both = policy == "fp32" and variant in ("loss_scaled", "loss_scaled_in_place")
        for donate in (True, False) if both else (True,):
            init, step = bench._make_step(variant, loss_fn, policy, donate=donate)
            p = jax.tree.map(jnp.copy, params)
            s = init(p)
            step = step.lower(p, s, x, y).compile(_CHECK_COMPILE)
            for _ in range(3):
                p, s, loss = step(p, s, x, y)[:3]
            assert np.isfinite(float(loss))
            results[variant, donate] = p
    # Same optimizer, same gradients: only XLA's fusion (FMA contraction) and, below float32,
    # the policy's rounding of the scaled backward pass may differ.
    rtol = 1e-5 if policy == "fp32" else 1e-2
    if policy == "fp16-mixed":
        # Unscaled float16 gradients underflow, which is what loss scaling is for: the unscaled
        # step of the README's gradient program is a timing reference for loss_scaled_policy
        # there, and its parameters part from the scaled steps' (loss_scaled_policy's do not).
        del results["plain_policy", True]
    for variant, p in results.items():
        for a, b in zip(jax.tree.leaves(results["plain", True]), jax.tree.leaves(p), strict=True):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-6, err_msg=variant
            )


def test_main_prints_a_table_and_writes_json(bench, tmp_path, capsys):
    out = tmp_path / "r.json"
    bench.main(
        [
            "--models",
            "mlp",
            "--policies",
            "fp32",
            "--variants",
            "loss_scaled",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--smoke",
            "--tiny",
            "--out",
            str(out),
        ]
    )
    payload = json.loads(out.read_text())
    assert payload["complete"] is True  # written after each configuration, marked when all ran
    donated, not_donated = payload["results"]
    assert (donated["donated"], not_donated["donated"]) == (True, False)
    for result in (donated, not_donated):
        # the variants asked for, after the reference (test_every_variant_... builds them all)
        assert list(result["variants"]) == ["plain", "loss_scaled"]
        for v in result["variants"].values():
            lo, hi = v["ratio_ci95"]
            assert lo <= hi and v["median_s"] > 0 and v["compile_s"] > 0
    assert "loss_scaled" in capsys.readouterr().out.splitlines()[-2]
    with pytest.raises(SystemExit):
        bench.main(["--steps", "3", "--out", str(out)])  # too few steps without --smoke


def test_variants_option_times_plain_and_the_chosen_ones(bench, tmp_path):
    """``--variants`` times plain and the chosen ones, in that order; "ahead of a peer" is read
    from loss_scaled's own ratio to it (paired CI), not from two ratios to plain."""
    out = tmp_path / "r.json"
    common = ["--models", "mlp", "--policies", "fp32", "--steps", "3", "--smoke", "--tiny"]
    bench.main(
        [
            *common,
            *("--warmup", "1", "--donate", "no", "--clock", "cpu"),
            *("--variants", "order_floor", "loss_scaled", "jmp", "plain_policy"),
            *("loss_scaled_policy", "--out", str(out)),
        ]
    )
    (result,) = json.loads(out.read_text())["results"]
    assert list(result["variants"]) == [
        *("plain", "order_floor", "loss_scaled", "jmp", "plain_policy", "loss_scaled_policy")
    ]
    assert result["donated"] is False and result["tiny"] is True and result["clock"] == "cpu"
    rows = result["variants"]
    # The README's step verbatim against its own unscaled gradient program.
    own = rows["loss_scaled_policy"]["ratio_to_plain_policy"]
    assert own["ratio"] == pytest.approx(
        rows["loss_scaled_policy"]["median_s"] / rows["plain_policy"]["median_s"]
    )
    assert 0 < own["ci95"][0] <= own["ci95"][1]
    assert "ratio_to_plain_policy" not in rows["loss_scaled"]
    assert "ratio_to_peer" not in rows["plain"] and "ratio_to_peer" not in rows["jmp"]
    peers = rows["loss_scaled"]["ratio_to_peer"]
    assert list(peers) == ["jmp"]  # the peers timed in this run only
    for peer, compared in peers.items():
        assert compared["ratio"] == pytest.approx(
            rows["loss_scaled"]["median_s"] / rows[peer]["median_s"]
        )
        lo, hi = compared["ci95"]
        assert 0 < lo <= hi
    with pytest.raises(SystemExit):
        bench.main([*common, "--variants", "loss_scaled_fast", "--out", str(out)])
    with pytest.raises(ValueError, match="must start with 'plain'"):
        bench.bench("mlp", "fp32", 2, 1, 8, variants=("loss_scaled",))
    with pytest.raises(ValueError, match="clock must be one of"):
        bench.bench("mlp", "fp32", 2, 1, 8, variants=("plain",), clock="gpu")


def test_hlo_analysis_reads_gpus_program(bench, benchmark_script):
    """`benchmarks/hlo_loss_scaled.py` on the MLP, lowered for GPU here: jaxamp's check adds one
    reduction per gradient leaf (Flax's count), one pass, nothing written between passes, and
    no conditional; lowered for CPU, the block form and (donated) the branch."""
    rows = benchmark_script("hlo_loss_scaled").analyse(
        ["mlp"], ["fp32"], ["plain", "loss_scaled_in_place", "flax"], ["cpu", "cuda"]
    )
    got = {(r["variant"], r["donated"], r["platform"]): r for r in rows}
    flax = got["flax", True, "cuda"]
    gpu = got["loss_scaled_in_place", True, "cuda"]
    assert gpu["extra_reductions"] == flax["extra_reductions"] == 7  # leaves of >= 1024
    assert gpu["extra_reduced_elements"] == 1.0 and gpu["extra_partial_bytes"] == 0
    assert gpu["conditionals"] == 0 and gpu["callbacks"] == 0
    cpu = got["loss_scaled_in_place", True, "cpu"]
    assert cpu["extra_reductions"] > 7 and cpu["extra_partial_bytes"] > 0
    assert cpu["conditionals"] == 1


def test_compile_benchmark_reads_what_xla_cpu_compiles(bench, benchmark_script, tmp_path, capsys):
    """`benchmarks/compile_loss_scaled.py` on the tiny MLP: a row per (policy, variant) with the
    compiled program's instruction and fusion counts and a compile time per repeat, printed and
    written as JSON; the loss-scaled step's program holds more than the plain one's (its
    check, skip and scale update)."""
    out = tmp_path / "compile.json"
    benchmark_script("compile_loss_scaled").main(
        [
            "--tiny",
            "--models",
            "mlp",
            "--policies",
            "fp16-mixed",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    assert "compile CPU s" in capsys.readouterr().out
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain", "loss_scaled"}
    for r in rows.values():
        assert len(r["compile_cpu_s"]) == 2 and all(t > 0 for t in r["compile_cpu_s"])
        assert r["fusions"] > 0
    assert rows["loss_scaled"]["instructions"] > rows["plain"]["instructions"] > 0
