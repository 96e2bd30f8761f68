"""`python -m parity` on what it should refuse: runs that are not comparable, concurrent writers,
bad arguments, malformed results files (a fuzz test), nonsense values, unreadable data and a
non-finite first batch. Each case exits with a documented code and says why in one line."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from conftest import fake_run  # noqa: E402

from parity import cell  # noqa: E402
from parity.cli import commands as cli  # noqa: E402
from parity.core.config import RunConfig  # noqa: E402
from parity.core.records import load_results, write_json_atomic  # noqa: E402
from parity.data import DataSpec, load_text  # noqa: E402
from parity.report import markdown as report  # noqa: E402
from parity.verdicts.judge import compare_runs  # noqa: E402

pytestmark = [pytest.mark.standard_promotion, pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[2]
EXIT_CODES = {0, 1, 2, 3, 4}  # README: PASS, FAIL, bad input, nothing compared, inconclusive
TINY_MLP = ["--model-override", "image_shape=[8,8,3]", "--model-override", "hidden=16"]


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    # The plots are drawn inside the report's own guard (a failing plot is a note in the report,
    # never an exception) and judge nothing: leaving them out keeps these cases fast.
    monkeypatch.setattr(report, "_draw_plots", lambda runs, out: ([], []))


def _run(framework, precision="fp32", losses=(2.3, 2.0, 1.8), scales=None, skips=None, **config):
    """A measured mlp run record whose configuration holds `config`'s trajectory settings."""
    config = {"precision": precision, "steps": len(losses), **config}
    return fake_run(
        framework,
        losses,
        precision,
        scales=scales,
        skips=skips,
        model="mlp",
        eval_metric=0.5,
        config=config,
        measured=True,
    )


def _step0(passed=True):
    row = {
        "model": "mlp",
        "precision": "fp32",
        "device": "cpu",
        "check": "step 0 fp32: gradients",
        "compared": "jax vs torch, step 0",
        "value": 1e-7,
        "tolerance": 1e-5,
        "passed": passed,
        "detail": "worst parameter: fc/kernel",
        "mode": "step 0",
    }
    return {
        "passed": passed,
        "summary": "step 0: all checks pass",
        "verdicts": [row],
        "worst_output": ["logits", 1e-7],
        "worst_parameter": ["fc/kernel", 1e-7],
        "compute_flops": None,
        "diagnosis": {"markdown": "| table |", "first_failing": None},
        "diagnosis_error": None,
    }


def _compare(folder: Path, runs_or_text, capsys) -> tuple[int, str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    text = runs_or_text if isinstance(runs_or_text, str) else json.dumps({"runs": runs_or_text})
    (folder / "results.json").write_text(text)
    code = cli.main(["compare", str(folder)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _no_training(monkeypatch):
    def trained(*args, **kwargs):
        raise AssertionError("training started: the argument should have been refused first")

    monkeypatch.setattr(cli.cell, "run_cell", trained)


# --- 1. only comparable runs are compared ----------------------------------------------------


@pytest.mark.parametrize(
    ("field", "torch_value", "jax_value"),
    [
        ("steps", 30, 2),
        ("lr", 1e-3, 1e-2),
        ("optimizer", "adamw", "sgd"),
        ("schedule", "cosine", "constant"),
        ("batch_size", 32, 8),
        ("seed", 0, 1),
        ("data", "synthetic", "digits"),
        ("clip_norm", 1.0, None),
    ],
)
def test_runs_that_differ_in_a_trajectory_setting_are_not_comparable(
    tmp_path, capsys, field, torch_value, jax_value
):
    torch_run = _run("torch", **{field: torch_value})
    jax_run = _run("jax", **{field: jax_value})
    if field == "steps":  # the issue's case: 30 torch steps against 2 JAX steps
        torch_run = _run("torch", losses=[2.3 - 0.01 * i for i in range(30)])
        jax_run = _run("jax", losses=(2.3, 2.29))
    code, out, err = _compare(tmp_path, [torch_run, jax_run], capsys)
    assert code == 3, out + err  # nothing judged: never 0
    verdicts = json.loads((tmp_path / "verdicts.json").read_text())["verdicts"]
    (row,) = [v for v in verdicts if v["mode"] == "not comparable"]
    assert field in row["value"] and row["passed"] is None
    assert not any(v["passed"] is True for v in verdicts)


def test_different_recorded_lengths_are_not_judged_on_the_common_prefix(tmp_path, capsys):
    # Records without a config (older files) still differ in what they recorded.
    torch_run, jax_run = _run("torch"), _run("jax", losses=(2.3, 2.0))
    torch_run["config"] = jax_run["config"] = {}
    code, out, _ = _compare(tmp_path, [torch_run, jax_run], capsys)
    assert code == 3 and "recorded steps (torch 3, jax 2)" in out
    # A run that stopped early on a non-finite loss is judged, and fails.
    jax_run["steps"][-1]["loss"] = None
    jax_run["summary"].update(diverged=True, stopped_reason="non-finite loss")
    assert _compare(tmp_path, [torch_run, jax_run], capsys)[0] == 1


def test_a_not_comparable_cell_beside_a_passing_one_is_never_a_pass(tmp_path, capsys):
    losses = [2.3 - 0.02 * i for i in range(12)]
    passing = [_run("torch", losses=losses), _run("jax", losses=losses)]
    assert _compare(tmp_path, passing, capsys)[0] == 0
    other = [_run("torch", lr=1e-2) | {"model": "cnn"}, _run("jax") | {"model": "cnn"}]
    code, out, _ = _compare(tmp_path, passing + other, capsys)
    status = json.loads((tmp_path / "verdicts.json").read_text())["status"]
    assert code not in (0, 1) and status != "PASS" and "not comparable" in out


def test_a_calibration_run_made_with_other_settings_is_left_out():
    noise = _run("torch", lr=1e-2) | {"variant": "noise"}
    rows = compare_runs([_run("torch"), _run("jax"), noise])
    (row,) = [v for v in rows if v.check == "calibration run left out"]
    assert "lr" in row.value
    assert all("self-divergence" not in v.detail for v in rows)


# --- 2. concurrent writers keep every run ------------------------------------------------------

_WRITER = """
import sys, time
from pathlib import Path
from parity.core.records import merge_runs
out, who, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
(out / f"ready-{who}").touch()
while len(list(out.glob("ready-*"))) < 2:  # start together
    time.sleep(0.01)
for i in range(count):
    run = {"framework": "jax", "model": f"{who}{i}", "precision": "fp32", "device": "cpu",
           "steps": [], "summary": {}}
    merge_runs(out, [run])
import gc; gc.freeze()  # no final garbage collection over what the imports made
"""


@pytest.mark.integration
def test_two_processes_merging_at_once_lose_no_run(tmp_path):
    count = 30
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), who, str(count)], cwd=ROOT)
        for who in ("a", "b")
    ]
    try:
        codes = [w.wait(timeout=240) for w in writers]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.wait()
    assert codes == [0, 0]
    models = sorted(r["model"] for r in load_results(tmp_path)["runs"])
    assert models == sorted(f"{who}{i}" for who in "ab" for i in range(count))


# --- 3, 6, 9. bad arguments exit 2 before any work, naming the option ------------------------


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        (["--init-scale", "1e300"], "--init-scale"),
        (["--init-scale", "0"], "--init-scale"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "1e39"], "--lr"),
        (["--steps", "0"], "--steps"),
        (["--warmup", "-1"], "--warmup"),
        (["--growth-interval", "0"], "--growth-interval"),
        (["--weight-decay", "-0.1"], "--weight-decay"),
        (["--seed", "99999999999999999999999"], "--seed"),
        (["--seed", str(2**63 - 1), "--seeds", "2", "--framework", "both"], "--seed"),
        (["--clip-norm", "-1"], "--clip-norm"),
        (["--data", "text:"], "--data"),
        (["--data", "cifar10:/nonexistent/cifar"], "--data"),
        (["--model", "transformer", "--data", "text:/nonexistent/corpus.txt"], "--data"),
    ],
)
def test_bad_arguments_exit_2_before_any_work_naming_the_option(
    tmp_path, capsys, monkeypatch, extra, option
):
    _no_training(monkeypatch)
    args = ["run", "--model", "mlp", "--framework", "jax", "--out", str(tmp_path / "x")]
    if "--model" in extra:
        args[1:3] = []
    assert cli.main([*args, "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x" / "results.json").exists()


@pytest.mark.parametrize("option", ["--seeds", "--threads", "--devices", "--timeout"])
def test_counts_below_one_are_refused_by_the_parser(tmp_path, capsys, option):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--model", "mlp", "--out", str(tmp_path), option, "0"])
    assert exit_info.value.code == 2 and option in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a file", "/proc", "results.json a folder", "invalid results"])
def test_an_unusable_out_is_refused_before_training(tmp_path, capsys, monkeypatch, where):
    _no_training(monkeypatch)
    out = tmp_path / "out"
    if where == "a file":
        out.write_text("not a folder")
    elif where == "/proc":
        out = Path("/proc/parity-x")
    elif where == "results.json a folder":
        (out / "results.json").mkdir(parents=True)
    else:
        out.mkdir()
        (out / "results.json").write_text('{"runs": [{"framework": "jax"}]}')
    assert cli.main(["run", "--model", "mlp", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_failed_run_never_exits_0(tmp_path, capsys, monkeypatch):
    def fails(config, frameworks, **kwargs):
        from parity.core.records import build_error_record

        return [build_error_record("jax", config, RuntimeError("boom"))]

    monkeypatch.setattr(cli.cell, "run_cell", fails)
    args = ["run", "--model", "mlp", "--framework", "jax", "--out", str(tmp_path)]
    assert cli.main([*args, "--no-progress"]) == 1


# --- 4, 5. compare never tracebacks; nonsense never passes -----------------------------------


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("step0 rows of empty objects", "step0.verdicts[0]"),
        ("step0 rows a string", "step0.verdicts"),
        ("step0 row of another cell", "step0.verdicts[0]"),
        ("200,000-deep array", "nested"),
        ("deep array in a free field", "nested"),
        ("config.data_seed a string", "config.data_seed"),
        ("config.lr a list", "config.lr"),
        ("negative loss scale", "steps[0].loss_scale"),
        ("zero loss scale", "steps[0].loss_scale"),
        ("precision fp64", "'precision'"),
        ("policy of another precision", "'policy'"),
        ("steps out of order", "steps[1].step"),
        ("hardware without cpu", "hardware.cpu"),
    ],
)
def test_compare_refuses_a_malformed_file_in_one_line(tmp_path, capsys, case, expected):
    scales = [2.0**16, 2.0**15, 2.0**15]
    runs = [_run(fw, "fp16-mixed", scales=scales) for fw in ("torch", "jax")]
    torch_run = runs[0]
    text = None
    if case == "step0 rows of empty objects":
        torch_run["step0"] = {"verdicts": [{}]}
    elif case == "step0 rows a string":
        torch_run["step0"] = {"verdicts": "abc"}
    elif case == "step0 row of another cell":
        runs = [_run("torch"), _run("jax")]
        runs[0]["step0"] = _step0()
        runs[0]["step0"]["verdicts"][0]["model"] = "cnn"
    elif case == "200,000-deep array":
        text = _deep(200_000)
    elif case == "deep array in a free field":
        nested: list = []
        for _ in range(500):
            nested = [nested]
        runs[1]["extra"] = nested
    elif case == "config.data_seed a string":
        torch_run["config"]["data_seed"] = "abc"
    elif case == "config.lr a list":
        torch_run["config"]["lr"] = [1]
    elif case == "negative loss scale":
        for run in runs:
            run["steps"][0]["loss_scale"] = -1.0
    elif case == "zero loss scale":
        torch_run["steps"][0]["loss_scale"] = 0.0
    elif case == "precision fp64":
        for run in runs:
            run["precision"] = "fp64"
    elif case == "policy of another precision":
        torch_run["policy"] = "p=f32,c=bf16,o=f32"
    elif case == "steps out of order":
        torch_run["steps"][1]["step"] = 5
    elif case == "hardware without cpu":
        torch_run["hardware"] = {"jax": None}
    code, _, err = _compare(tmp_path, text if text is not None else runs, capsys)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "results.json" in err and expected in err


def test_a_scale_torch_underflowed_to_zero_is_recorded_and_judged(tmp_path, capsys):
    # GradScaler has no floor: ~165 backoffs reach 0, and every step at 0 skips. That run is a
    # finding (jaxamp's scale never reaches 0), not a malformed file.
    torch_run = _run("torch", "fp16-mixed", scales=[2.0**-149, 0.0, 0.0], skips=[0, 1, 1])
    jax_run = _run("jax", "fp16-mixed", scales=[2.0**-149] * 3)
    code, out, err = _compare(tmp_path, [torch_run, jax_run], capsys)
    assert code == 1 and not err and "loss-scale trajectory" in out


@pytest.mark.parametrize("name", ["results.json", "verdicts.json", "report.md"])
def test_compare_with_a_folder_where_a_file_should_be(tmp_path, capsys, name):
    write_json_atomic(tmp_path / "results.json", {"runs": [_run("torch"), _run("jax")]})
    if name == "results.json":
        (tmp_path / name).unlink()
    (tmp_path / name).mkdir()
    assert cli.main(["compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert name in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_one_framework_with_passing_step0_rows_is_nothing_compared(tmp_path, capsys):
    torch_run = _run("torch")
    torch_run["step0"] = _step0()
    code, out, _ = _compare(tmp_path, [torch_run], capsys)
    assert code == 3 and "NOTHING COMPARED" in out
    # The same rows beside a comparable JAX run count as usual.
    jax_run = _run("jax", losses=(2.3, 2.0, 1.80001))
    assert _compare(tmp_path, [torch_run, jax_run], capsys)[0] in (0, 4)


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, (*prefix, index))


def _seed_file() -> dict:
    scales = [2.0**16, 2.0**15, 2.0**15]
    torch_run = _run("torch", "fp16-mixed", scales=scales)
    torch_run["step0"] = _step0() | {
        "verdicts": [_step0()["verdicts"][0] | {"precision": "fp16-mixed"}]
    }
    jax_run = _run("jax", "fp16-mixed", scales=scales)
    for run in (torch_run, jax_run):  # GradScaler's halving after an overflow at step 0
        run["steps"][0]["skipped"] = True
    return {"runs": [torch_run, jax_run]}


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_compare_on_mutated_results_files_only_exits_with_documented_codes(data, capsys):
    document = _seed_file()
    paths = list(_paths(document))
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(paths), label="path")
        target = document
        try:
            for key in path[:-1]:
                target = target[key]
            if not path:
                document = data.draw(_JSON, label="file")
            elif data.draw(st.booleans(), label="delete") and isinstance(target, dict):
                target.pop(path[-1], None)
            else:
                target[path[-1]] = data.draw(_JSON, label="value")
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed the path
            continue
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "results.json").write_text(json.dumps(document))
        code = cli.main(["compare", folder])
    err = capsys.readouterr().err
    assert code in EXIT_CODES
    if code == 2:
        assert err.startswith("error: ") and "results.json" in err
        assert len(err.strip().splitlines()) == 1


def test_the_fuzz_seed_file_itself_is_judged(tmp_path, capsys):
    code, out, err = _compare(tmp_path, copy.deepcopy(_seed_file())["runs"], capsys)
    assert code in (0, 4) and not err  # valid: the fuzz starts from a file compare judges


# --- 7. text data: bounded memory, no empty path, the 1 KiB minimum ---------------------------


def test_text_loading_reads_no_more_than_max_bytes(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * (8 << 20))
    tracemalloc.start()
    try:
        corpus = load_text(big, max_bytes=64 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert corpus.size == 64 << 10
    assert peak < 1 << 20  # the file is 8 MiB; reading it whole peaked above it


def test_text_needs_a_path_after_the_colon_and_1_kib_of_text(tmp_path):
    with pytest.raises(ValueError, match="no path after the colon"):
        DataSpec.parse("text:")
    with pytest.raises(ValueError, match="takes no path"):
        DataSpec.parse("synthetic:")
    (tmp_path / "short.txt").write_bytes(b"a" * 1023)  # 1,024 with the newline it gets
    with pytest.raises(ValueError, match="holds 1023 bytes"):
        load_text(tmp_path / "short.txt")
    (tmp_path / "short.txt").write_bytes(b"a" * 1024)
    assert load_text(tmp_path / "short.txt").size == 1025


# --- 8. a non-finite first batch is the data's fault -------------------------------------------


class _Poisoned:
    """The built-in stream with NaN in one input of batch 0."""

    def __init__(self, stream):
        self._stream = stream
        self.batch_size, self.input_shape = stream.batch_size, stream.input_shape

    def batch(self, step):
        inputs, targets = self._stream.batch(step)
        if step == 0:
            inputs = inputs.copy()
            inputs[0, 1, 2, 0] = np.nan
        return inputs, targets

    def eval_batches(self):
        return self._stream.eval_batches()


def test_a_nan_in_the_first_batch_is_reported_as_the_datas_fault(monkeypatch):
    def step0(*args, **kwargs):
        raise AssertionError("the step-0 checks and their diagnosis ran on non-finite data")

    def train(framework, config, pair, stream, progress=False):  # the gate is under test
        return _run(framework) | {"summary": {**_run(framework)["summary"], "diverged": True}}

    monkeypatch.setattr(cell, "run_step0", step0)
    monkeypatch.setattr(cell, "train_framework", train)
    config = RunConfig(
        model="mlp",
        steps=2,
        batch_size=4,
        eval=False,
        timing_warmup=0,
        model_overrides={"image_shape": (8, 8, 3), "hidden": 16},
    )
    pair = cell.builtin_pair(config)
    stream = _Poisoned(pair.make_data(config.stream_seed, config.batch_size))
    runs = cell.run_cell(config, pair=pair, stream=stream, echo=False)
    rows = compare_runs(runs)
    data_rows = [v for v in rows if v.mode == "data"]
    assert data_rows and data_rows[0].passed is False
    assert data_rows[0].value == "inputs: 1 NaN, 0 inf (first at index (0, 1, 2, 0))"
    assert all(run["step0"]["diagnosis"] is None for run in runs)  # no layer is blamed
    assert all(run["step0"]["verdicts"] == [data_rows[0].to_dict()] for run in runs)
    assert math.isnan(stream.batch(0)[0][0, 1, 2, 0])


def test_library_eval_setting_is_taken_refused_or_derived():
    # compare_models / export_models(eval=False) raised "got multiple values for keyword
    # argument 'eval'": the caller's setting now turns evaluation off, and eval=True without
    # held-out batches is refused before any work, naming what to pass.
    import torch

    from parity.api import compare_models, resolve_eval
    from parity.golden.export import export_models

    assert resolve_eval("f", {}, True) is True
    assert resolve_eval("f", {}, False) is False
    config = {"eval": False, "lr": 0.1}
    assert resolve_eval("f", config, True) is False and config == {"lr": 0.1}
    with pytest.raises(TypeError, match=r"f\(eval='yes'\): eval must be True or False"):
        resolve_eval("f", {"eval": "yes"}, True)
    batches = [(np.zeros((2, 4), np.float32), np.zeros(2, np.int32))]
    linear = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"compare_models\(eval=True\): no held-out batches"):
        compare_models(linear, None, None, batches, eval=True)
    with pytest.raises(ValueError, match=r"export_models\(eval=True\): no held-out batches"):
        export_models("/nonexistent/g.npz", linear, "pkg.mod:Model", batches, eval=True)
