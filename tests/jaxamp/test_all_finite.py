"""all_finite: empty trees, ignored leaves, detection anywhere, mixed dtypes, sharding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp import DynamicLossScale, StaticLossScale, all_finite

BAD_VALUES = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}


def _check(result, expected):
    assert result.shape == ()
    assert result.dtype == jnp.bool_
    assert bool(result) is expected


# --- empty trees and ignored leaves ---------------------------------------------------------------


@pytest.mark.parametrize("tree", [{}, [], (), None, {"a": {}, "b": [None]}], ids=repr)
def test_empty_tree_is_finite(tree, maybe_jit):
    _check(maybe_jit(all_finite)(tree), True)


def test_non_float_leaves_are_ignored(maybe_jit):
    tree = {
        "int32": jnp.array([0, np.iinfo(np.int32).max, -1], jnp.int32),
        "uint8": jnp.arange(3, dtype=jnp.uint8),
        "bool": jnp.array([True, False]),
        "key": jax.random.key(0),
        "legacy_key": jax.random.PRNGKey(0),
    }
    _check(maybe_jit(all_finite)(tree), True)
    tree["x"] = jnp.array([1.0, np.nan], jnp.float32)
    _check(maybe_jit(all_finite)(tree), False)


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_non_finite_leaf_detected_anywhere(position, bad, float_dtype, maybe_jit):
    leaves = [jnp.linspace(-2.0, 2.0, 5, dtype=float_dtype) for _ in range(3)]
    index = {"first": 0, "middle": 1, "last": 2}[position]
    leaves[index] = leaves[index].at[3].set(BAD_VALUES[bad])
    # Non-float leaves interleaved, so "first"/"last" are about float leaves in a mixed tree.
    tree = [jnp.int32(7), leaves[0], {"m": leaves[1], "flag": jnp.array(True)}, leaves[2]]
    _check(maybe_jit(all_finite)(tree), False)


def test_finite_extremes_are_finite(float_dtype, maybe_jit):
    info = jnp.finfo(float_dtype)
    x = jnp.array([info.max, -info.max, info.tiny, info.smallest_subnormal, 0.0], float_dtype)
    _check(maybe_jit(all_finite)({"x": x}), True)


def test_numpy_and_python_float_leaves_are_checked(maybe_jit):
    # Under jit, numpy scalars and Python floats become arrays and are checked: eager must agree.
    for leaf in (np.float32(np.nan), np.float16(np.inf), float("nan"), np.array([1.0, np.inf])):
        _check(maybe_jit(all_finite)({"g": leaf}), False)
    for leaf in (np.float32(1.0), 2.5, np.array([1.0, 2.0])):
        _check(maybe_jit(all_finite)({"g": leaf}), True)


# --- mixed trees ----------------------------------------------------------------------------------


def _mixed_tree():
    base = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7.0
    return {
        "f32": base,
        "bf16": base.astype(jnp.bfloat16),
        "f16": base.astype(jnp.float16),
        "scalar_f32": jnp.float32(0.5),
        "scalar_f16": jnp.float16(-3.0),
        "scalar_bf16": jnp.bfloat16(2.0),
        "empty_f32": jnp.zeros((0, 3), jnp.float32),
        "empty_f16": jnp.zeros((0,), jnp.float16),
        "transposed_f32": base.T,
        "transposed_bf16": base.astype(jnp.bfloat16).T,
        "transposed_f16": jnp.swapaxes(base.astype(jnp.float16).reshape(3, 2, 2), 0, 2),
        "ints": jnp.arange(3),
    }


FLOAT_KEYS = [k for k in _mixed_tree() if k != "ints" and not k.startswith("empty")]


def test_mixed_tree_finite(maybe_jit):
    _check(maybe_jit(all_finite)(_mixed_tree()), True)


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_mixed_tree_detects_each_leaf(key, bad, maybe_jit):
    tree = _mixed_tree()
    leaf = tree[key]
    flat = leaf.reshape(-1).at[-1].set(BAD_VALUES[bad])
    tree[key] = flat.reshape(leaf.shape)
    _check(maybe_jit(all_finite)(tree), False)


@pytest.mark.parametrize("loss_scale", [2.0**10, 2.0**-3], ids=["2^10", "2^-3"])
def test_mixed_tree_unscales_exactly_and_keeps_dtypes(loss_scale, maybe_jit):
    """Scaled finite leaves unscale exactly (power-of-two scale), each keeping its dtype."""
    tree = _mixed_tree()
    scale = DynamicLossScale.create(init_scale=loss_scale)
    scaled = jax.tree.map(
        lambda x: (
            x * jnp.asarray(loss_scale, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        ),
        tree,
    )

    def unscale_and_check(s, g):
        return s.unscale(g), all_finite(g)

    unscaled, finite = maybe_jit(unscale_and_check)(scale, scaled)
    _check(finite, True)
    for key, x in tree.items():
        assert unscaled[key].dtype == x.dtype, key
        assert unscaled[key].shape == x.shape, key
        np.testing.assert_array_equal(np.asarray(unscaled[key]), np.asarray(x), err_msg=key)
    # Static scales follow the same contract.
    static = maybe_jit(lambda g: StaticLossScale(loss_scale).unscale(g))(scaled)
    assert jax.tree.map(lambda x: x.dtype, static) == jax.tree.map(lambda x: x.dtype, tree)


# --- sharded arrays -------------------------------------------------------------------------------


@pytest.fixture
def mesh(replica_devices):
    return Mesh(np.array(replica_devices), ("d",))


@pytest.mark.parametrize("bad", [None, "first", "middle", "last"])
def test_sharded_array(mesh, bad, maybe_jit):
    n = mesh.size
    sharding = NamedSharding(mesh, P("d"))
    x = np.linspace(-1.0, 1.0, 4 * n, dtype=np.float32)
    bad_index = {None: None, "first": 0, "middle": 2 * n + 1, "last": 4 * n - 1}[bad]
    if bad_index is not None:
        x[bad_index] = np.nan
    sharded = jax.device_put(x, sharding)
    assert len(sharded.sharding.device_set) == n
    # Only the shard holding the bad element is non-finite.
    shard_finite = [bool(np.isfinite(np.asarray(s.data)).all()) for s in sharded.addressable_shards]
    assert shard_finite.count(False) == (0 if bad_index is None else 1)
    tree = {"sharded": sharded, "replicated": jnp.ones(3, jnp.bfloat16)}
    _check(maybe_jit(all_finite)(tree), bad_index is None)


def test_axis_name_inside_shard_map(mesh):
    n = mesh.size
    x = np.ones(2 * n, np.float32)
    x[2 * n - 3] = np.nan  # shard n - 2 only (6 of 8)

    def per_shard(block, axis_name):
        return all_finite({"g": block}, axis_name=axis_name).reshape(1)

    def run(axis_name):
        fn = jax.shard_map(
            lambda b: per_shard(b, axis_name), mesh=mesh, in_specs=P("d"), out_specs=P("d")
        )
        return np.asarray(jax.jit(fn)(x))

    local = run(None)
    assert local.dtype == np.bool_ and local.shape == (n,)
    assert local.tolist() == [i != n - 2 for i in range(n)]
    agreed = run("d")
    assert agreed.tolist() == [False] * n
    x[2 * n - 3] = 1.0
    assert run("d").tolist() == [True] * n


def test_axis_name_empty_tree_inside_shard_map(mesh):
    fn = jax.shard_map(
        lambda b: all_finite({}, axis_name="d").reshape(1) & (b[:1] > 0),
        mesh=mesh,
        in_specs=P("d"),
        out_specs=P("d"),
    )
    assert np.asarray(fn(np.ones(mesh.size, np.float32))).tolist() == [True] * mesh.size


# --- values a sum-based check would get wrong (overflowing or cancelling sums) --------------------


def test_finite_rows_whose_sums_overflow_are_finite(float_dtype, maybe_jit):
    """Row sums overflow here: a check that sums would need a second look to say finite."""
    info = jnp.finfo(float_dtype)
    rows = jnp.full((3, 4), info.max, float_dtype)
    _check(maybe_jit(all_finite)({"w": rows}), True)
    _check(maybe_jit(all_finite)({"w": rows, "b": jnp.full((5,), -info.max, float_dtype)}), True)
    _check(maybe_jit(all_finite)({"w": rows.at[1, 2].set(jnp.nan)}), False)
    _check(maybe_jit(all_finite)({"w": rows.at[2, 0].set(-jnp.inf)}), False)


def test_infinities_that_cancel_in_a_sum_are_caught(float_dtype, maybe_jit):
    # inf + (-inf) is NaN and NaN + inf is NaN: no combination sums to a finite number.
    x = jnp.zeros((2, 4), float_dtype).at[0, 1].set(jnp.inf).at[0, 3].set(-jnp.inf)
    _check(maybe_jit(all_finite)(x), False)
    _check(maybe_jit(all_finite)(x.at[0, 0].set(jnp.nan)), False)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0), (2, 0, 4), (1,), (2, 3, 4, 5)])
def test_any_rank_and_empty_leaves(shape, maybe_jit):
    x = jnp.ones(shape, jnp.float32)
    _check(maybe_jit(all_finite)({"x": x, "s": jnp.float32(2.0)}), True)
    if x.size:
        bad = x.reshape(-1).at[x.size // 2].set(jnp.inf).reshape(shape)
        _check(maybe_jit(all_finite)({"x": bad}), False)


def test_complex_non_finite_in_either_part_is_caught(maybe_jit):
    x = jnp.ones((3, 4), jnp.complex64)
    _check(maybe_jit(all_finite)(x), True)
    _check(maybe_jit(all_finite)(x.at[1, 1].set(complex(1.0, np.nan))), False)
    _check(maybe_jit(all_finite)(x.at[2, 3].set(complex(np.inf, 0.0))), False)
    huge = jnp.full((2, 3), complex(3e38, -3e38), jnp.complex64)  # sums overflow, finite
    _check(maybe_jit(all_finite)(huge), True)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    magnitude=st.sampled_from([1.0, "max"]),
    bad=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from([np.inf, -np.inf, np.nan])),
        max_size=3,
    ),
    seed=st.integers(0, 2**16),
)
def test_all_finite_equals_numpy(dtype, shape, magnitude, bad, seed):
    """Eager and jitted, every dtype and rank: the answer is numpy's isfinite(x).all()."""
    dtype = jnp.dtype(dtype)
    scale = float(jnp.finfo(dtype).max) if magnitude == "max" else 1.0
    rng = np.random.default_rng(seed)
    flat = np.clip(rng.uniform(-1.0, 1.0, size=math.prod(shape)) * scale, -scale, scale)
    flat = flat.astype(dtype)
    for index, value in bad:
        if flat.size:
            flat[index % flat.size] = value
    x = flat.reshape(shape)
    expected = bool(np.isfinite(flat.astype(np.float32)).all())
    for fn in (all_finite, jax.jit(all_finite)):
        _check(fn({"x": jnp.asarray(x)}), expected)


# One optimizer for every scale: a static scale is a leaf of the state (traced under `jit`),
# so one compiled update per gradient shape and dtype serves every scale.
_STATIC_SGD = jaxamp.loss_scaled(optax.sgd(1e-3), jaxamp.StaticLossScale(1.0))
_STATIC_SGD_JIT_UPDATE = jax.jit(_STATIC_SGD.update)


@settings(max_examples=12, deadline=None)
@example(scale=0.25, magnitude=3e38, bad=None, seed=0)  # finite, overflows when unscaled
@example(scale=0.5, magnitude=1.0, bad=np.nan, seed=1)
@example(scale=2.0**127, magnitude=3e38, bad=None, seed=2)
@example(scale=float(np.finfo(np.float32).max), magnitude=1e30, bad=-np.inf, seed=3)
@given(
    scale=st.sampled_from(
        [0.25, 0.5, 1.0, 1.5, 2.0**16, 2.0**127, float(np.finfo(np.float32).max)]
    ),
    magnitude=st.sampled_from([1.0, 1e30, 3e38]),
    bad=st.sampled_from([None, np.inf, -np.inf, np.nan]),
    seed=st.integers(0, 2**16),
)
def test_loss_scaled_skips_exactly_when_the_unscaled_gradients_are_not_finite(
    scale, magnitude, bad, seed
):
    """The scaled gradients are always checked; below a scale of 1 the unscaled ones are too
    (unscaling can overflow only there). Either way: skip iff numpy says so."""
    rng = np.random.default_rng(seed)
    g = (rng.uniform(-1.0, 1.0, size=(4, 8)) * magnitude).astype(np.float32)
    if bad is not None:
        g[rng.integers(4), rng.integers(8)] = bad
    params = {"w": jnp.zeros((4, 8))}
    opt_state = jaxamp.set_loss_scale(_STATIC_SGD.init(params), jaxamp.StaticLossScale(scale))
    unscaled = np.asarray(jaxamp.StaticLossScale(scale).unscale(jnp.asarray(g)))
    expected_skip = not np.isfinite(unscaled).all()
    for step in (_STATIC_SGD.update, _STATIC_SGD_JIT_UPDATE):
        _, state = step({"w": jnp.asarray(g)}, opt_state, params)
        assert int(jaxamp.amp_info(state).skipped_steps) == int(expected_skip)


@settings(max_examples=6, deadline=None)
@example(dtype="float16", size=17, scale=2.0**-4, at=16, seed=0)  # a lone element past a row
@example(dtype="bfloat16", size=48, scale=0.5, at=0, seed=1)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    size=st.integers(1, 50),
    scale=st.sampled_from([2.0**-4, 0.5, 0.75, 1.0]),
    at=st.integers(0, 49),
    seed=st.integers(0, 2**16),
)
def test_unscaled_overflow_of_16_bit_leaves_is_decided_element_by_element(
    dtype, size, scale, at, seed
):
    """Only each leaf's largest magnitude is unscaled for the check (unscaling rounds
    monotonically): on 16-bit leaves of every length (rows of 16, 8, 4, 2 or 1) the step
    skips iff numpy finds a non-finite element after unscaling in the leaf's dtype."""
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    top = float(jnp.finfo(dtype).max)
    flat = (rng.uniform(-1.0, 1.0, size=size) * top * scale * 0.9).astype(dtype)
    flat[at % size] = rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.0) * top
    params = {"w": jnp.zeros(size, jnp.float32)}
    opt_state = jaxamp.set_loss_scale(_STATIC_SGD.init(params), jaxamp.StaticLossScale(scale))
    with np.errstate(over="ignore"):
        unscaled = (flat.astype(np.float32) * np.float32(1.0 / scale)).astype(dtype)
    expected_skip = not np.isfinite(unscaled.astype(np.float32)).all()
    for step in (_STATIC_SGD.update, _STATIC_SGD_JIT_UPDATE):
        _, state = step({"w": jnp.asarray(flat)}, opt_state, params)
        assert int(jaxamp.amp_info(state).skipped_steps) == int(expected_skip)


@pytest.mark.parametrize(
    ("scale", "skipped"), [(0.25, True), (0.5, True), (1.0, False), (2.0**127, False)]
)
def test_below_scale_one_the_unscaled_gradients_decide(scale, skipped, maybe_jit):
    """One large finite gradient whose row sum stays finite: unscaled by a scale below 1 it
    overflows (the step must skip), by a scale of 1 or more it does not."""
    g = jnp.zeros((4, 8), jnp.float32).at[1, 2].set(2e38)
    tx = jaxamp.loss_scaled(optax.sgd(1e-3), jaxamp.StaticLossScale(scale))
    params = {"w": jnp.zeros((4, 8))}
    _, state = maybe_jit(tx.update)({"w": g}, tx.init(params), params)
    assert int(jaxamp.amp_info(state).skipped_steps) == int(skipped)
