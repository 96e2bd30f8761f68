"""`jaxamp.optim_precision.low_precision_state` and its codecs: dtypes and shapes, errors, error bounds, and the
compositions it promises (loss_scaled skips, multi_steps, optax.MultiSteps, sharding, jit)."""

import collections
import dataclasses
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FLOAT_DTYPES
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxamp
from jaxamp import optim_precision
from jaxamp.optim_precision import _qmaps

pytestmark = pytest.mark.standard_promotion  # optax internals (float ** int32 bias correction)

BLOCK = ("8bit", "4bit", "fp8")
ALL = ("bf16", *BLOCK)


def _params(dtype=jnp.float32):
    return {"w": jnp.ones((64, 64), dtype), "b": jnp.zeros(64, dtype)}


def _grads(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)  # data made on the host: no random-number program
    return {
        "w": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32).astype(dtype),
        "b": jnp.asarray(rng.standard_normal(64), jnp.float32).astype(dtype),
    }


# --- codecs ------------------------------------------------------------------------------------


def _max_error(state_format, signed, scale):
    """The largest |x - dequantize(quantize(x))| a block can show: half the widest gap of its
    map times the block scale (fp8: half an e4m3 step at the top of the range, 32 / 448)."""
    if state_format == "fp8":
        return scale * 16.0 / 448.0
    table = {
        ("8bit", True): _qmaps.SIGNED_8BIT,
        ("8bit", False): _qmaps.UNSIGNED_8BIT,
        ("4bit", True): _qmaps.SIGNED_4BIT,
        ("4bit", False): _qmaps.UNSIGNED_4BIT,
    }[state_format, signed]
    # Between two map values: half their gap. Below the first value everything takes code 0
    # (the signed maps start at -0.993, the 4-bit unsigned map at 1/16): the whole distance.
    below = table[0] - (-1.0 if signed else 0.0)
    return scale * max(0.5 * float(np.diff(table).max()), float(below))


@pytest.mark.parametrize("state_format", BLOCK)
def test_quantize_round_trip_dtypes_shapes_and_error(state_format, maybe_jit):
    # Signed and unsigned codes of each float dtype: under jit the six in one program.
    variants = [(signed, d) for signed in (True, False) for d in FLOAT_DTYPES]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)) * 3.0, jnp.float32)
    xs = [(x if signed else jnp.abs(x)).astype(d) for signed, d in variants]
    encode = maybe_jit(
        lambda xs: tuple(
            optim_precision.encode_blockwise(v, state_format, signed=signed)
            for v, (signed, _) in zip(xs, variants, strict=True)
        )
    )
    decode = maybe_jit(lambda qs: tuple(optim_precision.decode_blockwise(q) for q in qs))
    qs = encode(xs)
    block = optim_precision._codecs.DEFAULT_BLOCK_SIZE[state_format]
    want_codes = {
        "8bit": (jnp.uint8, (8, 128)),
        "4bit": (jnp.uint8, (512,)),
        "fp8": (jnp.float8_e4m3fn, (8, 128)),
    }[state_format]
    for (signed, dtype), x, q, back in zip(variants, xs, qs, decode(qs), strict=True):
        case = f"signed={signed}, {jnp.dtype(dtype).name}"
        assert q.scale.dtype == jnp.float32 and q.scale.shape == (1024 // block,), case
        assert (q.codes.dtype, q.codes.shape) == (jnp.dtype(want_codes[0]), want_codes[1]), case
        assert back.dtype == jnp.float32 and back.shape == x.shape, case
        x32 = np.asarray(x.astype(jnp.float32)).reshape(-1, block)
        bound = _max_error(state_format, signed, np.abs(x32).max(-1, keepdims=True))
        err = np.abs(np.asarray(back).reshape(-1, block) - x32)
        # ... plus the float32 rounding of value * scale (half an ulp of the scale).
        assert (err <= bound + np.abs(x32).max(-1, keepdims=True) * 2.0**-23).all(), case
        # The scale is each block's largest magnitude (fp8: over 448).
        want = np.abs(x32).max(-1) / (448.0 if state_format == "fp8" else 1.0)
        np.testing.assert_allclose(np.asarray(q.scale), want, rtol=2.0**-23, err_msg=case)


def test_quantize_zeros_and_pytree_round_trip():
    q = optim_precision.encode_blockwise(jnp.zeros(256), "8bit", signed=False)
    np.testing.assert_array_equal(optim_precision.decode_blockwise(q), np.zeros(256))
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2  # codes and scale; the rest is static
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    meta = ("state_format", "signed", "shape", "block_size", "order")
    assert [getattr(again, f) for f in meta] == [getattr(q, f) for f in meta]
    assert {f.name for f in dataclasses.fields(q)} == {"codes", "scale", *meta}
    assert q.nbytes == 256 + 4


def test_codec_errors_name_the_parameter_and_the_closest_value():
    with pytest.raises(ValueError, match=r"state_format='8-bit'.*did you mean '8bit'.*Formats"):
        optim_precision.encode_blockwise(jnp.zeros(256), "8-bit")
    with pytest.raises(ValueError, match=r"block_size=3.*even"):
        optim_precision.encode_blockwise(jnp.zeros(256), "4bit", block_size=3)
    with pytest.raises(ValueError, match=r"size 100 .*multiple of block_size=256"):
        optim_precision.encode_blockwise(jnp.zeros(100), "8bit")
    with pytest.raises(TypeError, match="QuantizedArray"):
        optim_precision.decode_blockwise(jnp.zeros(3))


# --- the wrapper -------------------------------------------------------------------------------


@pytest.mark.parametrize("state_format", ALL)
def test_state_layout_dtypes_and_update_dtypes(state_format, maybe_jit):
    # Parameters of each float dtype: under jit the three updates in one program.
    tx = jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), state_format)
    params = [_params(d) for d in FLOAT_DTYPES]
    states = [tx.init(p) for p in params]
    for float_dtype, state in zip(FLOAT_DTYPES, states, strict=True):
        adam = state.inner_state[0]
        for field in ("mu", "nu"):
            w, b = getattr(adam, field)["w"], getattr(adam, field)["b"]
            if state_format == "bf16":
                assert w.dtype == jnp.bfloat16 and b.dtype == jnp.bfloat16
            else:  # the 64-element bias is below torchao's 4096-element minimum
                assert isinstance(w, optim_precision.QuantizedArray)
                assert w.signed == (field == "mu")
                assert b.dtype == float_dtype
    update = maybe_jit(lambda variants: tuple(tx.update(*v) for v in variants))
    stepped = update(
        [(_grads(0, d), s, p) for d, s, p in zip(FLOAT_DTYPES, states, params, strict=True)]
    )
    for float_dtype, state, (updates, new_state) in zip(FLOAT_DTYPES, states, stepped, strict=True):
        assert jax.tree.map(lambda u: u.dtype, updates) == {"w": float_dtype, "b": float_dtype}
        # The state keeps its types step to step (no retrace, no branch promotion in loss_scaled).
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        assert jax.tree.map(lambda a: a.dtype, new_state) == jax.tree.map(lambda a: a.dtype, state)
        assert bool(jnp.isfinite(updates["w"].astype(jnp.float32)).all())


@pytest.mark.parametrize("state_format", ALL)
def test_updates_follow_float32_adamw_within_the_formats_error(state_format):
    """Over a few steps the low-precision state gives AdamW's float32 updates up to the codes'
    resolution: a wrapper that dropped or mis-scaled a moment would be off by O(lr)."""
    lr = 1e-3
    exact, narrow = (
        optax.adamw(lr),
        jaxamp.optim_precision.low_precision_state(optax.adamw(lr), state_format),
    )
    params = _params()
    s_exact, s_narrow = exact.init(params), narrow.init(params)
    for step in range(5):
        grads = _grads(step)
        u_exact, s_exact = jax.jit(exact.update)(grads, s_exact, params)
        u_narrow, s_narrow = jax.jit(narrow.update)(grads, s_narrow, params)
    diff = np.abs(np.asarray(u_narrow["w"]) - np.asarray(u_exact["w"]))
    # Adam's update is about lr per element; the codes move it by a fraction of that.
    tol = {"bf16": 0.02, "fp8": 0.2, "8bit": 0.2, "4bit": 0.6}[state_format] * lr
    assert float(np.median(diff)) < tol / 4 and float(diff.max()) < 4 * tol
    if state_format != "bf16":
        # The small bias stays float32: the same arithmetic in two XLA programs, whose fusions
        # may round a few intermediate values differently (a few float32 ulps).
        np.testing.assert_allclose(u_narrow["b"], u_exact["b"], rtol=2.0**-20, atol=0)


_TRACES = collections.Counter()


@functools.cache
def _loss_scaled_and_jitted_update(state_format):
    """(loss_scaled AdamW with `state_format` state, its update jitted): one compiled program
    per format, shared by the tests; `_TRACES[state_format]` counts its traces."""
    tx = jaxamp.loss_scaled(
        jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), state_format)
    )

    def update(grads, state, params):
        _TRACES[state_format] += 1
        return tx.update(grads, state, params)

    return tx, jax.jit(update)


@pytest.mark.parametrize("state_format", BLOCK)
def test_skipped_step_keeps_codes_bit_for_bit(state_format, maybe_jit):
    tx, jitted = _loss_scaled_and_jitted_update(state_format)
    params = _params()
    state = tx.init(params)
    update = jitted if maybe_jit is jax.jit else tx.update
    _, state = update(jax.tree.map(lambda g: g * 65536.0, _grads(0)), state, params)
    bad = _grads(1)
    bad["w"] = bad["w"].at[3, 5].set(jnp.inf)
    updates, skipped = update(bad, state, params)
    assert not bool(jaxamp.amp_info(skipped).last_step_applied)
    before = jax.tree.leaves(state.inner_state)
    after = jax.tree.leaves(skipped.inner_state)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(
            np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a),
            np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8) if b.dtype.itemsize == 1 else b),
        )
        assert a.dtype == b.dtype
    assert all(bool((u == 0).all()) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("accumulate", ["jaxamp.multi_steps", "optax.MultiSteps"])
def test_gradient_accumulation_equals_one_step_on_the_mean(accumulate):
    base = jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), "8bit")
    wrapped = (
        jaxamp.multi_steps(base, every_k=2)
        if accumulate == "jaxamp.multi_steps"
        else optax.MultiSteps(base, every_k_schedule=2)
    )
    params = _params()
    g0, g1 = _grads(0), _grads(1)
    state = wrapped.init(params)
    _, state = jax.jit(wrapped.update)(g0, state, params)
    updates, state = jax.jit(wrapped.update)(g1, state, params)
    mean = jax.tree.map(lambda a, b: a + (b - a) / 2.0, g0, g1)
    want_updates, want_state = base.update(mean, base.init(params), params)
    np.testing.assert_allclose(updates["w"], want_updates["w"], rtol=0, atol=2.0**-30)
    inner = state.inner_state if accumulate == "jaxamp.multi_steps" else state.inner_opt_state
    got_mu = inner.inner_state[0].mu["w"]
    want_mu = want_state.inner_state[0].mu["w"]
    # The running mean and (a + b) / 2 agree to an ulp; a code moves only at a midpoint.
    assert int(jnp.abs(got_mu.codes.astype(jnp.int32) - want_mu.codes.astype(jnp.int32)).max()) <= 1


@pytest.mark.parametrize("state_format", ALL)
def test_sharded_update_gives_the_unsharded_codes(state_format):
    devices = np.array(jax.devices()[:8])
    if devices.size < 2:
        pytest.skip("needs several devices (conftest sets 8 CPU devices)")
    mesh = Mesh(devices, ("data",))
    tx = jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), state_format)
    params, grads = _params(), _grads(0)
    state = tx.init(params)
    want_updates, want_state = jax.jit(tx.update)(grads, state, params)

    rows = NamedSharding(mesh, PartitionSpec("data"))
    put = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(x, rows if x.ndim and x.shape[0] % devices.size == 0 else None),
        tree,
    )
    got_updates, got_state = jax.jit(tx.update)(put(grads), put(state), put(params))
    np.testing.assert_array_equal(got_updates["w"], want_updates["w"])
    for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(
            np.asarray(got).reshape(-1).view(np.uint8), np.asarray(want).reshape(-1).view(np.uint8)
        )
    mu = got_state.inner_state[0].mu["w"]
    codes = mu if state_format == "bf16" else mu.codes
    # Codes of the parameter's shape (8-bit, fp8, bf16) or packed flat (4-bit), spread over
    # the devices as the inputs were.
    assert codes.shape == ((2048,) if state_format == "4bit" else (64, 64))
    assert len(codes.sharding.device_set) == devices.size


def test_second_jitted_call_does_not_retrace():
    # The skipped-step test's jitted update (one program): traced once in this process, by
    # that test or here, however often either calls it.
    tx, update = _loss_scaled_and_jitted_update("4bit")
    params = _params()
    state = tx.init(params)
    for seed in range(3):
        updates, state = update(_grads(seed), state, params)
        params = optax.apply_updates(params, updates)
    assert _TRACES["4bit"] == 1


def test_state_bytes_per_parameter():
    params = {"w": jnp.zeros((128, 256))}  # 32768 elements
    n = 128 * 256
    per = {
        # the state's shapes and dtypes, as init returns them (no program compiled or run)
        name: optim_precision.state_bytes(jax.eval_shape(tx.init, params)) / n
        for name, tx in {
            "f32": optax.adamw(1e-3),
            "bf16": jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), "bf16"),
            "fp8": optim_precision.adamw_fp8(),
            "8bit": optim_precision.adamw_8bit(),
            "4bit": optim_precision.adamw_4bit(),
        }.items()
    }
    count = 4 / n  # Adam's int32 step counter
    assert per["f32"] == pytest.approx(8 + count)
    assert per["bf16"] == pytest.approx(4 + count)
    assert per["fp8"] == pytest.approx(2 + 2 * 4 / 256 + count)
    assert per["8bit"] == pytest.approx(2 + 2 * 4 / 256 + count)
    assert per["4bit"] == pytest.approx(1 + 2 * 4 / 128 + count)


def test_wrapper_errors_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"state_format='4-bit'.*did you mean '4bit'"):
        jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), "4-bit")
    with pytest.raises(ValueError, match=r"fields=\('m',\).*its fields are .*'mu'.*Did you mean"):
        jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), "8bit", fields=("m",)).init(
            _params()
        )
    with pytest.raises(ValueError, match=r"put loss_scaled outside"):
        jaxamp.optim_precision.low_precision_state(jaxamp.loss_scaled(optax.adamw(1e-3)), "8bit")
    with pytest.raises(TypeError, match=r"inner=\.\.\.\) takes an optax GradientTransformation"):
        jaxamp.optim_precision.low_precision_state(lambda g: g, "8bit")
    with pytest.raises(ValueError, match=r"min_size=-1"):
        jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), "8bit", min_size=-1)
    with pytest.raises(ValueError, match=r"block_size=0"):
        jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), "8bit", block_size=0)
    with pytest.raises(TypeError, match=r"fields=3"):
        jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), "8bit", fields=3)


def test_other_state_fields_and_small_leaves():
    # optax.sgd with momentum keeps a `trace`: it can be stored narrowly too.
    tx = jaxamp.optim_precision.low_precision_state(
        optax.sgd(0.1, momentum=0.9), "8bit", fields=("trace",), unsigned=(), min_size=256
    )
    params = {"w": jnp.ones(512), "odd": jnp.ones(300)}
    state = tx.init(params)
    trace = state.inner_state[0].trace
    assert isinstance(trace["w"], optim_precision.QuantizedArray) and trace["w"].signed
    assert trace["odd"].dtype == jnp.float32  # 300 is not a multiple of the block size
    updates, state = tx.update({"w": -jnp.ones(512), "odd": -jnp.ones(300)}, state, params)
    np.testing.assert_allclose(updates["w"], 0.1, rtol=2.0**-7)


def test_documentation_page_snippet_runs():
    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide" / "optimizer-precision.md"
    block = re.search(r"```python\n(.*?)```", page.read_text(), flags=re.S).group(1)
    assert "low_precision_state" in block and "stochastic_rounding" in block
    params = {"w": jnp.ones((64, 64), jnp.bfloat16)}
    opt_state = optim_precision.adamw_8bit().init(params)
    namespace = {"jax": jax, "jnp": jnp, "jaxamp": jaxamp, "optax": optax, "opt_state": opt_state}
    exec(compile(block, str(page), "exec"), namespace)  # noqa: S102
    tx = namespace["tx"]  # the last one: loss-scaled SR around 8-bit state
    state = jax.jit(tx.init)(params)  # one program each (eagerly: one compile per operation)
    grads = {"w": jnp.full((64, 64), 65536.0, jnp.bfloat16)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert updates["w"].dtype == jnp.bfloat16 and bool(jaxamp.amp_info(state).last_step_applied)


def test_checkpoint_round_trip_keeps_codes_static_fields_and_key(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.ones((64, 64), jnp.bfloat16)}
    for state_format in ALL:
        tx = jaxamp.optim_precision.stochastic_rounding(
            jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), state_format), seed=3
        )
        state = tx.init(params)
        _, state = tx.update({"w": jnp.full((64, 64), 0.5, jnp.bfloat16)}, state, params)
        path = tmp_path / state_format
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, state)
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path, jax.eval_shape(lambda s=state: s))
        # Same tree (QuantizedArray's static fields included), same dtypes, same bits.
        assert jax.tree.structure(restored) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(
                np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)
            )


# --- block order ---------------------------------------------------------------------------------


@pytest.mark.parametrize("state_format", BLOCK)
def test_block_order_blocks_the_permuted_elements(state_format, maybe_jit):
    """With an order, the codes and scales are those of the permuted elements (a (64, 32)
    kernel blocked as its (32, 64) transpose), and dequantize puts every value back in place.
    Each float dtype: under jit the three in one program."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 32)) * 3.0, jnp.float32)
    xs = [x.astype(d) for d in FLOAT_DTYPES]
    order = optim_precision.BlockOrder(np.arange(x.size).reshape(x.shape).T.reshape(-1))
    encode = maybe_jit(
        lambda xs: tuple(optim_precision.encode_blockwise(v, state_format, order=order) for v in xs)
    )
    decode = maybe_jit(lambda qs: tuple(optim_precision.decode_blockwise(q) for q in qs))
    qs = encode(xs)
    for x, q, back in zip(xs, qs, decode(qs), strict=True):
        plain = optim_precision.encode_blockwise(x.T, state_format)
        assert q.order is order and q.codes.ndim == 1 and q.scale.shape == plain.scale.shape
        np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(plain.scale))
        np.testing.assert_array_equal(
            np.asarray(q.codes).reshape(-1).view(np.uint8),
            np.asarray(plain.codes).reshape(-1).view(np.uint8),
        )
        assert back.shape == x.shape and back.dtype == jnp.float32
        np.testing.assert_array_equal(
            np.asarray(back), np.asarray(optim_precision.decode_blockwise(plain)).T
        )


def test_block_order_in_the_optimizer_keeps_its_order_and_stays_finite(maybe_jit):
    params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    order = np.arange(4096).reshape(64, 64).T.reshape(-1)
    tx = optim_precision.adamw_8bit(block_order={"w": order, "b": None})
    state = tx.init(params)
    for seed in range(2):
        updates, state = maybe_jit(tx.update)(_grads(seed), state, params)
        params = optax.apply_updates(params, updates)
    mu = state.inner_state[0].mu["w"]
    assert mu.order == optim_precision.BlockOrder(order) and mu.codes.shape == (4096,)
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree_util.tree_leaves(params))


def test_block_order_errors_name_the_parameter_and_the_closest_name():
    params = {"dense": {"kernel": jnp.ones((64, 64))}}
    order = np.arange(4096)
    tx = jaxamp.optim_precision.low_precision_state(
        optax.adam(1e-3), "8bit", block_order={"dense": {"kernal": order}}
    )
    with pytest.raises(
        ValueError, match=r"'dense/kernal' is not a parameter.*Did you mean 'dense/kernel'"
    ):
        tx.init(params)
    tx = jaxamp.optim_precision.low_precision_state(
        optax.adam(1e-3), "8bit", block_order={"dense": {"kernel": order[:100]}}
    )
    with pytest.raises(
        ValueError, match=r"'dense/kernel' has 100 elements; the parameter has 4096"
    ):
        tx.init(params)
    with pytest.raises(
        ValueError,
        match=r"dense/kernel.*each of 0 .. 4095 exactly once; index 0 appears 4096 times",
    ):
        jaxamp.optim_precision.low_precision_state(
            optax.adam(1e-3), "8bit", block_order={"dense": {"kernel": np.zeros(4096, int)}}
        )
    with pytest.raises(ValueError, match=r"1-D integer array.*float64"):
        optim_precision.BlockOrder(np.zeros(8))
    with pytest.raises(ValueError, match=r"state_format='bf16', block_order.*block formats"):
        jaxamp.optim_precision.low_precision_state(
            optax.adam(1e-3), "bf16", block_order={"dense": {"kernel": order}}
        )
    with pytest.raises(ValueError, match=r"encode_blockwise\(order=.*BlockOrder of size 256"):
        optim_precision.encode_blockwise(
            jnp.zeros(256), "8bit", order=optim_precision.BlockOrder(order)
        )
