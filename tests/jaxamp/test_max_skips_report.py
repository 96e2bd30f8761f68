"""`loss_scaled(max_consecutive_skips=M)` reports a run that overflows forever, once,
at the step that reaches M, eagerly, under `jit` and under `jit` with a donated state, on every
platform: eagerly the call reports; under `jit` a host callback inside the step reports before the
step's outputs are ready."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp

PARAMS = {"w": jnp.ones(3)}
NAN = {"w": jnp.array([jnp.nan, 1.0, 1.0])}
FINITE = {"w": jnp.ones(3)}
MESSAGE = "consecutive steps had non-finite"


def _cpu_backend() -> bool:
    try:
        jax.devices("cpu")
    except RuntimeError:
        return False
    return True


def _stepper(tx, mode):
    """The step in `mode`. Where this process has no CPU backend (``JAX_PLATFORMS=cuda``) a
    jitted step with a report cannot call back: check that it refuses, then skip."""
    if mode == "eager":
        return tx.update
    step = jax.jit(tx.update, donate_argnums=(1,) if mode == "jit_donated" else ())
    if not _cpu_backend():
        with pytest.raises(RuntimeError, match="JAX_PLATFORMS"):
            step(NAN, tx.init(PARAMS), PARAMS)
        pytest.skip("no CPU backend here (JAX_PLATFORMS leaves cpu out): refused, as it must")
    return step


MODES = ["eager", "jit", "jit_donated"]


def _warnings_per_step(step, state, grads_seq):
    """Runs the steps; for each, the report warnings issued by the time its outputs are ready."""
    counts = []
    for grads in grads_seq:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, state = step(grads, state, PARAMS)
            jax.block_until_ready(state)
        counts.append(sum(MESSAGE in str(w.message) for w in caught))
    return counts, state


@pytest.mark.parametrize("mode", MODES)
def test_warns_once_at_the_step_that_reaches_the_limit(mode):
    tx = jaxamp.loss_scaled(optax.sgd(0.1), max_consecutive_skips=2)
    step = _stepper(tx, mode)
    # Two skips: the report; a third: none (it came once); a finite step resets; two more: again.
    counts, state = _warnings_per_step(step, tx.init(PARAMS), [NAN, NAN, NAN, FINITE, NAN, NAN])
    assert counts == [0, 1, 0, 0, 0, 1]
    assert int(jaxamp.amp_info(state).consecutive_skips) == 2


@pytest.mark.parametrize("mode", MODES)
def test_raise_fails_the_step_that_reaches_the_limit(mode):
    tx = jaxamp.loss_scaled(optax.sgd(0.1), max_consecutive_skips=2, on_max_skips="raise")
    step = _stepper(tx, mode)
    _, state = step(NAN, tx.init(PARAMS), PARAMS)
    jax.block_until_ready(state)  # one skip: below the limit, nothing raised
    if mode == "eager":
        with pytest.raises(jaxamp.LossScaleDivergedError, match=f"2 {MESSAGE}"):
            step(NAN, state, PARAMS)
        return
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"2 {MESSAGE}"):
        _, state = step(NAN, state, PARAMS)
        jax.block_until_ready(state)


def test_ignore_and_no_limit_add_no_callback():
    for tx in (
        jaxamp.loss_scaled(optax.sgd(0.1), max_consecutive_skips=2, on_max_skips="ignore"),
        jaxamp.loss_scaled(optax.sgd(0.1)),
    ):
        jaxpr = jax.make_jaxpr(tx.update)(NAN, tx.init(PARAMS), PARAMS)
        assert "callback" not in str(jaxpr)
    tx = jaxamp.loss_scaled(optax.sgd(0.1), max_consecutive_skips=2)
    assert "debug_callback" in str(jax.make_jaxpr(tx.update)(NAN, tx.init(PARAMS), PARAMS))


def test_without_a_cpu_backend_eager_reports_and_jit_refuses(monkeypatch):
    """JAX runs host callbacks on its CPU backend: with ``JAX_PLATFORMS=cuda`` there is none,
    and the callback failed instead of reporting. Eagerly no callback is needed; a jitted step
    refuses to trace, naming the fix."""
    devices = jax.devices

    def no_cpu(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu")
        return devices(backend)

    monkeypatch.setattr(jax, "devices", no_cpu)
    tx = jaxamp.loss_scaled(optax.sgd(0.1), max_consecutive_skips=1)
    with pytest.warns(RuntimeWarning, match=f"1 {MESSAGE}"):
        tx.update(NAN, tx.init(PARAMS), PARAMS)
    with pytest.raises(RuntimeError, match="JAX_PLATFORMS=cuda,cpu.*on_max_skips='ignore'"):
        jax.jit(tx.update)(NAN, tx.init(PARAMS), PARAMS)
