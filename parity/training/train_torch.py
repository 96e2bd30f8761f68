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
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from parity.core.config import RunConfig, torch_device_type
from parity.core.eval_logits import eval_logit_point
from parity.core.hardware import UnsupportedHere, inductor_cache_hazard, unsupported_reason
from parity.core.losses import eval_metric_torch, loss_torch
from parity.core.progress import progress as progress_lines
from parity.core.records import build_run_record
from parity.perf import measure
from parity.perf.phases import phase
from parity.training.steps import build_torch_optimizer, torch_train_step

__all__ = ["TorchStep", "build_torch_step", "train_torch"]


def _to_device(array: np.ndarray, device: torch.device, float_dtype: torch.dtype | None):
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(device)
    if float_dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(float_dtype)
    return tensor


class TorchStep(NamedTuple):
    """The torch side of a run, built once (`build_torch_step`); the trainer and the
    alternating-block timing (`parity.training.blocks`) both step it."""

    step: Callable  # step(index, inputs, targets) -> loss (`torch_train_step`)
    forward_loss: Callable  # forward_loss(inputs, targets, train) -> (logits, loss)
    model: Any
    optimizer: Any
    scaler: Any
    params: list
    device: Any
    input_dtype: Any
    extras: dict

    def batch(self, stream: Any, index: int) -> tuple[Any, Any]:
        """Batch `index` of `stream` on the run's device, inputs in the recipe's dtype."""
        raw_inputs, raw_targets = stream.batch(index)
        return (
            _to_device(raw_inputs, self.device, self.input_dtype),
            _to_device(raw_targets, self.device, None),
        )


def _inductor_default_cache() -> str | None:
    """Inductor's default kernel cache folder (None where this torch does not say)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return default_cache_dir()


def build_torch_step(config: RunConfig, pair: Any) -> TorchStep:
    """The recipe's torch model (a copy of `pair.torch_model`), optimizer, scaler and step.

    Raises:
      UnsupportedHere: this machine cannot run the cell (no CUDA; no oneDNN kernel for it).
    """
    reason = unsupported_reason("torch", config.policy, pair.torch_model, config.device)
    if reason is not None:
        raise UnsupportedHere(reason)
    device_type = torch_device_type(config.device)
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("train_torch: config.device='gpu' but torch sees no CUDA device.")
    device = torch.device(device_type)
    # The fp32 baseline at full precision; TF32 would make torch fp32 matmuls approximate.
    torch.set_float32_matmul_precision("highest")
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    recipe = config.recipe
    recipe.check_arm("single")
    model, extras = recipe.torch_convert(copy.deepcopy(pair.torch_model).to(device), device)
    loop = pair.loop if getattr(pair, "loop", None) is not None else None
    loop = loop if loop is not None and loop.torch_optimizer is not None else None
    scheduler = None
    if loop is not None:
        optimizer, scheduler = loop.build_torch(model)
    else:
        optimizer = build_torch_optimizer(config, model.parameters())
    loss = getattr(getattr(pair, "loop", None), "torch_loss", None)
    scaler = recipe.torch_grad_scaler(config, device_type)
    if config.torch_compile and device_type == "cpu":
        hazard = inductor_cache_hazard(default_dir=_inductor_default_cache())
        if hazard is not None:
            warnings.warn(hazard, RuntimeWarning, stacklevel=2)
    forward_model = torch.compile(model) if config.torch_compile else model
    params = [p for p in model.parameters() if p.requires_grad]

    def forward_loss(inputs, targets, train):
        with recipe.torch_autocast(device_type):
            logits = pair.torch_forward(forward_model, inputs, train=train)
            if loss is not None:
                return logits, loss(logits, targets).float()
            return logits, loss_torch(pair.task, logits, targets)

    step = torch_train_step(
        config,
        lambda inputs, targets: forward_loss(inputs, targets, True)[1],
        optimizer,
        scaler,
        params,
        names=[n for n, p in model.named_parameters() if p.requires_grad],
        loop=loop,
        scheduler=scheduler,
    )
    return TorchStep(
        step,
        forward_loss,
        model,
        optimizer,
        scaler,
        params,
        device,
        recipe.torch_input_dtype(),
        extras,
    )


def _eval_logit_point(side: TorchStep, stream: Any, step: int) -> dict[str, Any]:
    """The first eval batch's logits through the eval-mode forward (`eval_logit_point`)."""
    raw_inputs, raw_targets = stream.eval_batches()[0]
    inputs = _to_device(raw_inputs, side.device, side.input_dtype)
    targets = _to_device(raw_targets, side.device, None)
    with torch.no_grad():
        logits, _ = side.forward_loss(inputs, targets, train=False)
    return eval_logit_point(step, logits.float().cpu().numpy(), raw_inputs)


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
      stream: a `BatchStream` (default: ``pair.make_data(config.stream_seed, config.batch_size)``).
      progress: report progress (a bar on a terminal, a plain line every 30 s elsewhere).

    Returns:
      A run record (`parity.core.records.build_run_record`; framework ``"torch"``,
      ``torch_compile`` in the config).
    """
    if stream is None:
        stream = pair.make_data(config.stream_seed, config.batch_size)
    side = build_torch_step(config, pair)
    model, optimizer, scaler, params = side.model, side.optimizer, side.scaler, side.params
    train_step, forward_loss = side.step, side.forward_loss
    device_type = torch_device_type(config.device)
    recipe = config.recipe

    # A language model's eval logits at the initial weights and after training
    # (`parity.verdicts.logits` compares them with JAX's).
    eval_logits: list[dict[str, Any]] = []
    capture_logits = config.eval and pair.task == "lm"
    if capture_logits:
        with phase("eval"):
            eval_logits.append(_eval_logit_point(side, stream, 0))
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    log = measure.StepLog()
    scale = float(scaler.get_scale()) if scaler is not None else None
    iterator = range(config.steps)
    if progress:
        label = (
            f"torch{'-compile' if config.torch_compile else ''} {config.model} {config.precision}"
        )
        iterator = progress_lines(iterator, label)
    with phase("steps"):
        for step in iterator:
            inputs, targets = side.batch(stream, step)
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
            stop = log.record(step, loss_value, scale_used, skipped, elapsed)
            log.steps[-1].update(train_step.signals)  # grad and update norms (torch_train_step)
            if stop:
                break

    eval_metric = None
    if config.eval and log.stopped_reason is None:
        values = []
        with torch.no_grad(), phase("eval"):
            for raw_inputs, raw_targets in stream.eval_batches():
                inputs = _to_device(raw_inputs, side.device, side.input_dtype)
                targets = _to_device(raw_targets, side.device, None)
                logits, _ = forward_loss(inputs, targets, train=False)
                values.append(float(eval_metric_torch(pair.task, logits.float(), targets)))
            if capture_logits:
                eval_logits.append(_eval_logit_point(side, stream, len(log.steps)))
        eval_metric = float(np.mean(values))

    if device_type == "cuda":
        peak_memory = measure.torch_gpu_peak_memory()
        memory_method = "torch_cuda_max_memory_allocated"
    else:
        # One extra step after everything recorded (on the last batch again: user streams may
        # hold exactly `steps` batches): measured, not logged.
        inputs, targets = side.batch(stream, max(len(log.steps) - 1, 0))
        optimizer.zero_grad(set_to_none=True)
        live = list(model.parameters()) + list(model.buffers()) + [inputs, targets]
        live.extend(measure.torch_state_tensors(optimizer))
        peak_memory = measure.torch_cpu_step_memory(
            lambda: train_step(max(len(log.steps) - 1, 0), inputs, targets), live
        )
        memory_method = "torch_profiler_cpu_allocations"

    timing = measure.step_time_summary(log.times, config.timing_warmup)
    optimizer_state = measure.torch_optimizer_state(optimizer, params)
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
        optimizer_state=optimizer_state,
        eval_logits=eval_logits,
        extra={
            "torch_mode": "compile" if config.torch_compile else "eager",
            "mixed_precision_method": recipe.torch_method(),
            **side.extras,
        },
    )
