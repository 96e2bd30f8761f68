"""Golden trajectories (parity.golden.check): the torch side recorded, the JAX side checked without torch.

The committed goldens (examples/parity_ci/port.golden.npz, the example's own port at bf16-mixed,
12 steps; tests/data/mlp.golden.npz, the built-in ``mlp`` at fp32, `MLP_EXPORT`) are checked in
one subprocess as a machine without torch runs them (tests/data/no_torch hides torch, torchao and
torchvision from every finder: ``find_spec`` answers None, as where they are not installed):
through the example project's own pytest tests, through ``python -m parity check`` with torch's
kernels restricted to AVX2 as on a narrower CPU, and for the built-in model with no
``--flax-model`` (its twin comes from `parity.twins`). CI runs this file again in an environment
built without torch (``.ci/run``), where the tests that export skip. In process: the schema
refuses broken files naming the field, a fresh export of a built-in pair checks PASS and a
recorded machine with native bf16 kernels widens the bf16 step-0 bands only, by one rounding per
layer, and says so.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from parity import bisect
from parity.golden import check as golden_check
from parity.golden.check import check_golden, hardware_allowance
from parity.golden.format import HEADER_KEY, GoldenFileError, load_golden
from parity.verdicts.tolerance import SAFETY, gradient_tolerance, tolerance, unit_roundoff

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "examples" / "parity_ci" / "port.golden.npz"
NO_TORCH = ROOT / "tests" / "data" / "no_torch"
FLAX_NET = "examples.parity_ci.flax_model:FlaxNet"
MLP_GOLDEN = ROOT / "tests" / "data" / "mlp.golden.npz"
# what wrote MLP_GOLDEN (run it again when the golden format changes)
MLP_EXPORT = (
    "export --model mlp --precision fp32 --steps 5 --batch-size 4 --no-eval --lr-warmup-steps 2 "
    "--model-override image_shape=[4,4,1] --model-override hidden=8 --no-progress --out"
).split()


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(NO_TORCH), str(ROOT)])
    # This process's JAX compilation cache (tests/conftest.py's): the subprocess runs while this
    # process waits, and compiles what the in-process tests compile for the same goldens (each
    # writer alone, one at a time: no half-written entry is read).
    if jax.config.jax_compilation_cache_dir and "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(
            jax.config.jax_persistent_cache_min_compile_time_secs
        )
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


# One torch-free process (tests/data/no_torch) runs, as a machine without torch would, one after
# the other: the example project's own tests (`pytest examples/parity_ci`), `python -m parity
# check` of the built-in model's golden, `python -m parity check` of the example's golden with
# torch's kernels restricted to AVX2 as on a narrower CPU, and a check whose --flax-model imports
# torch (exit 2); then `import torch` fails. One interpreter start for all four; the two example
# checks share compiled programs.
_TORCH_FREE = """
import importlib.metadata, importlib.util, os, runpy, sys
assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("torchao") is None
try:
    importlib.metadata.version("torch")
    raise SystemExit("torch's metadata is visible")
except importlib.metadata.PackageNotFoundError:
    pass
import scipy.stats  # probes array libraries
from transformers import FlaxGPT2LMHeadModel  # probes torch/torchao with find_spec
import parity.golden.check, parity.twins.resnet, parity.twins.transformer
import pytest

mlp_golden, mlp_json, golden, golden_json = sys.argv[1:]


def section(name):
    for stream in (sys.stdout, sys.stderr):
        print(f"\\n=== {name}", file=stream, flush=True)


def parity(*args):
    # `python -m parity ARGS`, in this process
    sys.argv = ["parity", *args]
    try:
        runpy.run_module("parity", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        print("python -m parity exit code:", done.code, flush=True)


section("example tests")
print("pytest exit code:", int(pytest.main(["-p", "no:cacheprovider", "-q", "examples/parity_ci"])))
section("built-in check")
parity("check", "--golden", mlp_golden, "--no-progress", "--json", mlp_json)
section("narrower cpu check")
os.environ.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
parity("check", "--golden", golden, "--no-progress", "--json", golden_json)
section("a flax model that imports torch")
parity("check", "--golden", golden, "--no-progress", "--flax-model",
       "examples.parity_ci.torch_model:reference")
section("import torch")
import torch
"""


def _sections(text: str) -> dict[str, str]:
    """`_TORCH_FREE`'s output by section."""
    parts = text.split("\n=== ")
    return {p.partition("\n")[0]: p.partition("\n")[2] for p in parts[1:]}


@pytest.mark.integration
def test_goldens_check_without_torch_as_a_machine_without_it_and_on_a_narrower_cpu(tmp_path):
    """One process as a machine without torch (`_TORCH_FREE`): what libraries probe answers as
    without torch, transformers' Flax models and the golden check's modules import, and ``import
    torch`` fails as it does where it is not installed. In it: the example project's passing
    case and planted bug through parity.testing; a built-in model's golden checks PASS with no
    --flax-model (its twin is built from the recorded configuration, torch-free);
    ``python -m parity check`` of the example's golden, torch's kernels restricted to AVX2,
    PASSes (it checks the golden the example's tests checked, with the same Flax port); and a
    --flax-model whose module imports torch exits 2 naming the module and the missing import."""
    mlp_json, example_json = tmp_path / "mlp.json", tmp_path / "example.json"
    args = [str(MLP_GOLDEN), str(mlp_json), str(GOLDEN), str(example_json)]
    done = _run(["-c", _TORCH_FREE, *args], _env())
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    out = _sections(done.stdout)
    assert done.returncode == 1, tail
    assert done.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'torch'"

    # the example project's own tests
    assert "pytest exit code: 0" in out["example tests"], tail
    assert "2 passed, 1 skipped" in out["example tests"], tail

    # the built-in model's golden, no --flax-model
    assert "python -m parity exit code: 0" in out["built-in check"], tail
    result = json.loads(mlp_json.read_text())
    assert result["status"] == "PASS"
    assert any(v["check"] == "per-step loss, steps 0-4" and v["passed"] for v in result["verdicts"])

    # the example's golden on a narrower CPU
    check = out["narrower cpu check"]
    assert "python -m parity exit code: 0" in check, tail
    result = json.loads(example_json.read_text())
    assert result["status"] == "PASS"
    checks = {v["check"]: v["passed"] for v in result["verdicts"]}
    assert checks["step 0 fp32: gradients"] and checks["final loss (mean of last 5)"]
    # the bf16 gradient band, widened for the recorded kernels, is judged once widened: within
    # it, and above the power bound it is no pass (inconclusive), never a FAIL
    (widened,) = [v for v in result["verdicts"] if v["check"] == "step 0 bf16-mixed: gradients"]
    assert "for the recorded bfloat16 kernels" in widened["detail"]
    assert widened["value"] <= widened["tolerance"]
    assert widened["passed"] is (True if widened["tolerance"] <= 1.0 else None)
    # the golden holds torch's per-step gradient norms, and check judges them (at bf16-mixed a
    # 50% band: judged, never a PASS on its own)
    norms = [v for v in result["verdicts"] if v["check"].startswith("per-step gradient norm")]
    assert norms and all(v["passed"] is not False and v["value"] < v["tolerance"] for v in norms)
    # the restriction is reported (it restricts torch only; the JAX side is unaffected)
    assert "ATEN_CPU_CAPABILITY=None when recorded, avx2 here" in check

    # a --flax-model module that imports torch is bad input there (exit 2), named with the cause
    assert "python -m parity exit code: 2" in out["a flax model that imports torch"], tail
    assert (
        "module 'examples.parity_ci.torch_model' does not import (No module named 'torch')"
        in _sections(done.stderr)["a flax model that imports torch"]
    ), tail


def _rewrite(tmp_path, change_header=None, drop: str | None = None) -> Path:
    with np.load(GOLDEN, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    header = json.loads(arrays[HEADER_KEY].tobytes())
    if change_header:
        change_header(header)
    arrays[HEADER_KEY] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    if drop:
        del arrays[drop]
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    path = tmp_path / "changed.npz"
    path.write_bytes(buffer.getvalue())
    return path


def test_schema_refuses_broken_files_naming_the_field(tmp_path):
    golden = load_golden(GOLDEN)
    assert golden.config.precision == "bf16-mixed" and golden.config.steps == 12
    assert golden.header["model"]["flax_model"] == "examples.parity_ci.flax_model:FlaxNet"
    assert [s["stage"] for s in golden.stages] == ["fp32", "bf16-mixed"]
    assert len(golden.torch_run["steps"]) == 12 and GOLDEN.stat().st_size < 150_000

    def version(h):
        h["schema_version"] = 99

    def steps(h):
        h["config"]["steps"] = 13

    def loss(h):
        h["torch_run"]["steps"][3]["loss"] = "2.3"

    def low_bit(h):  # a low-bit AdamW cell without torchao's recorded optimizer step
        h["config"].update(precision="adamw-8bit", policy="p=f32,c=f32,o=f32")

    for change, drop, field in (
        (version, None, "schema_version"),
        (steps, None, "data"),
        (loss, None, "torch_run.steps[3].loss"),
        (low_bit, None, "step0.optimizer"),
        (None, "batch/7/targets", "batch/7/targets"),
        (None, "step0/bf16-mixed/grads/fc1/kernel", "step0/bf16-mixed/grads/fc1/kernel"),
    ):
        with pytest.raises(GoldenFileError) as error:
            load_golden(_rewrite(tmp_path, change, drop))
        if field is not None:
            assert error.value.field == field, error.value
    (tmp_path / "plain.npz").write_bytes(b"not an archive")
    with pytest.raises(GoldenFileError, match="not a golden .npz archive"):
        load_golden(tmp_path / "plain.npz")


def test_a_version_2_golden_reads_with_the_kinds_of_its_torch_rows(tmp_path):
    """Version 2 wrote its torch-only rows without kinds: read, each has its kind (the
    diagnosis finds a cause by kind); a label version 2 never wrote, or a version-3 row
    without a kind, is refused naming the row."""
    from parity.verdicts.checks import CHECKS

    for path in (GOLDEN, MLP_GOLDEN):
        with np.load(path, allow_pickle=False) as archive:
            stored = json.loads(archive[HEADER_KEY].tobytes())
        assert stored["schema_version"] == 2
        assert not any(row.get("kind") for row in stored["step0"]["torch_rows"])
        rows = load_golden(path).torch_rows()
        assert [v.kind for v in rows] == ["stochastic"] and rows[0].kind in CHECKS

    def unknown(h):
        h["step0"]["torch_rows"][0]["check"] = "step 0: something new"

    def version_3(h):
        h["schema_version"] = 3

    for change, field in ((unknown, "check"), (version_3, "kind")):
        with pytest.raises(GoldenFileError) as error:
            load_golden(_rewrite(tmp_path, change))
        assert error.value.field == f"step0.torch_rows[0].{field}", error.value


_AVX2 = {"cpu": {"flags": ["avx", "avx2", "fma"]}, "env": {}}
_AVX512_BF16 = {"cpu": {"flags": ["avx", "avx2", "avx512f", "avx512_bf16"]}, "env": {}}


def test_hardware_allowance_only_for_a_different_low_precision_kernel_class():
    recorded = {
        "hardware": {
            "cpu": {"flags": ["avx", "avx2"]},
            "env": {},
            "torch": {"cpu_capability": "AVX2"},
            "torch_bf16_emulated": True,
        },
        "versions": {"jax": "0.0.1"},
    }
    extra, notes = hardware_allowance(recorded, _AVX512_BF16)
    assert extra == {"bfloat16": 1.0}
    assert any("recorded bfloat16 emulated in float32, here native bfloat16" in n for n in notes)
    assert any("float32 kernels differ in accumulation order only" in n for n in notes)
    assert any("jax 0.0.1 when recorded" in n and "no allowance" in n for n in notes)
    extra, notes = hardware_allowance(recorded, _AVX2)
    assert extra == {} and not any("kernels" in n for n in notes)
    # the reverse: recorded on an AVX512-BF16 CPU, checked on an AVX2-only one
    native = dict(recorded, hardware=dict(recorded["hardware"], torch_bf16_emulated=False))
    native["hardware"]["torch"] = {"cpu_capability": "AVX512"}
    assert hardware_allowance(native, _AVX2)[0] == {"bfloat16": 1.0}


@pytest.mark.integration
def test_recorded_on_native_bf16_passes_here_with_the_bf16_bands_widened():
    """The committed golden as if recorded on a CPU with native bf16 kernels, checked on an
    AVX2-only one: only the bf16 step-0 rows grow, by 8 x depth x u(bf16) (x4 for gradients),
    and the report says why."""
    golden = load_golden(GOLDEN)
    header = json.loads(json.dumps(golden.header))
    header["hardware"]["torch_bf16_emulated"] = False
    header["hardware"]["torch"]["cpu_capability"] = "AVX512"
    result = check_golden(dataclasses.replace(golden, header=header), current_hardware=_AVX2)
    assert result.status == "PASS", result.report()
    rows = {  # the output and gradient rows (the probe's and torch-only rows are not widened)
        v.check: v
        for v in result.verdicts
        if v.check.startswith("step 0 ") and v.check.endswith(("output", "gradients"))
    }
    assert len(rows) == 6, sorted(rows)
    fan_in = 64  # fc1's contraction; the gradients' longest is the same here
    for check, row in rows.items():
        low = check.startswith("step 0 bf16-mixed")
        dtype = "bfloat16" if low else "float32"
        gradients = check.endswith("gradients")
        depth = 4 if gradients else 2
        band = (gradient_tolerance if gradients else tolerance)(dtype, fan_in, depth)
        extra = (4.0 if gradients else 1.0) * SAFETY * depth * unit_roundoff("bfloat16")
        assert row.tolerance == pytest.approx(band + extra if low else band), check
        assert ("recorded bfloat16 kernels" in row.detail) == low
    assert "bands grow" in result.report()


@pytest.mark.integration
def test_export_of_a_builtin_pair_checks_pass(tmp_path, capsys):
    """``python -m parity export`` of a built-in pair, then the check (its Flax twin found by
    name): the trajectory is judged by the fp32 per-step bands. The committed built-in golden
    is what this command writes."""
    pytest.importorskip("torch")
    from parity.cli.commands import main

    path = tmp_path / "mlp.npz"
    assert main([*MLP_EXPORT, str(path)]) == 0
    written, committed = load_golden(path), load_golden(MLP_GOLDEN)
    assert written.header["config"] == committed.header["config"]
    assert written.header["model"] == committed.header["model"]
    assert sorted(written.arrays) == sorted(committed.arrays)
    result = check_golden(path)
    assert result.status == "PASS", result.report()
    assert any(v.check == "per-step loss, steps 0-4" and v.passed for v in result.verdicts)
    assert len(result.runs[1]["steps"]) == 5
    # the per-step gradient norms are recorded and judged by the fp32 bands
    assert all(isinstance(s["grad_norm"], float) for s in result.runs[0]["steps"])
    norms = [v for v in result.verdicts if v.check.startswith("per-step gradient norm")]
    assert norms and all(v.passed for v in norms), result.report()
    # a float32 golden has nothing to bisect, and another model's port does not fit it: both
    # bad input (exit 2, one line naming the file)
    for command, argv, what in (
        (bisect.main, ["--golden", str(path)], "computes in float32"),
        (
            golden_check.main,
            ["--golden", str(path), "--flax-model", FLAX_NET],
            "do not fit this Flax",
        ),
    ):
        code = command(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and str(path) in err and what in err, err


@pytest.mark.integration
@pytest.mark.torch
def test_export_models_takes_a_batch_stream(tmp_path):
    """`export_models` given a `BatchStream` (as `compare_models` takes one): the golden holds
    the stream's batches of the steps run and its held-out batches, and checks PASS; a dropout
    rate only torch has is recorded and named in an informational row."""
    pytest.importorskip("torch")
    from examples.parity_ci.data import CLASSES, FEATURES, make_batches
    from examples.parity_ci.torch_model import reference
    from parity.data import BatchStream
    from parity.golden.export import export_models
    from parity.verdicts.step0_checks import DROPOUT_CHECK

    def sample(rng, batch_size):
        inputs, labels = make_batches(1, batch_size, seed=int(rng.integers(1 << 30)))[0]
        return inputs, labels

    stream = BatchStream(
        sample,
        seed=3,
        batch_size=4,
        task="classification",
        num_classes=CLASSES,
        input_shape=(FEATURES,),
        num_eval_batches=2,
    )
    torch_model = reference()
    torch_model.dropout = 0.1  # a rate the port does not have (its forward reads none)
    path = export_models(tmp_path / "s.npz", torch_model, FLAX_NET, stream, steps=3)
    golden = load_golden(path)
    assert golden.config.steps == 3 and golden.config.eval
    for step in range(3):
        np.testing.assert_array_equal(golden.batch(step)[0], stream.batch(step)[0])
    assert len(golden.eval_batches()) == 2
    result = check_golden(golden)
    assert result.status == "PASS", result.report()
    # the rates differ, both turned off: recorded with torch, named by the check, not a failure
    dropout = [v for v in result.verdicts if v.check == DROPOUT_CHECK]
    assert [v.mode for v in dropout] == ["informational"], result.report()
    assert dropout[0].detail.startswith("dropout rates: torch 0.1 (dropout); Flax no dropout")
