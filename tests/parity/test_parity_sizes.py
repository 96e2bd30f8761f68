"""Named sizes of the built-in models: ``--size gpt2-small`` is GPT-2 small's shape (86.2 M
parameters with a byte vocabulary), resolved alike by the command line and the matrix, refused
with the sizes a model has; one training step through the command line at a reduced depth and
context is the GPU check's dry cell (tests/parity/test_gpu_check.py checks it; the full 12 layers
compile for ~40 CPU s: benchmarks/bench_harness_cost.py runs them)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from parity.cli import commands as cli  # noqa: E402
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


# One training step of the gpt2-small width through `python -m parity run` (reduced depth and
# context): the GPU check's dry mode runs that very cell on CPU, and
# tests/parity/test_gpu_check.py checks its outputs (both frameworks, GPT-2 small's width, step 0
# passed, one step, no plots).
