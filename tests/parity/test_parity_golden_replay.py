"""A golden file exported with the user's torch loop holds torch's side of the replay; the check
replays the user's optax port and JAX loss against it without torch, with the same rows and
named findings as `compare_models`. Imports no torch (the torch-free CI stage runs this file).

The golden: ``python -m examples.training_loop.export_golden`` (run it again when the golden
format changes).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.training_loop import SMOOTHING, jax_loop
from parity.golden.check import check_golden, flax_pair
from parity.golden.format import HEADER_KEY, GoldenFileError, load_golden
from parity.replay.record import judge_recorded
from parity.training.user_loop import TrainingLoop
from parity.verdicts.checks import CHECKS

pytestmark = pytest.mark.standard_promotion  # the example's optax schedule mixes int and float

GOLDEN = Path(__file__).resolve().parents[2] / "examples" / "training_loop" / "loop.golden.npz"


@pytest.fixture(scope="module")
def golden():
    return load_golden(GOLDEN)


def summed_loss(logits, targets):
    onehot = optax.smooth_labels(jax.nn.one_hot(targets, logits.shape[-1]), SMOOTHING)
    return jnp.sum(optax.softmax_cross_entropy(logits.astype(jnp.float32), onehot))


# name -> (optax port, JAX loss, (optimizer row passed, loss row passed), words in the details)
PORTS = {
    "the port": (jax_loop.optimizer, jax_loop.loss, (True, True), []),
    "weight decay on every tensor": (
        jax_loop.forgot_the_mask,
        jax_loop.loss,
        (False, True),
        ["weight decay applied to", "norm/scale", "on the JAX side only"],
    ),
    "a summed loss": (
        jax_loop.optimizer,
        summed_loss,
        (True, False),
        ["sum vs mean: ratio 8 = tokens per batch"],
    ),
}


@pytest.mark.parametrize("name", list(PORTS))
def test_recorded_replay_judges_the_port(golden, name):
    optimizer, loss, passed, words = PORTS[name]
    loop = TrainingLoop(jax_optimizer=optimizer(), jax_loss=loss, sides="jax")
    pair = flax_pair(golden)
    rows, record = judge_recorded(
        golden.replay, pair, loop, golden.config, golden.variables()["params"]
    )
    assert [r.check for r in rows] == [
        "step 0 replay: optimizer on identical gradients",
        "step 0 replay: loss on identical logits",
    ]
    # rows of the check table (their kind decides their power bound), not labels only
    assert [CHECKS[r.kind].kind for r in rows] == ["replay optimizer", "replay loss"]
    assert tuple(r.passed for r in rows) == passed, [r.detail for r in rows]
    details = " ".join(r.detail for r in rows)
    for word in words:
        assert word in details, details
    assert set(record["optimizer"]["findings"]) == {"real", "tiny", "extremes"}


@pytest.mark.integration
def test_check_golden_gates_training_on_the_recorded_replay(golden):
    """The port passes the whole check; the port without the mask fails at the replay rows,
    before training (as in compare_models)."""
    result = check_golden(golden, jax_optimizer=jax_loop.optimizer(), jax_loss=jax_loop.loss)
    assert result.status == "PASS", result.report()
    assert any(v.check.startswith("step 0 replay") and v.passed for v in result.verdicts)
    bad = check_golden(golden, jax_optimizer=jax_loop.forgot_the_mask(), jax_loss=jax_loop.loss)
    assert bad.status == "FAIL"
    row = next(v for v in bad.verdicts if v.check.startswith("step 0 replay: optimizer"))
    assert row.passed is False and "norm/scale" in row.detail
    assert not bad.runs[1]["steps"], "trained past a failing replay"


def _rewrite(tmp_path: Path, change) -> Path:
    with np.load(GOLDEN, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    header = json.loads(arrays[HEADER_KEY].tobytes().decode("utf-8"))
    change(header["replay"], arrays)
    arrays[HEADER_KEY] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    out = tmp_path / "damaged.npz"
    out.write_bytes(buffer.getvalue())
    return out


def _drop_an_array(replay, arrays):
    del arrays[next(k for k in arrays if k.startswith("replay/opt/real/1/"))]


def _shorten_a_shape(replay, arrays):
    replay["shapes"]["fc1/kernel"] = [1, 1]


@pytest.mark.parametrize("change", [_drop_an_array, _shorten_a_shape])
def test_a_damaged_replay_record_is_refused_naming_the_field(tmp_path, change):
    with pytest.raises(GoldenFileError, match="field 'replay': the replay's record is malformed"):
        load_golden(_rewrite(tmp_path, change))


def test_check_command_refuses_bad_references_and_a_missing_port(capsys):
    """``python -m parity check --jax-optimizer/--jax-loss``: a misspelled name is refused
    before any work, naming the closest; a golden recorded with your torch loop, checked
    without your JAX port, is refused naming the option to pass."""
    from parity.golden.check import main

    port = "examples.training_loop.jax_loop"
    assert main(["--golden", str(GOLDEN), "--jax-optimizer", f"{port}:optimiser"]) == 2
    err = capsys.readouterr().err
    assert "--jax-optimizer" in err and "did you mean 'optimizer'?" in err, err
    assert main(["--golden", str(GOLDEN), "--jax-optimizer", f"{port}:optimizer"]) == 2
    err = capsys.readouterr().err
    assert "pass its JAX port as --jax-loss" in err, err


@pytest.mark.integration
def test_check_command_replays_the_port_without_torch(capsys):
    from parity.golden.check import main

    port = "examples.training_loop.jax_loop"
    argv = ["--golden", str(GOLDEN), "--jax-loss", f"{port}:loss", "--no-progress"]
    assert main([*argv, "--jax-optimizer", f"{port}:forgot_the_mask"]) == 1
    out = capsys.readouterr().out
    assert "step 0 replay: optimizer on identical gradients" in out and "norm/scale" in out, out
