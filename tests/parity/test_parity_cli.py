"""`python -m parity`: run, compare (exit codes), matrix (resumable), atomic results, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import fake_run  # noqa: E402

from parity import cell  # noqa: E402
from parity.cli import commands as cli  # noqa: E402
from parity.core.records import load_results, merge_runs, write_json_atomic  # noqa: E402

pytestmark = [pytest.mark.standard_promotion, pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[2]


def _fake_run(framework, precision="fp32", losses=(2.0, 1.5, 1.0), scales=None, mode="eager"):
    """A measured mlp run record; a step is skipped where the scale drops after it."""
    skips = (
        None
        if scales is None
        else [i + 1 < len(scales) and scales[i + 1] < scales[i] for i in range(len(scales))]
    )
    return fake_run(
        framework,
        losses,
        precision,
        scales=scales,
        skips=skips,
        torch_mode=mode,
        model="mlp",
        measured=True,
        summary={"compile_time_s": None},
    )


# The runs here are the default mlp at batch 4 (the matrix's, which takes no overrides): one
# fp32 and one bf16-mixed program of each kind for the whole file.
@pytest.mark.integration
def test_run_both_writes_results_and_report(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--model", "mlp", "--precision", "fp32", "--framework", "both"]
    args += ["--steps", "12", "--batch-size", "4", "--out", str(out), "--no-progress"]
    assert cli.main(args) == 0
    data = load_results(out)
    assert sorted(r["framework"] for r in data["runs"]) == ["jax", "torch"]
    for run in data["runs"]:
        assert {
            "framework",
            "model",
            "precision",
            "device",
            "versions",
            "config",
            "steps",
            "summary",
        } <= set(run)
        assert run["config"]["policy"] == "p=f32,c=f32,o=f32"
        assert run["summary"]["peak_memory_method"]
    assert (out / "report.md").exists() and (out / "steps.csv").exists()
    captured = capsys.readouterr()
    printed = captured.out
    assert "per-step loss, steps 0-9" in printed and "report:" in printed
    # Where the time went: in every record (the schema checked it on load), one line, the report.
    for run in data["runs"]:
        names = [entry["phase"] for entry in run["phases"]]
        for name in ("step 0", "step 0/outputs and gradients", "step 0/layer probe"):
            assert name in names, names
        for part in ("torch", "jax", "jax/compile", "jax/run"):  # each side's passes, timed apart
            assert f"step 0/outputs and gradients/{part}" in names, names
        assert "step 0/stochastic modules" in names, names
        for name in ("train torch/steps", "train jax/compile", "train jax/steps"):
            assert name in names, names
        assert "verdicts" in names and "report/plots" in names, names
        assert names.index("step 0") < names.index("step 0/layer probe")  # in the order begun
    line = [x for x in captured.err.splitlines() if x.startswith("time (wall s / CPU s): ")]
    assert len(line) == 1 and "step 0 " in line[0] and "total " in line[0], captured.err
    assert "## Where the time went" in (out / "report.md").read_text()
    # Running one framework again replaces its run instead of appending a duplicate.
    args = ["run", "--model", "mlp", "--framework", "jax", "--steps", "4", "--batch-size", "4"]
    assert cli.main([*args, "--out", str(out), "--no-progress", "--no-eval"]) == 0
    runs = load_results(out)["runs"]
    assert len(runs) == 2
    assert len(next(r for r in runs if r["framework"] == "jax")["steps"]) == 4


def test_compare_exit_code_fails_on_a_failed_verdict(tmp_path, capsys):
    good = [_fake_run("torch"), _fake_run("jax", losses=(2.0, 1.5, 1.00001))]
    write_json_atomic(tmp_path / "ok" / "results.json", {"runs": good})
    assert cli.main(["compare", str(tmp_path / "ok")]) == 0
    bad = [_fake_run("torch"), _fake_run("jax", losses=(2.0, 1.6, 1.0))]
    write_json_atomic(tmp_path / "bad" / "results.json", {"runs": bad})
    assert cli.main(["compare", str(tmp_path / "bad")]) == 1
    assert "FAIL" in capsys.readouterr().out
    verdicts = json.loads((tmp_path / "bad" / "verdicts.json").read_text())["verdicts"]
    assert any(v["passed"] is False for v in verdicts)


def test_compare_missing_folder_and_bad_model_are_usage_errors(tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path / "nothing")]) == 2
    assert "results.json" in capsys.readouterr().err
    assert cli.main(["run", "--model", "no_such_model", "--out", str(tmp_path)]) == 2
    assert "--model must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", "--model", "mlp", "--precision", "fp8", "--out", str(tmp_path)])


@pytest.mark.integration
def test_matrix_resumes_after_interruption(tmp_path, monkeypatch):
    out = tmp_path / "matrix"
    calls = []
    real_run_pair = cell.run_cell

    def interrupted(config, frameworks, *, progress, **kwargs):
        calls.append((config.precision, frameworks))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user hits ^C during the second cell
        return real_run_pair(config, frameworks, progress=progress, **kwargs)

    monkeypatch.setattr(cell, "run_cell", interrupted)
    args = ["matrix", "--out", str(out), "--models", "mlp", "--precisions", "fp32", "bf16-mixed"]
    args += ["--steps", "3", "--batch-size", "4", "--no-eval", "--no-progress", "--warmup", "1"]
    # what is checked is the resumption; the plots are drawn (and checked) by the run test above
    args += ["--no-plots"]
    with pytest.raises(KeyboardInterrupt):
        cli.main(args)
    finished = load_results(out)["runs"]
    assert {(r["precision"], r["framework"]) for r in finished} == {
        ("fp32", "torch"),
        ("fp32", "jax"),
    }
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]

    redo = []

    def counting(config, frameworks, *, progress, **kwargs):
        redo.append(config.precision)
        return real_run_pair(config, frameworks, progress=progress, **kwargs)

    monkeypatch.setattr(cell, "run_cell", counting)
    assert cli.main(args) == 0
    assert redo == ["bf16-mixed"]  # the finished fp32 cell is not redone
    assert len(load_results(out)["runs"]) == 4
    redo.clear()
    assert cli.main(args) == 0
    assert redo == []
    assert "Not drawn (`--no-plots`)" in (out / "report.md").read_text()
    assert not list(out.glob("*.png"))


def test_matrix_applies_each_models_prescribed_calibration(tmp_path, monkeypatch):
    from parity.models import calibration_prescribed

    asked = []

    def fake_run_cell(config, frameworks, *, noise, seeds, **kwargs):
        asked.append((config.model, noise, seeds))
        return []

    monkeypatch.setattr(cell, "run_cell", fake_run_cell)
    monkeypatch.setattr(cell, "write_outputs", lambda out, runs=None, **kw: ("PASS", [], None))
    args = ["matrix", "--out", str(tmp_path), "--models", "mlp", "resnet", "--precisions", "fp32"]
    assert cli.main(args + ["--no-progress"]) == 0
    assert asked == [("mlp", "none", 1), ("resnet", "torch", 3)]
    assert calibration_prescribed("resnet") == {"noise": "torch", "seeds": 3}
    asked.clear()  # an explicit option wins over the prescription
    assert cli.main(args + ["--no-progress", "--noise", "none", "--seeds", "1"]) == 0
    assert asked == [("mlp", "none", 1), ("resnet", "none", 1)]


def test_results_are_written_atomically(tmp_path):
    merge_runs(tmp_path, [_fake_run("torch")])
    before = (tmp_path / "results.json").read_text()

    class Unserialisable:
        pass

    broken = _fake_run("jax")
    broken["summary"]["oops"] = Unserialisable()
    with pytest.raises(TypeError):
        merge_runs(tmp_path, [broken])
    assert (tmp_path / "results.json").read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["results.json"]


def test_non_finite_values_become_null_in_strict_json(tmp_path):
    run = _fake_run("jax")
    run["summary"]["final_loss"] = float("nan")
    write_json_atomic(tmp_path / "r.json", {"runs": [run]})
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text
    assert json.loads(text)["runs"][0]["summary"]["final_loss"] is None


# Where torch is imported, libgomp reads OMP_WAIT_POLICY once: `python -m parity` must have set
# it by then, or torch's idle OpenMP threads spin (most of step 0's torch CPU seconds at 512x8).
# A sitecustomize (run before `-m parity`) records the variable when torch is first looked up.
_WATCH_TORCH_IMPORT = """
import atexit, gc, importlib.abc, os, sys
# the last exit handler: no final garbage collection over what torch made (--help exits in
# argparse, before python -m parity's own freeze)
atexit.register(gc.freeze)
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
        return None
sys.meta_path.insert(0, Watch())
atexit.register(lambda: print("AT_TORCH_IMPORT", seen))
"""


@pytest.mark.integration
def test_python_dash_m_parity_help_and_the_wait_policy_torch_loads_with(tmp_path):
    """`python -m parity --help` lists the commands; torch, when it loads, sees
    OMP_WAIT_POLICY=PASSIVE though the caller did not set it."""
    (tmp_path / "sitecustomize.py").write_text(_WATCH_TORCH_IMPORT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "parity", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for command in ("run", "compare", "matrix"):
        assert command in result.stdout
    assert "AT_TORCH_IMPORT ['PASSIVE']" in result.stdout, result.stdout[-500:]


def test_a_run_that_raises_is_recorded_and_fails_compare(tmp_path, monkeypatch):
    import parity.training.train_jax

    def broken(config, pair, progress=False):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(parity.training.train_jax, "train_jax", broken)
    out = tmp_path / "err"
    args = ["run", "--model", "mlp", "--steps", "3", "--batch-size", "4", "--no-eval"]
    assert cli.main([*args, "--out", str(out), "--no-progress"]) == 1
    runs = load_results(out)["runs"]
    error = next(r for r in runs if r["framework"] == "jax")
    assert "no kernel for this" in error["summary"]["error"]
    assert "Runs that raised" in (out / "report.md").read_text()


# --- invalid files, nothing compared, no finite values ------------------------------------------


def _synthetic(framework, precision="fp32", losses=(2.3, 2.0, 1.8), scales=None, skipped=None):
    return fake_run(framework, losses, precision, scales=scales, skips=skipped, model="mlp")


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ({"runs": [{}]}, "'framework'"),
        ({"runs": [_synthetic("torch") | {"steps": [{"step": 0}]}]}, "'steps[0].loss'"),
        (
            {"runs": [_synthetic("torch") | {"steps": [{"step": 0, "loss": "x"}]}]},
            "'steps[0].loss'",
        ),
        ({"runs": [{k: v for k, v in _synthetic("jax").items() if k != "steps"}]}, "'steps'"),
    ],
)
def test_compare_names_file_run_and_field_of_an_invalid_results_file(
    tmp_path, capsys, content, field
):
    (tmp_path / "results.json").write_text(json.dumps(content))
    assert cli.main(["compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "results.json") in err and "run 0" in err and field in err
    assert "Traceback" not in err


def test_compare_names_a_broken_json_file(tmp_path, capsys):
    (tmp_path / "results.json").write_text('{"runs": [')
    assert cli.main(["compare", str(tmp_path)]) == 2
    assert "results.json: not valid JSON" in capsys.readouterr().err


def test_matrix_refuses_to_resume_onto_an_invalid_file(tmp_path, capsys):
    bad = json.dumps({"runs": [{"framework": "jax"}]})
    (tmp_path / "results.json").write_text(bad)
    args = ["matrix", "--out", str(tmp_path), "--models", "mlp", "--precisions", "fp32"]
    assert cli.main(args + ["--steps", "2", "--no-progress"]) == 2
    assert "'model'" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == bad  # not overwritten


def test_compare_with_one_framework_exits_non_zero_and_says_why(tmp_path, capsys):
    write_json_atomic(tmp_path / "results.json", {"runs": [_synthetic("torch")]})
    assert cli.main(["compare", str(tmp_path)]) == 3
    out = capsys.readouterr().out
    assert "NOTHING COMPARED" in out
    report = (tmp_path / "report.md").read_text()
    assert "NOTHING COMPARED" in report and "only torch" in report
    assert json.loads((tmp_path / "verdicts.json").read_text())["status"] == "NOTHING COMPARED"


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("case", ["nan_batch_0", "all_skipped"])
def test_compare_reports_runs_without_finite_losses(tmp_path, capsys, precision, case):
    losses = [None, None, None] if case == "all_skipped" else [None, 2.0, 1.8]
    scales = [2.0**16, 2.0**15, 2.0**14] if precision == "fp16-mixed" else None
    skipped = [True, True, True] if case == "all_skipped" else [True, False, False]
    skipped = skipped if precision == "fp16-mixed" else None
    runs = [_synthetic(fw, precision, losses, scales, skipped) for fw in ("torch", "jax")]
    write_json_atomic(tmp_path / "results.json", {"runs": runs})
    assert cli.main(["compare", str(tmp_path)]) == 1  # the verdict status, not a plotting error
    assert "Traceback" not in capsys.readouterr().err
    report = (tmp_path / "report.md").read_text()
    assert "**FAIL**" in report
    if case == "all_skipped":
        assert "no finite loss" in report


@pytest.mark.integration
@pytest.mark.slow
def test_run_with_noise_and_seeds_records_calibration_runs(tmp_path, capsys):
    args = ["run", "--model", "mlp", "--out", str(tmp_path), "--steps", "4", "--batch-size", "4"]
    args += ["--no-progress", "--no-step0", "--no-eval", "--warmup", "1"]
    # Two seeds cannot show equivalence (TOST) over 4 steps: INCONCLUSIVE (exit 4), never a
    # pass on a difference test that merely did not reject.
    assert cli.main(args + ["--noise", "torch", "--seeds", "2", "--precision", "bf16-mixed"]) == 4
    runs = load_results(tmp_path)["runs"]
    variants = sorted((r["framework"], r["variant"], r["config"]["data_seed"] or 0) for r in runs)
    assert variants == [
        ("jax", "", 0),
        ("jax", "", 1),
        ("torch", "", 0),
        ("torch", "", 1),
        ("torch", "noise", 0),
    ]
    report = (tmp_path / "report.md").read_text()
    assert "seed statistics" in report and "Welch" in report and "divergence.png" in report
