"""What this machine can run, and how fast it can run it: recorded with every parity run.

Two CPUs that both say "x86_64" behave very differently under mixed precision. On an AVX-512 CPU
with AVX512-BF16/AMX, torch's bfloat16 matmuls are ~4x faster than float32; on an AVX2-only CPU
they are emulated and 5-10x *slower*, and oneDNN has no bfloat16 LSTM at all (torch raises "could
not create a primitive descriptor for the LSTM forward propagation primitive"). XLA:CPU upcasts
bf16/fp16 dots to float32 on every CPU. A speed figure or a failure means nothing without the
hardware it came from, so:

- `hardware_info` describes the machine (CPU flags, torch's kernel level, oneDNN/XLA ISA limits,
  thread settings on both sides, devices, load) for every run record and report;
- `unsupported_reason` says why a framework cannot run a (precision, model, device) cell here, by
  *probing* the kernel rather than guessing from CPU flags, so it is right on any CPU and under
  ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` restrictions; the trainers raise
  `UnsupportedHere` with that reason and the harness records the cell as "unsupported here";
- `skip_if_unsupported` / `requires_torch_cpu` turn the same reason into a pytest skip.

Restricting a wider CPU to AVX2 (what ``.ci/run`` does for its second pass; both take effect,
checked in ``tests/parity/test_parity_hardware.py``), with torch.compile's kernels compiled in a
cache of their own (`inductor_cache_hazard`):

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \
        python -m pytest -m torch tests

This module never imports torch or JAX itself: it describes whichever is already imported (the JAX
trainer must run without torch).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
from typing import Any

__all__ = [
    "CPU_FLAGS_OF_INTEREST",
    "UnsupportedHere",
    "cpu_flags",
    "cpu_model_name",
    "hardware_info",
    "hardware_summary",
    "inductor_cache_hazard",
    "PROBE_MATMUL_N",
    "requires_torch_cpu",
    "skip_if_unsupported",
    "torch_matmul_probe",
    "torch_bf16_is_emulated",
    "unsupported_reason",
    "versions",
]

# The flags that decide low-precision speed and kernel availability on x86 CPUs.
CPU_FLAGS_OF_INTEREST = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)


class UnsupportedHere(RuntimeError):
    """A framework cannot run this cell on this hardware (not a failure of the run or the port).

    Attributes:
      reason: one line saying what is missing, e.g. "oneDNN has no bfloat16 LSTM on this CPU ...".

    Example:
      >>> try:
      ...     raise UnsupportedHere("torch sees no CUDA device")
      ... except UnsupportedHere as e:
      ...     print(e.reason)
      torch sees no CUDA device
    """

    def __init__(self, reason: str):
        super().__init__(f"unsupported here: {reason}")
        self.reason = reason


@functools.cache
def _proc_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the OS reports them (``/proc/cpuinfo``; empty where unknown).

    Returns:
      Lower-case flag names, e.g. ``{"avx2", "fma", ...}``. macOS and Windows: empty.

    Example:
      >>> "avx2" in cpu_flags() or platform.machine() != "x86_64" or not cpu_flags()
      True
    """
    match = re.search(r"^flags\s*:\s*(.*)$", _proc_cpuinfo(), re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else `platform.processor()`, else the machine.

    Example:
      >>> isinstance(cpu_model_name(), str)
      True
    """
    match = re.search(r"^model name\s*:\s*(.*)$", _proc_cpuinfo(), re.MULTILINE)
    if match:
        return match.group(1).strip()
    return platform.processor() or platform.machine()


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _xla_flag(name: str) -> str | None:
    match = re.search(rf"--{name}=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return match.group(1) if match else None


def _torch_info() -> dict[str, Any] | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    info: dict[str, Any] = {
        "version": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": torch.get_num_interop_threads(),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "cuda_available": bool(torch.cuda.is_available()),
        "cuda_devices": [],
    }
    if info["cuda_available"]:
        info["cuda_devices"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
        info["cuda_version"] = torch.version.cuda
    return info


def _jax_info() -> dict[str, Any] | None:
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    devices = jax.devices()
    multi_thread = _xla_flag("xla_cpu_multi_thread_eigen")
    return {
        "version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [f"{d.platform}:{d.device_kind}" for d in devices],
        "device_count": len(devices),
        # XLA:CPU compiles for the host CPU's features (LLVM), capped by --xla_cpu_max_isa.
        "cpu_max_isa": _xla_flag("xla_cpu_max_isa") or "host",
        # XLA:CPU's intra-op pool has one thread per schedulable core unless multi-threaded
        # Eigen is off (then one): what `parity.perf.measure.set_threads` controls.
        "cpu_intra_op_threads": 1 if multi_thread == "false" else _available_cpus(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def hardware_info() -> dict[str, Any]:
    """The machine as it affects speed and kernel availability, JSON-able, for every run record.

    torch and JAX sections are filled only when that framework is already imported (this function
    imports neither): ``None`` otherwise.

    Returns:
      ``{"cpu": {"model", "machine", "flags", "available_cpus", "load_average"}, "env":
      {ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, OMP_NUM_THREADS, OMP_WAIT_POLICY, ...}, "torch": {version,
      cpu_capability, intra_op_threads, inter_op_threads, mkldnn, cuda_available, cuda_devices},
      "jax": {version, backend, devices, cpu_max_isa, cpu_intra_op_threads, xla_flags},
      "torch_bf16_emulated": bool | None}``.

    Example:
      >>> info = hardware_info()
      >>> sorted(info)[:3]
      ['cpu', 'env', 'jax']
    """
    flags = cpu_flags()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    torch_info = _torch_info()
    return {
        "cpu": {
            "model": cpu_model_name(),
            "machine": platform.machine(),
            "flags": sorted(f for f in CPU_FLAGS_OF_INTEREST if f in flags),
            "flags_known": bool(flags),
            "available_cpus": _available_cpus(),
            "load_average": load,
        },
        "env": {
            name: os.environ.get(name)
            for name in (
                "ATEN_CPU_CAPABILITY",
                "ONEDNN_MAX_CPU_ISA",
                "OMP_NUM_THREADS",
                "OMP_WAIT_POLICY",
                "MKL_NUM_THREADS",
                "XLA_PYTHON_CLIENT_PREALLOCATE",
                "TORCHINDUCTOR_CACHE_DIR",
            )
        },
        "torch": torch_info,
        "jax": _jax_info(),
        "torch_bf16_emulated": torch_bf16_is_emulated(torch_info),
    }


def inductor_cache_hazard(environ: Any = None, default_dir: str | None = None) -> str | None:
    """Why torch.compile's CPU kernels may not be those ``ATEN_CPU_CAPABILITY`` asks for, or None.

    Inductor picks the vector width of the kernels it generates from ``ATEN_CPU_CAPABILITY``, but
    its on-disk cache does not key them on it: on a CPU wider than the setting, a kernel compiled
    without the setting (the same machine, the default cache) is reused under it. torchao's
    compiled AdamW8bit step then gave other 8-bit codes and block scales than its own eager step
    under ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 machine; in a fresh cache it gave the same.
    A cache of its own (``TORCHINDUCTOR_CACHE_DIR``) for the restricted runs removes the hazard.

    Args:
      environ: the environment to read (default: ``os.environ``).
      default_dir: inductor's default cache folder, which torch writes into
        ``TORCHINDUCTOR_CACHE_DIR`` once it has used it (the caller, which imports torch, reads
        it: this module imports neither framework); that value counts as unset.

    Example:
      >>> inductor_cache_hazard({}) is None
      True
      >>> "TORCHINDUCTOR_CACHE_DIR" in inductor_cache_hazard({"ATEN_CPU_CAPABILITY": "avx2"})
      True
      >>> inductor_cache_hazard({"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/own"})
    """
    env = os.environ if environ is None else environ
    capability = env.get("ATEN_CPU_CAPABILITY")
    cache = env.get("TORCHINDUCTOR_CACHE_DIR")
    own_cache = bool(cache) and (
        default_dir is None or os.path.abspath(cache) != os.path.abspath(default_dir)
    )
    if not capability or own_cache:
        return None
    return (
        f"ATEN_CPU_CAPABILITY={capability} with torch.compile and inductor's default kernel cache: "
        "inductor does not key its cached kernels on ATEN_CPU_CAPABILITY, so kernels compiled "
        "on this machine without the setting may be reused under it and compute other values. "
        "Give the restricted runs a cache of their own, e.g. "
        "TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)."
    )


def torch_bf16_is_emulated(torch_info: dict[str, Any] | None = None) -> bool | None:
    """Whether torch's bfloat16 CPU matmuls are emulated here (no AVX512-BF16 / AMX kernels).

    torch uses native bf16 kernels only at capability AVX512 with the avx512_bf16 or amx_bf16
    flag; below that (AVX2, DEFAULT, or restricted by ``ATEN_CPU_CAPABILITY``) bf16 is converted
    to float32 and back around every op: slower than float32 itself.

    Args:
      torch_info: ``hardware_info()["torch"]`` (default: from the imported torch).

    Returns:
      True/False, or None when torch is not imported or the CPU flags are unknown.

    Example:
      >>> torch_bf16_is_emulated({"cpu_capability": "AVX2"})
      True
    """
    info = torch_info if torch_info is not None else _torch_info()
    if info is None:
        return None
    if str(info.get("cpu_capability", "")).upper() not in ("AVX512", "AVX512_BF16", "AMX"):
        return True
    # oneDNN (torch's bf16 matmul/conv kernels) capped below AVX512_CORE_BF16 emulates bf16 too
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or "ALL").upper()
    if isa != "ALL" and not any(key in isa for key in ("BF16", "AMX", "FP16", "AVX10")):
        return True
    flags = cpu_flags()
    if not flags:
        return None
    return not ({"avx512_bf16", "amx_bf16"} & flags)


def hardware_summary(info: dict[str, Any] | None = None) -> str:
    """One line for logs and reports: CPU, its relevant flags, torch's kernel level, devices.

    Example:
      >>> "CPU" in hardware_summary()
      True
    """
    info = info or hardware_info()
    cpu = info["cpu"]
    flags = ", ".join(cpu["flags"]) if cpu.get("flags_known", True) else "flags unknown"
    parts = [f"CPU {cpu['model']} ({cpu['available_cpus']} cores; {flags})"]
    no512 = cpu.get("flags_known", True) and "avx512f" not in cpu["flags"]
    if no512:
        parts[0] += ", no AVX-512"
    torch_info = info.get("torch")
    if torch_info:
        parts.append(
            f"torch {torch_info['version']} kernels {torch_info['cpu_capability']}, "
            f"{torch_info['intra_op_threads']} threads"
        )
        if torch_info.get("cuda_devices"):
            parts.append("CUDA " + ", ".join(torch_info["cuda_devices"]))
    jax_info = info.get("jax")
    if jax_info:
        parts.append(
            f"JAX {jax_info['version']} on {', '.join(sorted(set(jax_info['devices'])))}, "
            f"XLA:CPU {jax_info['cpu_intra_op_threads']} threads"
        )
    if info.get("torch_bf16_emulated"):
        parts.append("torch bf16 emulated")
    return "; ".join(parts)


# --- what cannot run here ----------------------------------------------------------------------


def _policy_dtypes(precision: Any) -> tuple[str, str] | None:
    """(param dtype name, compute dtype name) of a precision name, policy string or Policy."""
    import numpy as np

    import jaxamp

    try:
        policy = jaxamp.get_policy(precision)
    except (ValueError, TypeError):
        return None  # a precision jaxamp's grammar does not cover (e.g. fp8 recipes)
    return np.dtype(policy.param_dtype).name, np.dtype(policy.compute_dtype).name


@functools.cache
def _torch_cpu_rnn_failure(rnn_class: str, dtype_name: str, autocast: bool) -> str | None:
    """Runs a 1x2x4 `rnn_class` on the CPU in `dtype_name`; returns torch's error or None."""
    import torch

    dtype = getattr(torch, dtype_name)
    module = getattr(torch.nn, rnn_class)(4, 4, batch_first=True)
    x = torch.zeros(1, 2, 4)
    try:
        if autocast:
            with torch.autocast("cpu", dtype=dtype):
                module(x)
        else:
            module.to(dtype)(x.to(dtype))
    except RuntimeError as e:
        return str(e).split(". ")[0]
    return None


def _rnn_classes(model: Any) -> set[str]:
    """The torch RNN layer classes a model uses (by built-in name or by walking a torch module)."""
    if isinstance(model, str):
        return {"LSTM"} if model == "lstm" else set()
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(model, torch.nn.Module):
        return set()
    return {
        type(m).__name__
        for m in model.modules()
        if isinstance(m, torch.nn.RNNBase) and type(m).__name__ in ("LSTM", "GRU", "RNN")
    }


def _handles_cpu_float16_rnn(model: Any) -> bool:
    """The built-in lstm pair runs its LSTM in float16 itself under CPU fp16 autocast."""
    if model == "lstm":
        return True
    from_module = sys.modules.get("parity.models.lstm")
    return from_module is not None and isinstance(model, from_module.TorchLSTMClassifier)


def unsupported_reason(framework: str, precision: Any, model: Any, device: str) -> str | None:
    """Why `framework` cannot run this cell on this machine, or None if it can.

    Kernel availability is probed (a tiny forward pass, cached), so the answer holds on any CPU
    and under ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` restrictions.

    Args:
      framework: ``"torch"`` or ``"jax"``.
      precision: a precision name (``"bf16-mixed"``), a jaxamp policy string or a `jaxamp.Policy`.
      model: a built-in model name (``"lstm"``) or a torch module (its RNN layers are probed).
      device: ``"cpu"`` or ``"gpu"``.

    Returns:
      One line ("oneDNN has no bfloat16 LSTM ...") or None.

    Raises:
      ValueError: an unknown framework or device.

    Example:
      >>> unsupported_reason("jax", "bf16-mixed", "lstm", "cpu") is None
      True
    """
    if framework not in ("torch", "jax"):
        raise ValueError(
            f"unsupported_reason: framework must be 'torch' or 'jax'; got {framework!r}."
        )
    if device not in ("cpu", "gpu"):
        raise ValueError(f"unsupported_reason: device must be 'cpu' or 'gpu'; got {device!r}.")
    if device == "gpu":
        return _gpu_missing(framework)
    if framework == "jax":
        return None  # XLA:CPU runs every dtype (upcasting bf16/fp16 dots to float32)
    dtypes = _policy_dtypes(precision)
    if dtypes is None:
        return None
    param_dtype, compute_dtype = dtypes
    autocast = param_dtype != compute_dtype
    if compute_dtype not in ("bfloat16", "float16"):
        return None
    for rnn in sorted(_rnn_classes(model)):
        if compute_dtype == "float16" and autocast and _handles_cpu_float16_rnn(model):
            continue
        error = _torch_cpu_rnn_failure(rnn, compute_dtype, autocast)
        if error is not None:
            import torch

            return (
                f"torch {'autocast ' if autocast else ''}{compute_dtype} {rnn} on CPU: oneDNN has "
                f"no kernel on this CPU (torch kernels {torch.backends.cpu.get_cpu_capability()}, "
                f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA') or 'unset'}; needs "
                f"AVX-512): {error}"
            )
    return None


def _gpu_missing(framework: str) -> str | None:
    if framework == "torch":
        import torch

        if not torch.cuda.is_available():
            return f"torch {torch.__version__} sees no CUDA device (CPU-only build or no GPU)"
        return None
    import jax

    try:
        jax.devices("gpu")
    except RuntimeError:
        return f"JAX {jax.__version__} has no GPU backend (install jax[cuda13]; no GPU visible)"
    return None


# --- pytest helpers ----------------------------------------------------------------------------


def skip_if_unsupported(framework: str, precision: Any, model: Any, device: str = "cpu") -> None:
    """Inside a test: `pytest.skip` with the reason when this hardware cannot run the cell.

    Example:
      >>> skip_if_unsupported("jax", "fp32", "mlp")  # runs everywhere: no skip
    """
    reason = unsupported_reason(framework, precision, model, device)
    if reason is not None:
        import pytest

        pytest.skip(f"unsupported here: {reason}")


def requires_torch_cpu(precision: Any, model: Any):
    """A pytest mark skipping a test where torch cannot run `model` at `precision` on this CPU.

    Evaluated at collection (imports torch): use it on modules that import torch anyway; inside
    a test prefer `skip_if_unsupported`.

    Example:
      >>> mark = requires_torch_cpu("fp32", "mlp")
      >>> mark.name
      'skipif'
    """
    import pytest

    reason = unsupported_reason("torch", precision, model, "cpu")
    return pytest.mark.skipif(reason is not None, reason=f"unsupported here: {reason}")


# --- measured, not assumed ---------------------------------------------------------------------

# The probe's size: big enough that a kernel's per-element cost shows (not its call overhead),
# small enough that an emulated float16 product (~200x float32 on some CPUs) stays near 0.1 s.
PROBE_MATMUL_N = 256


def _fastest_interleaved(runs: dict, repeats: int) -> dict[str, float]:
    """The fastest timed call of each function over `repeats` rounds, the functions taking turns
    (after one untimed call each). In a round a cheaper function is called as many times as fit
    in one call of the dearest (at most 100), so each gets the same wall time to find a moment the
    machine left it alone: load only adds time, and the minimum escapes a burst."""
    import time

    def timed(run):
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    first = {name: timed(run) for name, run in runs.items()}  # kernel selection, allocations
    dearest = max(first.values())
    calls = {name: min(max(round(dearest / max(t, 1e-9)), 1), 100) for name, t in first.items()}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            for _ in range(calls[name]):
                best[name] = min(best[name], timed(run))
    return best


@functools.cache
def torch_matmul_probe(dtype: str, n: int = PROBE_MATMUL_N, repeats: int = 5) -> dict | None:
    """How long torch's CPU matmul takes in `dtype` against float32 on this machine, measured.

    The figure behind "torch's fp16 is slow on CPU": 6.6-7.4x on one AVX-512 CPU, ~200x on
    another, par on a CPU with AVX512-FP16/AMX. The fastest n x n product of each dtype over
    `repeats` rounds, the two taking turns with equal wall time (`_fastest_interleaved`), resists
    a loaded machine: load only adds time, and a burst hits both dtypes alike. Cached per
    process.

    Args:
      dtype: ``"float16"`` or ``"bfloat16"``.
      n: the operands' size.
      repeats: timed products per dtype.

    Returns:
      ``{"dtype", "n", "float32_s", "dtype_s", "ratio_to_fp32", "method", "load_average"}``;
      None when torch is not imported (this module never imports it).

    Example:
      >>> probe = torch_matmul_probe("float16", n=32, repeats=1)
      >>> probe is None or probe["ratio_to_fp32"] > 0
      True
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(
            f"torch_matmul_probe: `dtype` must be 'float16' or 'bfloat16'; got {dtype!r}."
        )
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator)
    b = torch.randn(n, n, generator=generator)
    half_a, half_b = a.to(getattr(torch, dtype)), b.to(getattr(torch, dtype))
    best = _fastest_interleaved({"float32": lambda: a @ b, dtype: lambda: half_a @ half_b}, repeats)
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    return {
        "dtype": dtype,
        "n": n,
        "float32_s": best["float32"],
        "dtype_s": best[dtype],
        "ratio_to_fp32": best[dtype] / best["float32"] if best["float32"] > 0 else None,
        "method": f"fastest n x n CPU product per dtype over {repeats} rounds, the dtypes taking "
        "turns with equal wall time, after one untimed each",
        "load_average": load,
    }


def versions() -> dict[str, str]:
    """Versions of everything that affects the figures, and the machine."""
    import platform

    import flax
    import jax
    import jaxlib
    import numpy
    import optax

    import jaxamp

    out = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "numpy": numpy.__version__,
        "jaxamp": jaxamp.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
    }
    torch = sys.modules.get("torch")  # never imported here: the JAX trainer runs without torch
    if torch is not None:
        out["torch"] = torch.__version__
        out["torch_threads"] = str(torch.get_num_threads())
    out["cpu_count"] = str(os.cpu_count())
    return out
