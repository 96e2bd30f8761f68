"""autocast regressions: user-written upcasts are honoured; extended dtypes (PRNG keys) pass."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp

rng = np.random.default_rng(0)


def _upcast_loss(w, x):
    return jnp.sum((x @ w).astype(jnp.float32) ** 2)


def _ops(fn, *args):
    return [
        (r.op, r.in_dtypes, r.out_dtypes) for r in jaxamp.autocast_trace(fn, *args, device="cpu")
    ]


# -- Bug A: explicit upcasts that JAX elides when tracing at float32 ---------------------------


@pytest.mark.parametrize(
    "upcast",
    [
        lambda h: h.astype(jnp.float32),
        lambda h: jnp.astype(h, jnp.float32),
        lambda h: jnp.asarray(h, jnp.float32),
        lambda h: jnp.asarray(h, dtype=jnp.float32),
        lambda h: jnp.array(h, jnp.float32),
        lambda h: lax.convert_element_type(h, jnp.float32),
    ],
    ids=["method", "jnp.astype", "asarray", "asarray_kw", "array", "lax"],
)
def test_explicit_upcast_is_honoured(upcast, maybe_jit):
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    f = jaxamp.autocast(lambda w, x: jnp.sum(upcast(x @ w) ** 2), device="cpu")
    out = maybe_jit(f)(w, x)
    assert out.dtype == jnp.float32
    assert float(out) == 8 * 16.0
    ops = _ops(lambda w, x: jnp.sum(upcast(x @ w) ** 2), w, x)
    assert ops[0] == ("dot_general", ("bfloat16", "bfloat16"), ("bfloat16",))
    assert ("convert_element_type", ("bfloat16",), ("float32",)) in ops
    assert ops[-1] == ("reduce_sum", ("float32",), ("float32",))


def test_without_upcast_stays_low_and_no_cast_in_plain_jaxprs():
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    assert jaxamp.autocast(lambda w, x: jnp.sum((x @ w) ** 2), device="cpu")(w, x).dtype == (
        jnp.bfloat16
    )
    # Outside autocast, nothing changes: the same-dtype cast is still elided by JAX.
    jaxpr = jax.make_jaxpr(_upcast_loss)(w, x)
    assert [e.primitive.name for e in jaxpr.eqns] == ["dot_general", "integer_pow", "reduce_sum"]
    assert not hasattr(jnp.asarray, "__wrapped__")


def test_explicit_upcast_inside_scan_and_grad():
    w = jnp.full((4, 4), 0.1)

    def f(w, xs):
        def body(c, x):
            return c, jnp.sum((x @ w).astype(jnp.float32))

        return jnp.sum(lax.scan(body, 0.0, xs)[1])

    xs = jnp.ones((3, 2, 4))
    out, g = jax.value_and_grad(jaxamp.autocast(f, device="cpu"))(w, xs)
    assert out.dtype == jnp.float32 and g.dtype == jnp.float32
    np.testing.assert_allclose(float(out), 3 * 2 * 4 * 0.4, rtol=1e-2)


def test_explicit_cast_primitive_is_identity_outside_autocast():
    # A jaxpr traced under autocast may be cached by JAX and reused elsewhere.
    ac = __import__("sys").modules["jaxamp._autocast.explicit_casts"]
    x = jnp.arange(3.0)
    f = lambda x: ac.explicit_cast_p.bind(x * 2, dtype=jnp.dtype(jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(jax.jit(f)(x), x * 2)
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(f(x)))(x), jnp.full(3, 2.0))
    np.testing.assert_array_equal(jax.vmap(f)(x), x * 2)


torch = pytest.importorskip("torch")


@pytest.mark.torch
def test_explicit_upcast_matches_torch():
    w = (rng.standard_normal((16, 8)) / 4).astype(np.float32)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    out = jaxamp.autocast(_upcast_loss, device="cpu")(jnp.asarray(w), jnp.asarray(x))
    with torch.autocast("cpu"):
        ref = ((torch.from_numpy(x) @ torch.from_numpy(w)).float() ** 2).sum()
    assert ref.dtype == torch.float32 and out.dtype == jnp.float32
    np.testing.assert_allclose(float(out), float(ref), rtol=1e-3)


@pytest.mark.torch
@pytest.mark.standard_promotion
def test_flax_batchnorm_stats_match_torch():
    n, d, c = 16384, 8, 4
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = (rng.standard_normal((d, c)) / 3).astype(np.float32)
    b = np.array([3.0, -2.0, 5.0, 0.5], np.float32)  # large means: bf16 sums lose them

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(c)(x)
            return nn.BatchNorm(use_running_average=False, momentum=0.0)(h)

    net = Net()
    variables = jax.jit(net.init)(jax.random.key(0), jnp.asarray(x))  # set-up: one program
    params = jax.tree.map(lambda a: a, variables["params"])
    params["Dense_0"] = {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}
    variables = {"params": params, "batch_stats": variables["batch_stats"]}

    def fwd(v, x):
        return net.apply(v, x, mutable=["batch_stats"])

    y, upd = jax.jit(jaxamp.autocast(fwd, device="cpu"))(variables, jnp.asarray(x))
    mean = np.asarray(upd["batch_stats"]["BatchNorm_0"]["mean"])
    var = np.asarray(upd["batch_stats"]["BatchNorm_0"]["var"])
    assert mean.dtype == np.float32 and var.dtype == np.float32

    rm, rv = torch.zeros(c), torch.ones(c)
    with torch.autocast("cpu"):
        h = torch.nn.functional.linear(
            torch.from_numpy(x), torch.from_numpy(w.T), torch.from_numpy(b)
        )
        ref = torch.nn.functional.batch_norm(h, rm, rv, training=True, momentum=1.0)
    assert h.dtype == torch.bfloat16
    assert str(y.dtype) == str(ref.dtype).removeprefix("torch.")
    np.testing.assert_allclose(mean, rm.numpy(), rtol=1e-3, atol=1e-3)
    # torch's running_var is unbiased; flax's is the biased batch variance.
    np.testing.assert_allclose(var, rv.numpy() * (n - 1) / n, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref.float().numpy(), atol=5e-2, rtol=3e-2)


# -- Bug C: extended dtypes (typed PRNG keys) are never cast -----------------------------------


def test_prng_keys_in_scan(maybe_jit):
    def f(w, key, xs):
        def body(k, x):
            k, sub = jax.random.split(k)
            noise = jax.random.normal(sub, x.shape)
            return k, jnp.sum(jnp.tanh((x + noise) @ w))

        k, ys = lax.scan(body, key, xs)
        return jnp.sum(ys), k

    w, xs = jnp.ones((4, 4)) / 4, jnp.ones((3, 2, 4))
    key = jax.random.key(0)
    out, k = maybe_jit(jaxamp.autocast(f, device="cpu"))(w, key, xs)
    ref, kref = f(w, key, xs)
    assert out.dtype == jnp.bfloat16
    assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.extended)
    np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(kref))
    np.testing.assert_allclose(float(out), float(ref), rtol=3e-2)
    assert all(r.op for r in jaxamp.autocast_trace(f, w, key, xs, device="cpu"))


@pytest.mark.standard_promotion
def test_linen_rnn_lstm_forward_and_grad():
    model = nn.RNN(nn.OptimizedLSTMCell(16))
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(0), x)  # set-up: one program, not op by op

    def loss(p, x):
        return jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)

    # The autocast step and its float32 reference loss: one program.
    ref, (val, grads) = jax.jit(
        lambda p, x: (loss(p, x), jax.value_and_grad(jaxamp.autocast(loss, device="cpu"))(p, x))
    )(params, x)
    assert val.dtype == jnp.float32
    np.testing.assert_allclose(float(val), float(ref), rtol=5e-2)
    for g in jax.tree.leaves(grads):
        assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.standard_promotion
def test_linen_dropout_with_rngs():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x))

    net = Net()
    x = jnp.ones((4, 8))
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    params = jax.jit(net.init)(rngs, x)  # set-up: one program, not op by op
    f = jaxamp.autocast(lambda p, x, k: net.apply(p, x, rngs={"dropout": k}), device="cpu")
    out = f(params, x, jax.random.key(2))
    ref = net.apply(params, x, rngs={"dropout": jax.random.key(2)})
    # The Dense output is bfloat16; flax's zeros_like(inputs) was traced as a float32 constant,
    # so lax.select promotes (a known limitation of creation ops, not of keys).
    np.testing.assert_array_equal(np.asarray(out, np.float32) == 0, np.asarray(ref) == 0)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)
