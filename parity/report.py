"""The per-step CSV, PNG plots and the markdown report (every file written atomically).

The run-record schema, ``results.json`` loading/merging and the atomic writers live in
`parity.records`; the names below are re-exported from there for older imports.
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any

from parity.records import (
    RESULTS_FILE,
    load_results,
    merge_runs,
    run_key,
    run_label,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)

__all__ = [
    "RESULTS_FILE",
    "load_results",
    "merge_runs",
    "run_key",
    "run_label",
    "write_json_atomic",
    "write_report",
    "write_steps_csv",
    "write_text_atomic",
]

STEP_COLUMNS = (
    "model",
    "precision",
    "device",
    "run",
    "step",
    "loss",
    "loss_finite",
    "loss_scale",
    "skipped",
    "time_s",
)


def write_steps_csv(runs: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """One row per step of every run (atomic)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(STEP_COLUMNS)
    for run in runs:
        for step in run["steps"]:
            writer.writerow(
                [
                    run["model"],
                    run["precision"],
                    run["device"],
                    run_label(run),
                    step["step"],
                    "" if step["loss"] is None else repr(step["loss"]),
                    step.get("loss_finite", step["loss"] is not None),
                    "" if step["loss_scale"] is None else repr(step["loss_scale"]),
                    step["skipped"],
                    repr(step["time_s"]),
                ]
            )
    write_text_atomic(path, buffer.getvalue())


# --- plots -------------------------------------------------------------------------------------

_COLORS = {"torch": "tab:orange", "torch-compile": "tab:red", "jax": "tab:blue"}
_STYLES = {"torch": "-", "torch-compile": ":", "jax": "--"}


def _groups(runs):
    groups: dict[tuple, list] = {}
    for run in runs:
        groups.setdefault((run["model"], run["precision"], run["device"]), []).append(run)
    return groups


def _savefig(fig, path: Path) -> None:
    # Atomic like every other output: render to bytes, then replace.
    if fig._suptitle is not None:
        fig.tight_layout(rect=(0, 0, 1, 0.95))  # keep the suptitle clear of the panel titles
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    write_bytes_atomic(path, buffer.getvalue())


def _grid(n: int):
    import matplotlib.pyplot as plt

    cols = min(4, max(n, 1))
    rows = math.ceil(max(n, 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows + 0.6), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def plot_losses(runs, path: Path) -> None:
    """Loss curves of every (model, precision) group, the frameworks overlaid."""
    import matplotlib.pyplot as plt

    groups = _groups(runs)
    fig, axes = _grid(len(groups))
    for ax, ((model, precision, device), members) in zip(
        axes, sorted(groups.items()), strict=False
    ):
        for run in members:
            label = run_label(run)
            xs = [s["step"] for s in run["steps"] if s["loss"] is not None]
            ys = [s["loss"] for s in run["steps"] if s["loss"] is not None]
            ax.plot(xs, ys, _STYLES.get(label, "-"), color=_COLORS.get(label), label=label, lw=1.2)
            bad = [s["step"] for s in run["steps"] if s["loss"] is None]
            if bad:
                ax.axvline(bad[0], color=_COLORS.get(label), alpha=0.4, lw=3, label=f"{label}: NaN")
        ax.set_title(f"{model} {precision} ({device})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle("Training loss, torch vs JAX (same weights, same batches)")
    _savefig(fig, path)
    plt.close(fig)


def plot_loss_scales(runs, path: Path) -> bool:
    """Loss-scale trajectories of the loss-scaled runs; False (no file) when there are none."""
    import matplotlib.pyplot as plt

    scaled = [r for r in runs if any(s["loss_scale"] is not None for s in r["steps"])]
    if not scaled:
        return False
    groups = _groups(scaled)
    fig, axes = _grid(len(groups))
    for ax, ((model, precision, device), members) in zip(
        axes, sorted(groups.items()), strict=False
    ):
        for run in members:
            label = run_label(run)
            xs = [s["step"] for s in run["steps"]]
            ys = [s["loss_scale"] for s in run["steps"]]
            ax.step(
                xs, ys, where="post", color=_COLORS.get(label), ls=_STYLES.get(label), label=label
            )
            skips = [s["step"] for s in run["steps"] if s["skipped"]]
            if skips:
                ax.plot(
                    skips,
                    [run["steps"][i]["loss_scale"] for i in skips],
                    "x",
                    color=_COLORS.get(label),
                    label=f"{label} skipped",
                )
        ax.set_yscale("log", base=2)
        ax.set_title(f"{model} {precision} ({device})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss scale")
        ax.legend(fontsize=7)
    fig.suptitle("Dynamic loss scale (torch GradScaler vs jaxamp DynamicLossScale)")
    _savefig(fig, path)
    plt.close(fig)
    return True


def _bar_plot(runs, path: Path, value, ylabel: str, title: str, log: bool) -> None:
    import matplotlib.pyplot as plt

    groups = sorted(_groups(runs).items())
    labels = sorted(
        {run_label(r) for r in runs}, key=lambda x: ["torch", "torch-compile", "jax"].index(x)
    )
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(groups) + 2), 3.6))
    for i, label in enumerate(labels):
        xs, ys = [], []
        for g, (_, members) in enumerate(groups):
            for run in members:
                v = value(run)
                if run_label(run) == label and v is not None:
                    xs.append(g + (i - (len(labels) - 1) / 2) * width)
                    ys.append(v)
        ax.bar(xs, ys, width=width, color=_COLORS.get(label), label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{p}" for (m, p, _), _ in groups], fontsize=7)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    _savefig(fig, path)
    plt.close(fig)


def plot_step_times(runs, path: Path) -> None:
    """Median step time (after warm-up, synced) per run."""
    _bar_plot(
        runs,
        path,
        lambda r: r["summary"]["step_time_median_s"] and r["summary"]["step_time_median_s"] * 1e3,
        "median step time (ms, log)",
        "Step time after warm-up (device synced; compile time excluded)",
        log=True,
    )


def plot_memory(runs, path: Path) -> None:
    """Peak memory per run (each framework's method: see the report's table)."""
    _bar_plot(
        runs,
        path,
        lambda r: r["summary"]["peak_memory_bytes"] and r["summary"]["peak_memory_bytes"] / 2**20,
        "peak memory (MiB)",
        "Peak memory of a train step (torch: profiler allocations / CUDA allocator; JAX: XLA analysis / allocator)",
        log=False,
    )


# --- markdown ----------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _mib(value: Any) -> str:
    return "—" if value is None else f"{value / 2**20:.2f}"


def write_report(
    out_dir: str | os.PathLike,
    runs: list[dict[str, Any]],
    verdicts: list[Any],
    *,
    skipped_cells: list[dict[str, str]] | None = None,
) -> Path:
    """Writes ``report.md``, ``steps.csv`` and the PNG plots into `out_dir`; returns the report path."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_steps_csv(runs, out / "steps.csv")
    plots = []
    if runs:
        plot_losses(runs, out / "loss_curves.png")
        plots.append(("Loss curves", "loss_curves.png"))
        if plot_loss_scales(runs, out / "loss_scale.png"):
            plots.append(("Loss-scale trajectories (x: skipped steps)", "loss_scale.png"))
        plot_step_times(runs, out / "step_time.png")
        plots.append(("Step time", "step_time.png"))
        plot_memory(runs, out / "memory.png")
        plots.append(("Peak memory", "memory.png"))

    failed = [v for v in verdicts if v.passed is False]
    lines = ["# PyTorch vs JAX parity report", ""]
    if verdicts:
        status = "**FAIL**" if failed else "**PASS**"
        lines.append(
            f"Overall: {status} — {sum(v.passed is True for v in verdicts)} passed, "
            f"{len(failed)} failed, {sum(v.passed is None for v in verdicts)} informational."
        )
    else:
        lines.append("No torch/JAX pairs to compare yet.")
    if runs:
        versions = runs[0].get("versions", {})
        lines += [
            "",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())),
            "",
            "Both sides start from the same weights (torch's initialisation converted to Flax) and see "
            "the same batches in the same order, with the same optimizer, schedule and clipping. fp32 "
            "runs use the highest matmul precision on both sides.",
        ]
    lines += [
        "",
        "## Verdicts",
        "",
        "| model | precision | device | check | compared | value | tolerance | verdict |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for v in verdicts:
        mark = {True: "pass", False: "**FAIL**", None: "info"}[v.passed]
        lines.append(
            f"| {v.model} | {v.precision} | {v.device} | {v.check} | {v.compared} | {v.value_text} "
            f"| {v.tolerance_text} | {mark} |"
        )
    lines += [
        "",
        "## Runs",
        "",
        "Step time: median after the warm-up steps, device synced before each clock read. Compile: "
        "JAX `lower().compile()` wall time; torch.compile: the warm-up steps' excess over the median "
        "(eager torch compiles nothing). Memory: see the method column (methods below).",
        "",
        "| model | precision | run | steps | median step (ms) | p10–p90 (ms) | compile (s) | samples/s "
        "| tokens/s | peak MiB | memory method | final loss | eval | skipped | diverged | how |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: (r["model"], r["precision"], run_label(r))):
        s = run["summary"]
        med = s["step_time_median_s"]
        p10, p90 = s.get("step_time_p10_s"), s.get("step_time_p90_s")
        how = run.get("mixed_precision_method") or (
            "torch.autocast"
            if run["framework"] == "torch" and run["precision"].endswith("mixed")
            else ""
        )
        eval_text = _fmt(s["eval_metric"]) + (
            f" {s.get('eval_metric_name', '')}" if s["eval_metric"] is not None else ""
        )
        lines.append(
            f"| {run['model']} | {run['precision']} | {run_label(run)} | {s.get('steps_completed', len(run['steps']))} "
            f"| {_fmt(med and med * 1e3, '.3f')} | {_fmt(p10 and p10 * 1e3, '.3f')}–{_fmt(p90 and p90 * 1e3, '.3f')} "
            f"| {_fmt(s['compile_time_s'], '.2f')} | {_fmt(s.get('throughput_samples_per_s'), '.1f')} "
            f"| {_fmt(s.get('throughput_tokens_per_s'), '.0f')} | {_mib(s['peak_memory_bytes'])} "
            f"| {s.get('peak_memory_method') or '—'} | {_fmt(s['final_loss'])} | {eval_text} "
            f"| {s['skipped_steps']} | {_fmt(s.get('diverged'))} | {how} |"
        )
    errors = [r for r in runs if r["summary"].get("error")]
    if errors:
        lines += ["", "## Runs that raised", ""]
        for run in errors:
            lines.append(
                f"- {run['model']} {run['precision']} {run_label(run)}: `{run['summary']['error']}`"
            )
    fallbacks = [r for r in runs if r.get("autocast_fallback_reason")]
    if fallbacks:
        lines += ["", "## JAX runs that fell back from autocast to policy casting", ""]
        for run in fallbacks:
            lines.append(f"- {run['model']} {run['precision']}: {run['autocast_fallback_reason']}")
    if skipped_cells:
        lines += ["", "## Cells not run", ""]
        for cell in skipped_cells:
            lines.append(
                f"- {cell['model']} {cell['precision']} ({cell['device']}): {cell['reason']}."
            )
    diverged = [r for r in runs if r["summary"].get("diverged")]
    if diverged:
        lines += ["", "## Diverged runs", ""]
        for run in diverged:
            s = run["summary"]
            lines.append(
                f"- {run['model']} {run['precision']} {run_label(run)}: first non-finite loss at step "
                f"{s.get('first_nonfinite_step')}; {s.get('stopped_reason') or 'ran to the end'}."
            )
    from parity.measure import MEMORY_METHODS

    lines += ["", "### Memory methods", ""]
    for name, text in MEMORY_METHODS.items():
        lines.append(f"- `{name}`: {text}.")
    lines += ["", "## Plots", ""]
    for title, name in plots:
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    lines += [
        "Per-step data of every run: [steps.csv](steps.csv); raw records: [results.json](results.json).",
        "",
    ]
    path = out / "report.md"
    write_text_atomic(path, "\n".join(lines))
    return path
