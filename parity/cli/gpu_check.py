"""The one GPU check: every GPU figure the project quotes, in one call of at most 8 minutes.

``bash scripts/gpu_checks.sh OUT`` runs the stages below one after the other, each in its own
process under its own time cap (a slow stage cannot eat the rest), and writes ``OUT/gpu_check.json``
(each stage's command, exit status, seconds, and the figures read back from its files) and
``OUT/gpu_check.log`` (every stage's output). It needs what a CUDA image has (CUDA torch, JAX with
CUDA, flax, optax) plus jmp and this checkout.

Stages: the machine (``nvidia-smi``, versions); ``parity matmul`` at 1024/4096/8192 in fp32, bf16
and fp16; the ``gpt2-small`` cell at fp32, bf16-mixed and fp16-mixed (30 steps, alternating speed
blocks), and bf16-mixed again under ``--torch-compile``; ``benchmarks/bench_loss_scaled.py``; the
jaxamp test files under ``JAX_PLATFORMS=cuda``. From the cells it reports, per framework, the
bf16-mixed/fp32 and fp16-mixed/fp32 step-time speed-ups, the JAX/torch figure of each precision
(eager and torch.compile), allocator peaks and each cell's verdict.

``--dry`` (CPU, CI): every stage's command is built and parsed (the command line's own parser,
a script's ``--help``, pytest's collection), the first cell runs one step of a one-layer
``gpt2-small``-wide model at context 8 on CPU, and the figures are read back from it, so the plan
cannot rot where no GPU is lent.

    bash scripts/gpu_checks.sh OUT          # on the GPU machine
    bash scripts/gpu_checks.sh --dry OUT    # anywhere: the plan, checked
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from parity.cli.commands import build_parser
from parity.core.records import load_results, run_label
from parity.perf import speed

__all__ = ["BUDGET_S", "DRY_CAP_S", "Stage", "main", "plan", "summarise"]

BUDGET_S = 480  # every stage's cap together: 8 minutes
# The dry mode's cap per stage: a shared CPU is no GPU, and the caps are the GPU plan's.
DRY_CAP_S = 900
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
JAXAMP_TESTS = (
    "tests/jaxamp/test_autocast.py",
    "tests/jaxamp/test_policy.py",
    "tests/jaxamp/test_loss_scale.py",
    "tests/jaxamp/test_all_finite.py",
    "tests/jaxamp/test_reduce_dtype.py",
    "tests/jaxamp/test_overflow_edges.py",
)
_ENV = (
    "import jax, torch; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__, "
    "torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: its name, command, time cap (seconds) and extra environment."""

    name: str
    command: tuple[str, ...]
    cap_s: int
    env: tuple[tuple[str, str], ...] = ()


def _cell(out: Path, precision: str, *, dry: bool, compiled: bool = False) -> tuple[str, ...]:
    folder = out / ("gpt2_compile" if compiled else "gpt2")
    cmd = ["-m", "parity", "run", "--model", "transformer", "--size", "gpt2-small"]
    cmd += ["--precision", precision, "--no-eval", "--no-plots", "--no-progress"]
    cmd += ["--out", str(folder)]
    if dry:
        cmd += ["--device", "cpu", "--steps", "1", "--batch-size", "2", "--speed-blocks", "0"]
        cmd += ["--model-override", "seq_len=8", "--model-override", "num_layers=1"]
    else:
        cmd += ["--device", "gpu", "--steps", "30", "--batch-size", "8", "--speed-blocks", "4"]
    if compiled:
        cmd.append("--torch-compile")
    return (sys.executable, *cmd)


def plan(out: Path, *, dry: bool = False) -> list[Stage]:
    """The stages, in order, with their caps (together `BUDGET_S`)."""
    py = sys.executable
    device = "cpu" if dry else "gpu"
    sizes = ["64"] if dry else ["1024", "4096", "8192"]
    stages = [
        Stage("machine", (py, "-c", _ENV), 15),
        Stage(
            "matmul",
            (py, "-m", "parity", "matmul", "--device", device, "--sizes", *sizes, "--dtypes")
            + ("fp32", "bf16", "fp16", "--out", str(out / "matmul"), "--quiet"),
            45,
        ),
    ]
    stages += [Stage(f"gpt2-small {p}", _cell(out, p, dry=dry), 80) for p in PRECISIONS]
    stages.append(
        Stage(
            "gpt2-small bf16-mixed torch.compile",
            _cell(out, "bf16-mixed", dry=dry, compiled=True),
            70,
        )
    )
    stages.append(
        Stage(
            "bench_loss_scaled",
            (py, "benchmarks/bench_loss_scaled.py", "--out", str(out / "loss_scaled.json")),
            40,
        )
    )
    stages.append(
        Stage(
            "jaxamp tests (JAX_PLATFORMS=cuda)",
            (py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *JAXAMP_TESTS),
            60,
            (("JAX_PLATFORMS", "cpu" if dry else "cuda"),),
        )
    )
    return stages


def _dry_command(stage: Stage, run_it: bool) -> tuple[str, ...] | None:
    """What the dry mode runs for `stage`: the stage itself (`run_it`: the matmul at n=64, the
    first cell shrunk), a parse of it (a script's ``--help``, pytest's collection), or None (a
    ``python -m parity`` command parsed in this process)."""
    args = list(stage.command[1:])
    if args[:2] == ["-m", "parity"]:
        return stage.command if run_it else None
    if args[:2] == ["-m", "pytest"]:
        return (*stage.command[:3], "--collect-only", *args[2:])
    if args and args[0].endswith(".py"):
        return (stage.command[0], args[0], "--help")
    return stage.command


def _parse_parity(stage: Stage) -> None:
    """Parses a ``python -m parity`` stage with the command line's own parser (SystemExit on
    a bad argument, as the real run would)."""
    build_parser().parse_args(list(stage.command[3:]))


def _parsed(stage: Stage) -> dict[str, Any]:
    try:
        _parse_parity(stage)
        rc = 0
    except SystemExit as e:  # argparse's refusal
        rc = int(e.code or 0) or 2
    return {
        "stage": stage.name,
        "command": " ".join(stage.command),
        "cap_s": stage.cap_s,
        "rc": rc,
        "timed_out": False,
        "seconds": 0.0,
        "dry": "parsed",
    }


def run_stage(
    stage: Stage, log, *, command: tuple[str, ...] | None = None, cap_s: int | None = None
) -> dict[str, Any]:
    """Runs one stage under its cap (or `cap_s`); its output goes to `log`. Never raises."""
    command = command or stage.command
    if cap_s is not None:
        stage = dataclasses.replace(stage, cap_s=cap_s)
    log.write(f"\n== {stage.name} (cap {stage.cap_s} s): {' '.join(command)}\n")
    log.flush()
    start = time.perf_counter()
    env = {**os.environ, **dict(stage.env)}
    try:
        done = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, timeout=stage.cap_s, env=env
        )
        rc, timed_out = done.returncode, False
    except subprocess.TimeoutExpired:
        rc, timed_out = 124, True
    seconds = time.perf_counter() - start
    log.write(
        f"== {stage.name}: rc={rc}{' (cap reached)' if timed_out else ''} in {seconds:.0f} s\n"
    )
    log.flush()
    return {
        "stage": stage.name,
        "command": " ".join(command),
        "cap_s": stage.cap_s,
        "rc": rc,
        "timed_out": timed_out,
        "seconds": round(seconds, 1),
    }


def _median(run: dict[str, Any]) -> float | None:
    return (run.get("summary") or {}).get("step_time_median_s")


def summarise(out: Path) -> dict[str, Any]:
    """The figures the stages left in `out`: matmul cases, and per gpt2-small cell the verdict,
    each framework's median step time and allocator peak, the JAX/torch speed figure, and the
    low-precision speed-ups over fp32 per framework."""
    figures: dict[str, Any] = {}
    matmul = out / "matmul" / "matmul.json"
    if matmul.exists():
        figures["matmul"] = json.loads(matmul.read_text())
    cells: dict[str, Any] = {}
    medians: dict[str, dict[str, float]] = {}
    for folder in ("gpt2", "gpt2_compile"):
        if not (out / folder / "results.json").exists():
            continue
        runs = [r for r in load_results(out / folder)["runs"] if not r.get("variant")]
        verdicts = out / folder / "verdicts.json"
        status = json.loads(verdicts.read_text())["status"] if verdicts.exists() else None
        for key, members in speed.cells(runs).items():
            precision = key[1]
            cell = cells.setdefault(f"{folder} {precision}", {"status": status, "runs": {}})
            for label, run in members.items():
                summary = run.get("summary") or {}
                cell["runs"][label] = {
                    "median_step_s": _median(run),
                    "peak_memory_bytes": summary.get("peak_memory_bytes"),
                    "peak_memory_method": summary.get("peak_memory_method"),
                }
                if _median(run):
                    medians.setdefault(run_label(run), {})[precision] = _median(run)
            reference = speed.torch_reference(members)
            for label in speed.jax_labels(members):
                if reference is not None:
                    figure = speed.speed_figure(members[label], reference[1])
                    cell[f"{label} vs {reference[0]}"] = {
                        "status": figure["status"],
                        "text": figure["text"],
                    }
    speedups = {
        label: {
            f"{p}/fp32": by[p] and by["fp32"] / by[p]
            for p in PRECISIONS[1:]
            if p in by and "fp32" in by
        }
        for label, by in medians.items()
    }
    figures["gpt2_small"] = {"cells": cells, "speedup_over_fp32": speedups}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the one GPU check (see the module docstring)")
    parser.add_argument("--out", required=True, help="folder for gpt2_check.json and its log")
    parser.add_argument("--dry", action="store_true", help="CPU: parse every stage, run one step")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = plan(out, dry=args.dry)
    results = []
    with open(out / "gpu_check.log", "w") as log:
        cell_ran = False
        for stage in stages:
            if not args.dry:
                results.append(run_stage(stage, log))
                continue
            is_cell = "run" in stage.command[3:4]
            command = _dry_command(stage, run_it=not (is_cell and cell_ran))
            cell_ran = cell_ran or is_cell
            if command is None:
                results.append(_parsed(stage))
                log.write(f"\n== {stage.name}: {' '.join(stage.command)}\n")
                log.write(f"== {stage.name}: parsed, rc={results[-1]['rc']}\n")
            elif command is stage.command:
                results.append(run_stage(stage, log, cap_s=DRY_CAP_S) | {"dry": "ran"})
            else:
                parsed = run_stage(stage, log, command=command, cap_s=DRY_CAP_S)
                results.append(parsed | {"dry": "parsed"})
    report = {
        "dry": args.dry,
        "budget_s": BUDGET_S,
        "stages": results,
        "figures": summarise(out),
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    failed = [r["stage"] for r in results if r["rc"] != 0]
    print(
        f"gpu check{' (dry)' if args.dry else ''}: {len(results) - len(failed)}/{len(results)} "
        f"stages ok{'; failed: ' + ', '.join(failed) if failed else ''}; {out / 'gpu_check.json'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
