"""Records the torch loop's side once: ``python -m examples.training_loop.export_golden`` (needs
torch).

Writes ``examples/training_loop/loop.golden.npz``: `examples.parity_ci`'s model (8 wide) trained
by `torch_loop` (AdamW with two param groups, LambdaLR warm-up and cosine, clipping, label
smoothing), with torch's side of the replay: its steps on every gradient sequence and its loss on
the logits' cases. A CI job without torch then checks `jax_loop` against it:
``check_golden(GOLDEN, jax_optimizer=jax_loop.optimizer(), jax_loss=jax_loop.loss)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from examples.parity_ci.data import make_batches
from examples.parity_ci.torch_model import TorchNet
from examples.training_loop import CLIP, HIDDEN, STEPS, torch_loop
from parity.golden.export import export_models

GOLDEN = Path(__file__).with_name("loop.golden.npz")
REPLAY_STEPS = 2


def main() -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TorchNet(hidden=HIDDEN)
    return export_models(
        GOLDEN,
        model,
        "examples.training_loop:flax_port",
        make_batches(STEPS),
        name="training_loop_port",
        torch_optimizer=torch_loop.optimizer,
        torch_scheduler=torch_loop.scheduler,
        torch_clip=CLIP,
        torch_loss=torch_loop.loss,
        replay_steps=REPLAY_STEPS,
        eval=False,
    )


if __name__ == "__main__":
    print(main())
