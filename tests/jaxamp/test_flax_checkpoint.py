"""orbax checkpoints of Flax mixed-precision state, linen and NNX.

Save at step t, restore in a fresh process (a subprocess), continue: the next steps are
bit-identical to an uninterrupted run, skip decisions included. A checkpoint without
loss scaling restored into a run with it (and the reverse) raises, or resets when asked to.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state

import jaxamp
import jaxamp.flax as jf
from jaxamp.flax import checkpoint as ckpt

pytest.importorskip("orbax.checkpoint")

REPO = Path(__file__).resolve().parents[2]
TOTAL, SAVE_AT = 8, 3

# Shared by this process and the fresh one: the same model, data and steps.
WORKER = textwrap.dedent(
    """
    import hashlib, json, sys
    import flax.linen as nn
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import jaxamp, jaxamp.flax as jf
    from jaxamp.flax import checkpoint as ckpt

    POLICY = "fp16-mixed"
    OVERFLOW_STEPS = (1, 5)  # one skip before the save point, one after


    def scale():
        return jaxamp.DynamicLossScale.create(init_scale=2.0**10, growth_interval=2)


    def batch(i):  # made on the host: set-up, no XLA program
        x = np.random.default_rng(i).standard_normal((8, 4)).astype(np.float32)
        if i in OVERFLOW_STEPS:
            x[0, 0] = np.inf
        return jnp.asarray(x), jnp.asarray(np.arange(8) % 3)


    def xent(logits, y):
        logits = logits.astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.LayerNorm()(nn.Dense(8)(x))))


    # The initialisers in one program each (eagerly, a compile per op).
    init_linen = jax.jit(jf.linen.with_policy(LinenMLP().init, POLICY))


    def make_linen():
        model = LinenMLP()
        params = init_linen(jax.random.key(0), batch(0)[0])
        return jf.TrainState.create(apply_fn=model.apply, params=params["params"],
                                    tx=optax.adam(1e-2), policy=POLICY, loss_scale=scale())


    @jax.jit
    def linen_step(state, x, y):
        loss_fn = lambda p, x, y: xent(state.apply_fn({"params": p}, x), y)
        loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)
        return state.apply_gradients(grads=grads), loss


    class NNXMLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.l2 = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.norm(self.l1(x))))


    new_nnx_mlp = nnx.jit(lambda: NNXMLP(nnx.Rngs(0)))


    def make_nnx():
        model = jf.nnx.apply_policy(new_nnx_mlp(), POLICY)
        return model, jf.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, policy=POLICY,
                                   loss_scale=scale())


    @nnx.jit
    def nnx_step(model, optimizer, x, y):
        loss, grads = jf.nnx_value_and_grad(lambda m, x, y: xent(m(x), y))(
            model, x, y, loss_scale=optimizer)
        optimizer.update(model, grads)
        return loss


    def record(loss, info):
        return [np.asarray(loss).tobytes().hex(), float(info.loss_scale),
                bool(info.last_step_finite)]


    def digest(tree):
        h = hashlib.sha256()
        for leaf in jax.tree.leaves(tree):
            h.update(np.asarray(leaf).tobytes())
        return h.hexdigest()


    def run_linen(state, start, stop):
        records = []
        for i in range(start, stop):
            state, loss = linen_step(state, *batch(i))
            records.append(record(loss, state.amp_info()))
        return state, records


    def run_nnx(model, optimizer, start, stop):
        records = []
        for i in range(start, stop):
            loss = nnx_step(model, optimizer, *batch(i))
            records.append(record(loss, optimizer.amp_info()))
        return records


    def nnx_digest(model, optimizer):
        return digest(nnx.as_pure(nnx.state((model, optimizer))))


    if __name__ == "__main__":
        directory, start, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        state = ckpt.restore(directory + "/linen", make_linen())
        state, linen_records = run_linen(state, start, stop)
        model, optimizer = make_nnx()
        ckpt.restore(directory + "/nnx", (model, optimizer))
        nnx_records = run_nnx(model, optimizer, start, stop)
        print(json.dumps({"linen": linen_records, "linen_digest": digest(state),
                          "nnx": nnx_records, "nnx_digest": nnx_digest(model, optimizer)}))
        import gc
        gc.freeze()  # exit without the final collection's walk over every JAX/flax object
    """
)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = tmp_path_factory.mktemp("worker") / "flax_ckpt_worker.py"
    path.write_text(WORKER)
    namespace = {"__name__": "flax_ckpt_worker"}
    exec(compile(WORKER, str(path), "exec"), namespace)
    return path, namespace


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.standard_promotion  # optax's adam computes float ** int32
def test_restore_in_fresh_process_continues_bit_identically(worker, tmp_path):
    """Save, restore in a fresh process, continue bit-identically: linen and NNX, with a skipped step before and after the save point."""
    path, w = worker
    # The interrupted run: SAVE_AT steps, then save.
    state, _ = w["run_linen"](w["make_linen"](), 0, SAVE_AT)
    ckpt.save(tmp_path / "linen", state, SAVE_AT)
    model, optimizer = w["make_nnx"]()
    w["run_nnx"](model, optimizer, 0, SAVE_AT)
    ckpt.save(tmp_path / "nnx", (model, optimizer), SAVE_AT)
    assert ckpt.latest_step(tmp_path / "linen") == SAVE_AT
    # Resume in a fresh process, while this one runs the uninterrupted reference.
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, str(path), str(tmp_path), str(SAVE_AT), str(TOTAL)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        full_state, full_linen = w["run_linen"](w["make_linen"](), 0, TOTAL)
        model, optimizer = w["make_nnx"]()
        full_nnx = w["run_nnx"](model, optimizer, 0, TOTAL)
        full_nnx_digest = w["nnx_digest"](model, optimizer)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [r[2] for r in full_linen] == [i not in w["OVERFLOW_STEPS"] for i in range(TOTAL)]
    assert proc.returncode == 0, stderr[-3000:]
    resumed = json.loads(stdout.strip().splitlines()[-1])
    assert resumed["linen"] == full_linen[SAVE_AT:]
    assert resumed["linen_digest"] == w["digest"](full_state)
    assert resumed["nnx"] == full_nnx[SAVE_AT:]
    assert resumed["nnx_digest"] == full_nnx_digest


@pytest.mark.standard_promotion
def test_linen_loss_scale_mismatch(worker, tmp_path):
    """A checkpoint with or without loss scaling restored into the other, linen: plain <-> loss-scaled, and another loss-scale type."""
    _, w = worker
    scaled = w["make_linen"]()
    scaled, _ = w["linen_step"](scaled, *w["batch"](1))  # a skip: scale 512, skipped_steps 1
    plain = flax_train_state.TrainState.create(
        apply_fn=scaled.apply_fn, params=scaled.params, tx=optax.adam(1e-2)
    )
    ckpt.save(tmp_path / "scaled", scaled, 1)
    ckpt.save(tmp_path / "plain", plain, 1)
    # Saved without loss scaling, restored into a run with it: error, or documented reset.
    with pytest.raises(ValueError, match="saved with no loss scaling.*on_loss_scale_mismatch"):
        ckpt.restore(tmp_path / "plain", w["make_linen"]())
    restored = ckpt.restore(tmp_path / "plain", w["make_linen"](), on_loss_scale_mismatch="reset")
    assert float(restored.amp_info().loss_scale) == 2.0**10  # the target's fresh scale
    assert int(restored.amp_info().skipped_steps) == 0
    assert w["digest"](restored.params) == w["digest"](plain.params)
    inner = jaxamp.loss_scaled_states(restored.opt_state)[""].inner_state
    assert w["digest"](inner) == w["digest"](plain.opt_state)
    # The reverse.
    with pytest.raises(ValueError, match="target has no loss scaling"):
        ckpt.restore(tmp_path / "scaled", plain)
    back = ckpt.restore(tmp_path / "scaled", plain, on_loss_scale_mismatch="reset")
    assert w["digest"](back.opt_state) == w["digest"](
        jaxamp.loss_scaled_states(scaled.opt_state)[""].inner_state
    )
    # Another loss-scale type (NoOp: bf16) into a dynamic run.
    model = w["LinenMLP"]()
    noop = jf.TrainState.create(
        apply_fn=model.apply, params=scaled.params, tx=optax.adam(1e-2), policy="bf16-mixed"
    )
    ckpt.save(tmp_path / "noop", noop, 0)
    with pytest.raises(ValueError, match="NoOpLossScale"):
        ckpt.restore(tmp_path / "noop", w["make_linen"]())
    # Same type, same hyperparameters: the exact state comes back.
    exact = ckpt.restore(tmp_path / "scaled", w["make_linen"]())
    assert float(exact.amp_info().loss_scale) == 512.0
    assert w["digest"](exact) == w["digest"](scaled)


@pytest.mark.standard_promotion
def test_nnx_loss_scale_mismatch(worker, tmp_path):
    """A checkpoint with or without loss scaling restored into the other, NNX."""
    _, w = worker
    model, optimizer = w["make_nnx"]()
    w["nnx_step"](model, optimizer, *w["batch"](1))  # a skip
    ckpt.save(tmp_path / "scaled", (model, optimizer), 1)
    plain_model = w["NNXMLP"](nnx.Rngs(1))
    plain_opt = nnx.Optimizer(plain_model, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(ValueError, match="target has no loss scaling"):
        ckpt.restore(tmp_path / "scaled", (plain_model, plain_opt))
    ckpt.restore(tmp_path / "scaled", (plain_model, plain_opt), on_loss_scale_mismatch="reset")
    assert w["digest"](nnx.as_pure(nnx.state(plain_model))) == w["digest"](
        nnx.as_pure(nnx.state(model))
    )
    ckpt.save(tmp_path / "plain", (plain_model, plain_opt), 0)
    target_model, target_opt = w["make_nnx"]()
    with pytest.raises(ValueError, match="saved with no loss scaling"):
        ckpt.restore(tmp_path / "plain", (target_model, target_opt))
    ckpt.restore(tmp_path / "plain", (target_model, target_opt), on_loss_scale_mismatch="reset")
    assert float(target_opt.amp_info().loss_scale) == 2.0**10
    assert w["digest"](nnx.as_pure(nnx.state(target_model))) == w["digest"](
        nnx.as_pure(nnx.state(model))
    )


def test_no_partial_loads_and_bad_arguments(tmp_path):
    state = {"w": jnp.ones((2, 3), jnp.float32), "b": jnp.zeros((3,), jnp.bfloat16)}
    ckpt.save(tmp_path, state, 0)
    restored = ckpt.restore(tmp_path, {"w": jnp.zeros((2, 3)), "b": jnp.ones((3,), jnp.bfloat16)})
    assert restored["b"].dtype == jnp.bfloat16 and float(restored["w"].sum()) == 6.0
    with pytest.raises(ValueError, match="does not match"):
        ckpt.restore(tmp_path, {"w": jnp.zeros((2, 3))})
    with pytest.raises(ValueError, match="shape"):
        ckpt.restore(tmp_path, {"w": jnp.zeros((3, 3)), "b": jnp.zeros((3,), jnp.bfloat16)})
    with pytest.raises(ValueError, match="already exists"):
        ckpt.save(tmp_path, state, 0)
    with pytest.raises(ValueError, match="step"):
        ckpt.save(tmp_path, state, -1)
    with pytest.raises(ValueError, match="no such checkpoint"):
        ckpt.restore(tmp_path, state, step=7)
    with pytest.raises(ValueError, match="on_loss_scale_mismatch"):
        ckpt.restore(tmp_path, state, on_loss_scale_mismatch="ignore")
    assert jax.tree.structure(ckpt.amp_metadata(state)) is not None


def _corrupt_json(step_dir):
    (step_dir / "amp" / "metadata").write_text("{not json")


def _wrong_json(step_dir):
    (step_dir / "amp" / "metadata").write_text('{"format": 1, "leaves": 3}')


def _truncate_data(step_dir):
    for path in (step_dir / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[:7])


def _delete_manifest(step_dir):
    for path in (step_dir / "state").rglob("manifest.ocdbt"):
        path.unlink()


@pytest.mark.parametrize(
    "corrupt, item",
    [
        (_corrupt_json, "amp"),
        (_wrong_json, "amp"),
        (_truncate_data, "state"),
        (_delete_manifest, "state"),
    ],
    ids=["bad-json", "wrong-json", "truncated-data", "no-manifest"],
)
def test_corrupted_checkpoint_is_a_value_error_naming_the_file(tmp_path, corrupt, item):
    """Damaged checkpoint files give the documented ValueError, not raw orbax errors."""
    state = {"w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)}
    ckpt.save(tmp_path, state, 3)
    corrupt(tmp_path / "3")
    with pytest.raises(ValueError, match="corrupted") as err:
        ckpt.restore(tmp_path, state)
    assert str(tmp_path / "3" / item) in str(err.value)


# --- format versions and foreign checkpoints ------------------------------------------------------


def _set_format(step_dir, value):
    record = step_dir / "amp" / "metadata"
    meta = json.loads(record.read_text())
    if value is _DROP:
        del meta["format"]
    else:
        meta["format"] = value
    record.write_text(json.dumps(meta))


_DROP = object()


@pytest.mark.parametrize(
    ("value", "found"),
    [
        (999, "says format 999"),
        ("two", "says format 'two'"),
        (True, "says format True"),
        (_DROP, "has no 'format' field"),
    ],
    ids=["999", "two", "bool", "missing"],
)
def test_unknown_format_version_is_refused_naming_it(tmp_path, value, found):
    # On main the format field was written and never read: all of these restored silently.
    state = {"w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)}
    ckpt.save(tmp_path, state, 3)
    _set_format(tmp_path / "3", value)
    with pytest.raises(ValueError, match="reads format 1 only") as err:
        ckpt.restore(tmp_path, state)
    assert found in str(err.value)
    assert str(tmp_path / "3" / "amp" / "metadata") in str(err.value)


def test_format_1_still_restores(tmp_path):
    state = {"w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)}
    ckpt.save(tmp_path, state, 3)
    _set_format(tmp_path / "3", 1)
    restored = ckpt.restore(tmp_path, jax.tree.map(jnp.zeros_like, state))
    assert bool(jnp.array_equal(restored["w"], state["w"]))


@pytest.mark.parametrize("items", [None, ("state",)], ids=["default-item", "state-only"])
def test_plain_orbax_checkpoint_is_named_not_corrupted(tmp_path, items):
    # On main a checkpoint orbax wrote without the amp item was reported as "corrupted".
    ocp = pytest.importorskip("orbax.checkpoint")
    state = {"w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)}
    if items is None:
        manager = ocp.CheckpointManager(os.fspath(tmp_path))
        manager.save(2, args=ocp.args.StandardSave(state))
    else:
        manager = ocp.CheckpointManager(os.fspath(tmp_path), item_names=items)
        manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
    manager.close()
    with pytest.raises(ValueError, match="no 'amp' item") as err:
        ckpt.restore(tmp_path, state)
    message = str(err.value)
    assert "corrupted" not in message
    expected = "default" if items is None else "state"
    assert f"the items ['{expected}']" in message
    assert "'state' (the arrays) and 'amp'" in message
