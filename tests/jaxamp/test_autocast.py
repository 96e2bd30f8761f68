"""autocast as a JAX transform: control flow, derivatives, Flax, regions, overrides, errors."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxamp

LOW = {"float16", "bfloat16"}


def _dt(x):
    return jnp.dtype(x.dtype).name


@pytest.fixture
def low_dtype(float_dtype):
    return float_dtype


def test_matmul_in_dtype_everything_else_keeps(float_dtype, maybe_jit):
    x = jnp.ones((4, 4), jnp.float32)
    f = jaxamp.autocast(lambda a: jnp.tanh(a @ a) * 2.0, dtype=float_dtype, device="cpu")
    out = maybe_jit(f)(x)
    assert out.dtype == float_dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.tanh(4.0) * 2, rtol=1e-2)


def test_defaults_and_validation():
    f = jaxamp.autocast(lambda a: a @ a)
    # the device defaults to the backend's torch device type, the dtype to torch's default there
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    assert f(jnp.ones((2, 2))).dtype == (jnp.float16 if on_gpu else jnp.bfloat16)
    assert jaxamp.autocast(lambda a: a @ a, device="cuda")(jnp.ones((2, 2))).dtype == jnp.float16
    with pytest.raises(ValueError, match="device"):
        jaxamp.autocast(lambda a: a, device="tpu")
    with pytest.raises(ValueError, match="dtype"):
        jaxamp.autocast(lambda a: a, dtype=jnp.int8)
    with pytest.raises(TypeError, match="dtype"):
        jaxamp.autocast(lambda a: a, dtype="not-a-dtype")
    with pytest.raises(ValueError, match="overrides"):
        jaxamp.autocast(lambda a: a, overrides={"exp": "fp16"})
    with pytest.raises(TypeError, match="overrides"):
        jaxamp.autocast(lambda a: a, overrides=[("exp", "fp32")])
    with pytest.raises(TypeError, match="fn"):
        jaxamp.autocast(3)


def test_only_castable_floats_are_cast():
    def f(x, i, b):
        return x @ x, i @ i, jnp.where(b, 1, 0)

    x = jnp.ones((2, 2))
    out = jaxamp.autocast(f, device="cpu")(x, jnp.ones((2, 2), jnp.int32), jnp.ones(2, bool))
    assert [_dt(o) for o in out] == ["bfloat16", "int32", "int32"]


def test_explicit_preferred_element_type_left_alone():
    x = jnp.ones((2, 2), jnp.bfloat16)
    f = jaxamp.autocast(
        lambda a: lax.dot(a, a, preferred_element_type=jnp.float32),
        device="cuda",
        dtype=jnp.float16,
    )
    assert f(x).dtype == jnp.float32


def test_reaches_into_control_flow(maybe_jit):
    def f(x):
        y = jax.jit(lambda a: a @ a)(x)
        c, ys = lax.scan(lambda c, a: (c + jnp.sum(a @ a.T), a @ a.T), jnp.float32(0), x[None])
        z = lax.cond(c > 0, lambda a: a @ a, lambda a: a @ a * 2.0, x)
        _, w = lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] @ s[1]), (0, x))
        r = jax.checkpoint(lambda a: a @ a)(x)
        return y, c, ys, z, w, r

    x = jnp.eye(3)
    out = maybe_jit(jaxamp.autocast(f, device="cpu"))(x)
    assert [_dt(o) for o in out] == [
        "bfloat16",
        "float32",
        "bfloat16",
        "float32",
        "float32",
        "bfloat16",
    ]
    trace = jaxamp.autocast_trace(f, x, device="cpu")
    dots = [r for r in trace if r.op == "dot_general"]
    # (loop bodies may be traced more than once)
    assert len(dots) >= 6 and all(r.out_dtypes == ("bfloat16",) for r in dots)


def test_grad_float32_params_get_float32_grads(float_dtype, maybe_jit):
    w = jnp.full((3, 3), 0.1)
    x = jnp.ones((2, 3))

    def loss(w, x):
        return jnp.sum(jax.nn.relu(x @ w)).astype(jnp.float32)

    g = maybe_jit(jax.grad(jaxamp.autocast(loss, dtype=float_dtype, device="cuda")))(w, x)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, jax.grad(loss)(w, x), rtol=1e-2)


def test_vmap():
    f = jaxamp.autocast(lambda a: a @ a, device="cpu")
    out = jax.vmap(f)(jnp.ones((5, 2, 2)))
    assert out.shape == (5, 2, 2) and out.dtype == jnp.bfloat16


def test_custom_jvp_and_vjp_rules_still_apply():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))

    @jax.custom_jvp
    def double_grad(x):
        return x @ x

    double_grad.defjvp(lambda p, t: (double_grad(p[0]), 2.0 * (t[0] @ p[0] + p[0] @ t[0])))

    def f(w):
        return jnp.sum(clip_grad(w @ w)).astype(jnp.float32) + jnp.sum(double_grad(w)).astype(
            jnp.float32
        )

    w = jnp.eye(2) * 3.0
    g = jax.jit(jax.grad(jaxamp.autocast(f, device="cpu")))(w)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, jax.jit(jax.grad(f))(w), rtol=2e-2)
    trace = jaxamp.autocast_trace(f, w, device="cpu")
    assert any(r.op == "dot_general" and r.out_dtypes == ("bfloat16",) for r in trace)


def test_shard_map():
    # as many shards as the platform has devices (8 forced host devices on CPU, 1 on a one-GPU
    # machine): the rule re-binds shard_map with its psum either way
    n = math.gcd(len(jax.devices()), 16)
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
    P = jax.sharding.PartitionSpec

    def f(x, w):
        local = jax.shard_map(
            lambda a, b: lax.psum(a @ b, "d"),
            mesh=mesh,
            in_specs=(P(None, "d"), P("d", None)),
            out_specs=P(),
        )
        return local(x, w)

    x = jax.device_put(jnp.ones((2, 16)), jax.sharding.NamedSharding(mesh, P(None, "d")))
    w = jax.device_put(jnp.ones((16, 3)), jax.sharding.NamedSharding(mesh, P("d", None)))
    out = jaxamp.autocast(f, device="cpu")(x, w)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), 16.0)


def test_unknown_higher_order_primitive_warns_once():
    import sys

    mod = sys.modules["jaxamp._autocast.interpreter"]

    mod._warned_primitives.discard("custom_transpose_call")
    # A primitive with a jaxpr param that autocast does not know: fake one from cond's.
    jaxpr = jax.make_jaxpr(lambda a: a @ a)(jnp.eye(2))
    prim = jax.extend.core.Primitive("my_hop")
    prim.def_impl(lambda x, *, body: jax.core.eval_jaxpr(body.jaxpr, body.consts, x)[0])
    prim.def_abstract_eval(lambda x, *, body: x)
    mod._warned_primitives.discard("my_hop")
    f = jaxamp.autocast(lambda x: prim.bind(x, body=jaxpr), device="cpu")
    with pytest.warns(UserWarning, match="my_hop"):
        out = f(jnp.eye(2))
    assert out.dtype == jnp.float32
    f(jnp.eye(2))  # second time: no warning (pytest turns warnings into errors)


def test_overrides_move_primitives():
    x = jnp.ones((2, 2))
    f = jaxamp.autocast(lambda a: jnp.exp(a @ a), device="cpu", overrides={"dot_general": None})
    assert f(x).dtype == jnp.float32
    g = jaxamp.autocast(lambda a: jnp.exp(a @ a), device="cpu", overrides={lax.exp_p: "fp32"})
    assert g(x).dtype == jnp.float32
    assert jaxamp.autocast_rules("cpu", {"exp": "fp32"})["exp"] == "fp32"
    assert jaxamp.autocast_rules("cpu")["exp"] == "keep"


def test_full_precision_region(maybe_jit):
    def f(x):
        h = x @ x
        inner = jaxamp.full_precision(lambda a: a @ a + 1.0)(h)
        return h, inner, jaxamp.full_precision(jax.jit(lambda a: a @ a))(h)

    out = maybe_jit(jaxamp.autocast(f, device="cpu"))(jnp.eye(2))
    assert [_dt(o) for o in out] == ["bfloat16", "float32", "float32"]
    # Outside autocast it upcasts.
    assert jaxamp.full_precision(lambda a: a)(jnp.ones(2, jnp.bfloat16)).dtype == jnp.float32


def test_static_args_and_kwargs():
    def f(x, *, scale, train=False):
        return (x @ x) * scale if train else x

    g = jaxamp.autocast(f, device="cpu")
    assert g(jnp.eye(2), scale=2.0, train=True).dtype == jnp.bfloat16
    assert g(jnp.eye(2), scale=2.0).dtype == jnp.float32


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        q = nn.Dense(16)(h)
        att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, q) / 4.0)
        h = x + nn.Dense(16)(jnp.einsum("bqk,bkd->bqd", att, q))
        return h + nn.Dense(16)(jax.nn.gelu(nn.Dense(32)(nn.LayerNorm()(h))))


class _LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(50, 16)(tokens)
        x = _Block()(x)
        return nn.Dense(50)(nn.LayerNorm()(x))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_flax_transformer_train_step(device):
    # optax's adam mixes its int32 step count with Python floats: not strict-promotion clean.
    with jax.numpy_dtype_promotion("standard"):
        _train_step(device)


def _train_step(device):
    model = _LM()
    tokens = jnp.arange(16).reshape(2, 8) % 50
    params = jax.jit(model.init)(jax.random.key(0), tokens)  # set-up: one program, not op by op
    tx = optax.adam(1e-3)
    opt_state = jax.jit(tx.init)(params)

    def loss_fn(params, tokens):
        logits = model.apply(params, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(jaxamp.autocast(loss_fn, device=device))(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if device == "cuda":
        # No CUDA here (and XLA:CPU compiles are slow): check the types abstractly.
        new_params, _, loss = jax.eval_shape(step, params, opt_state, tokens)
    else:
        new_params, _, loss = step(params, opt_state, tokens)
        np.testing.assert_allclose(loss, jax.jit(loss_fn)(params, tokens), rtol=3e-2)
        # The whole step (forward + grad + update) can be autocast too.
        out = jax.eval_shape(
            jaxamp.autocast(step.__wrapped__, device=device), params, opt_state, tokens
        )
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(out[0]))
    assert loss.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new_params))


def test_nnx_module():
    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x)).astype(jnp.float32)

    x = jnp.ones((2, 4))
    grads = jax.jit(jax.grad(jaxamp.autocast(loss, device="cpu")))(state, x)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    trace = jaxamp.autocast_trace(lambda s, x: nnx.merge(graphdef, s)(x), state, x, device="cpu")
    assert [r.out_dtypes for r in trace if r.op == "dot_general"] == [("bfloat16",)]


def test_zero_cost_hlo_equals_hand_cast():
    w = jnp.ones((8, 8))
    x = jnp.ones((4, 8))

    def auto(w, x):
        return jax.nn.relu(x @ w)

    def hand(w, x):
        return jax.nn.relu(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16))

    def hlo(f):
        return jax.jit(f).lower(w, x).compile().as_text()

    assert _normalize_hlo(hlo(jaxamp.autocast(auto, device="cpu"))) == _normalize_hlo(hlo(hand))


def _normalize_hlo(text):
    import re

    text = text.split("\n", 1)[1]  # the module line names the function
    text = re.sub(r",? ?metadata=\{[^}]*\}", "", text)
    text = re.sub(r"\.\d+\b", "", text)  # instruction numbering
    return text.split("FileNames")[0].strip()
