"""fp16 loss scaling, judged by two rules (the checks ``scale`` and ``skips`` of
`parity.verdicts.checks.CHECKS`; a recipe with loss scaling names them in its
`parity.core.recipes.Recipe.verdict_checks`):

1. ``scale`` (`scale_rows`), exact: each side's recorded loss scale is torch's GradScaler rule
   applied to that side's own skip decisions (x0.5 on a skip, x2 after ``growth_interval``
   finite steps in a row, from ``init_scale``), every step. Where both sides skip alike their
   scales are then identical; where a skip flipped, each side's scale still follows its own.
2. ``skips`` (`skip_rows`): the two sides' skip decisions differ only within the flip window.
   At every step where one side skipped and the other applied the update, the applying side's
   largest |scaled gradient|, at the skipping side's loss scale, must reach float16's maximum
   to within `flip_window`: `FP16_FLIP_ULPS` float16 ulps or, with a calibration run (a main
   run and its 1-ulp noise run), `FP16_FLIP_NOISE_K` times the spread by which the model's own
   per-parameter gradient maxima move under that noise by that step. Each difference names its
   step, what overflowed on the skipping side (the parameters, or an intermediate where none or
   every one of them did) and the applying side's largest parameter.

A run with no scale event (no skip, no growth) on either side tested neither rule:
informational, never a pass. Runs record ``max_scaled_grad`` per step ({parameter: largest
|scaled gradient|}, null where non-finite) and the loss scale each step used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from parity.core.records import run_config, run_label
from parity.verdicts.rows import Row, fmt_value
from parity.verdicts.tolerances import TOLERANCES

__all__ = ["SkipDifference", "flip_window", "scale_rows", "skip_differences", "skip_rows"]

FP16_FLIP_ULPS = TOLERANCES["fp16_flip_ulps"]
FP16_FLIP_NOISE_K = TOLERANCES["fp16_flip_noise_k"]
FP16_MAX = TOLERANCES["fp16_max"]
ULP_WINDOW = FP16_FLIP_ULPS * 2.0**-11  # the flip window without a calibration run: 4 ulps

Calibration = Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]

_UNTESTED = (
    "no scale event (no skip, no growth) in {n} steps: the scaler was not exercised, so this is "
    "informational, not a pass; use the fp16 stress setting (init scale 2**20, growth interval "
    "5: `--fp16-stress`, or `fp16_stress=True` in `compare_models`)"
)


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
    return max(ULP_WINDOW, FP16_FLIP_NOISE_K * spread), spread


def _window_words(window: float, spread: float, step: int) -> str:
    if window <= ULP_WINDOW:
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


@dataclasses.dataclass(frozen=True)
class SkipDifference:
    """One step where one side skipped and the other applied its update.

    Attributes:
      step: the step.
      ratio: the applying side's largest |scaled gradient|, at the skipping side's loss scale,
        over float16's maximum (nan where no gradient maxima were recorded).
      window: the flip window at that step (`flip_window`).
      explained: ``ratio >= 1 - window``: at the skipping side's scale the applying side
        overflows too (a rounding flip), not a difference of the two sides' gradients.
      text: the step, what overflowed on the skipping side, the applying side's largest
        parameter and how close it came.
    """

    step: int
    ratio: float
    window: float
    explained: bool
    text: str


def skip_differences(ref, cand, calibration: Calibration = ()) -> list[SkipDifference]:
    """The steps where the two runs' skip decisions differ, in order, up to and including the
    first one the flip window does not explain (after it, nothing is compared).

    Example:
      >>> skip = {"skipped": True, "loss_scale": 8.0, "max_scaled_grad": {"w": None}}
      >>> applied = {"skipped": False, "loss_scale": 8.0, "max_scaled_grad": {"w": 65500.0}}
      >>> torch_run = {"framework": "torch", "steps": [skip]}
      >>> (d,) = skip_differences(torch_run, {"framework": "jax", "steps": [applied]})
      >>> d.step, d.explained
      (0, True)
    """
    out = []
    for i in range(min(len(ref["steps"]), len(cand["steps"]))):
        a, b = ref["steps"][i], cand["steps"][i]
        if bool(a.get("skipped")) == bool(b.get("skipped")):
            continue
        skipper, other = (ref, cand) if a.get("skipped") else (cand, ref)
        maxima_s = skipper["steps"][i].get("max_scaled_grad")
        maxima_o = other["steps"][i].get("max_scaled_grad")
        window, spread = flip_window(calibration, i)
        if not isinstance(maxima_s, Mapping) or not isinstance(maxima_o, Mapping):
            text = (
                f"step {i}: {run_label(skipper)} skipped, {run_label(other)} applied the step, "
                "and no gradient maxima were recorded to explain it"
            )
            out.append(SkipDifference(i, math.nan, window, False, text))
            break
        scale_s = skipper["steps"][i].get("loss_scale")
        scale_o = other["steps"][i].get("loss_scale")
        ratio = scale_s / scale_o if isinstance(scale_s, int | float) and scale_o else 1.0
        finite = {k: v for k, v in maxima_o.items() if isinstance(v, int | float)}
        name = max(finite, key=finite.get) if finite else None
        largest = finite[name] * ratio if name is not None else math.nan
        explained = math.isfinite(largest) and largest >= FP16_MAX * (1 - window)
        at = f" at {run_label(skipper)}'s scale {scale_s:g}" if ratio != 1.0 else ""
        text = (
            f"step {i}: {run_label(skipper)} skipped ({_overflow_text(maxima_s)}); "
            f"{run_label(other)} applied the step, its largest |scaled gradient| ({name}){at} "
            f"{fmt_value(largest)} = {fmt_value(largest / FP16_MAX)} of float16's max"
            + (
                f": a rounding flip (within {_window_words(window, spread, i)} of the threshold)"
                if explained
                else f": not within {_window_words(window, spread, i)} of it, so the sides' "
                "gradients differ"
            )
        )
        out.append(SkipDifference(i, largest / FP16_MAX, window, explained, text))
        if not explained:
            break
    return out


def _scale_events(steps) -> int:
    events, previous = 0, None
    for step in steps:
        scale = step.get("loss_scale")
        if step.get("skipped") or (
            previous is not None and scale is not None and scale != previous
        ):
            events += 1
        previous = scale
    return events


def _events(pair) -> tuple[int, int]:
    """(steps both runs recorded, the larger side's count of scale events among them)."""
    n = min(len(pair.ref["steps"]), len(pair.cand["steps"]))
    return n, max(_scale_events(pair.ref["steps"][:n]), _scale_events(pair.cand["steps"][:n]))


def replayed_scales(run) -> list[float]:
    """`run`'s loss scale per step as torch's GradScaler moves it from the run's own skips
    (x0.5 on a skip, x2 after ``growth_interval`` finite steps in a row, from ``init_scale``;
    the run's settings, torch's defaults where it recorded none).

    Example:
      >>> steps = [{"skipped": True}, {"skipped": False}, {"skipped": False}]
      >>> replayed_scales({"config": {"init_scale": 8.0, "growth_interval": 1}, "steps": steps})
      [8.0, 4.0, 8.0]
    """
    config = run_config(run)
    scale, interval = float(config.init_scale), config.growth_interval
    out, tracker = [], 0
    for step in run["steps"]:
        out.append(scale)
        if step.get("skipped"):
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == interval:
                grown = float(np.float32(scale * 2.0))
                scale, tracker = (grown if math.isfinite(grown) else scale), 0
    return out


def _scale_text(scale: float) -> str:
    exponent = math.log2(scale) if scale > 0 else math.nan
    return f"2**{exponent:.0f}" if exponent == round(exponent) else f"{scale:g}"


def scale_rows(pair) -> list[Row]:
    """Rule 1: each side's loss scale follows GradScaler's rule from its own skips (exact)."""
    ref, cand = pair.ref, pair.cand
    n, events = _events(pair)
    parted = []
    for run in (ref, cand):
        recorded = [s.get("loss_scale") for s in run["steps"][:n]]
        replay = replayed_scales(run)
        step = next((i for i in range(n) if recorded[i] != replay[i]), None)
        if step is not None:
            parted.append((run, step, recorded[step], replay[step]))
    first_apart = next(
        (
            i
            for i in range(n)
            if ref["steps"][i].get("loss_scale") != cand["steps"][i].get("loss_scale")
        ),
        None,
    )
    config = run_config(ref)
    rule = (
        f"GradScaler's rule from {_scale_text(config.init_scale)}: x0.5 on a skip, x2 after "
        f"{config.growth_interval} finite steps in a row"
    )
    if parted:
        run, step, recorded, replay = parted[0]
        value = f"{run_label(run)} differs from step {step}"
        detail = "; ".join(
            f"{run_label(r)} step {s}: recorded {rec}, its own skips give {rep}"
            for r, s, rec, rep in parted
        )
        passed, mode = False, "exact"
    elif not events:
        value, detail, passed, mode = "identical", _UNTESTED.format(n=n), None, "informational"
    else:
        value = "follows the rule on both sides" + (
            ", identical" if first_apart is None else f", apart from step {first_apart}"
        )
        last = [run["steps"][n - 1].get("loss_scale") for run in (ref, cand)]
        detail = (
            f"{n} steps, {events} scale events; each side's scale is {rule}, applied to its own "
            f"skips, every step; final scale {run_label(ref)} {last[0]}, "
            f"{run_label(cand)} {last[1]}"
            + (
                f" (apart from step {first_apart}: the skip decisions differ, see that row)"
                if first_apart is not None
                else ""
            )
        )
        passed, mode = True, "exact"
    return [
        Row(
            "scale",
            "loss-scale trajectory",
            value,
            "GradScaler's rule from each side's own skips",
            passed,
            detail,
            mode=mode,
            window=(0, n),
            first_failing_step=min((s for _, s, _, _ in parted), default=None),
        )
    ]


def skip_rows(pair) -> list[Row]:
    """Rule 2: the skip decisions differ only within the flip window (`pair.skips`, made by
    `skip_differences` when the pair was built)."""
    ref = pair.ref
    n, events = _events(pair)
    skipped = [i for i in range(n) if ref["steps"][i].get("skipped")]
    differences = pair.skips
    failed = [d for d in differences if not d.explained]
    steps = [d.step for d in differences]
    widest = max((d.window for d in differences), default=flip_window((), 0)[0])
    if failed:
        value = f"differ at step {failed[0].step}"
        detail = failed[0].text + (
            f"; before it, rounding flips at steps {steps[:-1][:5]}" if len(steps) > 1 else ""
        )
        passed, mode = False, "exact"
    elif differences:
        value = f"differ at steps {steps[:5]}, each a rounding flip"
        detail = "; ".join(d.text for d in differences[:3]) + (
            f"; {len(differences) - 3} more" if len(differences) > 3 else ""
        )
        passed, mode = True, "flip window"
    elif not events:
        value, detail = f"identical ({len(skipped)} skipped)", _UNTESTED.format(n=n)
        passed, mode = None, "informational"
    else:
        value = f"identical ({len(skipped)} skipped)"
        detail = f"skipped steps: {skipped[:10]}"
        passed, mode = True, "exact"
    return [
        Row(
            "skips",
            "skip decisions",
            value,
            f"identical, or apart within {widest:.3g} of float16 max (rounding flips)",
            passed,
            detail,
            mode=mode,
            window=(0, n),
            first_failing_step=failed[0].step if failed else None,
            power=widest if differences else 0.0,
        )
    ]
