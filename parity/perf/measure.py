"""Step timing and peak memory for both frameworks, on CPU and GPU, each figure with its method.

Timing rule: the device is synchronised before every clock read (JAX:
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

import contextlib
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "jax_cpu_memory",
    "jax_gpu_peak_memory",
    "jax_optimizer_state",
    "cpu_seconds_on_cores",
    "load_average",
    "set_threads",
    "thread_settings",
    "thread_warnings",
    "time_blocks",
    "time_interleaved",
    "step_time_summary",
    "tensor_bytes",
    "torch_cpu_step_memory",
    "torch_gpu_peak_memory",
    "torch_optimizer_state",
    "torch_state_tensors",
    "torch_sync",
]


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


def torch_state_tensors(optimizer: Any) -> list[Any]:
    """The plain tensors `optimizer`'s state holds: a tensor subclass (torchao's
    ``OptimState8bit`` / ``4bit`` / ``Fp8``) is taken apart into its inner tensors (codes,
    scales, quantization map), recursively."""
    import torch  # torch: optional for JAX users
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    out: list[Any] = []

    def add(tensor):
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                add(getattr(tensor, name))
        else:
            out.append(tensor)

    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    return out


def _state_figures(state_bytes: int, params: int, method: str) -> dict[str, Any]:
    return {
        "optimizer_state_bytes": int(state_bytes),
        "param_count": int(params),
        "optimizer_state_bytes_per_param": state_bytes / params if params else None,
        "optimizer_state_method": method,
    }


def torch_optimizer_state(optimizer: Any, params: Iterable[Any]) -> dict[str, Any]:
    """Bytes of the optimizer state (`torch_state_tensors`: distinct storages, quantized
    subclasses' codes, scales and maps included) and per trainable parameter.

    Example:
      >>> # torch_optimizer_state(torchao.optim.AdamW8bit(model.parameters()), params)
    """
    count = sum(int(p.numel()) for p in params)
    method = "sum of optimizer.state tensor storages (tensor subclasses: their inner tensors)"
    return _state_figures(tensor_bytes(torch_state_tensors(optimizer)), count, method)


def jax_optimizer_state(opt_state: Any, params: Any) -> dict[str, Any]:
    """Bytes of the optimizer state inside ``jaxamp.loss_scaled`` (its `inner_state`: what
    torch's ``optimizer.state`` holds; the loss scale is not optimizer state) by
    ``jaxamp.optim_precision.state_bytes`` (codes and scales included), and per parameter.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> params = {"w": jnp.zeros((64, 64))}
      >>> state = jaxamp.loss_scaled(optax.adam(1e-3)).init(params)
      >>> jax_optimizer_state(state, params)["optimizer_state_bytes"]  # mu, nu and the count
      32772
    """
    import jax  # JAX: this module serves the torch trainer too

    import jaxamp

    inner = opt_state.inner_state if isinstance(opt_state, jaxamp.LossScaledState) else opt_state
    count = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    method = "jaxamp.optim_precision.state_bytes of the loss-scaled state's inner_state"
    return _state_figures(jaxamp.optim_precision.state_bytes(inner), count, method)


# kineto (torch's profiler backend) prints "USDT:... profiler_start" / "profiler_stop" (and
# "STAGE:... Completed Stage") lines to fd 2 around every profile. They sit at its highest log
# level: KINETO_LOG_LEVEL can hide them only together with its errors, so they are filtered out.
_KINETO_MARKER = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d [\d:.]+ \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_kineto_markers():
    """Captures fd 2 while profiling and passes on every line except kineto's markers."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (embedded interpreters): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", errors="replace")
            kept = [ln for ln in text.splitlines(keepends=True) if not _KINETO_MARKER.match(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


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
    with (
        _without_kineto_markers(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
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


# --- thread settings and machine load ----------------------------------------------------------


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _jax_backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def set_threads(threads: int | None = None, *, torch_too: bool = True) -> dict[str, Any]:
    """Gives torch and XLA:CPU the same number of intra-op threads, explicitly; returns them.

    torch's thread count changes its speed (GPT-2-tiny fp32: 46 ms on 1 thread, 56-625 ms on 2
    under load) and a timing that compares frameworks must give both the same cores. torch:
    ``torch.set_num_threads``. XLA:CPU sizes its intra-op pool once, when the backend starts,
    from the schedulable cores: one thread is ``--xla_cpu_multi_thread_eigen=false``; fewer
    cores than the machine has is a CPU affinity mask for the whole process (both frameworks).
    Call it before JAX runs anything (the CLI and the benchmarks do); afterwards XLA's count can no
    longer change and a mismatch is reported by the return value and `thread_warnings`. Called
    before torch is imported, it also sets ``OMP_WAIT_POLICY=PASSIVE`` (unless set): torch's
    OpenMP threads then sleep between parallel regions instead of spinning against XLA's pool
    (``python -m parity`` sets it before anything loads torch).

    Args:
      threads: intra-op threads for each framework (default: every schedulable core).
      torch_too: also import torch and set its count (False for JAX-only processes).

    Returns:
      `thread_settings()`: what each framework now uses.

    Raises:
      ValueError: `threads` is not an integer in [1, schedulable cores].

    Example:
      >>> settings = set_threads()           # every core, both frameworks
      >>> settings["torch_intra_op_threads"] == settings["xla_cpu_intra_op_threads"]
      True
    """
    available = _available_cpus()
    if "torch" not in sys.modules:
        # libgomp (torch's OpenMP) reads this once, when torch loads: idle threads then sleep
        # at once instead of spinning on the cores XLA's pool and the other framework need.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is None:
        threads = available
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= available:
        raise ValueError(
            f"set_threads: `threads` must be an integer from 1 to {available} (the schedulable "
            f"cores); got {threads!r}."
        )
    if not _jax_backend_started():
        if threads == 1:
            flags = os.environ.get("XLA_FLAGS", "")
            if "--xla_cpu_multi_thread_eigen" not in flags:
                os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
        elif threads < available and hasattr(os, "sched_setaffinity"):
            cores = sorted(os.sched_getaffinity(0))[:threads]
            os.sched_setaffinity(0, cores)
    if torch_too:
        import torch

        torch.set_num_threads(threads)
    global _REQUESTED_THREADS
    _REQUESTED_THREADS = threads
    return thread_settings()


_REQUESTED_THREADS: int | None = None


def thread_settings() -> dict[str, Any]:
    """Intra-op threads each framework uses now (None: framework not imported), for the records.

    Example:
      >>> sorted(thread_settings())[:3]
      ['available_cpus', 'omp_wait_policy', 'requested']
    """
    torch = sys.modules.get("torch")
    multi = re.search(r"--xla_cpu_multi_thread_eigen=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return {
        "available_cpus": _available_cpus(),
        "requested": _REQUESTED_THREADS,
        "torch_intra_op_threads": torch.get_num_threads() if torch is not None else None,
        # as the environment says now; libgomp read it when torch loaded
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        # what XLA:CPU's pool has (or will have when JAX starts its backend)
        "xla_cpu_intra_op_threads": 1 if multi and multi.group(1) == "false" else _available_cpus(),
    }


def thread_warnings(settings: dict[str, Any] | None = None) -> list[str]:
    """A warning when torch and XLA:CPU run with different intra-op thread counts.

    Example:
      >>> thread_warnings({"torch_intra_op_threads": 1, "xla_cpu_intra_op_threads": 2})
      ['thread counts differ: torch 1, XLA:CPU 2 (use set_threads / --threads)']
    """
    settings = settings or thread_settings()
    torch_threads = settings.get("torch_intra_op_threads")
    xla_threads = settings.get("xla_cpu_intra_op_threads")
    out = []
    if torch_threads is not None and xla_threads is not None and torch_threads != xla_threads:
        out.append(
            f"thread counts differ: torch {torch_threads}, XLA:CPU {xla_threads} "
            "(use set_threads / --threads)"
        )
    policy = str(settings.get("omp_wait_policy") or "").upper()
    if torch_threads not in (None, 1) and "omp_wait_policy" in settings and policy != "PASSIVE":
        out.append(
            f"torch's {torch_threads} OpenMP threads may spin-wait (OMP_WAIT_POLICY "
            f"{settings['omp_wait_policy'] or 'unset'}; PASSIVE must be set before torch loads)"
        )
    return out


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none).

    Example:
      >>> load_average() is None or load_average() >= 0
      True
    """
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def time_interleaved(
    steps: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Times several step functions interleaved step by step, so machine load hits all alike.

    Each round runs every function once, in an order rotated by one every round (no function is
    always first after a pause). Every function must finish its work before it returns (call
    ``block_until_ready`` / `torch_sync` inside). The first `warmup` rounds are run, not kept.

    Args:
      steps: name -> a function running one step.
      repeats: kept rounds.
      warmup: rounds run first and discarded (compilation, caches).

    Returns:
      name -> `repeats` wall times in seconds.

    Raises:
      ValueError: `repeats` < 1, `warmup` < 0 or no functions.

    Example:
      >>> times = time_interleaved({"a": lambda: sum(range(100)), "b": lambda: None}, repeats=3)
      >>> sorted(times), len(times["a"])
      (['a', 'b'], 3)
    """
    if not steps:
        raise ValueError("time_interleaved: `steps` must name at least one function.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"time_interleaved: `repeats` must be an integer >= 1; got {repeats!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"time_interleaved: `warmup` must be an integer >= 0; got {warmup!r}.")
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = now()
            steps[name]()
            elapsed = now() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


def cpu_seconds_on_cores() -> tuple[float, float] | None:
    """Busy CPU seconds of the cores this process may run on, and this process's own CPU seconds.

    Sampled before and after a timed stretch, ``(busy - own) / wall`` is how many of our cores
    other processes (and the hypervisor: steal time) used meanwhile: the contention a step-time
    figure suffered, measured rather than inferred from the load average.

    Returns:
      ``(busy_s, own_s)``; None where ``/proc/stat`` is not available (macOS, Windows).

    Example:
      >>> sample = cpu_seconds_on_cores()
      >>> sample is None or sample[0] >= 0
      True
    """
    try:
        with open("/proc/stat") as f:
            lines = [ln.split() for ln in f if ln.startswith("cpu") and ln[3:4].isdigit()]
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    try:
        ours = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    except AttributeError:  # pragma: no cover - /proc/stat exists only where this does too
        ours = {fields[0] for fields in lines}
    busy = 0
    for fields in lines:
        if fields[0] in ours:
            # user nice system idle iowait irq softirq steal (guest time is inside user)
            values = [int(x) for x in fields[1:9]]
            busy += sum(values) - values[3] - values[4]
    own = os.times()
    return busy / ticks, own.user + own.system


def time_blocks(
    steps: dict[str, Callable[[], Any]], *, blocks: int, block_steps: int, warmup: int = 1
) -> dict[str, Any]:
    """Times step functions in alternating blocks: `block_steps` steps of one, then of the next...

    Block after block the frameworks take turns (the order rotated every round, so neither always
    runs first after the other), so load that drifts over the run hits each alike and every round
    gives one paired comparison. Steps are timed one by one; each function must finish its work
    before it returns (``block_until_ready`` / `torch_sync`). `warmup` steps of each function run
    first, untimed (compilation, caches, allocator growth). Other processes' use of our cores is
    sampled around every round (`cpu_seconds_on_cores`).

    Args:
      steps: name -> a function running one step.
      blocks: rounds (each: one block per function).
      block_steps: timed steps per block.
      warmup: untimed steps per function first.

    Returns:
      ``{"times": {name: [[seconds per step] per block]}, "order": [[names] per round],
      "others_cpu_cores": [cores used by other processes per round, or None], "wall_s": [...],
      "others_cpu_cores_total": over all rounds, or None}``.

    Raises:
      ValueError: no functions, or `blocks`, `block_steps` < 1 or `warmup` < 0.

    Example:
      >>> record = time_blocks({"a": lambda: None, "b": lambda: None}, blocks=2, block_steps=3)
      >>> [len(b) for b in record["times"]["a"]], record["order"]
      ([3, 3], [['a', 'b'], ['b', 'a']])
    """
    if not steps:
        raise ValueError("time_blocks: `steps` must name at least one function.")
    for name, value, low in (("blocks", blocks, 1), ("block_steps", block_steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"time_blocks: `{name}` must be an integer >= {low}; got {value!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"time_blocks: `warmup` must be an integer >= 0; got {warmup!r}.")
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    record: dict[str, Any] = {
        "times": {name: [] for name in names},
        "order": [],
        "others_cpu_cores": [],
        "wall_s": [],
    }
    first = cpu_seconds_on_cores()
    for round_index in range(blocks):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        before, start = cpu_seconds_on_cores(), now()
        for name in order:
            block = []
            for _ in range(block_steps):
                step_start = now()
                steps[name]()
                block.append(now() - step_start)
            record["times"][name].append(block)
        after, wall = cpu_seconds_on_cores(), now() - start
        others = None
        if before is not None and after is not None and wall > 0:
            others = max((after[0] - before[0]) - (after[1] - before[1]), 0.0) / wall
        record["order"].append(order)
        record["others_cpu_cores"].append(others)
        record["wall_s"].append(wall)
    # Over the whole run too: per round, the kernel's 10 ms ticks are coarse.
    last, total_wall = cpu_seconds_on_cores(), sum(record["wall_s"])
    record["others_cpu_cores_total"] = (
        max((last[0] - first[0]) - (last[1] - first[1]), 0.0) / total_wall
        if first is not None and last is not None and total_wall > 0
        else None
    )
    return record
