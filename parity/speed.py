"""Speed and memory figures a study can quote: confidence intervals, bottom lines, honest charts.

For every (model, precision, device) cell with a JAX run and a torch run:

- each framework's median step time (the steps after the run's timing warm-up) with a bootstrap
  95% confidence interval (`median_ci`), and the JAX/torch ratio of medians with its own
  interval (`ratio_ci`, both samples resampled independently);
- a bottom-line sentence (`bottom_line`): "JAX 1.37x slower than torch eager (95% CI 1.21-1.52);
  torch's bf16 is emulated on this CPU", with the hardware caveats that explain the figure and
  warnings when the figure is unreliable (spread, machine load, few steps, unequal threads);
- a step-time chart on a linear axis, one panel per cell, values printed and CI whiskers
  (`plot_step_times`), and a memory chart with the method of every bar (`plot_memory`) plus a
  statement of whether the two methods compare (`memory_comparability`).

`speed_section`, `memory_section` and `hardware_section` return markdown lines for
``parity.report``. Runs are the records of ``results.json`` (see ``parity.records``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import jaxamp
from parity.hardware import hardware_summary
from parity.precision.recipes import get_recipe
from parity.records import write_bytes_atomic

__all__ = [
    "CI_WIDTH_LIMIT",
    "SPREAD_LIMIT",
    "bottom_line",
    "cell_caveats",
    "cells",
    "hardware_section",
    "measured_times",
    "median_ci",
    "memory_comparability",
    "memory_section",
    "plot_memory",
    "plot_step_times",
    "ratio_ci",
    "reliability_warnings",
    "speed_section",
]

# A figure is flagged unreliable when its 95% CI is wider than this fraction of the median...
CI_WIDTH_LIMIT = 0.2
# ...or its p90/p10 step-time spread exceeds this factor.
SPREAD_LIMIT = 2.0
MIN_STEPS = 10
_LABEL_ORDER = ("torch", "torch-compile", "jax")
_COLORS = {"torch": "#d62728", "torch-compile": "#ff7f0e", "jax": "#1f77b4"}


# --- statistics --------------------------------------------------------------------------------


def _as_sample(name: str, values: Sequence[float]) -> np.ndarray:
    sample = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if sample.ndim != 1 or sample.size == 0:
        raise ValueError(f"{name}: need at least one timing; got {list(values)!r}.")
    if not np.all(np.isfinite(sample)):
        raise ValueError(f"{name}: timings must be finite; got {list(values)!r}.")
    return sample


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"`confidence` must be in (0, 1); got {confidence!r}.")


def _bootstrap(data, statistic, *, seed: int, **kwargs):
    """scipy.stats.bootstrap with a seeded generator (``rng=`` from scipy 1.15, ``random_state=``
    before: GPU images may carry an older scipy)."""
    from scipy.stats import bootstrap

    try:
        return bootstrap(data, statistic, rng=np.random.default_rng(seed), **kwargs)
    except TypeError:
        return bootstrap(data, statistic, random_state=np.random.default_rng(seed), **kwargs)


def median_ci(
    times: Sequence[float], *, confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """The median of `times` with a percentile-bootstrap confidence interval.

    Args:
      times: step times (any unit).
      confidence: the interval's coverage (default 95%).
      n_resamples: bootstrap resamples (scipy.stats.bootstrap).
      seed: the resampling seed (reproducible intervals).

    Returns:
      ``(median, low, high)``; with one timing the interval is that value.

    Raises:
      ValueError: no timings, a non-finite timing, or `confidence` outside (0, 1).

    Example:
      >>> median, low, high = median_ci([1.0, 1.1, 0.9, 1.05, 0.95])
      >>> low <= median <= high
      True
    """
    _check_confidence(confidence)
    sample = _as_sample("median_ci", times)
    median = float(np.median(sample))
    if sample.size < 2 or np.ptp(sample) == 0:
        return median, median, median
    result = _bootstrap(
        (sample,),
        np.median,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        seed=seed,
    )
    low, high = result.confidence_interval
    return median, float(low), float(high)


def ratio_ci(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """median(numerator) / median(denominator) with a bootstrap confidence interval.

    The two samples are resampled independently (they come from different processes' steps).

    Args:
      numerator: e.g. JAX step times.
      denominator: e.g. torch step times.
      confidence, n_resamples, seed: as in `median_ci`.

    Returns:
      ``(ratio, low, high)``.

    Raises:
      ValueError: an empty or non-finite sample, a zero median denominator.

    Example:
      >>> ratio, low, high = ratio_ci([2.0, 2.2, 1.9, 2.1], [1.0, 1.05, 0.98, 1.02])
      >>> 1.8 < low <= ratio <= high < 2.3
      True
    """
    _check_confidence(confidence)
    a = _as_sample("ratio_ci numerator", numerator)
    b = _as_sample("ratio_ci denominator", denominator)
    if np.median(b) <= 0:
        raise ValueError(f"ratio_ci: the denominator's median must be > 0; got {np.median(b)!r}.")
    ratio = float(np.median(a) / np.median(b))
    if (a.size < 2 or np.ptp(a) == 0) and (b.size < 2 or np.ptp(b) == 0):
        return ratio, ratio, ratio

    def statistic(x, y, axis=-1):
        return np.median(x, axis=axis) / np.median(y, axis=axis)

    result = _bootstrap(
        (a, b),
        statistic,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        paired=False,
        vectorized=True,
        seed=seed,
    )
    low, high = result.confidence_interval
    return ratio, float(low), float(high)


# --- runs and cells ----------------------------------------------------------------------------


def _label(run: Mapping[str, Any]) -> str:
    if run["framework"] == "torch" and run.get("torch_mode") == "compile":
        return "torch-compile"
    return run["framework"]


def _completed(run: Mapping[str, Any]) -> bool:
    status = run.get("status") or ("error" if run.get("summary", {}).get("error") else "completed")
    return status == "completed" and not run.get("variant")


def measured_times(run: Mapping[str, Any]) -> list[float]:
    """The step times a run's median is taken over: after its timing warm-up, finite ones.

    Example:
      >>> run = {"config": {"timing_warmup": 1}, "steps": [{"time_s": 9.0}, {"time_s": 1.0}]}
      >>> measured_times(run)
      [1.0]
    """
    times = [s.get("time_s") for s in run.get("steps", [])]
    times = [t for t in times if t is not None and math.isfinite(t)]
    warmup = int((run.get("config") or {}).get("timing_warmup", 0))
    warmup = min(warmup, max(len(times) - 1, 0))
    return times[warmup:]


def cells(runs: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Completed runs grouped by (model, precision, device), keyed by label within a cell.

    Example:
      >>> cells([])
      {}
    """
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for run in runs:
        if _completed(run) and measured_times(run):
            key = (run["model"], run["precision"], run["device"])
            out.setdefault(key, {})[_label(run)] = run
    return dict(sorted(out.items()))


def _compute_dtype(run: Mapping[str, Any]) -> str:
    """The compute dtype of the run's policy: the record's, else its recipe's."""
    spec = run.get("policy") or (run.get("config") or {}).get("policy")
    try:
        policy = jaxamp.get_policy(spec) if spec else get_recipe(run.get("precision", "")).policy
    except ValueError:
        return "float32"
    return policy.compute_dtype.name


def cell_caveats(run: Mapping[str, Any]) -> list[str]:
    """Hardware facts that explain a cell's speed (what a reader must know before quoting it).

    Example:
      >>> cell_caveats({"device": "cpu", "precision": "bf16-mixed", "framework": "torch",
      ...               "hardware": {"torch_bf16_emulated": True}})[0]
      "torch's bf16 is emulated on this CPU (no AVX512-BF16/AMX kernels)"
    """
    if run.get("device") != "cpu":
        return []
    hardware = run.get("hardware") or {}
    dtype = _compute_dtype(run)
    out = []
    if dtype == "bfloat16" and hardware.get("torch_bf16_emulated"):
        out.append("torch's bf16 is emulated on this CPU (no AVX512-BF16/AMX kernels)")
    if dtype == "float16":
        out.append("torch's fp16 CPU kernels are ~200x slower than its fp32 (no fast kernel)")
    if dtype != "float32":
        out.append("XLA:CPU computes bf16/fp16 dots in float32 (no low-precision speed-up for JAX)")
    return out


def reliability_warnings(run: Mapping[str, Any]) -> list[str]:
    """Why a run's step-time figure may not be quotable (empty when it is).

    Flags fewer than 10 timed steps, a 95% CI wider than 20% of the median, a p90/p10 spread
    above 2x, a 1-minute load average above the available cores when the run was recorded, and
    unequal thread counts between the frameworks.

    Example:
      >>> reliability_warnings({"steps": [{"time_s": 1.0}] * 3, "config": {}, "framework": "jax"})
      ['jax: only 3 timed steps']
    """
    label = _label(run)
    times = measured_times(run)
    out = []
    if len(times) < MIN_STEPS:
        out.append(f"{label}: only {len(times)} timed steps")
    if times:
        median, low, high = median_ci(times)
        if median > 0 and (high - low) / median > CI_WIDTH_LIMIT:
            out.append(
                f"{label}: 95% CI of the median spans {100 * (high - low) / median:.0f}% of it"
            )
        p10, p90 = np.percentile(times, [10, 90])
        if p10 > 0 and p90 / p10 > SPREAD_LIMIT:
            out.append(f"{label}: p90/p10 step-time spread {p90 / p10:.1f}x")
    hardware = run.get("hardware") or {}
    cpu = hardware.get("cpu") or {}
    load = (cpu.get("load_average") or [None])[0]
    cores = cpu.get("available_cpus")
    if load is not None and cores and load > cores:
        out.append(f"{label}: machine load {load:.1f} on {cores} cores")
    torch_info, jax_info = hardware.get("torch") or {}, hardware.get("jax") or {}
    if run.get("device") == "cpu" and torch_info and jax_info:
        a, b = torch_info.get("intra_op_threads"), jax_info.get("cpu_intra_op_threads")
        if a is not None and b is not None and a != b:
            out.append(f"{label}: unequal threads (torch {a}, XLA:CPU {b})")
    return out


def _torch_reference(members: Mapping[str, Any]) -> tuple[str, Any] | None:
    for label in ("torch", "torch-compile"):
        if label in members:
            return label, members[label]
    return None


def _mode_name(label: str) -> str:
    return "torch eager" if label == "torch" else "torch.compile"


def bottom_line(jax_run: Mapping[str, Any], torch_run: Mapping[str, Any]) -> str:
    """One sentence a study can quote: who is faster, by how much, with the 95% CI and caveats.

    Args:
      jax_run: the JAX run record of a cell.
      torch_run: the torch run record (eager or torch.compile) of the same cell.

    Returns:
      e.g. ``"JAX 1.37x slower than torch eager (95% CI 1.21-1.52); torch's bf16 is emulated on
      this CPU (no AVX512-BF16/AMX kernels)"``; a CI that contains 1 says "no clear difference".

    Example:
      >>> jax_run = {"framework": "jax", "device": "gpu", "config": {},
      ...            "steps": [{"time_s": t} for t in (2.0, 2.1, 1.9, 2.0)]}
      >>> torch_run = {"framework": "torch", "device": "gpu", "config": {},
      ...              "steps": [{"time_s": t} for t in (1.0, 1.02, 0.98, 1.0)]}
      >>> bottom_line(jax_run, torch_run).split(" (")[0]
      'JAX 2.00x slower than torch eager'
    """
    mode = _mode_name(_label(torch_run))
    ratio, low, high = ratio_ci(measured_times(jax_run), measured_times(torch_run))
    if low <= 1.0 <= high:
        text = (
            f"no clear difference between JAX and {mode}: step-time ratio {ratio:.2f} "
            f"(95% CI {low:.2f}-{high:.2f})"
        )
    elif ratio > 1:
        text = f"JAX {ratio:.2f}x slower than {mode} (95% CI {low:.2f}-{high:.2f})"
    else:
        text = f"JAX {1 / ratio:.2f}x faster than {mode} (95% CI {1 / high:.2f}-{1 / low:.2f})"
    caveats = cell_caveats(torch_run)
    warnings = reliability_warnings(jax_run) + reliability_warnings(torch_run)
    if caveats:
        text += "; " + "; ".join(caveats)
    if warnings:
        text += "; UNRELIABLE: " + "; ".join(warnings)
    return text


# --- markdown sections -------------------------------------------------------------------------


def _ms(value: float) -> str:
    return f"{value * 1e3:.3g}"


def speed_section(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown: the bottom line per cell and a table of medians with 95% CIs.

    Example:
      >>> speed_section([])[0]
      '## Speed'
    """
    lines = ["## Speed", ""]
    grouped = cells(runs)
    if not grouped:
        return lines + ["No completed runs with step times.", ""]
    lines += [
        "Median step time after the warm-up steps (device synced before each clock read; compile "
        "time apart), with a bootstrap 95% confidence interval; the ratio is JAX / torch of the "
        "medians, its interval from resampling both runs. Unless the runs say otherwise, the two "
        "frameworks ran one after the other in one process: load that changes between them moves "
        "the ratio (`benchmarks/bench_parity.py` interleaves them).",
        "",
    ]
    for (model, precision, device), members in grouped.items():
        reference = _torch_reference(members)
        if "jax" in members and reference is not None:
            sentence = bottom_line(members["jax"], reference[1])
            lines.append(
                f"- **{model} {precision} ({device})**: {sentence[0].upper()}{sentence[1:]}."
            )
        else:
            lines.append(f"- **{model} {precision} ({device})**: only {', '.join(members)} ran.")
    lines += ["", "| model | precision | device | run | steps | median ms (95% CI) | JAX / this |"]
    lines.append("|---|---|---|---|---|---|---|")
    for (model, precision, device), members in grouped.items():
        for label in sorted(members, key=_LABEL_ORDER.index):
            times = measured_times(members[label])
            median, low, high = median_ci(times)
            ratio_text = "—"
            if label != "jax" and "jax" in members:
                ratio, r_low, r_high = ratio_ci(measured_times(members["jax"]), times)
                ratio_text = f"{ratio:.2f} ({r_low:.2f}-{r_high:.2f})"
            lines.append(
                f"| {model} | {precision} | {device} | {label} | {len(times)} "
                f"| {_ms(median)} ({_ms(low)}-{_ms(high)}) | {ratio_text} |"
            )
    lines.append("")
    return lines


_METHOD_TEXT = {
    "xla_memory_analysis": "XLA's compiled-step plan (arguments + outputs + temporaries - aliased)",
    "torch_profiler_cpu_allocations": (
        "torch profiler: peak of one eager step's allocations + live params, optimizer state, batch"
    ),
    "torch_cuda_max_memory_allocated": "torch CUDA allocator peak (max_memory_allocated)",
    "jax_gpu_peak_bytes_in_use": "JAX GPU allocator peak (peak_bytes_in_use, process-wide)",
}


def memory_comparability(torch_method: str | None, jax_method: str | None) -> str:
    """Whether the torch and the JAX memory figures of a cell may be compared, and why.

    Example:
      >>> memory_comparability("torch_cuda_max_memory_allocated", "jax_gpu_peak_bytes_in_use")[:10]
      'Comparable'
    """
    pair = (torch_method, jax_method)
    if pair == ("torch_cuda_max_memory_allocated", "jax_gpu_peak_bytes_in_use"):
        return (
            "Comparable: both are device-allocator peaks over the timed steps (JAX's is "
            "process-wide, so run one cell per process for per-cell peaks; both exclude the CUDA "
            "context and library workspaces)."
        )
    if pair == ("torch_profiler_cpu_allocations", "xla_memory_analysis"):
        return (
            "Not directly comparable (same order of magnitude at best): torch's figure is the "
            "running peak of the CPU allocations one eager step actually made, plus the tensors "
            "live before it; XLA's is the buffer plan of the compiled step, which reuses and "
            "fuses buffers torch allocates separately, and counts every argument and output "
            "(params, optimizer state, batch) whether or not the runtime aliases it. Neither "
            "includes the framework's own runtime memory. Compare each framework against itself "
            "across precisions, not the two against each other."
        )
    names = ", ".join(f"`{m}`" for m in pair if m)
    return f"Different methods ({names or 'none recorded'}): not comparable as they stand."


def _bf16_mixed(precision: str) -> bool:
    """float32 params, bfloat16 compute (what the memory note explains)."""
    try:
        policy = get_recipe(precision).policy
    except ValueError:
        return False
    return policy.param_dtype.name == "float32" and policy.compute_dtype.name == "bfloat16"


def _bf16_memory_note(grouped) -> list[str]:
    """Explains JAX bf16-mixed memory not lower than fp32 on CPU where that is what was measured."""
    notes = []
    for (model, precision, device), members in grouped.items():
        if device != "cpu" or "jax" not in members or not _bf16_mixed(precision):
            continue
        fp32 = grouped.get((model, "fp32", device), {}).get("jax")
        low = members["jax"]["summary"].get("peak_memory_bytes")
        full = fp32 and fp32["summary"].get("peak_memory_bytes")
        if low and full and low >= 0.95 * full:
            notes.append(
                f"- JAX {model}: bf16-mixed plans {low / 2**20:.2f} MiB against fp32's "
                f"{full / 2**20:.2f} MiB. Expected on CPU: under a mixed policy the parameters, "
                "gradients and optimizer state stay float32 and the bf16 copies of the weights are "
                "extra buffers; XLA:CPU also converts bf16 dot operands to float32, so the "
                "float32 temporaries remain. Only saved activations shrink, which at these batch "
                "sizes are a small part of the step."
            )
    return notes


def memory_section(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown: peak memory per cell, how each figure was measured and whether they compare.

    Example:
      >>> memory_section([])[0]
      '## Memory'
    """
    lines = ["## Memory", ""]
    grouped = cells(runs)
    if not grouped:
        return lines + ["No completed runs with memory figures.", ""]
    lines += ["| model | precision | device | run | peak MiB | how it was measured |"]
    lines.append("|---|---|---|---|---|---|")
    pairs = set()
    for (model, precision, device), members in grouped.items():
        for label in sorted(members, key=_LABEL_ORDER.index):
            summary = members[label]["summary"]
            peak = summary.get("peak_memory_bytes")
            method = summary.get("peak_memory_method")
            lines.append(
                f"| {model} | {precision} | {device} | {label} "
                f"| {'—' if peak is None else f'{peak / 2**20:.2f}'} "
                f"| {_METHOD_TEXT.get(method, method or '—')} |"
            )
        reference = _torch_reference(members)
        if reference and "jax" in members:
            pairs.add(
                (
                    reference[1]["summary"].get("peak_memory_method"),
                    members["jax"]["summary"].get("peak_memory_method"),
                )
            )
    lines.append("")
    for torch_method, jax_method in sorted(pairs, key=str):
        lines.append(
            f"- `{torch_method}` vs `{jax_method}`: {memory_comparability(torch_method, jax_method)}"
        )
    lines += _bf16_memory_note(grouped)
    lines.append("")
    return lines


def hardware_section(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown: the machine(s) the runs were recorded on, from their ``hardware`` fields.

    Example:
      >>> hardware_section([])[0]
      '## Hardware'
    """

    lines = ["## Hardware", ""]
    seen: dict[str, list[str]] = {}
    loads = []
    for run in runs:
        hardware = run.get("hardware")
        if not hardware or "cpu" not in hardware:
            continue
        seen.setdefault(hardware_summary(hardware), []).append(_label(run))
        load = (hardware["cpu"].get("load_average") or [None])[0]
        if load is not None:
            loads.append(load)
    if not seen:
        return lines + ["The runs carry no hardware record (written by an older version).", ""]
    for summary, labels in seen.items():
        lines.append(f"- {summary} ({len(labels)} runs)")
    if len(seen) > 1:
        lines.append("- **The runs come from different machines or settings**: compare with care.")
    if loads:
        lines.append(
            f"- 1-minute load average when the runs ended: {min(loads):.1f}-{max(loads):.1f}."
        )
    lines.append("")
    return lines


# --- plots -------------------------------------------------------------------------------------


def _save(fig, path: Path) -> None:

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    write_bytes_atomic(path, buffer.getvalue())


def _panels(n: int):
    import matplotlib.pyplot as plt

    cols = min(3, max(n, 1))
    rows = math.ceil(max(n, 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 1.0 + 1.5 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _empty(path: Path, text: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 1.2))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")
    _save(fig, path)
    plt.close(fig)


def plot_step_times(runs: Sequence[Mapping[str, Any]], path: str | Path) -> bool:
    """Median step time per run with 95% CI whiskers, linear axis from 0, values printed.

    One panel per (model, precision, device) cell, so a 2 ms cell and a 200 ms cell are both
    readable and bar lengths stay proportional to time. Runs without timings are left out; with
    none at all the PNG says so (never a crash).

    Returns:
      True when at least one bar was drawn.

    Example:
      >>> # plot_step_times(load_results("runs/x")["runs"], "runs/x/step_time.png")
    """
    import matplotlib.pyplot as plt

    path = Path(path)
    grouped = cells(runs)
    if not grouped:
        _empty(path, "no completed runs with step times")
        return False
    fig, axes = _panels(len(grouped))
    for ax, ((model, precision, device), members) in zip(axes, grouped.items(), strict=False):
        labels = sorted(members, key=_LABEL_ORDER.index)
        stats = [median_ci(measured_times(members[label])) for label in labels]
        medians = [1e3 * m for m, _, _ in stats]
        errors = [[1e3 * (m - lo) for m, lo, _ in stats], [1e3 * (hi - m) for m, _, hi in stats]]
        ys = range(len(labels))
        ax.barh(ys, medians, xerr=errors, capsize=4, color=[_COLORS[lb] for lb in labels])
        right = max(1e3 * hi for _, _, hi in stats)
        for y, (m, _, hi) in zip(ys, stats, strict=True):
            ax.text(1e3 * hi + 0.02 * right, y, f"{1e3 * m:.3g} ms", va="center", fontsize=8)
        ax.set_xlim(0, 1.3 * right)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{model} {precision} ({device})", fontsize=9)
        ax.set_xlabel("median step time, ms (95% CI)", fontsize=8)
    fig.suptitle("Step time after warm-up (linear axis; whiskers: bootstrap 95% CI)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def plot_memory(runs: Sequence[Mapping[str, Any]], path: str | Path) -> bool:
    """Peak memory per run in MiB, linear axis, values printed, the measuring method per bar.

    Hatched bars are XLA's compiled plan, plain bars allocator or profiler peaks (see
    `memory_comparability`). Returns True when at least one bar was drawn.

    Example:
      >>> # plot_memory(load_results("runs/x")["runs"], "runs/x/memory.png")
    """
    import matplotlib.pyplot as plt

    path = Path(path)
    grouped = {
        key: {
            label: run
            for label, run in members.items()
            if (run["summary"].get("peak_memory_bytes") or 0) > 0
        }
        for key, members in cells(runs).items()
    }
    grouped = {key: members for key, members in grouped.items() if members}
    if not grouped:
        _empty(path, "no completed runs with memory figures")
        return False
    fig, axes = _panels(len(grouped))
    for ax, ((model, precision, device), members) in zip(axes, grouped.items(), strict=False):
        labels = sorted(members, key=_LABEL_ORDER.index)
        values = [members[lb]["summary"]["peak_memory_bytes"] / 2**20 for lb in labels]
        methods = [members[lb]["summary"].get("peak_memory_method") or "?" for lb in labels]
        ys = range(len(labels))
        bars = ax.barh(ys, values, color=[_COLORS[lb] for lb in labels])
        for bar, method in zip(bars, methods, strict=True):
            if method == "xla_memory_analysis":
                bar.set_hatch("//")
        right = max(values)
        for y, value, method in zip(ys, values, methods, strict=True):
            ax.text(value + 0.02 * right, y, f"{value:.3g} MiB ({method})", va="center", fontsize=7)
        ax.set_xlim(0, 2.2 * right)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{model} {precision} ({device})", fontsize=9)
        ax.set_xlabel("peak MiB", fontsize=8)
    fig.suptitle("Peak memory of a train step; methods differ (see the report)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True
