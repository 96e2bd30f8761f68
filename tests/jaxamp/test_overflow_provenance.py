"""Overflow provenance: ``loss_scaled(..., provenance=True)`` names the first
gradient leaf that held inf or NaN on a skipped step and gives each leaf's headroom below
float16's maximum, eagerly and under `jit`, sharded and across replicas; finite steps report
nothing and cost nothing; ``provenance=False`` leaves the state and its checkpoints as they were.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxamp
import jaxamp.flax as jf

F16_MAX = float(np.finfo(np.float16).max)
PLANTED = "['dense1']['kernel']"  # the layer that overflows: the third leaf of four


def _params() -> dict:
    return {
        "dense0": {"bias": jnp.zeros(3), "kernel": jnp.ones((4, 3))},
        "dense1": {"bias": jnp.zeros(2), "kernel": jnp.ones((3, 2))},
    }


def _scaled_grads(dtype: Any, *, inf_at: tuple | None = (1, 0), nan_in_bias1: bool = False):
    """Gradients of a scaled loss in `dtype`, leaves in order dense0 bias (all zero), dense0
    kernel (largest value subnormal in `dtype`), dense1 bias, dense1 kernel (a value above
    float16's maximum where `dtype` has one). inf is planted in dense1's kernel at `inf_at`
    (None: nowhere); with `nan_in_bias1` a NaN in dense1's bias, the earlier leaf."""
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    big = 3.0e5 if dtype != jnp.float16 else 6.0e4
    kernel1 = np.array([[0.5, -1.25], [big, 2.0], [-7.0, 0.0]], np.float64)
    if inf_at is not None:
        kernel1[inf_at] = np.inf
    bias1 = np.array([1.0, np.nan if nan_in_bias1 else -3.0])
    grads = {
        "dense0": {"bias": np.zeros(3), "kernel": np.full((4, 3), -3.0 * tiny)},
        "dense1": {"bias": bias1, "kernel": kernel1},
    }
    grads["dense0"]["kernel"][0, 1] = 5 * tiny  # the largest, subnormal in `dtype`
    return jax.tree.map(lambda g: jnp.asarray(g, dtype), grads)


def _reference_headroom(grads: dict) -> list[float]:
    """log2(float16 max / max |g|) per leaf in float64: -inf non-finite, +inf all zero."""
    out = []
    for leaf in jax.tree.leaves(grads):
        values = np.abs(np.asarray(leaf).astype(np.float64))
        if not np.isfinite(values).all():
            out.append(-np.inf)
        elif values.max() == 0:
            out.append(np.inf)
        else:
            out.append(float(np.log2(F16_MAX) - np.log2(values.max())))
    return out


# A leaf whose largest magnitude is below float32's smallest normal: its maximum is read as 0
# (+inf headroom) where the backend flushes subnormals in comparisons (CPU, TPU).
FLUSHABLE = np.log2(F16_MAX) + 126


def _assert_headroom(got: Any, expected: list[float]) -> None:
    got = np.asarray(got, np.float64)
    assert got.dtype == np.float64 and got.shape == (len(expected),)
    for g, e in zip(got, expected, strict=True):
        if e > FLUSHABLE and g == np.inf:
            continue  # read as zero where subnormals are flushed
        if np.isinf(e):
            assert g == e
        else:
            # float32 arithmetic: log2 of the significand (a few float32 ulps of a value in
            # [0, 1)) plus the exponent and log2(float16 max), each rounded to float32.
            tol = 4 * np.finfo(np.float32).eps * (abs(e) + np.log2(F16_MAX) + 1)
            assert abs(g - e) <= tol, (g, e, tol)


def _no_overflow(overflow) -> None:
    assert int(overflow.overflow_leaf) == -1 and overflow.leaf_path() is None
    assert np.all(np.asarray(overflow.headroom) == np.inf)


# --- the planted overflow is named, with every leaf's headroom ------------------------------------


_PLANTED_STEPS = ({}, {"nan_in_bias1": True}, {"inf_at": None})


@functools.cache
def _planted_steps(dtype_names, jitted):
    """{dtype name: [(params, state) after each step]}: apply_gradients with provenance on the
    planted gradients of `_scaled_grads(dtype, **kw)` for each kw of `_PLANTED_STEPS` in turn,
    for each of `dtype_names`: under jit the dtypes in one program, shared by the tests."""
    params = _params()
    tx = jaxamp.loss_scaled(optax.sgd(1e-2), provenance=True)

    def each(grads, states, params):
        return {d: jaxamp.apply_gradients(tx, grads[d], states[d], params) for d in dtype_names}

    each = jax.jit(each) if jitted else each
    states = {d: tx.init(params) for d in dtype_names}
    runs = {d: [] for d in dtype_names}
    for kw in _PLANTED_STEPS:
        out = each({d: _scaled_grads(jnp.dtype(d), **kw) for d in dtype_names}, states, params)
        states = {d: out[d][1] for d in dtype_names}
        for d in dtype_names:
            runs[d].append(out[d])
    return runs


@pytest.mark.standard_promotion  # optax.apply_updates adds 16-bit updates to float32 params
def test_planted_overflow_names_the_layer(float_dtype, maybe_jit):
    params = _params()
    tx = jaxamp.loss_scaled(optax.sgd(1e-2), provenance=True)
    state = tx.init(params)
    jitted = maybe_jit is jax.jit
    names = ("float16", "bfloat16", "float32") if jitted else (float_dtype.name,)
    runs = iter(_planted_steps(names, jitted)[float_dtype.name])
    assert jaxamp.amp_info(state).overflow.paths == (
        "['dense0']['bias']",
        "['dense0']['kernel']",
        "['dense1']['bias']",
        PLANTED,
    )
    _no_overflow(jaxamp.amp_info(state).overflow)

    grads = _scaled_grads(float_dtype)
    new_params, state = next(runs)
    info = jaxamp.amp_info(state)
    assert not bool(info.last_step_applied)
    for new, old in zip(jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True):
        assert np.asarray(new).tobytes() == np.asarray(old).tobytes()
    overflow = info.overflow
    assert overflow.leaf_path() == PLANTED and int(overflow.overflow_leaf) == 3
    assert overflow.overflow_leaf.dtype == jnp.int32 and overflow.headroom.dtype == jnp.float32
    expected = _reference_headroom(grads)
    _assert_headroom(overflow.headroom, expected)
    assert overflow.headroom_by_path()[PLANTED] == -np.inf
    assert expected[0] == np.inf  # the all-zero leaf
    assert 16 < expected[1] < np.inf  # the subnormal leaf (in float16: measured exactly)
    if float_dtype == jnp.float16:
        assert overflow.headroom[1] < np.inf

    # A NaN in an earlier leaf as well: that leaf is the first.
    grads = _scaled_grads(float_dtype, nan_in_bias1=True)
    new_params, state = next(runs)
    overflow = jaxamp.amp_info(state).overflow
    assert overflow.leaf_path() == "['dense1']['bias']" and int(overflow.overflow_leaf) == 2
    _assert_headroom(overflow.headroom, _reference_headroom(grads))

    grads = _scaled_grads(float_dtype, inf_at=None)
    new_params, state = next(runs)
    assert bool(jaxamp.amp_info(state).last_step_applied)
    _no_overflow(jaxamp.amp_info(state).overflow)  # a finite step reports nothing


def test_overflow_only_once_unscaled_is_named(maybe_jit):
    """A scale below 1: the float16 gradient is finite as given, inf once unscaled (the check
    that skipped the step); its headroom is that of the finite scaled value."""
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    tx = jaxamp.loss_scaled(optax.sgd(0.1), jaxamp.StaticLossScale(0.5), provenance=True)
    grads = {"a": jnp.asarray([1.0, 2.0], jnp.float16), "b": jnp.asarray([4.0e4, 1.0], jnp.float16)}
    _, state = maybe_jit(tx.update)(grads, tx.init(params), params)
    overflow = jaxamp.amp_info(state).overflow
    assert int(state.skipped_steps) == 1 and overflow.leaf_path() == "['b']"
    _assert_headroom(overflow.headroom, _reference_headroom(grads))
    assert 0 < float(overflow.headroom[1]) < 1


def test_complex_and_integer_leaves(maybe_jit):
    params = {"c": jnp.ones(2, jnp.complex64), "i": jnp.ones(2, jnp.int32), "r": jnp.ones(2)}
    tx = jaxamp.loss_scaled(optax.identity(), jaxamp.StaticLossScale(1.0), provenance=True)
    grads = {
        "c": jnp.asarray([3.0 + 512.0j, 1.0], jnp.complex64),
        "i": jnp.ones(2, jnp.int32),
        "r": jnp.asarray([jnp.nan, 1.0]),
    }
    _, state = maybe_jit(tx.update)(grads, tx.init(params), params)
    overflow = jaxamp.amp_info(state).overflow
    assert overflow.leaf_path() == "['r']"
    headroom = overflow.headroom_by_path()
    assert headroom["['i']"] == np.inf and headroom["['r']"] == -np.inf
    assert abs(headroom["['c']"] - (np.log2(F16_MAX) - 9)) < 1e-5  # the larger part, 512


@pytest.mark.standard_promotion  # optax's Adam computes float ** int32
def test_per_group_decisions_record_the_first_leaf(maybe_jit):
    params = _params()
    labels = {"dense0": {"bias": "a", "kernel": "a"}, "dense1": {"bias": "b", "kernel": "b"}}
    tx = jaxamp.loss_scaled(
        {"a": optax.adam(1e-2), "b": optax.sgd(0.1)}, param_labels=labels, provenance=True
    )
    grads = _scaled_grads(jnp.float32)
    _, state = maybe_jit(tx.update)(grads, tx.init(params), params)
    info = jaxamp.amp_info(state)
    assert bool(info.last_step_applied) and not bool(info.last_step_finite)
    assert info.overflow.leaf_path() == PLANTED


def test_composes_with_multi_steps_and_stacked_runs():
    """Inside `jaxamp.multi_steps` the window's accumulated gradients are measured; under `vmap`
    each stacked run keeps its own record."""
    params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    bad = {"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf, 1.0])}
    tx = jaxamp.multi_steps(jaxamp.loss_scaled(optax.sgd(0.1), provenance=True), 2)
    state = tx.init(params)
    for _ in range(2):
        _, state = jax.jit(tx.update)(bad, state, params)
    assert jaxamp.amp_info(state).overflow.leaf_path() == "['b']"
    tx = jaxamp.loss_scaled(optax.sgd(0.1), provenance=True)
    states = jax.tree.map(lambda x: jnp.stack([x] * 3), tx.init(params))
    good = {"a": jnp.full(2, 2.0), "b": jnp.ones(3)}
    nan_a = {"a": jnp.array([jnp.nan, 1.0]), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda *g: jnp.stack(g), bad, good, nan_a)
    _, states = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params)))(grads, states)
    assert np.asarray(states.overflow.overflow_leaf).tolist() == [1, -1, 0]
    for run, g in enumerate((bad, good, nan_a)):
        expected = _reference_headroom(g) if run != 1 else [np.inf, np.inf]
        _assert_headroom(states.overflow.headroom[run], expected)


# --- provenance=False: the state, the step and checkpoints as they were ---------------------------


@pytest.mark.standard_promotion  # optax's Adam computes float ** int32
def test_provenance_changes_no_value_of_the_step(maybe_jit):
    """Finite and skipped steps alike: parameters, inner state, scale and counters bit for bit
    what they are without provenance; without it the state has no overflow record."""
    params = _params()
    runs = {}
    for provenance in (False, True):
        tx = jaxamp.loss_scaled(optax.adam(1e-2), provenance=provenance)
        step = maybe_jit(functools.partial(jaxamp.apply_gradients, tx))
        p, state = params, tx.init(params)
        trace = []
        for inf_at in (None, (1, 0), None):
            grads = _scaled_grads(jnp.float32, inf_at=inf_at)
            grads = jax.tree.map(lambda g: g * 2.0**12, grads)
            p, state = step(grads, state, p)
            trace.append(jax.tree.leaves((p, state._replace(overflow=None))))
        runs[provenance] = trace, state
    (off, off_state), (on, on_state) = runs[False], runs[True]
    for a_step, b_step in zip(off, on, strict=True):
        for a, b in zip(a_step, b_step, strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert off_state.overflow is None and jaxamp.amp_info(off_state).overflow is None
    assert len(jax.tree.leaves(on_state)) == len(jax.tree.leaves(off_state)) + 2


class _SixFieldState(NamedTuple):
    """`LossScaledState` as it was before `overflow` existed (same fields, same order)."""

    inner_state: Any
    loss_scale: Any
    last_step_finite: Any
    skipped_steps: Any
    consecutive_skips: Any
    group_applied: Any = None


def test_checkpoints_written_before_the_field_restore(tmp_path):
    """orbax compares tree structures, None fields included: a state without provenance must
    flatten as the six-field state did, or every older checkpoint fails to restore."""
    ocp = pytest.importorskip("orbax.checkpoint")
    params = _params()
    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    state = tx.init(params)
    _, state = tx.update(_scaled_grads(jnp.float32), state, params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    old = _SixFieldState(*state[:6])
    old_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(old)]
    assert paths == old_paths
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "old", old)
    checkpointer.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(params))
    restored = checkpointer.restore(tmp_path / "old", target)
    assert restored.overflow is None and int(restored.skipped_steps) == 1
    assert float(restored.loss_scale.loss_scale) == 2.0**15


def test_flax_checkpoints_restore_with_provenance_switched(tmp_path):
    """A run restarted from its checkpoint with provenance on (to find an overflow) restores;
    so does the reverse. The record describes the last step only: the target keeps its own."""
    pytest.importorskip("orbax.checkpoint")
    params = _params()
    without = jaxamp.loss_scaled(optax.sgd(0.1))
    with_it = jaxamp.loss_scaled(optax.sgd(0.1), provenance=True)
    for i, (saved_tx, target_tx) in enumerate(((without, with_it), (with_it, without))):
        _, state = saved_tx.update(_scaled_grads(jnp.float32), saved_tx.init(params), params)
        jf.checkpoint.save(tmp_path / str(i), {"opt": state}, step=1)
        restored = jf.checkpoint.restore(tmp_path / str(i), {"opt": target_tx.init(params)})["opt"]
        assert int(restored.skipped_steps) == 1 and float(restored.loss_scale.loss_scale) == 2.0**15
        assert (restored.overflow is None) == (target_tx is without)
        if restored.overflow is not None:
            _no_overflow(restored.overflow)


# --- replicas and sharding ------------------------------------------------------------------------


def _replica_grads(n: int) -> tuple[dict, list[dict]]:
    """Per-replica gradients stacked on a leading axis: replica 1 holds inf in dense1's kernel
    (leaf 3), replica n-1 a NaN in dense0's bias (leaf 0, the first across replicas)."""
    per_replica = []
    for r in range(n):
        g = _scaled_grads(jnp.float32, inf_at=None)
        g = jax.tree.map(lambda x, r=r: x * (r + 1), g)
        per_replica.append(g)
    per_replica[1]["dense1"]["kernel"] = per_replica[1]["dense1"]["kernel"].at[0, 0].set(jnp.inf)
    per_replica[n - 1]["dense0"]["bias"] = per_replica[n - 1]["dense0"]["bias"].at[2].set(jnp.nan)
    return jax.tree.map(lambda *g: jnp.stack(g), *per_replica), per_replica


def _replica_reference(per_replica: list[dict]) -> list[float]:
    return list(np.min([_reference_headroom(g) for g in per_replica], axis=0))


def test_shard_map_replicas_agree_on_the_first_leaf(replica_devices):
    n = min(4, len(replica_devices))
    mesh = jax.sharding.Mesh(np.array(replica_devices[:n]), ("d",))
    params = _params()
    tx = jaxamp.loss_scaled(optax.sgd(0.1), axis_name="d", provenance=True)
    stacked, per_replica = _replica_grads(n)

    def step(grads, state):
        grads = jax.tree.map(lambda g: g[0], grads)
        return tx.update(grads, state, params)[1]

    state = tx.init(params)
    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("d"), P()), out_specs=P()))
    overflow = jaxamp.amp_info(run(stacked, state)).overflow
    assert overflow.leaf_path() == "['dense0']['bias']"  # the last replica's NaN: leaf 0
    _assert_headroom(overflow.headroom, _replica_reference(per_replica))
    # Without the NaN the first is replica 1's kernel; finite replicas alone report nothing.
    stacked["dense0"]["bias"] = jnp.zeros_like(stacked["dense0"]["bias"])
    per_replica[n - 1]["dense0"]["bias"] = jnp.zeros(3)
    overflow = jaxamp.amp_info(run(stacked, state)).overflow
    assert overflow.leaf_path() == PLANTED
    _assert_headroom(overflow.headroom, _replica_reference(per_replica))
    finite = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 1.0), stacked)
    _no_overflow(jaxamp.amp_info(run(finite, state)).overflow)


def test_pmap_replicas_agree_on_the_first_leaf(replica_devices):
    n = 2
    params = _params()
    tx = jaxamp.loss_scaled(optax.sgd(0.1), axis_name="batch", provenance=True)
    stacked, per_replica = _replica_grads(n)
    state = jax.tree.map(lambda x: jnp.stack([x] * n), tx.init(params))
    step = jax.pmap(
        lambda g, s: tx.update(g, s, params)[1], axis_name="batch", devices=replica_devices[:n]
    )
    new_state = step(stacked, state)
    leaves = np.asarray(new_state.overflow.overflow_leaf)
    assert leaves.tolist() == [0, 0]  # replica 1's NaN in dense0's bias, on every replica
    one = jax.tree.map(lambda x: x[0], new_state.overflow)
    assert one.leaf_path() == "['dense0']['bias']"
    _assert_headroom(one.headroom, _replica_reference(per_replica))
    _assert_headroom(new_state.overflow.headroom[1], _replica_reference(per_replica))
    with pytest.raises(TypeError, match=r"shape \(2,\).*x\[0\]"):
        new_state.overflow.leaf_path()


def test_sharded_gradients_name_the_leaf():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, P("d"))
    params = {"a": jnp.ones((4, 2)), "b": jnp.ones((4, 2))}
    grads = {"a": jnp.full((4, 2), 3.0), "b": jnp.ones((4, 2)).at[3, 1].set(jnp.inf)}
    grads = jax.device_put(grads, sharding)
    tx = jaxamp.loss_scaled(optax.sgd(0.1), provenance=True)
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    overflow = jaxamp.amp_info(state).overflow
    assert overflow.leaf_path() == "['b']"
    _assert_headroom(overflow.headroom, [np.log2(F16_MAX) - np.log2(3.0), -np.inf])


# --- a finite step does no extra work -------------------------------------------------------------


def _primitives(jaxpr, inside_cond: bool, found: dict) -> None:
    """Counts primitives by name, apart inside and outside `lax.cond` branches."""
    for eqn in jaxpr.eqns:
        counts = found.setdefault(inside_cond, collections.Counter())
        counts[eqn.primitive.name] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _primitives(sub, inside_cond or eqn.primitive.name == "cond", found)


def _logs(counts: collections.Counter) -> int:
    """Logarithms among counted primitives: jnp.log2 binds `log` (and divides) up to jax 0.10,
    its own `log2` primitive from jax 0.11."""
    return counts["log"] + counts["log2"]


def test_measurement_runs_inside_the_skip_branch_only(monkeypatch):
    """The measurement's log2 (and the unsigned maximum of the bits) run only inside a
    `lax.cond`; outside it the step is the one without provenance: the branch form, CPU's and
    TPU's (GPU's program selects: tests/jaxamp/test_platform_programs.py)."""
    monkeypatch.setattr("jaxamp._provenance.branch_or_select", lambda branch, select: branch())
    params = _params()
    grads = _scaled_grads(jnp.float32, inf_at=None)
    found_with: dict = {}
    found_without: dict = {}
    for provenance, found in ((True, found_with), (False, found_without)):
        tx = jaxamp.loss_scaled(optax.sgd(0.1), provenance=provenance)
        jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(params), params)
        _primitives(jaxpr.jaxpr, False, found)
    assert _logs(found_with[True]) > 0 and _logs(found_with[False]) == 0
    # Outside the branches: the cond (and its predicate's conversion to a branch index).
    assert set(found_with[False] - found_without[False]) <= {"cond", "convert_element_type"}
    assert found_without[False] - found_with[False] == collections.Counter()


def test_select_form_where_a_branch_syncs_with_the_host(monkeypatch):
    """The GPU form (measured every step, then selected) gives the branch's records; run here
    by handing the select form to the CPU."""
    monkeypatch.setattr("jaxamp._provenance.branch_or_select", lambda branch, select: select())
    params = _params()
    tx = jaxamp.loss_scaled(optax.sgd(0.1), provenance=True)
    step = jax.jit(tx.update)
    grads = _scaled_grads(jnp.float32)
    _, state = step(grads, tx.init(params), params)
    overflow = jaxamp.amp_info(state).overflow
    assert overflow.leaf_path() == PLANTED
    _assert_headroom(overflow.headroom, _reference_headroom(grads))
    _, state = step(_scaled_grads(jnp.float32, inf_at=None), state, params)
    _no_overflow(jaxamp.amp_info(state).overflow)
    jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(params), params)
    found: dict = {}
    _primitives(jaxpr.jaxpr, False, found)
    assert _logs(found[False]) > 0  # computed outside any branch, as on GPU


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 1, None, jnp.array(True)], ids=repr)
def test_provenance_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"loss_scaled\(provenance=\.\.\.\) takes a bool") as err:
        jaxamp.loss_scaled(optax.sgd(0.1), provenance=value)
    assert type(value).__name__ in str(err.value)


def test_state_and_optimizer_must_agree_on_provenance():
    params = _params()
    with_it = jaxamp.loss_scaled(optax.sgd(0.1), provenance=True)
    without = jaxamp.loss_scaled(optax.sgd(0.1))
    grads = _scaled_grads(jnp.float32)
    with pytest.raises(ValueError, match=r"made without provenance.*provenance=True"):
        with_it.update(grads, without.init(params), params)
    with pytest.raises(ValueError, match=r"made with provenance.*provenance=False"):
        without.update(grads, with_it.init(params), params)
    with pytest.raises(ValueError, match=r"gradients have 1 leaves.*made for 4"):
        with_it.update({"w": jnp.ones(2)}, with_it.init(params), params)


# --- the benchmark's provenance variant -----------------------------------------------------------


def test_benchmark_provenance_variant_is_loss_scaled_with_provenance(benchmark_script):
    """The variant times `loss_scaled` with provenance on (its values equal the default's:
    `test_provenance_changes_no_value_of_the_step`); built, not compiled, to stay cheap."""
    bench = benchmark_script("bench_loss_scaled")
    params = {"w": jnp.ones((2, 2))}
    states = {}
    for variant in ("loss_scaled", "loss_scaled_provenance"):
        init, _ = bench._make_step(variant, lambda p, x, y: jnp.sum(p["w"]), "fp32")
        states[variant] = init(params)
    assert states["loss_scaled"].overflow is None
    assert states["loss_scaled_provenance"].overflow.paths == ("['w']",)
    assert "loss_scaled_provenance" not in bench.VARIANTS  # opt-in: the default run is as was
