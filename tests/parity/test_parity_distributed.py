"""The distributed runner goes through the one cell pipeline: results.json, verdicts.json and
report.md from `parity.cell.write_outputs`, verdicts from the shared rows and `judge`, and a
planted wrong port fails where the correct one passes.

Tiny MLP, 2 steps, 2 devices, one JAX mode: every worker is owned and ended by PID
(`parity.distributed.procs.WorkerGroup`); each test checks none outlives it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]

from parity.cli import commands as cli  # noqa: E402
from parity.core.config import RunConfig  # noqa: E402
from parity.core.records import comparable_labels, load_results  # noqa: E402
from parity.distributed import DistributedPlan, run_distributed  # noqa: E402
from parity.distributed.procs import live_worker_pids  # noqa: E402
from parity.models import get_model_pair  # noqa: E402
from parity.verdicts.judge import compare_runs  # noqa: E402

TINY = {"image_shape": (4, 4, 3), "hidden": 8}
TINY_ARGS = ["--model-override", "image_shape=[4,4,3]", "--model-override", "hidden=8"]
HERE = str(Path(__file__).resolve().parent)


def transposed_mlp(seed: int):
    """The tiny MLP with a classic porting bug: fc2's square kernel handed over untransposed."""
    pair = get_model_pair("mlp", seed=seed, **TINY)
    to_flax = pair.to_flax

    def wrong(model):
        variables = to_flax(model)
        fc2 = dict(variables["params"]["fc2"])
        fc2["kernel"] = np.asarray(fc2["kernel"]).T
        return {**variables, "params": {**variables["params"], "fc2": fc2}}

    return dataclasses.replace(pair, to_flax=wrong)


def _no_strays(result) -> None:
    pids = [r["pid"] for results in result.ranks.values() for r in results]
    assert all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in pids)
    assert live_worker_pids() == []


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def correct(tmp_path_factory):
    """A correct port through the CLI: bf16-mixed, DDP over 2 ranks against JAX jit on 2 devices
    and 2 JAX processes (no plots: `compare` draws them)."""
    out = tmp_path_factory.mktemp("correct")
    args = ["run", "--model", "mlp", "--precision", "bf16-mixed", "--devices", "2", "--steps"]
    args += ["3", "--batch-size", "4", "--jax-modes", "jit", "multiprocess", "--no-eval"]
    args += ["--no-progress", "--no-plots", "--lr-warmup-steps", "2"]
    args += ["--timeout", "300", "--out", str(out), *TINY_ARGS]
    code = cli.main(args)
    assert live_worker_pids() == []
    return code, out


@pytest.mark.integration
def test_a_distributed_run_writes_the_cell_outputs_and_passes_a_correct_port(correct):
    code, out = correct
    assert code == 0
    for name in ("results.json", "verdicts.json", "report.md", "distributed.json"):
        assert (out / name).exists(), name
    runs = {r["distributed"]: r for r in load_results(out)["runs"]}
    assert set(runs) == {"torch ddp", "jax:jit ddp", "jax:multiprocess ddp"}
    verdicts = json.loads((out / "verdicts.json").read_text())
    assert verdicts["status"] == "PASS"
    rows = verdicts["verdicts"]
    # The shared rows (step 0, the loss, gradient norms) for each JAX mode, and the arm's own.
    for mode in ("jit", "multiprocess"):
        pair = f"jax:{mode} ddp vs torch ddp"
        checks = {v["check"] for v in rows if v["compared"] == pair}
        assert "final loss (mean of last 5)" in checks, checks
        assert any(c.startswith("per-step gradient norm") for c in checks), checks
    assert any(v["mode"] == "step 0" for v in rows)
    arm = {(v["check"], v["compared"]) for v in rows if v["mode"] == "distributed"}
    assert ("replicated params identical across ranks", "torch") in arm
    assert ("gradient reduction dtype", "jax:jit") in arm
    assert ("loss scale and skips identical across ranks", "jax:multiprocess") in arm
    # The workers record the single-device trainers' per-step signals on both sides.
    for run in runs.values():
        for step in run["steps"]:
            assert step["grad_norm"] > 0 and step["update_norm"] > 0
    report = (out / "report.md").read_text()
    assert "jax:jit ddp vs torch ddp" in report
    # One JAX/torch speed figure per JAX mode, in the report's bottom line and distributed.json.
    speed = json.loads((out / "distributed.json").read_text())["speed"]
    assert set(speed) == {"jax:jit ddp vs torch ddp", "jax:multiprocess ddp vs torch ddp"}
    line = next(x for x in report.splitlines() if x.startswith("- **mlp bf16-mixed (cpu)**"))
    assert all(f"{pair}: {text}" in line for pair, text in speed.items()), line
    # --no-plots: report.md without PNGs; `parity compare` judges the folder again to the same
    # status and draws them.
    assert not list(out.glob("*.png"))
    assert cli.main(["compare", str(out)]) == 0
    assert (out / "loss_curves.png").exists()


@pytest.mark.integration
def test_compare_pairs_each_torch_side_with_the_jax_sides_of_its_arm(correct):
    _, out = correct
    runs = load_results(out)["runs"]
    single = [
        {k: v for k, v in r.items() if k not in ("distributed", "arm", "distributed_verdicts")}
        for r in runs
    ]
    both = runs + single
    assert comparable_labels(both) == [
        ("torch", "jax"),
        ("torch ddp", "jax:jit ddp"),
        ("torch ddp", "jax:multiprocess ddp"),
    ]
    compared = {v.compared for v in compare_runs(both) if "vs" in v.compared}
    assert "jax vs torch" in compared and "jax:jit ddp vs torch ddp" in compared
    assert not any("jax:jit ddp vs torch," in c or c == "jax vs torch ddp" for c in compared)


@pytest.mark.integration
def test_a_planted_wrong_port_fails_at_step_0_and_in_training(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    config = RunConfig(model="mlp", precision="fp32", steps=2, batch_size=4, eval=False)
    plan = DistributedPlan(devices=2, strategy="ddp", jax_modes=("jit",), timeout_s=300)
    factory = "test_parity_distributed:transposed_mlp"
    # The gate: a broken port is not trained (no worker starts), and the run fails.
    gated = run_distributed(config, plan, tmp_path / "gate", pair_factory=factory, plots=False)
    assert gated.status == "FAIL" and gated.ranks == {}
    assert any(v.mode == "step 0" and v.passed is False for v in gated.verdicts)
    assert (tmp_path / "gate" / "report.md").exists()
    # Past the gate, the trained trajectories fail the shared per-step rows.
    trained = run_distributed(
        config, plan, tmp_path / "trained", pair_factory=factory, step0_checks=False, plots=False
    )
    assert trained.status == "FAIL"
    failed = {v.check for v in trained.verdicts if v.passed is False}
    assert any(c.startswith("per-step loss") for c in failed), failed
    # Rank agreement holds (each side is consistent with itself): only the port is wrong.
    assert all(v.passed for v in trained.verdicts if v.mode == "distributed")
    assert json.loads((tmp_path / "trained" / "verdicts.json").read_text())["status"] == "FAIL"
    _no_strays(trained)


def test_calibration_with_devices_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "x"
    args = ["run", "--model", "mlp", "--devices", "2", "--noise", "torch", "--out", str(out)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--noise" in err and "one device" in err and "Traceback" not in err
    assert not (out / "results.json").exists()
