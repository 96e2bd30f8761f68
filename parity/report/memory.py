"""The report's memory section: peak memory per cell, how each figure was measured, and whether
the two frameworks' figures compare (`memory_comparability`). A profiler's running sum of one
eager step's allocations and XLA's buffer plan of a compiled step are different quantities: the
text says so, and `parity.report.plots.memory_panels` never draws them on one axis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from parity.core.recipes import get_recipe
from parity.perf.speed import cells, jax_labels, ordered_labels, torch_reference

__all__ = ["memory_comparability", "memory_section"]


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
        for label in ordered_labels(members):
            summary = members[label]["summary"]
            peak = summary.get("peak_memory_bytes")
            method = summary.get("peak_memory_method")
            lines.append(
                f"| {model} | {precision} | {device} | {label} "
                f"| {'—' if peak is None else f'{peak / 2**20:.2f}'} "
                f"| {_METHOD_TEXT.get(method, method or '—')} |"
            )
        reference = torch_reference(members)
        for label in jax_labels(members) if reference else []:
            pairs.add(
                (
                    reference[1]["summary"].get("peak_memory_method"),
                    members[label]["summary"].get("peak_memory_method"),
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
