"""Test configuration: 8 host devices, strict dtype promotion, warnings as errors (pyproject)."""

import copy
import importlib.util
import math
import os
import pathlib
import sys
from typing import Any

# Must happen before jax is imported anywhere: multi-device tests run on 8 virtual CPU devices.
# XLA:CPU compiles at its default optimisation level, as users run it: at LLVM level 0 the
# float32 loss-scale trajectory parts from torch's by up to 3 ulps (growth 1.5, backoff 0.7),
# where at the default level it is torch's bit for bit.
# A count already in XLA_FLAGS wins: `XLA_FLAGS=--xla_force_host_platform_device_count=1` runs the
# suite as a one-device machine (a single GPU) would, with the multi-device tests skipped.
_flag = "--xla_force_host_platform_device_count=8"
if "--xla_force_host_platform_device_count=" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# As `python -m parity` does: torch's OpenMP threads sleep instead of spinning against XLA's pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

# Implicit promotions (e.g. f16 * f32 -> f32) hide precision bugs: make them errors in tests.
# jaxamp's own code must run under strict promotion. optax and flax internals do not (e.g.
# optax's bias correction computes float ** int32), so tests that run them carry the marker
# `standard_promotion`, which switches back to JAX's default for that test only.
jax.config.update("jax_numpy_dtype_promotion", "strict")

# One XLA compile per program per test process. JAX keeps an executable per jitted function object,
# and tests build fresh ones (a new model, a new closure, a new trainer) whose programs are the
# same as an earlier test's: most of the suite's CPU time is XLA compiling. JAX's compilation
# cache, keyed by the program itself (not by its source names), compiles each once. Each process
# (each pytest-xdist worker) has its own folder, made here and removed at its end: JAX writes an
# entry without a lock, so a process could read one another process is half-way through writing.
# Nothing carries over between sessions. A JAX_COMPILATION_CACHE_DIR already set wins (empty: no
# cache).
_OWN_COMPILE_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_COMPILE_CACHE = tempfile.mkdtemp(prefix="jaxamp-tests-xla-cache-")
    jax.config.update("jax_compilation_cache_dir", _OWN_COMPILE_CACHE)
    # programs that took over 0.1 s to compile (JAX's default, 1 s, leaves most out)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)

# The tests compare with torch's float32 (its CPU build; on CUDA torch's float32 matmuls are full
# float32 too: torch.backends.cuda.matmul.allow_tf32 is False by default). JAX's default matmul
# precision on a GPU multiplies float32 in TF32 (10-bit significands: 1e-3 apart after a few SGD
# steps): there the tests ask for float32 products, as XLA:CPU always computes them.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield


FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


@pytest.fixture
def replica_devices():
    """Every device of the platform (the 8 forced host devices on CPU, each GPU of a machine),
    for tests whose point is agreement across replicas; skips, saying so, where it has one."""
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip(
            f"replicas need 2 or more devices; this {devices[0].platform} platform has 1 "
            "(on CPU conftest forces 8 host devices)"
        )
    return devices


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def float_dtype(request):
    """Each low/full precision float dtype in turn."""
    return jnp.dtype(request.param)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Run a function as is, then under jax.jit."""
    return jax.jit if request.param else (lambda f, **kw: f)


_BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread while a test module runs (``pytest.mark.usefixtures``): on tiny
    layers extra threads only contend on a shared 2-core runner."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def benchmark_script():
    """Loads a script of `benchmarks/` as a module: ``benchmark_script("bench_loss_scaled")``,
    once per test module. Until the test module ends it is also ``sys.modules[name]``:
    dataclasses look their module up there, and a script's ``import <sibling>`` gets the one
    loaded here."""
    loaded = {}
    with pytest.MonkeyPatch.context() as patch:

        def load(name: str):
            if name not in loaded:
                spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
                module = importlib.util.module_from_spec(spec)
                patch.setitem(sys.modules, name, module)
                spec.loader.exec_module(module)
                loaded[name] = module
            return loaded[name]

        yield load


def pytest_unconfigure(config):
    if _OWN_COMPILE_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_COMPILE_CACHE, ignore_errors=True)


# --- CPU seconds per test (`--cpu-durations=N`) ----------------------------------------------------
# On a shared machine wall-clock durations measure the neighbours as much as the test; the CPU
# time this process (and the subprocesses it waited for) spent is what a test costs CI.


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="list the N tests (and every test file) with the most CPU seconds, setup included",
    )


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# With `-o enable_assertion_pass_hook=true` the summary also counts the test's passing `assert`
# statements: how many ran, and at how many distinct (test, line) places. A cheaper test must
# keep its checks: compare these counts before and after a change, beside the CPU seconds.
_ASSERTS: dict[str, Any] = {"ran": 0, "sites": set()}


def pytest_assertion_pass(item, lineno, orig, expl):
    _ASSERTS["ran"] += 1
    _ASSERTS["sites"].add((str(item.path), lineno))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _ASSERTS["ran"], _ASSERTS["sites"] = 0, set()
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_s", _cpu_seconds() - start))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_s", _cpu_seconds() - start))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_s", _cpu_seconds() - start))
    item.user_properties.append(("asserts", (_ASSERTS["ran"], len(_ASSERTS["sites"]))))


_CPU_BY_TEST: dict[str, float] = {}
_ASSERTS_BY_TEST: dict[str, tuple[int, int]] = {}


def pytest_runtest_logreport(report):
    # user_properties accumulate over the phases: the teardown report carries all three.
    if report.when == "teardown":
        _CPU_BY_TEST[report.nodeid] = sum(v for k, v in report.user_properties if k == "cpu_s")
        for key, value in report.user_properties:
            if key == "asserts":
                _ASSERTS_BY_TEST[report.nodeid] = tuple(value)


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if n is None or not _CPU_BY_TEST:
        return
    tr = terminalreporter
    total = sum(_CPU_BY_TEST.values())
    tr.write_sep("=", f"CPU seconds: {total:.0f} over {len(_CPU_BY_TEST)} tests")
    counted = config.getini("enable_assertion_pass_hook")
    if counted:
        ran = sum(r for r, _ in _ASSERTS_BY_TEST.values())
        sites = sum(s for _, s in _ASSERTS_BY_TEST.values())
        tr.write_line(f"passing asserts: {ran} ran, at {sites} distinct (test, line) places")
    by_file: dict[str, float] = {}
    asserts_by_file: dict[str, tuple[int, int]] = {}
    for nodeid, seconds in _CPU_BY_TEST.items():
        path = nodeid.split("::")[0]
        by_file[path] = by_file.get(path, 0.0) + seconds
        ran, sites = asserts_by_file.get(path, (0, 0))
        more = _ASSERTS_BY_TEST.get(nodeid, (0, 0))
        asserts_by_file[path] = (ran + more[0], sites + more[1])
    for path, seconds in sorted(by_file.items(), key=lambda kv: -kv[1]):
        ran, sites = asserts_by_file[path]
        tr.write_line(
            f"{seconds:8.1f}s  {path}" + (f"  ({ran} asserts, {sites} places)" if counted else "")
        )
    tr.write_sep("-", f"slowest {n} tests by CPU seconds")
    for nodeid, seconds in sorted(_CPU_BY_TEST.items(), key=lambda kv: -kv[1])[:n]:
        tr.write_line(f"{seconds:8.1f}s  {nodeid}")


# What a trainer measures beside the losses: versions, the machine, timing and memory.
_FAKE_HARDWARE = {
    "cpu": {
        "model": "cpu",
        "machine": "x86_64",
        "flags": ["avx2"],
        "flags_known": True,
        "available_cpus": 2,
        "load_average": [0.5, 0.5, 0.5],
    },
    "env": {"OMP_NUM_THREADS": None},
    "torch": {"version": "2", "cpu_capability": "AVX2", "intra_op_threads": 2},
    "jax": {"version": "0.0", "devices": ["cpu:0"], "cpu_intra_op_threads": 2},
    "torch_bf16_emulated": False,
}
_FAKE_MEASURED_SUMMARY = {
    "step_time_median_s": 0.01,
    "step_time_p10_s": 0.009,
    "step_time_p90_s": 0.011,
    "compile_time_s": 0.5,
    "peak_memory_bytes": 1000,
    "peak_memory_method": "xla_memory_analysis",
}


def fake_run(
    framework,
    losses,
    precision="fp32",
    *,
    variant="",
    data_seed=0,
    scales=None,
    skips=None,
    eval_metric=None,
    torch_mode="eager",
    steps_extra=None,
    model="m",
    config=None,
    measured=False,
    summary=None,
):
    """One run record for the verdict, report and CLI tests, valid under the record schema:
    `losses` per step (None or a non-finite value: a non-finite step), the loss scale and skip
    decision per step where given, `steps_extra` ({step: fields}) merged into its steps, the cell
    (`model`, `precision`, cpu), a calibration `variant`, a data seed and `config` fields
    (``init_scale``, ``growth_interval``...) merged into its ``config``; `measured`: with the
    versions, machine, step times and memory a trainer records; `summary` fields merged last."""
    from parity.core.config import RunConfig
    from parity.core.records import validate_run

    steps = []
    for i, loss in enumerate(losses):
        finite = loss is not None and math.isfinite(loss)
        step = {
            "step": i,
            "loss": float(loss) if finite else None,
            "loss_finite": finite,
            "loss_scale": None if scales is None else scales[i],
            "skipped": bool(skips[i]) if skips is not None else False,
            "time_s": 0.01,
        }
        step.update((steps_extra or {}).get(i, {}))
        steps.append(step)
    nonfinite = [s["step"] for s in steps if not s["loss_finite"]]
    run = {
        "framework": framework,
        "model": model,
        "precision": precision,
        "policy": str(RunConfig(precision=precision).policy),
        "device": "cpu",
        "status": "completed",
        "seed": 0,
        "variant": variant,
        "config": {"seed": 0, "data_seed": data_seed, **(config or {})},
        "steps": steps,
        "summary": {
            "final_loss": steps[-1]["loss"] if steps else None,
            "eval_metric": eval_metric,
            "eval_metric_name": "accuracy",
            "skipped_steps": sum(bool(s["skipped"]) for s in steps),
            "diverged": bool(nonfinite),
        },
    }
    if measured:
        run["versions"] = {"jax": "0.0", "python": "3"}
        run["hardware"] = copy.deepcopy(_FAKE_HARDWARE)
        run["summary"].update(
            _FAKE_MEASURED_SUMMARY,
            steps_completed=len(steps),
            first_nonfinite_step=nonfinite[0] if nonfinite else None,
        )
    run["summary"].update(summary or {})
    if framework == "torch":
        run["torch_mode"] = torch_mode
    validate_run(run)
    return run
