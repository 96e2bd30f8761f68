"""What XLA:CPU compiles for one loss-scaled train step: instructions after optimisation,
fusions, and compile CPU seconds, against the same step without loss scaling.

The steps are `bench_loss_scaled.py`'s (``plain``: `optax.adamw` on the policy-cast loss's
gradients; ``loss_scaled``: the README's step, `jaxamp.loss_scaled` around the same AdamW with
its dynamic loss scale), on its MLP and TinyLM, full size or ``--tiny`` (the sizes the test
suite trains). Each step is lowered and compiled ``--repeats`` times, JAX's in-memory caches
cleared before each lowering (`jax.clear_caches`; a lowered step keeps its executable), the
(variant, model, policy) cells interleaved within each repeat, after one unmeasured warm-up
compile per process; compile time is this process's CPU seconds
(`time.process_time`: XLA:CPU compiles on several threads, and a shared machine's wall clock
measures the waits too), reported as the median and the range. The instruction count is that
of the compiled module's text (fused computations included): what XLA:CPU generates code for.

Comparing two versions of jaxamp: run the script with each on ``PYTHONPATH``, one after the
other and again (A B A B), and pair the medians.

    python benchmarks/compile_loss_scaled.py --tiny --out benchmarks/results/compile_loss_scaled.json
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_loss_scaled as bench  # noqa: E402

VARIANTS = ("plain", "loss_scaled")
POLICIES = ("fp32", "bf16-mixed", "fp16-mixed")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = ", re.MULTILINE)


def measure(models, policies, variants, repeats: int, tiny: bool, batch_size: int) -> list[dict]:
    """One row per (model, policy, variant): instructions and fusions of the compiled program,
    compile CPU seconds of each repeat."""
    cells = []
    for model in models:
        params, x, y, loss_fn = bench._problem(model, batch_size, tiny)
        for policy in policies:
            for variant in variants:
                init, step = bench._make_step(variant, loss_fn, policy, donate=False)
                args = (params, init(params), x, y)
                cells.append(
                    {
                        "model": model,
                        "policy": policy,
                        "variant": variant,
                        "lower": lambda step=step, args=args: step.lower(*args),
                        "compile_cpu_s": [],
                    }
                )
    cells[0]["lower"]().compile()  # the process's first compile pays XLA's own set-up
    for _ in range(repeats):
        for cell in cells:
            jax.clear_caches()
            lowered = cell["lower"]()
            start = time.process_time()
            compiled = lowered.compile()
            cell["compile_cpu_s"].append(time.process_time() - start)
            if "instructions" not in cell:  # the same program every repeat
                text = compiled.as_text()
                cell["instructions"] = len(_INSTRUCTION.findall(text))
                cell["fusions"] = text.count(" fusion(")
    rows = []
    for cell in cells:
        times = cell.pop("compile_cpu_s")
        del cell["lower"]
        rows.append({**cell, "compile_cpu_s": times, "median_cpu_s": statistics.median(times)})
    return rows


def _print(rows: list[dict]) -> None:
    print(
        f"{'model':<12}{'policy':>11}{'variant':>13}{'instructions':>14}{'fusions':>9}"
        f"{'compile CPU s (median)':>24}{'range':>15}"
    )
    for r in rows:
        t = r["compile_cpu_s"]
        print(
            f"{r['model']:<12}{r['policy']:>11}{r['variant']:>13}{r['instructions']:>14}"
            f"{r['fusions']:>9}{r['median_cpu_s']:>24.2f}{min(t):>8.2f}-{max(t):.2f}"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer"]
    )
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny models (the sizes the test suite compiles)"
    )
    parser.add_argument("--out", default="benchmarks/results/compile_loss_scaled.json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")
    load = os.getloadavg()
    rows = measure(
        args.models, args.policies, args.variants, args.repeats, args.tiny, args.batch_size
    )
    _print(rows)
    import jaxamp

    bench._write_json_atomic(
        args.out,
        {
            "rows": rows,
            "jaxamp": os.path.dirname(jaxamp.__file__),
            "jax": jax.__version__,
            "tiny": args.tiny,
            "repeats": args.repeats,
            "load_before": load,
            "load_after": os.getloadavg(),
        },
    )


if __name__ == "__main__":
    main()
