"""``python -m parity``: run, compare, matrix.

::

    python -m parity run --model cnn --precision bf16-mixed --framework both --steps 100 --out runs/x
    python -m parity compare runs/x          # verdicts + report.md, exit code 1 if a verdict fails
    python -m parity matrix --out runs/matrix  # every model x precision; resumable
    python -m parity run --model resnet --noise torch --seeds 3 --out runs/r  # calibrated verdicts

Exit codes: 0 all verdicts pass, 1 a verdict failed, 2 bad arguments or an invalid results.json,
3 nothing was compared (no torch/JAX pair: one framework only, or only unsupported cells).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from parity.config import DEVICES, FP16_STRESS, OPTIMIZERS, PRECISIONS, SCHEDULES, RunConfig

__all__ = ["MATRIX_PLAN", "calibration_runs", "main", "matrix_config"]

# Matrix defaults per precision: fp32 needs 30 steps for its two tolerance windows. torch's fp16
# matmuls/convolutions on this CPU have no fast kernel (~200x slower than fp32): keep them tiny.
MATRIX_PLAN: dict[str, dict[str, Any]] = {
    "fp32": {"steps": 30, "batch_size": 16},
    "bf16-mixed": {"steps": 30, "batch_size": 16},
    "bf16-true": {"steps": 30, "batch_size": 16},
    # The fp16 stress setting: the short run exercises overflow, backoff and growth.
    "fp16-mixed": {"steps": 20, "batch_size": 4, **FP16_STRESS},
    # torchao's fp8 recipes (parity.fp8): emulated on CPU, float32 outside the fp8 layers.
    "fp8-tensorwise": {"steps": 30, "batch_size": 16},
    "fp8-rowwise": {"steps": 30, "batch_size": 16},
    "fp8-rowwise-gw-hp": {"steps": 30, "batch_size": 16},
}


# Cells the matrix skips, with the reason (shown in the report): torch has no kernel for them.
UNSUPPORTED: dict[tuple[str, str, str], str] = {}


def _model_names():
    from parity.models import MODEL_NAMES

    return MODEL_NAMES


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
    where = "per-precision default of the matrix plan" if matrix else "default 30 steps, batch 32"
    parser.add_argument("--steps", type=int, default=None, help=f"training steps ({where})")
    parser.add_argument("--batch-size", type=int, default=None, help="examples per step")
    parser.add_argument("--seed", type=int, default=0, help="torch init and data seed (default 0)")
    parser.add_argument(
        "--data",
        default="synthetic",
        help="synthetic (default), real (digits for image models, text for token models), "
        "digits (scikit-learn's bundled 8x8 digits, image models), "
        "text[:PATH] (byte-level corpus, default the Python stdlib sources; transformer, lstm), "
        "fashion-mnist:DIR, cifar10:DIR",
    )
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu", help="cpu, or gpu (CUDA torch, GPU JAX)"
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    # Default 10: AdamW's first updates are ~lr * sign(grad), so a gradient component that is ~0
    # up to rounding flips sign between frameworks and moves by a full lr; without warm-up the
    # fp32 cnn drifts to 1.6e-4 by step 9 (measured), with it 8e-6.
    parser.add_argument(
        "--lr-warmup-steps", type=int, default=10, help="linear learning-rate warm-up (default 10)"
    )
    parser.add_argument(
        "--clip-norm", type=float, default=1.0, help="global-norm clipping; 0 disables"
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="steps excluded from the step-time median"
    )
    parser.add_argument(
        "--init-scale", type=float, default=None, help="fp16 initial loss scale (default 2**16)"
    )
    parser.add_argument(
        "--growth-interval",
        type=int,
        default=None,
        help="fp16 loss-scale growth interval (default 2000)",
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
    parser.add_argument(
        "--noise",
        choices=("none", "torch", "jax", "both"),
        default="none",
        help="calibration runs from 1-ulp-nudged weights (noise-calibrated verdicts; default none)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="data seeds per framework, same initial weights; >= 2 judges final loss and eval "
        "by Welch's t-test (default 1)",
    )
    parser.add_argument(
        "--no-step0",
        action="store_true",
        help="skip the step-0 output/gradient checks that run before training (parity.step0)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output (default: a bar on a terminal, a plain line every 30 s elsewhere)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op CPU threads for torch and XLA alike (default: every core; recorded)",
    )


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    from parity.distributed.run import JAX_MODES, STRATEGIES

    group = parser.add_argument_group("multi-device (parity.distributed)")
    group.add_argument(
        "--devices",
        type=int,
        default=1,
        help="JAX devices / processes; > 1 (or --strategy) runs torch ranks vs JAX meshes",
    )
    group.add_argument("--strategy", choices=STRATEGIES, default=None, help="ddp or fsdp")
    group.add_argument(
        "--torch-ranks", type=int, default=None, help="torch processes (default --devices)"
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
        "--timeout", type=float, default=900.0, help="seconds per worker group (default 900)"
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
    run.add_argument("--precision", choices=PRECISIONS, default="fp32")
    run.add_argument("--framework", choices=("torch", "jax", "both"), default="both")
    run.add_argument("--out", required=True, help="output folder (results.json is merged into)")
    run.add_argument(
        "--model-override",
        action="append",
        metavar="KEY=VALUE",
        help="architecture override, JSON value; repeatable",
    )
    _add_training_args(run, matrix=False)
    _add_distributed_args(run)

    compare = sub.add_parser("compare", help="verdicts and report.md for DIR/results.json")
    compare.add_argument("dir", help="folder holding results.json")

    matrix = sub.add_parser("matrix", help="every model x precision, torch and JAX; resumable")
    matrix.add_argument("--out", default="runs/matrix", help="output folder (default runs/matrix)")
    matrix.add_argument("--models", nargs="+", default=None, help="default: all models")
    matrix.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    matrix.add_argument("--force", action="store_true", help="redo runs already in results.json")
    _add_training_args(matrix, matrix=True)
    from parity.matmul import add_matmul_parser

    add_matmul_parser(sub)
    return parser


def _config_from_args(
    args, model: str, precision: str, plan: dict[str, Any] | None = None
) -> RunConfig:
    plan = dict(plan or {})
    values = {
        "model": model,
        "precision": precision,
        "steps": args.steps if args.steps is not None else plan.get("steps", 30),
        "batch_size": args.batch_size
        if args.batch_size is not None
        else plan.get("batch_size", 32),
        "seed": args.seed,
        "device": args.device,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "momentum": args.momentum,
        "schedule": args.schedule,
        "lr_warmup_steps": args.lr_warmup_steps,
        "clip_norm": args.clip_norm if args.clip_norm and args.clip_norm > 0 else None,
        "timing_warmup": args.warmup,
        "torch_compile": args.torch_compile,
        "eval": not args.no_eval,
        "init_scale": args.init_scale
        if args.init_scale is not None
        else plan.get("init_scale", 2.0**16),
        "growth_interval": args.growth_interval
        if args.growth_interval is not None
        else plan.get("growth_interval", 2000),
        **(
            {k: v for k, v in FP16_STRESS.items() if getattr(args, k) is None}
            if getattr(args, "fp16_stress", False)
            else {}
        ),
        "model_overrides": _overrides(getattr(args, "model_override", None)),
        "data": args.data,
    }
    return RunConfig(**values)


def matrix_config(model: str, precision: str, **changes: Any) -> RunConfig:
    """The matrix's default configuration of one cell (for tests and benchmarks)."""
    return RunConfig(model=model, precision=precision, **{**MATRIX_PLAN[precision], **changes})


def _step0_option(args) -> dict[str, bool]:
    # Passed only when switched off, so wrappers of `run_pair` without the keyword keep working.
    return {"step0_checks": False} if getattr(args, "no_step0", False) else {}


def run_pair(
    config: RunConfig, frameworks: tuple[str, ...], *, progress: bool, step0_checks: bool = True
) -> list[dict[str, Any]]:
    """Trains the named model with `config` on each framework; returns the run records.

    With both frameworks, the step-0 checks (`parity.step0`) run first; when they fail, nothing
    is trained and both records are errors naming the worst output, parameter and layer."""
    from parity.hardware import UnsupportedHere, unsupported_reason
    from parity.models import get_model_pair
    from parity.records import build_unsupported_record
    from parity.step0 import attach_step0, blocked_records, run_step0
    from parity.train_jax import train_jax
    from parity.train_torch import build_error_record, train_torch

    pair = get_model_pair(
        config.model, seed=config.seed, data=config.data, **config.model_overrides
    )
    # A cell this hardware cannot run (no GPU; no oneDNN kernel) is recorded, not failed.
    unsupported = []
    for framework in frameworks:
        model = pair.torch_model if framework == "torch" else config.model
        reason = unsupported_reason(framework, config.policy, model, config.device)
        if reason is not None:
            unsupported.append(build_unsupported_record(framework, config, reason))
    skip = {run["framework"] for run in unsupported}
    frameworks = tuple(fw for fw in frameworks if fw not in skip)
    if not frameworks:
        return unsupported
    # Step 0 first (outputs and gradients before any training); a broken port is not trained.
    step0 = run_step0(config, pair, frameworks=frameworks) if step0_checks else None
    if step0 is not None and not step0.passed:
        return unsupported + blocked_records(config, step0, frameworks)
    runs = []
    for framework in frameworks:
        trainer = train_torch if framework == "torch" else train_jax
        try:
            runs.append(trainer(config, pair, progress=progress))
        except UnsupportedHere as e:
            runs.append(build_unsupported_record(framework, config, e.reason))
        except Exception as e:  # recorded and failed by `compare`; the matrix goes on
            print(f"error: {framework} {config.model} {config.precision}: {e}", file=sys.stderr)
            runs.append(build_error_record(framework, config, e))
    return unsupported + attach_step0(runs, step0)


def calibration_runs(
    config: RunConfig,
    *,
    noise: str = "none",
    seeds: int = 1,
    progress: bool = False,
    skip_keys: set | frozenset = frozenset(),
) -> list[dict[str, Any]]:
    """The calibration runs of a cell: 1-ulp-nudged runs (`--noise`) and extra data seeds.

    Args:
      config: the cell's configuration (the main runs').
      noise: ``"none"``, ``"torch"``, ``"jax"`` or ``"both"``: which frameworks get a noise run.
      seeds: data seeds per framework in all (the main run is the first).
      progress: tqdm bars.
      skip_keys: `parity.records.run_key`s already done (a resumed matrix).

    Returns:
      Run records (``variant="noise"`` or another ``data_seed``), for `parity.compare`.
    """
    from parity.calibrate import noise_runs, seed_runs
    from parity.models import get_model_pair
    from parity.records import config_run_key

    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"--seeds must be an integer >= 1; got {seeds!r}.")
    noise_frameworks = {"none": (), "torch": ("torch",), "jax": ("jax",), "both": ("torch", "jax")}
    if noise not in noise_frameworks:
        raise ValueError(f"--noise must be one of {tuple(noise_frameworks)}; got {noise!r}.")
    wanted_noise = tuple(
        fw for fw in noise_frameworks[noise] if config_run_key(fw, config, "noise") not in skip_keys
    )
    seed_configs = [config.replace(data_seed=config.stream_seed + k) for k in range(1, seeds)]
    missing_seeds = [
        c
        for c in seed_configs
        if any(config_run_key(fw, c) not in skip_keys for fw in ("torch", "jax"))
    ]
    if not wanted_noise and not missing_seeds:
        return []
    pair = get_model_pair(
        config.model, seed=config.seed, data=config.data, **config.model_overrides
    )
    runs = noise_runs(config, pair, wanted_noise, progress=progress) if wanted_noise else []
    if missing_seeds:
        runs += seed_runs(config, pair, seeds, progress=progress)
    return runs


def _compare_and_report(out: Path, skipped_cells: list[dict[str, str]] | None = None) -> int:
    from parity.compare import compare_runs, format_verdicts, overall_status
    from parity.records import load_results, write_json_atomic
    from parity.report import write_report

    runs = load_results(out)["runs"]
    verdicts = compare_runs(runs)
    print(format_verdicts(verdicts))
    status = overall_status(verdicts)
    write_json_atomic(
        out / "verdicts.json",
        {"status": status, "verdicts": [v.to_dict() for v in verdicts]},
    )
    path = write_report(out, runs, verdicts, skipped_cells=skipped_cells)
    print(f"report: {path.resolve()}")
    return {"PASS": 0, "FAIL": 1}.get(status, 3)


def _cmd_run(args) -> int:
    from parity.report import merge_runs

    if args.model not in _model_names():
        raise ValueError(f"--model must be one of {', '.join(_model_names())}; got {args.model!r}.")
    config = _config_from_args(args, args.model, args.precision)
    frameworks = ("torch", "jax") if args.framework == "both" else (args.framework,)
    if args.devices > 1 or args.strategy is not None or args.torch_ranks is not None:
        from parity.distributed.run import cli_run

        return cli_run(args, config, frameworks)
    out = Path(args.out)
    runs = run_pair(config, frameworks, progress=not args.no_progress, **_step0_option(args))
    if args.framework == "both":
        runs += calibration_runs(
            config, noise=args.noise, seeds=args.seeds, progress=not args.no_progress
        )
    merge_runs(out, runs)
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
    # (exit 3) only when both were asked for: a single-framework run may be paired later.
    code = _compare_and_report(out)
    return code if args.framework == "both" or code == 1 else 0


def _cmd_matrix(args) -> int:
    from parity.records import config_run_key, load_results, merge_runs, run_key

    models = args.models or list(_model_names())
    unknown = [m for m in models if m not in _model_names()]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; valid: {', '.join(_model_names())}.")
    out = Path(args.out)
    done = {run_key(r): r for r in load_results(out)["runs"]}
    cells = [(m, p) for m in models for p in args.precisions]
    progress = not args.no_progress
    iterator = cells
    if progress:
        from parity.progress import progress as progress_lines

        iterator = progress_lines(cells, "matrix", unit="cell", leave=True)
    skipped_cells = []
    for model, precision in iterator:
        reason = UNSUPPORTED.get((model, precision, args.device))
        if reason:
            skipped_cells.append(
                {"model": model, "precision": precision, "device": args.device, "reason": reason}
            )
            continue
        config = _config_from_args(args, model, precision, MATRIX_PLAN[precision])
        keys = {fw: config_run_key(fw, config) for fw in ("torch", "jax")}
        todo = tuple(
            fw
            for fw, key in keys.items()
            if args.force or key not in done or done[key]["config"] != config.to_dict()
        )
        if todo:  # else finished in an earlier (possibly interrupted) invocation
            runs = run_pair(config, todo, progress=progress, **_step0_option(args))
            data = merge_runs(out, runs)  # after every cell: an interruption loses one cell at most
            done = {run_key(r): r for r in data["runs"]}
        extra = calibration_runs(
            config,
            noise=args.noise,
            seeds=args.seeds,
            progress=progress,
            skip_keys=set() if args.force else set(done),
        )
        if extra:
            data = merge_runs(out, extra)
            done = {run_key(r): r for r in data["runs"]}
    return _compare_and_report(out, skipped_cells)


def _gpu_missing(args) -> str | None:
    """One line naming each requested framework that has no GPU here, or None."""
    if args.device != "gpu":
        return None
    from parity.hardware import unsupported_reason

    wanted = getattr(args, "framework", "both")
    frameworks = ("torch", "jax") if wanted == "both" else (wanted,)
    reasons = [unsupported_reason(fw, "fp32", "mlp", "gpu") for fw in frameworks]
    reasons = [r for r in reasons if r]
    return "; ".join(reasons) or None


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
            from parity.matmul import main_matmul

            return main_matmul(args)
        if args.command in ("run", "matrix"):
            from parity.measure import set_threads

            set_threads(args.threads)  # before JAX starts its CPU backend; recorded in every run
            missing = _gpu_missing(args)
            code = _cmd_run(args) if args.command == "run" else _cmd_matrix(args)
            if missing:  # what could run ran and is reported; the cells without a GPU are not
                print(f"error: --device gpu: {missing}", file=sys.stderr)
                return 2
            return code
        if args.command == "compare":
            out = Path(args.dir)
            if not (out / "results.json").exists():
                raise ValueError(
                    f"compare: {out / 'results.json'} does not exist; run `python -m parity run --out {out}` first."
                )
            return _compare_and_report(out)
        return _cmd_matrix(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
