"""``python -m parity replay``: a training loop named on the command line, replayed; bad input
refused before any work, in one line naming the option, the value, what it takes and the
closest valid name."""

from __future__ import annotations

import json

import pytest

from parity.cli.commands import main

pytestmark = pytest.mark.standard_promotion  # the example's optax schedule mixes int and float

LOOP = "examples.training_loop"
OWN_PAIR = [
    "--torch-model",
    "examples.parity_ci.torch_model:reference",
    "--flax-model",
    "examples.parity_ci.flax_model:FlaxNet",
    "--batches",
    f"{LOOP}:batches",
]
TORCH = [
    "--torch-optimizer",
    f"{LOOP}.torch_loop:optimizer",
    "--torch-scheduler",
    f"{LOOP}.torch_loop:scheduler",
    "--torch-clip",
    "1.0",
]


def replay(*argv: str) -> int:
    return main(["replay", *argv])


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--model", "mlp", *TORCH, "--jax-optimizer", f"{LOOP}.jax_loop:optimiser"],
            ["--jax-optimizer", "'optimiser'", "did you mean 'optimizer'?"],
        ),
        (
            ["--model", "mlp", *TORCH, "--jax-optimizer", f"{LOOP}.jax_loop:loss"],
            ["--jax-optimizer", "gives a function", "optax.GradientTransformation"],
        ),
        (
            ["--model", "mlp", *TORCH, "--jax-optimizer", f"{LOOP}.jax_loops:optimizer"],
            ["--jax-optimizer", "'examples.training_loop.jax_loops'", "does not import"],
        ),
        (
            ["--model", "mlp", *TORCH, "--jax-optimizer", "optimizer"],
            ["--jax-optimizer takes 'package.module:attr'", "got 'optimizer'"],
        ),
        (["--model", "mlp", *TORCH], ["--torch-optimizer was given without --jax-optimizer"]),
        (
            ["--model", "mlp", "--torch-clip", "1.0", "--torch-loss", f"{LOOP}.torch_loop:loss"],
            ["--torch-loss was given without --jax-loss"],
        ),
        (
            ["--model", "mlp", *TORCH[2:], "--torch-loss", f"{LOOP}.torch_loop:loss"]
            + ["--jax-loss", f"{LOOP}.jax_loop:loss"],
            ["--torch-scheduler needs --torch-optimizer"],
        ),
        (["--model", "mlp"], ["nothing to replay"]),
        (
            ["--model", "mlp", *TORCH, "--jax-optimizer", f"{LOOP}.jax_loop:optimizer"]
            + ["--torch-clip", "-2"],
            ["--torch-clip", "max global norm > 0", "'-2'"],
        ),
        (
            ["--model", "mlp", *TORCH, "--jax-optimizer", f"{LOOP}.jax_loop:optimizer"]
            + ["--precision", "bf16-mixd"],
            ["--precision must be one of", "'bf16-mixd'", "Did you mean 'bf16-mixed'?"],
        ),
        (
            [*OWN_PAIR, "--model", "mlp", *TORCH, "--jax-optimizer", f"{LOOP}.jax_loop:optimizer"],
            ["--model 'mlp' and --torch-model, --flax-model, --batches were both given"],
        ),
        (
            [*OWN_PAIR[:2], *TORCH, "--jax-optimizer", f"{LOOP}.jax_loop:optimizer"],
            ["--flax-model, --batches missing"],
        ),
        (
            [*OWN_PAIR, *TORCH, "--jax-optimizer", f"{LOOP}.jax_loop:optimizer"]
            + [
                "--torch-loss",
                f"{LOOP}.torch_loop:loss",
                "--jax-loss",
                f"{LOOP}.jax_loop:optimizer",
            ],
            ["--jax-loss", "cannot be called with 2 arguments", "(logits, targets) -> loss"],
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_option(argv, words, capsys):
    assert replay(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize(
    "option, value, closest",
    [("--model", "mlpp", "did you mean 'mlp'?"), ("--task", "lmm", "did you mean 'lm'?")],
)
def test_bad_choice_names_the_closest(option, value, closest, capsys):
    with pytest.raises(SystemExit) as exit_info:
        replay(option, value)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be one of" in err and closest in err, err


@pytest.mark.integration
def test_replay_passes_and_fails_from_the_command_line(tmp_path, capsys):
    """A built-in pair with the example's loop and its optax port passes (exit 0); your own
    pair with the port that forgot the mask fails (exit 1), naming the parameter and the side,
    and the JSON keeps the rows and the record."""
    port = ["--jax-optimizer", f"{LOOP}.jax_loop:optimizer"]
    assert replay("--model", "mlp", *TORCH, *port, "--steps", "2") == 0
    out = capsys.readouterr().out
    assert "PASS  step 0 replay: optimizer on identical gradients: agree" in out, out

    naive = ["--jax-optimizer", f"{LOOP}.jax_loop:forgot_the_mask"]
    losses = ["--torch-loss", f"{LOOP}.torch_loop:loss", "--jax-loss", f"{LOOP}.jax_loop:loss"]
    record = tmp_path / "replay.json"
    code = replay(*OWN_PAIR, *TORCH, *naive, *losses, "--steps", "2", "--json", str(record))
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL  step 0 replay: optimizer on identical gradients" in out, out
    assert "weight decay applied to" in out and "norm/scale" in out, out
    assert "on the JAX side only" in out, out
    saved = json.loads(record.read_text())
    assert saved["status"] == "FAIL"
    assert [v["passed"] for v in saved["verdicts"]] == [False, True]
    assert saved["replay"]["optimizer"]["findings"]["real"]["quantity"] == "weight decay"
