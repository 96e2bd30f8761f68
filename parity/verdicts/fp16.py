"""fp16 runs whose skip decisions differ: what overflowed, whether it was a rounding flip, and
the comparison continued past a flip with the scales realigned (`parity.verdicts.judge`
adds these rows to an fp16 pair).

- `fp16_skip_rows`: the first step where the two sides' skip decisions differ. The skipping
  side's non-finite gradients are named (`_overflow_text`: the parameters, or an intermediate
  where none or every one of them overflowed); the applying side's largest |scaled gradient|
  is set against float16's maximum. Within the flip window of it (`flip_window`), it is a
  flip: `FP16_FLIP_ULPS` ulps, or, with a calibration run (a main run and its 1-ulp noise run),
  `FP16_FLIP_NOISE_K` times the spread of the per-parameter largest |scaled gradient| between
  the two by that step, the model's own rounding sensitivity (a deep fp16 model's gradient
  maxima move by percent under 1-ulp noise within a few steps; two correct implementations
  each sit about that far from the exact value, hence twice it).
- `fp16_realigned_rows`: after a flip the sides' scales differ (one backed off). Every later
  differing skip must then be explained by the two scales: the applying side's largest |scaled
  gradient| rescaled to the skipping side's scale reaches float16's maximum, to within the same
  window. Each side's recorded scale must also follow its own skips by torch's GradScaler rule.

Runs record ``max_scaled_grad`` per step ({parameter: largest |scaled gradient|}, null where
non-finite) and the loss scale each step used (`parity.training.steps`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from parity.core.records import run_label
from parity.verdicts.rows import Verdict, fmt_value, pair_fields
from parity.verdicts.tolerances import TOLERANCES

__all__ = [
    "explained_steps",
    "flip_window",
    "fp16_realigned_rows",
    "fp16_skip_rows",
]

FP16_FLIP_ULPS = TOLERANCES["fp16_flip_ulps"]
FP16_FLIP_NOISE_K = TOLERANCES["fp16_flip_noise_k"]
FP16_MAX = TOLERANCES["fp16_max"]

Calibration = Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]


def _unscaled_maxima(step: Mapping[str, Any]) -> dict[str, float]:
    maxima, scale = step.get("max_scaled_grad"), step.get("loss_scale")
    if not isinstance(maxima, Mapping) or not isinstance(scale, int | float) or scale <= 0:
        return {}
    return {
        k: v / scale
        for k, v in maxima.items()
        if isinstance(v, int | float) and math.isfinite(v) and v > 0
    }


def flip_window(calibration: Calibration, step: int) -> tuple[float, float]:
    """``(window, spread)``: how far below float16's max the applying side's largest |scaled
    gradient| may sit at `step` for a differing skip to count as a flip, relative.

    ``spread`` is the largest relative difference, over parameters and steps up to `step`, of
    a parameter's largest unscaled gradient between a main run and its 1-ulp noise run (each
    pair of `calibration`; steps either side skipped or overflowed are left out); the window is
    the larger of `FP16_FLIP_ULPS` float16 ulps and `FP16_FLIP_NOISE_K` x ``spread``.

    Example:
      >>> main = {"steps": [{"loss_scale": 4.0, "max_scaled_grad": {"w": 400.0}}]}
      >>> noisy = {"steps": [{"loss_scale": 4.0, "max_scaled_grad": {"w": 404.0}}]}
      >>> [round(x, 4) for x in flip_window([(main, noisy)], 0)]
      [0.02, 0.01]
      >>> flip_window([], 0)[0] == 4 * 2.0**-11
      True
    """
    spread = 0.0
    for main, noise in calibration:
        n = min(step + 1, len(main["steps"]), len(noise["steps"]))
        for i in range(n):
            a, b = _unscaled_maxima(main["steps"][i]), _unscaled_maxima(noise["steps"][i])
            for name, x in a.items():
                if name in b:
                    spread = max(spread, abs(b[name] - x) / x)
    return max(FP16_FLIP_ULPS * 2.0**-11, FP16_FLIP_NOISE_K * spread), spread


def _window_words(window: float, spread: float, step: int) -> str:
    if window <= FP16_FLIP_ULPS * 2.0**-11:
        return f"{FP16_FLIP_ULPS} float16 ulps"
    return (
        f"{window:.3g} ({FP16_FLIP_NOISE_K:g} x the {spread:.3g} by which a parameter's largest "
        f"gradient moves between a run and its 1-ulp noise run by step {step})"
    )


def _overflow_text(maxima: Mapping[str, Any]) -> str:
    """Which gradients were non-finite on a skipping side: named parameters, or an
    intermediate when none or every one of them was."""
    overflowed = sorted(k for k, v in maxima.items() if v is None)
    if not overflowed:
        return (
            "no parameter's gradient overflowed (every one is finite): an intermediate (an "
            "activation, its gradient, or the loss) did"
        )
    if len(overflowed) == len(maxima) and len(maxima) > 1:
        return (
            f"every parameter's gradient ({len(maxima)} of {len(maxima)}) is non-finite: the "
            "overflow came through an intermediate of the backward pass, not from one parameter"
        )
    return f"non-finite gradient of {', '.join(overflowed[:3])}"


def _largest(maxima: Mapping[str, Any]) -> float:
    return max((v for v in maxima.values() if isinstance(v, int | float)), default=math.nan)


def fp16_skip_rows(ref, cand, calibration: Calibration = ()) -> list[Verdict]:
    """Where two fp16 runs' skip decisions first differ: what overflowed on the skipping side
    (the parameters, or an intermediate: `_overflow_text`), the other side's largest |scaled
    gradient| against float16's maximum, and whether that is a flip (within `flip_window` of
    the maximum: `FP16_FLIP_ULPS` ulps, or the model's own spread from `calibration`, pairs of
    (main run, its noise run)).

    Needs the runs' per-step ``max_scaled_grad`` ({parameter: largest |scaled gradient|},
    null where non-finite); [] without it or without a difference.
    """
    n = min(len(ref["steps"]), len(cand["steps"]))
    rows = []
    for i in range(n):
        a, b = ref["steps"][i], cand["steps"][i]
        if bool(a.get("skipped")) == bool(b.get("skipped")):
            continue
        skipper, other = (ref, cand) if a.get("skipped") else (cand, ref)
        maxima_s = skipper["steps"][i].get("max_scaled_grad")
        maxima_o = other["steps"][i].get("max_scaled_grad")
        if not isinstance(maxima_s, Mapping) or not isinstance(maxima_o, Mapping):
            return rows
        largest = _largest(maxima_o)
        window, spread = flip_window(calibration, i)
        flip = math.isfinite(largest) and largest >= FP16_MAX * (1 - window)
        within = _window_words(window, spread, i)
        rows.append(
            Verdict(
                check=f"fp16 skip at step {i}",
                value=largest / FP16_MAX if math.isfinite(largest) else math.inf,
                tolerance=f">= 1 - {window:.3g} of float16 max",
                passed=None,
                detail=(
                    f"{run_label(skipper)} skipped: {_overflow_text(maxima_s)}; "
                    f"{run_label(other)} applied the step, its largest |scaled gradient| "
                    f"{fmt_value(largest)} = {fmt_value(largest / FP16_MAX)} of float16's max"
                    + (
                        f": a rounding flip (both sides within {within} of the threshold), "
                        "not a port difference"
                        if flip
                        else f": not at the threshold (not within {within} of it), so the "
                        "sides' gradients differ"
                    )
                ),
                mode="informational" if flip else "exact",
                first_failing_step=i,
                power=0.0,
                kind="fp16 skip",
                **pair_fields(ref, cand),
            )
        )
        break
    return rows


def _replayed_scales(run) -> list[float] | None:
    """`run`'s loss scale per step as torch's GradScaler moves it from the run's own skips
    (x0.5 on a skip, x2 after ``growth_interval`` finite steps in a row); None without the
    settings."""
    config = run.get("config") or {}
    steps = run["steps"]
    scale = config.get("init_scale", steps[0].get("loss_scale") if steps else None)
    interval = config.get("growth_interval")
    if not isinstance(scale, int | float) or not isinstance(interval, int) or interval < 1:
        return None
    out, tracker = [], 0
    for step in steps:
        out.append(float(scale))
        if step.get("skipped"):
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == interval:
                grown = float(np.float32(scale * 2.0))
                scale, tracker = (grown if math.isfinite(grown) else scale), 0
    return out


def _realigned(ref, cand, flip: int, calibration: Calibration):
    """After the flip at `flip`: (steps whose differing skips the realigned scales explain,
    (first unexplained step, why) or None, skips on either side, widest window used)."""
    n = min(len(ref["steps"]), len(cand["steps"]))
    unexplained, explained, events, widest = None, [], 0, (flip_window((), 0)[0], 0.0, 0)
    for i in range(flip + 1, n):
        a, b = ref["steps"][i], cand["steps"][i]
        events += bool(a.get("skipped")) + bool(b.get("skipped"))
        if bool(a.get("skipped")) == bool(b.get("skipped")):
            continue
        skipper, other = (ref, cand) if a.get("skipped") else (cand, ref)
        maxima_s = skipper["steps"][i].get("max_scaled_grad")
        maxima_o = other["steps"][i].get("max_scaled_grad")
        if not isinstance(maxima_s, Mapping) or not isinstance(maxima_o, Mapping):
            unexplained = (i, f"step {i}: skip decisions differ and no gradient maxima recorded")
            break
        scale_s = skipper["steps"][i].get("loss_scale")
        scale_o = other["steps"][i].get("loss_scale")
        ratio = scale_s / scale_o if isinstance(scale_s, int | float) and scale_o else 1.0
        rescaled = _largest(maxima_o) * ratio
        window, spread = flip_window(calibration, i)
        text = (
            f"step {i}: {run_label(skipper)} skipped ({_overflow_text(maxima_s)}) at scale "
            f"{scale_s}; {run_label(other)}'s largest |scaled gradient| at that scale "
            f"{fmt_value(rescaled)} = {fmt_value(rescaled / FP16_MAX)} of float16's max"
        )
        if math.isfinite(rescaled) and rescaled >= FP16_MAX * (1 - window):
            explained.append(i)
            widest = max(widest, (window, spread, i))
        else:
            unexplained = (
                i,
                text + f": below the threshold (not within {_window_words(window, spread, i)} "
                "of it), so the sides' gradients differ",
            )
            break
    return explained, unexplained, events, widest


def explained_steps(ref, cand, flip: int, calibration: Calibration = ()) -> list[int]:
    """The steps whose skip decisions differ and are explained, given a flip at `flip`
    (`fp16_skip_rows`' first row, informational): the flip and the later steps the realigned
    scales explain (`fp16_realigned_rows`). At these steps one side's gradients are non-finite
    by design: per-step gradient comparisons leave them to these rows.

    Example:
      >>> explained_steps({"steps": []}, {"steps": []}, flip=0)
      [0]
    """
    return [flip, *_realigned(ref, cand, flip, calibration)[0]]


def fp16_realigned_rows(ref, cand, flip: int, calibration: Calibration = ()) -> list[Verdict]:
    """The fp16 comparison continued past a rounding flip at step `flip`: the scales realigned.

    - ``skip decisions after the flip (scales realigned)``: at every later step where the
      decisions differ, the applying side's largest |scaled gradient|, rescaled to the skipping
      side's loss scale, must reach float16's maximum to within `flip_window` of that step (at
      the skipper's scale it overflows too: the scales explain the difference); else FAIL naming
      what overflowed and the step. Informational when nothing happened after the flip (no
      differing step and no skip on either side): nothing was tested.
    - ``loss-scale trajectory (each side replayed from its own skips)``: each side's recorded
      scale equals torch's GradScaler rule replayed from its own skip decisions, every step.
    """
    base = pair_fields(ref, cand)
    explained, unexplained, events, widest = _realigned(ref, cand, flip, calibration)
    if unexplained is not None:
        passed, mode, detail = False, "exact", unexplained[1]
    elif not explained and not events:
        passed, mode = None, "informational"
        detail = f"no skip on either side after step {flip}: nothing after the flip was tested"
    else:
        passed, mode = True, "exact"
        detail = (
            f"{events} skip(s) after step {flip}; differing steps {explained[:5] or 'none'}, "
            "each explained by the realigned scales (the applying side's gradient, at the "
            f"skipping side's scale, reaches float16's max to within "
            f"{_window_words(*widest)})"
        )
    rows = [
        Verdict(
            check=f"skip decisions after the flip at step {flip} (scales realigned)",
            value="explained" if passed else ("untested" if passed is None else "differ"),
            tolerance=f"each difference within {widest[0]:.3g} of float16 max",
            passed=passed,
            detail=detail,
            mode=mode,
            first_failing_step=unexplained[0] if unexplained else None,
            kind="fp16 realigned",
            **base,
        )
    ]
    mismatches = []
    for run in (ref, cand):
        replay = _replayed_scales(run)
        if replay is None:
            continue
        recorded = [s.get("loss_scale") for s in run["steps"]]
        step = next(
            (i for i, (x, y) in enumerate(zip(recorded, replay, strict=False)) if x != y), None
        )
        mismatches.append((run, step, replay))
    if mismatches:
        bad = [(run, step, replay) for run, step, replay in mismatches if step is not None]
        detail = (
            "; ".join(
                f"{run_label(run)} step {step}: recorded {run['steps'][step].get('loss_scale')}, "
                f"its own skips give {replay[step]}"
                for run, step, replay in bad
            )
            if bad
            else "each side's scale follows torch's GradScaler rule (x0.5 on a skip, x2 after "
            "the growth interval of finite steps) from its own skips, every step"
        )
        rows.append(
            Verdict(
                check="loss-scale trajectory (each side replayed from its own skips)",
                value="follows" if not bad else "differs",
                tolerance="identical",
                passed=not bad,
                detail=detail,
                mode="exact",
                first_failing_step=min((step for _, step, _ in bad), default=None),
                kind="fp16 replayed",
                **base,
            )
        )
    return rows
