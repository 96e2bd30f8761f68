"""PyTorch vs JAX parity-run benchmark: step time per model and precision, with 95% CIs.

For every model x precision it trains the matched pair with the harness's own trainers (one
`RunConfig` for both sides) in alternating blocks: `--repeats` rounds, each round one short run
per framework (torch eager, JAX, and torch.compile unless `--no-compile`), the order rotated every
round, so load that drifts during the benchmark hits every framework alike. The steps after each
run's warm-up are pooled per framework: the table gives each framework's median step time with a
bootstrap 95% CI and the JAX/torch ratio of medians with its CI (`parity.perf.speed`), and flags a
figure as unreliable where the CI is wide, the spread large or the machine loaded. Thread counts
are set equal on both sides (`--threads`, default every core) and recorded. Cells this hardware
cannot run (torch's bf16 LSTM without AVX-512, no GPU) are listed with the reason, not timed.

Gate: correctness first. Each round's runs go through `parity.verdicts.judge`; a failing verdict is
reported in the "parity" column.

    python benchmarks/bench_parity.py --out benchmarks/results/parity_cpu_ci.json
    python benchmarks/bench_parity.py --device gpu --steps 60 --out benchmarks/results/parity_gpu_ci.json
    python benchmarks/bench_parity.py --render benchmarks/results/parity_cpu_ci.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.cell import run_cell  # noqa: E402
from parity.cli.commands import CLI_DEFAULTS  # noqa: E402
from parity.core.config import RunConfig  # noqa: E402
from parity.models import get_model_pair  # noqa: E402
from parity.perf import measure, speed  # noqa: E402
from parity.verdicts.judge import compare_runs  # noqa: E402

# Batch sizes that give each model a few ms of work per step on a 2-core CPU. torch's float16
# kernels on CPU are ~200x slower: fp16-mixed runs are tiny and only indicative there.
BATCH = {"mlp": 64, "cnn": 32, "cnn_bn": 32, "lstm": 32, "transformer": 16, "resnet": 16}
FP16_CPU_BATCH = 4
GPU_BATCH_SCALE = 8


def _batch(model: str, precision: str, device: str) -> int:
    if device == "gpu":
        return BATCH.get(model, 16) * GPU_BATCH_SCALE
    return FP16_CPU_BATCH if precision == "fp16-mixed" else BATCH.get(model, 16)


def bench_cell(model, precision, *, device, steps, repeats, warmup, compile_torch, log):
    """Alternating-block timing of one cell; returns (summary, raw rounds).

    Each framework's run is the harness's own cell (`parity.cell.run_cell`, one framework, no
    step-0 gate: the verdicts of every round gate the timings instead)."""
    batch = _batch(model, precision, device)
    base = RunConfig(
        model=model,
        precision=precision,
        steps=steps,
        batch_size=batch,
        timing_warmup=warmup,
        eval=False,
        device=device,
        **CLI_DEFAULTS,
    )
    pair = get_model_pair(model, seed=0)
    cell = {"model": model, "precision": precision, "device": device, "batch_size": batch}

    def run(mode):
        config = base.replace(torch_compile=mode == "torch-compile")
        framework = "jax" if mode == "jax" else "torch"
        (record,) = run_cell(config, (framework,), pair=pair, step0_checks=False, echo=False)
        return record

    modes = ["torch", "jax"] + (["torch-compile"] if compile_torch else [])
    rounds, pooled = [], {mode: [] for mode in modes}
    last_runs = {}
    for index in range(repeats):
        order = modes[index % len(modes) :] + modes[: index % len(modes)]
        runs = {}
        for mode in order:
            runs[mode] = run(mode)
            if runs[mode].get("status") == "unsupported":  # this machine cannot run the cell
                cell["unsupported"] = f"{mode}: {runs[mode].get('reason')}"
                log(f"  {model} {precision}: not timed ({cell['unsupported']})")
                return cell, []
            pooled[mode].extend(speed.measured_times(runs[mode]))
        verdicts = compare_runs([runs["torch"], runs["jax"]])
        failed = [f"{v.check}: {v.value_text}" for v in verdicts if v.passed is False]
        medians = {m: runs[m]["summary"]["step_time_median_s"] for m in modes}
        rounds.append(
            {
                "round": index,
                "order": order,
                "step_time_median_s": medians,
                "load_average": measure.load_average(),
                "failed_verdicts": failed,
            }
        )
        last_runs = runs
        log(
            f"  {model} {precision} round {index}: "
            + ", ".join(f"{m} {medians[m] * 1e3:.2f} ms" for m in order)
            + (f"  FAILED {failed}" if failed else "")
        )
    for mode in modes:
        median, low, high = speed.median_ci(pooled[mode])
        cell[mode] = {
            "median_ms": median * 1e3,
            "ci_ms": [low * 1e3, high * 1e3],
            "steps": len(pooled[mode]),
            "peak_memory_bytes": last_runs[mode]["summary"]["peak_memory_bytes"],
            "peak_memory_method": last_runs[mode]["summary"]["peak_memory_method"],
            "compile_time_s": last_runs[mode]["summary"]["compile_time_s"],
        }
    for mode in modes[:1] + modes[2:]:
        ratio, low, high = speed.ratio_ci(pooled["jax"], pooled[mode])
        key = "jax_over_torch_eager" if mode == "torch" else "jax_over_torch_compile"
        cell[key] = {"ratio": ratio, "ci": [low, high]}
    loads = [r["load_average"] for r in rounds if r["load_average"] is not None]
    cell["load_average"] = [min(loads), max(loads)] if loads else None
    cell["warnings"] = [
        w
        for mode in modes
        for w in speed.reliability_warnings(_as_run(last_runs[mode], pooled[mode]))
    ]
    cell["caveats"] = speed.cell_caveats(last_runs["torch"])
    cell["correct"] = not any(r["failed_verdicts"] for r in rounds)
    return cell, rounds


def _as_run(run, times):
    """A run record whose steps are the pooled times (for `speed.reliability_warnings`)."""
    return {**run, "config": {"timing_warmup": 0}, "steps": [{"time_s": t} for t in times]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "lstm", "transformer"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from each run")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (one run per framework)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for both sides")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile runs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/parity_cpu_ci.json"))
    parser.add_argument("--render", nargs="+", metavar="JSON", help="only print saved results")
    args = parser.parse_args(argv)
    if args.render:
        for path in args.render:
            print(render(json.loads(Path(path).read_text())))
        return 0
    if args.device == "gpu":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    threads = measure.set_threads(args.threads)  # before JAX starts its backend
    from parity.core.hardware import hardware_info, hardware_summary
    from parity.core.records import write_json_atomic

    started = time.time()
    load_before = measure.load_average()
    cells, raw = [], []
    for model in args.models:
        for precision in args.precisions:
            cpu_fp16 = precision == "fp16-mixed" and args.device == "cpu"
            steps = min(args.steps, 15) if cpu_fp16 else args.steps
            print(f"{model} {precision}", flush=True)
            cell, rounds = bench_cell(
                model,
                precision,
                device=args.device,
                steps=steps,
                repeats=args.repeats,
                warmup=min(args.warmup, steps - 2),
                compile_torch=not args.no_compile and not cpu_fp16,
                log=lambda line: print(line, flush=True),
            )
            cells.append(cell)
            raw.append({"model": model, "precision": precision, "rounds": rounds})
    hardware = hardware_info()
    record = {
        "benchmark": "parity_ci",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "hardware": hardware,
        "hardware_summary": hardware_summary(hardware),
        "threads": threads,
        "timing": "alternating blocks: each round one run per framework, order rotated per "
        "round; per framework the steps after warm-up are pooled; medians and ratios with "
        "bootstrap 95% CIs",
        "versions": hardware.versions(),
        "args": vars(args),
        "load_average_before": load_before,
        "load_average_after": measure.load_average(),
        "wall_s": time.time() - started,
        "cells": cells,
        "raw": raw,
    }
    write_json_atomic(args.out, record)
    print(render(record))
    print(f"\nwrote {args.out} ({record['wall_s']:.0f} s)")
    return 0


def _ms(entry) -> str:
    if not entry:
        return "—"
    low, high = entry["ci_ms"]
    return f"{entry['median_ms']:.3g} ({low:.3g}–{high:.3g})"


def _ratio(entry) -> str:
    if not entry:
        return "—"
    low, high = entry["ci"]
    return f"**{entry['ratio']:.2f}** ({low:.2f}–{high:.2f})"


def render(record) -> str:
    """The markdown of one benchmark record: medians and ratios with 95% CIs, then notes."""
    lines = [
        f"Machine: {record['hardware_summary']}; load average {record['load_average_before']:.1f} "
        f"before, {record['load_average_after']:.1f} after; {record['wall_s']:.0f} s.",
        "",
        "| model | precision | batch | torch eager ms (95% CI) | torch.compile ms | JAX ms "
        "| JAX / eager (95% CI) | JAX / compile (95% CI) | parity |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for cell in record["cells"]:
        name = f"{cell['model']} {cell['precision']}"
        if "unsupported" in cell:
            lines.append(
                f"| {cell['model']} | {cell['precision']} | {cell['batch_size']} "
                f"| unsupported here | — | — | — | — | — |"
            )
            notes.append(f"- {name}: not timed: {cell['unsupported']}.")
            continue
        lines.append(
            f"| {cell['model']} | {cell['precision']} | {cell['batch_size']} "
            f"| {_ms(cell.get('torch'))} | {_ms(cell.get('torch-compile'))} | {_ms(cell.get('jax'))} "
            f"| {_ratio(cell.get('jax_over_torch_eager'))} "
            f"| {_ratio(cell.get('jax_over_torch_compile'))} "
            f"| {'pass' if cell['correct'] else 'FAIL'} |"
        )
        if cell["caveats"]:
            notes.append(f"- {name}: " + "; ".join(cell["caveats"]) + ".")
        if cell["warnings"]:
            notes.append(f"- {name}: unreliable: " + "; ".join(cell["warnings"]) + ".")
    return "\n".join(lines + [""] + notes)


if __name__ == "__main__":
    sys.exit(main())
