"""The report's plots: loss curves, cross-framework gap against self-divergence, loss-scale
trajectories, step time and peak memory. Every figure is written atomically.

The step-time and memory charts carry the caveats the text carries (`parity.perf.speed`): a panel whose
speed figure is not quotable says so in red (UNRELIABLE, NOT REPRODUCIBLE HERE, NO RATIO), and
memory figures measured by different methods (torch's profiler against XLA's buffer plan) never
share an axis.
"""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path

import numpy as np

from parity.core.records import run_label, write_bytes_atomic
from parity.perf import speed
from parity.verdicts.gaps import self_divergence
from parity.verdicts.judge import judged_pairs
from parity.verdicts.tolerances import POWER_BOUNDS, TOLERANCES

__all__ = [
    "cell_groups",
    "decimate",
    "finite",
    "memory_panels",
    "plot_divergence",
    "plot_gaps",
    "plot_loss_scales",
    "plot_losses",
    "plot_memory",
    "plot_step_times",
    "step_time_caveat",
]


_COLORS = {"torch": "tab:orange", "torch-compile": "tab:red", "jax": "tab:blue"}


_STYLES = {"torch": "-", "torch-compile": ":", "jax": "--"}


def _base_label(run) -> str:
    return run_label(run).split("~")[0]


def finite(x) -> bool:
    """A real, finite number (not a bool)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def cell_groups(runs):
    """Runs grouped by (model, precision, device)."""
    groups: dict[tuple, list] = {}
    for run in runs:
        groups.setdefault((run["model"], run["precision"], run["device"]), []).append(run)
    return groups


# Fixed margins, in inches: a layout pass (tight_layout) or a tight bounding box renders every
# artist once more, which cost more than the drawing itself (measured: 4.1 of 4.5 CPU s for a
# two-framework cell's plots).
_MARGINS = {"left": 0.9, "right": 0.25, "bottom": 0.55, "top": 0.4, "title_line": 0.24}
_DPI = 90


def _savefig(fig, path: Path) -> None:
    """Writes `fig` as PNG with fixed margins (one render; the Agg canvas), atomically."""
    width, height = fig.get_size_inches()
    top = _MARGINS["top"]
    if fig._suptitle is not None:  # wrapped to the figure's width, room made for its lines
        text = fig._suptitle.get_text()
        lines = textwrap.wrap(text, max(int(width * 11), 20)) or [""]
        fig._suptitle.set_text("\n".join(lines))
        fig._suptitle.set_y(1 - 0.12 / height)
        fig._suptitle.set_va("top")
        top += _MARGINS["title_line"] * len(lines)
    fig.subplots_adjust(
        left=min(_MARGINS["left"] / width, 0.4),
        right=1 - _MARGINS["right"] / width,
        bottom=min(_MARGINS["bottom"] / height, 0.4),
        top=max(1 - top / height, 0.5),
        wspace=0.4,
        hspace=0.55,
    )
    # Atomic like every other output: render to bytes, then replace.
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI)
    write_bytes_atomic(path, buffer.getvalue())


# A line drawn across a panel this many pixels wide shows no more than two values per pixel
# column (the smallest and the largest): longer series are decimated to that before drawing.
_PANEL_PIXELS = 400


def decimate(xs, ys, pixels: int = _PANEL_PIXELS) -> tuple[list, list]:
    """At most ``2 * pixels`` points of a series: in each of `pixels` runs of consecutive points,
    the smallest and the largest (in step order), so spikes and the envelope stay as drawn.

    Example:
      >>> xs, ys = decimate(list(range(1000)), [0.0] * 499 + [5.0] + [0.0] * 500, pixels=10)
      >>> len(xs) <= 20, max(ys)
      (True, 5.0)
    """
    xs, ys = list(xs), list(ys)
    if len(xs) <= 2 * pixels:
        return xs, ys
    edges = np.linspace(0, len(xs), pixels + 1).astype(int)
    out_x, out_y = [], []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        if hi <= lo:
            continue
        chunk = ys[lo:hi]
        keep = sorted({lo + int(np.argmin(chunk)), lo + int(np.argmax(chunk))})
        out_x += [xs[k] for k in keep]
        out_y += [ys[k] for k in keep]
    return out_x, out_y


def _grid(n: int):
    import matplotlib.pyplot as plt

    cols = min(4, max(n, 1))
    rows = math.ceil(max(n, 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows + 0.6), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _say(ax, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=8,
        wrap=True,
    )


def plot_losses(runs, path: Path) -> list[str]:
    """Loss curves of every (model, precision) group, the frameworks overlaid.

    Returns:
      Notes in words for panels that have nothing to draw (no steps, no finite loss).
    """
    import matplotlib.pyplot as plt

    notes = []
    groups = cell_groups([r for r in runs if not r.get("variant")] or runs)
    fig, axes = _grid(len(groups))
    for ax, ((model, precision, device), members) in zip(
        axes, sorted(groups.items()), strict=False
    ):
        drawn = []
        for run in members:
            label = run_label(run)
            pts = [(s["step"], s["loss"]) for s in run["steps"] if finite(s.get("loss"))]
            if pts:
                xs, ys = decimate(*zip(*pts, strict=True))
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
            bad = [s["step"] for s in run["steps"] if not finite(s.get("loss"))]
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


def _pair_panels(runs, *, with_steps: bool) -> list[tuple]:
    """``(cell key, torch main run, JAX main run, the judged pair)`` of every cell with a pair
    the verdicts judged (`parity.verdicts.judge.judged_pairs`: the same runs, gaps, tolerances
    and calibration runs; its first pair where a cell has several), in cell order
    (`with_steps`: runs that recorded steps only)."""
    panels, seen = [], set()
    for pair in judged_pairs(runs):
        if pair.cell in seen or with_steps and not (pair.ref["steps"] and pair.cand["steps"]):
            continue
        seen.add(pair.cell)
        panels.append((pair.cell, pair.ref, pair.cand, pair))
    return panels


def plot_divergence(runs, path: Path) -> bool:
    """Per-step relative gap torch vs JAX and the self-divergence envelope, one panel per cell.

    Returns:
      False (no file) when no cell has both a torch/JAX pair and a calibration run.
    """
    import matplotlib.pyplot as plt

    panels = [p for p in _pair_panels(runs, with_steps=False) if p[3].noise]
    if not panels:
        return False
    fig, axes = _grid(len(panels))
    for ax, ((model, precision, device), ref, cand, pair) in zip(axes, panels, strict=False):
        gaps, noise = pair.gaps, pair.noise
        pts = [(i, g) for i, g in enumerate(gaps) if math.isfinite(g) and g > 0]
        if pts:
            xs, ys = decimate(*zip(*pts, strict=True))
            ax.plot(
                xs,
                ys,
                color="tab:purple",
                lw=1.2,
                label=f"{run_label(cand)} vs {run_label(ref)}",
            )
        for run in noise:
            own = ref if run["framework"] == "torch" else cand
            env = self_divergence([run], {run["framework"]: own}) or []
            pts = [(i, e) for i, e in enumerate(env) if math.isfinite(e) and e > 0]
            if pts:
                xs, ys = decimate(*zip(*pts, strict=True))
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


def plot_gaps(runs, path: Path) -> bool:
    """Gap per step, one panel per cell with a torch/JAX pair: the relative loss gap, and the
    gradient-norm and update-norm gaps where the records carry them, on a log axis against the
    loss tolerance of each step the verdicts used (`parity.verdicts.judge.Pair.tolerances`: with
    the pair's self-divergence where calibration runs exist). Unlike the loss curves, it shows a
    1e-4 gap.

    Returns:
      False (no file) when no cell has a torch/JAX pair.
    """
    import matplotlib.pyplot as plt

    panels = _pair_panels(runs, with_steps=True)
    if not panels:
        return False
    fig, axes = _grid(len(panels))
    for ax, ((model, precision, device), ref, cand, pair) in zip(axes, panels, strict=False):
        gaps = pair.gaps
        series = [("loss", gaps, "tab:purple")]
        for field, color in (("grad_norm", "tab:green"), ("update_norm", "tab:orange")):
            a = [s.get(field) for s in ref["steps"]]
            b = [s.get(field) for s in cand["steps"]]
            series.append(
                (
                    field.replace("_", " "),
                    [
                        abs(x - y) / abs(x) if finite(x) and finite(y) and x else math.nan
                        for x, y in zip(a, b, strict=False)
                    ],
                    color,
                )
            )
        for label, values, color in series:
            pts = [(i, g) for i, g in enumerate(values) if finite(g) and g > 0]
            if pts:
                xs, ys = decimate(*zip(*pts, strict=True))
                ax.plot(xs, ys, color=color, lw=1.2, marker=".", ms=3, label=f"{label} gap")
        tolerance = pair.tolerances
        ax.step(
            *decimate(range(len(tolerance)), tolerance),
            where="mid",
            color="gray",
            lw=0.8,
            label="loss tolerance",
        )
        bound = POWER_BOUNDS["loss"]
        ax.axhline(bound, color="red", ls=":", lw=0.8, label=f"power bound {bound:.0%}")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_title(f"{model} {precision} ({device})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("relative gap, jax vs torch")
    fig.suptitle(
        "Gap per step (gray: the loss tolerance of each step; red: the bound above which a check decides nothing)"
    )
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
        and any(finite(s.get("loss_scale")) and s["loss_scale"] > 0 for s in r["steps"])
    ]
    if not scaled:
        return False
    groups = cell_groups(scaled)
    fig, axes = _grid(len(groups))
    for ax, ((model, precision, device), members) in zip(
        axes, sorted(groups.items()), strict=False
    ):
        for run in members:
            label = run_label(run)
            pts = [
                (s["step"], s["loss_scale"], s.get("skipped"))
                for s in run["steps"]
                if finite(s.get("loss_scale")) and s["loss_scale"] > 0
            ]
            # A step line changes value only where the scale does: those points draw it exactly.
            changes = [
                k for k, p in enumerate(pts) if k in (0, len(pts) - 1) or p[1] != pts[k - 1][1]
            ]
            xs = [pts[k][0] for k in changes]
            ys = [pts[k][1] for k in changes]
            ax.step(
                xs,
                ys,
                where="post",
                color=_COLORS.get(label),
                ls=_STYLES.get(label),
                label=label,
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


# --- step time and memory -----------------------------------------------------------------------


def _speed_pair(members):
    """The cell's (first) JAX run and torch reference (eager first), or None."""
    reference, jax = speed.torch_reference(members), speed.jax_labels(members)
    return (members[jax[0]], reference[1]) if jax and reference is not None else None


def step_time_caveat(members) -> str | None:
    """What a cell's step-time panel must say beside its bars (None: a quotable ratio).

    Args:
      members: label -> run record of one cell (`parity.perf.speed.cells`).

    Returns:
      e.g. ``"NOT REPRODUCIBLE HERE: the block ratios span 2.00x ..."``, ``"UNRELIABLE: ..."``,
      ``"NO RATIO: machine oversubscribed ..."``; for one framework alone, None.

    Example:
      >>> step_time_caveat({}) is None
      True
    """
    pair = _speed_pair(members)
    if pair is None:
        return None
    try:
        figure = speed.speed_figure(*pair)
    except ValueError as e:  # timings a figure cannot be made of: the panel says so
        return f"NO RATIO: {e}"
    if figure["status"] == "ratio":
        return None
    mark = speed.SPEED_MARKS[figure["status"]]
    verdict = figure["verdict"] or {}
    if verdict.get("reason"):
        return f"{mark}: {verdict['reason']}"
    if figure["status"] == "unreliable":
        return f"{mark}: " + "; ".join(
            speed.reliability_warnings(pair[0]) + speed.reliability_warnings(pair[1])
        )
    return mark


def _block_stats(members):
    """Per framework, the median of its block medians and the block range (the alternating-block
    timing of the cell), or None when the cell has none."""
    pair = _speed_pair(members)
    trial = pair and (pair[1].get("speed_blocks") or pair[0].get("speed_blocks"))
    if not trial or not isinstance(trial.get("times"), dict):
        return None
    out = {}
    for label, key in ((_base_label(pair[1]), "torch"), (_base_label(pair[0]), "jax")):
        medians = [float(np.median(b)) for b in trial["times"].get(key) or [] if b]
        if medians:
            out[label] = (float(np.median(medians)), min(medians), max(medians))
    return out or None


def plot_step_times(runs, path) -> bool:
    """Step time per framework, one panel per cell, linear axis from 0, values printed.

    With an alternating-block timing (`parity.training.blocks`) the bars are the median of the block
    medians and the whiskers the range of the block medians (the between-block spread the ratio's
    interval includes); otherwise each run's median with its bootstrap 95% CI. A panel whose
    figure is not quotable carries `step_time_caveat` in red. With no timings at all the PNG says
    so (never a crash).

    Returns:
      True when at least one bar was drawn.

    Example:
      >>> # plot_step_times(load_results("runs/x")["runs"], "runs/x/step_time.png")
    """
    import matplotlib.pyplot as plt

    path = Path(path)
    grouped = speed.cells(runs)
    if not grouped:
        _empty(path, "no completed runs with step times")
        return False
    fig, axes = _grid(len(grouped))
    for ax, ((model, precision, device), members) in zip(axes, grouped.items(), strict=False):
        blocks = _block_stats(members)
        labels = speed.ordered_labels(members)
        if blocks:
            labels = [lb for lb in labels if lb in blocks]
            stats = [blocks[lb] for lb in labels]
            xlabel = "ms: median of block medians (whiskers: block range)"
        else:
            stats = [speed.median_ci(speed.measured_times(members[lb])) for lb in labels]
            xlabel = "median step time, ms (95% CI)"
        medians = [1e3 * m for m, _, _ in stats]
        errors = [[1e3 * (m - lo) for m, lo, _ in stats], [1e3 * (hi - m) for m, _, hi in stats]]
        ys = range(len(labels))
        colors = [_COLORS.get(lb, "gray") for lb in labels]
        ax.barh(ys, medians, xerr=errors, capsize=4, color=colors)
        right = max(1e3 * hi for _, _, hi in stats)
        for y, (m, _, hi) in zip(ys, stats, strict=True):
            ax.text(1e3 * hi + 0.02 * right, y, f"{1e3 * m:.3g} ms", va="center", fontsize=8)
        ax.set_xlim(0, 1.3 * right)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        caveat = step_time_caveat(members)
        ax.set_title(
            f"{model} {precision} ({device})", fontsize=9, color="red" if caveat else "black"
        )
        if caveat:
            ax.text(
                0.5,
                0.5,
                "\n".join(textwrap.wrap(caveat, 40)),
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=7,
                color="red",
                bbox={"facecolor": "white", "edgecolor": "red", "alpha": 0.85},
            )
        ax.set_xlabel(xlabel, fontsize=8)
    fig.suptitle("Step time after warm-up (linear axis; red: not a figure to quote)")
    _savefig(fig, path)
    plt.close(fig)
    return True


_ALLOCATOR_PEAKS = {"torch_cuda_max_memory_allocated", "jax_gpu_peak_bytes_in_use"}


def memory_panels(runs) -> list[tuple[str, list[tuple[str, float, str]]]]:
    """The memory chart's panels: bars share a panel only when measured comparably.

    Device-allocator peaks (torch CUDA, JAX GPU) share one; any other method (torch's profiler
    on CPU, XLA's buffer plan) gets a panel of its own, with its own axis, so a profiler's bytes
    never stand beside a compiled plan's as if they compared (`parity.perf.speed.memory_comparability`).

    Returns:
      ``[(title, [(label, MiB, method), ...]), ...]``.

    Example:
      >>> memory_panels([])
      []
    """
    panels = []
    for (model, precision, device), members in speed.cells(runs).items():
        classes: dict[str, list] = {}
        for label in speed.ordered_labels(members):
            summary = members[label]["summary"]
            peak = summary.get("peak_memory_bytes") or 0
            if not (finite(peak) and peak > 0):
                continue
            method = summary.get("peak_memory_method") or "?"
            kind = "allocator peaks" if method in _ALLOCATOR_PEAKS else method
            classes.setdefault(kind, []).append((label, peak / 2**20, method))
        for kind, bars in classes.items():
            alone = len(classes) > 1
            title = f"{model} {precision} ({device})\n{kind}" + (
                " (not comparable with its neighbour)" if alone else ""
            )
            panels.append((title, bars))
    return panels


def plot_memory(runs, path) -> bool:
    """Peak memory in MiB, linear axes, values printed: one panel per cell and measuring method
    (`memory_panels`). Returns True when at least one bar was drawn.

    Example:
      >>> # plot_memory(load_results("runs/x")["runs"], "runs/x/memory.png")
    """
    import matplotlib.pyplot as plt

    path = Path(path)
    panels = memory_panels(runs)
    if not panels:
        _empty(path, "no completed runs with memory figures")
        return False
    fig, axes = _grid(len(panels))
    for ax, (title, bars) in zip(axes, panels, strict=False):
        labels = [label for label, _, _ in bars]
        values = [value for _, value, _ in bars]
        ys = range(len(bars))
        ax.barh(ys, values, color=[_COLORS.get(lb, "gray") for lb in labels])
        right = max(values)
        for y, value in zip(ys, values, strict=True):
            ax.text(value + 0.02 * right, y, f"{value:.3g} MiB", va="center", fontsize=8)
        ax.set_xlim(0, 1.4 * right)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("peak MiB", fontsize=8)
    fig.suptitle("Peak memory of a train step: bars share a panel only when measured alike")
    _savefig(fig, path)
    plt.close(fig)
    return True


def _empty(path: Path, text: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 1.2))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")
    _savefig(fig, path)
    plt.close(fig)
