"""Step timing and peak memory for both frameworks, on CPU and GPU, each figure with its method.

Timing rule (ANCHORS.md): the device is synchronised before every clock read (JAX:
``block_until_ready``; torch on CUDA: ``torch.cuda.synchronize``), the first `timing_warmup`
steps are excluded from the median, and compile time is reported apart.

Memory methods (every figure in ``results.json`` names one of these):

- ``torch_cuda_max_memory_allocated``: ``torch.cuda.max_memory_allocated()`` after
  ``reset_peak_memory_stats()``, over the measured steps.
- ``jax_gpu_peak_bytes_in_use``: ``device.memory_stats()["peak_bytes_in_use"]`` (needs
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` to be meaningful).
- ``xla_memory_analysis``: on CPU JAX has no allocator statistics; the compiled train step's
  ``memory_analysis()`` gives argument + output + temp - aliased bytes: the step's peak
  footprint as planned by XLA (params, optimizer state, batch, activations, gradients).
- ``torch_profiler_cpu_allocations``: torch's CPU allocator has no statistics and tracemalloc
  does not see it; we run one training step under ``torch.profiler.profile(profile_memory=True)``
  and take the maximum running sum of its allocation/free events, plus the bytes of parameters,
  optimizer state and batch live before the step (the gradients are freed first, so the step
  starts from the same state XLA's figure counts).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "MEMORY_METHODS",
    "jax_cpu_memory",
    "jax_gpu_peak_memory",
    "step_time_summary",
    "tensor_bytes",
    "torch_cpu_step_memory",
    "torch_gpu_peak_memory",
    "torch_sync",
]

MEMORY_METHODS = {
    "torch_cuda_max_memory_allocated": "torch.cuda.max_memory_allocated() over the measured steps",
    "jax_gpu_peak_bytes_in_use": (
        "jax device.memory_stats()['peak_bytes_in_use'] with XLA_PYTHON_CLIENT_PREALLOCATE=false; "
        "process-wide (JAX has no reset), so run GPU cells in separate processes for per-run peaks"
    ),
    "xla_memory_analysis": "compiled train step memory_analysis(): argument + output + temp - alias bytes",
    "torch_profiler_cpu_allocations": (
        "torch.profiler(profile_memory=True) over one step: max running sum of CPU allocator "
        "events + bytes of params, optimizer state and batch live before the step"
    ),
}


def torch_sync(device: str) -> None:
    """Waits for queued torch work on `device` ("cpu": nothing is asynchronous)."""
    if device == "gpu":
        import torch

        torch.cuda.synchronize()


# A run whose loss stays non-finite this many steps in a row has diverged: stop and report it.
MAX_NONFINITE_STEPS = 10


class StepLog:
    """Per-step records and step times of one training run, with the divergence guard.

    Both trainers log through it, so a torch run and a JAX run produce the same record shape
    (results.json's ``steps``) and stop on the same rule.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.times: list[float] = []
        self.stopped_reason: str | None = None
        self._consecutive_nonfinite = 0

    def record(
        self, step: int, loss: float, loss_scale: float | None, skipped: bool, time_s: float
    ) -> bool:
        """Appends one step; returns True when the run must stop (its loss diverged)."""
        finite = math.isfinite(loss)
        self.times.append(time_s)
        self.steps.append(
            {
                "step": step,
                "loss": loss if finite else None,  # JSON has no NaN/inf
                "loss_finite": finite,
                "loss_scale": loss_scale,
                "skipped": skipped,
                "time_s": time_s,
            }
        )
        self._consecutive_nonfinite = 0 if finite else self._consecutive_nonfinite + 1
        if self._consecutive_nonfinite >= MAX_NONFINITE_STEPS:
            self.stopped_reason = f"loss non-finite for {MAX_NONFINITE_STEPS} consecutive steps"
        return self.stopped_reason is not None


def step_time_summary(times: list[float], warmup: int) -> dict[str, Any]:
    """Median, spread and compile estimate of per-step wall times.

    The first `warmup` steps are excluded from the statistics (fewer when the run is shorter, so
    at least one step is always measured). ``first_step_time_s`` is the first step's time; the
    compile estimate for lazily compiling frameworks (torch.compile) is the excess of the warm-up
    steps over the median.
    """
    if not times:
        return {
            "step_time_median_s": None,
            "step_time_p10_s": None,
            "step_time_p90_s": None,
            "first_step_time_s": None,
            "measured_steps": 0,
            "warmup_excess_s": None,
        }
    warmup = min(warmup, len(times) - 1)
    measured = sorted(times[warmup:])
    median = statistics.median(measured)

    def quantile(q):
        return measured[min(int(q * len(measured)), len(measured) - 1)]

    return {
        "step_time_median_s": median,
        "step_time_p10_s": quantile(0.1),
        "step_time_p90_s": quantile(0.9),
        "first_step_time_s": times[0],
        "measured_steps": len(measured),
        "warmup_excess_s": max(sum(t - median for t in times[:warmup]), 0.0),
    }


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of distinct torch tensors' storages (a storage shared by views counts once)."""
    seen = set()
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen or key == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def torch_cpu_step_memory(run_step: Callable[[], Any], live_tensors: Iterable[Any]) -> int:
    """Peak CPU bytes of one torch training step (method ``torch_profiler_cpu_allocations``).

    Args:
      run_step: runs one full training step (forward, backward, optimizer); its gradients must
        already be freed (``zero_grad(set_to_none=True)``) so no free of an allocation made before
        profiling is missed.
      live_tensors: tensors live before the step (params, optimizer state, batch).
    """
    from torch.profiler import ProfilerActivity, profile

    baseline = tensor_bytes(live_tensors)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return baseline + peak


def torch_gpu_peak_memory() -> int:
    """``torch.cuda.max_memory_allocated()`` (call ``reset_peak_memory_stats`` before the steps)."""
    import torch

    return int(torch.cuda.max_memory_allocated())


def jax_cpu_memory(compiled: Any) -> dict[str, int] | None:
    """The compiled step's planned memory (method ``xla_memory_analysis``), or None if unknown.

    Works for any backend's executable; on CPU it is the only figure JAX offers.
    """
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # backends without the analysis raise various errors
        return None
    if analysis is None:
        return None
    fields = {
        "argument_bytes": analysis.argument_size_in_bytes,
        "output_bytes": analysis.output_size_in_bytes,
        "temp_bytes": analysis.temp_size_in_bytes,
        "alias_bytes": analysis.alias_size_in_bytes,
    }
    fields = {k: int(v) for k, v in fields.items()}
    fields["peak_bytes"] = (
        fields["argument_bytes"]
        + fields["output_bytes"]
        + fields["temp_bytes"]
        - fields["alias_bytes"]
    )
    return fields


def jax_gpu_peak_memory(device: Any) -> int | None:
    """``peak_bytes_in_use`` of a JAX GPU device, or None where the backend has no statistics."""
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])


def now() -> float:
    """A monotonic clock (seconds)."""
    return time.perf_counter()


def versions() -> dict[str, str]:
    """Versions of everything that affects the figures, and the machine."""
    import platform

    import flax
    import jax
    import jaxlib
    import numpy
    import optax

    import jaxamp

    out = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": numpy.__version__,
        "jaxamp": jaxamp.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_threads"] = str(torch.get_num_threads())
    except ImportError:  # the JAX side alone can run without torch
        pass
    import os

    out["cpu_count"] = str(os.cpu_count())
    return out
