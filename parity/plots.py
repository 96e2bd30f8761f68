"""The report's plots: loss curves, cross-framework gap against self-divergence, loss-scale
trajectories (speed and memory plots are `parity.speed`'s). Every figure is written atomically.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from parity.records import run_label, write_bytes_atomic
from parity.verdicts.rows import (
    TOLERANCES,
    loss_floor,
    relative_gaps,
    run_losses,
    self_divergence,
)

__all__ = ["cell_groups", "finite", "plot_divergence", "plot_loss_scales", "plot_losses"]


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


def plot_divergence(runs, path: Path) -> bool:
    """Per-step relative gap torch vs JAX and the self-divergence envelope, one panel per cell.

    Returns:
      False (no file) when no cell has both a torch/JAX pair and a calibration run.
    """
    import matplotlib.pyplot as plt

    panels = []
    for key, members in sorted(cell_groups(runs).items()):
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
        ref_l = run_losses(ref)
        gaps = relative_gaps(ref_l, run_losses(cand), loss_floor(ref_l))
        pts = [(i, g) for i, g in enumerate(gaps) if math.isfinite(g) and g > 0]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(
                xs,
                ys,
                color="tab:purple",
                lw=1.2,
                label=f"{run_label(cand)} vs {run_label(ref)}",
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
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
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
