"""The jaxamp trainer: the JAX twin of `parity.train_torch`, one run record out.

Precisions:

- ``fp32``: no casts; the step is traced under ``jax.default_matmul_precision("highest")``.
- ``bf16-mixed`` / ``fp16-mixed``: float32 params; the forward pass runs under
  ``jaxamp.autocast(dtype, device=<torch device type>)`` (torch's per-op rules for the device the
  torch side runs on) when jaxamp has it, else under the jaxamp policy (every floating input and
  param cast to the compute dtype) — `mixed_value_and_grad` is the one place that chooses.
  fp16 adds ``jaxamp.loss_scaled`` with the torch preset of `DynamicLossScale`, so both sides move
  the scale identically.
- ``bf16-true``: params (and batch statistics) cast to bfloat16 once, inputs too, as
  ``model.to(torch.bfloat16)`` does.

Optimizer: ``optax.adamw`` or momentum SGD (``add_decayed_weights`` then ``optax.sgd``: torch's
L2-style ``weight_decay``), after torch-exact global-norm clipping, wrapped in
``optax.inject_hyperparams`` so the host-computed learning rate of each iteration is fed in (the
other hyperparameters stay static Python floats: as float32 arrays they would promote bf16-true
optimizer state to float32).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from parity import fp8 as parity_fp8
from parity import measure
from parity.config import RunConfig, torch_device_type
from parity.hardware import UnsupportedHere, unsupported_reason
from parity.records import build_run_record

__all__ = ["build_jax_optimizer", "clip_by_global_norm_torch", "mixed_value_and_grad", "train_jax"]

# Switch: op-level autocast (torch's per-device op lists) when jaxamp provides it.
USE_AUTOCAST = True


def autocast_available() -> bool:
    """Whether the installed jaxamp has `autocast` (and the trainer will use it)."""
    return USE_AUTOCAST and hasattr(jaxamp, "autocast")


def mixed_value_and_grad(loss_fn, config: RunConfig, use_autocast: bool | None = None):
    """`jaxamp.value_and_grad` for the run's precision: the one place that picks autocast or policy.

    `loss_fn(params, inputs, targets, *, batch_stats) -> (loss, new_batch_stats)`. The returned
    function takes the same arguments plus ``loss_scale``. `use_autocast` defaults to
    `autocast_available()`.
    """
    if use_autocast is None:
        use_autocast = autocast_available()
    if not config.mixed:
        return jaxamp.value_and_grad(loss_fn, has_aux=True)
    if use_autocast:
        # loss_fn was built with `autocast_forward`: the forward pass is autocast, the loss is
        # float32 (torch's cross_entropy is on its float32 list).
        return jaxamp.value_and_grad(loss_fn, has_aux=True)
    return jaxamp.value_and_grad(loss_fn, policy=config.policy, has_aux=True)


def autocast_forward(forward, config: RunConfig, use_autocast: bool | None = None):
    """`forward` under `jaxamp.autocast` for a mixed run with autocast; else `forward` itself.

    Only the model's forward pass is wrapped, not the loss: the loss casts the logits to float32
    and torch computes cross-entropy in float32 under autocast on every device.
    """
    if use_autocast is None:
        use_autocast = autocast_available()
    if config.mixed and use_autocast:
        return jaxamp.autocast(
            forward,
            dtype=config.policy.compute_dtype,
            device=torch_device_type(config.device),
        )
    return forward


def mixed_method(config: RunConfig, use_autocast: bool | None = None) -> str:
    """How the JAX side realises the precision (logged in the run record)."""
    if use_autocast is None:
        use_autocast = autocast_available()
    if not config.mixed:
        if config.param_dtype != "float32":
            return f"{config.param_dtype} params and inputs"
        return "float32"
    if use_autocast:
        return f"jaxamp.autocast(device={torch_device_type(config.device)!r})"
    return f"jaxamp policy {config.policy}"


class ClipState(NamedTuple):
    """Stateless."""


def clip_by_global_norm_torch(max_norm: float) -> optax.GradientTransformation:
    """Global-norm clipping with torch's exact formula.

    ``torch.nn.utils.clip_grad_norm_`` multiplies by ``min(max_norm / (norm + 1e-6), 1)``;
    ``optax.clip_by_global_norm`` has no 1e-6, which would move fp32 runs apart by ~1e-6 per step.
    """

    def init(params):
        del params
        return ClipState()

    def update(updates, state, params=None):
        del params
        leaves = jax.tree_util.tree_leaves(updates)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))
        coef = jnp.minimum(jnp.float32(max_norm) / (norm + jnp.float32(1e-6)), jnp.float32(1.0))
        return jax.tree_util.tree_map(lambda x: (x * coef).astype(x.dtype), updates), state

    return optax.GradientTransformation(init, update)


def _sgd(learning_rate, momentum, weight_decay):
    # torch.optim.SGD's weight_decay is L2 added to the gradient before momentum.
    return optax.chain(
        optax.add_decayed_weights(weight_decay),
        optax.sgd(learning_rate, momentum=momentum),
    )


def build_jax_optimizer(config: RunConfig) -> optax.GradientTransformation:
    """The optax twin of `train_torch.build_torch_optimizer`, with clipping and loss scaling."""
    if config.optimizer == "adamw":
        inner = optax.inject_hyperparams(
            optax.adamw,
            static_args=("b1", "b2", "eps", "weight_decay"),
            hyperparam_dtype=jnp.float32,
        )(
            learning_rate=config.lr,
            b1=config.betas[0],
            b2=config.betas[1],
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    else:
        inner = optax.inject_hyperparams(
            _sgd, static_args=("momentum", "weight_decay"), hyperparam_dtype=jnp.float32
        )(learning_rate=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    if config.clip_norm is not None:
        inner = optax.chain(clip_by_global_norm_torch(config.clip_norm), inner)
    if config.loss_scaling:
        loss_scale = jaxamp.DynamicLossScale.from_preset(
            "torch", init_scale=config.init_scale, growth_interval=config.growth_interval
        )
        return jaxamp.loss_scaled(inner, loss_scale)
    return inner


def _is_inject_state(x) -> bool:
    return isinstance(x, optax.InjectStatefulHyperparamsState | optax.InjectHyperparamsState)


def set_learning_rate(opt_state, learning_rate):
    """`opt_state` with the injected learning rate replaced (in-graph; no retrace)."""

    def replace(x):
        if _is_inject_state(x):
            hyper = dict(x.hyperparams)
            hyper["learning_rate"] = jnp.asarray(learning_rate, jnp.float32)
            return x._replace(hyperparams=hyper)
        return x

    return jax.tree_util.tree_map(replace, opt_state, is_leaf=_is_inject_state)


def _jax_device(device: str):
    platform = "gpu" if device == "gpu" else "cpu"
    try:
        return jax.devices(platform)[0]
    except RuntimeError as e:
        raise ValueError(
            f"train_jax: config.device={device!r} but JAX has no {platform} backend."
        ) from e


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
    from parity.models import loss_jax

    if stream is None:
        stream = pair.make_data(config.stream_seed, config.batch_size)
    reason = unsupported_reason("jax", config.policy, config.model, config.device)
    if reason is not None:  # no GPU backend: recorded as unsupported here, not failed
        raise UnsupportedHere(reason)
    device = _jax_device(config.device)
    if variables is None:
        variables = pair.torch_to_flax()
    variables = dict(variables)
    params = variables["params"]
    batch_stats = variables.get("batch_stats")
    input_dtype = None
    if config.param_dtype != "float32":  # bf16-true: params, statistics and inputs cast once
        input_dtype = config.policy.param_dtype
        params = jaxamp.cast_floating(params, input_dtype)
        batch_stats = jaxamp.cast_floating(batch_stats, input_dtype)
    params, batch_stats = jax.device_put((params, batch_stats), device)
    tx = build_jax_optimizer(config)
    opt_state = jax.jit(tx.init)(params)
    task = pair.task

    def make_train_step(use_autocast):
        def forward(params, inputs, batch_stats):
            full = {"params": params}
            if batch_stats is not None:
                full["batch_stats"] = batch_stats
            return pair.flax_apply(full, inputs, train=True)

        forward = autocast_forward(forward, config, use_autocast)
        if parity_fp8.is_fp8(config.precision):  # linear layers in fp8 (see parity.fp8)
            forward = parity_fp8.wrap_jax_forward(forward, config.precision, config.device)

        def loss_fn(params, inputs, targets, *, batch_stats):
            logits, new_stats = forward(params, inputs, batch_stats)
            return loss_jax(task, logits.astype(jnp.float32), targets), new_stats

        grad_fn = mixed_value_and_grad(loss_fn, config, use_autocast)
        return functools.partial(train_step, grad_fn)

    def train_step(grad_fn, params, batch_stats, opt_state, inputs, targets, learning_rate):
        opt_state = set_learning_rate(opt_state, learning_rate)
        if config.loss_scaling:
            scale_used = jaxamp.get_loss_scale(opt_state).loss_scale
        else:
            scale_used = jnp.float32(jnp.nan)
        (loss, new_stats), grads = grad_fn(
            params,
            inputs,
            targets,
            batch_stats=batch_stats,
            loss_scale=opt_state if config.loss_scaling else None,
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if config.loss_scaling:
            skipped = jnp.logical_not(jaxamp.amp_info(opt_state).last_step_finite)
        else:
            skipped = jnp.bool_(False)
        if new_stats is not None:
            # Keep the carried statistics' dtype (mixed precision may return them as float32).
            batch_stats = jax.tree_util.tree_map(
                lambda n, o: n.astype(o.dtype), new_stats, batch_stats
            )
        metrics = {
            "loss": loss,
            "loss_scale": jnp.asarray(scale_used, jnp.float32),
            "skipped": skipped,
        }
        return params, batch_stats, opt_state, metrics

    def host_batch(step):
        raw_inputs, raw_targets = stream.batch(step)
        inputs = jnp.asarray(raw_inputs)
        if input_dtype is not None and jnp.issubdtype(inputs.dtype, jnp.floating):
            inputs = inputs.astype(input_dtype)
        return jax.device_put((inputs, jnp.asarray(raw_targets)), device)

    inputs, targets = host_batch(0)
    lr0 = jnp.float32(config.lr_at(0))
    use_autocast = config.mixed and autocast_available()
    fallback_reason = None
    with jax.default_matmul_precision("highest"):
        start = measure.now()
        try:
            compiled = (
                jax.jit(make_train_step(use_autocast), donate_argnums=(0, 1, 2))
                .lower(params, batch_stats, opt_state, inputs, targets, lr0)
                .compile()
            )
        except Exception as e:
            if not use_autocast:
                raise
            # Keep the comparison running with policy casting; the record says why.
            fallback_reason = f"jaxamp.autocast failed ({type(e).__name__}: {str(e)[:200]})"
            use_autocast = False
            start = measure.now()
            compiled = (
                jax.jit(make_train_step(False), donate_argnums=(0, 1, 2))
                .lower(params, batch_stats, opt_state, inputs, targets, lr0)
                .compile()
            )
        compile_time = measure.now() - start

    log = measure.StepLog()
    iterator = range(config.steps)
    if progress:
        from parity.progress import progress as progress_lines

        iterator = progress_lines(iterator, f"jax {config.model} {config.precision}")
    for step in iterator:
        inputs, targets = host_batch(step)
        learning_rate = jnp.float32(config.lr_at(step))
        jax.block_until_ready((inputs, targets, learning_rate))
        start = measure.now()
        params, batch_stats, opt_state, metrics = compiled(
            params, batch_stats, opt_state, inputs, targets, learning_rate
        )
        jax.block_until_ready((params, opt_state, metrics))
        elapsed = measure.now() - start
        loss_scale = float(metrics["loss_scale"]) if config.loss_scaling else None
        if log.record(step, float(metrics["loss"]), loss_scale, bool(metrics["skipped"]), elapsed):
            break

    eval_metric = None
    if config.eval and log.stopped_reason is None:
        eval_metric = _evaluate(
            config, pair, stream, params, batch_stats, input_dtype, device, use_autocast
        )

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
        extra={
            "mixed_precision_method": (
                parity_fp8.fp8_method(config.precision, "jax", config.device)
                if parity_fp8.is_fp8(config.precision)
                else mixed_method(config, use_autocast)
            ),
            "autocast_fallback_reason": fallback_reason,
        },
        memory_detail=memory_detail,
    )


def _evaluate(
    config, pair, stream, params, batch_stats, input_dtype, device, use_autocast
) -> float:
    from parity.models import eval_metric_jax

    task = pair.task

    def logits_fn(params, inputs, *, batch_stats):
        full = {"params": params}
        if batch_stats is not None:
            full["batch_stats"] = batch_stats
        logits, _ = pair.flax_apply(full, inputs, train=False)
        return logits

    if parity_fp8.is_fp8(config.precision):
        logits_fn = parity_fp8.wrap_jax_forward(logits_fn, config.precision, config.device)
    elif config.mixed and use_autocast:
        logits_fn = autocast_forward(logits_fn, config, use_autocast)
    elif config.mixed:
        policy = config.policy
        inner = logits_fn

        def logits_fn(params, inputs, *, batch_stats):
            return inner(
                policy.cast_to_compute(params),
                policy.cast_to_compute(inputs),
                batch_stats=batch_stats,
            )

    @jax.jit
    def metric(params, batch_stats, inputs, targets):
        logits = logits_fn(params, inputs, batch_stats=batch_stats)
        return eval_metric_jax(task, logits.astype(jnp.float32), targets)

    values = []
    with jax.default_matmul_precision("highest"):
        for raw_inputs, raw_targets in stream.eval_batches():
            inputs = jnp.asarray(raw_inputs)
            if input_dtype is not None and jnp.issubdtype(inputs.dtype, jnp.floating):
                inputs = inputs.astype(input_dtype)
            inputs, targets = jax.device_put((inputs, jnp.asarray(raw_targets)), device)
            values.append(float(metric(params, batch_stats, inputs, targets)))
    return float(np.mean(values))
