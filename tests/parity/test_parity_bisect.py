"""parity bisect: delta debugging finds the one fragile module to keep in float32.

The pair: Linear -> +20 -> LayerNorm -> GELU -> Linear -> LayerNorm -> Linear. The torch side
is correct (autocast keeps layer_norm in float32). The Flax port is correct except its first
LayerNorm, which takes its variance as E[x^2] - E[x]^2 in the compute dtype: around a mean of
20, bfloat16's ulp at 400 is 2, so the variance (~1) is lost and step 0 fails at bf16-mixed.
bisect must name that module, and only it, within 6 runs (2 to start, 4 for ddmin: the budget).

The second pair: Linear -> LayerNorm -> GELU -> Linear -> +12 -> softmax -> Linear, whose Flax
port is correct except its softmax, written exp(x) / sum(exp(x)) without the max subtracted:
around 12, float16's exp overflows (its largest value is 65504 = e^11.09), torch's softmax
subtracts the max, and step 0 fails at fp16-mixed with non-finite outputs. Both stages must name
it alone: the module "softmax" and the primitive "exp", within 10 runs (2 + 3 for ddmin over
5 modules with one to find; 1 + 4 for ddmin over the softmax's 4 primitives). Its NNX port
(Linear -> +12 -> the same softmax -> Linear) has no module tree to intercept: the primitives
stage alone names "exp", within 8 runs (1 to start; 1 + ddmin's over the 6 primitives on float16
operands that autocast does not run in float16 by design).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxamp
import jaxamp.flax
from parity.api import prepare_pair
from parity.bisect import FLOAT32_FAILS, NOT_SEARCHED, bisect, bisect_golden, ddmin
from parity.core.config import RunConfig
from parity.core.recipes import get_recipe
from parity.golden.format import BatchList, load_golden
from parity.verdicts.torch_side import torch_stage_side

SHIFT = 20.0
LOGIT_SHIFT = 12.0


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.norm2 = torch.nn.LayerNorm(32)
        self.fc3 = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.nn.functional.gelu(self.norm(self.fc1(x) + SHIFT))
        return self.fc3(self.norm2(self.fc2(x)))


class FragileLayerNorm(nn.Module):
    """A LayerNorm port that takes its statistics in the input dtype, one pass."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],))
        mean = x.mean(-1, keepdims=True)
        var = (x * x).mean(-1, keepdims=True) - mean * mean
        y = (x - mean) * jnp.reciprocal(jnp.sqrt(jnp.maximum(var, 0) + 1e-5))
        return y * scale.astype(x.dtype) + bias.astype(x.dtype)


class FlaxNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(32, name="fc1")(x) + SHIFT
        x = nn.gelu(FragileLayerNorm(name="norm")(x), approximate=False)
        x = nn.LayerNorm(epsilon=1e-5, name="norm2")(nn.Dense(32, name="fc2")(x))
        return nn.Dense(10, name="fc3")(x)


class TorchSoftmaxNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.fc3 = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.nn.functional.gelu(self.norm(self.fc1(x)))
        return self.fc3(torch.softmax(self.fc2(x) + LOGIT_SHIFT, -1))


class UnguardedSoftmax(nn.Module):
    """A softmax port without the max subtracted."""

    @nn.compact
    def __call__(self, x):
        e = jnp.exp(x)
        return e / e.sum(-1, keepdims=True)


class FlaxSoftmaxNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.LayerNorm(epsilon=1e-5, name="norm")(nn.Dense(32, name="fc1")(x))
        x = nn.gelu(x, approximate=False)
        x = UnguardedSoftmax(name="softmax")(nn.Dense(32, name="fc2")(x) + LOGIT_SHIFT)
        return nn.Dense(10, name="fc3")(x)


class TorchSoftmaxPair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.softmax(self.fc1(x) + LOGIT_SHIFT, -1))


class NnxSoftmaxPair(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        e = jnp.exp(self.fc1(x) + LOGIT_SHIFT)
        return self.fc2(e / e.sum(-1, keepdims=True))


def _bisected(torch_net, flax_net, precision, budget):
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(8, 16)).astype(np.float32), rng.integers(0, 10, 8).astype(np.int32))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch_model = torch_net()
    pair = prepare_pair(torch_model, flax_net, None, BatchList([batch]))
    config = RunConfig(model="fragile", precision=precision, batch_size=8)
    torch_numbers, scale = torch_stage_side(pair, *batch, config, trace_flops=False)
    variables = pair.torch_to_flax()
    result = bisect(pair, config, batch, torch_numbers, variables, scale, budget=budget)
    return result, variables, batch, pair


def test_ddmin_finds_a_one_minimal_set():
    assert ddmin(list("abcdefgh"), lambda s: {"c", "f"} <= set(s)) == (["c", "f"], True)

    def budget(keep, calls=[]):  # noqa: B006
        calls.append(keep)
        if len(calls) > 2:
            raise StopIteration
        return "f" in keep

    keep, minimal = ddmin(list("abcdefgh"), budget)
    assert not minimal and "f" in keep


def test_bisect_finds_the_fragile_layernorm_and_only_it():
    result, *_ = _bisected(TorchNet, FlaxNet(), "bf16-mixed", budget=6)
    assert result.candidates == ["fc1", "norm", "fc2", "norm2", "fc3"]
    assert result.outcome == "found" and result.minimal, result.report()
    assert result.keep == ["norm"]
    assert result.runs <= 8
    assert all(v.passed for v in result.verdicts)
    assert "rules = {'norm': 'fp32'}" in result.rules_code()
    assert f"{result.runs} runs" in result.report()
    # the modules stage spent the budget: the primitives stage finds it spent before its first run
    stage = result.primitives
    assert (stage.outcome, stage.minimal, stage.runs, result.runs) == ("budget spent", False, 0, 6)
    assert "norm" not in stage.outside and result.overrides_code() is None and result.found


def test_autocast_overrides_reach_the_recipes_jax_forward_only_where_it_is_autocast():
    recipe = get_recipe("fp16-mixed").with_autocast_overrides({"exp": "fp32"})
    assert "overrides={'exp': 'fp32'}" in recipe.jax_method("cpu")
    x, w = jnp.ones((1, 2)), jnp.full((2, 2), 6.0)
    overridden = recipe.jax_forward(lambda x, w: jnp.exp(x @ w), "cpu")(x, w)
    plain = get_recipe("fp16-mixed").jax_forward(lambda x, w: jnp.exp(x @ w), "cpu")(x, w)
    assert (overridden.dtype, plain.dtype) == (jnp.float32, jnp.float16)
    assert np.isfinite(overridden).all() and np.isinf(np.asarray(plain, np.float32)).all()
    with pytest.raises(
        ValueError, match="'bf16-true': the JAX forward pass is not jaxamp.autocast"
    ):
        get_recipe("bf16-true").with_autocast_overrides({"exp": "fp32"})


@pytest.mark.integration
def test_bisect_golden_needs_no_torch_side_and_stops_at_a_passing_cell():
    golden = Path(__file__).resolve().parents[2] / "examples" / "parity_ci" / "port.golden.npz"
    with pytest.raises(ValueError, match="`budget` must be an integer >= 2 runs; got 1"):
        bisect_golden(golden, budget=1)
    with pytest.raises(
        ValueError,
        match=r"`judge` must be one of \('step0', 'cell'\); got 'cells' \(did you mean 'cell'\?\)",
    ):
        bisect_golden(golden, judge="cells")
    result = bisect_golden(golden)  # the correct port: its bf16 step 0 passes as it is
    assert (result.outcome, result.keep, result.runs) == ("passes already", [], 1)
    assert result.candidates == ["fc1", "norm", "fc2"]
    # judged by the whole cell, one run is the golden's check: step 0, training, trajectory
    result = bisect_golden(golden, judge="cell")
    assert (result.outcome, result.keep, result.runs) == ("passes already", [], 1)
    checks = {v.check for v in result.verdicts}
    assert {"step 0 bf16-mixed: gradients", "final loss (mean of last 5)"} <= checks
    assert "(judged by the whole cell)" in result.report()


@pytest.mark.integration
def test_the_whole_cell_judge_fails_a_cell_whose_step_0_passes_and_trajectory_fails():
    golden = load_golden(
        Path(__file__).resolve().parents[2] / "examples" / "parity_ci" / "port.golden.npz"
    )
    # torch's recorded trajectory parts from the port's after step 0 (its losses from step 1
    # on 30% higher): step 0, recorded apart, still agrees; only the training can tell
    torch_run = dict(golden.torch_run)
    torch_run["steps"] = [
        {**s, "loss": s["loss"] * (1.3 if s["step"] else 1.0)} for s in torch_run["steps"]
    ]
    parted = dataclasses.replace(golden, header={**golden.header, "torch_run": torch_run})
    # the whole cell fails it (step 0 alone would pass it as it is): nothing kept fails, and
    # every module kept fails too
    result = bisect_golden(parted, judge="cell", budget=2)
    assert (result.outcome, result.runs, result.found) == ("no set passes", 2, False)
    assert result.keep == result.candidates == ["fc1", "norm", "fc2"]
    step0 = [v for v in result.verdicts if v.mode == "step 0"]
    assert step0 and all(v.passed for v in step0)
    failed = [v for v in result.verdicts if v.passed is False]
    assert failed and all(v.mode != "step 0" for v in failed)
    assert any(v.check.startswith("final loss") for v in failed), [v.check for v in failed]
    assert "(judged by the whole cell)" in result.report()
    # "no set passes" says what still fails with every module kept: the last run's worst row
    worst = result.report().split("the last run's worst row: ")[1]
    assert " > " in worst and worst.split(":")[0] in {v.check for v in failed}, worst


def test_bisect_finds_the_unguarded_exp_and_only_it():
    result, variables, batch, _ = _bisected(TorchSoftmaxNet, FlaxSoftmaxNet(), "fp16-mixed", 10)
    assert result.candidates == ["fc1", "norm", "fc2", "softmax", "fc3"]
    assert result.outcome == "found" and result.minimal, result.report()
    assert result.keep == ["softmax"]
    stage = result.primitives
    assert stage is not None and stage.outcome == "found" and stage.minimal, result.report()
    assert stage.keep == ["exp"] and stage.outside == {"exp": 0}
    assert set(stage.candidates) >= {"exp", "reduce_sum", "div"}
    assert result.runs <= 10 and 0 < stage.runs < result.runs
    assert all(v.passed for v in stage.verdicts) and all(v.passed for v in result.verdicts)
    code = result.overrides_code()
    assert "overrides = {'exp': 'fp32'}" in code and code.splitlines()[0] in result.report()

    # the code printed runs as written: the float16 forward overflows without it, not with it
    def forward(x):
        return FlaxSoftmaxNet().apply(variables, x)

    plain = jaxamp.autocast(forward, dtype=jnp.float16, device="cpu")(batch[0])
    scope = {"jaxamp": jaxamp, "jnp": jnp, "forward": forward}
    exec(code, scope)
    fixed = jax.jit(scope["forward"])(batch[0])
    assert not np.isfinite(np.asarray(plain, np.float32)).all()
    assert np.isfinite(np.asarray(fixed, np.float32)).all()
    # and so do the module rules, under jaxamp's per-module policies
    scope = {"jaxamp": jaxamp, "model": FlaxSoftmaxNet()}
    exec(result.rules_code(), scope)
    unruled = jaxamp.flax.linen.with_policy(FlaxSoftmaxNet().apply, "fp16-mixed")
    assert not np.isfinite(np.asarray(unruled(variables, batch[0]), np.float32)).all()
    assert np.isfinite(np.asarray(scope["apply"](variables, batch[0]), np.float32)).all()


@pytest.mark.integration
def test_bisect_of_an_nnx_port_runs_the_primitives_stage_alone():
    port = nnx.jit(NnxSoftmaxPair)()  # its initialisers one program (the weights are torch's)
    result, variables, batch, pair = _bisected(TorchSoftmaxPair, port, "fp16-mixed", 8)
    assert (result.outcome, result.keep, result.candidates) == (NOT_SEARCHED, [], [])
    stage = result.primitives
    assert stage.outcome == "found" and stage.minimal, result.report()
    # no module tree: matmuls are candidates too (an overflowing attention matmul is in reach)
    assert stage.keep == ["exp"] and "dot_general" in stage.candidates
    assert result.runs == stage.runs + 1 <= 8 and result.found
    assert all(v.passed for v in stage.verdicts)
    assert "overrides = {'exp': 'fp32'}" in result.report() and "rules =" not in result.report()
    true_bf16 = RunConfig(model="fragile", precision="bf16-true", batch_size=8)
    with pytest.raises(ValueError, match="for this nnx model the primitives stage cannot run"):
        bisect(pair, true_bf16, batch, None, variables, budget=8)


def test_bisect_stops_when_the_float32_stage_already_fails(capsys):
    """The example's port with the tanh GELU for torch's erf: its float32 step 0 fails, so no
    module kept in float32 can fix it; bisect says so, with the figure, in one run."""
    from parity import bisect as bisect_module

    golden = Path(__file__).resolve().parents[2] / "examples" / "parity_ci" / "port.golden.npz"
    result = bisect_golden(golden, "examples.parity_ci.flax_model:buggy_port")
    assert (result.outcome, result.runs, result.found) == (FLOAT32_FAILS, 1, False)
    report = result.report()
    assert "the float32 stage of step 0 already fails (step 0 fp32:" in report, report
    assert " > " in report and "first diverging layer" in report
    code = bisect_module.main(
        ["--golden", str(golden), "--flax-model", "examples.parity_ci.flax_model:buggy_port"]
    )
    assert code == 1 and "already fails" in capsys.readouterr().out
