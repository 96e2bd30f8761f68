"""Named sizes of the built-in models: ``--size gpt2-small`` is GPT-2 small's shape (86.2 M
parameters with a byte vocabulary), resolved alike by the command line and the matrix, refused
with the sizes a model has; one training step through the command line at a reduced depth and
context (the full 12 layers compile for ~40 CPU s: benchmarks/bench_harness_cost.py runs them)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from parity.cli import commands as cli  # noqa: E402
from parity.core.records import load_results  # noqa: E402
from parity.models import get_model_pair, model_sizes, size_overrides  # noqa: E402

pytestmark = [pytest.mark.standard_promotion, pytest.mark.torch]

GPT2_SMALL = {"seq_len": 1024, "d_model": 768, "num_heads": 12, "num_layers": 12, "mlp_ratio": 4}


def test_gpt2_small_is_gpt2_smalls_shape_with_its_parameter_count():
    assert {k: model_sizes("transformer")["gpt2-small"][k] for k in GPT2_SMALL} == GPT2_SMALL
    pair = get_model_pair("transformer", **size_overrides("transformer", "gpt2-small"))
    assert pair.num_params() == 86_235_904  # the figure the size's documentation states
    blocks = sum(p.numel() for p in pair.torch_model.blocks.parameters())
    assert blocks == 85_054_464


def test_the_command_line_and_the_matrix_resolve_a_size_and_refuse_a_wrong_one(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(
        ["run", "--model", "transformer", "--size", "gpt2-small", "--out", "x"]
        + ["--model-override", "seq_len=32"]
    )
    config = cli._config_from_args(args, "transformer", "fp32")
    assert config.model_overrides == {**model_sizes("transformer")["gpt2-small"], "seq_len": 32}
    args = parser.parse_args(["matrix", "--models", "transformer", "--size", "gpt2-small"])
    assert cli._config_from_args(args, "transformer", "fp32").model_overrides["num_layers"] == 12
    assert cli.main(["run", "--model", "transformer", "--size", "gpt2-smal", "--out", "x"]) == 2
    assert "did you mean 'gpt2-small'" in capsys.readouterr().err
    assert cli.main(["run", "--model", "mlp", "--size", "gpt2-small", "--out", "x"]) == 2
    assert "model 'mlp' has no size of that name (its sizes: none)" in capsys.readouterr().err


@pytest.mark.integration
def test_one_step_of_the_gpt2_small_width_through_the_command_line(tmp_path):
    out = tmp_path / "gpt2"
    args = ["run", "--model", "transformer", "--size", "gpt2-small", "--steps", "1"]
    args += ["--model-override", "seq_len=8", "--model-override", "num_layers=1"]
    args += ["--batch-size", "2", "--no-eval", "--speed-blocks", "0", "--no-plots"]
    assert cli.main([*args, "--no-progress", "--out", str(out)]) == 0
    runs = load_results(out)["runs"]
    assert {r["framework"] for r in runs} == {"torch", "jax"}
    for run in runs:
        assert run["model_config"]["d_model"] == 768 and run["model_config"]["num_heads"] == 12
        assert run["step0"]["passed"] and len(run["steps"]) == 1
    assert "Not drawn (`--no-plots`)" in (out / "report.md").read_text()
    assert not list(out.glob("*.png"))
