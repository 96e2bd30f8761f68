"""Step-0 verdicts (parity.verdicts.step0), the compute-dtype verdict and the per-op dtype-trace diff.

The resnet pair is the chaotic case (BatchNorm, strided shortcuts); its deliberately wrong ports
must fail at step 0, before any training, naming the layer. Shapes are tiny: torch bf16 is
emulated on AVX2-only CPUs.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxamp
import parity
from parity.core.config import RunConfig
from parity.core.schema import RUN_SCHEMA, check_schema
from parity.models import ModelPair, get_model_pair
from parity.perf.flops import jax_matmul_flops, requested_fraction
from parity.training.dtype_trace import diff_dtype_traces, torch_dtype_trace, torch_matmul_flops
from parity.verdicts import step0_batch
from parity.verdicts.step0 import check_step0
from parity.verdicts.tolerance import (
    SAFETY,
    group_error,
    program_shape,
    relative_error,
    tolerance,
    unit_roundoff,
)

TINY_RESNET = {"image_shape": (8, 8, 3), "channels": (4, 8, 16), "blocks_per_stage": 1}


def _resnet(wrong_port: str = ""):
    return get_model_pair("resnet", seed=0, wrong_port=wrong_port, **TINY_RESNET)


def _fp32(model: str = "resnet") -> RunConfig:
    return RunConfig(model=model, precision="fp32", batch_size=2)


# --- the band and the error measure --------------------------------------------------------------


def test_tolerance_scales_with_dtype_depth_and_fan_in():
    u32 = float(np.finfo(np.float32).eps) / 2
    assert unit_roundoff("float32") == u32
    assert unit_roundoff(jnp.bfloat16) == 2.0**-8
    assert unit_roundoff("float16") == 2.0**-11
    assert tolerance("float32", 256, 10) == pytest.approx(SAFETY * 10 * (16 * u32 + u32))
    assert tolerance("float32", 256, 20) == pytest.approx(2 * tolerance("float32", 256, 10))
    assert tolerance("float32", 1024, 10) > tolerance("float32", 256, 10)
    assert tolerance("bfloat16", 256, 10) > 100 * tolerance("float32", 256, 10)
    with pytest.raises(ValueError, match="dtype"):
        unit_roundoff("int8")
    with pytest.raises(ValueError, match="fan_in"):
        tolerance("float32", 0, 3)


def test_relative_error_and_cancellation_floor():
    assert relative_error(np.array([3.0, 4.0]), np.array([3.0, 4.0])) == 0.0
    assert relative_error(np.array([3.0, 4.5]), np.array([3.0, 4.0])) == pytest.approx(0.1)
    assert relative_error(np.ones(3), np.ones(4)) == math.inf
    assert relative_error(np.array([1.0, np.nan]), np.array([1.0, 2.0])) == math.inf
    assert relative_error(np.array([1.0, np.inf]), np.array([1.0, np.inf])) == 0.0
    # A gradient that is zero up to cancellation is judged on its group's scale.
    tiny = np.array([1e-9, -1e-9])
    assert group_error(tiny * 3, tiny, scale=1.0) < 1e-8
    assert group_error(np.array([0.5, 1.0]), np.array([0.5, 1.1]), scale=1.1) > 0.05


def test_program_shape_reads_fan_in_and_depth_from_the_jaxpr():
    x = jnp.ones((3, 5))
    w = jnp.ones((5, 5))
    assert program_shape(jax.make_jaxpr(lambda x: (x @ w) @ w)(x)) == (5, 2)

    def scanned(x):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=4)[0]

    assert program_shape(jax.make_jaxpr(scanned)(x)) == (5, 4)
    conv = jax.make_jaxpr(
        lambda x, k: jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    )(jnp.ones((1, 6, 6, 3)), jnp.ones((3, 3, 3, 8)))
    assert program_shape(conv) == (27, 1)


# --- the resnet pair: the correct port passes, the wrong ports fail naming the layer -----------


@pytest.mark.slow
def test_resnet_correct_port_passes_step0_fp32():
    result = check_step0(_resnet(), _fp32())
    assert result.passed, result.summary()
    checks = [v.check for v in result.verdicts]
    assert checks == [
        "step 0 fp32: eval-mode output",
        "step 0 fp32: train-mode output",
        "step 0 fp32: gradients",
        "step 0: deterministic train-mode forward (torch)",
        "step 0 fp32: each layer on its operating range",
    ]
    for verdict in result.verdicts[:3]:
        # A correct port sits orders of magnitude inside the band, on any CPU.
        assert verdict.value < verdict.tolerance / 10, verdict
    probe = result.verdicts[4]
    assert probe.passed and probe.value <= probe.tolerance, probe
    assert probe.detail.startswith("worst: ") and "19 layers" in probe.detail
    assert result.diagnosis is None
    assert result.to_dict()["passed"] is True


def _flipped_conv(pair):
    """The pair ported with blocks.1.conv1's kernel flipped (torch's conv is a cross-correlation):
    a wrong port in the weight transfer, so its programs are the correct port's."""
    original = pair.to_flax

    def to_flax(model):
        variables = jax.tree.map(np.array, original(model))
        conv = variables["params"]["blocks_1"]["conv1"]
        conv["kernel"] = np.ascontiguousarray(conv["kernel"][::-1, ::-1])
        return variables

    return dataclasses.replace(pair, to_flax=to_flax)


def test_a_bounded_step0_says_so_and_still_names_a_wrong_port(monkeypatch):
    """Past its bound step 0 compares the batch's first examples: its summary and record say
    how many, and a wrong port fails there with its first diverging layer named. (The first 2 of
    4 examples: the correct port's programs above, compiled once.)"""
    monkeypatch.setattr(step0_batch, "STEP0_FLOPS", 1)
    pair = _flipped_conv(_resnet())
    config = RunConfig(model="resnet", precision="fp32", batch_size=4)
    result = check_step0(pair, config, pair.make_data(0, 4).batch(0))
    assert not result.passed and result.examples == {"compared": 2, "batch": 4}
    assert "(on the batch's first 2 of 4 examples: bounded by work)" in result.summary()
    assert result.diagnosis.first_failing == "blocks.1.conv1"
    record = result.to_dict()
    assert record["examples"] == {"compared": 2, "batch": 4}
    problems = []
    check_schema(record, RUN_SCHEMA["step0"], "step0", lambda f, m: problems.append((f, m)))
    assert not problems


# The resnet's wrong ports fail step 0 naming the layer: Flax's "SAME" padding of a stride-2 conv
# (the conv; every layer upstream agrees; torch's passes run once; `parity run` stops before
# training) and Flax's biased BatchNorm running variance (the train-mode row, the diagnosis and
# the probe name the norm). In tests/parity/test_parity_golden_mutations.py, on the mutation
# catalogue's resnet, whose compiled programs its golden checks share.


# --- compute dtype ------------------------------------------------------------------------------


@pytest.mark.slow
def test_matmul_flops_agree_between_jaxpr_and_torch_dispatch():
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 3)).astype(np.float32)
    k = np.random.default_rng(1).normal(size=(3, 3, 3, 8)).astype(np.float32)
    jaxpr = jax.make_jaxpr(
        lambda x, k: jax.lax.conv_general_dilated(
            x, k, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    )(x, k)
    torch_flops = torch_matmul_flops(
        lambda: torch.nn.functional.conv2d(
            torch.from_numpy(x).permute(0, 3, 1, 2),
            torch.from_numpy(k).permute(3, 2, 0, 1),
            padding=1,
        )
    )
    assert jax_matmul_flops(jaxpr) == torch_flops == {"float32": 2 * 2 * 6 * 6 * 8 * 27}
    assert jax_matmul_flops(jax.make_jaxpr(jnp.matmul)(jnp.ones((2, 3)), jnp.ones((3, 4)))) == {
        "float32": 48
    }
    assert requested_fraction({"bfloat16": 30, "float32": 10}, "bfloat16") == 0.75
    assert requested_fraction({}, "bfloat16") is None


class _TorchMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _FlaxMLP(nn.Module):
    """``compute_dtype=float32`` is the Hugging Face Flax pattern: modules that cast back up."""

    compute_dtype: object = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(8, dtype=self.compute_dtype, name="fc1")(x))
        return nn.Dense(3, dtype=self.compute_dtype, name="fc2")(x)


def _mlp_transfer(module):
    return {
        "params": {
            name: {
                "kernel": jnp.asarray(getattr(module, name).weight.detach().numpy().T),
                "bias": jnp.asarray(getattr(module, name).bias.detach().numpy()),
            }
            for name in ("fc1", "fc2")
        }
    }


def _mlp_pair(compute_dtype=None, transfer=_mlp_transfer) -> ModelPair:
    torch.manual_seed(0)
    return ModelPair(
        name="tiny_mlp",
        task="classification",
        torch_model=_TorchMLP(),
        flax_model=_FlaxMLP(compute_dtype),
        config={},
        to_flax=transfer,
        from_flax=lambda v, m: None,
    )


def _mlp_batch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(4, 6)).astype(np.float32), rng.integers(0, 3, size=(4,)).astype(
        np.int32
    )


@pytest.mark.slow
def test_compute_dtype_verdict_catches_bf16_true_run_with_float32_jax_matmuls():
    config = RunConfig(model="tiny_mlp", precision="bf16-true", batch_size=4)
    good = check_step0(_mlp_pair(), config, _mlp_batch())
    rows = {v.check: v for v in good.verdicts}
    assert rows["compute dtype (torch)"].passed and rows["compute dtype (jax)"].passed
    assert rows["compute dtype (jax)"].value == 1.0
    assert good.compute_flops["jax"] == {"bfloat16": good.compute_flops["jax"]["bfloat16"]}

    upcast = check_step0(_mlp_pair(jnp.float32), config, _mlp_batch(), diagnose=False)
    rows = {v.check: v for v in upcast.verdicts}
    assert rows["compute dtype (torch)"].passed
    jax_row = rows["compute dtype (jax)"]
    assert jax_row.passed is False and jax_row.value == 0.0
    assert "float32 100%" in jax_row.detail and "asked for bfloat16" in jax_row.detail
    assert not upcast.passed


# --- the dtype-trace diff sees per-op precision, not only op counts -----------------------------


def test_dtype_trace_diff_catches_float32_bias_add():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8)).astype(np.float32)
    w = rng.normal(size=(8, 3)).astype(np.float32)
    b = rng.normal(size=(3,)).astype(np.float32)
    torch_trace = torch_dtype_trace(
        lambda x, w, b: torch.nn.functional.linear(x, w.T, b),
        torch.from_numpy(x),
        torch.from_numpy(w),
        torch.from_numpy(b),
        device_type="cpu",
    )
    dense = nn.Dense(3)
    variables = {"params": {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}}
    same = jaxamp.autocast_trace(lambda v, x: dense.apply(v, x), variables, x, device="cpu")
    assert diff_dtype_traces(same, torch_trace) == []
    # The matmul runs in bf16 on both sides; only the bias add differs (float32 in JAX).
    upcast = jaxamp.autocast_trace(lambda x, w, b: x @ w + b, x, w, b, device="cpu")
    problems = diff_dtype_traces(upcast, torch_trace)
    assert problems == ["add #0: jax float32 (add), torch bfloat16 (aten addmm bias)"]


def test_dtype_trace_diff_compares_dtype_sets_when_counts_differ():
    rec = jaxamp.DtypeRecord
    jax_trace = [
        rec("reduce_max", ("float32",), ("float32",)),
        rec("reduce_sum", ("float32",), ("float32",)),
    ]
    torch_trace = [rec("sum", ("float16",), ("float16",))]
    problems = diff_dtype_traces(jax_trace, torch_trace)
    assert "reduction: dtypes differ: jax float32 x2; torch float16 x1" in problems
    softmax_jax = [rec("exp", ("bfloat16",), ("bfloat16",))]
    softmax_torch = [rec("_softmax", ("float32",), ("float32",))]
    assert diff_dtype_traces(softmax_jax, softmax_torch) == [
        "softmax #0: jax bfloat16 (exp), torch float32 (aten _softmax)"
    ]
    norm_jax = [rec("rsqrt", ("bfloat16",), ("bfloat16",))]
    norm_torch = [rec("native_layer_norm", ("float32",) * 3, ("float32",) * 3)]
    assert diff_dtype_traces(norm_jax, norm_torch)[0].startswith("normalisation #0: jax bfloat16")


# --- the run flow -------------------------------------------------------------------------------


def _wrong_transfer(module):
    variables = _mlp_transfer(module)
    variables["params"]["fc2"]["bias"] = jnp.zeros_like(variables["params"]["fc2"]["bias"])
    return variables


@pytest.mark.integration
@pytest.mark.standard_promotion  # optax's AdamW internals
@pytest.mark.slow
def test_compare_models_stops_a_wrong_port_before_training(tmp_path):
    batches = [_mlp_batch() for _ in range(3)]
    torch.manual_seed(0)
    result = parity.compare_models(_TorchMLP(), _FlaxMLP(), _wrong_transfer, batches, lr=1e-2)
    assert not result.passed
    assert all(r["steps"] == [] for r in result.runs)  # nothing trained
    assert all("Step0Failure" in r["summary"]["error"] for r in result.runs)
    assert result.runs[0]["step0"]["passed"] is False
    assert "fc2" in result.runs[0]["step0"]["summary"]

    torch.manual_seed(0)
    good = parity.compare_models(_TorchMLP(), _FlaxMLP(), _mlp_transfer, batches, lr=1e-2)
    assert len(good.runs[0]["steps"]) == 3
    assert good.runs[0]["step0"]["passed"] is True


# `parity run` at an fp8 precision (step 0's rows are the per-layer fp8 checks; a wrong JAX recipe
# stops the run): tests/parity/test_fp8_parity.py, on that file's step-0 programs.


def test_the_layer_probe_runs_on_the_runs_torch_device(monkeypatch):
    """On a GPU run the probe's torch passes run on the GPU (on the host they were minutes of CPU
    at GPT-2 small's size); its weights and offsets are drawn on the CPU, the same everywhere."""
    from parity.verdicts import step0_checks

    seen = []
    monkeypatch.setattr(
        step0_checks, "probe_layers", lambda pair, inputs, device, **_: seen.append(device)
    )
    for device in ("gpu", "cpu"):
        config = RunConfig(model="mlp", precision="fp32", device=device)
        step0_checks.probe_verdict(None, config, None)
    assert seen == ["cuda", "cpu"]


def test_step0_compiles_its_programs_with_the_run_once_options(monkeypatch):
    """Step 0's sides and the layer probe are programs run once: they compile with
    `parity.core.once.ONCE` (XLA:GPU's autotuning off), the train step with XLA's defaults. An
    option XLA does not know shows where the options reach."""
    from parity.core import once

    config = RunConfig(model="tiny_mlp", precision="fp32", batch_size=4)
    monkeypatch.setitem(once.ONCE, "xla_not_an_option", 0)
    with pytest.raises(Exception, match="xla_not_an_option"):
        check_step0(_mlp_pair(), config, _mlp_batch(), diagnose=False)
    from parity.verdicts.step0_checks import probe_verdict

    row, probe = probe_verdict(_mlp_pair(), config, _mlp_batch()[0])
    assert probe is None and "xla_not_an_option" in row.detail  # the probe's one program too
