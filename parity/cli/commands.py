"""``python -m parity``: run, compare, matrix.

::

    python -m parity run --model cnn --precision bf16-mixed --framework both --steps 100 --out runs/x
    python -m parity compare runs/x          # verdicts + report.md, exit code 1 if a verdict fails
    python -m parity export --model mlp --precision bf16-mixed --out golden.npz  # torch's side
    python -m parity check --golden golden.npz  # the JAX side against it; no torch needed
    python -m parity bisect --golden golden.npz  # fewest Flax modules to keep in float32
    python -m parity matrix --out runs/matrix  # every model x precision; resumable
    python -m parity run --model resnet --noise torch --seeds 3 --out runs/r  # calibrated verdicts
    python -m parity replay --model mlp --torch-optimizer m:opt --jax-optimizer m:tx  # your loop

Exit codes: 0 PASS (nothing failed, and every compared cell has a check with power past step 0),
1 a verdict failed, 2 bad arguments or an invalid results.json, 3 nothing was compared (no
torch/JAX pair: one framework only, or only unsupported cells), 4 INCONCLUSIVE (nothing failed,
but some cell has no check that could have failed: the report gives the command that decides).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from parity import cell
from parity.bisect import add_bisect_parser, run_bisect
from parity.cli.replay import add_replay_parser, run_replay
from parity.core import flags
from parity.core.config import DEVICES, FP16_STRESS, OPTIMIZERS, SCHEDULES, ConfigError, RunConfig
from parity.core.hardware import unsupported_reason
from parity.core.progress import progress as progress_lines
from parity.core.recipes import get_recipe, precision_names, resolve_precision
from parity.core.records import (
    RESULTS_FILE,
    config_run_key,
    load_results,
    merge_runs,
    run_key,
    run_status,
)
from parity.data import DataSpec
from parity.distributed.run import JAX_MODES, STRATEGIES, cli_run
from parity.golden.check import add_check_parser, bad_input, flax_model_of, run_check
from parity.golden.export import export_golden
from parity.models import MODEL_NAMES, calibration_prescribed, size_overrides
from parity.perf.matmul import add_matmul_parser, main_matmul
from parity.perf.measure import set_threads
from parity.perf.phases import clock, format_line
from parity.training.blocks import DEFAULT_BLOCKS

__all__ = ["CLI_DEFAULTS", "build_parser", "main", "matrix_config"]

# Where the command line departs from RunConfig's defaults (`run`, `matrix` and the benchmark;
# the matrix adds each recipe's own plan, `Recipe.matrix_plan`). Warm-up 10: AdamW's first
# updates are ~lr * sign(grad), so a gradient component that is ~0 up to rounding flips sign
# between frameworks and moves by a full lr; without warm-up the fp32 cnn drifts to 1.6e-4 by
# step 9 (measured), with it 8e-6. Warm-up also keeps the first steps' rates independent of
# --steps (runs of different lengths stay comparable step for step).
CLI_DEFAULTS: dict[str, Any] = {"lr_warmup_steps": 10}

# The defaults of the training options: RunConfig's fields, then CLI_DEFAULTS (one place each).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)} | CLI_DEFAULTS


def _precision(value: str) -> str:
    """argparse type: a registered precision or a name jaxamp.get_policy reads for one."""
    try:
        return resolve_precision(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _at_least(minimum: int):
    """argparse type: an integer >= `minimum` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}; got {value}")
        return value

    return parse


def _positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds; got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0; got {text}")
    return value


def _overrides(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--model-override takes KEY=VALUE (VALUE in JSON); got {item!r}.")
        key, value = item.split("=", 1)
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--model-override {key}: VALUE must be JSON (e.g. 64 or [28,28,1]); got {value!r}."
            ) from e
        out[key] = tuple(parsed) if isinstance(parsed, list) else parsed
    return out


def _add_training_args(parser: argparse.ArgumentParser, *, matrix: bool) -> None:
    d = _DEFAULTS
    where = (
        "per-precision default of the matrix plan"
        if matrix
        else f"default {d['steps']} steps, batch {d['batch_size']}"
    )
    parser.add_argument("--steps", type=int, default=None, help=f"training steps ({where})")
    parser.add_argument("--batch-size", type=int, default=None, help="examples per step")
    parser.add_argument("--seed", type=int, default=d["seed"], help="torch init and data seed")
    parser.add_argument(
        "--data",
        default=d["data"],
        help="synthetic (default), real (digits for image models, text for token models), "
        "digits (scikit-learn's bundled 8x8 digits, image models), "
        "text[:PATH] (byte-level corpus, default the Python stdlib sources; transformer, lstm), "
        "fashion-mnist:DIR, cifar10:DIR",
    )
    parser.add_argument(
        "--device", choices=DEVICES, default=d["device"], help="cpu, or gpu (CUDA torch, GPU JAX)"
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=d["optimizer"])
    parser.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    parser.add_argument("--momentum", type=float, default=d["momentum"], help="SGD momentum")
    parser.add_argument("--schedule", choices=SCHEDULES, default=d["schedule"])
    parser.add_argument(
        "--lr-warmup-steps",
        type=int,
        default=None,
        help=f"linear learning-rate warm-up (default {d['lr_warmup_steps']})",
    )
    parser.add_argument(
        "--clip-norm", type=float, default=d["clip_norm"], help="global-norm clipping; 0 disables"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=d["timing_warmup"],
        help="steps excluded from the step-time median",
    )
    parser.add_argument(
        "--init-scale",
        type=float,
        default=None,
        help=f"fp16 initial loss scale (default {d['init_scale']:g})",
    )
    parser.add_argument(
        "--growth-interval",
        type=int,
        default=None,
        help=f"fp16 loss-scale growth interval (default {d['growth_interval']})",
    )
    parser.add_argument(
        "--torch-compile", action="store_true", help="run the torch model under torch.compile"
    )
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    parser.add_argument(
        "--fp16-stress",
        action="store_true",
        help="fp16: init scale 2**20 and growth interval 5, so the run has skips and growths "
        "(the matrix always uses it)",
    )
    # The matrix's default is each model's prescription (parity.models.calibration_prescribed).
    parser.add_argument(
        "--noise",
        choices=("none", "torch", "jax", "both"),
        default=None if matrix else "none",
        help="calibration runs from 1-ulp-nudged weights (noise-calibrated verdicts; "
        + (
            "default: the model's prescription, resnet and cnn_bn torch, others none; "
            "adamw-4bit cells torch)"
            if matrix
            else "default none)"
        ),
    )
    parser.add_argument(
        "--seeds",
        type=_at_least(1),
        default=None if matrix else 1,
        help="data seeds per framework, same initial weights; >= 2 judges final loss and eval "
        + (
            "by Welch's t-test (default: the model's prescription, resnet 3, others 1)"
            if matrix
            else "by Welch's t-test (default 1)"
        ),
    )
    parser.add_argument(
        "--no-step0",
        action="store_true",
        help="skip the step-0 output/gradient checks that run before training (parity.verdicts.step0)",
    )
    parser.add_argument(
        "--no-escalate",
        action="store_true",
        help="leave a cell INCONCLUSIVE where a row exceeded its band and a 1-ulp torch "
        "calibration run would decide it (default: that run is made, one torch training run)",
    )
    parser.add_argument(
        "--no-plots",
        action="store_true",
        help="write report.md without its PNG plots (`compare DIR` draws them later)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output (default: a bar on a terminal, a plain line every 30 s elsewhere)",
    )
    parser.add_argument(
        "--threads",
        type=_at_least(1),
        default=None,
        help="intra-op CPU threads for torch and XLA alike (default: every core; recorded)",
    )
    parser.add_argument(
        "--speed-blocks",
        type=int,
        default=DEFAULT_BLOCKS,
        help="after both runs, time torch and JAX in this many alternating blocks: the speed "
        f"figure of the report (default {DEFAULT_BLOCKS}; 0: none, the sequential runs' figure)",
    )


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-device (parity.distributed)")
    group.add_argument(
        "--devices",
        type=_at_least(1),
        default=1,
        help="JAX devices / processes; > 1 (or --strategy) runs torch ranks vs JAX meshes",
    )
    group.add_argument("--strategy", choices=STRATEGIES, default=None, help="ddp or fsdp")
    group.add_argument(
        "--torch-ranks", type=_at_least(1), default=None, help="torch processes (default --devices)"
    )
    group.add_argument(
        "--jax-modes",
        nargs="+",
        choices=JAX_MODES,
        default=list(JAX_MODES),
        help="JAX variants to run (default all)",
    )
    group.add_argument(
        "--inject-overflow",
        default=None,
        metavar="STEP:RANK",
        help="fp16: a non-finite gradient on torch rank RANK's rows at STEP, both sides",
    )
    group.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=900.0,
        help="seconds per worker group (default 900)",
    )


def _add_model_override(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-override",
        action="append",
        metavar="KEY=VALUE",
        help="architecture override, JSON value; repeatable (applied on top of --size)",
    )
    parser.add_argument(
        "--size",
        default=None,
        metavar="NAME",
        help="a named size of the model: transformer gpt2-small (12 layers, 768 wide, 12 heads, "
        "context 1024, byte vocabulary; 86.2 M parameters)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parity", description="PyTorch (torch.amp) vs JAX (jaxamp) parity runs."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train one model at one precision; write DIR/results.json")
    run.add_argument(
        "--model", required=True, help="model name (mlp, cnn, cnn_bn, lstm, transformer)"
    )
    run.add_argument(
        "--precision",
        type=_precision,
        default=_DEFAULTS["precision"],
        help=f"one of {', '.join(precision_names())}, or a name jaxamp.get_policy reads "
        "(bf16, 16-mixed, 32-true, ...)",
    )
    run.add_argument("--framework", choices=("torch", "jax", "both"), default="both")
    run.add_argument("--out", required=True, help="output folder (results.json is merged into)")
    _add_model_override(run)
    _add_training_args(run, matrix=False)
    _add_distributed_args(run)

    compare = sub.add_parser("compare", help="verdicts and report.md for DIR/results.json")
    compare.add_argument("dir", help="folder holding results.json")

    matrix = sub.add_parser("matrix", help="every model x precision, torch and JAX; resumable")
    matrix.add_argument("--out", default="runs/matrix", help="output folder (default runs/matrix)")
    matrix.add_argument("--models", nargs="+", default=None, help="default: all models")
    matrix.add_argument("--precisions", nargs="+", type=_precision, default=list(precision_names()))
    matrix.add_argument("--force", action="store_true", help="redo runs already in results.json")
    matrix.add_argument(
        "--size",
        default=None,
        metavar="NAME",
        help="a named size of each model (transformer: gpt2-small); a model without it is refused",
    )
    _add_training_args(matrix, matrix=True)
    add_matmul_parser(sub)

    export = sub.add_parser(
        "export", help="record torch's side of a cell into a golden file (read by `check`)"
    )
    export.add_argument("--model", required=True, help="model name (mlp, cnn, ...)")
    export.add_argument(
        "--precision",
        type=_precision,
        default=_DEFAULTS["precision"],
        help=f"one of {', '.join(precision_names())} (fp8 recipes excepted)",
    )
    export.add_argument("--out", required=True, help="the golden file to write (.npz)")
    export.add_argument(
        "--flax-model",
        default=None,
        metavar="MODULE:ATTR",
        help="the Flax module (or a zero-argument factory) `check` imports without torch; "
        "default: the built-in pair's twin, found by name (needs torch)",
    )
    _add_model_override(export)
    _add_training_args(export, matrix=False)
    add_check_parser(sub)
    add_bisect_parser(sub)
    add_replay_parser(sub)
    return parser


def _config_from_args(
    args, model: str, precision: str, plan: dict[str, Any] | None = None
) -> RunConfig:
    """The run's `RunConfig`: the command line, else `plan` (the matrix's), else `CLI_DEFAULTS`,
    else RunConfig's own defaults."""
    plan = {**CLI_DEFAULTS, **(plan or {})}
    if getattr(args, "fp16_stress", False):
        plan.update(FP16_STRESS)
    given = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr_warmup_steps": args.lr_warmup_steps,
        "init_scale": args.init_scale,
        "growth_interval": args.growth_interval,
    }
    values = {
        "model": model,
        "precision": precision,
        **plan,
        **{k: v for k, v in given.items() if v is not None},
        "seed": args.seed,
        "device": args.device,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "momentum": args.momentum,
        "schedule": args.schedule,
        "clip_norm": _clip_norm(args.clip_norm),
        "timing_warmup": args.warmup,
        "torch_compile": args.torch_compile,
        "eval": not args.no_eval,
        "model_overrides": size_overrides(
            model, getattr(args, "size", None), _overrides(getattr(args, "model_override", None))
        ),
        "data": args.data,
    }
    try:
        config = RunConfig(**values)
        # Seed statistics run data seeds seed .. seed + seeds - 1: each must be a valid seed.
        seeds = getattr(args, "seeds", None) or 1
        config.replace(data_seed=config.stream_seed + seeds - 1)
    except ConfigError as e:
        option = flags.option(e.field) if e.field != "data_seed" else "--seed with --seeds"
        raise ValueError(f"{option}: {e}") from None
    return config


def _clip_norm(value: float) -> float | None:
    """--clip-norm: 0 disables clipping (None); a negative norm is refused, not read as 0."""
    if value == 0:
        return None
    if not value > 0:
        raise ValueError(f"--clip-norm must be > 0, or 0 to disable clipping; got {value!r}.")
    return value


def _check_out(out: Path, option: str = "--out") -> None:
    """Refuses an output folder that cannot take the results, before any work: a file in its
    place, a folder that cannot be made or written, an output that is a folder, or an existing
    results.json that a merge would refuse after training."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"{option} {str(out)!r} is a file; give a folder (results.json goes in it)."
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{option} {str(out)!r}: cannot create the folder ({e.strerror})."
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {str(out)!r}: the folder is not writable.")
    for name in ("verdicts.json", "report.md", "steps.csv"):
        if (out / name).exists() and not (out / name).is_file():
            raise ValueError(f"{out / name} is not a file; remove it or give another {option}.")
    load_results(out)  # an invalid results.json is refused now, not after the training


def _check_data(config: RunConfig) -> None:
    """--data that cannot be read is refused before any work (one line, exit 2)."""
    DataSpec.parse(config.data).check()


def matrix_plan(precision: str) -> dict[str, Any]:
    """The matrix's settings of a precision: `CLI_DEFAULTS` and the recipe's own plan."""
    return {**CLI_DEFAULTS, **get_recipe(precision).matrix_plan}


def matrix_config(model: str, precision: str, **changes: Any) -> RunConfig:
    """The matrix's default configuration of one cell (for tests and benchmarks)."""
    return RunConfig(model=model, precision=precision, **{**matrix_plan(precision), **changes})


def _cell_options(args) -> dict[str, Any]:
    return {
        "progress": not args.no_progress,
        "step0_checks": not args.no_step0,
        "noise": args.noise,
        "seeds": args.seeds,
        "speed_blocks": args.speed_blocks,
        "escalate": not args.no_escalate,
    }


def _exit_code(status: str) -> int:
    return {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 4}.get(status, 3)


def _check_models(models: list[str]) -> None:
    unknown = [m for m in models if m not in MODEL_NAMES]
    if unknown:
        raise ValueError(
            f"--model must be one of {', '.join(MODEL_NAMES)}; got {', '.join(map(repr, unknown))}."
        )


def _cmd_run(args) -> int:
    _check_models([args.model])
    config = _config_from_args(args, args.model, args.precision)
    frameworks = ("torch", "jax") if args.framework == "both" else (args.framework,)
    _check_data(config)
    out = Path(args.out)
    _check_out(out)
    if args.devices > 1 or args.strategy is not None or args.torch_ranks is not None:
        return _exit_code(cli_run(args, config, frameworks))
    options = _cell_options(args)
    if args.framework != "both":  # calibration needs both frameworks' main runs
        options.update(noise="none", seeds=1, escalate=False)
    runs = cell.run_cell(config, frameworks, **options)
    for run in runs:
        s = run["summary"]
        if run.get("status") == "unsupported":
            print(f"{run['framework']:5s} {run['model']} {run['precision']}: unsupported here")
            continue
        if s.get("error"):
            print(f"{run['framework']:5s} {run['model']} {run['precision']}: ERROR {s['error']}")
            continue
        print(
            f"{run['framework']:5s} {run['model']} {run['precision']}: final loss {s['final_loss']}, "
            f"median step {s['step_time_median_s'] * 1e3:.2f} ms, skipped {s['skipped_steps']}"
            + (" DIVERGED" if s["diverged"] else "")
        )
    print(f"results: {(out / 'results.json').resolve()}")
    # Every run that produced records gets a report; one framework alone is "nothing compared"
    # (exit 3) only when both were asked for: a single-framework run may be paired later. A run
    # that failed (an error record) exits 1 either way.
    code = _exit_code(cell.write_outputs(out, runs, echo=True, plots=not args.no_plots)[0])
    if any(run_status(r) == "error" for r in runs):
        return 1
    return code if args.framework == "both" or code == 1 else 0


def _cmd_compare(args) -> int:
    out = Path(args.dir)
    results = out / RESULTS_FILE
    if not results.exists():
        raise ValueError(
            f"compare: {results} does not exist; run `python -m parity run --out {out}` first."
        )
    _check_out(out, "compare DIR")
    return _exit_code(cell.write_outputs(out, echo=True)[0])


def _cmd_matrix(args) -> int:
    models = args.models or list(MODEL_NAMES)
    _check_models(models)
    out = Path(args.out)
    _check_out(out)
    for model in models:  # every cell's settings and data, before the first cell trains
        for precision in args.precisions:
            _config_from_args(args, model, precision, matrix_plan(precision))
    _check_data(_config_from_args(args, models[0], args.precisions[0]))
    done = {run_key(r): r for r in load_results(out)["runs"]}
    cells = [(m, p) for m in models for p in args.precisions]
    options = _cell_options(args)
    iterator = cells
    if options["progress"]:
        iterator = progress_lines(cells, "matrix", unit="cell", leave=True)
    for model, precision in iterator:
        config = _config_from_args(args, model, precision, matrix_plan(precision))
        # the README's per-model calibration, and the recipe's (adamw-4bit: torch noise)
        prescribed = {**calibration_prescribed(model), **config.recipe.calibration}
        options["noise"] = prescribed["noise"] if args.noise is None else args.noise
        options["seeds"] = prescribed["seeds"] if args.seeds is None else args.seeds
        keys = {fw: config_run_key(fw, config) for fw in ("torch", "jax")}
        # Cells finished in an earlier (possibly interrupted) invocation are not run again.
        todo = tuple(
            fw
            for fw, key in keys.items()
            if args.force or key not in done or done[key]["config"] != config.to_dict()
        )
        skip = frozenset() if args.force else frozenset(done)
        if todo:
            runs = cell.run_cell(config, todo, skip_keys=skip, **options)
        else:
            runs = cell.calibration_runs(
                config,
                noise=options["noise"],
                seeds=options["seeds"],
                progress=options["progress"],
                skip_keys=skip,
            )
        if runs:  # merged after every cell: an interruption loses one cell at most
            done = {run_key(r): r for r in merge_runs(out, runs)["runs"]}
    return _exit_code(cell.write_outputs(out, echo=True, plots=not args.no_plots)[0])


def _check_golden_out(out: Path) -> None:
    """--out of export: a file that can be written, refused before the torch run."""
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a folder; give the golden file's path (.npz).")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the folders export would create hang off the first that exists
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {str(out)!r}: {str(parent)!r} is not a writable folder.")


def _cmd_export(args) -> int:
    _check_models([args.model])
    config = _config_from_args(args, args.model, args.precision)
    _check_golden_out(Path(args.out))
    _check_data(config)
    if args.flax_model is not None:
        flax_model_of(args.flax_model)  # a reference that is not a model: refused before torch runs
    path = export_golden(
        args.out, config, flax_model=args.flax_model, progress=not args.no_progress
    )
    print(f"golden: {path.resolve()} ({path.stat().st_size} bytes)")
    return 0


def _gpu_missing(args) -> str | None:
    """One line naming each requested framework that has no GPU here, or None."""
    if args.device != "gpu":
        return None
    wanted = getattr(args, "framework", "both")
    frameworks = ("torch", "jax") if wanted == "both" else (wanted,)
    reasons = [unsupported_reason(fw, "fp32", "mlp", "gpu") for fw in frameworks]
    reasons = [r for r in reasons if r]
    return "; ".join(reasons) or None


@contextlib.contextmanager
def timed_phases():
    """Collects the phases of the command (`parity.perf.phases`) and prints them as one line
    to stderr at the end, whatever the outcome."""
    wall, cpu = time.perf_counter(), time.process_time()
    with clock() as phases:
        try:
            yield phases
        finally:
            entries = phases.as_records()
            if entries:
                total = (time.perf_counter() - wall, time.process_time() - cpu)
                print(format_line(entries, total), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "device", "cpu") == "gpu":
        # Before JAX starts its GPU backend: without this JAX grabs 75% of the GPU up front and
        # its allocator peak says nothing about the model.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        if args.command == "matmul":
            return main_matmul(args)
        if args.command in ("run", "matrix"):
            set_threads(args.threads)  # before JAX starts its CPU backend; recorded in every run
            missing = _gpu_missing(args)
            with timed_phases():
                code = _cmd_run(args) if args.command == "run" else _cmd_matrix(args)
            if missing:  # what could run ran and is reported; the cells without a GPU are not
                print(f"error: --device gpu: {missing}", file=sys.stderr)
                return 2
            return code
        if args.command == "compare":
            return _cmd_compare(args)
        if args.command == "export":
            set_threads(args.threads)
            return _cmd_export(args)
        if args.command == "check":  # also `python -m parity check`, torch-free (__main__)
            return run_check(args)
        if args.command == "bisect":  # also torch-free through __main__
            return run_bisect(args)
        if args.command == "replay":
            return run_replay(args)
        return _cmd_matrix(args)
    except (ValueError, OSError) as e:  # bad input, or a file that cannot be read or written
        return bad_input(e)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
