"""The per-step CSV, PNG plots and the markdown report (every file written atomically).

The report opens with one bottom line per cell (parity pass/fail and why, from
`parity.compare.cell_bottom_lines`; which framework is faster and by how much, from
`parity.speed.bottom_line`), then the step-0 checks and per-layer diagnosis when the records
carry them (``run["step0"]``, ``run["diagnosis"]``: `parity.step0` / `parity.diagnose`), the
verdict table with every row's explanation, the runs, and the plots: loss curves, the
cross-framework gap against the self-divergence envelope, loss-scale trajectories, step time and
memory.

Every plot and table copes with runs that have no finite value, one step, no steps, or only one
framework: it says so in words, and ``report.md`` is always written (a plot that still cannot be
drawn is replaced by a sentence saying why).

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
    run_seed,
    run_status,
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
    "report_sections",
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
            loss, scale, time_s = step.get("loss"), step.get("loss_scale"), step.get("time_s")
            writer.writerow(
                [
                    run["model"],
                    run["precision"],
                    run["device"],
                    run_label(run),
                    step["step"],
                    "" if loss is None else repr(loss),
                    step.get("loss_finite", loss is not None),
                    "" if scale is None else repr(scale),
                    step.get("skipped", False),
                    "" if time_s is None else repr(time_s),
                ]
            )
    write_text_atomic(path, buffer.getvalue())


# --- plots -------------------------------------------------------------------------------------

_COLORS = {"torch": "tab:orange", "torch-compile": "tab:red", "jax": "tab:blue"}
_STYLES = {"torch": "-", "torch-compile": ":", "jax": "--"}


def _base_label(run) -> str:
    return run_label(run).split("~")[0]


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


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


def _say(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=8, wrap=True)


def plot_losses(runs, path: Path) -> list[str]:
    """Loss curves of every (model, precision) group, the frameworks overlaid.

    Returns:
      Notes in words for panels that have nothing to draw (no steps, no finite loss).
    """
    import matplotlib.pyplot as plt

    notes = []
    groups = _groups([r for r in runs if not r.get("variant")] or runs)
    fig, axes = _grid(len(groups))
    for ax, ((model, precision, device), members) in zip(
        axes, sorted(groups.items()), strict=False
    ):
        drawn = []
        for run in members:
            label = run_label(run)
            pts = [(s["step"], s["loss"]) for s in run["steps"] if _finite(s.get("loss"))]
            if pts:
                xs, ys = zip(*pts, strict=True)
                style = _STYLES.get(_base_label(run), "-")
                marker = "o" if len(pts) == 1 else None
                ax.plot(
                    xs,
                    ys,
                    style,
                    color=_COLORS.get(_base_label(run)),
                    label=label,
                    lw=1.2,
                    marker=marker,
                )
                drawn.extend(ys)
            bad = [s["step"] for s in run["steps"] if not _finite(s.get("loss"))]
            if bad:
                ax.axvline(
                    bad[0],
                    color=_COLORS.get(_base_label(run)),
                    alpha=0.4,
                    lw=3,
                    label=f"{label}: NaN",
                )
            if not run["steps"]:
                notes.append(f"{model} {precision} {label}: no steps recorded")
            elif not pts:
                notes.append(
                    f"{model} {precision} {label}: no finite loss in {len(run['steps'])} steps"
                )
        ax.set_title(f"{model} {precision} ({device})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (nats)")
        if drawn and min(drawn) > 0:
            ax.set_yscale("log")
        if not drawn:
            _say(ax, "no finite loss to plot")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Training loss, torch vs JAX (same weights, same batches)")
    _savefig(fig, path)
    plt.close(fig)
    return notes


def plot_divergence(runs, path: Path) -> bool:
    """Per-step relative gap torch vs JAX and the self-divergence envelope, one panel per cell.

    Returns:
      False (no file) when no cell has both a torch/JAX pair and a calibration run.
    """
    import matplotlib.pyplot as plt

    from parity.compare import TOLERANCES, _floor, _gaps, _losses, self_divergence

    panels = []
    for key, members in sorted(_groups(runs).items()):
        main = [r for r in members if not r.get("variant")]
        torch_runs = [r for r in main if r["framework"] == "torch"]
        jax_runs = [r for r in main if r["framework"] == "jax"]
        noise = [r for r in members if r.get("variant") == "noise"]
        if torch_runs and jax_runs and noise:
            panels.append((key, torch_runs[0], jax_runs[0], noise))
    if not panels:
        return False
    fig, axes = _grid(len(panels))
    for ax, ((model, precision, device), ref, cand, noise) in zip(axes, panels, strict=False):
        ref_l = _losses(ref)
        gaps = _gaps(ref_l, _losses(cand), _floor(ref_l))
        pts = [(i, g) for i, g in enumerate(gaps) if math.isfinite(g) and g > 0]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(
                xs, ys, color="tab:purple", lw=1.2, label=f"{run_label(cand)} vs {run_label(ref)}"
            )
        for run in noise:
            own = ref if run["framework"] == "torch" else cand
            env = self_divergence(own, [run]) or []
            pts = [(i, e) for i, e in enumerate(env) if math.isfinite(e) and e > 0]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(
                    xs,
                    ys,
                    color=_COLORS.get(run["framework"]),
                    ls=":",
                    lw=1.2,
                    label=f"self-divergence {run_label(run)}",
                )
        bands = [
            (0, TOLERANCES["fp32_first"]),
            (TOLERANCES["fp32_first"][0], TOLERANCES["fp32_next"]),
        ]
        for start, (stop, tol) in bands:
            ax.hlines(tol, start, stop, colors="gray", lw=0.8)
        if ax.get_legend_handles_labels()[0]:
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        else:
            _say(ax, "no finite, non-zero gap to plot")
        ax.set_title(f"{model} {precision} ({device})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("relative loss gap")
    fig.suptitle("Cross-framework gap vs the model's own self-divergence (gray: fixed bands)")
    _savefig(fig, path)
    plt.close(fig)
    return True


def plot_loss_scales(runs, path: Path) -> bool:
    """Loss-scale trajectories of the loss-scaled runs; False (no file) when there are none."""
    import matplotlib.pyplot as plt

    scaled = [
        r
        for r in runs
        if not r.get("variant")
        and any(_finite(s.get("loss_scale")) and s["loss_scale"] > 0 for s in r["steps"])
    ]
    if not scaled:
        return False
    groups = _groups(scaled)
    fig, axes = _grid(len(groups))
    for ax, ((model, precision, device), members) in zip(
        axes, sorted(groups.items()), strict=False
    ):
        for run in members:
            label = run_label(run)
            pts = [
                (s["step"], s["loss_scale"], s.get("skipped"))
                for s in run["steps"]
                if _finite(s.get("loss_scale")) and s["loss_scale"] > 0
            ]
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            ax.step(
                xs, ys, where="post", color=_COLORS.get(label), ls=_STYLES.get(label), label=label
            )
            skips = [(p[0], p[1]) for p in pts if p[2]]
            if skips:
                ax.plot(
                    *zip(*skips, strict=True),
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


def _bar_plot(runs, path: Path, value, ylabel: str, title: str) -> bool:
    import matplotlib.pyplot as plt

    runs = [r for r in runs if not r.get("variant")]
    groups = sorted(_groups(runs).items())
    labels = sorted(
        {run_label(r) for r in runs}, key=lambda x: (x != "torch", x != "torch-compile", x)
    )
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(groups) + 2), 3.6))
    drawn = False
    for i, label in enumerate(labels):
        xs, ys = [], []
        for g, (_, members) in enumerate(groups):
            for run in members:
                v = value(run)
                if run_label(run) == label and _finite(v):
                    xs.append(g + (i - (len(labels) - 1) / 2) * width)
                    ys.append(v)
        if xs:
            ax.bar(xs, ys, width=width, color=_COLORS.get(label), label=label)
            drawn = True
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{p}" for (m, p, _), _ in groups], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if drawn:
        ax.legend(fontsize=8)
    else:
        _say(ax, "no run has a measured value")
    _savefig(fig, path)
    plt.close(fig)
    return drawn


def plot_step_times(runs, path: Path) -> bool:
    """Median step time (after warm-up, synced) per run (linear axis)."""
    return _bar_plot(
        runs,
        path,
        lambda r: (
            r["summary"].get("step_time_median_s") and r["summary"]["step_time_median_s"] * 1e3
        ),
        "median step time (ms)",
        "Step time after warm-up (device synced; compile time excluded)",
    )


def plot_memory(runs, path: Path) -> bool:
    """Peak memory per run (each framework's method: see the report's table)."""
    return _bar_plot(
        runs,
        path,
        lambda r: (
            r["summary"].get("peak_memory_bytes") and r["summary"]["peak_memory_bytes"] / 2**20
        ),
        "peak memory (MiB)",
        "Peak memory of a train step (methods: see the report)",
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
    return "—" if not _finite(value) else f"{value / 2**20:.2f}"


def _ms(value: Any, spec: str = ".3f") -> str:
    return "—" if not _finite(value) else format(value * 1e3, spec)


def _speed():
    try:
        from parity import speed
    except ImportError:  # parity.speed not installed in this checkout: the plain plots are used
        return None
    return speed


def _speed_sentence(members) -> str | None:
    speed = _speed()
    main = [r for r in members if not r.get("variant") and run_status(r) == "completed"]
    jax_run = next((r for r in main if r["framework"] == "jax" and r["steps"]), None)
    torch_run = next((r for r in main if r["framework"] == "torch" and r["steps"]), None)
    if jax_run is None or torch_run is None:
        return None
    if speed is not None:
        try:
            return speed.bottom_line(jax_run, torch_run)
        except Exception as e:  # a speed figure must not cost the parity report
            return f"speed: not computed ({type(e).__name__}: {e})"
    a = jax_run["summary"].get("step_time_median_s")
    b = torch_run["summary"].get("step_time_median_s")
    if not (_finite(a) and _finite(b)) or a <= 0 or b <= 0:
        return None
    faster, ratio = ("JAX", b / a) if a < b else (run_label(torch_run), a / b)
    return f"{faster} {ratio:.2f}x faster (median step {a * 1e3:.3g} ms JAX, {b * 1e3:.3g} ms {run_label(torch_run)})"


def report_sections(runs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The markdown of the "Step 0" and "Diagnosis" sections, from the run records.

    A record may carry ``step0`` (`parity.step0.Step0Result.to_dict()`: ``summary``,
    ``verdicts``, ``diagnosis``) and ``diagnosis`` (`parity.diagnose.Diagnosis.to_dict()`, e.g.
    made after a trajectory failure). Each distinct one is rendered once.

    Example:
      >>> report_sections([])
      {'Step 0': [], 'Diagnosis': []}
    """
    step0_lines: list[str] = []
    diagnosis_lines: list[str] = []
    seen: set[str] = set()

    def add_diagnosis(where: str, diagnosis: Any) -> None:
        if not isinstance(diagnosis, dict):
            return
        text = diagnosis.get("markdown") or ""
        key = where + text
        if key in seen:
            return
        seen.add(key)
        first = diagnosis.get("first_failing")
        diagnosis_lines.extend(
            [
                f"### {where}",
                "",
                f"First diverging layer: **{first}** ({diagnosis.get('first_failing_kind')}, "
                f"{diagnosis.get('first_failing_stage')})."
                if first
                else "Every layer agrees within its band.",
                "",
            ]
        )
        if text:
            diagnosis_lines.extend([text, ""])

    for run in runs:
        where = f"{run['model']} {run['precision']} ({run['device']})"
        step0 = run.get("step0")
        if isinstance(step0, dict):
            summary = step0.get("summary")
            line = f"- {where}: {summary}" if summary else None
            if line and line not in step0_lines:
                step0_lines.append(line)
            add_diagnosis(f"{where}, step 0", step0.get("diagnosis"))
        add_diagnosis(where, run.get("diagnosis"))
    return {"Step 0": step0_lines, "Diagnosis": diagnosis_lines}


def _try_plot(plots, notes, title, name, draw) -> None:
    try:
        result = draw()
    except Exception as e:  # a plot never costs the report: say which and why
        notes.append(f"{title}: not drawn ({type(e).__name__}: {e})")
        return
    if result is False:
        return
    if isinstance(result, list):
        notes.extend(result)
    plots.append((title, name))


def write_report(
    out_dir: str | os.PathLike,
    runs: list[dict[str, Any]],
    verdicts: list[Any],
    *,
    skipped_cells: list[dict[str, str]] | None = None,
) -> Path:
    """Writes ``report.md``, ``steps.csv`` and the PNG plots into `out_dir`; returns the report path.

    Args:
      out_dir: the folder (created if missing).
      runs: the run records (results.json's ``runs``).
      verdicts: `parity.compare.Verdict` rows for them.
      skipped_cells: cells the matrix did not run, with the reason.

    Returns:
      The path of ``report.md``. It is written whatever the runs hold (no steps, no finite
      value, one framework only): what cannot be shown is said in words.

    Example:
      >>> # path = write_report("runs/x", runs, compare_runs(runs))
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from parity.compare import cell_bottom_lines, overall_status

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_steps_csv(runs, out / "steps.csv")
    plots: list[tuple[str, str]] = []
    notes: list[str] = []
    speed = _speed()
    main_runs = [r for r in runs if not r.get("variant")]
    if runs:
        _try_plot(
            plots,
            notes,
            "Loss curves",
            "loss_curves.png",
            lambda: plot_losses(runs, out / "loss_curves.png"),
        )
        _try_plot(
            plots,
            notes,
            "Cross-framework gap and self-divergence",
            "divergence.png",
            lambda: plot_divergence(runs, out / "divergence.png"),
        )
        _try_plot(
            plots,
            notes,
            "Loss-scale trajectories (x: skipped steps)",
            "loss_scale.png",
            lambda: plot_loss_scales(runs, out / "loss_scale.png"),
        )
        step_plot = speed.plot_step_times if speed is not None else plot_step_times
        memory_plot = speed.plot_memory if speed is not None else plot_memory
        _try_plot(
            plots,
            notes,
            "Step time",
            "step_time.png",
            lambda: step_plot(main_runs, out / "step_time.png"),
        )
        _try_plot(
            plots,
            notes,
            "Peak memory",
            "memory.png",
            lambda: memory_plot(main_runs, out / "memory.png"),
        )
    plt.close("all")

    failed = [v for v in verdicts if v.passed is False]
    status = overall_status(verdicts)
    lines = ["# PyTorch vs JAX parity report", ""]
    counts = (
        f"{sum(v.passed is True for v in verdicts)} passed, {len(failed)} failed, "
        f"{sum(v.passed is None for v in verdicts)} informational"
    )
    if status == "NOTHING COMPARED":
        lines.append(
            f"Overall: **NOTHING COMPARED** — no torch/JAX pair could be compared ({counts}); "
            "this is not a pass."
        )
    else:
        lines.append(f"Overall: **{status}** — {counts}.")
    if not runs:
        lines += ["", "No runs recorded."]
    bottom = cell_bottom_lines(verdicts)
    groups = _groups(runs)
    if bottom or groups:
        lines += ["", "## Bottom line", ""]
        for key in sorted(set(bottom) | set(groups)):
            model, precision, device = key
            parity_text = bottom.get(key, "nothing judged")
            speed_text = _speed_sentence(groups.get(key, []))
            lines.append(
                f"- **{model} {precision} ({device})**: {parity_text}."
                + (f" Speed: {speed_text}." if speed_text else "")
            )
    if runs:
        versions = runs[0].get("versions", {})
        lines += [
            "",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())),
            "",
            "Both sides start from the same weights (torch's initialisation converted to Flax) and see "
            "the same batches in the same order, with the same optimizer, schedule and clipping. fp32 "
            "runs use the highest matmul precision on both sides. Relative loss gaps are divided by "
            "max(|torch loss|, 1% of the first loss): a loss trained to ~0 never makes a 100% gap. "
            "Modes: *fixed bands* (1e-4 for steps 0-9, 1e-3 for 10-29); *noise-calibrated* (k x the "
            "self-divergence of 1-ulp-perturbed calibration runs, where that exceeds the bands); "
            "*seed statistics* (Welch's t-test over K data seeds, 95% confidence).",
        ]
    sections = report_sections(runs)
    for title, body in sections.items():
        if body:
            lines += ["", f"## {title}", "", *body]
    lines += [
        "",
        "## Verdicts",
        "",
        "| model | precision | device | check | compared | value | tolerance | mode | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        mark = {True: "pass", False: "**FAIL**", None: "info"}[v.passed]
        lines.append(
            f"| {v.model} | {v.precision} | {v.device} | {v.check} | {v.compared} | {v.value_text} "
            f"| {v.tolerance_text} | {v.mode} | {mark} |"
        )
    explained = [v for v in verdicts if v.detail]
    if explained:
        lines += ["", "Why:", ""]
        for v in explained:
            mark = {True: "pass", False: "FAIL", None: "info"}[v.passed]
            lines.append(f"- {mark} {v.model} {v.precision} — {v.check}: {v.detail}")
    lines += [
        "",
        "## Runs",
        "",
        "Step time: median after the warm-up steps, device synced before each clock read. Compile: "
        "JAX `lower().compile()` wall time; torch.compile: the warm-up steps' excess over the median "
        "(eager torch compiles nothing). Memory: see the method column (methods below).",
        "",
        "| model | precision | run | seed | status | steps | median step (ms) | p10–p90 (ms) | compile (s) "
        "| samples/s | tokens/s | peak MiB | memory method | final loss | eval | skipped | diverged | how |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: (r["model"], r["precision"], run_label(r), run_seed(r))):
        s = run["summary"]
        how = run.get("mixed_precision_method") or (
            "torch.autocast"
            if run["framework"] == "torch" and run["precision"].endswith("mixed")
            else ""
        )
        eval_value = s.get("eval_metric")
        eval_text = _fmt(eval_value) + (
            f" {s.get('eval_metric_name', '')}" if eval_value is not None else ""
        )
        lines.append(
            f"| {run['model']} | {run['precision']} | {run_label(run)} | {run_seed(run)} | {run_status(run)} "
            f"| {s.get('steps_completed', len(run['steps']))} "
            f"| {_ms(s.get('step_time_median_s'))} | {_ms(s.get('step_time_p10_s'))}–{_ms(s.get('step_time_p90_s'))} "
            f"| {_fmt(s.get('compile_time_s'), '.2f')} | {_fmt(s.get('throughput_samples_per_s'), '.1f')} "
            f"| {_fmt(s.get('throughput_tokens_per_s'), '.0f')} | {_mib(s.get('peak_memory_bytes'))} "
            f"| {s.get('peak_memory_method') or '—'} | {_fmt(s.get('final_loss'))} | {eval_text} "
            f"| {s.get('skipped_steps', 0)} | {_fmt(s.get('diverged'))} | {how} |"
        )
    empty = [
        r
        for r in runs
        if run_status(r) == "completed" and not any(_finite(st.get("loss")) for st in r["steps"])
    ]
    if empty or notes:
        lines += ["", "## What the plots cannot show", ""]
        for run in empty:
            lines.append(
                f"- {run['model']} {run['precision']} {run_label(run)}: "
                + (
                    "no steps recorded."
                    if not run["steps"]
                    else f"no finite loss in {len(run['steps'])} steps."
                )
            )
        for note in notes:
            if not any(
                note.startswith(f"{r['model']} {r['precision']} {run_label(r)}") for r in empty
            ):
                lines.append(f"- {note}.")
    lonely = sorted(
        key
        for key, members in groups.items()
        if len({r["framework"] for r in members if run_status(r) != "unsupported"}) == 1
    )
    if lonely:
        lines += ["", "## Cells with one framework only (nothing compared)", ""]
        for model, precision, device in lonely:
            present = ", ".join(sorted({run_label(r) for r in groups[(model, precision, device)]}))
            lines.append(f"- {model} {precision} ({device}): only {present}.")
    errors = [r for r in runs if r["summary"].get("error")]
    if errors:
        lines += ["", "## Runs that raised", ""]
        for run in errors:
            lines.append(
                f"- {run['model']} {run['precision']} {run_label(run)}: `{run['summary']['error']}`"
            )
    unsupported = [r for r in runs if run_status(r) == "unsupported"]
    if unsupported or skipped_cells:
        lines += ["", "## Unsupported here / cells not run", ""]
        for run in unsupported:
            lines.append(
                f"- {run['model']} {run['precision']} {run_label(run)}: {run.get('reason')}."
            )
        for cell in skipped_cells or []:
            lines.append(
                f"- {cell['model']} {cell['precision']} ({cell['device']}): {cell['reason']}."
            )
    fallbacks = [r for r in runs if r.get("autocast_fallback_reason")]
    if fallbacks:
        lines += ["", "## JAX runs that fell back from autocast to policy casting", ""]
        for run in fallbacks:
            lines.append(f"- {run['model']} {run['precision']}: {run['autocast_fallback_reason']}")
    diverged = [r for r in runs if r["summary"].get("diverged")]
    if diverged:
        lines += ["", "## Diverged runs", ""]
        for run in diverged:
            s = run["summary"]
            lines.append(
                f"- {run['model']} {run['precision']} {run_label(run)}: first non-finite loss at step "
                f"{s.get('first_nonfinite_step')}; {s.get('stopped_reason') or 'ran to the end'}."
            )
    if speed is not None and main_runs:
        for name in ("speed_section", "memory_section", "hardware_section"):
            try:
                section = getattr(speed, name)(main_runs)
            except Exception as e:  # the parity report stands without the speed tables
                section = [f"({name} not available: {type(e).__name__}: {e})"]
            if section:
                lines += ["", *section]
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
