"""Loss scales and loss-scaled states as users build, map and misuse them: validation where the
user builds, never when JAX rebuilds; jmp's idiom; errors that name the parameter, the value and
the closest valid name; misplaced loss scaling refused; no buffer copied on every step."""

from __future__ import annotations

import re

import flax.jax_utils
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp

SCALES = {
    "static": lambda: jaxamp.StaticLossScale(2.0**10),
    "dynamic": lambda: jaxamp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2),
    "noop": jaxamp.NoOpLossScale,
    "jmp_static": lambda: jmp.StaticLossScale(jnp.float32(2.0**10)),
}


def _params():
    return {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones(3)}


def _grads(scale: float, bad: bool = False):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5 * scale), _params())
    if bad:
        grads["b"] = grads["b"].at[1].set(jnp.inf)
    return grads


# --- stacked and replicated states ----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SCALES))
def test_state_survives_stacking_and_replication(kind):
    tx = jaxamp.loss_scaled(optax.sgd(0.1), SCALES[kind]())
    state = tx.init(_params())
    stacked = jax.tree.map(lambda x: x[None], state)
    assert jax.tree.structure(stacked) == jax.tree.structure(state)
    for leaf, original in zip(jax.tree.leaves(stacked), jax.tree.leaves(state), strict=True):
        assert leaf.shape == (1, *np.shape(original)) and leaf.dtype == original.dtype
    replicated = flax.jax_utils.replicate(state)
    n = jax.local_device_count()
    assert {leaf.shape[0] for leaf in jax.tree.leaves(replicated)} == {n}
    back = flax.jax_utils.unreplicate(replicated)
    assert jax.tree.structure(back) == jax.tree.structure(state)


@pytest.mark.parametrize("kind", ["static", "dynamic", "noop"])
def test_stacked_states_step_under_vmap(kind, maybe_jit):
    """Four independent runs stacked along a vmapped axis, one of them overflowing."""
    tx = jaxamp.loss_scaled(optax.sgd(0.1), SCALES[kind]())
    params = _params()
    states = jax.tree.map(lambda x: jnp.stack([x] * 4), tx.init(params))
    scale = float(jaxamp.get_loss_scale(tx.init(params)).loss_scale)
    grads = jax.tree.map(lambda *g: jnp.stack(g), *[_grads(scale, bad=(i == 2)) for i in range(4)])
    step = jax.vmap(lambda g, s: tx.update(g, s, params))
    updates, new_states = maybe_jit(step)(grads, states)
    assert np.asarray(new_states.skipped_steps).tolist() == [0, 0, 1, 0]
    assert not np.asarray(updates["b"][2]).any()
    np.testing.assert_allclose(np.asarray(updates["b"][0]), np.full(3, -0.05), rtol=1e-6)


def test_replicated_state_steps_under_pmap():
    """optax's own `apply_if_finite` pmap test, with loss_scaled and a static scale."""
    n = jax.local_device_count()
    tx = jaxamp.loss_scaled(optax.sgd(0.1), jaxamp.StaticLossScale(4.0), axis_name="devices")
    params = _params()
    state = flax.jax_utils.replicate(tx.init(params))
    grads = jax.tree.map(lambda g: jnp.stack([g] * n), _grads(4.0))
    grads["b"] = grads["b"].at[n - 1, 0].set(jnp.nan)  # one replica overflows: all skip
    step = jax.pmap(lambda g, s: tx.update(g, s, params), axis_name="devices")
    updates, new_state = step(grads, state)
    assert np.asarray(new_state.skipped_steps).tolist() == [1] * n
    assert not np.asarray(updates["w"]).any()
    np.testing.assert_array_equal(np.asarray(new_state.loss_scale.loss_scale), np.full(n, 4.0))


def test_static_scale_validates_the_users_value_only():
    with pytest.raises(TypeError, match=r"StaticLossScale\(loss_scale=...\).*shape \(1,\)"):
        jaxamp.StaticLossScale(jnp.ones(1))
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda v: jaxamp.StaticLossScale(v))(jnp.float32(2.0))
    # JAX rebuilding it with tracers, stacked or abstract values is not the user's call.
    scale = jaxamp.StaticLossScale(8.0)
    assert jax.jit(lambda s: s)(scale).loss_scale.dtype == jnp.float32
    assert jax.tree.map(lambda x: jnp.stack([x, x]), scale).loss_scale.shape == (2,)
    assert jax.eval_shape(lambda s: s, scale).loss_scale.shape == ()


# --- concrete 0-d arrays accepted (jmp's idiom), tracers/strings/bools refused --------------------


@pytest.mark.parametrize(
    "value",
    [
        jnp.float32(2.0**15),
        jnp.asarray(2.0**15, jnp.bfloat16),
        jnp.asarray(2.0**15, jnp.float16),
        np.float64(2.0**15),
        np.asarray(2.0**15, np.float64),
        jnp.int32(2**15),
    ],
    ids=lambda v: f"{type(v).__name__}-{np.dtype(v.dtype).name}",
)
def test_concrete_0d_arrays_are_accepted(value, maybe_jit):
    def build():
        dynamic = jaxamp.DynamicLossScale.create(
            init_scale=value, min_scale=jnp.float32(1.0), max_scale=jnp.float32(2.0**20)
        )
        return dynamic, jaxamp.StaticLossScale(value)

    dynamic, static = build()  # built eagerly, used under jit and without
    assert float(dynamic.loss_scale) == 2.0**15 and dynamic.min_scale == 1.0
    assert dynamic.max_scale == 2.0**20 and isinstance(dynamic.max_scale, float)
    out = maybe_jit(lambda d, s: (d.adjust(jnp.array(False)).loss_scale, s.loss_scale))(
        dynamic, static
    )
    assert float(out[0]) == 2.0**14 and float(out[1]) == 2.0**15
    assert out[1].dtype == jnp.float32
    reference = jmp.DynamicLossScale(jnp.float32(2**15))  # the idiom, as jmp users write it
    assert float(reference.loss_scale) == float(dynamic.loss_scale)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("65536", "got str '65536'"),
        (True, "got the bool True"),
        (np.bool_(True), "got the bool"),
        (jnp.array(True), "dtype bool"),
        (jnp.ones(2), r"shape \(2,\)"),
        (jnp.array(1 + 2j, jnp.complex64), "complex64"),
        ([2.0], "got list"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) or len(v) > 8 else v,
)
def test_non_numbers_are_refused_naming_the_parameter(value, match):
    with pytest.raises(TypeError, match=match) as err:
        jaxamp.DynamicLossScale.create(init_scale=value)
    assert str(err.value).startswith("init_scale must")
    with pytest.raises(TypeError, match=r"StaticLossScale\(loss_scale=...\)"):
        jaxamp.StaticLossScale(value)


def test_tracers_are_refused_with_the_fix():
    def build(value):
        return jaxamp.DynamicLossScale.create(init_scale=value).loss_scale

    with pytest.raises(TypeError, match=r"init_scale must be a concrete number.*outside jax.jit"):
        jax.jit(build)(jnp.float32(2.0**15))
    with pytest.raises(TypeError, match="growth_factor must be a concrete number"):
        jax.vmap(lambda f: jaxamp.DynamicLossScale.create(growth_factor=f).loss_scale)(
            jnp.ones(2) * 2
        )


# --- messages that name the parameter, the value and the closest valid name -----------------------


def test_unknown_axis_name_is_named_with_the_axes_in_scope():
    mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
    tx = jaxamp.loss_scaled(optax.sgd(0.1), axis_name="batchh")
    params = _params()
    state = tx.init(params)

    def step(grads):
        return tx.update(grads, state, params)[0]

    mapped = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P())
    for run in (mapped, jax.jit(mapped)):
        with pytest.raises(ValueError, match=r"axis_name='batchh'.*\['batch'\].*'batch'\?"):
            run(_grads(1.0))
    with pytest.raises(ValueError, match="no mapped axis is in scope"):
        jax.jit(step)(_grads(1.0))
    with pytest.raises(ValueError, match=r"all_finite: axis_name='x'"):
        jaxamp.all_finite(jnp.ones(2), axis_name="x")


_TORCH_KEYS = {
    "scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 0,
}


@pytest.mark.parametrize(
    ("jaxamp_part", "error", "match"),
    [
        ([1, 2], TypeError, r"state_dict\['jaxamp'\] must be a mapping.*got list \[1, 2\]"),
        ({"min_sale": 1.0}, ValueError, r"unknown key 'min_sale'.*Did you mean 'min_scale'\?"),
        ({"growth_rule": "flx"}, ValueError, r"growth_rule.*'flx'.*Did you mean 'flax'\?"),
    ],
)
def test_bad_jaxamp_part_of_a_state_dict_is_named(jaxamp_part, error, match):
    with pytest.raises(error, match=match):
        jaxamp.DynamicLossScale.from_state_dict({**_TORCH_KEYS, "jaxamp": jaxamp_part})


def test_preset_name_errors_name_the_valid_names():
    with pytest.raises(TypeError, match=r"from_preset\(name=...\) takes a preset name.*list"):
        jaxamp.DynamicLossScale.from_preset(["torch"])
    with pytest.raises(ValueError, match=r"name='torh'.*Did you mean 'torch'\?"):
        jaxamp.DynamicLossScale.from_preset("torh")
    with pytest.raises(ValueError, match=r"'megatorn'.*Did you mean 'megatron'\?"):
        jaxamp.loss_scaled(optax.sgd(0.1), "megatorn")


# --- misplaced or missing loss scaling is refused, naming the fix ---------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: optax.chain(optax.clip_by_global_norm(1.0), jaxamp.loss_scaled(optax.sgd(0.1))),
        lambda: optax.chain(jaxamp.loss_scaled(optax.sgd(0.1)), optax.scale(0.5)),
        lambda: optax.named_chain(
            ("clip", optax.clip(1.0)), ("sgd", jaxamp.loss_scaled(optax.sgd(0.1)))
        ),
    ],
    ids=["clip-then-loss_scaled", "loss_scaled-then-scale", "named_chain"],
)
def test_loss_scaled_inside_a_chain_is_refused(build, maybe_jit):
    tx = build()
    params = _params()
    state = tx.init(params)
    fix = r"Make loss_scaled the outermost transformation: jaxamp.loss_scaled\(optax.chain\("
    with pytest.raises(ValueError, match=fix):
        maybe_jit(lambda g, s, p: jaxamp.apply_gradients(tx, g, s, p))(_grads(1.0), state, params)
    with pytest.raises(ValueError, match=fix):
        maybe_jit(lambda s: jaxamp.get_loss_scale(s).loss_scale)(state)
    with pytest.raises(ValueError, match=fix):
        maybe_jit(lambda p, s: jaxamp.value_and_grad(lambda p: jnp.sum(p["w"]))(p, loss_scale=s))(
            params, state
        )
    updates, new_state = tx.update(_grads(1.0), state, params)
    with pytest.raises(ValueError, match=fix):
        jaxamp.apply_updates(params, updates, new_state)


def test_loss_scaled_per_multi_transform_group_is_not_a_chain(maybe_jit):
    params = _params()
    tx = optax.multi_transform(
        {"a": jaxamp.loss_scaled(optax.sgd(0.1)), "b": jaxamp.loss_scaled(optax.sgd(0.1))},
        {"w": "a", "b": "b"},
    )
    state = tx.init(params)
    grads = _grads(2.0**16, bad=True)  # group "b" overflows, group "a" applies
    new, _ = maybe_jit(lambda g, s, p: jaxamp.apply_gradients(tx, g, s, p))(grads, state, params)
    np.testing.assert_array_equal(np.asarray(new["b"]), np.asarray(params["b"]))
    np.testing.assert_allclose(np.asarray(new["w"]), np.asarray(params["w"]) - 0.05, rtol=1e-6)


@pytest.mark.parametrize("inner", [optax.adam(1e-3), optax.sgd(0.1)], ids=["adam", "sgd"])
def test_plain_optimizer_is_refused_by_apply_gradients(inner, maybe_jit):
    params = _params()
    state = inner.init(params)
    with pytest.raises(TypeError, match=r"tx is not loss-scaled.*jaxamp.loss_scaled\("):
        maybe_jit(lambda g, s, p: jaxamp.apply_gradients(inner, g, s, p))(
            _grads(2.0**16), state, params
        )


# --- seams: update_and_apply is a method; last_step_applied has its own meaning -------------------


@pytest.mark.standard_promotion  # optax's Adam computes float ** int32
def test_update_and_apply_is_a_method_equal_to_update_then_apply_updates(maybe_jit):
    tx = jaxamp.loss_scaled(optax.adam(1e-2))
    params = _params()
    state = tx.init(params)
    assert not hasattr(tx.update, "update_and_apply")  # no attribute set on a function
    for bad in (False, True):
        grads = _grads(2.0**16, bad=bad)
        fused, fused_state = maybe_jit(tx.update_and_apply)(grads, state, params)
        updates, pair_state = maybe_jit(tx.update)(grads, state, params)
        pair = jaxamp.apply_updates(params, updates, pair_state)
        fused_leaves = jax.tree.leaves((fused, fused_state))
        for a, b in zip(fused_leaves, jax.tree.leaves((pair, pair_state)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hand_built = jaxamp.LossScaledTransformation(optax.sgd(0.1).init, optax.sgd(0.1).update)
    with pytest.raises(TypeError, match="not built by jaxamp.loss_scaled"):
        hand_built.update_and_apply(_grads(1.0), state, params)


def test_last_step_applied_and_finite_differ_when_one_group_skips(maybe_jit):
    params = _params()
    tx = jaxamp.loss_scaled(
        {"a": optax.sgd(0.1), "b": optax.sgd(0.1)}, param_labels={"w": "a", "b": "b"}
    )
    state = tx.init(params)
    _, state = maybe_jit(tx.update)(_grads(2.0**16, bad=True), state, params)
    info = jaxamp.amp_info(state)
    assert not bool(info.last_step_finite)  # group "b" overflowed: the scale backs off
    assert bool(info.last_step_applied)  # group "a" updated its parameters
    _, state = maybe_jit(tx.update)(_grads(2.0**15), state, params)
    info = jaxamp.amp_info(state)
    assert bool(info.last_step_finite) and bool(info.last_step_applied)
    all_bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(2.0**15))
    _, state = maybe_jit(tx.update)(all_bad, state, params)
    info = jaxamp.amp_info(state)
    assert not bool(info.last_step_finite) and not bool(info.last_step_applied)


def test_loss_scaled_states_finds_them_and_amp_states_is_gone():
    """One vocabulary: `loss_scaled` makes a LossScaledState, `loss_scaled_states` finds them;
    the old name `amp_states` is removed, and asking for it names its replacement."""
    tx = optax.multi_transform(
        {"a": jaxamp.loss_scaled(optax.sgd(0.1)), "b": optax.sgd(0.1)}, {"w": "a", "b": "b"}
    )
    state = tx.init(_params())
    found = jaxamp.loss_scaled_states(state)
    assert list(found) == [".inner_states['a'].inner_state"]
    assert all(isinstance(s, jaxamp.LossScaledState) for s in found.values())
    assert "amp_states" not in jaxamp.__all__ and "amp_states" not in dir(jaxamp)
    with pytest.raises(AttributeError, match=r"removed: call jaxamp\.loss_scaled_states\("):
        jaxamp.amp_states  # noqa: B018
    with pytest.raises(ImportError):
        from jaxamp import amp_states  # noqa: F401
    with pytest.raises(AttributeError, match="has no attribute 'not_a_name'"):
        jaxamp.not_a_name  # noqa: B018


def test_set_loss_scale_names_itself_when_refusing_a_value():
    state = jaxamp.loss_scaled(optax.sgd(0.1)).init(_params())
    with pytest.raises(
        TypeError, match=r"^set_loss_scale\(loss_scale=\.\.\.\) takes None .*got float"
    ):
        jaxamp.set_loss_scale(state, 2.0)
    with pytest.raises(
        TypeError, match=r"^loss_scaled\(loss_scale=\.\.\.\) takes None .*got float"
    ):
        jaxamp.loss_scaled(optax.sgd(0.1), 2.0)


# --- no parameter or state buffer copied on every step, donated or not ----------------------------


def _big_copies(tx, donate: bool) -> list[str]:
    params = {"w": jnp.ones((64, 32)), "v": jnp.ones((32, 16))}
    state = tx.init(params)

    def step(params, opt_state, grads):
        return jaxamp.apply_gradients(tx, grads, opt_state, params)

    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    hlo = jitted.lower(params, state, params).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    # Copies in the entry computation run on every step (inside a branch: on a skip only).
    return [line for line in entry.splitlines() if re.search(r"= f32\[\d+,\d+\]\S* copy\(", line)]


@pytest.mark.standard_promotion  # optax's Adam computes float ** int32
def test_applied_steps_copy_no_parameter_or_state_buffer():
    """The README's step (no donation) with the default form, and a donating step with
    ``in_place=True``: XLA copies no parameter or optimizer-state buffer on every step (the
    branch form without donation copied all of them: the overhead the issue measured)."""
    if jax.default_backend() != "cpu":
        pytest.skip("XLA:CPU's program")
    assert _big_copies(jaxamp.loss_scaled(optax.adam(1e-3)), donate=False) == []
    assert _big_copies(jaxamp.loss_scaled(optax.adam(1e-3), in_place=True), donate=True) == []
    # What in_place=True costs without donation: every buffer copied (so it is opt-in).
    assert len(_big_copies(jaxamp.loss_scaled(optax.adam(1e-3), in_place=True), False)) >= 6


def test_in_place_must_be_a_bool():
    with pytest.raises(TypeError, match=r"loss_scaled\(in_place=...\) takes a bool"):
        jaxamp.loss_scaled(optax.sgd(0.1), in_place="yes")


def test_float16_master_weights_refused_by_apply_gradients_under_a_policy(maybe_jit):
    """Params outside the policy's param dtype, for the bare step: the policy named, the leaf named, the fix named."""
    half = jax.tree.map(lambda p: p.astype(jnp.float16), _params())
    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    state = tx.init(half)

    def step(policy):
        return maybe_jit(lambda g, s, p: jaxamp.apply_gradients(tx, g, s, p, policy=policy))(
            half, state, half
        )

    with pytest.raises(TypeError, match=r"b \(float16; expected float32 or float64\)") as err:
        step("fp16-mixed")
    assert "keep float32 master weights" in str(err.value)
    new, _ = step("fp16-true")  # pure float16 training, named as such
    assert jax.tree.map(lambda p: p.dtype, new) == jax.tree.map(lambda p: p.dtype, half)
    float32 = _params()
    new, _ = maybe_jit(lambda g, s, p: jaxamp.apply_gradients(tx, g, s, p, policy="fp16-mixed"))(
        float32, tx.init(float32), float32
    )
    assert new["w"].dtype == jnp.float32
