"""`parity.perf.phases`: each phase's wall and CPU seconds, nested by path, and the record's schema."""

from __future__ import annotations

import time

import pytest

from parity.core.records import ResultsFileError, validate_run
from parity.perf.phases import clock, current, format_line, phase


def _busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_phases_nest_by_path_add_up_and_keep_the_order_they_began_in():
    with clock() as phases:
        with phase("step 0"):
            with phase("layer probe"):
                _busy(0.02)
        for _ in range(2):
            with phase("calibration"), phase("train jax"):
                _busy(0.01)
    entries = {e["phase"]: e for e in phases.as_records()}
    assert list(entries) == ["step 0", "step 0/layer probe", "calibration", "calibration/train jax"]
    assert entries["step 0"]["cpu_s"] >= entries["step 0/layer probe"]["cpu_s"] >= 0.02
    assert entries["calibration/train jax"]["cpu_s"] >= 0.02  # two intervals, added
    assert all(e["wall_s"] >= 0 for e in entries.values())
    line = format_line(phases.as_records(), total=(1.0, 2.0))
    assert line.startswith("time (wall s / CPU s): step 0 ")
    assert "[layer probe " in line and "[train jax " in line and line.endswith("total 1 / 2")


def test_a_phase_that_raises_is_timed_and_no_clock_costs_nothing():
    assert current() is None
    with phase("alone"):  # no clock open: nothing recorded anywhere
        pass
    with clock() as phases:
        with pytest.raises(RuntimeError), phase("step 0"):
            raise RuntimeError("the time was spent")
        with phase("after"):  # the path was restored
            pass
    assert [e["phase"] for e in phases.as_records()] == ["step 0", "after"]


def test_the_trace_says_which_phase_began_and_what_each_finished_one_cost(monkeypatch, capsys):
    with clock(), phase("step 0"), phase("layer probe"):
        pass
    assert capsys.readouterr().err == ""  # off unless asked for
    monkeypatch.setenv("PARITY_PHASE_TRACE", "1")
    with clock(), phase("step 0"):
        with phase("layer probe"):
            _busy(0.01)
        with pytest.raises(RuntimeError), phase("diagnosis"):
            raise RuntimeError("stopped here")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[phase] step 0: begins"
    assert lines[1] == "[phase] step 0/layer probe: begins"
    assert lines[2].startswith("[phase] step 0/layer probe: ") and "s CPU" in lines[2]
    assert lines[3] == "[phase] step 0/diagnosis: begins"
    assert lines[4].startswith("[phase] step 0/diagnosis: ")  # timed even though it raised
    assert lines[5].startswith("[phase] step 0: ") and len(lines) == 6


@pytest.mark.parametrize(
    "phases, field",
    [
        ([{"phase": "step 0", "wall_s": -1.0, "cpu_s": 0.0}], "phases[0].wall_s"),
        ([{"phase": "step 0", "wall_s": 1.0}], "phases[0].cpu_s"),
        ("step 0", "phases"),
    ],
)
def test_the_schema_names_a_malformed_phase(phases, field):
    run = {"framework": "jax", "model": "mlp", "precision": "fp32", "device": "cpu"}
    run |= {"steps": [], "summary": {"skipped_steps": 0, "steps_completed": 0, "diverged": False}}
    validate_run(run, 0)
    with pytest.raises(ResultsFileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        validate_run(run | {"phases": phases}, 0)
