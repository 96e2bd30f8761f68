"""The programs XLA gets for one loss-scaled train step, per platform, read on any machine.

Each step of `bench_loss_scaled.py` (plain AdamW, jaxamp's `loss_scaled` in both forms, Flax's
`DynamicScale`, jmp) is lowered for XLA:CPU and for XLA:GPU with
``jax.jit(step).trace(...).lower(lowering_platforms=(platform,))``: no GPU is needed to read GPU's
program. In the lowered HLO (before XLA's own passes) the script counts what decides a loss
scaler's cost on a GPU, where an elementwise chain becomes one kernel and a reduction cannot
fuse with the elementwise work that waits for its result:

* ``extra reductions``: reductions over arrays of >= 1024 elements beyond the plain step's
  (XLA:GPU runs each in a kernel of its own; it cannot fuse with the update that waits for it);
* ``extra elements reduced``: the elements those reductions read, in units of the gradients'
  element count: 1.0 is one more pass over the gradients;
* ``extra partial bytes``: what those reductions write when their result is not a scalar (a
  buffer between two passes);
* ``conditionals``: conditionals left whose predicate is computed (XLA:GPU copies each such
  predicate to the host and waits for it, every step);
* ``selects``: selects of arrays of >= 1024 elements (one of an elementwise result fuses into
  the update on GPU: no pass of its own, one operand more per element);
* ``callbacks``: host callbacks.

    python benchmarks/hlo_loss_scaled.py --out benchmarks/results/hlo_loss_scaled.json

The table is printed as it goes and the JSON written at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_loss_scaled as bench  # noqa: E402

VARIANTS = ("plain", "loss_scaled", "loss_scaled_in_place", "flax", "jmp")
PLATFORMS = ("cpu", "cuda")
BIG = 1024  # elements: a parameter, gradient or state leaf, not a scalar of the loss scale
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2}


def _array_bytes(typ: str) -> tuple[int, int]:
    """(elements, bytes) of one HLO array type such as ``f32[784,1024]{1,0}``."""
    m = re.match(r"(\w+)\[([\d,]*)\]", typ)
    if not m:
        return 0, 0
    dtype, dims = m.groups()
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    return n, n * _BYTES.get(dtype, 4)


def _instructions(hlo: str) -> list[tuple[str, str, str, list[str]]]:
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)", line)
        if m:
            name, typ, op, operands = m.groups()
            found.append((name, typ, op, [o.strip() for o in operands.split(",") if o.strip()]))
    return found


def program_stats(hlo: str, grad_elements: int) -> dict:
    """The counts above for one lowered HLO module's text."""
    instructions = _instructions(hlo)
    types = {name: typ for name, typ, _, _ in instructions}
    constants = {name for name, _, op, _ in instructions if op == "constant"}
    stages = read = partial = selects = conditionals = callbacks = 0
    for _, typ, op, operands in instructions:
        if op == "reduce":
            n, _ = _array_bytes(types.get(operands[0], ""))
            if n >= BIG:
                stages += 1
                read += n
                out_n, out_bytes = _array_bytes(typ)
                partial += out_bytes if out_n > 1 else 0
        elif op == "select" and _array_bytes(typ)[0] >= BIG:
            selects += 1
        elif op == "conditional" and operands[0] not in constants:
            conditionals += 1
        elif op == "custom-call" and "callback" in typ + " ".join(operands):
            callbacks += 1
    return {
        "reductions": stages,
        "reduced_elements": round(read / grad_elements, 3),
        "partial_bytes": partial,
        "conditionals": conditionals,
        "selects": selects,
        "callbacks": callbacks,
    }


def analyse(models, policies, variants, platforms):
    rows = []
    for model in models:
        params, x, y, loss_fn = bench._problem(model, 32)
        grad_elements = sum(leaf.size for leaf in jax.tree.leaves(params))
        for policy in policies:
            for variant in variants:
                for donate in (True, False):
                    init, step = bench._make_step(variant, loss_fn, policy, donate=donate)
                    state = init(params)
                    traced = step.trace(params, state, x, y)
                    for platform in platforms:
                        hlo = traced.lower(lowering_platforms=(platform,)).as_text(dialect="hlo")
                        row = {
                            "model": model,
                            "policy": policy,
                            "variant": variant,
                            "donated": donate,
                            "platform": platform,
                            **program_stats(hlo, grad_elements),
                        }
                        base = next(
                            (
                                r
                                for r in rows
                                if r["variant"] == "plain"
                                and (r["model"], r["policy"], r["donated"], r["platform"])
                                == (model, policy, donate, platform)
                            ),
                            row,
                        )
                        for key in ("reductions", "reduced_elements", "partial_bytes"):
                            row[f"extra_{key}"] = round(row[key] - base[key], 3)
                        rows.append(row)
                        print(_format(row), flush=True)
    return rows


def _format(row: dict) -> str:
    return (
        f"| {row['model']} | {row['policy']} | {row['variant']} | "
        f"{'yes' if row['donated'] else 'no'} | {row['platform']} | "
        f"{row['extra_reductions']} | {row['extra_reduced_elements']} | "
        f"{row['extra_partial_bytes']} | {row['conditionals']} | {row['selects']} | "
        f"{row['callbacks']} |"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    parser.add_argument("--policies", nargs="+", default=["fp32", "bf16-mixed", "fp16-mixed"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--platforms", nargs="+", default=list(PLATFORMS))
    parser.add_argument("--out", default="benchmarks/results/hlo_loss_scaled.json")
    args = parser.parse_args(argv)
    for name, given, allowed in (
        ("--variants", args.variants, VARIANTS),
        ("--platforms", args.platforms, ("cpu", "cuda", "rocm", "tpu")),
    ):
        bad = [v for v in given if v not in allowed]
        if bad:
            parser.error(f"{name} {bad[0]!r}: choose from {', '.join(allowed)}")
    print(
        "| model | policy | variant | donated | platform | extra reductions | extra elements "
        "reduced / gradient elements | extra partial bytes | conditionals | selects | callbacks |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = analyse(args.models, args.policies, args.variants, args.platforms)
    payload = {"jax": jax.__version__, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
