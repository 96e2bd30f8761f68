"""Precision report: effective dtypes per module and the silent-promotion trap, linen and NNX."""

import json

import flax.linen as nn
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxamp.flax as jf


class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = nn.LayerNorm()(x)
        x = nn.Dense(8, dtype=jnp.float32)(x)  # explicitly float32
        return nn.Dense(3)(x)


class NNX(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.norm(self.l1(x)))


X = jnp.ones((2, 4), jnp.bfloat16)


def test_linen_trap_without_policy():
    report = jf.precision_report(Linen(), X)
    assert report.policy is None
    dense = report["Dense_0"]
    assert (dense.params, dense.inputs, dense.compute) == (("float32",), "bfloat16", "float32")
    assert [m.path for m in report.traps] == ["Dense_0"]
    assert "silently promote" in str(report)
    json.dumps(report.to_dict())


def test_linen_with_policy():
    report = jf.precision_report(Linen(), X, policy="bf16-mixed")
    assert report.policy == "p=f32,c=bf16,o=f32"
    assert not report.traps
    assert report["Dense_0"].compute == "bfloat16"
    norm = report["LayerNorm_0"]
    assert (norm.compute, norm.output) == ("float32", "bfloat16")
    assert norm.rule.startswith("default class")
    assert report["Dense_1"].flags == ("wider-than-policy",)
    assert report[""].output == "float32"
    report = jf.precision_report(Linen(), X, policy="bf16-mixed", rules={"Dense_2": "fp32"})
    assert report["Dense_2"].compute == "float32" and "glob" in report["Dense_2"].rule


def test_nnx_report():
    model = NNX(nnx.Rngs(0))
    assert [m.path for m in jf.precision_report(model, X).traps] == ["l1"]
    jf.nnx.apply_policy(model, "bf16-mixed")
    report = jf.precision_report(model, X)
    assert report.policy == "p=f32,c=bf16,o=f32" and not report.traps
    assert (report["l1"].compute, report["norm"].compute) == ("bfloat16", "float32")
    assert report[""].output == "float32"
    assert model(jnp.ones((2, 4))).dtype == jnp.float32  # the report left the model as it was
    with pytest.raises(ValueError, match="apply_policy"):
        jf.precision_report(model, X, policy="fp32")
    with pytest.raises(TypeError, match="linen or NNX"):
        jf.precision_report(object(), X)
    with pytest.raises(KeyError, match="no module"):
        report["nope"]


def test_report_names_use_the_policy_grammar():
    # One dtype grammar: every dtype and policy the report prints parses back.
    from jaxamp._policy import get_policy, parse_dtype

    rules = {"Dense_2": jf.override(compute="full"), "LayerNorm_0": "p=f32,c=f32,o=bf16"}
    report = jf.precision_report(Linen(), X, policy="bf16-mixed", rules=rules)
    assert report["Dense_2"].rule.endswith("override(c=f32)")
    for module in report.modules:
        for name in (*module.params, module.inputs, module.compute, module.output):
            if name is not None:
                parse_dtype(name)
        if module.policy is not None:
            assert str(get_policy(module.policy)) == module.policy


def test_report_reads_only_public_queries_of_the_flax_glue():
    """The seam between the report and the Flax glue: report.py asks linen.py / nnx.py through
    their exported queries (current_policy, module_policy, own_params, has_own_call), never
    their private names."""
    import ast
    import inspect

    from jaxamp.flax import _report as report
    from jaxamp.flax import linen as jl
    from jaxamp.flax import nnx as jn

    used = {
        (node.value.id, node.attr)
        for node in ast.walk(ast.parse(inspect.getsource(report)))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("jl", "jn")
    }
    assert used, "report.py no longer reads the glue through jl/jn: update this test"
    for module_name, attr in sorted(used):
        module = {"jl": jl, "jn": jn}[module_name]
        assert attr in module.__all__, f"report.py reads {module_name}.{attr}, not exported"
