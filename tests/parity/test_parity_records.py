"""parity.core.records: one run-record schema, validation on load, atomic writes with the usual mode."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from parity.core import records
from parity.core.config import RunConfig
from parity.core.records import ResultsFileError, load_results, merge_runs, validate_run


def _run(framework="torch", **changes):
    run = {
        "framework": framework,
        "model": "mlp",
        "precision": "fp32",
        "device": "cpu",
        "status": "completed",
        "seed": 0,
        "variant": "",
        "config": {"seed": 0},
        "steps": [
            {"step": 0, "loss": 2.3, "loss_scale": None, "skipped": False, "time_s": 0.01},
            {"step": 1, "loss": 2.1, "loss_scale": None, "skipped": False, "time_s": 0.01},
        ],
        "summary": {"final_loss": 2.1, "eval_metric": None, "skipped_steps": 0},
    }
    run.update(changes)
    return run


def _write(tmp_path, data):
    (tmp_path / "results.json").write_text(json.dumps(data))


@pytest.mark.integration
def test_train_jax_does_not_import_torch():
    code = "import sys, parity.training.train_jax, parity.core.records, parity.verdicts.judge; print('torch' in sys.modules)"
    code += "\nimport gc; gc.freeze()"  # its exit skips a last collection over what JAX made
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(
    ("data", "run_index", "field"),
    [
        ({"runs": [{}]}, 0, "framework"),
        ({"runs": [_run(), {k: v for k, v in _run().items() if k != "model"}]}, 1, "model"),
        ({"runs": [{k: v for k, v in _run().items() if k != "steps"}]}, 0, "steps"),
        ({"runs": [_run(steps=[{"step": 0, "skipped": False}])]}, 0, "steps[0].loss"),
        (
            {"runs": [_run(steps=[{"step": 0, "loss": "abc", "skipped": False}])]},
            0,
            "steps[0].loss",
        ),
        ({"runs": [_run(steps=[{"step": 0, "loss": True}])]}, 0, "steps[0].loss"),
        ({"runs": [_run(framework="tf")]}, 0, "framework"),
        ({"runs": [_run(summary=[])]}, 0, "summary"),
        ({"runs": [_run(summary={"final_loss": "x"})]}, 0, "summary.final_loss"),
        ({"runs": [_run(status="weird")]}, 0, "status"),
        ({"runs": [_run(status="unsupported")]}, 0, "reason"),
    ],
)
def test_schema_errors_name_file_run_and_field(tmp_path, data, run_index, field):
    _write(tmp_path, data)
    with pytest.raises(ResultsFileError) as info:
        load_results(tmp_path)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.run_index == run_index and error.field == field
    assert str(tmp_path / "results.json") in str(error)
    assert f"run {run_index}" in str(error) and repr(field) in str(error)


@pytest.mark.parametrize("text", ["{not json", '{"runs": 3}', "[]", '"x"'])
def test_file_level_errors_name_the_file(tmp_path, text):
    (tmp_path / "results.json").write_text(text)
    with pytest.raises(ResultsFileError, match="results.json") as info:
        load_results(tmp_path)
    assert info.value.run_index is None


def test_valid_file_loads_and_missing_file_is_empty(tmp_path):
    assert load_results(tmp_path) == {"runs": []}
    _write(tmp_path, {"runs": [_run(), _run("jax")]})
    assert len(load_results(tmp_path)["runs"]) == 2


def test_merge_replaces_same_key_keeps_seeds_and_variants_apart(tmp_path):
    merge_runs(tmp_path, [_run(), _run("jax")])
    merge_runs(tmp_path, [_run(summary={"final_loss": 9.0})])  # same key: replaced
    merge_runs(tmp_path, [_run(seed=1), _run(variant="noise")])  # new keys: added
    runs = load_results(tmp_path)["runs"]
    assert len(runs) == 4
    assert [
        r["summary"]["final_loss"] for r in runs if records.run_key(r) == records.run_key(_run())
    ] == [9.0]
    assert records.run_label(_run(variant="noise")) == "torch~noise"


def test_runs_on_other_data_live_beside_each_other(tmp_path):
    digits = RunConfig(model="mlp", data="digits")
    merge_runs(tmp_path, [_run("jax"), _run("jax", config=digits.to_dict())])
    assert len(load_results(tmp_path)["runs"]) == 2  # --data digits did not replace synthetic
    merge_runs(tmp_path, [_run("jax", config=digits.to_dict(), summary={"final_loss": 9.0})])
    runs = load_results(tmp_path)["runs"]
    assert sorted(r["summary"]["final_loss"] for r in runs) == [2.1, 9.0]
    # a matrix resumes by config_run_key: it must match the key of the record the config writes
    keys = {records.run_key(r) for r in runs}
    assert records.config_run_key("jax", digits) in keys
    assert records.config_run_key("jax", RunConfig(model="mlp")) in keys


def test_merge_refuses_an_invalid_run_and_leaves_the_file(tmp_path):
    merge_runs(tmp_path, [_run()])
    before = (tmp_path / "results.json").read_bytes()
    with pytest.raises(ResultsFileError, match="steps"):
        merge_runs(tmp_path, [_run(steps="nope")])
    assert (tmp_path / "results.json").read_bytes() == before


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_atomic_writes_respect_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        json_path = records.write_json_atomic(tmp_path / "a.json", {"x": float("inf")})
        text_path = records.write_text_atomic(tmp_path / "b.md", "hi")
        reference = tmp_path / "c.txt"
        with open(reference, "w") as handle:
            handle.write("x")
    finally:
        os.umask(old)
    expected = stat.S_IMODE(reference.stat().st_mode)
    assert expected == 0o666 & ~umask
    for path in (json_path, text_path):
        assert stat.S_IMODE(path.stat().st_mode) == expected
    assert json.loads(json_path.read_text()) == {"x": None}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_built_records_validate_and_carry_hardware_and_policy():
    config = RunConfig(model="mlp", precision="bf16-mixed", steps=2)
    error = records.build_error_record("jax", config, RuntimeError("boom"))
    validate_run(error)
    assert error["status"] == "error" and error["summary"]["error"] == "RuntimeError: boom"
    assert error["policy"] == "p=f32,c=bf16,o=f32" and isinstance(error["hardware"], dict)
    unsupported = records.build_unsupported_record("torch", config, "no bf16 LSTM kernel here")
    validate_run(unsupported)
    assert unsupported["status"] == "unsupported" and unsupported["torch_mode"] == "eager"
    with pytest.raises(ValueError, match="reason"):
        records.build_unsupported_record("torch", config, "")
    with pytest.raises(ValueError, match="framework"):
        records.build_error_record("tensorflow", config, RuntimeError("x"))


def test_config_carries_a_policy_and_round_trips():
    import jaxamp

    config = RunConfig(precision="fp16-mixed", data_seed=3)
    assert isinstance(config.policy, jaxamp.Policy)
    assert config.compute_dtype == "float16" and config.loss_scaling and config.mixed
    assert RunConfig(precision="bf16-true").param_dtype == "bfloat16"
    assert RunConfig().full_precision and not RunConfig().mixed
    assert config.stream_seed == 3 and RunConfig(seed=5).stream_seed == 5
    assert RunConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="bf16-mixed"):
        RunConfig(precision="bf16-mixd")


# --- rows stored before rows had kinds ------------------------------------------------------------

# A real record pair saved before rows carried their check kinds (the README's main job, transformer
# fp32, on CPU; trimmed to 12 steps, eval logits left out): its step-0 rows have no kind, and those
# built without a mode have none.
OLD_RECORDS = Path(__file__).resolve().parents[2] / "tests" / "data" / "old_run_records.json"


def _old(tmp_path, change=None):
    data = json.loads(OLD_RECORDS.read_text())
    assert all(not row.get("kind") for r in data["runs"] for row in r["step0"]["verdicts"])
    if change:
        change(data["runs"][0])
    _write(tmp_path, data)
    return data


def test_rows_stored_without_kinds_are_read_with_them(tmp_path):
    from parity.verdicts.checks import CHECKS
    from parity.verdicts.judge import compare_runs
    from parity.verdicts.rows import PADDING_CHECK

    stored = _old(tmp_path)
    runs = load_results(tmp_path)["runs"]
    rows = [row for r in runs for row in r["step0"]["verdicts"]]
    assert {row["kind"] for row in rows} == {
        "step 0 output", "step 0 gradients", "stochastic", "layer probe"
    }  # fmt: skip
    assert all(row["mode"] in ("step 0", "inconclusive") for row in rows)
    old = {row["check"]: row for r in stored["runs"] for row in r["step0"]["verdicts"]}
    for row in rows:  # nothing else changes
        assert {k: v for k, v in row.items() if k not in ("kind", "mode")} == {
            k: v for k, v in old[row["check"]].items() if k not in ("kind", "mode")
        }
        assert row["kind"] in CHECKS and old[row["check"]].get("mode") in ("", row["mode"])

    # the judge finds a stored row by its kind: the padding row of such a record, as that version
    # wrote it (label, no kind), makes the trained pair's structural-difference row
    def padding(run):
        run["step0"]["verdicts"].append(
            {
                **run["step0"]["verdicts"][0],
                "check": PADDING_CHECK,
                "compared": "the weight mapping",
                "value": "1 embedding(s)",
                "tolerance": "-",
                "passed": None,
                "mode": "informational",
            }
        )

    saved = _old(tmp_path, padding)
    for runs in (load_results(tmp_path)["runs"], saved["runs"]):  # loaded, or handed over as saved
        verdicts = compare_runs(runs)
        assert [v.kind for v in verdicts if v.check.startswith("structural")] == ["structural"]


def test_a_stored_row_no_version_wrote_is_refused_naming_it(tmp_path):
    def unknown(run):
        run["step0"]["verdicts"][2]["check"] = "step 0 fp32: gradient norms"

    _old(tmp_path, unknown)
    with pytest.raises(ResultsFileError) as e:
        load_results(tmp_path)
    assert e.value.run_index == 0 and e.value.field == "step0.verdicts[2]"
    assert "'step 0 fp32: gradient norms'" in str(e.value)
    assert "closest: 'step 0 P: gradients'" in str(e.value)
