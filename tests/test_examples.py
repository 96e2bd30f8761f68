"""One fast smoke test per example: a few steps at small sizes, through each main.py's flags."""

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # examples/ is a folder of scripts, not an installed package


def _check_outputs(workdir: Path, loss_keys: tuple[str, ...], precision: str) -> dict:
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert (workdir / "loss.png").stat().st_size > 0
    assert metrics["precision"] == precision
    assert metrics["steps"], "no steps recorded"
    for step in metrics["steps"]:
        for key in loss_keys:
            assert step[key] is not None and math.isfinite(step[key]), (key, step)
    assert not list(workdir.glob("*.tmp"))  # atomic write left nothing behind
    return metrics


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.standard_promotion  # optax's adamw computes float ** int32
def test_image_classifier(tmp_path, capsys):
    from examples.image_classifier import main

    main.main(
        [
            "--workdir", str(tmp_path), "--precision", "fp16-mixed", "--num_steps", "3",
            "--batch_size", "8", "--eval_every", "3", "--image_size", "8", "--widths", "8",
            "--no_progress",
        ]
    )  # fmt: skip
    metrics = _check_outputs(tmp_path, ("loss",), "fp16-mixed")
    assert metrics["policy"] == "p=f32,c=f16,o=f32"
    assert len(metrics["eval"]) == 1 and 0.0 <= metrics["summary"]["eval_accuracy"] <= 1.0
    assert "eval_accuracy" in capsys.readouterr().out


def test_image_classifier_needs_data_dir(tmp_path):
    from examples.image_classifier import config as config_lib
    from examples.image_classifier import train

    with pytest.raises(ValueError, match="data_dir"):
        train.make_data(config_lib.get_config(dataset="fashion_mnist"))
    with pytest.raises(ValueError, match="dataset"):
        train.make_data(config_lib.get_config(dataset="mnist"))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.standard_promotion
def test_transformer_lm(tmp_path):
    from examples.transformer_lm import main

    main.main(
        [
            "--workdir", str(tmp_path), "--precision", "bf16-mixed", "--num_steps", "3",
            "--batch_size", "4", "--seq_len", "16", "--d_model", "32", "--num_layers", "1",
            "--vocab_size", "64", "--eval_every", "3", "--no_progress",
        ]
    )  # fmt: skip
    metrics = _check_outputs(tmp_path, ("loss",), "bf16-mixed")
    assert metrics["module_policies"]["blocks/0/norm1"] == "p=f32,c=f32,o=bf16"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.standard_promotion
def test_torch_port(tmp_path):
    pytest.importorskip("torch")
    from examples.torch_port import main

    main.main(
        [
            "--workdir", str(tmp_path), "--precision", "bf16-mixed", "--num_steps", "3",
            "--batch_size", "8", "--image_size", "8", "--hidden", "16", "--no_progress",
        ]
    )  # fmt: skip
    metrics = _check_outputs(tmp_path, ("loss_jax", "loss_torch"), "bf16-mixed")
    check = metrics["forward_check"]
    assert check["fp32_verdict"] == "ok" and check["policy_verdict"] == "ok"


def test_bad_precision_is_rejected(tmp_path):
    from examples.image_classifier import main

    with pytest.raises(ValueError, match="Valid specs"):
        main.main(["--workdir", str(tmp_path), "--precision", "fp12", "--num_steps", "1"])
