"""The torch.amp trainer: autocast + GradScaler, eager or torch.compile, one run record out.

Precisions, as torch users write them:

- ``fp32``: no autocast; ``torch.set_float32_matmul_precision("highest")`` (and TF32 off on CUDA).
- ``bf16-mixed`` / ``fp16-mixed``: ``torch.autocast(device_type, dtype)`` around forward and loss;
  fp16 adds ``torch.amp.GradScaler(device_type)`` (on CPU ``GradScaler("cpu")``: the default
  ``"cuda"`` silently disables itself there). Clipping follows ``scaler.unscale_``.
- ``bf16-true``: the model is cast to bfloat16 (``model.to(torch.bfloat16)``), inputs too; the
  optimizer then keeps bfloat16 state, as in a pure-bf16 torch script.

The learning rate of every iteration is `RunConfig.lr_at(step)`, written into the param groups
before the step (what ``LambdaLR`` does, without its warning when GradScaler skips step 0).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from parity import measure
from parity.config import RunConfig

__all__ = ["build_error_record", "build_run_record", "build_torch_optimizer", "train_torch"]

_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
# A run whose loss stays non-finite this many steps in a row is stopped and reported diverged.


def torch_device_type(device: str) -> str:
    """torch's device type for a harness device name (``"gpu"`` is CUDA)."""
    return "cuda" if device == "gpu" else "cpu"


def build_torch_optimizer(config: RunConfig, params) -> torch.optim.Optimizer:
    """AdamW or momentum SGD with the run's hyperparameters (foreach off: one code path)."""
    params = list(params)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    return torch.optim.SGD(
        params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )


def _to_device(array: np.ndarray, device: torch.device, float_dtype: torch.dtype | None):
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(device)
    if float_dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(float_dtype)
    return tensor


def train_torch(
    config: RunConfig,
    pair: Any,
    stream: Any = None,
    *,
    progress: bool = False,
) -> dict[str, Any]:
    """Trains `pair.torch_model` (a copy; the pair keeps its initial weights) and returns a run.

    Args:
      config: the run's configuration.
      pair: a `parity.models.ModelPair` (torch model, forward, loss task).
      stream: a `BatchStream` (default: ``pair.make_data(config.seed, config.batch_size)``).
      progress: show a tqdm progress bar.

    Returns:
      A run record as in DESIGN.md (framework ``"torch"``; ``torch_compile`` in the config).
    """
    from parity.models import eval_metric_torch, loss_torch

    if stream is None:
        stream = pair.make_data(config.seed, config.batch_size)
    device_type = torch_device_type(config.device)
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("train_torch: config.device='gpu' but torch sees no CUDA device.")
    device = torch.device(device_type)
    # The fp32 baseline at full precision; TF32 would make torch fp32 matmuls approximate.
    torch.set_float32_matmul_precision("highest")
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    model = copy.deepcopy(pair.torch_model).to(device)
    input_dtype = None
    if config.precision == "bf16-true":
        model = model.to(torch.bfloat16)
        input_dtype = torch.bfloat16
    optimizer = build_torch_optimizer(config, model.parameters())
    scaler = None
    if config.loss_scaling:
        scaler = torch.amp.GradScaler(
            device_type, init_scale=config.init_scale, growth_interval=config.growth_interval
        )
    forward_model = torch.compile(model) if config.torch_compile else model
    autocast_dtype = _AUTOCAST_DTYPES.get(config.precision)
    params = [p for p in model.parameters() if p.requires_grad]

    def forward_loss(inputs, targets, train):
        with torch.autocast(
            device_type, dtype=autocast_dtype or torch.float32, enabled=config.mixed
        ):
            logits = pair.torch_forward(forward_model, inputs, train=train)
            return logits, loss_torch(pair.task, logits, targets)

    def train_step(step, inputs, targets):
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        _, loss = forward_loss(inputs, targets, train=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # clip the true gradients
            if config.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, config.clip_norm)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if config.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, config.clip_norm)
            optimizer.step()
        return loss

    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    log = measure.StepLog()
    scale = float(scaler.get_scale()) if scaler is not None else None
    iterator = range(config.steps)
    if progress:
        from tqdm import tqdm

        label = (
            f"torch{'-compile' if config.torch_compile else ''} {config.model} {config.precision}"
        )
        iterator = tqdm(iterator, desc=label, leave=False)
    for step in iterator:
        raw_inputs, raw_targets = stream.batch(step)
        inputs = _to_device(raw_inputs, device, input_dtype)
        targets = _to_device(raw_targets, device, None)
        measure.torch_sync(config.device)
        start = measure.now()
        loss = train_step(step, inputs, targets)
        loss_value = float(loss.item())  # a device sync: the step is done
        measure.torch_sync(config.device)
        elapsed = measure.now() - start
        skipped = False
        scale_used = scale
        if scaler is not None:
            # GradScaler backs off exactly when it skipped the optimizer step.
            scale = float(scaler.get_scale())
            skipped = scale < scale_used
        if log.record(step, loss_value, scale_used, skipped, elapsed):
            break

    eval_metric = None
    if config.eval and log.stopped_reason is None:
        values = []
        with torch.no_grad():
            for raw_inputs, raw_targets in stream.eval_batches():
                inputs = _to_device(raw_inputs, device, input_dtype)
                targets = _to_device(raw_targets, device, None)
                logits, _ = forward_loss(inputs, targets, train=False)
                values.append(float(eval_metric_torch(pair.task, logits.float(), targets)))
        eval_metric = float(np.mean(values))

    if device_type == "cuda":
        peak_memory = measure.torch_gpu_peak_memory()
        memory_method = "torch_cuda_max_memory_allocated"
    else:
        # One extra step after everything recorded (on the last batch again: user streams may
        # hold exactly `steps` batches): measured, not logged.
        raw_inputs, raw_targets = stream.batch(max(len(log.steps) - 1, 0))
        inputs = _to_device(raw_inputs, device, input_dtype)
        targets = _to_device(raw_targets, device, None)
        optimizer.zero_grad(set_to_none=True)
        live = list(model.parameters()) + list(model.buffers()) + [inputs, targets]
        for state in optimizer.state.values():
            live.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        peak_memory = measure.torch_cpu_step_memory(
            lambda: train_step(max(len(log.steps) - 1, 0), inputs, targets), live
        )
        memory_method = "torch_profiler_cpu_allocations"

    timing = measure.step_time_summary(log.times, config.timing_warmup)
    return build_run_record(
        framework="torch",
        config=config,
        pair=pair,
        stream=stream,
        steps_log=log.steps,
        timing=timing,
        compile_time_s=timing["warmup_excess_s"] if config.torch_compile else None,
        compile_method="warm-up steps' excess over the median step"
        if config.torch_compile
        else None,
        peak_memory=peak_memory,
        memory_method=memory_method,
        eval_metric=eval_metric,
        stopped_reason=log.stopped_reason,
        extra={"torch_mode": "compile" if config.torch_compile else "eager"},
    )


def build_run_record(
    *,
    framework: str,
    config: RunConfig,
    pair: Any,
    stream: Any,
    steps_log: list[dict[str, Any]],
    timing: dict[str, Any],
    compile_time_s: float | None,
    compile_method: str | None,
    peak_memory: int | None,
    memory_method: str | None,
    eval_metric: float | None,
    stopped_reason: str | None,
    extra: dict[str, Any] | None = None,
    memory_detail: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run record of DESIGN.md, shared by both trainers so their fields cannot drift."""
    from parity.models import eval_metric_name

    losses = [s["loss"] for s in steps_log]
    nonfinite = [s["step"] for s in steps_log if not s["loss_finite"]]
    median = timing["step_time_median_s"]
    samples_per_s = config.batch_size / median if median else None
    tokens_per_s = None
    if pair.task == "lm" and median:
        tokens_per_s = config.batch_size * int(np.prod(stream.input_shape)) / median
    tail = [x for x in losses[-5:] if x is not None]
    summary = {
        "step_time_median_s": median,
        "step_time_p10_s": timing["step_time_p10_s"],
        "step_time_p90_s": timing["step_time_p90_s"],
        "first_step_time_s": timing["first_step_time_s"],
        "measured_steps": timing["measured_steps"],
        "compile_time_s": compile_time_s,
        "compile_time_method": compile_method,
        "throughput_samples_per_s": samples_per_s,
        "throughput_tokens_per_s": tokens_per_s,
        "peak_memory_bytes": peak_memory,
        "peak_memory_method": memory_method,
        "peak_memory_method_description": measure.MEMORY_METHODS.get(memory_method),
        "final_loss": losses[-1] if losses else None,
        "final_loss_mean_last5": float(np.mean(tail))
        if len(tail) == len(losses[-5:]) and tail
        else None,
        "eval_metric": eval_metric,
        "eval_metric_name": eval_metric_name(pair.task),
        "skipped_steps": sum(1 for s in steps_log if s["skipped"]),
        "steps_completed": len(steps_log),
        "diverged": bool(nonfinite) or stopped_reason is not None,
        "first_nonfinite_step": nonfinite[0] if nonfinite else None,
        "stopped_reason": stopped_reason,
    }
    if memory_detail:
        summary["peak_memory_detail"] = memory_detail
    run = {
        "framework": framework,
        "model": config.model,
        "precision": config.precision,
        "policy": config.policy,
        "device": config.device,
        "versions": measure.versions(),
        "config": config.to_dict(),
        "model_config": {
            k: list(v) if isinstance(v, tuple) else v for k, v in dict(pair.config).items()
        },
        "steps": steps_log,
        "summary": summary,
    }
    run.update(extra or {})
    return run


def build_error_record(framework: str, config: RunConfig, error: BaseException) -> dict[str, Any]:
    """The record of a run that raised: kept in results.json and failed by `compare`, not a crash."""
    return {
        "framework": framework,
        "model": config.model,
        "precision": config.precision,
        "policy": config.policy,
        "device": config.device,
        "versions": measure.versions(),
        "config": config.to_dict(),
        "steps": [],
        "summary": {
            "error": f"{type(error).__name__}: {str(error)[:500]}",
            "step_time_median_s": None,
            "compile_time_s": None,
            "peak_memory_bytes": None,
            "peak_memory_method": None,
            "final_loss": None,
            "eval_metric": None,
            "skipped_steps": 0,
            "diverged": False,
            "steps_completed": 0,
        },
        **(
            {"torch_mode": "compile" if config.torch_compile else "eager"}
            if framework == "torch"
            else {}
        ),
    }
