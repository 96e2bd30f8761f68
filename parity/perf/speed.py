"""Speed and memory figures a study can quote: confidence intervals, bottom lines, honest charts.

For every (model, precision, device) cell with a JAX run and a torch run:

- the figure a study can quote comes from alternating blocks (`parity.training.blocks`: torch block,
  JAX block, torch, JAX... in one process, same threads): `block_verdict` takes the JAX/torch
  ratio of the block medians of every round and gives their geometric mean with a t-interval
  over the rounds, so the between-block spread is inside the interval; it says "not
  reproducible here" when the blocks disagree beyond it and refuses a ratio (with the reason)
  when other processes held the cores (`oversubscribed`);
- each framework's median step time (the steps after the run's timing warm-up) with a bootstrap
  95% confidence interval (`median_ci`), and the JAX/torch ratio of medians with its own
  interval (`ratio_ci`, both samples resampled independently);
- a bottom-line sentence (`speed_figure`, `bottom_line`): "JAX 1.37x slower than torch eager
  (95% CI 1.21-1.52; 6 alternating blocks); torch's bf16 is emulated on this CPU", with the
  hardware caveats that explain the figure; a figure that is not quotable (not reproducible,
  refused, or unreliable sequential runs) leads with that status, never with a ratio;
- the speed and hardware sections of the report (`speed_section`, `hardware_section`); the
  memory section is `parity.report.memory`'s, the charts that carry the same caveats
  `parity.report.plots`'.

`speed_section` and `hardware_section` return markdown lines for
``parity.report.markdown``. Runs are the records of ``results.json`` (see ``parity.core.records``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import jaxamp
from parity.core.hardware import hardware_summary
from parity.core.recipes import get_recipe
from parity.core.records import run_label

__all__ = [
    "CI_WIDTH_LIMIT",
    "MIN_BLOCKS",
    "QUOTABLE",
    "REPRO_SPREAD_LIMIT",
    "SPEED_MARKS",
    "SPREAD_LIMIT",
    "block_verdict",
    "blocks_verdict",
    "bottom_line",
    "cell_caveats",
    "cells",
    "hardware_section",
    "measured_times",
    "median_ci",
    "oversubscribed",
    "ratio_ci",
    "reliability_warnings",
    "speed_figure",
    "speed_section",
    "torch_reference",
]

# A figure is flagged unreliable when its 95% CI is wider than this fraction of the median...
CI_WIDTH_LIMIT = 0.2
# ...or its p90/p10 step-time spread exceeds this factor.
SPREAD_LIMIT = 2.0
MIN_STEPS = 10
# Alternating blocks: an interval over rounds needs at least this many of them...
MIN_BLOCKS = 3
# ...and when the rounds' JAX/torch ratios span more than this factor, the machine moved the
# figure more than any interval over so few rounds can hold: "not reproducible here". (Five
# identical GPT-2 runs gave ratios 0.95-1.94 with non-overlapping intervals: a 2x spread.)
REPRO_SPREAD_LIMIT = 1.5
# A timing is refused when other processes left fewer free cores than the threads each framework
# ran with, minus this margin (background daemons use a little of any machine).
OVERSUBSCRIBED_MARGIN = 0.5
# The order runs are listed and drawn in within a cell.


# --- statistics --------------------------------------------------------------------------------


def _as_sample(name: str, values: Sequence[float]) -> np.ndarray:
    sample = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if sample.ndim != 1 or sample.size == 0:
        raise ValueError(f"{name}: need at least one timing; got {list(values)!r}.")
    if not np.all(np.isfinite(sample)):
        raise ValueError(f"{name}: timings must be finite; got {list(values)!r}.")
    return sample


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"`confidence` must be in (0, 1); got {confidence!r}.")


def _bootstrap(data, statistic, *, seed: int, **kwargs):
    """scipy.stats.bootstrap with a seeded generator (``rng=`` from scipy 1.15, ``random_state=``
    before: GPU images may carry an older scipy)."""
    from scipy.stats import bootstrap

    try:
        return bootstrap(data, statistic, rng=np.random.default_rng(seed), **kwargs)
    except TypeError:
        return bootstrap(data, statistic, random_state=np.random.default_rng(seed), **kwargs)


def median_ci(
    times: Sequence[float], *, confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """The median of `times` with a percentile-bootstrap confidence interval.

    Args:
      times: step times (any unit).
      confidence: the interval's coverage (default 95%).
      n_resamples: bootstrap resamples (scipy.stats.bootstrap).
      seed: the resampling seed (reproducible intervals).

    Returns:
      ``(median, low, high)``; with one timing the interval is that value.

    Raises:
      ValueError: no timings, a non-finite timing, or `confidence` outside (0, 1).

    Example:
      >>> median, low, high = median_ci([1.0, 1.1, 0.9, 1.05, 0.95])
      >>> low <= median <= high
      True
    """
    _check_confidence(confidence)
    sample = _as_sample("median_ci", times)
    median = float(np.median(sample))
    if sample.size < 2 or np.ptp(sample) == 0:
        return median, median, median
    result = _bootstrap(
        (sample,),
        np.median,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        seed=seed,
    )
    low, high = result.confidence_interval
    return median, float(low), float(high)


def ratio_ci(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """median(numerator) / median(denominator) with a bootstrap confidence interval.

    The two samples are resampled independently (they come from different processes' steps).

    Args:
      numerator: e.g. JAX step times.
      denominator: e.g. torch step times.
      confidence, n_resamples, seed: as in `median_ci`.

    Returns:
      ``(ratio, low, high)``.

    Raises:
      ValueError: an empty or non-finite sample, a zero median denominator.

    Example:
      >>> ratio, low, high = ratio_ci([2.0, 2.2, 1.9, 2.1], [1.0, 1.05, 0.98, 1.02])
      >>> 1.8 < low <= ratio <= high < 2.3
      True
    """
    _check_confidence(confidence)
    a = _as_sample("ratio_ci numerator", numerator)
    b = _as_sample("ratio_ci denominator", denominator)
    if np.median(b) <= 0:
        raise ValueError(f"ratio_ci: the denominator's median must be > 0; got {np.median(b)!r}.")
    ratio = float(np.median(a) / np.median(b))
    if (a.size < 2 or np.ptp(a) == 0) and (b.size < 2 or np.ptp(b) == 0):
        return ratio, ratio, ratio

    def statistic(x, y, axis=-1):
        return np.median(x, axis=axis) / np.median(y, axis=axis)

    result = _bootstrap(
        (a, b),
        statistic,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        paired=False,
        vectorized=True,
        seed=seed,
    )
    low, high = result.confidence_interval
    return ratio, float(low), float(high)


def oversubscribed(
    others_cores: float | None,
    cores: int | None,
    threads: int | None,
    load_average: float | None = None,
) -> str | None:
    """Why a timing on this machine cannot give a ratio (other processes held the cores), or None.

    Args:
      others_cores: cores' worth of CPU other processes used while the blocks ran
        (`parity.perf.measure.time_blocks`' ``others_cpu_cores_total``); None where not measurable.
      cores: the cores this process could run on.
      threads: intra-op threads each framework ran with.
      load_average: the 1-minute load average, used only when `others_cores` is None.

    Example:
      >>> oversubscribed(1.4, 2, 2)
      'machine oversubscribed: other processes used 1.4 of the 2 cores while the blocks ran, leaving 0.6 for 2 threads per framework'
      >>> oversubscribed(0.1, 2, 2) is None
      True
    """
    if not cores:
        return None
    threads = threads or cores
    if others_cores is not None:
        free = cores - others_cores
        if free < threads - OVERSUBSCRIBED_MARGIN:
            return (
                f"machine oversubscribed: other processes used {others_cores:.1f} of the {cores} "
                f"cores while the blocks ran, leaving {max(free, 0.0):.1f} for {threads} threads "
                "per framework"
            )
        return None
    if load_average is not None and load_average > cores:
        return (
            f"machine oversubscribed: 1-minute load {load_average:.1f} on {cores} cores (other "
            "processes' CPU use is not measurable here)"
        )
    return None


def _block_medians(name: str, blocks: Sequence[Sequence[float]]) -> np.ndarray:
    if isinstance(blocks, str | bytes) or len(blocks) == 0:
        raise ValueError(f"block_verdict: `{name}` must be a list of blocks; got {blocks!r}.")
    medians = np.asarray([np.median(_as_sample(f"{name} block", b)) for b in blocks])
    if np.any(medians <= 0):
        raise ValueError(f"block_verdict: `{name}` step times must be > 0; got {blocks!r}.")
    return medians


def block_verdict(
    jax_blocks: Sequence[Sequence[float]],
    torch_blocks: Sequence[Sequence[float]],
    *,
    refused: str | None = None,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """The JAX/torch step-time ratio of alternating blocks, or why there is none.

    Round i pairs JAX's block i with torch's block i (adjacent in time); its ratio is the ratio of
    the two blocks' median step times. The figure is the geometric mean of the rounds' ratios with
    a Student-t interval over the rounds (on the log scale), so load that moved between rounds
    widens the interval instead of hiding in it.

    Statuses:

    - ``"refused"``: `refused` says why (`oversubscribed`), or fewer than `MIN_BLOCKS` rounds;
    - ``"not reproducible"``: the rounds disagree beyond the interval: their ratios span more than
      `REPRO_SPREAD_LIMIT`, or some round puts the other framework ahead while the interval
      excludes 1;
    - ``"ratio"``: ``ratio``, ``low``, ``high`` are quotable.

    Args:
      jax_blocks: JAX's step times, one list per block.
      torch_blocks: torch's, as many blocks.
      refused: a reason to refuse the ratio (the machine was oversubscribed), or None.
      confidence: the interval's coverage.

    Returns:
      ``{"status", "ratio", "low", "high", "block_ratios", "reason", "blocks"}`` (``ratio``,
      ``low``, ``high`` None unless the status is ``"ratio"``).

    Raises:
      ValueError: empty, non-finite or non-positive timings, unequal block counts, or
        `confidence` outside (0, 1).

    Example:
      >>> verdict = block_verdict([[2.0, 2.1]] * 4, [[1.0, 1.05]] * 4)
      >>> verdict["status"], round(verdict["ratio"], 2)
      ('ratio', 2.0)
    """
    _check_confidence(confidence)
    jax_medians = _block_medians("jax_blocks", jax_blocks)
    torch_medians = _block_medians("torch_blocks", torch_blocks)
    if jax_medians.size != torch_medians.size:
        raise ValueError(
            f"block_verdict: as many JAX blocks as torch blocks needed; got {jax_medians.size} "
            f"and {torch_medians.size}."
        )
    ratios = jax_medians / torch_medians
    out: dict[str, Any] = {
        "status": "ratio",
        "ratio": None,
        "low": None,
        "high": None,
        "block_ratios": [float(r) for r in ratios],
        "reason": None,
        "blocks": int(ratios.size),
    }
    if refused:
        return {**out, "status": "refused", "reason": refused}
    if ratios.size < MIN_BLOCKS:
        return {
            **out,
            "status": "refused",
            "reason": f"only {ratios.size} alternating blocks (an interval over blocks needs "
            f"{MIN_BLOCKS})",
        }
    from scipy.stats import t as student_t  # on first use: scipy.stats takes ~0.5 s to import

    logs = np.log(ratios)
    half = float(
        student_t.ppf((1 + confidence) / 2, logs.size - 1) * logs.std(ddof=1) / math.sqrt(logs.size)
    )
    ratio = float(np.exp(logs.mean()))
    low, high = float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))
    spread = float(ratios.max() / ratios.min())
    against = (high < 1 and ratios.max() > 1) or (low > 1 and ratios.min() < 1)
    if spread > REPRO_SPREAD_LIMIT or against:
        why = (
            f"the block ratios span {spread:.2f}x (limit {REPRO_SPREAD_LIMIT}x)"
            if spread > REPRO_SPREAD_LIMIT
            else "some blocks put the other framework ahead"
        )
        return {
            **out,
            "status": "not reproducible",
            "reason": f"{why}: JAX/torch {ratios.min():.2f}-{ratios.max():.2f} by block, beyond "
            f"their {100 * confidence:.0f}% CI {low:.2f}-{high:.2f}",
        }
    return {**out, "ratio": ratio, "low": low, "high": high}


# --- runs and cells ----------------------------------------------------------------------------


def _completed(run: Mapping[str, Any]) -> bool:
    status = run.get("status") or ("error" if run.get("summary", {}).get("error") else "completed")
    return status == "completed" and not run.get("variant")


def measured_times(run: Mapping[str, Any]) -> list[float]:
    """The step times a run's median is taken over: after its timing warm-up, finite ones.

    Example:
      >>> run = {"config": {"timing_warmup": 1}, "steps": [{"time_s": 9.0}, {"time_s": 1.0}]}
      >>> measured_times(run)
      [1.0]
    """
    times = [s.get("time_s") for s in run.get("steps", [])]
    times = [t for t in times if t is not None and math.isfinite(t)]
    warmup = int((run.get("config") or {}).get("timing_warmup", 0))
    warmup = min(warmup, max(len(times) - 1, 0))
    return times[warmup:]


def cells(runs: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Completed runs grouped by (model, precision, device), keyed by `run_label` within a cell:
    ``"torch"``, ``"torch-compile"``, ``"jax"``; a distributed cell's sides by arm and JAX mode
    (``"torch ddp"``, ``"jax:jit ddp"``, ``"jax:shard_map ddp"``), each JAX mode its own member.

    Example:
      >>> cells([])
      {}
    """
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for run in runs:
        if _completed(run) and measured_times(run):
            key = (run["model"], run["precision"], run["device"])
            out.setdefault(key, {})[run_label(run)] = run
    return dict(sorted(out.items()))


def _is_compiled(run: Mapping[str, Any]) -> bool:
    return run.get("torch_mode") == "compile"


def ordered_labels(members: Mapping[str, Any]) -> list[str]:
    """A cell's labels in table order: torch eager, torch.compile, then each JAX mode.

    Example:
      >>> ordered_labels({"jax": {"framework": "jax"}, "torch": {"framework": "torch"}})
      ['torch', 'jax']
    """
    return sorted(
        members,
        key=lambda label: (
            members[label]["framework"] != "torch",
            _is_compiled(members[label]),
            label,
        ),
    )


def jax_labels(members: Mapping[str, Any]) -> list[str]:
    """A cell's JAX members: ``["jax"]`` on one device, one per JAX mode of a distributed arm.

    Example:
      >>> jax_labels({"torch ddp": {"framework": "torch"}, "jax:jit ddp": {"framework": "jax"},
      ...             "jax:shard_map ddp": {"framework": "jax"}})
      ['jax:jit ddp', 'jax:shard_map ddp']
    """
    return [label for label in ordered_labels(members) if members[label]["framework"] == "jax"]


def _compute_dtype(run: Mapping[str, Any]) -> str:
    """The compute dtype of the run's policy: the record's, else its recipe's."""
    spec = run.get("policy") or (run.get("config") or {}).get("policy")
    try:
        policy = jaxamp.get_policy(spec) if spec else get_recipe(run.get("precision", "")).policy
    except ValueError:
        return "float32"
    return policy.compute_dtype.name


# The mark of each status of a cell's speed figure (`speed_figure`) that is not a quotable ratio:
# the bottom line, the Speed table and the step-time plot all carry the same one.
SPEED_MARKS = {
    "unreliable": "UNRELIABLE",
    "not reproducible": "NOT REPRODUCIBLE HERE",
    "refused": "NO RATIO",
    "sequential": "sequential runs: indicative only",
}
QUOTABLE = ("ratio", "sequential")


def _probe_withheld(run: Mapping[str, Any], probe: Mapping[str, Any]) -> str | None:
    """Why torch's matmul probe must not be quoted: measured on an oversubscribed machine (its
    own load above the cores). None when it may be."""
    load = probe.get("load_average")
    cores = ((run.get("hardware") or {}).get("cpu") or {}).get("available_cpus")
    if load is not None and cores and load > cores:
        return f"measured at load {load:.1f} on {cores} cores"
    return None


def cell_caveats(run: Mapping[str, Any], withheld: str | None = None) -> list[str]:
    """Hardware facts that explain a cell's speed (what a reader must know before quoting it).

    Args:
      run: the torch run of the cell.
      withheld: the mark of the cell's speed figure when it is not quotable (``"NO RATIO"``...):
        a timing measured alongside it (torch's matmul probe) is withheld with the same mark,
        never quoted beside a refused ratio.

    Example:
      >>> cell_caveats({"device": "cpu", "precision": "bf16-mixed", "framework": "torch",
      ...               "hardware": {"torch_bf16_emulated": True}})[0]
      "torch's bf16 is emulated on this CPU (no AVX512-BF16/AMX kernels)"
    """
    if run.get("device") != "cpu":
        return []
    hardware = run.get("hardware") or {}
    dtype = _compute_dtype(run)
    out = []
    if dtype == "bfloat16" and hardware.get("torch_bf16_emulated"):
        out.append("torch's bf16 is emulated on this CPU (no AVX512-BF16/AMX kernels)")
    if dtype in ("float16", "bfloat16"):
        probe = (run.get("speed_blocks") or {}).get("torch_probe") or {}
        why = _probe_withheld(run, probe) if probe.get("ratio_to_fp32") else None
        if probe.get("ratio_to_fp32") and (withheld or why):
            out.append(
                f"torch's {dtype} matmul time against float32 not quoted "
                f"({withheld or 'NO RATIO'}: "
                + (why or "measured under the same conditions as the withheld step times")
                + ")"
            )
        elif probe.get("ratio_to_fp32"):
            load = probe.get("load_average")
            out.append(
                f"torch's {dtype} matmul takes {probe['ratio_to_fp32']:.3g}x its float32 time on "
                f"this CPU (n={probe['n']}, measured"
                + ("" if load is None else f" at load {load:.1f}")
                + ")"
            )
        elif dtype == "float16":
            out.append(
                "torch's float16 CPU speed against its float32 was not measured for these runs "
                "(it ranges from par to >100x slower by CPU; the alternating-block timing probes it)"
            )
    if dtype != "float32":
        out.append("XLA:CPU computes bf16/fp16 dots in float32 (no low-precision speed-up for JAX)")
    return out


def reliability_warnings(run: Mapping[str, Any]) -> list[str]:
    """Why a run's step-time figure may not be quotable (empty when it is).

    Flags fewer than 10 timed steps, a 95% CI wider than 20% of the median, a p90/p10 spread
    above 2x, a 1-minute load average above the available cores when the run was recorded, and
    unequal thread counts between the frameworks.

    Example:
      >>> reliability_warnings({"steps": [{"time_s": 1.0}] * 3, "config": {}, "framework": "jax"})
      ['jax: only 3 timed steps']
    """
    label = run_label(run)
    times = measured_times(run)
    out = []
    if len(times) < MIN_STEPS:
        out.append(f"{label}: only {len(times)} timed steps")
    if times:
        median, low, high = median_ci(times)
        if median > 0 and (high - low) / median > CI_WIDTH_LIMIT:
            out.append(
                f"{label}: 95% CI of the median spans {100 * (high - low) / median:.0f}% of it"
            )
        p10, p90 = np.percentile(times, [10, 90])
        if p10 > 0 and p90 / p10 > SPREAD_LIMIT:
            out.append(f"{label}: p90/p10 step-time spread {p90 / p10:.1f}x")
    hardware = run.get("hardware") or {}
    cpu = hardware.get("cpu") or {}
    load = (cpu.get("load_average") or [None])[0]
    cores = cpu.get("available_cpus")
    if load is not None and cores and load > cores:
        out.append(f"{label}: machine load {load:.1f} on {cores} cores")
    torch_info, jax_info = hardware.get("torch") or {}, hardware.get("jax") or {}
    if run.get("device") == "cpu" and torch_info and jax_info:
        a, b = torch_info.get("intra_op_threads"), jax_info.get("cpu_intra_op_threads")
        if a is not None and b is not None and a != b:
            out.append(f"{label}: unequal threads (torch {a}, XLA:CPU {b})")
    return out


def torch_reference(members: Mapping[str, Any]) -> tuple[str, Any] | None:
    """``(label, run)`` of a cell's torch run that JAX is compared with: eager first, else
    torch.compile; None when the cell has neither.

    Example:
      >>> torch_reference({"jax": {"framework": "jax"}}) is None
      True
    """
    torch = [label for label in ordered_labels(members) if members[label]["framework"] == "torch"]
    return (torch[0], members[torch[0]]) if torch else None


def _mode_name(torch_run: Mapping[str, Any]) -> str:
    mode = "torch.compile" if _is_compiled(torch_run) else "torch eager"
    arm = torch_run.get("arm")
    return f"{mode} ({arm})" if arm and arm != "single" else mode


def _blocks_of(jax_run: Mapping[str, Any], torch_run: Mapping[str, Any]) -> Mapping | None:
    """The alternating-block timing of this pair (its torch mode must be the torch run's)."""
    for run in (torch_run, jax_run):
        trial = run.get("speed_blocks")
        if isinstance(trial, Mapping) and trial.get("torch_label", "torch") == run_label(torch_run):
            return trial
    return None


def blocks_verdict(trial: Mapping[str, Any]) -> dict[str, Any]:
    """`block_verdict` of a recorded alternating-block timing (``run["speed_blocks"]``), refused
    when the machine was oversubscribed, the frameworks ran with unequal threads or the timing
    failed (its ``error``)."""
    if trial.get("error"):
        reason = str(trial["error"])
        return {
            "status": "refused",
            "ratio": None,
            "low": None,
            "high": None,
            "block_ratios": [],
            "reason": reason,
            "blocks": 0,
        }
    threads = trial.get("threads") or {}
    torch_threads = threads.get("torch_intra_op_threads")
    xla_threads = threads.get("xla_cpu_intra_op_threads")
    refused = None
    if trial.get("device", "cpu") == "cpu" and torch_threads and xla_threads:
        if torch_threads != xla_threads:
            refused = f"unequal threads (torch {torch_threads}, XLA:CPU {xla_threads})"
    refused = refused or oversubscribed(
        trial.get("others_cpu_cores_total"),
        threads.get("available_cpus"),
        max(torch_threads or 1, xla_threads or 1) if trial.get("device", "cpu") == "cpu" else 1,
        (trial.get("load_average_before") or [None])[0],
    )
    times = trial.get("times") or {}
    return block_verdict(times.get("jax") or [], times.get("torch") or [], refused=refused)


def _ratio_words(mode: str, ratio: float, low: float, high: float, detail: str = "") -> str:
    if low <= 1.0 <= high:
        return (
            f"no clear difference between JAX and {mode}: step-time ratio {ratio:.2f} "
            f"(95% CI {low:.2f}-{high:.2f}{detail})"
        )
    if ratio > 1:
        return f"JAX {ratio:.2f}x slower than {mode} (95% CI {low:.2f}-{high:.2f}{detail})"
    return f"JAX {1 / ratio:.2f}x faster than {mode} (95% CI {1 / high:.2f}-{1 / low:.2f}{detail})"


def speed_figure(jax_run: Mapping[str, Any], torch_run: Mapping[str, Any]) -> dict[str, Any]:
    """The speed figure of a cell, with its status: what the report's bottom line shows.

    Statuses: ``"ratio"`` (alternating blocks, quotable), ``"not reproducible"`` and
    ``"refused"`` (`block_verdict`), ``"sequential"`` (no alternating blocks recorded: the two
    runs were timed one after the other; indicative) and ``"unreliable"`` (sequential runs with
    `reliability_warnings`). Only ``"ratio"`` and ``"sequential"`` texts begin with a ratio; the
    others begin with the status and why.

    Returns:
      ``{"status", "text", "verdict"}`` (``verdict``: `block_verdict`'s dict, or None).

    Example:
      >>> jax_run = {"framework": "jax", "device": "gpu", "config": {},
      ...            "steps": [{"time_s": t} for t in (2.0, 2.1, 1.9, 2.0)]}
      >>> torch_run = {"framework": "torch", "device": "gpu", "config": {},
      ...              "steps": [{"time_s": t} for t in (1.0, 1.02, 0.98, 1.0)]}
      >>> figure = speed_figure(jax_run, torch_run)
      >>> figure["status"], figure["text"].split(" (")[0]
      ('unreliable', 'UNRELIABLE: jax: only 4 timed steps; torch: only 4 timed steps')
    """
    mode = _mode_name(torch_run)
    trial = _blocks_of(jax_run, torch_run)
    verdict = None
    if trial is not None:
        verdict = blocks_verdict(trial)
        status = verdict["status"]
        if status == "ratio":
            detail = f" over {verdict['blocks']} alternating blocks"
            text = _ratio_words(mode, verdict["ratio"], verdict["low"], verdict["high"], detail)
        elif status == "not reproducible":
            text = f"not reproducible here: {verdict['reason']}; no ratio quoted"
        else:
            text = f"no speed ratio: {verdict['reason']}"
    else:
        ratio, low, high = ratio_ci(measured_times(jax_run), measured_times(torch_run))
        warnings = reliability_warnings(jax_run) + reliability_warnings(torch_run)
        if warnings:
            status = "unreliable"
            text = (
                f"UNRELIABLE: {'; '.join(warnings)} (the sequential runs' JAX/{mode} ratio "
                f"{ratio:.2f}, 95% CI {low:.2f}-{high:.2f}, is not a figure to quote)"
            )
        else:
            status = "sequential"
            text = (
                _ratio_words(mode, ratio, low, high)
                + "; the runs were timed one after the other, not in alternating blocks: indicative"
            )
    caveats = cell_caveats(torch_run, None if status in QUOTABLE else SPEED_MARKS[status])
    if caveats:
        text += "; " + "; ".join(caveats)
    return {"status": status, "text": text, "verdict": verdict}


def bottom_line(jax_run: Mapping[str, Any], torch_run: Mapping[str, Any]) -> str:
    """`speed_figure`'s text: who is faster, by how much, with the 95% CI and caveats, or the
    status ("not reproducible here", "no speed ratio", "UNRELIABLE") and why.

    Args:
      jax_run: the JAX run record of a cell.
      torch_run: the torch run record (eager or torch.compile) of the same cell.

    Returns:
      e.g. ``"JAX 1.37x slower than torch eager (95% CI 1.21-1.52 over 6 alternating blocks);
      torch's bf16 is emulated on this CPU (no AVX512-BF16/AMX kernels)"``; a CI that contains 1
      says "no clear difference".

    Example:
      >>> blocks = {"device": "gpu", "times": {"jax": [[2.0, 2.1]] * 4, "torch": [[1.0, 1.1]] * 4}}
      >>> torch_run = {"framework": "torch", "device": "gpu", "speed_blocks": blocks, "steps": []}
      >>> bottom_line({**torch_run, "framework": "jax"}, torch_run)
      'JAX 1.95x slower than torch eager (95% CI 1.95-1.95 over 4 alternating blocks)'
    """
    return speed_figure(jax_run, torch_run)["text"]


# --- markdown sections -------------------------------------------------------------------------


def _ms(value: float) -> str:
    return f"{value * 1e3:.3g}"


def speed_section(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown: the bottom line per cell and a table of medians with 95% CIs.

    Example:
      >>> speed_section([])[0]
      '## Speed'
    """
    lines = ["## Speed", ""]
    grouped = cells(runs)
    if not grouped:
        return lines + ["No completed runs with step times.", ""]
    lines += [
        "The quotable figure comes from alternating blocks (`--speed-blocks`, `parity.training.blocks`): "
        "after both runs, torch and JAX take turns, a block of steps each, in one process with the "
        "same intra-op threads; each round gives the ratio of the two blocks' median step times, "
        "and the figure is their geometric mean with a Student-t 95% interval over the rounds "
        "(the between-block spread is inside it). It is withheld when the rounds disagree beyond "
        'it ("not reproducible here") or other processes held the cores while it ran. Without '
        "blocks, the runs' own medians (timed one after the other: load that changed between "
        "them moves the ratio) are indicative only. Device synced before each clock read; "
        "compile time apart.",
        "",
    ]
    for (model, precision, device), members in grouped.items():
        reference = torch_reference(members)
        jax = jax_labels(members)
        if jax and reference is not None:
            for label in jax:
                sentence = bottom_line(members[label], reference[1])
                who = "" if label == "jax" else f", {label} vs {reference[0]}"
                lines.append(
                    f"- **{model} {precision} ({device}{who})**: "
                    f"{sentence[0].upper()}{sentence[1:]}."
                )
        else:
            lines.append(f"- **{model} {precision} ({device})**: only {', '.join(members)} ran.")
    lines += [
        "",
        "A cell whose speed figure is withheld (its bottom line's mark) shows its medians with "
        "that mark and no ratio: they were measured under the same conditions.",
        "",
        "| model | precision | device | run | steps | median ms (95% CI) | JAX / this |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for (model, precision, device), members in grouped.items():
        jax = jax_labels(members)
        reference = torch_reference(members)
        for label in ordered_labels(members):
            times = measured_times(members[label])
            median, low, high = median_ci(times)
            ratios = []
            if label not in jax:
                for other in jax:
                    status = speed_figure(members[other], members[label])["status"]
                    named = "" if len(jax) == 1 else f"{other}: "
                    if status not in QUOTABLE:
                        ratios.append(f"{named}withheld ({SPEED_MARKS[status]})")
                        continue
                    ratio, r_low, r_high = ratio_ci(measured_times(members[other]), times)
                    ratios.append(f"{named}{ratio:.2f} ({r_low:.2f}-{r_high:.2f})")
            ratio_text = "; ".join(ratios) or "—"
            median_text = f"{_ms(median)} ({_ms(low)}-{_ms(high)})"
            if jax and reference is not None:
                status = speed_figure(members[jax[0]], reference[1])["status"]
                if status not in QUOTABLE:
                    median_text += f" {SPEED_MARKS[status]}"
            lines.append(
                f"| {model} | {precision} | {device} | {label} | {len(times)} "
                f"| {median_text} | {ratio_text} |"
            )
    lines.append("")
    return lines + _blocks_table(grouped)


def _blocks_table(grouped) -> list[str]:
    """Markdown: each cell's alternating-block timing, round by round, with threads and load."""
    rows = []
    for (model, precision, device), members in grouped.items():
        reference = torch_reference(members)
        for label in jax_labels(members) if reference else []:
            rows += _blocks_row(model, precision, device, members[label], reference[1])
    if not rows:
        return []
    return [
        "Alternating blocks (JAX / torch per round; threads torch / XLA:CPU; cores other "
        "processes used while the blocks ran; 1-minute load before):",
        "",
        "| model | precision | device | blocks x steps | JAX / torch (95% CI) | by round "
        "| threads | others' CPU | load |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _blocks_row(model, precision, device, jax_run, torch_run) -> list[str]:
    """The blocks table's row of one JAX run against the torch reference (none without blocks)."""
    trial = _blocks_of(jax_run, torch_run)
    if not trial:
        return []
    if jax_run.get("distributed"):
        device = f"{device}, {run_label(jax_run)}"
    verdict = blocks_verdict(trial)
    threads = trial.get("threads") or {}
    others = trial.get("others_cpu_cores_total")
    figure = (
        f"{verdict['ratio']:.3f} ({verdict['low']:.3f}-{verdict['high']:.3f})"
        if verdict["status"] == "ratio"
        else verdict["status"]
    )
    return [
        f"| {model} | {precision} | {device} | {verdict['blocks']} x "
        f"{trial.get('block_steps', '?')} | {figure} "
        f"| {', '.join(f'{r:.2f}' for r in verdict['block_ratios']) or '—'} "
        f"| {threads.get('torch_intra_op_threads')} / {threads.get('xla_cpu_intra_op_threads')}"
        f" ({threads.get('omp_wait_policy') or 'OMP default'}) "
        f"| {'—' if others is None else f'{others:.2f}'} of {threads.get('available_cpus')} "
        f"| {(trial.get('load_average_before') or ['—'])[0]} |"
    ]


def hardware_section(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown: the machine(s) the runs were recorded on, from their ``hardware`` fields.

    Example:
      >>> hardware_section([])[0]
      '## Hardware'
    """

    lines = ["## Hardware", ""]
    seen: dict[str, list[str]] = {}
    loads = []
    for run in runs:
        hardware = run.get("hardware")
        if not hardware or "cpu" not in hardware:
            continue
        seen.setdefault(hardware_summary(hardware), []).append(run_label(run))
        load = (hardware["cpu"].get("load_average") or [None])[0]
        if load is not None:
            loads.append(load)
    if not seen:
        return lines + ["The runs carry no hardware record (written by an older version).", ""]
    for summary, labels in seen.items():
        lines.append(f"- {summary} ({len(labels)} runs)")
    if len(seen) > 1:
        lines.append("- **The runs come from different machines or settings**: compare with care.")
    if loads:
        lines.append(
            f"- 1-minute load average when the runs ended: {min(loads):.1f}-{max(loads):.1f}."
        )
    lines.append("")
    return lines
