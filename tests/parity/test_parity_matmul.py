"""parity matmul, quiet progress and clean failures: the micro-benchmark measures real products
(checked against float64), progress suits the stream, `--device gpu` without a GPU fails in one
line with a report, a cell the CPU cannot run is recorded as unsupported, the profiler is quiet."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity.cli.commands import main  # noqa: E402
from parity.core.hardware import unsupported_reason  # noqa: E402
from parity.core.progress import progress  # noqa: E402
from parity.perf import matmul, measure  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.standard_promotion]

NO_GPU = unsupported_reason("torch", "fp32", "mlp", "gpu") is not None or (
    unsupported_reason("jax", "fp32", "mlp", "gpu") is not None
)


@pytest.mark.slow
def test_matmul_benchmark_times_checked_products(monkeypatch):
    # A measured probe decides (here a slow float16 and a fast bfloat16, fixed): fp16 n=32's
    # five products are predicted at 9.8 ms, n=16's at 1.2 ms, against a 5 ms budget.
    probes = {"float16": (1.0, 100.0), "bfloat16": (1e-6, 1.0)}
    monkeypatch.setattr(
        matmul,
        "torch_matmul_probe",
        lambda dtype: {"n": 256, "dtype_s": probes[dtype][0], "ratio_to_fp32": probes[dtype][1]},
    )
    monkeypatch.setattr(matmul, "CPU_CASE_BUDGET_S", 0.005)
    record = matmul.run_matmul_benchmark([16, 32], repeats=3, warmup=1)
    json.dumps(record)
    rows = {(r["framework"], r["dtype"], r["n"]): r for r in record["results"]}
    assert ("torch", "fp16", 32) not in rows  # torch fp16 on CPU: tiny sizes only...
    assert any(
        item.get("n") == 32 and "fp16 matmul measured here at 100x" in item["reason"]
        for item in record["not_run"]
    )  # ...and the rest is recorded as not run, with the measured reason
    assert sorted(record["torch_cpu_probes"]) == ["bfloat16", "float16"]
    assert len(rows) == 2 * 3 * 2 - 1
    for row in rows.values():
        assert row["correct"] and row["timed"] == 3
        assert row["tflops"] == pytest.approx(2 * row["n"] ** 3 / row["median_s"] / 1e12)
        low, high = row["tflops_ci"]
        assert low <= row["tflops"] <= high
        assert row["fraction_of_peak"] is None and "unknown" in row["peak_source"]
    assert record["threads"]["torch_intra_op_threads"] == torch.get_num_threads()
    table = matmul.format_table(record)
    assert "CPU peak FLOP/s unknown" in table and "Not run: torch fp16 n=32" in table


def test_a_wrong_product_is_caught():
    a, b = matmul._operands(24, "bf16", seed=1)
    exact = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    assert matmul._check_product("x", exact, a, b, "bf16") is None
    wrong = exact.copy()
    wrong[0, 0] += 1.0 + abs(wrong[0, 0])
    assert "beyond the rounding bound" in matmul._check_product("x", wrong, a, b, "bf16")
    transposed = (a.astype(np.float64) @ b.astype(np.float64).T).astype(np.float32)
    assert matmul._check_product("x", transposed, a, b, "bf16") is not None


def test_peaks_and_bad_arguments():
    assert matmul.peak_tflops("NVIDIA H100 80GB HBM3", "fp16")[0] == 989.0
    assert matmul.peak_tflops("NVIDIA H200", "fp32")[0] == 67.0
    assert matmul.peak_tflops("NVIDIA H100 PCIe", "bf16")[0] is None
    with pytest.raises(ValueError, match="Did you mean 'fp32'"):
        matmul.run_matmul_benchmark([8], ["fp31"])
    with pytest.raises(ValueError, match="`sizes` must be positive"):
        matmul.run_matmul_benchmark([0])
    with pytest.raises(ValueError, match="`repeats` must be an integer >= 3"):
        matmul.run_matmul_benchmark([8], repeats=1)


def test_matmul_cli_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "mm"
    code = main(
        ["matmul", "--sizes", "16", "--dtypes", "fp32", "--repeats", "3", "--out", str(out)]
    )
    assert code == 0
    record = json.loads((out / "matmul.json").read_text())
    assert {r["framework"] for r in record["results"]} == {"torch", "jax"}
    assert (out / "matmul.png").read_bytes()[:4] == b"\x89PNG"
    assert "TFLOP/s" in capsys.readouterr().out


@pytest.mark.skipif(NO_GPU, reason="no GPU here for both frameworks")
def test_matmul_on_the_gpu(tmp_path):
    record = matmul.run_matmul_benchmark([256], device="gpu", repeats=3)
    assert all(r["correct"] and r["allocator_peak_bytes"] for r in record["results"])


@pytest.mark.skipif(not NO_GPU, reason="a GPU is present: the failure path cannot be seen")
def test_device_gpu_without_a_gpu_fails_in_one_line_with_a_report(tmp_path, capsys):
    out = tmp_path / "gpu"
    args = ["run", "--model", "mlp", "--steps", "2", "--batch-size", "2", "--device", "gpu"]
    code = main([*args, "--no-eval", "--out", str(out)])
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    # one error line; the phase-timing line every run prints at its end comes beside it
    err = [line for line in lines if not line.startswith("time (wall s / CPU s):")]
    assert len(err) == 1 and err[0].startswith("error: --device gpu: ")
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert {r["status"] for r in runs} == {"unsupported"}
    assert (out / "report.md").exists()
    assert main(["matmul", "--device", "gpu", "--sizes", "8", "--out", str(tmp_path / "m")]) == 2


@pytest.mark.slow
def test_a_cell_the_cpu_cannot_run_is_recorded_as_unsupported(tmp_path):
    reason = unsupported_reason("torch", "bf16-mixed", "lstm", "cpu")
    if reason is None:
        pytest.skip("this CPU runs torch's bf16 LSTM: nothing unsupported to record")
    out = tmp_path / "lstm"
    args = ["run", "--model", "lstm", "--precision", "bf16-mixed", "--steps", "3"]
    main([*args, "--batch-size", "2", "--no-eval", "--no-progress", "--out", str(out)])
    runs = {r["framework"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert runs["torch"]["status"] == "unsupported" and runs["torch"]["reason"] == reason
    assert runs["jax"]["status"] == "completed"
    assert runs["jax"]["hardware"]["torch"]["cpu_capability"]


def test_progress_is_plain_lines_off_a_terminal():
    stream = io.StringIO()
    assert list(progress(range(5), "job", stream=stream)) == list(range(5))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("job: 5/5 steps done in")
    with pytest.raises(ValueError, match="every_s"):
        list(progress(range(2), "job", every_s=0))


def test_progress_is_a_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    assert list(progress(range(3), "job", stream=stream)) == [0, 1, 2]
    assert "\rjob:" in stream.getvalue() and "|" in stream.getvalue()  # tqdm's bar


@pytest.mark.slow
def test_torch_memory_profiling_prints_no_kineto_markers(capfd):
    x = torch.ones(64, requires_grad=True)
    peak = measure.torch_cpu_step_memory(lambda: (x * 2).sum().backward(), [x])
    assert peak > 0
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err and "STAGE" not in err


def test_examples_show_progress_off_a_terminal(capsys):
    from examples import utils

    assert list(utils.progress(range(3), total=3, enabled=True, desc="train")) == [0, 1, 2]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("train: 3/3 steps done in")
    assert list(utils.progress(range(2), total=2, enabled=False, desc="train")) == [0, 1]
    assert capsys.readouterr().err == ""
