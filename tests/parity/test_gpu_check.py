"""The one GPU check (scripts/gpu_checks.sh, parity.cli.gpu_check): its plan fits 8 minutes and
every stage's command parses; the dry mode runs the whole plan on CPU (one tiny step) and reads
the figures back, so it cannot rot where no GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.cli import gpu_check
from parity.core.records import load_results

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_fits_the_budget_and_every_command_parses(tmp_path):
    stages = gpu_check.plan(tmp_path)
    planned = gpu_check.select(stages)
    assert sum(s.cap_s for s in planned) <= gpu_check.BUDGET_S <= 480  # 8 minutes in all
    assert [s.key for s in planned] == [  # most important first
        "machine",
        "gpt2-fp32",
        "gpt2-bf16-mixed",
        "gpt2-fp16-mixed",
        "matmul",
        "loss-scaled",
        "jaxamp-tests",
    ]
    assert [s.key for s in stages if s.extra] == ["gpt2-compile"]
    assert len({s.name for s in stages}) == len(stages)
    cells = [s for s in stages if s.name.startswith("gpt2-small")]
    assert len(cells) == 4 and all("--device gpu" in " ".join(s.command) for s in cells)
    matmul = next(s for s in stages if s.name == "matmul")
    assert ("1024", "4096", "8192") == matmul.command[matmul.command.index("--sizes") + 1 :][:3]
    for stage in stages:
        if stage.command[1:3] == ("-m", "parity"):
            assert gpu_check._parsed(stage)["rc"] == 0, stage.command
    broken = gpu_check.Stage("bad", (sys.executable, "-m", "parity", "run", "--nope"), 1)
    assert gpu_check._parsed(broken)["rc"] == 2


def test_only_and_cap_pick_stages_by_key_and_refuse_unknown_keys(tmp_path):
    stages = gpu_check.plan(tmp_path)
    chosen = gpu_check.select(stages, ["jaxamp-tests", "gpt2-fp32"], ["jaxamp-tests=150"])
    assert [s.key for s in chosen] == ["gpt2-fp32", "jaxamp-tests"]  # the plan's order
    assert [s.cap_s for s in chosen] == [120, 150]
    assert gpu_check.select(stages) == [s for s in stages if not s.extra]
    assert gpu_check.select(stages, extras=True) == stages  # the dry mode's
    assert [s.key for s in gpu_check.select(stages, ["gpt2-compile"])] == ["gpt2-compile"]
    tests = chosen[1]
    assert dict(tests.env)["JAX_PLATFORMS"] == "cuda,cpu"  # host callbacks need the CPU backend
    with pytest.raises(ValueError, match="did you mean 'gpt2-fp32'"):
        gpu_check.select(stages, ["gpt2-fp23"])
    ids = ("tests/jaxamp/test_policy.py::test_a", "tests/jaxamp/test_fp8.py::test_b[jit]")
    (rerun,) = [s for s in gpu_check.plan(tmp_path, tests=ids) if s.key == "jaxamp-tests"]
    assert rerun.key == "jaxamp-tests" and rerun.command[-2:] == ids
    for bad in ("jaxamp-tests", "jaxamp-tests=0", "jaxamp-tests=1.5"):
        with pytest.raises(ValueError, match="KEY=SECONDS"):
            gpu_check.select(stages, None, [bad])


def test_a_capped_test_stage_is_read_from_its_verbose_lines(tmp_path):
    """pytest writes its JUnit file at the end only: a tests stage stopped at its cap is read
    from the outcome lines ``-v`` wrote to the log (with xdist and without)."""
    (tmp_path / "gpu_check.log").write_text(
        "== gpt2-small fp32: tests/x.py::not_this PASSED\n"
        "== jaxamp tests (JAX_PLATFORMS=cuda,cpu) (cap 90 s): python -m pytest ...\n"
        "[gw0] [  1%] PASSED tests/jaxamp/test_a.py::test_one[jit-1e-12]\n"
        "[gw1] [  2%] FAILED tests/jaxamp/test_a.py::test_two\n"
        "tests/jaxamp/test_b.py::test_three SKIPPED (no torchao)                [  3%]\n"
        "[gw0] [  4%] XPASS tests/jaxamp/test_b.py::test_four\n"
    )
    tests = gpu_check.summarise(tmp_path)["jaxamp_tests"]
    assert (tests["tests"], tests["passed"], tests["failures"], tests["skipped"]) == (4, 1, 2, 1)
    assert tests["failed"] == [
        "tests/jaxamp/test_a.py::test_two",
        "tests/jaxamp/test_b.py::test_four",
    ]
    assert tests["complete"] is False


def test_the_figures_print_as_tables():
    figures = {
        "gpt2_small": {
            "cells": {
                "gpt2 fp32": {
                    "status": "PASS",
                    "runs": {"torch": {"median_step_s": 0.05, "peak_memory_bytes": 2**31}},
                    "jax vs torch": {"status": "ok", "text": "JAX/torch 0.9 [0.85, 0.95]"},
                }
            },
            "speedup_over_fp32": {"jax": {"bf16-mixed/fp32": 2.5}, "torch": {}},
        },
        "loss_scaled": [
            {
                "model": "mlp",
                "policy": "fp32",
                "donated": True,
                "variant": "loss_scaled",
                "ratio_to_plain": 1.1,
                "ratio_to_peer": {"flax": {"ratio": 0.95, "ci95": [0.9, 0.99]}},
            }
        ],
        "jaxamp_tests": {"passed": 3, "failures": 1, "errors": 0, "skipped": 2, "failed": ["t: x"]},
    }
    text = gpu_check.format_figures(figures)
    assert "gpt2 fp32: PASS" in text and "step 50.00 ms, peak 2.00 GiB" in text
    assert "jax vs torch: JAX/torch 0.9" in text and "bf16-mixed/fp32 2.50x" in text
    assert "/flax 0.950 [0.900, 0.990]" in text
    assert "3 passed, 1 failed" in text and "FAILED t: x" in text
    assert gpu_check.format_figures({}) == ""


def test_a_stage_past_its_cap_is_interrupted_with_its_children(tmp_path):
    """Before the cap the stage's process group gets SIGINT (pytest and the cells report how far
    they got) and the stage ends with rc 124 at its cap, its children too."""
    script = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('CHILDPID', child.pid, flush=True)\n"
        "try:\n    time.sleep(60)\n"
        # slow to stop once interrupted: killed at the cap
        "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n    time.sleep(60)\n"
    )
    stage = gpu_check.Stage("sleeper", (sys.executable, "-c", script), 4)
    with open(tmp_path / "log", "w") as log:
        result = gpu_check.run_stage(stage, log)
    # Stopped at its cap (the script alone would take 120 s); the margin is for killing and
    # reaping the group on a loaded machine, not part of what is checked.
    assert result["timed_out"] and result["rc"] == 124 and result["seconds"] < stage.cap_s + 3
    text = (tmp_path / "log").read_text()
    assert "interrupted" in text
    pid = int(text.split("CHILDPID ")[1].split()[0])
    for _ in range(50):  # the child got SIGINT too (a zombie or gone, never left sleeping)
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid)


def test_a_stage_run_in_process_reports_its_failure_and_leaves_the_environment(tmp_path):
    """The dry mode's in-process run: the stage's environment while it runs, restored after
    (and ``sys.argv``, a script's); an exception is rc 1 with its traceback in the log; an exit
    (argparse's refusal, a script's) is its code."""
    code = "import os; print('SEEN', os.environ['GPU_CHECK_PROBE']); raise RuntimeError('boom')"
    stage = gpu_check.Stage("probe", (sys.executable, "-c", code), 5, (("GPU_CHECK_PROBE", "1"),))
    bad = gpu_check.Stage("bad", (sys.executable, "-m", "parity", "matmul", "--nope"), 5)
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint('ARGV', sys.argv[1:])\nsys.exit(3)\n")
    scripted = gpu_check.Stage("script", (sys.executable, str(script), "--help"), 5)
    argv = list(sys.argv)
    with open(tmp_path / "log", "w") as log:
        failed = gpu_check.run_in_process(stage, log)
        refused = gpu_check.run_in_process(bad, log)
        exited = gpu_check.run_in_process(scripted, log)
    assert failed["rc"] == 1 and failed["in_process"] and refused["rc"] == 2 and exited["rc"] == 3
    assert "GPU_CHECK_PROBE" not in os.environ and sys.argv == argv
    text = (tmp_path / "log").read_text()
    assert "SEEN 1" in text and "RuntimeError: boom" in text and "== probe: rc=1" in text
    assert "ARGV ['--help']" in text


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state


def test_the_script_runs_the_check_with_its_arguments(tmp_path):
    """scripts/gpu_checks.sh: ``$PY -m parity.cli.gpu_check --out OUT [--dry] ARGS`` from the
    checkout's root, the checkout on PYTHONPATH, JAX's GPU memory not preallocated, its exit
    status the script's (a stand-in for $PY prints what it was given and exits 3)."""
    fake = tmp_path / "py"
    fake.write_text(
        '#!/bin/sh\necho "ARGS $*"\necho "CWD $(pwd)"\necho "PYTHONPATH $PYTHONPATH"\n'
        'echo "PREALLOCATE $XLA_PYTHON_CLIENT_PREALLOCATE"\nexit 3\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "PYTHONPATH": "/elsewhere"}
    for args, expected in (
        (["--dry", "OUT"], "ARGS -m parity.cli.gpu_check --out OUT --dry"),
        (["OUT", "--only", "gpt2-fp32"], "ARGS -m parity.cli.gpu_check --out OUT --only gpt2-fp32"),
    ):
        done = subprocess.run(
            ["bash", str(ROOT / "scripts/gpu_checks.sh"), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 3, done.stderr  # the check's exit status is the script's
        lines = done.stdout.splitlines()
        assert expected in lines, lines
        assert f"CWD {ROOT}" in lines and f"PYTHONPATH {ROOT}:/elsewhere" in lines, lines
        assert "PREALLOCATE false" in lines, lines


@pytest.mark.integration
@pytest.mark.torch
@pytest.mark.standard_promotion  # the matmul and the benchmark run here, as in the check's process
def test_the_dry_mode_runs_the_plan_on_cpu_and_reads_the_figures_back(tmp_path, capsys):
    """The script's command (`test_the_script_runs_the_check_with_its_arguments`), run in this
    process: the stages it runs in its own process run here (this process has loaded what they
    load), the cell and the tests' collection in processes of their own."""
    pytest.importorskip("torch")
    out = tmp_path / "check"
    code = gpu_check.main(["--out", str(out), "--dry"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-2000:] + (out / "gpu_check.log").read_text()[-3000:]
    assert "gpu check (dry): 8/8 stages ok" in printed
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry"] and [s["rc"] for s in report["stages"]] == [0] * len(report["stages"])
    ran = [s["stage"] for s in report["stages"] if s.get("dry") == "ran"]
    assert ran == ["machine", "gpt2-small fp32", "matmul"], ran
    # the cell in its own process; the machine stage, the matmul and the benchmark's --help in
    # the check's
    in_process = [s["stage"] for s in report["stages"] if s.get("in_process")]
    assert in_process == ["machine", "matmul", "bench_loss_scaled"], in_process
    cell = report["figures"]["gpt2_small"]["cells"]["gpt2 fp32"]
    assert cell["status"] == "PASS" and set(cell["runs"]) == {"torch", "jax"}
    assert all(r["median_step_s"] > 0 for r in cell["runs"].values())
    assert report["figures"]["matmul"]
    log = (out / "gpu_check.log").read_text()
    assert all(f"== {stage['stage']}: " in log for stage in report["stages"])
    # the cell is one step of gpt2-small (its 12 heads; width, depth and context reduced) through
    # `python -m parity run --size gpt2-small`: both frameworks, step 0 passed, no plots drawn
    cells = out / "gpt2"
    runs = load_results(cells)["runs"]
    assert {r["framework"] for r in runs} == {"torch", "jax"}
    for run in runs:
        assert run["model_config"]["d_model"] == 24 and run["model_config"]["num_heads"] == 12
        assert (run["model_config"]["num_layers"], run["model_config"]["seq_len"]) == (1, 8)
        assert run["step0"]["passed"] and len(run["steps"]) == 1
    assert "Not drawn (`--no-plots`)" in (cells / "report.md").read_text()
    assert not list(cells.glob("*.png"))
