"""What emulated block-scaled formats cost on a CPU: one linear layer's forward + backward.

Emulation is a correctness path (quantize, dequantize, float32 matmul), not a speed-up: this
measures its price against the float32 layer, per format, on both sides.

* JAX (jitted ``jax.value_and_grad`` of ``sum(x @ w)``): float32 (`jnp.matmul`), torchao's fp8
  tensorwise recipe (`jaxamp.fp8`, emulated), and the `jaxamp.mx` recipes mxfp8 (RCEIL),
  mxfp8_floor, mxfp8_wgrad_with_hp, mxfp4 (emulated). Variants are timed interleaved, step by
  step in rotating order, after warm-up; compile time is reported apart.
* torch (eager): ``nn.functional.linear`` in float32 and torchao's ``mx_mm`` in
  ``KernelPreference.EMULATED`` (the op behind ``MXFP8Linear``) for the same formats.

Per variant: median wall ms and median CPU ms per step (``time.process_time``: every thread of
the process, so the figure holds on a loaded machine), their ratio to the same side's float32,
and the forward output's relative error against float32 (max |y - y32| / max |y32|). Writes one
JSON record.

    .venv/bin/python benchmarks/bench_mx.py [--shapes 256x1024x1024 64x256x256] [--steps 20] \
        [--repeats 3] [--out benchmarks/results/mx_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp.fp8 as f8
import jaxamp.mx as mx

DN = (((1,), (0,)), ((), ()))
MX_RECIPES = ("mxfp8", "mxfp8_floor", "mxfp8_wgrad_with_hp", "mxfp4")


def jax_variants() -> dict:
    fp8 = f8.get_recipe("tensorwise", emulate=True)
    out = {"fp32": lambda x, w: jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)}
    out["fp8-tensorwise"] = lambda x, w: f8.dot_general(x, w, DN, recipe=fp8)
    for name in MX_RECIPES:
        rec = mx.get_recipe(name, emulate=True)
        out[name] = lambda x, w, rec=rec: mx.dot_general(x, w, DN, recipe=rec)
    return out


def torch_variants() -> dict:
    import torch
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import (
        MXFP8Dim0CastKernelChoice,
        MXFP8Dim1CastKernelChoice,
        ScaleCalculationMode,
    )
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    def mm(elem, mode, wgrad_hp):
        return lambda x, w: mx_mm.apply(
            x,
            w,
            elem,
            elem,
            elem,
            32,
            KernelPreference.EMULATED,
            MXFP8Dim0CastKernelChoice.TORCH,
            MXFP8Dim1CastKernelChoice.TORCH,
            ScaleCalculationMode(mode),
            wgrad_hp,
        )

    e4, e2 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2
    return {
        "fp32": lambda x, w: torch.nn.functional.linear(x, w),
        "mxfp8": mm(e4, "rceil", False),
        "mxfp8_floor": mm(e4, "floor", False),
        "mxfp8_wgrad_with_hp": mm(e4, "rceil", True),
        "mxfp4": mm(e2, "rceil", False),
    }


def _time(step, n: int) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - w0) * 1e3 / n, (time.process_time() - c0) * 1e3 / n


def bench_shape(m: int, k: int, n: int, steps: int, repeats: int, with_torch: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    rows = []
    # --- JAX ---
    fns, compile_s, outputs = {}, {}, {}
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    for name, f in jax_variants().items():
        vg = jax.jit(jax.value_and_grad(lambda a, b, f=f: jnp.sum(f(a, b)), argnums=(0, 1)))
        t0 = time.perf_counter()
        compiled = vg.lower(xj, wj).compile()
        compile_s[name] = time.perf_counter() - t0
        fns[name] = lambda c=compiled: jax.block_until_ready(c(xj, wj))
        outputs[name] = np.asarray(jax.jit(f)(xj, wj))
        for _ in range(3):
            fns[name]()
    rows += _interleaved("jax", fns, steps, repeats, outputs, compile_s, (m, k, n))
    if not with_torch:
        return rows
    # --- torch (eager) ---
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "2")))
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w.T.copy(), requires_grad=True)  # (N, K), torch's layout
    tfns, toutputs = {}, {}
    for name, f in torch_variants().items():

        def step(f=f):
            xt.grad = wt.grad = None
            f(xt, wt).sum().backward()

        tfns[name] = step
        with torch.no_grad():
            toutputs[name] = f(xt, wt).detach().numpy()
        step()
    rows += _interleaved("torch", tfns, steps, repeats, toutputs, {}, (m, k, n))
    return rows


def _interleaved(side, fns, steps, repeats, outputs, compile_s, shape) -> list[dict]:
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for i in range(steps):
            order = names[(i + r) % len(names) :] + names[: (i + r) % len(names)]
            for name in order:
                w_ms, c_ms = _time(fns[name], 1)
                wall[name].append(w_ms)
                cpu[name].append(c_ms)
    ref = outputs["fp32"]
    base_w, base_c = statistics.median(wall["fp32"]), statistics.median(cpu["fp32"])
    rows = []
    for name in names:
        mw, mc = statistics.median(wall[name]), statistics.median(cpu[name])
        err = float(np.max(np.abs(outputs[name] - ref)) / np.max(np.abs(ref)))
        rows.append(
            {
                "side": side,
                "shape": "x".join(map(str, shape)),
                "variant": name,
                "wall_ms": mw,
                "cpu_ms": mc,
                "wall_vs_fp32": mw / base_w,
                "cpu_vs_fp32": mc / base_c,
                "fwd_rel_err": err,
                "compile_s": compile_s.get(name),
                "samples": len(wall[name]),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["256x1024x1024", "64x256x256"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--out", default="benchmarks/results/mx_cpu.json")
    args = p.parse_args()
    rows = []
    for s in args.shapes:
        m, k, n = (int(v) for v in s.split("x"))
        rows += bench_shape(m, k, n, args.steps, args.repeats, not args.no_torch)
    head = f"{'side':<6} {'M x K x N':<15} {'variant':<20} {'wall ms':>9} {'CPU ms':>9} {'wall/fp32':>9} {'CPU/fp32':>9} {'fwd rel err':>11} {'compile s':>9}"
    print(head)
    for r in rows:
        comp = "" if r["compile_s"] is None else f"{r['compile_s']:.2f}"
        print(
            f"{r['side']:<6} {r['shape']:<15} {r['variant']:<20} {r['wall_ms']:>9.2f} "
            f"{r['cpu_ms']:>9.2f} {r['wall_vs_fp32']:>9.2f} {r['cpu_vs_fp32']:>9.2f} "
            f"{r['fwd_rel_err']:>11.2e} {comp:>9}"
        )
    record = {
        "benchmark": "mx_cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_1min": os.getloadavg()[0],
            "jax": jax.__version__,
        },
        "args": vars(args),
        "rows": rows,
    }
    try:
        import torch

        record["machine"]["torch"] = torch.__version__
        record["machine"]["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        record["machine"]["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
