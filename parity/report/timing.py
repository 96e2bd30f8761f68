"""The report's "Where the time went" section: each cell's phases, wall and CPU seconds.

A cell's run records carry ``"phases"`` (`parity.perf.phases`: step 0 and its parts, each
framework's training with its compile, timed steps and evaluation, the speed blocks, the
calibration runs, and once the report is written, the report and its plots). The section shows
them per cell, parts indented under their phase, with each phase's share of the cell's CPU
seconds; the report being written adds its own plots' time (drawn before the text).
"""

from __future__ import annotations

from typing import Any

from parity.perf.phases import top_level

__all__ = ["phases_section"]


def _cell_phases(runs: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The phases of a cell: those of its first main record that has them."""
    for run in runs:
        if not run.get("variant") and run.get("phases"):
            return run["phases"]
    for run in runs:
        if run.get("phases"):
            return run["phases"]
    return None


def phases_section(
    groups: dict[tuple, list[dict[str, Any]]], rendering: list[dict[str, Any]] | None = None
) -> list[str]:
    """Markdown lines: one table per cell whose records hold phases (none: no section).

    Args:
      groups: runs by cell, ``{(model, precision, device): [run, ...]}``.
      rendering: the phases of the report being written (its plots), added to every cell whose
        records do not already hold a report phase.

    Example:
      >>> lines = phases_section({("mlp", "fp32", "cpu"): [{"phases": [
      ...     {"phase": "step 0", "wall_s": 1.0, "cpu_s": 2.0}]}]})
      >>> lines[-1]
      '| step 0 | 1 | 2 | 100% |'
    """
    lines: list[str] = []
    for (model, precision, device), runs in groups.items():
        entries = _cell_phases(runs)
        if not entries:
            continue
        entries = list(entries)
        if rendering and not any(e["phase"].split("/")[0] == "report" for e in entries):
            entries += rendering
        total_cpu = sum(e["cpu_s"] for e in top_level(entries)) or 1.0
        if not lines:
            lines += [
                "## Where the time went",
                "",
                "Wall and CPU seconds of each phase of each cell (parts indented under their "
                "phase; CPU seconds are the process's, every thread; the share is of the "
                "cell's CPU seconds). `train jax/steps` and `train torch/steps` are the "
                "training loops; everything else is the harness's cost.",
            ]
        lines += [
            "",
            f"### {model} {precision} {device}",
            "",
            "| phase | wall s | CPU s | CPU share |",
            "|---|---|---|---|",
        ]
        for entry in entries:
            depth = entry["phase"].count("/")
            name = entry["phase"].rsplit("/", 1)[-1]
            indent = "&nbsp;&nbsp;" * depth
            lines.append(
                f"| {indent}{name} | {entry['wall_s']:.3g} | {entry['cpu_s']:.3g} | "
                f"{entry['cpu_s'] / total_cpu:.0%} |"
            )
    return lines
