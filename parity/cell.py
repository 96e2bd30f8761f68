"""One cell of a parity run (a model pair at one precision), and the one writer of its outputs.

`run_cell` is the pipeline every entry point runs: ``python -m parity run`` and ``matrix``,
`parity.compare_models`, ``benchmarks/bench_parity.py`` and the distributed runner
(`parity.distributed.run`: its workers train in place of the single-device trainers). In order:
the pair (built in, or the caller's), the step-0 gate (`parity.verdicts.step0`: outputs and
gradients before any training; a broken port is not trained), each framework's training run
(`parity.training.trainers`), then the calibration runs (`calibration_runs`: 1-ulp-nudged
weights, extra data seeds). It returns run records; `write_outputs` merges them into
``results.json`` and writes ``verdicts.json`` and ``report.md`` from everything the folder holds.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from parity import models
from parity.automap.explain import record_mapping
from parity.core.config import RunConfig
from parity.core.hardware import unsupported_reason
from parity.core.records import (
    build_unsupported_record,
    config_run_key,
    load_results,
    merge_runs,
    write_json_atomic,
)
from parity.perf.phases import clock, current, phase
from parity.replay.rows import attach_replay, replay_gate
from parity.report.markdown import write_report
from parity.training.blocks import attach_speed_blocks, check_speed_blocks
from parity.training.trainers import train_framework
from parity.verdicts.calibrate import noise_runs, seed_runs
from parity.verdicts.judge import compare_runs
from parity.verdicts.outcomes import cell_configs, format_verdicts, overall_status
from parity.verdicts.qualifiers import escalation, verdict
from parity.verdicts.rows import Verdict, cell_fields
from parity.verdicts.step0 import Step0Result, attach_step0, blocked_records, run_step0

__all__ = [
    "NOISE_FRAMEWORKS",
    "calibration_runs",
    "nonfinite_data_row",
    "run_cell",
    "write_outputs",
]

# --noise: which frameworks get a 1-ulp-nudged calibration run.
NOISE_FRAMEWORKS = {"none": (), "torch": ("torch",), "jax": ("jax",), "both": ("torch", "jax")}


def builtin_pair(config: RunConfig) -> Any:
    """The built-in pair of ``config.model`` with the run's seed, data and overrides."""
    return models.get_model_pair(
        config.model, seed=config.seed, data=config.data, **config.model_overrides
    )


def nonfinite_data_row(config: RunConfig, batch: Any) -> Verdict | None:
    """A failing ``data`` row when the first batch holds NaN or inf, naming each tensor; None
    when it is finite.

    Non-finite data makes every loss and gradient non-finite on both sides: judged as a port,
    the per-layer diagnosis would name the first layer. The row says whose fault it is.

    Example:
      >>> row = nonfinite_data_row(RunConfig(), (np.array([1.0, np.nan]), np.array([0, 1])))
      >>> row.value
      'inputs: 1 NaN, 0 inf (first at index (1,))'
    """
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    pair = isinstance(batch, tuple | list) and len(batch) == 2 and len(leaves) == 2
    problems = []
    for index, (path, leaf) in enumerate(leaves):
        try:
            finite = np.isfinite(np.asarray(leaf))
        except (TypeError, ValueError, RuntimeError):  # not numbers (or a dtype numpy lacks)
            continue
        if finite.all():
            continue
        values = np.asarray(leaf)
        first = tuple(int(i) for i in np.argwhere(~finite)[0])
        name = ("inputs", "targets")[index] if pair else "batch" + jax.tree_util.keystr(path)
        problems.append(
            f"{name}: {int(np.isnan(values).sum())} NaN, {int(np.isinf(values).sum())} inf "
            f"(first at index {first})"
        )
    if not problems:
        return None
    return verdict(
        **cell_fields(config),
        check="batch 0 data finite",
        compared="data",
        value="; ".join(problems),
        tolerance="finite",
        passed=False,
        detail="the data's fault, not the port's: batch 0 is not finite, so every loss and "
        "gradient on both sides is not either; the step-0 checks and the per-layer diagnosis "
        "are skipped (they would blame the first layer)",
        mode="data",
        kind="data finite",
    )


def run_cell(
    config: RunConfig,
    frameworks: Sequence[str] = ("torch", "jax"),
    *,
    pair: Any = None,
    stream: Any = None,
    progress: bool = False,
    step0_checks: bool = True,
    echo: bool = True,
    noise: str = "none",
    seeds: int = 1,
    skip_keys: set | frozenset = frozenset(),
    speed_blocks: int = 0,
    train: Callable[..., list[dict[str, Any]]] | None = None,
    escalate: bool = False,
) -> list[dict[str, Any]]:
    """Runs one cell; returns its run records (main runs, then calibration runs).

    Args:
      config: the cell's configuration (model, recipe, data, seeds...).
      frameworks: which frameworks train (``()``: calibration runs only, for a resumed matrix).
      pair: the model pair (default: the built-in pair of ``config.model``).
      stream: the batches (default: the pair's data at the run's data seed).
      progress: report progress.
      step0_checks: run the step-0 gate first when both frameworks train.
      echo: print the step-0 outcome to stderr.
      noise: ``"none"``, ``"torch"``, ``"jax"`` or ``"both"``: 1-ulp-nudged calibration runs.
      seeds: data seeds per framework in all (>= 2: seed statistics).
      skip_keys: `parity.core.records.run_key`s already done (calibration runs are not redone).
      speed_blocks: when both frameworks complete, time them again in this many alternating
        blocks (`parity.training.blocks`: the cell's quotable speed figure, ``speed_blocks`` in both
        records); 0: not timed (the report's speed is then the sequential runs', indicative).
      train: ``train(frameworks, config, pair, stream) -> records`` trains the frameworks that
        passed the gate, in place of `parity.training.trainers.train_framework` for each (the
        distributed runner's workers: one record per side, always a record); None: one device.
      escalate: with ``noise="none"``, when the trained pair's verdicts leave a row exceeded
        that a 1-ulp torch run decides (`parity.verdicts.qualifiers.escalation`: no band
        calibrated to the model's own chaos past step 30), run that calibration run here and
        return it with the cell's runs (budget: one torch training run), so the cell is decided
        instead of INCONCLUSIVE.

    Every record returned carries ``"phases"``: the wall and CPU seconds of each phase of the
    cell (`parity.perf.phases`: step 0 and its parts, each framework's training with its compile,
    timed steps and evaluation, the speed blocks, the calibration runs); an enclosing clock (the
    CLI's) gets them added too.
    """
    check_speed_blocks(speed_blocks)
    outer = current()
    with clock() as cell_clock:
        runs = _run_cell(
            config,
            frameworks,
            pair=pair,
            stream=stream,
            progress=progress,
            step0_checks=step0_checks,
            echo=echo,
            noise=noise,
            seeds=seeds,
            skip_keys=skip_keys,
            speed_blocks=speed_blocks,
            train=train,
            escalate=escalate,
        )
    entries = cell_clock.as_records()
    for run in runs:
        run["phases"] = [dict(entry) for entry in entries]
    if outer is not None:
        outer.merge(entries)
    return runs


def _run_cell(
    config,
    frameworks,
    *,
    pair,
    stream,
    progress,
    step0_checks,
    echo,
    noise,
    seeds,
    skip_keys,
    speed_blocks,
    train,
    escalate=False,
) -> list[dict[str, Any]]:
    if pair is None and frameworks:
        pair = builtin_pair(config)
    # A cell this hardware cannot run (no GPU; no oneDNN kernel) is recorded, not failed.
    runs: list[dict[str, Any]] = []
    for framework in frameworks:
        model = pair.torch_model if framework == "torch" else config.model
        reason = unsupported_reason(framework, config.policy, model, config.device)
        if reason is not None:
            runs.append(build_unsupported_record(framework, config, reason))
    frameworks = tuple(fw for fw in frameworks if fw not in {r["framework"] for r in runs})
    if frameworks:
        first = (
            stream if stream is not None else pair.make_data(config.stream_seed, config.batch_size)
        )
        bad_data = nonfinite_data_row(config, first.batch(0))
        if bad_data is not None:  # reported as the data's; the runs go on and record the rest
            step0 = Step0Result([bad_data], True)
            if echo:
                print(f"{config.model} {config.precision}: data: {bad_data.value}", file=sys.stderr)
        elif step0_checks:
            with phase("step 0"):
                step0 = run_step0(config, pair, stream, frameworks=tuple(frameworks), echo=echo)
        else:
            step0 = None
        replay = None
        loop = getattr(pair, "loop", None)
        if step0 is not None and step0.passed and loop is not None and loop.sides == "both":
            # the user's optimizer and loss on identical gradients and logits: a step-0 gate
            with phase("replay"):
                step0, replay = replay_gate(step0, config, pair, first, echo=echo)
        if step0 is not None and not step0.passed:
            # The mapping goes into the records: a port blocked at step 0 shows its pairing.
            blocked = record_mapping(blocked_records(config, step0, frameworks), pair)
            return runs + attach_replay(blocked, replay, getattr(pair, "loop", None))
        if train is None:
            trained = []
            for fw in frameworks:
                with phase(f"train {fw}"):
                    trained.append(train_framework(fw, config, pair, stream, progress=progress))
        else:
            with phase("train"):
                trained = train(frameworks, config, pair, stream)
        if speed_blocks:
            with phase("speed blocks"):
                attach_speed_blocks(trained, config, pair, stream, blocks=speed_blocks)
        runs += attach_replay(
            record_mapping(attach_step0(trained, step0), pair), replay, getattr(pair, "loop", None)
        )
    if escalate and noise == "none" and escalation(compare_runs(runs)):
        noise = "torch"
        if echo:
            print(
                f"{config.model} {config.precision}: a row exceeded its band past the steps a "
                "fixed band decides and a 1-ulp torch run decides it: running that calibration "
                "run (budget: one torch training run; --no-escalate leaves the cell INCONCLUSIVE)",
                file=sys.stderr,
            )
    calibrating = noise != "none" or seeds != 1
    with phase("calibration") if calibrating else contextlib.nullcontext():
        return runs + calibration_runs(
            config,
            pair,
            stream=stream,
            noise=noise,
            seeds=seeds,
            progress=progress,
            skip_keys=skip_keys,
        )


def calibration_runs(
    config: RunConfig,
    pair: Any = None,
    *,
    stream: Any = None,
    noise: str = "none",
    seeds: int = 1,
    progress: bool = False,
    skip_keys: set | frozenset = frozenset(),
) -> list[dict[str, Any]]:
    """The calibration runs of a cell: 1-ulp-nudged runs (`noise`) and extra data seeds.

    Args:
      config: the cell's configuration (the main runs').
      pair: the model pair (default: the built-in pair, built only when a run is missing).
      stream: the main runs' batches (nudged runs reuse them).
      noise: ``"none"``, ``"torch"``, ``"jax"`` or ``"both"``: which frameworks get a noise run.
      seeds: data seeds per framework in all (the main run is the first).
      progress: report progress.
      skip_keys: `parity.core.records.run_key`s already done (a resumed matrix).

    Returns:
      Run records (``variant="noise"`` or another ``data_seed``), for `parity.verdicts.judge`.
    """
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"--seeds must be an integer >= 1; got {seeds!r}.")
    if noise not in NOISE_FRAMEWORKS:
        raise ValueError(f"--noise must be one of {tuple(NOISE_FRAMEWORKS)}; got {noise!r}.")
    wanted_noise = tuple(
        fw for fw in NOISE_FRAMEWORKS[noise] if config_run_key(fw, config, "noise") not in skip_keys
    )
    seed_configs = [config.replace(data_seed=config.stream_seed + k) for k in range(1, seeds)]
    missing_seeds = [
        c
        for c in seed_configs
        if any(config_run_key(fw, c) not in skip_keys for fw in ("torch", "jax"))
    ]
    if not wanted_noise and not missing_seeds:
        return []
    if pair is None:
        pair = builtin_pair(config)
    runs = (
        noise_runs(config, pair, wanted_noise, stream=stream, progress=progress)
        if wanted_noise
        else []
    )
    if missing_seeds:
        runs += seed_runs(config, pair, seeds, progress=progress)
    return runs


def _report_phase(entry: dict[str, Any]) -> bool:
    return entry["phase"].split("/")[0] in ("verdicts", "report")


def write_outputs(
    out_dir: str | os.PathLike,
    runs: list[dict[str, Any]] | None = None,
    *,
    skipped_cells: list[dict[str, str]] | None = None,
    echo: bool = False,
    plots: bool = True,
) -> tuple[str, list[Any], Path]:
    """Merges `runs` into ``DIR/results.json`` (None: reads it as it is), then writes
    ``verdicts.json`` and ``report.md`` for every run the folder holds (`plots`: and its PNG
    plots; ``compare`` draws them later from the same files).

    Returns:
      ``(status, verdicts, report path)``; status ``"PASS"``, ``"FAIL"``, ``"INCONCLUSIVE"``
      or ``"NOTHING COMPARED"`` (`parity.verdicts.outcomes.overall_status`); the rows are
      `parity.verdicts.judge.compare_runs`'s.
    """
    out = Path(out_dir)
    data = merge_runs(out, runs) if runs is not None else load_results(out)
    outer = current()
    with clock() as report_clock:
        with phase("verdicts"):
            verdicts = compare_runs(data["runs"])
    status = overall_status(verdicts)
    if echo:
        print(format_verdicts(verdicts, cell_configs(data["runs"])))
    write_json_atomic(
        out / "verdicts.json", {"status": status, "verdicts": [v.to_dict() for v in verdicts]}
    )
    with clock(report_clock), phase("report"):
        path = write_report(out, data["runs"], verdicts, skipped_cells=skipped_cells, plots=plots)
    entries = report_clock.as_records()
    if outer is not None:
        outer.merge(entries)
    if runs:  # this invocation's records keep the time their verdicts and report took
        for run in runs:
            run["phases"] = [e for e in run.get("phases") or [] if not _report_phase(e)] + [
                dict(e) for e in entries
            ]
        merge_runs(out, runs)
    if echo:
        print(f"report: {path.resolve()}")
    return status, verdicts, path
