"""Policy.reduce_dtype is honoured on the partitioned program (the post-SPMD HLO).

XLA:CPU upcasts bfloat16 all-reduces late in compilation, so the final CPU HLO always shows
float32: the dtype of a collective is read from the module right after SPMD partitioning, dumped
by XLA (compiler options ``xla_dump_to`` and ``xla_dump_hlo_pass_re=spmd-partitioning``) on 4
host devices.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._reduce import reduce_in

# Compiler options of the probe's programs: each dumps its module right after SPMD partitioning.
# Only that module is read: the CPU code generated after it is never run, so LLVM optimises none
# of it (the same dumps, a third less compile work).
_DUMP_OPTIONS = {
    "xla_dump_hlo_pass_re": "spmd-partitioning",
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}
_COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|reduce-scatter)\(")


def _probe_collectives(dump, devices) -> dict[str, list]:
    """Each case's program compiled on a mesh of `devices` with its post-SPMD module dumped to
    `dump`; returns each case's cross-device reductions as ``[op, [hlo dtypes]]``."""
    import flax.linen as nn
    import optax
    from flax import nnx

    import jaxamp.flax as jf

    mesh = Mesh(np.array(devices), ("data",))
    rng = np.random.default_rng(0)

    def put(x, spec):
        return jax.device_put(np.asarray(x), NamedSharding(mesh, spec))

    params = {
        "emb": rng.normal(size=(10, 16)).astype(np.float32),
        "w": rng.normal(size=(16, 8)).astype(np.float32),
        "b": np.zeros((8,), np.float32),
        "pos": rng.normal(size=(16,)).astype(np.float32),
    }
    x = rng.normal(size=(32, 16)).astype(np.float32)
    ids = (np.arange(32) % 10).astype(np.int32)

    def loss(p, x, ids):
        # A lookup with constant indices stays replicated until it meets the batch: under
        # shard_map its gradient is summed by the psum that transposes pvary.
        h = x + p["emb"][ids] + p["pos"][jnp.arange(16)]
        return jnp.mean(((h @ p["w"]) + p["b"]) ** 2)

    def sharded(spec_w):
        p = {k: put(v, spec_w if k == "w" else P()) for k, v in params.items()}
        return p, put(x, P("data")), put(ids, P("data"))

    def marked(name, build):
        # A module-name marker: each case compiles a function whose name is the case's name.
        def f(*a):
            return build(*a)

        f.__name__ = f.__qualname__ = name
        return f

    cases = []

    def case(name, fn, args):
        cases.append(name)
        options = {**_DUMP_OPTIONS, "xla_dump_to": str(dump)}
        jax.jit(marked(name, fn)).lower(*args).compile(compiler_options=options)

    low = "p=f32,c=bf16,o=f32,r=bf16"
    case("dp_bf16_mixed", jaxamp.value_and_grad(loss, policy="bf16-mixed"), sharded(P()))
    case("dp_fp16_mixed", jaxamp.value_and_grad(loss, policy="fp16-mixed"), sharded(P()))
    case("dp_reduce_bf16", jaxamp.value_and_grad(loss, policy=low), sharded(P()))
    case("fsdp_bf16_mixed", jaxamp.value_and_grad(loss, policy="bf16-mixed"), sharded(P("data")))
    case("fsdp_reduce_bf16", jaxamp.value_and_grad(loss, policy=low), sharded(P("data")))

    def linear(p, x, ids):
        return (x + p["emb"][ids]) @ p["w"] + p["b"]

    fwd = jaxamp.autocast(linear, dtype=jnp.bfloat16, device="cpu")

    def auto_loss(p, x, ids):
        return jnp.mean(fwd(p, x, ids).astype(jnp.float32) ** 2)

    case(
        "autocast_reduce_f32",
        jaxamp.value_and_grad(auto_loss, reduce_dtype="float32"),
        sharded(P()),
    )
    case("autocast_default", jaxamp.value_and_grad(auto_loss), sharded(P()))
    fwd32 = jaxamp.autocast(linear, dtype=jnp.bfloat16, device="cpu", reduce_dtype="float32")

    def auto_loss32(p, x, ids):
        return jnp.mean(fwd32(p, x, ids).astype(jnp.float32) ** 2)

    case("autocast_kwarg_reduce_f32", jax.value_and_grad(auto_loss32), sharded(P()))

    def sm(policy):
        def step(p, x, ids):
            loss_value, grads = jaxamp.value_and_grad(loss, policy=policy)(p, x, ids)
            return loss_value[None], grads

        return jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P("data"), P())
        )

    p_rep = {k: put(v, P()) for k, v in params.items()}
    batch = (put(x, P("data")), put(ids, P("data")))
    case("shard_map_bf16_mixed", sm("bf16-mixed"), (p_rep, *batch))
    case("shard_map_reduce_bf16", sm(low), (p_rep, *batch))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))

    model = MLP()
    variables = model.init(jax.random.key(0), x[:2])
    state = jf.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1), policy="bf16-mixed"
    )

    def ts_step(state, x):
        def lf(p, x):
            return jnp.mean(state.apply_fn({"params": p}, x).astype(jnp.float32) ** 2)

        _, g = state.value_and_grad(lf)(state.params, x)
        return g

    state = jax.device_put(state, NamedSharding(mesh, P()))
    case("flax_train_state_bf16_mixed", ts_step, (state, put(x, P("data"))))

    nmodel = nnx.Sequential(
        nnx.Linear(16, 16, rngs=nnx.Rngs(0)),
        nnx.LayerNorm(16, rngs=nnx.Rngs(1)),
        nnx.Linear(16, 8, rngs=nnx.Rngs(2)),
    )
    jf.nnx.apply_policy(nmodel, "bf16-mixed")
    ngraph, nstate = nnx.split(nmodel)
    nstate = jax.device_put(nstate, NamedSharding(mesh, P()))

    def nnx_case(reduce_dtype):
        def step(state, x):
            m = nnx.merge(ngraph, state)

            def lf(m, x):
                return jnp.mean(m(x).astype(jnp.float32) ** 2)

            return jf.nnx_value_and_grad(lf, reduce_dtype=reduce_dtype)(m, x)[1]

        return step

    case("nnx_reduce_f32", nnx_case("float32"), (nstate, put(x, P("data"))))
    case("nnx_default", nnx_case(None), (nstate, put(x, P("data"))))

    out = {}
    for name in cases:
        colls = []
        dumped = sorted(dump.glob(f"*jit_{name}*after_spmd-partitioning*"))
        assert dumped, f"{name}: XLA dumped no module after SPMD partitioning into {dump}"
        for path in dumped:
            for line in path.read_text().splitlines():
                found = _COLLECTIVE.search(line)
                if found:
                    dtypes = sorted(set(re.findall(r"\b([a-z]+\d+)\[", found.group(1))))
                    colls.append([found.group(2), dtypes])
        out[name] = colls
    return out


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    """The probe's reductions, compiled in this process on 4 of its CPU devices (conftest forces
    8). The compilation cache is off while it compiles (switched off and reset: JAX decides once
    per process whether it uses the cache): its key leaves the dump options out, so a program
    compiled before would be read back and not dumped."""
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip(f"the probe needs 4 CPU devices; this process has {len(devices)}")
    dump = tmp_path_factory.mktemp("spmd_dump")
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        with jax.numpy_dtype_promotion("standard"):  # optax and flax internals
            return _probe_collectives(dump, devices[:4])
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()  # set up again, from the same folder, by the next compile


def _dtypes(colls):
    return sorted({d for _, ds in colls for d in ds})


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "dp_bf16_mixed",
        "dp_fp16_mixed",
        "fsdp_bf16_mixed",
        "autocast_reduce_f32",
        "autocast_kwarg_reduce_f32",
        "shard_map_bf16_mixed",
        "flax_train_state_bf16_mixed",
        "nnx_reduce_f32",
    ],
)
def test_gradient_collectives_run_in_reduce_dtype(collectives, case):
    colls = collectives[case]
    assert colls, f"{case}: no cross-device reduction found in the partitioned program"
    assert _dtypes(colls) == ["f32"], f"{case}: {colls}"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "dp_reduce_bf16",
        "fsdp_reduce_bf16",
        "shard_map_reduce_bf16",
        "autocast_default",
        "nnx_default",
    ],
)
def test_low_precision_reduction_is_visible_when_asked_for(collectives, case):
    # The same programs with reduce_dtype = compute dtype (or no reduce dtype for autocast)
    # reduce weight gradients in bfloat16: what the check above would catch.
    assert "bf16" in _dtypes(collectives[case]), collectives[case]


def _loss(p, x, ids):
    h = x + p["emb"][ids]
    h = jnp.tanh(h @ p["w"] + p["b"])
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _params(dtype=jnp.float32):
    rng = np.random.default_rng(1)
    return {
        "emb": jnp.asarray(rng.normal(size=(10, 16)), dtype),
        "w": jnp.asarray(rng.normal(size=(16, 8)) / 4, dtype),
        "b": jnp.asarray(rng.normal(size=(8,)), dtype),
    }


@pytest.mark.parametrize(
    "policy, maybe_jit",
    [
        pytest.param("bf16-mixed", lambda f: f, id="bf16-mixed-eager", marks=pytest.mark.slow),
        pytest.param("bf16-mixed", jax.jit, id="bf16-mixed-jit"),
        pytest.param("fp16-mixed", jax.jit, id="fp16-mixed-jit"),
    ],
)
def test_values_unchanged_and_grads_agree(policy, maybe_jit):
    p = _params()
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    ids = jnp.asarray(np.arange(32) % 10, jnp.int32)
    low = jaxamp.get_policy(policy).with_reduce_dtype(jaxamp.get_policy(policy).compute_dtype)
    loss_r, grads_r = maybe_jit(jaxamp.value_and_grad(_loss, policy=policy))(p, x, ids)
    loss_l, grads_l = maybe_jit(jaxamp.value_and_grad(_loss, policy=low))(p, x, ids)
    assert loss_r == loss_l  # the forward pass is the same program
    eps = float(jnp.finfo(jaxamp.get_policy(policy).compute_dtype).eps)
    for k in p:
        assert grads_r[k].dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(grads_l[k]))) + 1e-12
        # Low-precision accumulation of 32 rows and a final rounding: a few eps of the max.
        np.testing.assert_allclose(grads_r[k], grads_l[k], atol=8 * eps * scale, rtol=0)


def test_grads_equal_float32_accumulation_rounded_once():
    # reduce_in's weight gradient is a bf16 x bf16 dot accumulated in float32 and rounded once to
    # bfloat16 (as torch's bf16 matmul returns it): the float32 dot of the bf16 operands, rounded.
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(64, 16)), jnp.bfloat16)

    def f(w, x):
        return jnp.sum((x @ w.astype(jnp.bfloat16)).astype(jnp.float32))

    g = jax.jit(jax.grad(reduce_in(f, jnp.float32)))(w, x)
    ones = jnp.ones((64, 8), jnp.bfloat16)
    expected = jnp.dot(
        x.T, ones, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )
    np.testing.assert_array_equal(g, expected.astype(jnp.bfloat16).astype(jnp.float32))


def test_float16_weight_gradient_overflows_as_in_torch():
    # A float16 weight gradient past 65504 is inf in torch (its f16 matmul output); the same here,
    # so a loss scaler skips that step on both sides.
    w = jnp.ones((2, 1), jnp.float32)
    x = jnp.full((4, 2), 8.0, jnp.float32)

    def f(w, x):
        return jnp.sum((x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32))

    scaled = lambda w, x: f(w, x) * 2.0**16  # noqa: E731
    g = jax.jit(jax.grad(reduce_in(scaled, jnp.float32)))(w, x)
    assert g.dtype == jnp.float32 and not bool(jnp.isfinite(g).any())
    g = jax.jit(jax.grad(reduce_in(f, jnp.float32)))(w, x)
    np.testing.assert_array_equal(g, np.full((2, 1), 32.0))


def test_static_leaves_and_aux_pass_through():
    def f(p, x, *, scale, train):
        assert isinstance(train, bool)  # static, not traced
        return jnp.sum(x.astype(jnp.bfloat16) @ p.astype(jnp.bfloat16)).astype(jnp.float32) * scale

    p = jnp.ones((4, 2), jnp.float32)
    x = jnp.ones((3, 4), jnp.float32)
    g = jax.grad(reduce_in(f, "float32"), argnums=0)(p, x, scale=2.0, train=True)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, 6.0 * np.ones((4, 2)))


def test_bad_reduce_dtype():
    with pytest.raises(ValueError, match="reduce_dtype"):
        jaxamp.value_and_grad(_loss, reduce_dtype="float8")
    with pytest.raises(ValueError, match="reduce_dtype"):
        reduce_in(_loss, jnp.int32)


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_pmap_grads_in_param_dtype_psum_in_float32(replica_devices):
    # 16 rows per device: the full batch has the eager test's shapes (its operations reused).
    n = 2
    p = _params()
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(n, 16, 16)), jnp.float32)
    ids = jnp.asarray((np.arange(n * 16) % 10).reshape(n, 16), jnp.int32)

    def step(p, x, ids):
        _, g = jaxamp.value_and_grad(_loss, policy="bf16-mixed")(p, x, ids)
        return jax.lax.pmean(g, "data")

    g = jax.pmap(step, axis_name="data", in_axes=(None, 0, 0), devices=replica_devices[:n])(
        p, x, ids
    )
    _, full = jaxamp.value_and_grad(_loss, policy="bf16-mixed")(
        p, x.reshape(-1, 16), ids.reshape(-1)
    )
    for k in p:
        assert g[k].dtype == jnp.float32
        np.testing.assert_allclose(g[k][0], g[k][1])
        eps = float(jnp.finfo(jnp.bfloat16).eps)
        np.testing.assert_allclose(
            g[k][0], full[k], atol=8 * eps * float(jnp.max(jnp.abs(full[k]))), rtol=0
        )


@pytest.mark.standard_promotion
def test_nnx_value_and_grad_reduce_dtype_keeps_values_and_state():
    from flax import nnx

    import jaxamp.flax as jf

    @nnx.jit  # set-up in one program (its initialisers eagerly are a compile per op)
    def new_model():
        rngs = nnx.Rngs(0)
        return nnx.Sequential(
            nnx.Linear(4, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)
        )

    def build():
        model = new_model()
        jf.nnx.apply_policy(model, "bf16-mixed")
        return model

    x = jnp.asarray(np.random.default_rng(5).normal(size=(16, 4)), jnp.float32)

    def loss(m, x):
        return jnp.mean(m(x).astype(jnp.float32) ** 2)

    # Each under jit, as a training step runs it (reduce_in has no eager-only path); two programs,
    # so the equal losses are not one shared forward pass.
    plain, reduced = build(), build()
    l1, g1 = nnx.jit(jf.nnx_value_and_grad(loss))(plain, x)
    l2, g2 = nnx.jit(jf.nnx_value_and_grad(loss, reduce_dtype="float32"))(reduced, x)
    assert l1 == l2
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    leaves1, leaves2 = jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)
    # The bias before BatchNorm has a zero true gradient (rounding noise only): scale the
    # tolerance by the largest gradient of the model.
    scale = max(float(jnp.max(jnp.abs(a))) for a in leaves1)
    for a, b in zip(leaves1, leaves2, strict=True):
        assert b.dtype == jnp.float32
        np.testing.assert_allclose(a, b, atol=8 * eps * scale)
    # Batch statistics updated by the forward pass are kept, as nnx.value_and_grad keeps them.
    stats = lambda m: jax.tree_util.tree_leaves(nnx.state(m, nnx.BatchStat))  # noqa: E731
    for a, b in zip(stats(plain), stats(reduced), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(float(jnp.abs(s).sum()) > 0 for s in stats(reduced)[:1])
