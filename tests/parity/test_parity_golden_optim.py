"""A low-bit AdamW precision through a golden file: the export records torchao's optimizer step
from torch's step-0 gradients (each quantized moment's codes and scales, the weights after the
step) and the JAX state's block order; the check, without torch, runs jaxamp's step and judges
it with the rows `compare_models` runs (`parity.verdicts.optim_judge`), and trains with the
recorded block order."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchao.optim")

from test_parity_golden import _env, _run  # noqa: E402

from parity.cell import builtin_pair  # noqa: E402
from parity.core.config import RunConfig  # noqa: E402
from parity.golden.check import check_pair, flax_pair  # noqa: E402
from parity.golden.export import export_golden  # noqa: E402
from parity.golden.format import load_golden  # noqa: E402
from parity.verdicts.optim_step0 import optimizer_state_verdicts  # noqa: E402

pytestmark = [
    pytest.mark.integration,  # exports (trains torch) and checks (trains JAX)
    pytest.mark.filterwarnings("ignore::UserWarning"),  # torchao's caching hint
]

# fc1 and fc2 hold 4096 elements each: torchao quantizes both (smaller tensors stay float32)
CONFIG = RunConfig(
    model="mlp",
    precision="adamw-4bit",
    steps=2,
    batch_size=4,
    eval=False,
    model_overrides={"image_shape": (8, 8, 1), "hidden": 64},
)
CODES = "step 0 adamw-4bit: optimizer state codes and scales"
WEIGHTS = "step 0 adamw-4bit: weights after one optimizer step"


@pytest.fixture(scope="module")
def golden_path(tmp_path_factory):
    return export_golden(tmp_path_factory.mktemp("golden") / "mlp-4bit.npz", CONFIG)


def test_the_check_judges_the_recorded_optimizer_step_as_compare_models_does(golden_path):
    """Checked without torch (the command line, torch hidden): the same rows, to the digit, as
    the harness computes with torch and torchao at hand."""
    out = golden_path.parent / "verdicts.json"
    args = ["-m", "parity", "check", "--golden", str(golden_path), "--no-progress", "--json"]
    done = _run([*args, str(out)], _env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    rows = {v["check"]: v for v in json.loads(out.read_text())["verdicts"]}
    golden = load_golden(golden_path)
    harness = optimizer_state_verdicts(builtin_pair(CONFIG), CONFIG, *golden.batch(0))
    assert [rows[v.check] for v in harness] == [
        json.loads(json.dumps(v.to_dict())) for v in harness
    ]
    assert rows[CODES]["value"] == "0/4 moments off"
    assert "fc1.weight, fc2.weight" in rows[CODES]["detail"]


def test_a_state_blocked_in_the_flax_layout_fails_the_golden_check_at_step0(golden_path):
    golden = load_golden(golden_path)
    pair = dataclasses.replace(flax_pair(golden), block_order={})  # no order: the Flax layout
    result = check_pair(golden, pair)
    assert result.status == "FAIL"
    failed = [v for v in result.verdicts if v.passed is False]
    assert failed[0].check == CODES and failed[0].value == "4/4 moments off", failed
    assert not result.runs[1]["steps"]  # stopped at step 0, as the harness stops the run
