"""PyTorch vs JAX parity-run benchmark: step time per model and precision, with spread.

For every model x precision it trains the matched pair with the harness's own trainers (the same
config object on both sides), `--repeats` times, interleaving torch eager, torch.compile and JAX
so that drifting machine load hits all of them alike. Each repeat gives one ratio
``jax / torch_eager`` and ``jax / torch_compile`` of median step times (after warm-up, synced);
the table reports the median ratio and its spread ((max - min) / median) over the repeats, and
flags spreads above 10%. It also reports bf16-mixed vs fp32 peak memory (each side's method).

Gate: correctness first — a repeat whose runs fail `parity.compare` is reported, not timed.

    python benchmarks/bench_parity.py --out benchmarks/results/parity_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.compare import compare_runs  # noqa: E402
from parity.config import RunConfig  # noqa: E402
from parity.measure import versions  # noqa: E402
from parity.models import get_model_pair  # noqa: E402
from parity.report import write_json_atomic  # noqa: E402
from parity.train_jax import train_jax  # noqa: E402
from parity.train_torch import train_torch  # noqa: E402

# Batch sizes that give each model a few ms of work per step on a 2-core CPU. torch's float16
# kernels on CPU are ~200x slower: fp16-mixed runs are tiny and only indicative.
BATCH = {"mlp": 64, "cnn": 32, "cnn_bn": 32, "lstm": 32, "transformer": 16}
FP16_BATCH = 4
SPREAD_LIMIT = 0.10


def _spread(values):
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def bench_cell(model, precision, *, steps, repeats, warmup, compile_torch, progress):
    batch = FP16_BATCH if precision == "fp16-mixed" else BATCH[model]
    base = RunConfig(
        model=model,
        precision=precision,
        steps=steps,
        batch_size=batch,
        timing_warmup=warmup,
        lr_warmup_steps=10,  # as the CLI's default (see parity/cli.py)
        eval=False,
    )
    pair = get_model_pair(model, seed=0)
    modes = ["torch", "jax"] + (["torch-compile"] if compile_torch else [])
    repeats_out = []
    for repeat in range(repeats):
        runs = {}
        for mode in modes:
            if mode == "jax":
                runs[mode] = train_jax(base, pair)
            else:
                config = base.replace(torch_compile=mode == "torch-compile")
                runs[mode] = train_torch(config, pair)
        verdicts = compare_runs([runs["torch"], runs["jax"]])
        failed = [f"{v.check}: {v.value_text}" for v in verdicts if v.passed is False]
        times = {m: r["summary"]["step_time_median_s"] for m, r in runs.items()}
        record = {
            "repeat": repeat,
            "step_time_median_s": times,
            "compile_time_s": {m: r["summary"]["compile_time_s"] for m, r in runs.items()},
            "peak_memory_bytes": {m: r["summary"]["peak_memory_bytes"] for m, r in runs.items()},
            "peak_memory_method": {m: r["summary"]["peak_memory_method"] for m, r in runs.items()},
            "failed_verdicts": failed,
            "jax_over_torch_eager": times["jax"] / times["torch"],
        }
        if "torch-compile" in times:
            record["jax_over_torch_compile"] = times["jax"] / times["torch-compile"]
        repeats_out.append(record)
        if progress:
            print(
                f"  {model} {precision} repeat {repeat}: "
                + ", ".join(f"{m} {t * 1e3:.2f} ms" for m, t in times.items())
                + (f"  FAILED {failed}" if failed else ""),
                flush=True,
            )
    summary = {"model": model, "precision": precision, "batch_size": batch, "steps": steps}
    for mode in modes:
        values = [r["step_time_median_s"][mode] for r in repeats_out]
        summary[f"{mode}_step_ms"] = _median(values) * 1e3
        summary[f"{mode}_step_spread"] = _spread(values)
        summary[f"{mode}_peak_memory_bytes"] = repeats_out[0]["peak_memory_bytes"][mode]
        summary[f"{mode}_peak_memory_method"] = repeats_out[0]["peak_memory_method"][mode]
    for key in ("jax_over_torch_eager", "jax_over_torch_compile"):
        values = [r.get(key) for r in repeats_out]
        if any(v is not None for v in values):
            summary[key] = _median(values)
            summary[f"{key}_min"] = min(v for v in values if v is not None)
            summary[f"{key}_max"] = max(v for v in values if v is not None)
            summary[f"{key}_spread"] = _spread(values)
    summary["ratios_repeat_within_10pct"] = all(
        summary.get(f"{k}_spread", 0.0) <= SPREAD_LIMIT
        for k in ("jax_over_torch_eager", "jax_over_torch_compile")
    )
    summary["correct"] = not any(r["failed_verdicts"] for r in repeats_out)
    return summary, repeats_out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "lstm", "transformer"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed", "bf16-true"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from each median")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile runs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/parity_cpu.json"))
    parser.add_argument(
        "--render", nargs="+", metavar="JSON", help="only print tables of saved runs"
    )
    args = parser.parse_args(argv)
    if args.render:
        render([json.loads(Path(path).read_text()) for path in args.render])
        return 0

    started = time.time()
    cells, raw = [], []
    for model in args.models:
        for precision in args.precisions:
            steps = min(args.steps, 15) if precision == "fp16-mixed" else args.steps
            print(f"{model} {precision}", flush=True)
            summary, repeats = bench_cell(
                model,
                precision,
                steps=steps,
                repeats=args.repeats,
                warmup=min(args.warmup, steps - 2),
                compile_torch=not args.no_compile and precision != "fp16-mixed",
                progress=True,
            )
            cells.append(summary)
            raw.append({"model": model, "precision": precision, "repeats": repeats})
    memory = []
    for model in args.models:
        by = {c["precision"]: c for c in cells if c["model"] == model}
        if "fp32" in by and "bf16-mixed" in by:
            row = {"model": model}
            for mode in ("torch", "jax"):
                a = by["fp32"][f"{mode}_peak_memory_bytes"]
                b = by["bf16-mixed"][f"{mode}_peak_memory_bytes"]
                row[f"{mode}_fp32_bytes"] = a
                row[f"{mode}_bf16_mixed_bytes"] = b
                row[f"{mode}_bf16_over_fp32"] = b / a if a and b else None
                row[f"{mode}_method"] = by["fp32"][f"{mode}_peak_memory_method"]
            memory.append(row)
    record = {
        "benchmark": "parity_cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu",
        "gpu": "none available",
        "versions": versions(),
        "args": vars(args),
        "wall_s": time.time() - started,
        "cells": cells,
        "memory": memory,
        "raw": raw,
    }
    write_json_atomic(args.out, record)
    render([record])
    print(f"\nwrote {args.out} ({record['wall_s']:.0f} s)")
    return 0


def _best_of(repeats, mode):
    return min(r["step_time_median_s"][mode] for r in repeats)


def render(records) -> None:
    """Prints the markdown tables of one or more benchmark records.

    Besides the median ratio over repeats and its min-max, it gives the best-of-repeats ratio
    (each framework's fastest repeat): on a shared machine the fastest repeat is the least
    disturbed one.
    """
    cells = [c for rec in records for c in rec["cells"]]
    raw = {(r["model"], r["precision"]): r["repeats"] for rec in records for r in rec["raw"]}
    memory = [m for rec in records for m in rec["memory"]]
    print(
        "| model | precision | batch | torch eager ms | torch.compile ms | JAX ms "
        "| JAX / eager: median (min–max) | best-of | JAX / compile: median (min–max) | best-of "
        "| spread ≤ 10% | parity |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        repeats = raw[(c["model"], c["precision"])]

        def ratio(key, c=c):
            if key not in c:
                return "—"
            return f"{c[key]:.2f} ({c[key + '_min']:.2f}–{c[key + '_max']:.2f})"

        def best(mode, repeats=repeats):
            if mode not in repeats[0]["step_time_median_s"]:
                return "—"
            return f"{_best_of(repeats, 'jax') / _best_of(repeats, mode):.2f}"

        compile_ms = c.get("torch-compile_step_ms")
        print(
            f"| {c['model']} | {c['precision']} | {c['batch_size']} | {c['torch_step_ms']:.2f} "
            f"| {'—' if compile_ms is None else f'{compile_ms:.2f}'} | {c['jax_step_ms']:.2f} "
            f"| {ratio('jax_over_torch_eager')} | {best('torch')} "
            f"| {ratio('jax_over_torch_compile')} | {best('torch-compile')} "
            f"| {'yes' if c['ratios_repeat_within_10pct'] else 'no'} "
            f"| {'pass' if c['correct'] else 'FAIL'} |"
        )
    print()
    print(
        "| model | torch fp32 MiB | torch bf16-mixed MiB | ratio | JAX fp32 MiB "
        "| JAX bf16-mixed MiB | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in memory:
        print(
            f"| {m['model']} | {m['torch_fp32_bytes'] / 2**20:.2f} "
            f"| {m['torch_bf16_mixed_bytes'] / 2**20:.2f} | {m['torch_bf16_over_fp32']:.2f} "
            f"| {m['jax_fp32_bytes'] / 2**20:.2f} | {m['jax_bf16_mixed_bytes'] / 2**20:.2f} "
            f"| {m['jax_bf16_over_fp32']:.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
