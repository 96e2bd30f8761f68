"""Save mid-run with orbax, restore in a fresh process, continue bit-identically."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

# The training script runs twice: uninterrupted here, and resumed in a fresh interpreter.
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import orbax.checkpoint as ocp
    import jaxamp

    mode, ckpt_dir, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    TOTAL, SAVE_AT = 10, 4
    POISON = {2, 6, 7}  # overflowing steps before and after the checkpoint

    def loss_fn(params, x):
        return jnp.mean((x @ params["w"] + params["b"]) ** 2)

    tx = jaxamp.loss_scaled(
        optax.adamw(1e-2), jaxamp.DynamicLossScale.create(init_scale=2.0**8, growth_interval=2)
    )

    @jax.jit
    def step(params, opt_state, x, poison):
        loss, grads = jaxamp.value_and_grad(loss_fn, policy="bf16-mixed")(
            params, x, loss_scale=opt_state)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def batch(i):
        return jnp.asarray(np.random.default_rng(i).normal(size=(8, 4)), jnp.float32)

    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    opt_state = tx.init(params)
    checkpointer = ocp.StandardCheckpointer()
    start = 0
    if mode == "resume":
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, (params, opt_state))
        params, opt_state = checkpointer.restore(ckpt_dir, target)
        start = SAVE_AT
    log = []
    for i in range(start, TOTAL):
        if mode == "save" and i == SAVE_AT:
            checkpointer.save(ckpt_dir, (params, opt_state))
            checkpointer.wait_until_finished()
        params, opt_state, loss = step(params, opt_state, batch(i), jnp.array(i in POISON))
        info = jaxamp.amp_info(opt_state)
        log.append({"step": i, "loss": float(loss), "scale": float(info.loss_scale),
                    "applied": bool(info.last_step_applied)})
    np.savez(out_path + ".npz", **{k: np.asarray(v) for k, v in params.items()})
    with open(out_path, "w") as f:
        json.dump(log, f)
    """
)


def _run(tmp_path, mode, ckpt_dir, out):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one device, as a user's fresh process would have
    result = subprocess.run(
        [sys.executable, str(script), mode, str(ckpt_dir), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out) as f:
        log = json.load(f)
    return log, dict(np.load(str(out) + ".npz"))


@pytest.mark.integration
def test_resume_in_fresh_process_is_bit_identical(tmp_path):
    ckpt = tmp_path / "ckpt"
    full_log, full_params = _run(tmp_path, "save", ckpt, tmp_path / "full.json")
    resumed_log, resumed_params = _run(tmp_path, "resume", ckpt, tmp_path / "resumed.json")
    tail = [r for r in full_log if r["step"] >= 4]
    assert resumed_log == tail  # losses, scales and skip decisions, exactly
    assert [r["applied"] for r in full_log] == [i not in {2, 6, 7} for i in range(10)]
    for name in full_params:
        np.testing.assert_array_equal(resumed_params[name], full_params[name])
