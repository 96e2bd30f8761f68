"""Per-module policies for linen and NNX: dtypes, precedence, defaults, attention, errors."""

import functools
import re

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp.flax as jf

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


# ----------------------------------------------------------------------------- linen models


class LinenBlock(nn.Module):
    features: int = 8

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.features)(h)
        w = self.param("w", nn.initializers.ones, (self.features,))
        return x + nn.relu(h) * w


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="embed")(x)
        x = LinenBlock(name="block")(x)
        return nn.Dense(3, name="head")(x)


class SetupModel(nn.Module):
    def setup(self):
        self.dense = nn.Dense(8)
        self.scale = self.param("scale", nn.initializers.ones, (8,))

    def __call__(self, x):
        return self.dense(x) * self.scale


def _first_float_dtype(tree):
    floats = [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)]
    return floats[0].dtype if floats else None


def _linen_calls(model, policy, x, rules=None, **kw):
    """Per module path: (class, dtype its inputs have after the policy's casts, output dtype)."""
    # Abstract evaluation: dtypes only, nothing computed or compiled.
    init = jf.linen.with_policy(model.init, policy, rules, **kw)
    variables = jax.eval_shape(init, jax.random.key(0), x)
    seen_in, seen_out = {}, {}

    def outer(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__":
            path = "/".join(context.module.path)
            seen_out[path] = (type(context.module).__name__, out.dtype)
        return out

    def inner(next_fun, args, kwargs, context):
        if context.method_name == "__call__":
            seen_in["/".join(context.module.path)] = _first_float_dtype(args)
        return next_fun(*args, **kwargs)

    # Interceptors run in registration order: outer sees the policy's output casts, inner the
    # inputs as the module's own code receives them.
    policy_interceptor = jf.linen.policy_interceptor(policy, rules, **kw)

    def apply(variables, x):
        with nn.intercept_methods(outer), nn.intercept_methods(policy_interceptor):
            with nn.intercept_methods(inner):
                return model.apply(variables, x)

    out = jax.eval_shape(apply, variables, x)
    calls = {path: (cls, seen_in[path], dtype) for path, (cls, dtype) in seen_out.items()}
    return variables, out, calls


def test_linen_bf16_mixed_dtypes(maybe_jit):
    model = LinenModel()
    x = jnp.ones((2, 4), jnp.float32)
    variables, out, calls = _linen_calls(model, "bf16-mixed", x)
    # Params stored in float32 (the param dtype), everywhere.
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {F32}
    assert out.dtype == F32  # the root returns the policy's output dtype
    assert calls["embed"] == ("Dense", BF16, BF16)
    assert calls["block"] == ("LinenBlock", BF16, BF16)
    # LayerNorm computes in float32 (default rule) and hands bf16 back to its caller.
    assert calls["block/LayerNorm_0"] == ("LayerNorm", F32, BF16)
    assert calls[""] == ("LinenModel", BF16, F32)
    variables = _linen_runs()["float32"][0]  # float32 parameters, as bf16-mixed's init makes
    apply = maybe_jit(jf.linen.with_policy(model.apply, "bf16-mixed"))
    assert apply(variables, x).dtype == F32


_DTYPE_NAMES = ("float16", "bfloat16", "float32")


@functools.cache
def _linen_runs():
    """{dtype name: (variables, output, gradients)} of LinenModel: initialized and applied under
    the "true" policy of each float dtype, and the gradients of its summed output under
    p=f32,c=<dtype>,o=f32 (from the float32 parameters, which every p=f32 policy's init makes).
    One jitted program, shared by the tests."""
    model, x = LinenModel(), jnp.ones((2, 4), jnp.float32)

    def run(key, x):
        out = {}
        for policy in _DTYPE_NAMES:  # "float16" etc.: params, compute and output all in it
            variables = jf.linen.with_policy(model.init, policy)(key, x)
            out[policy] = (variables, jf.linen.with_policy(model.apply, policy)(variables, x))
        params = out["float32"][0]["params"]
        for name in _DTYPE_NAMES:
            apply = jf.linen.with_policy(model.apply, f"p=f32,c={name},o=f32")
            grads = jax.grad(lambda p, apply=apply: apply({"params": p}, x).sum())(params)
            out[name] = (*out[name], grads)
        return out

    return jax.jit(run)(jax.random.key(0), x)


def test_linen_true_policy_creates_params_in_param_dtype(float_dtype):
    variables, out, _ = _linen_runs()[float_dtype.name]
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {float_dtype}
    assert out.dtype == float_dtype


def test_linen_mixed_grads_are_float32(float_dtype):
    g = _linen_runs()[float_dtype.name][2]
    assert {leaf.dtype for leaf in jax.tree.leaves(g)} == {F32}
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(g))


def test_linen_setup_params_are_cast():
    model = SetupModel()
    x = jnp.ones((2, 8), jnp.float32)
    variables = jf.linen.with_policy(model.init, "bf16-true")(jax.random.key(0), x)
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {BF16}
    out = jf.linen.with_policy(model.apply, "bf16-mixed")(
        jax.tree.map(lambda a: a.astype(F32), variables), x
    )
    assert out.dtype == F32


def test_silent_promotion_trap_is_fixed():
    """With dtype=None, f32 params and bf16 inputs compute in f32; under a policy in bf16."""
    model = nn.Dense(4)
    x = jnp.ones((2, 3), jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):
        variables = model.init(jax.random.key(0), x)
        assert model.apply(variables, x).dtype == F32  # the trap: promoted back to f32
    policy = "p=f32,c=bf16,o=bf16"
    assert jf.linen.with_policy(model.apply, policy)(variables, x).dtype == BF16


@pytest.mark.standard_promotion  # flax's LayerNorm in bf16 promotes bf16 with f32 internally
def test_linen_precedence():
    model = LinenModel()
    x = jnp.ones((2, 4), jnp.float32)
    fp32 = jf.override(compute="float32")
    # A glob beats a class rule; a regex given later beats an earlier glob.
    rules = {nn.Dense: fp32, "head": jf.override(compute="bf16")}
    _, _, calls = _linen_calls(model, "bf16-mixed", x, rules)
    assert calls["embed"][1] == F32 and calls["head"][1] == BF16
    rules = [("head", fp32), (re.compile(r"^he"), jf.override(compute="f16"))]
    _, _, calls = _linen_calls(model, "bf16-mixed", x, rules)
    assert calls["head"][1] == F16
    # Predicates are instance rules too.
    rules = {lambda module, path: path.endswith("embed"): fp32}
    _, _, calls = _linen_calls(model, "bf16-mixed", x, rules)
    assert calls["embed"][1] == F32 and calls["head"][1] == BF16
    # Children inherit their parent's rule; defaults still apply below it.
    rules = {LinenBlock: "p=f32,c=f16,o=bf16"}
    _, _, calls = _linen_calls(model, "bf16-mixed", x, rules)
    assert calls["block"] == ("LinenBlock", F16, BF16)
    assert calls["block/Dense_0"] == ("Dense", F16, F16)
    assert calls["block/LayerNorm_0"] == ("LayerNorm", F32, F16)
    # A user class rule beats the default rule; defaults=False removes it.
    _, _, calls = _linen_calls(model, "bf16-mixed", x, {nn.LayerNorm: jf.override(compute="bf16")})
    assert calls["block/LayerNorm_0"][1] == BF16
    _, _, calls = _linen_calls(model, "bf16-mixed", x, defaults=False)
    assert calls["block/LayerNorm_0"][1] == BF16


class Base(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)


class Derived(Base):
    pass


def test_linen_most_derived_class_wins():
    x = jnp.ones((1, 2), jnp.float32)
    rules = [(Derived, jf.override(compute="f16")), (Base, jf.override(compute="f32"))]
    _, _, calls = _linen_calls(Derived(), "bf16-mixed", x, rules)
    assert calls[""][1] == F16


def _exp_dtypes(fn, *args):
    """dtypes of every `exp` in the jaxpr of fn (softmax's exp tells its precision)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "exp":
                found.append(eqn.invars[0].aval.dtype)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_linen_attention_softmax_float32():
    model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    x = jnp.ones((1, 3, 8), jnp.float32)
    variables = jax.jit(jf.linen.with_policy(model.init, "bf16-mixed"))(jax.random.key(0), x)
    apply = jf.linen.with_policy(model.apply, "bf16-mixed")
    assert _exp_dtypes(apply, variables, x) == [F32]
    assert apply(variables, x).dtype == F32
    off = jf.linen.with_policy(model.apply, "bf16-mixed", float32_softmax=False)
    assert _exp_dtypes(off, variables, x) == [BF16]
    # The module's own attention_fn is restored after the call.
    assert model.attention_fn is nn.dot_product_attention


def test_linen_intercept_context_manager():
    model = nn.Dense(3)
    x = jnp.ones((2, 3))
    with jf.linen.intercept("bf16-true"):
        variables = model.init(jax.random.key(0), x)
        out = model.apply(variables, x)
    assert out.dtype == BF16
    assert model.apply(variables, x.astype(BF16)).dtype == BF16  # no policy outside


# ------------------------------------------------------------------------------ NNX models


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.dense = nnx.Linear(8, 8, rngs=rngs)
        self.w = nnx.Param(jnp.ones((8,)))

    def __call__(self, x):
        return x + nnx.relu(self.dense(self.norm(x))) * self.w[...]


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(4, 8, rngs=rngs)
        self.block = NNXBlock(rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.block(self.embed(x)))


# The NNX model built in one compiled program (its initializers eagerly are one compile per op);
# each call makes a new model with the same parameters.
_new_nnx_model = nnx.jit(lambda: NNXModel(nnx.Rngs(0)))


def _nnx_in_out(model, x):
    """Runs model(x); per path: (input dtype the module's own __call__ sees, its raw output)."""
    seen, paths, bases = {}, {}, {}
    for path, module in nnx.iter_modules(model):
        paths[id(module)] = "/".join(map(str, path))
        base = type(module).__jaxamp_base__
        bases[base] = base.__dict__.get("__call__")

    def make_spy(original):
        def spy(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            seen[paths[id(self)]] = (_first_float_dtype(args), out.dtype)
            return out

        return spy

    for base in bases:
        base.__call__ = make_spy(base.__call__)
    try:
        out = model(x)
    finally:
        for base, own in bases.items():
            if own is None:
                del base.__call__
            else:
                base.__call__ = own
    return out, seen


def test_nnx_bf16_mixed_dtypes(maybe_jit):
    model = _new_nnx_model()
    jf.nnx.apply_policy(model, "bf16-mixed")
    x = jnp.ones((2, 4), jnp.float32)
    out, seen = _nnx_in_out(model, x)
    assert out.dtype == F32
    assert seen["embed"] == (BF16, BF16)
    assert seen["block/norm"] == (F32, F32)  # inside: f32 compute; cast to bf16 after
    assert seen["block/dense"] == (BF16, BF16)
    policies = jf.nnx.module_policies(model)
    assert str(policies[""]) == "p=f32,c=bf16,o=f32"
    assert str(policies["block/norm"]) == "p=f32,c=f32,o=bf16"
    # Params stay float32 in storage; grads are float32.
    params = nnx.state(model, nnx.Param)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {F32}

    def loss(m):
        return m(x).sum()

    grad_fn = nnx.jit(nnx.grad(loss)) if maybe_jit is jax.jit else nnx.grad(loss)
    grads = grad_fn(model)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {F32}
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}


def test_nnx_true_policy_casts_params(float_dtype):
    model = _new_nnx_model()
    jf.nnx.apply_policy(model, float_dtype.name)
    params = nnx.state(model, nnx.Param)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {float_dtype}
    x = jnp.ones((2, 4), jnp.float32)
    assert nnx.jit(lambda m, x: m(x))(model, x).dtype == float_dtype


def test_nnx_precedence_and_inheritance():
    x = jnp.ones((2, 4), jnp.float32)
    model = _new_nnx_model()
    rules = {
        nnx.Linear: jf.override(compute="f32"),
        "head": jf.override(compute="bf16"),
        NNXBlock: "p=f32,c=f16,o=bf16",
    }
    jf.nnx.apply_policy(model, "bf16-mixed", rules)
    p = {k: str(v) for k, v in jf.nnx.module_policies(model).items()}
    assert p["embed"] == "p=f32,c=f32,o=bf16"  # class rule
    assert p["head"] == "p=f32,c=bf16,o=bf16"  # glob beats class
    assert p["block"] == "p=f32,c=f16,o=bf16"  # full policy: its own output dtype
    assert p["block/dense"] == "p=f32,c=f32,o=f16"  # class rule; output = caller's compute
    assert p["block/norm"] == "p=f32,c=f32,o=f16"  # default rule inside an f16 block
    out, seen = _nnx_in_out(model, x)
    assert out.dtype == F32 and seen["block"] == (F16, F16)  # raw, before the o=bf16 cast
    # Regex and predicate rules; the last instance rule wins.
    model = _new_nnx_model()
    rules = [
        (re.compile(r"block/.*"), jf.override(compute="f16")),
        (lambda m, path: path == "block/dense", jf.override(compute="f32")),
    ]
    jf.nnx.apply_policy(model, "bf16-mixed", rules)
    p = {k: str(v) for k, v in jf.nnx.module_policies(model).items()}
    assert p["block/norm"] == "p=f32,c=f16,o=bf16"
    assert p["block/dense"] == "p=f32,c=f32,o=bf16"


def test_nnx_attention_softmax_float32():
    model = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0))
    jf.nnx.apply_policy(model, "bf16-mixed")
    x = jnp.ones((1, 3, 8), jnp.float32)
    graphdef, state = nnx.split(model)

    def run(state, x):
        return nnx.merge(graphdef, state)(x)

    assert _exp_dtypes(run, state, x) == [F32]
    assert run(state, x).dtype == F32
    assert model.attention_fn is jf.float32_softmax_attention
    other = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0))
    jf.nnx.apply_policy(other, "bf16-mixed", float32_softmax=False)
    assert other.attention_fn is nnx.dot_product_attention


def test_nnx_remove_policy():
    model = _new_nnx_model()
    jf.nnx.apply_policy(model, "bf16-mixed")
    jf.nnx.remove_policy(model)
    assert type(model.head) is nnx.Linear
    assert jf.nnx.module_policies(model) == {}


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "rules, error",
    [
        ({3: "fp32"}, TypeError),
        ({nn.Dense: 3.0}, TypeError),
        ({nn.Dense: "nonsense"}, ValueError),
        ([("a", "fp32", "extra")], TypeError),
    ],
)
def test_bad_rules(rules, error):
    with pytest.raises(error, match="rules|policy|spec"):
        jf.linen.policy_interceptor("bf16-mixed", rules)
    with pytest.raises(error, match="rules|policy|spec"):
        jf.nnx.apply_policy(_new_nnx_model(), "bf16-mixed", rules)


def test_bad_override_and_policy():
    with pytest.raises(ValueError, match="override\\(compute="):
        jf.override(compute="int8")
    with pytest.raises(ValueError, match="override\\(param="):
        jf.override(param=np.int32)
    with pytest.raises(TypeError, match="policy"):
        jf.linen.with_policy(nn.Dense(2).apply, None)
    with pytest.raises(TypeError, match="nnx.Module"):
        jf.nnx.apply_policy(nn.Dense(2), "fp32")


# ------------------------------------------- rules matching no module warn


def test_linen_rule_matching_no_module_warns():
    model, x = LinenModel(), jnp.ones((2, 4))
    init = jf.linen.with_policy(model.init, "bf16-mixed", {"embd": "fp32", nn.Conv: "fp32"})
    with pytest.warns(jf.UnmatchedRuleWarning) as record:
        jax.eval_shape(init, jax.random.key(0), x)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert "rules['embd'] matched no module" in messages[0]
    assert "Did you mean 'embed'?" in messages[0]
    assert "Conv" in messages[1] and "matched no module" in messages[1]
    # Warned once per wrapper, not on every trace.
    jax.eval_shape(init, jax.random.key(0), x)


def test_linen_rules_that_match_do_not_warn():
    model, x = LinenModel(), jnp.ones((2, 4))
    rules = {
        "block/Dense_*": jf.override(compute="bf16"),
        nn.LayerNorm: jf.override(compute="full"),
        re.compile("^head$"): jf.override(compute="f32"),
        # shadowed by the rules above inside the block and for the head; it matches embed
        nn.Dense: jf.override(compute="float16"),
    }
    init = jf.linen.with_policy(model.init, "bf16-mixed", rules)
    jax.eval_shape(init, jax.random.key(0), x)  # filterwarnings=error: any warning fails


def test_nnx_rule_matching_no_module_warns():
    with pytest.warns(jf.UnmatchedRuleWarning, match=r"rules\['blok/dense'\].*'block/dense'"):
        jf.nnx.apply_policy(_new_nnx_model(), "bf16-mixed", {"blok/dense": "fp32"})
    jf.nnx.apply_policy(_new_nnx_model(), "bf16-mixed", {"block/dense": "fp32"})


def test_override_uses_get_policy_dtype_grammar():
    # One dtype-name grammar: whatever get_policy reads, override reads too.
    from jaxamp._policy import _NAME_TO_DTYPE, get_policy

    for name, dtype in _NAME_TO_DTYPE.items():
        assert jf.override(compute=name).compute == dtype
        assert jf.override(compute=name.upper()).compute == get_policy(f"c={name}").compute_dtype
    assert jf.override(compute="full").compute == F32
    assert str(jf.override(compute="bfloat16", output="float32")) == "override(c=bf16,o=f32)"
    with pytest.raises(ValueError, match="did you mean 'bf16'"):
        jf.override(compute="bf61")
