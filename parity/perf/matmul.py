"""Square-matmul micro-benchmark: fp32 / bf16 / fp16 on torch and JAX, TFLOP/s and fraction of peak.

``python -m parity matmul`` times ``C = A @ B`` for n x n operands over a range of sizes, in each
dtype, on both frameworks, interleaved step by step (`parity.perf.measure.time_interleaved`) so machine
load hits both alike, after warm-up (JAX compiles in the warm-up rounds) and with the device synced
before every clock read. For every (framework, dtype, size) it reports the median time with a
bootstrap 95% CI, achieved TFLOP/s (2 n^3 flops per product), the fraction of the device's peak
where the peak is known (H100 SXM / H200 from their data sheets; a CPU's peak is not known here and
the output says so), the operand bytes, and on GPU each allocator's peak. Each product is first
checked against a float64 reference on a few rows (within the worst-case rounding bound of an
n-term dot product in the operand dtype): a wrong kernel is reported, not timed.

fp32 runs at full precision on both sides (``torch.set_float32_matmul_precision("highest")``, TF32
off; JAX ``precision=HIGHEST``). On CPU, torch's float16 and bfloat16 matmuls range from as fast as
float32 (AVX512-FP16/AMX) to ~200x slower (emulated): a probe measures this machine's
(`parity.core.hardware.torch_matmul_probe`, recorded), and a case whose products it predicts would
take longer than `CPU_CASE_BUDGET_S` in all is recorded as not run, with the measured figure as
the reason. XLA:CPU upcasts bf16/fp16 dots to float32, so JAX gets no low-precision speed-up on
CPU.

    python -m parity matmul --sizes 256 512 1024 2048 --out runs/matmul         # CPU
    python -m parity matmul --device gpu --sizes 1024 2048 4096 8192 --out runs/matmul_gpu
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parity.core.hardware import (
    UnsupportedHere,
    cpu_model_name,
    hardware_info,
    torch_matmul_probe,
    unsupported_reason,
    versions,
)
from parity.core.records import write_bytes_atomic, write_json_atomic
from parity.perf import measure, speed
from parity.perf.measure import thread_settings

__all__ = [
    "CPU_CASE_BUDGET_S",
    "DTYPES",
    "PEAK_TFLOPS",
    "format_table",
    "peak_tflops",
    "plot_matmul",
    "predicted_case_seconds",
    "run_matmul_benchmark",
]

DTYPES = ("fp32", "bf16", "fp16")
_NUMPY = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# A torch CPU case in bf16/fp16 is not run when the probe predicts its products (timed, warm-up
# and the correctness check) would take longer than this in all.
CPU_CASE_BUDGET_S = 30.0
# Dense peaks, TFLOP/s (the vendors' data sheets). fp32 is the non-tensor-core rate: TF32 is off.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0},
    "H200": {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0},
}


def peak_tflops(device_name: str, dtype: str) -> tuple[float | None, str]:
    """The dense peak of a device for a dtype, and where it comes from (or why it is unknown).

    Args:
      device_name: as torch or JAX name the device ("NVIDIA H100 80GB HBM3", "cpu").
      dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``.

    Returns:
      ``(peak or None, source text)``.

    Example:
      >>> peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
      (989.0, 'H100 SXM data sheet (dense)')
      >>> peak_tflops("cpu", "fp32")[0] is None
      True
    """
    name = device_name.upper()
    if "H200" in name:
        key = "H200"
    elif "H100" in name and ("SXM" in name or "HBM3" in name):
        key = "H100 SXM"
    else:
        return None, f"peak of {device_name!r} unknown (no data-sheet figure recorded)"
    return PEAK_TFLOPS[key][dtype], f"{key} data sheet (dense)"


def predicted_case_seconds(probe: dict[str, Any], n: int, products: int) -> float:
    """Seconds `products` n x n products would take, from a probe at ``probe["n"]``: its
    per-product time scaled by n^3 (a dense matmul's work; an underestimate where the operands
    outgrow the caches, so the budget is generous).

    Example:
      >>> predicted_case_seconds({"n": 256, "dtype_s": 0.01}, 512, 10)
      0.8
    """
    return probe["dtype_s"] * (n / probe["n"]) ** 3 * products


def _torch_cpu_skip(dtype: str, n: int, products: int, probes: dict) -> str | None:
    """Why torch's CPU `dtype` case of size `n` is not run (the probe's prediction), or None."""
    if dtype == "fp32":
        return None
    name = _torch_dtype(dtype)
    if name not in probes:
        probes[name] = torch_matmul_probe(name)
    probe = probes[name]
    predicted = predicted_case_seconds(probe, n, products)
    if predicted <= CPU_CASE_BUDGET_S:
        return None
    return (
        f"torch {dtype} matmul measured here at {probe['ratio_to_fp32']:.3g}x its fp32 time "
        f"(n={probe['n']}: {probe['dtype_s'] * 1e3:.3g} ms per product), so n={n} would take "
        f"~{predicted:.0f} s for its {products} products (budget {CPU_CASE_BUDGET_S:g} s)"
    )


def _check_args(sizes, dtypes, frameworks, device, repeats, warmup) -> None:
    import difflib

    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"matmul: `sizes` must be positive integers; got {list(sizes)!r}.")
    for dtype in dtypes:
        if dtype not in DTYPES:
            close = difflib.get_close_matches(str(dtype), DTYPES, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"matmul: `dtypes` must be from {DTYPES}; got {dtype!r}.{hint}")
    for framework in frameworks:
        if framework not in ("torch", "jax"):
            raise ValueError(
                f"matmul: `frameworks` must be from ('torch', 'jax'); got {framework!r}."
            )
    if device not in ("cpu", "gpu"):
        raise ValueError(f"matmul: `device` must be 'cpu' or 'gpu'; got {device!r}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 3:
        raise ValueError(f"matmul: `repeats` must be an integer >= 3; got {repeats!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"matmul: `warmup` must be an integer >= 1; got {warmup!r}.")


def _operands(n: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    import ml_dtypes  # noqa: F401  (numpy's bfloat16; a JAX dependency)

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n), dtype=np.float32).astype(_NUMPY[dtype])
    b = rng.standard_normal((n, n), dtype=np.float32).astype(_NUMPY[dtype])
    return a, b


def _check_product(
    name: str, c: np.ndarray, a: np.ndarray, b: np.ndarray, dtype: str
) -> str | None:
    """None when the first rows of `c` are within the rounding of a float32-accumulated product.

    Both frameworks accumulate bf16/fp16 products in float32 (CPU kernels and tensor cores); the
    bound allows that accumulation's worst case (n * eps32 * sum|a||b|), the output's rounding
    (2 eps|c|) and a few roundings in the operand dtype of partial sums, whose size is about
    sqrt(sum (ab)^2) (cuBLAS may reduce split-K partial sums in fp16). A transposed or otherwise
    wrong product is off by about that same sqrt(sum (ab)^2): caught.
    """
    import ml_dtypes

    rows = min(4, a.shape[0])
    a64, b64 = a[:rows].astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64
    scale = np.abs(a64) @ np.abs(b64)
    rms = np.sqrt((a64**2) @ (b64**2))
    eps = float(ml_dtypes.finfo(a.dtype).eps)  # bfloat16 2**-7, float16 2**-10, float32 2**-23
    eps32 = float(np.finfo(np.float32).eps)
    bound = 2 * eps * np.abs(exact) + a.shape[1] * eps32 * scale + 4 * eps * rms
    got = c[:rows].astype(np.float64)
    if not np.all(np.isfinite(got)) or np.any(np.abs(got - exact) > bound):
        worst = float(np.max(np.abs(got - exact) - bound))
        return f"{name}: product off by {worst:.3g} beyond the rounding bound"
    return None


def _torch_case(n, dtype, device, a, b):
    import torch

    torch_device = torch.device("cuda" if device == "gpu" else "cpu")
    ta = (
        torch.from_numpy(a.astype(np.float32))
        .to(torch_device)
        .to(getattr(torch, _torch_dtype(dtype)))
    )
    tb = (
        torch.from_numpy(b.astype(np.float32))
        .to(torch_device)
        .to(getattr(torch, _torch_dtype(dtype)))
    )

    def step():
        out = ta @ tb
        measure.torch_sync(device)
        return out

    def result():
        return (ta @ tb).float().cpu().numpy()

    return step, result


def _torch_dtype(dtype: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]


def _jax_case(n, dtype, device, a, b):
    import jax
    import jax.numpy as jnp

    target = jax.devices("gpu" if device == "gpu" else "cpu")[0]
    ja = jax.device_put(jnp.asarray(a), target)
    jb = jax.device_put(jnp.asarray(b), target)
    product = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))

    def step():
        return product(ja, jb).block_until_ready()

    def result():
        return np.asarray(product(ja, jb).astype(jnp.float32))

    return step, result


def _device_name(framework: str, device: str) -> str:
    if device == "cpu":
        return cpu_model_name()
    if framework == "torch":
        import torch

        return torch.cuda.get_device_name(0)
    import jax

    return jax.devices("gpu")[0].device_kind


def run_matmul_benchmark(
    sizes: Sequence[int] = (256, 512, 1024),
    dtypes: Sequence[str] = DTYPES,
    frameworks: Sequence[str] = ("torch", "jax"),
    *,
    device: str = "cpu",
    repeats: int = 10,
    warmup: int = 2,
    seed: int = 0,
    progress: Any = None,
) -> dict[str, Any]:
    """Times square matmuls on both frameworks; returns the JSON-able benchmark record.

    Args:
      sizes: n of the n x n operands.
      dtypes: from `DTYPES`.
      frameworks: ``"torch"`` and/or ``"jax"``.
      device: ``"cpu"`` or ``"gpu"``.
      repeats: timed products per (framework, dtype, size) (>= 3), interleaved across frameworks.
      warmup: untimed rounds first (JAX compiles here).
      seed: operand seed.
      progress: a callable receiving one line per case (None: silent).

    Returns:
      ``{"benchmark": "matmul", "device", "hardware", "versions", "results": [row, ...],
      "not_run": [...]}``; a row has framework, dtype, n, median_s, ci_s, tflops, tflops_ci,
      peak_tflops, fraction_of_peak, peak_source, operand_bytes, correct, error.

    Raises:
      ValueError: bad arguments (naming the parameter and what is allowed).
      parity.core.hardware.UnsupportedHere: `device` is "gpu" and no framework asked for can use one.

    Example:
      >>> record = run_matmul_benchmark([32], ["fp32"], ["jax"], repeats=3, warmup=1)
      >>> record["results"][0]["tflops"] > 0
      True
    """

    _check_args(sizes, dtypes, frameworks, device, repeats, warmup)
    frameworks = list(dict.fromkeys(frameworks))
    not_run: list[dict[str, Any]] = []
    usable = []
    for framework in frameworks:
        reason = unsupported_reason(framework, "fp32", "matmul", device)
        if reason is None:
            usable.append(framework)
        else:
            not_run.append({"framework": framework, "reason": reason})
    if not usable:
        raise UnsupportedHere("; ".join(item["reason"] for item in not_run))
    if "torch" in usable:
        import torch

        torch.set_float32_matmul_precision("highest")
        if device == "gpu":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    results = []
    probes: dict[str, Any] = {}  # torch's measured CPU bf16/fp16 against fp32, by dtype
    started = time.time()
    for dtype in dtypes:
        for n in sizes:
            a, b = _operands(n, dtype, seed)
            cases = {}
            for framework in usable:
                skip = None
                if framework == "torch" and device == "cpu":
                    skip = _torch_cpu_skip(dtype, n, repeats + warmup + 1, probes)
                if skip is not None:
                    not_run.append({"framework": "torch", "dtype": dtype, "n": n, "reason": skip})
                    continue
                make = _torch_case if framework == "torch" else _jax_case
                cases[framework] = make(n, dtype, device, a, b)
            errors = {
                fw: _check_product(fw, result(), a, b, dtype) for fw, (_, result) in cases.items()
            }
            timed = {fw: step for fw, (step, _) in cases.items() if errors[fw] is None}
            before = _gpu_peaks_reset(device, timed)
            times = measure.time_interleaved(timed, repeats=repeats, warmup=warmup) if timed else {}
            peaks = _gpu_peaks(device, timed, before)
            for framework in cases:
                row = _row(framework, dtype, n, device, times.get(framework), errors[framework])
                row["allocator_peak_bytes"] = peaks.get(framework)
                results.append(row)
                if progress is not None:
                    progress(_line(row))

    return {
        "benchmark": "matmul",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "args": {
            "sizes": list(sizes),
            "dtypes": list(dtypes),
            "frameworks": frameworks,
            "repeats": repeats,
            "warmup": warmup,
            "seed": seed,
        },
        "timing": "frameworks interleaved product by product (rotating order), device synced, "
        "median of the timed products with a bootstrap 95% CI",
        "threads": thread_settings(),
        "hardware": hardware_info(),
        "versions": versions(),
        "wall_s": time.time() - started,
        "results": results,
        "not_run": not_run,
        "torch_cpu_probes": probes,
    }


def _gpu_peaks_reset(device: str, timed) -> dict[str, int]:
    if device != "gpu":
        return {}
    out = {}
    if "torch" in timed:
        import torch

        torch.cuda.reset_peak_memory_stats()
    if "jax" in timed:
        import jax

        stats = jax.devices("gpu")[0].memory_stats() or {}
        out["jax"] = stats.get("peak_bytes_in_use")
    return out


def _gpu_peaks(device: str, timed, before: dict[str, int]) -> dict[str, int | None]:
    if device != "gpu":
        return {}
    out: dict[str, int | None] = {}
    if "torch" in timed:
        out["torch"] = measure.torch_gpu_peak_memory()
    if "jax" in timed:
        import jax

        # process-wide and never reset: meaningful only when it grew during this case
        out["jax"] = measure.jax_gpu_peak_memory(jax.devices("gpu")[0])
    return out


def _row(framework, dtype, n, device, times, error) -> dict[str, Any]:
    itemsize = 4 if dtype == "fp32" else 2
    row: dict[str, Any] = {
        "framework": framework,
        "dtype": dtype,
        "n": n,
        "device_name": _device_name(framework, device),
        "operand_bytes": 3 * n * n * itemsize,  # A, B and C
        "correct": error is None,
        "error": error,
        "median_s": None,
        "ci_s": None,
        "tflops": None,
        "tflops_ci": None,
        "timed": 0,
    }
    peak, source = peak_tflops(row["device_name"] if device == "gpu" else "cpu", dtype)
    if device == "cpu":
        source = "CPU peak unknown: fraction of peak not given"
    row["peak_tflops"], row["peak_source"] = peak, source
    row["fraction_of_peak"] = None
    if times:
        median, low, high = speed.median_ci(times)
        flops = 2.0 * n**3
        row.update(
            median_s=median,
            ci_s=[low, high],
            tflops=flops / median / 1e12,
            tflops_ci=[flops / high / 1e12, flops / low / 1e12],
            timed=len(times),
        )
        if peak:
            row["fraction_of_peak"] = row["tflops"] / peak
    return row


def _line(row: dict[str, Any]) -> str:
    if not row["correct"]:
        return f"{row['framework']:5s} {row['dtype']} n={row['n']}: WRONG ({row['error']})"
    low, high = row["tflops_ci"]
    text = (
        f"{row['framework']:5s} {row['dtype']} n={row['n']}: {row['median_s'] * 1e3:.3f} ms, "
        f"{row['tflops']:.3g} TFLOP/s (95% CI {low:.3g}-{high:.3g})"
    )
    if row["fraction_of_peak"] is not None:
        text += f", {100 * row['fraction_of_peak']:.1f}% of peak"
    return text


def format_table(record: dict[str, Any]) -> str:
    """The markdown table of a benchmark record (also what the CLI prints).

    Example:
      >>> format_table({"device": "cpu", "results": [], "not_run": []}).splitlines()[0][:9]
      '| dtype |'
    """
    lines = [
        "| dtype | n | framework | median ms (95% CI) | TFLOP/s (95% CI) | of peak | operand MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in record["results"]:
        if not row["correct"]:
            lines.append(
                f"| {row['dtype']} | {row['n']} | {row['framework']} | WRONG: {row['error']} "
                "| — | — | — |"
            )
            continue
        low, high = row["ci_s"]
        t_low, t_high = row["tflops_ci"]
        fraction = row["fraction_of_peak"]
        lines.append(
            f"| {row['dtype']} | {row['n']} | {row['framework']} "
            f"| {row['median_s'] * 1e3:.3g} ({low * 1e3:.3g}-{high * 1e3:.3g}) "
            f"| {row['tflops']:.3g} ({t_low:.3g}-{t_high:.3g}) "
            f"| {'unknown' if fraction is None else f'{100 * fraction:.1f}%'} "
            f"| {row['operand_bytes'] / 2**20:.2f} |"
        )
    for item in record["not_run"]:
        where = f"{item.get('dtype', '')} n={item['n']} " if "n" in item else ""
        lines.append(f"\nNot run: {item['framework']} {where}— {item['reason']}.")
    if record["device"] == "cpu":
        lines.append("\nCPU peak FLOP/s unknown: no fraction of peak is given.")
    return "\n".join(lines)


def plot_matmul(record: dict[str, Any], path: str | Path) -> bool:
    """TFLOP/s against n, one line per (framework, dtype), CI whiskers; the peak where known.

    Returns True when at least one point was drawn.

    Example:
      >>> # plot_matmul(record, "runs/matmul/matmul.png")
    """
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["results"] if r["tflops"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    styles = {"torch": "-", "jax": "--"}
    colors = {"fp32": "#1f77b4", "bf16": "#2ca02c", "fp16": "#d62728"}
    for framework in ("torch", "jax"):
        for dtype in DTYPES:
            points = sorted(
                (r for r in rows if r["framework"] == framework and r["dtype"] == dtype),
                key=lambda r: r["n"],
            )
            if not points:
                continue
            xs = [r["n"] for r in points]
            ys = [r["tflops"] for r in points]
            errors = [
                [r["tflops"] - r["tflops_ci"][0] for r in points],
                [r["tflops_ci"][1] - r["tflops"] for r in points],
            ]
            ax.errorbar(
                xs,
                ys,
                yerr=errors,
                fmt="o" + styles[framework],
                color=colors[dtype],
                capsize=3,
                label=f"{framework} {dtype}",
            )
    peaks = {(r["dtype"], r["peak_tflops"]) for r in rows if r["peak_tflops"]}
    for dtype, peak in sorted(peaks):
        ax.axhline(peak, color=colors[dtype], lw=0.8, alpha=0.5)
        ax.text(ax.get_xlim()[0] if rows else 0, peak, f" {dtype} peak {peak:g}", fontsize=7)
    if rows:
        ax.set_xscale("log", base=2)  # sizes are positive by construction
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no timed products", ha="center", transform=ax.transAxes)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("n (n x n @ n x n)")
    ax.set_ylabel("TFLOP/s (median, 95% CI)")
    name = rows[0]["device_name"] if rows else record["device"]
    ax.set_title(f"Square matmul throughput on {name}", fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    write_bytes_atomic(path, buffer.getvalue())
    return bool(rows)


def main_matmul(args) -> int:
    """``python -m parity matmul``: run, print the table, write matmul.json and matmul.png."""

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        record = run_matmul_benchmark(
            args.sizes,
            args.dtypes,
            args.frameworks,
            device=args.device,
            repeats=args.repeats,
            warmup=args.warmup,
            progress=None if args.quiet else (lambda line: print(line, flush=True)),
        )
    except UnsupportedHere as e:
        print(f"error: --device {args.device}: {e.reason}", file=sys.stderr)
        return 2
    write_json_atomic(out / "matmul.json", record)
    plot_matmul(record, out / "matmul.png")
    print(format_table(record))
    print(f"results: {(out / 'matmul.json').resolve()} (plot: matmul.png)")
    wrong = [r for r in record["results"] if not r["correct"]]
    return 1 if wrong else 0


def add_matmul_parser(sub) -> None:
    """Adds the ``matmul`` subcommand to the CLI's subparsers."""
    parser = sub.add_parser(
        "matmul", help="square-matmul TFLOP/s, fp32/bf16/fp16, torch and JAX interleaved"
    )
    parser.add_argument("--sizes", nargs="+", type=int, default=[256, 512, 1024, 2048])
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument(
        "--frameworks", nargs="+", choices=("torch", "jax"), default=["torch", "jax"]
    )
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--repeats", type=int, default=10, help="timed products per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--out", default="runs/matmul", help="folder for matmul.json and .png")
    parser.add_argument("--quiet", action="store_true", help="no per-case lines")
