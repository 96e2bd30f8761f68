"""The jaxamp trainer: the JAX twin of `parity.training.train_torch`, one run record out.

The precision is the run's recipe (`parity.core.recipes`): it wraps the forward pass
(``jaxamp.autocast`` with torch's per-op rules for the torch side's device, ``jaxamp.fp8``),
casts params, statistics and inputs (bf16-true), makes the gradient function and wraps the
optimizer (``jaxamp.loss_scaled``; the torch preset of `DynamicLossScale` for fp16, so both
sides move the scale identically). The step is the README's (`parity.training.steps`), traced
once under ``jax.default_matmul_precision("highest")``. A recipe that fails to compile fails
the run: nothing falls back to another way of casting.

Optimizer: ``optax.adamw`` or momentum SGD after torch-exact global-norm clipping, with the
host-computed learning rate of each iteration fed in (`parity.training.steps`).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from parity.core.config import RunConfig
from parity.core.eval_logits import eval_logit_point
from parity.core.hardware import UnsupportedHere, unsupported_reason
from parity.core.losses import eval_metric_jax, loss_jax
from parity.core.progress import progress as progress_lines
from parity.core.records import build_run_record
from parity.perf import measure
from parity.perf.phases import phase
from parity.training.steps import (
    build_jax_optimizer,
    jax_forward,
    observed_step,
    step_signals,
)
from parity.training.user_loop import loop_optimizer

__all__ = ["JaxStep", "build_jax_step", "train_jax"]


def _jax_device(device: str):
    platform = "gpu" if device == "gpu" else "cpu"
    try:
        return jax.devices(platform)[0]
    except RuntimeError as e:
        raise ValueError(
            f"train_jax: config.device={device!r} but JAX has no {platform} backend."
        ) from e


class JaxStep(NamedTuple):
    """The JAX side of a run, built and compiled once (`build_jax_step`); the trainer and the
    alternating-block timing (`parity.training.blocks`) both step it."""

    # compiled(params, batch_stats, opt_state, inputs, targets, learning_rate)
    #   -> (params, batch_stats, opt_state, metrics); buffers donated
    compiled: Any
    params: Any
    batch_stats: Any
    opt_state: Any
    host_batch: Callable  # host_batch(index) -> (inputs, targets) on the device
    compile_time_s: float | None  # None: an executable compiled earlier was reused
    device: Any


# The last executable compiled for each live pair (by id; the entry goes when the pair does),
# with all else the program depends on: the alternating-block timing after a run reuses it.
_COMPILED: dict[int, tuple] = {}


def _remember(pair: Any, key: tuple, compiled: Any) -> None:
    if id(pair) not in _COMPILED:
        try:
            weakref.finalize(pair, _COMPILED.pop, id(pair), None)
        except TypeError:  # a pair that cannot be weakly referenced: nothing kept
            return
    _COMPILED[id(pair)] = (key, compiled)


def _program_key(config: RunConfig, device: Any, args: tuple) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return (
        json.dumps(config.to_dict(), sort_keys=True, default=str),
        str(device),
        str(treedef),
        tuple((tuple(x.shape), str(x.dtype)) for x in leaves),
    )


def build_jax_step(
    config: RunConfig,
    pair: Any,
    stream: Any,
    variables: dict | None = None,
    *,
    reuse_compiled: bool = False,
) -> JaxStep:
    """The recipe's JAX state (params, statistics, optimizer state) and compiled train step.

    Args:
      config: the run's configuration.
      pair: a `parity.models.ModelPair`.
      stream: the batches (the step is compiled for batch 0's shapes).
      variables: initial Flax variables (default: ``pair.torch_to_flax()``).
      reuse_compiled: take the executable the last build for this pair compiled for the same
        configuration and shapes, if any (``compile_time_s`` is then None); the trainer always
        compiles (its compile time is a figure).

    Raises:
      UnsupportedHere: no backend for ``config.device``.
    """
    reason = unsupported_reason("jax", config.policy, config.model, config.device)
    if reason is not None:  # no GPU backend: recorded as unsupported here, not failed
        raise UnsupportedHere(reason)
    recipe = config.recipe
    recipe.check_arm("single")
    device = _jax_device(config.device)
    if variables is None:
        variables = pair.torch_to_flax()
    variables = dict(variables)
    params = recipe.jax_cast(variables["params"])
    batch_stats = recipe.jax_cast(variables.get("batch_stats"))
    params, batch_stats = jax.device_put((params, batch_stats), device)
    loop = getattr(pair, "loop", None)
    own_optimizer = loop is not None and loop.jax_optimizer is not None
    if own_optimizer:
        tx = loop_optimizer(loop, config, params, pair=pair)
    else:
        tx = build_jax_optimizer(config, pair=pair)
    opt_state = jax.jit(tx.init)(params)
    task = pair.task
    user_loss = loop.jax_loss if loop is not None else None
    forward = jax_forward(pair, recipe, config.device, train=True)

    def loss_fn(params, inputs, targets, batch_stats):
        logits, new_stats = forward(params, batch_stats, inputs)
        if user_loss is not None:
            return user_loss(logits, targets).astype(jnp.float32), new_stats
        return loss_jax(task, logits.astype(jnp.float32), targets), new_stats

    step = observed_step(
        recipe.jax_value_and_grad(loss_fn),
        tx,
        feed_lr=not own_optimizer,
        max_scaled_grad=recipe.loss_scaling,
    )

    def train_step(params, batch_stats, opt_state, inputs, targets, learning_rate):
        params, opt_state, (loss, new_stats), metrics = step(
            params, opt_state, learning_rate, inputs, targets, batch_stats
        )
        if new_stats is not None:
            # Keep the carried statistics' dtype (mixed precision may return them as float32).
            batch_stats = jax.tree_util.tree_map(
                lambda n, o: n.astype(o.dtype), new_stats, batch_stats
            )
        return params, batch_stats, opt_state, {"loss": loss, **metrics}

    def host_batch(step):
        raw_inputs, raw_targets = stream.batch(step)
        inputs = recipe.jax_cast(jnp.asarray(raw_inputs))
        return jax.device_put((inputs, jnp.asarray(raw_targets)), device)

    inputs, targets = host_batch(0)
    lr0 = jnp.float32(config.lr_at(0))
    args = (params, batch_stats, opt_state, inputs, targets, lr0)
    key = _program_key(config, device, args)
    cached = _COMPILED.get(id(pair))
    if reuse_compiled and cached is not None and cached[0] == key:
        return JaxStep(cached[1], params, batch_stats, opt_state, host_batch, None, device)
    with jax.default_matmul_precision("highest"), phase("compile"):
        start = measure.now()
        compiled = jax.jit(train_step, donate_argnums=(0, 1, 2)).lower(*args).compile()
        compile_time = measure.now() - start
    _remember(pair, key, compiled)
    return JaxStep(compiled, params, batch_stats, opt_state, host_batch, compile_time, device)


def train_jax(
    config: RunConfig,
    pair: Any,
    stream: Any = None,
    *,
    variables: dict | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Trains the Flax twin from the torch model's initial weights and returns a run record.

    Args:
      config: the run's configuration (the same object the torch side gets).
      pair: a `parity.models.ModelPair`.
      stream: a `BatchStream` (default: ``pair.make_data(config.stream_seed, config.batch_size)``).
      variables: initial Flax variables (default: ``pair.torch_to_flax()``, converted from the
        torch model's initial weights).
      progress: report progress (a bar on a terminal, a plain line every 30 s elsewhere).
    """
    if stream is None:
        stream = pair.make_data(config.stream_seed, config.batch_size)
    side = build_jax_step(config, pair, stream, variables)
    compiled, host_batch, device = side.compiled, side.host_batch, side.device
    params, batch_stats, opt_state = side.params, side.batch_stats, side.opt_state
    compile_time = side.compile_time_s
    recipe = config.recipe
    # Evaluation compiled once; a language model's eval logits at the initial weights (before
    # step 0 donates them) and after training: `parity.verdicts.logits` compares them with torch's.
    with phase("eval"):
        evaluation = _Evaluation(config, pair, stream, device) if config.eval else None
        if evaluation is not None:
            evaluation.capture_logits(0, params, batch_stats)

    log = measure.StepLog()
    iterator = range(config.steps)
    if progress:
        iterator = progress_lines(iterator, f"jax {config.model} {config.precision}")
    with phase("steps"):
        for step_index in iterator:
            inputs, targets = host_batch(step_index)
            learning_rate = jnp.float32(config.lr_at(step_index))
            jax.block_until_ready((inputs, targets, learning_rate))
            start = measure.now()
            params, batch_stats, opt_state, metrics = compiled(
                params, batch_stats, opt_state, inputs, targets, learning_rate
            )
            jax.block_until_ready((params, opt_state, metrics))
            elapsed = measure.now() - start
            loss_scale = recipe.logged_scale(metrics["loss_scale"])
            stop = log.record(
                step_index, float(metrics["loss"]), loss_scale, bool(metrics["skipped"]), elapsed
            )
            log.steps[-1].update(step_signals(metrics, scaled=loss_scale is not None))
            if stop:
                break

    eval_metric = None
    if config.eval and log.stopped_reason is None:
        with phase("eval"):
            eval_metric = evaluation.evaluate(len(log.steps), params, batch_stats)

    memory_detail = None
    if config.device == "gpu":
        peak_memory = measure.jax_gpu_peak_memory(device)
        memory_method = "jax_gpu_peak_bytes_in_use"
        # The allocator's peak is process-wide (JAX cannot reset it): keep XLA's per-step plan too.
        memory_detail = measure.jax_cpu_memory(compiled)
    else:
        memory_detail = measure.jax_cpu_memory(compiled)
        peak_memory = memory_detail["peak_bytes"] if memory_detail else None
        memory_method = "xla_memory_analysis"
    timing = measure.step_time_summary(log.times, config.timing_warmup)
    optimizer_state = measure.jax_optimizer_state(opt_state, params)
    return build_run_record(
        framework="jax",
        config=config,
        pair=pair,
        stream=stream,
        steps_log=log.steps,
        timing=timing,
        compile_time_s=compile_time,
        compile_method="jax.jit(...).lower(...).compile() wall time",
        peak_memory=peak_memory,
        memory_method=memory_method,
        eval_metric=eval_metric,
        stopped_reason=log.stopped_reason,
        extra={"mixed_precision_method": config.recipe.jax_method(config.device)},
        memory_detail=memory_detail,
        optimizer_state=optimizer_state,
        eval_logits=evaluation.logit_points if evaluation is not None else None,
    )


class _Evaluation:
    """The held-out metric and, for a language model, the eval logits the record keeps
    (`parity.core.eval_logits.eval_logit_point` of the first eval batch): one compiled
    eval-mode forward at the run's precision returns both."""

    def __init__(self, config, pair, stream, device):
        recipe = config.recipe
        forward = jax_forward(pair, recipe, config.device, train=False)
        self.task = pair.task
        self.logit_points: list[dict[str, Any]] = []

        @jax.jit
        def metric_and_logits(params, batch_stats, inputs, targets):
            logits = forward(params, batch_stats, inputs)[0].astype(jnp.float32)
            return eval_metric_jax(pair.task, logits, targets), logits

        self.run = metric_and_logits
        self.raw = stream.eval_batches()
        self.batches = [
            jax.device_put((recipe.jax_cast(jnp.asarray(x)), jnp.asarray(y)), device)
            for x, y in self.raw
        ]

    def capture_logits(self, step, params, batch_stats, logits=None) -> None:
        """Records the first eval batch's logits after `step` updates (language models only)."""
        if self.task != "lm":
            return
        if logits is None:
            with jax.default_matmul_precision("highest"):
                _, logits = self.run(params, batch_stats, *self.batches[0])
        self.logit_points.append(eval_logit_point(step, np.asarray(logits), self.raw[0][0]))

    def evaluate(self, step, params, batch_stats) -> float:
        """The mean metric over the eval batches; the logits of the first are captured."""
        values = []
        with jax.default_matmul_precision("highest"):
            for index, (inputs, targets) in enumerate(self.batches):
                metric, logits = self.run(params, batch_stats, inputs, targets)
                values.append(float(metric))
                if index == 0:
                    self.capture_logits(step, params, batch_stats, logits)
        return float(np.mean(values))
