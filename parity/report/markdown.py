"""The per-step CSV, PNG plots and the markdown report (every file written atomically).

The report opens with one bottom line per cell (parity pass/fail and why, from
`parity.verdicts.outcomes.cell_bottom_lines`; which framework is faster and by how much, from
`parity.perf.speed.bottom_line`), then the step-0 checks and per-layer diagnosis when the records
carry them (``run["step0"]``, ``run["diagnosis"]``: `parity.verdicts.step0` / `parity.verdicts.diagnose`), the
verdict table with every row's explanation, the runs, and the plots: loss curves, the
cross-framework gap against the self-divergence envelope, loss-scale trajectories, step time and
memory.

Every plot and table copes with runs that have no finite value, one step, no steps, or only one
framework: it says so in words, and ``report.md`` is always written (a plot that still cannot be
drawn is replaced by a sentence saying why).

The run-record schema, ``results.json`` loading/merging and the atomic writers live in
`parity.core.records`.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any

from parity.core.records import (
    MEMORY_METHODS,
    comparable_labels,
    run_label,
    run_seed,
    run_status,
    write_text_atomic,
)
from parity.perf import speed
from parity.perf.phases import current, phase
from parity.report.memory import memory_section
from parity.report.plots import (
    cell_groups,
    finite,
    plot_divergence,
    plot_gaps,
    plot_loss_scales,
    plot_losses,
    plot_memory,
    plot_step_times,
)
from parity.report.timing import phases_section
from parity.verdicts.outcomes import cell_bottom_lines, cell_configs, overall_status, verdict_mark
from parity.verdicts.rows import EXCEEDED, fmt_value

__all__ = ["report_sections", "speed_ratios", "write_report", "write_steps_csv"]

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
    "grad_norm",
    "update_norm",
)


def write_steps_csv(runs: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """One row per step of every run (atomic)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(STEP_COLUMNS)
    for run in runs:
        for step in run["steps"]:
            loss, scale, time_s = (
                step.get("loss"),
                step.get("loss_scale"),
                step.get("time_s"),
            )
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
                    *(
                        "" if step.get(f) is None else repr(step[f])
                        for f in ("grad_norm", "update_norm")
                    ),
                ]
            )
    write_text_atomic(path, buffer.getvalue())


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
    return "—" if not finite(value) else f"{value / 2**20:.2f}"


def _ms(value: Any, spec: str = ".3f") -> str:
    return "—" if not finite(value) else format(value * 1e3, spec)


def speed_ratios(members) -> dict[str, str]:
    """One JAX/torch speed figure per compared pair of a cell's completed main runs: each JAX
    side against the torch side of its arm (`parity.core.records.comparable_labels`), so a
    distributed cell gets one per JAX mode (``"jax:jit ddp vs torch ddp"``,
    ``"jax:multiprocess ddp vs torch ddp"``) and a single-device cell one (``"jax vs torch"``),
    each `parity.perf.speed.bottom_line`'s text.

    Example:
      >>> steps = [{"time_s": t} for t in [1.0] * 12]
      >>> run = {"model": "m", "precision": "fp32", "device": "cpu", "config": {}, "steps": steps}
      >>> sides = [dict(run, framework="torch", distributed="torch ddp", arm="ddp")] + [
      ...     dict(run, framework="jax", distributed=f"jax:{m} ddp", arm="ddp")
      ...     for m in ("jit", "multiprocess")]
      >>> list(speed_ratios(sides))
      ['jax:jit ddp vs torch ddp', 'jax:multiprocess ddp vs torch ddp']
    """
    main: dict[str, Any] = {}
    for run in members:
        if not run.get("variant") and run_status(run) == "completed" and run["steps"]:
            main.setdefault(run_label(run), run)  # the first of a label, as the cell's own
    out = {}
    for torch_label, jax_label in comparable_labels(list(main.values())):
        try:
            text = speed.bottom_line(main[jax_label], main[torch_label])
        except Exception as e:  # a speed figure must not cost the parity report
            text = f"speed: not computed ({type(e).__name__}: {e})"
        out[f"{jax_label} vs {torch_label}"] = text
    return out


def _speed_sentence(members) -> str | None:
    """The bottom line's speed: the one pair's figure, or each pair's, named (one per JAX mode
    of a distributed cell)."""
    ratios = speed_ratios(members)
    if len(ratios) <= 1:
        return next(iter(ratios.values()), None)
    return "; ".join(f"{pair}: {text}" for pair, text in ratios.items())


def report_sections(runs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The markdown of the "Step 0" and "Diagnosis" sections, from the run records.

    A record may carry ``step0`` (`parity.verdicts.step0.Step0Result.to_dict()`: ``summary``,
    ``verdicts``, ``diagnosis``) and ``diagnosis`` (`parity.verdicts.diagnose.Diagnosis.to_dict()`, e.g.
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
                (
                    "First divergence: the input of "
                    if diagnosis.get("first_failing_input")
                    else "First diverging layer: "
                )
                + f"**{first}** ({diagnosis.get('first_failing_kind')}, "
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


def _draw_plots(runs, out: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """Draws the PNG plots; returns ``(title, file)`` of each drawn and notes on what was not."""
    import matplotlib  # heavy; the backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots: list[tuple[str, str]] = []
    notes: list[str] = []
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
            "Gap per step: loss, gradient norm, update norm",
            "gaps.png",
            lambda: plot_gaps(runs, out / "gaps.png"),
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
        _try_plot(
            plots,
            notes,
            "Step time",
            "step_time.png",
            lambda: plot_step_times(main_runs, out / "step_time.png"),
        )
        _try_plot(
            plots,
            notes,
            "Peak memory",
            "memory.png",
            lambda: plot_memory(main_runs, out / "memory.png"),
        )
    plt.close("all")
    return plots, notes


def _header(runs, verdicts) -> list[str]:
    """The title and the overall status line."""
    lines: list[str] = []
    failed = [v for v in verdicts if v.passed is False]
    status = overall_status(verdicts)
    lines += ["# PyTorch vs JAX parity report", ""]
    inconclusive = sum(v.mode == "inconclusive" for v in verdicts)
    exceeded = sum(v.mode == EXCEEDED for v in verdicts)
    counts = (
        f"{sum(v.passed is True for v in verdicts)} passed, {len(failed)} failed, "
        f"{exceeded} exceeded (excused, undecided), {inconclusive} inconclusive (no power), "
        f"{sum(v.passed is None for v in verdicts) - inconclusive - exceeded} informational"
    )
    if status == "NOTHING COMPARED":
        lines.append(
            f"Overall: **NOTHING COMPARED** — no torch/JAX pair could be compared ({counts}); "
            "this is not a pass."
        )
    elif status == "INCONCLUSIVE":
        lines.append(
            f"Overall: **INCONCLUSIVE** — nothing failed, but some cell has no check that could "
            f"have failed past step 0 ({counts}); this is not a pass: the bottom line gives the "
            "command that decides."
        )
    else:
        lines.append(f"Overall: **{status}** — {counts}.")
    if not runs:
        lines += ["", "No runs recorded."]
    return lines


def _bottom_lines(verdicts, groups) -> list[str]:
    """One line per cell: parity and speed."""
    lines: list[str] = []
    # each cell's deciding command reruns the cell's own run (its config) with the deciding
    # options added
    configs = cell_configs([r for members in groups.values() for r in members])
    bottom = cell_bottom_lines(verdicts, configs)
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
    return lines


def _method_note(runs) -> list[str]:
    """Versions, and how both sides are set up and judged."""
    lines: list[str] = []
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
            "Modes: *fixed bands* (1e-4 for steps 0-9, 1e-3 from step 10 to the end); "
            "*noise-calibrated* (k x the self-divergence of 1-ulp-perturbed calibration runs, "
            "where that exceeds the bands; the steps whose tolerance stays within the bound decide, "
            "those after that horizon are inconclusive); *seed statistics* (an equivalence test, "
            "TOST: the 90% interval of the difference within the margin; Welch's t-test shown). "
            "*Could detect*: each row's power, the smallest relative difference it could have "
            "seen; a row above its bound (relative error 1 for outputs and gradients, 20% for "
            "losses) is *inconclusive*, never a pass. PASS needs, in every cell, a passing row "
            "with power past step 0.",
        ]
    return lines


def _detail_sections(runs) -> list[str]:
    """Step-0 and diagnosis sections (`report_sections`)."""
    lines: list[str] = []
    sections = report_sections(runs)
    for title, body in sections.items():
        if body:
            lines += ["", f"## {title}", "", *body]
    return lines


def _mapping_sections(runs) -> list[str]:
    """How the weights were paired (`parity.automap.explain` rows in the records), per model."""
    lines: list[str] = []
    shown: set[str] = set()
    for run in runs:
        rows = run.get("weight_mapping")
        if not rows or run.get("model") in shown:
            continue
        shown.add(run.get("model"))
        lines += [
            "",
            f"## Weight mapping ({run.get('model')})",
            "",
            "Each torch tensor, its Flax leaf and how the pair was decided: by name, by the "
            "order the layers run in (execution order), by what they compute (function), as the "
            "only candidate of its type and shape, or by a rule.",
        ]
        folded = [r["torch"] for r in rows if r.get("folded_into")]
        if folded:
            lines += ["", f"**Folded trainable tensors** ({', '.join(folded)}): see the notes."]
        lines += ["", "| torch | Flax | transform | decided by | note |", "|---|---|---|---|---|"]
        for r in rows:
            cells = (
                r["torch"],
                r["flax"] or "-",
                r["transform"] or "-",
                r["decided_by"],
                r["note"],
            )
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return lines


def _verdict_table(verdicts) -> list[str]:
    """Every verdict row, then why."""
    lines: list[str] = []
    lines += [
        "",
        "## Verdicts",
        "",
        "| model | precision | device | check | compared | value | tolerance | could detect "
        "| mode | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        mark = verdict_mark(v)
        mark = f"**{mark}**" if mark in ("FAIL", "exceeded", "inconclusive") else mark
        lines.append(
            f"| {v.model} | {v.precision} | {v.device} | {v.check} | {v.compared} | {v.value_text} "
            f"| {v.tolerance_text} | {fmt_value(v.power)} | {v.mode} | {mark} |"
        )
    explained = [v for v in verdicts if v.detail]
    if explained:
        lines += ["", "Why:", ""]
        for v in explained:
            mark = verdict_mark(v)
            lines.append(f"- {mark} {v.model} {v.precision} — {v.check}: {v.detail}")
    return lines


def _runs_table(runs) -> list[str]:
    """One row per run: timings, memory, losses."""
    lines: list[str] = []
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
        how = run.get("mixed_precision_method") or ""
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
    return lines


def _optimizer_state_table(runs) -> list[str]:
    """Optimizer-state bytes per trainable parameter of each run, measured from its state
    objects (`parity.perf.measure.torch_optimizer_state` / `jax_optimizer_state`)."""
    measured = [r for r in runs if r["summary"].get("optimizer_state_bytes") is not None]
    if not measured:
        return []
    lines = [
        "",
        "## Optimizer state",
        "",
        "Bytes held by the optimizer's state (moments, codes, block scales, quantization maps, "
        "step counters; the loss scale is not optimizer state), measured from the state objects "
        "after the run, and per trainable parameter.",
        "",
        "| model | precision | run | seed | state bytes | bytes/param | parameters | how measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(
        measured, key=lambda r: (r["model"], r["precision"], run_label(r), run_seed(r))
    ):
        s = run["summary"]
        lines.append(
            f"| {run['model']} | {run['precision']} | {run_label(run)} | {run_seed(run)} "
            f"| {s['optimizer_state_bytes']:,} | {_fmt(s.get('optimizer_state_bytes_per_param'), '.3f')} "
            f"| {s.get('param_count', 0):,} | {s.get('optimizer_state_method') or '—'} |"
        )
    return lines


def _cannot_show(runs, notes) -> list[str]:
    """Runs and plots with nothing to draw."""
    lines: list[str] = []
    empty = [
        r
        for r in runs
        if run_status(r) == "completed" and not any(finite(st.get("loss")) for st in r["steps"])
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
    return lines


def _problem_sections(runs, groups, skipped_cells) -> list[str]:
    """Lonely cells, runs that raised, unsupported cells, diverged runs."""
    lines: list[str] = []
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
    diverged = [r for r in runs if r["summary"].get("diverged")]
    if diverged:
        lines += ["", "## Diverged runs", ""]
        for run in diverged:
            s = run["summary"]
            lines.append(
                f"- {run['model']} {run['precision']} {run_label(run)}: first non-finite loss at step "
                f"{s.get('first_nonfinite_step')}; {s.get('stopped_reason') or 'ran to the end'}."
            )
    return lines


def _speed_sections(runs) -> list[str]:
    """The speed, memory and hardware tables (`parity.perf.speed`, `parity.report.memory`)."""
    lines: list[str] = []
    main_runs = [r for r in runs if not r.get("variant")]
    if main_runs:
        for make in (speed.speed_section, memory_section, speed.hardware_section):
            try:
                section = make(main_runs)
            except Exception as e:  # the parity report stands without the speed tables
                section = [f"({make.__name__} not available: {type(e).__name__}: {e})"]
            if section:
                lines += ["", *section]

    return lines


def _timing_section(groups, rendering) -> list[str]:
    """Each cell's phases (`parity.report.timing`), with this report's own plots when timed."""
    lines = phases_section(groups, rendering.as_records() if rendering is not None else None)
    return ["", *lines] if lines else []


def _plot_gallery(plots) -> list[str]:
    """The memory methods, the plots and the raw files."""
    lines: list[str] = []
    lines += ["", "### Memory methods", ""]
    for name, text in MEMORY_METHODS.items():
        lines.append(f"- `{name}`: {text}.")
    lines += ["", "## Plots", ""]
    if plots is None:
        lines += [
            "Not drawn (`--no-plots`): `python -m parity compare DIR` draws them from "
            "results.json.",
            "",
        ]
    for title, name in plots or []:
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    lines += [
        "Per-step data of every run: [steps.csv](steps.csv); raw records: [results.json](results.json).",
        "",
    ]
    return lines


def write_report(
    out_dir: str | os.PathLike,
    runs: list[dict[str, Any]],
    verdicts: list[Any],
    *,
    skipped_cells: list[dict[str, str]] | None = None,
    plots: bool = True,
) -> Path:
    """Writes ``report.md``, ``steps.csv`` and the PNG plots into `out_dir`; returns the report path.

    Args:
      out_dir: the folder (created if missing).
      runs: the run records (results.json's ``runs``).
      verdicts: `parity.verdicts.rows.Verdict` rows for them.
      skipped_cells: cells the matrix did not run, with the reason.
      plots: draw the PNG plots (False: the report says how to draw them later, ``compare``).

    Returns:
      The path of ``report.md``. It is written whatever the runs hold (no steps, no finite
      value, one framework only): what cannot be shown is said in words.

    Example:
      >>> # path = write_report("runs/x", runs, compare_runs(runs))
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_steps_csv(runs, out / "steps.csv")
    drawn: list[tuple[str, str]] | None = None
    notes: list[str] = []
    if plots:
        with phase("plots"):
            drawn, notes = _draw_plots(runs, out)
    groups = cell_groups(runs)
    rendering = current()
    lines = [
        *_header(runs, verdicts),
        *_bottom_lines(verdicts, groups),
        *_method_note(runs),
        *_detail_sections(runs),
        *_mapping_sections(runs),
        *_verdict_table(verdicts),
        *_runs_table(runs),
        *_optimizer_state_table(runs),
        *_cannot_show(runs, notes),
        *_problem_sections(runs, groups, skipped_cells),
        *_speed_sections(runs),
        *_timing_section(groups, rendering),
        *_plot_gallery(drawn),
    ]
    path = out / "report.md"
    write_text_atomic(path, "\n".join(lines))
    return path
