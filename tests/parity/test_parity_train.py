"""The torch.amp and jaxamp trainers: optimizer equivalence, fp32 per-step parity, fp16 loss-scale
trajectory equality, every model x precision, divergence handling, the shared config."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

from parity.core.config import PRECISIONS, RunConfig, learning_rate_at  # noqa: E402
from parity.core.hardware import skip_if_unsupported  # noqa: E402
from parity.models import MODEL_NAMES, get_model_pair  # noqa: E402
from parity.training.steps import (  # noqa: E402
    build_jax_optimizer,
    build_torch_optimizer,
    clip_by_global_norm_torch,
    set_learning_rate,
)
from parity.training.train_jax import train_jax  # noqa: E402
from parity.training.train_torch import train_torch  # noqa: E402
from parity.verdicts.judge import compare_runs  # noqa: E402

# optax/flax internals need JAX's standard promotion; torch's profiler and autocast are quiet.
pytestmark = [pytest.mark.standard_promotion, pytest.mark.torch]

# Tiny architectures: compile time and torch's slow CPU fp16 kernels dominate otherwise. XLA:CPU's
# compile of a train step grows with the layers and the widths: resnet's channels (2, 2, 4) keep
# every kind of block (identity, strided shortcut, strided widening); on these sizes the resnet and
# transformer cells compile in about 5/6 of the CPU seconds of resnet (4, 4, 8) on 8 x 8 images
# and a 16-wide transformer block.
TINY = {
    "mlp": {"image_shape": (8, 8, 3), "hidden": 16},
    "cnn": {"image_shape": (4, 4, 3), "channels": (2, 4)},
    "cnn_bn": {"image_shape": (4, 4, 3), "channels": (2, 4)},
    "resnet": {"image_shape": (4, 4, 3), "channels": (2, 2, 4)},
    "lstm": {"vocab_size": 16, "embed_dim": 4, "hidden": 4, "seq_len": 4},
    "transformer": {
        "vocab_size": 16,
        "seq_len": 4,
        "d_model": 8,
        "num_heads": 2,
        "num_layers": 1,
        "mlp_ratio": 2,
    },
}


def _pair(config: RunConfig):
    return get_model_pair(config.model, seed=config.seed, **config.model_overrides)


def _both(config: RunConfig):
    pair = _pair(config)
    return train_torch(config, pair), train_jax(config, pair)


def _rel(a, b):
    return abs(a - b) / abs(a)


# --- optimizer equivalence ------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_optimizers_agree_step_for_step_in_fp32(optimizer):
    """torch AdamW/SGD and the optax twins: same params after each of 6 steps of given grads.

    Pins eps placement (outside the sqrt on both sides), decoupled weight decay scaled by the
    learning rate (AdamW), L2 decay before momentum (SGD), a changing learning rate, clipping.
    """
    config = RunConfig(optimizer=optimizer, lr=3e-2, weight_decay=0.1, clip_norm=0.5, steps=6)
    rng = np.random.default_rng(0)
    init = {
        "w": rng.normal(size=(5, 3)).astype(np.float32),
        "b": rng.normal(size=(3,)).astype(np.float32),
    }
    grads_seq = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in init.items()} for _ in range(6)
    ]

    torch_params = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init.items()}
    torch_opt = build_torch_optimizer(config, torch_params.values())
    tx = build_jax_optimizer(config)
    params = {k: jnp.asarray(v) for k, v in init.items()}
    state = tx.init(params)

    @jax.jit
    def jax_step(params, state, grads, lr):
        state = set_learning_rate(state, lr)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for step, grads in enumerate(grads_seq):
        lr = learning_rate_at(config, step)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        for k, p in torch_params.items():
            p.grad = torch.tensor(grads[k])
        torch.nn.utils.clip_grad_norm_(list(torch_params.values()), config.clip_norm)
        torch_opt.step()
        grads = {k: jnp.asarray(v) for k, v in grads.items()}
        params, state = jax_step(params, state, grads, jnp.float32(lr))
        for k in init:
            # float32 rounding only: parameters are O(1), one ulp is ~1.2e-7.
            np.testing.assert_allclose(
                np.asarray(params[k]), torch_params[k].detach().numpy(), rtol=1e-6, atol=1e-6
            )


def test_clip_matches_torch_clip_grad_norm():
    rng = np.random.default_rng(1)
    grads = [rng.normal(size=s).astype(np.float32) * 3 for s in [(4, 4), (7,)]]
    tensors = [torch.tensor(g) for g in grads]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for p, t in zip(params, tensors, strict=True):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    clipped, _ = clip_by_global_norm_torch(1.0).update([jnp.asarray(g) for g in grads], None)
    for p, c in zip(params, clipped, strict=True):
        np.testing.assert_allclose(np.asarray(c), p.grad.numpy(), rtol=1e-6)


# --- per-step parity ------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fp32_per_step_loss_parity(optimizer):
    """fp32: per-step loss within 1e-4 relative for 10 steps, 1e-3 up to 30 (DESIGN tolerances)."""
    config = RunConfig(
        model="mlp",
        precision="fp32",
        steps=30,
        batch_size=16,
        optimizer=optimizer,
        lr=1e-2 if optimizer == "sgd" else 1e-3,
        lr_warmup_steps=3,
        eval=False,
        model_overrides=TINY["mlp"],
    )
    torch_run, jax_run = _both(config)
    for a, b in zip(torch_run["steps"], jax_run["steps"], strict=True):
        tolerance = 1e-4 if a["step"] < 10 else 1e-3
        assert _rel(a["loss"], b["loss"]) <= tolerance, (a, b)
    assert torch_run["steps"][-1]["loss"] < torch_run["steps"][0]["loss"]  # it learns


@pytest.mark.integration
def test_fp16_loss_scale_trajectory_identical():
    """fp16-mixed: same scale every step and same skip decisions, with overflow and growth."""
    config = RunConfig(
        model="mlp",
        precision="fp16-mixed",
        steps=14,
        batch_size=8,
        init_scale=2.0**24,
        growth_interval=3,
        eval=False,
        model_overrides=TINY["mlp"],
    )
    torch_run, jax_run = _both(config)
    torch_scales = [s["loss_scale"] for s in torch_run["steps"]]
    assert torch_scales == [s["loss_scale"] for s in jax_run["steps"]]
    assert [s["skipped"] for s in torch_run["steps"]] == [s["skipped"] for s in jax_run["steps"]]
    assert torch_scales[0] == 2.0**24
    assert any(s["skipped"] for s in torch_run["steps"])  # overflow happened...
    assert any(b > a for a, b in zip(torch_scales, torch_scales[1:], strict=False))  # ...and growth
    assert torch_run["summary"]["skipped_steps"] == jax_run["summary"]["skipped_steps"] > 0


# --- every model x precision ----------------------------------------------------------------


# Recipes whose torch face replaces the optimizer (torchao's) and change nothing else of bf16-true
# or fp32.
OPTIMIZER_PRECISIONS = ("adamw-8bit", "adamw-4bit", "adamw-fp8", "bf16-true-sr")
# mlp and mlp_nnx (the same program) run every recipe in tests/parity/test_parity_recipes.py's
# every-recipe test, whose single-device runs are checked with `check_records` too.
RECIPE_MODELS = ("mlp", "mlp_nnx")


def check_records(config: RunConfig, torch_run: dict, jax_run: dict) -> None:
    """The two records of a cell: complete, finite, the config's, and starting from one loss."""
    model, precision = config.model, config.precision
    for run in (torch_run, jax_run):
        assert run["precision"] == precision and run["model"] == model
        assert run["config"]["policy"] == str(config.policy)
        assert RunConfig.from_dict(run["config"]) == config
        assert len(run["steps"]) == config.steps
        for step in run["steps"]:
            assert set(step) >= {"step", "loss", "loss_scale", "skipped", "time_s"}
            assert step["loss"] is not None and math.isfinite(step["loss"])
            assert (step["loss_scale"] is None) == (precision != "fp16-mixed")
        summary = run["summary"]
        for key in ("step_time_median_s", "peak_memory_bytes", "final_loss", "skipped_steps"):
            assert summary[key] is not None, key
        assert summary["peak_memory_method"] in (
            "xla_memory_analysis",
            "torch_profiler_cpu_allocations",
        )
        assert summary["peak_memory_bytes"] > 0
        assert (summary["eval_metric"] is not None) == config.eval
    assert jax_run["summary"]["compile_time_s"] > 0
    # The loss scale (fp16-mixed; None elsewhere) moves, and skips, identically on both sides.
    assert [s["loss_scale"] for s in torch_run["steps"]] == [
        s["loss_scale"] for s in jax_run["steps"]
    ]
    assert [s["skipped"] for s in torch_run["steps"]] == [s["skipped"] for s in jax_run["steps"]]
    # Same weights, same first batch: the first losses agree closely at any precision.
    assert _rel(torch_run["steps"][0]["loss"], jax_run["steps"][0]["loss"]) < 0.02
    if model == "transformer":  # a correct port passes the eval-logit KL and top-1 rows
        rows = [v for v in compare_runs([torch_run, jax_run]) if v.check.startswith("eval logits")]
        assert len(rows) == 4 and all(v.passed is True for v in rows), rows


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore::UserWarning:torch.*")
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", [m for m in MODEL_NAMES if m not in RECIPE_MODELS])
def test_every_model_and_precision_runs(model, precision):
    skip_if_unsupported("torch", precision, model, "cpu")  # bf16 LSTM needs AVX-512 (oneDNN)
    if precision.startswith("fp8-") and (model != "cnn" or precision != "fp8-rowwise"):
        pytest.skip(
            "fp8: one recipe on cnn here, every recipe on mlp in "
            "tests/parity/test_parity_recipes.py; tests/parity/test_fp8_parity.py covers the rest"
        )
    if precision.startswith("mx"):
        pytest.skip(
            "block-scaled formats need linear layers with features in multiples of 32, which "
            "these tiny models lack: tests/parity/test_mx_parity.py runs them on such models "
            "and checks that the models without one are refused"
        )
    if precision in OPTIMIZER_PRECISIONS:
        pytest.skip(
            "the optimizer's own precisions change no model code (bf16-true-sr is bf16-true, "
            "run on every model, with torchao's optimizer): tests/parity/test_parity_recipes.py "
            "runs them on mlp; tests/parity/test_parity_optim_state.py checks their state on "
            "cnn and transformer"
        )
    config = RunConfig(
        model=model,
        precision=precision,
        steps=3,
        batch_size=2 if precision == "fp16-mixed" else 4,
        timing_warmup=1,
        eval=model == "transformer",
        model_overrides=TINY[model],
    )
    check_records(config, *_both(config))


# --- robustness -----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning:torch.*")
def test_diverging_run_is_recorded_not_raised():
    config = RunConfig(
        model="mlp",
        precision="fp32",
        optimizer="sgd",
        lr=1e6,
        clip_norm=None,
        schedule="constant",
        steps=40,
        batch_size=8,
        model_overrides=TINY["mlp"],
    )
    torch_run, jax_run = _both(config)
    from parity.verdicts.judge import compare_runs

    for run in (torch_run, jax_run):
        summary = run["summary"]
        assert summary["diverged"]
        assert summary["first_nonfinite_step"] is not None
        assert any(s["loss"] is None and not s["loss_finite"] for s in run["steps"])
        assert summary["stopped_reason"]  # stopped early, after 10 non-finite steps
        assert len(run["steps"]) < 40
    verdicts = compare_runs([torch_run, jax_run])
    assert any(v.check == "no divergence" and v.passed is False for v in verdicts)


# --- the shared config ----------------------------------------------------------------------


def test_config_round_trip_and_policy_string():
    config = RunConfig(model="cnn", precision="bf16-mixed", model_overrides={"channels": (4, 8)})
    data = config.to_dict()
    assert data["policy"] == "p=f32,c=bf16,o=f32"
    assert RunConfig.from_dict(data) == config
    bad = dict(data, policy="p=f32,c=f16,o=f32")
    with pytest.raises(ValueError, match="policy"):
        RunConfig.from_dict(bad)


@pytest.mark.parametrize(
    "field,value",
    [
        ("precision", "fp8"),
        ("steps", 0),
        ("batch_size", -1),
        ("optimizer", "lamb"),
        ("lr", float("nan")),
        ("clip_norm", -1.0),
        ("device", "tpu"),
        ("schedule", "linear"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RunConfig(**{field: value})


def test_learning_rate_schedule():
    config = RunConfig(lr=1.0, steps=10, lr_warmup_steps=2, schedule="cosine")
    rates = [learning_rate_at(config, s) for s in range(10)]
    assert rates[:2] == [0.5, 1.0]
    assert rates[2] == 1.0 and rates[-1] < rates[5] < rates[2]
    constant = RunConfig(lr=0.3, schedule="constant")
    assert {learning_rate_at(constant, s) for s in range(5)} == {0.3}


def test_jax_train_step_compiles_once(monkeypatch):
    """The JAX step is compiled ahead of time and reused: one trace for the whole run."""
    import jaxamp as module_jaxamp

    # test_fp32_per_step_loss_parity[adamw]'s program (batch 16)
    config = RunConfig(model="mlp", steps=4, batch_size=16, eval=False, model_overrides=TINY["mlp"])
    traces = []
    original = module_jaxamp.value_and_grad

    def counting(*args, **kwargs):
        fn = original(*args, **kwargs)

        def wrapped(*a, **k):
            traces.append(1)
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(module_jaxamp, "value_and_grad", counting)
    run = train_jax(config, _pair(config))
    assert len(traces) == 1
    assert len(run["steps"]) == 4
