"""parity bisect: delta debugging finds the one fragile module to keep in float32.

The pair: Linear -> +20 -> LayerNorm -> GELU -> Linear -> LayerNorm -> Linear. The torch side
is correct (autocast keeps layer_norm in float32). The Flax port is correct except its first
LayerNorm, which takes its variance as E[x^2] - E[x]^2 in the compute dtype: around a mean of
20, bfloat16's ulp at 400 is 2, so the variance (~1) is lost and step 0 fails at bf16-mixed.
bisect must name that module, and only it, within 8 runs (2 to start, ddmin's after).
"""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from parity.api import prepare_pair
from parity.bisect import bisect, bisect_golden, ddmin
from parity.config import RunConfig
from parity.golden.format import BatchList
from parity.verdicts.torch_side import torch_stage_side

pytestmark = pytest.mark.standard_promotion

SHIFT = 20.0


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
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(8, 16)).astype(np.float32), rng.integers(0, 10, 8).astype(np.int32))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch_model = TorchNet()
    pair = prepare_pair(torch_model, FlaxNet(), None, BatchList([batch]))
    config = RunConfig(model="fragile", precision="bf16-mixed", batch_size=8)
    torch_numbers, scale = torch_stage_side(pair, *batch, config, trace_flops=False)
    result = bisect(pair, config, batch, torch_numbers, pair.torch_to_flax(), scale, budget=8)
    assert result.candidates == ["fc1", "norm", "fc2", "norm2", "fc3"]
    assert result.outcome == "found" and result.minimal, result.report()
    assert result.keep == ["norm"]
    assert result.runs <= 8
    assert all(v.passed for v in result.verdicts)
    assert "rules = {'norm': 'fp32'}" in result.rules_code()
    assert f"{result.runs} runs" in result.report()


def test_bisect_golden_needs_no_torch_side_and_stops_at_a_passing_cell():
    golden = Path(__file__).resolve().parents[1] / "examples" / "parity_ci" / "port.golden.npz"
    with pytest.raises(ValueError, match="`budget` must be an integer >= 2 runs; got 1"):
        bisect_golden(golden, budget=1)
    result = bisect_golden(golden)  # the correct port: its bf16 step 0 passes as it is
    assert (result.outcome, result.keep, result.runs) == ("passes already", [], 1)
    assert result.candidates == ["fc1", "norm", "fc2"]
