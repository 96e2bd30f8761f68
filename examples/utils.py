"""Helpers shared by the examples: metrics JSON (atomic), loss plots, progress bars, flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

__all__ = [
    "add_common_flags",
    "apply_flags",
    "fetch_step_records",
    "plot_losses",
    "progress",
    "write_json_atomic",
]


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Writes JSON to a temporary file in the same folder, then renames it over `path`, so an
    interrupted run never leaves a half-written file. NaN/inf are written as null."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_finite_or_none(obj), f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def plot_losses(
    path: str | os.PathLike,
    steps: Sequence[int],
    losses: Sequence[float],
    *,
    title: str,
    loss_scales: Sequence[float | None] | None = None,
    label: str = "train loss",
    others: dict[str, Sequence[float]] | None = None,
) -> None:
    """Saves a loss curve (and the loss scale, on a log axis, when there is one) as a PNG.

    `others` adds more curves over the same steps (e.g. the torch run beside the JAX one).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, label=label, color="tab:blue")
    for name, values in (others or {}).items():
        ax.plot(steps, values, label=name, linestyle="--", alpha=0.8)
    if others:
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    if loss_scales and any(s is not None and s != 1.0 for s in loss_scales):
        ax2 = ax.twinx()
        ax2.plot(steps, loss_scales, color="tab:orange", alpha=0.6, label="loss scale")
        ax2.set_yscale("log", base=2)
        ax2.set_ylabel("loss scale")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def progress(
    iterable: Iterable[Any], *, total: int, enabled: bool, desc: str, every_s: float = 10.0
) -> Iterator[Any]:
    """Progress on stderr: a tqdm bar on a terminal; elsewhere (a log file, CI) one plain line
    every `every_s` seconds and one at the end, so a redirected run is never silent for long.
    Nothing at all when `enabled` is false."""
    if not enabled:
        yield from iterable
        return
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        yield from tqdm(iterable, total=total, desc=desc)
        return
    start = last = time.monotonic()
    done = 0
    for item in iterable:
        yield item
        done += 1
        if time.monotonic() - last >= every_s:
            last = time.monotonic()
            print(
                f"{desc}: {done}/{total} steps, {last - start:.0f} s", file=sys.stderr, flush=True
            )
    print(
        f"{desc}: {done}/{total} steps done in {time.monotonic() - start:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def add_common_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags every example takes; None means "keep the config's value"."""
    parser.add_argument("--workdir", required=True, help="where metrics.json and loss.png go")
    parser.add_argument(
        "--precision",
        help="any policy name jaxamp.get_policy accepts: fp32, bf16-mixed, fp16-mixed, "
        "bf16-true, 16-mixed, 'p=f32,c=bf16,o=f32', ...",
    )
    parser.add_argument("--num_steps", type=int)
    parser.add_argument("--batch_size", type=int)
    parser.add_argument("--learning_rate", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--no_progress", action="store_true", help="disable the progress bar")
    return parser


def apply_flags(config: Any, args: argparse.Namespace) -> Any:
    """Returns `config` with every flag that was given (not None) replacing its field."""
    fields = {f.name for f in dataclasses.fields(config)}
    updates = {
        k: v for k, v in vars(args).items() if k in fields and v is not None and k != "workdir"
    }
    if args.no_progress:
        updates["progress"] = False
    return dataclasses.replace(config, **updates)


def fetch_step_records(pending: list) -> list[dict]:
    """Host records for `(step, loss, amp_info)` triples kept on device since the last fetch.

    Training loops append device values and fetch every few steps, so logging costs one
    device-to-host transfer per batch of steps instead of a sync per step.
    """
    host = jax.device_get([(loss, info) for _, loss, info in pending])
    return [
        {
            "step": step,
            "loss": float(loss),
            "loss_scale": float(info.loss_scale),
            "skipped": not bool(info.last_step_applied),
        }
        for (step, _, _), (loss, info) in zip(pending, host, strict=True)
    ]
