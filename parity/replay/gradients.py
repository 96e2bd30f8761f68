"""The gradient sequences of the optimizer replay, and the replay itself.

Each sequence starts from the pair's weights and fresh optimizer states on both sides:

- ``real``: the torch model's own gradients on the run's first K batches, along torch's
  trajectory (the loop the user wrote: their loss, clipping, scheduler);
- ``tiny``: batch 0's gradient scaled to a largest element of 1e-8 (Adam's epsilon is then as
  large as the root of the second moment: where epsilon sits decides the update);
- ``extremes``: batch 0's gradient, then it times 1e4 (clipping bites), then zeros twice (the second
  moment falls: AMSGrad keeps its maximum; weight decay still acts), then batch 0's again;
- ``non-finite`` (only where the run scales the loss): batch 0's, one with an inf element (both
  sides must skip it and back the scale off, the step count must not move), batch 0's again.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from parity.core.losses import loss_torch
from parity.replay.jax_side import SideStep, jax_stepper
from parity.replay.judge import SCENARIOS, ReplayResult, judge_sequences
from parity.replay.layout import Layout
from parity.replay.optimizers import replay_threads, torch_replay
from parity.training.user_loop import TrainingLoop

__all__ = ["replay_optimizers", "torch_sequences"]

TINY = 1e-8
LARGE = 1e4


def _sequences(g0: dict[str, torch.Tensor], scaled: bool) -> dict[str, list]:
    largest = max(float(g.abs().max()) for g in g0.values()) or 1.0
    tiny = {n: g * (TINY / largest) for n, g in g0.items()}
    zeros = {n: torch.zeros_like(g) for n, g in g0.items()}
    out = {
        "tiny": [tiny, tiny],
        "extremes": [g0, {n: g * LARGE for n, g in g0.items()}, zeros, zeros, g0],
    }
    if scaled:
        bad = {n: g.clone() for n, g in g0.items()}
        first = next(iter(bad))
        bad[first].view(-1)[0] = float("inf")
        out["non-finite"] = [g0, bad, g0]
    return out


def torch_sequences(
    pair: Any,
    loop: TrainingLoop,
    config: Any,
    batch: Any,
    *,
    steps: int = 4,
    scenarios: tuple[str, ...] | None = None,
    layout: Layout | None = None,
) -> dict[str, tuple[list[SideStep], list[dict[str, np.ndarray]]]]:
    """torch's side of every gradient sequence: ``{scenario: (torch's steps, the gradients
    it was fed, unscaled, in the Flax layout)}`` (what the JAX side is then fed); arguments as
    `replay_optimizers`."""
    with replay_threads(pair.torch_model):
        layout = layout or Layout(pair)
        loss_fn = loop.torch_loss or (lambda logits, y: loss_torch(pair.task, logits, y))
        scaled = bool(config.recipe.loss_scaling)
        wanted = scenarios or SCENARIOS
        out = {}
        t_steps, given = torch_replay(
            pair, loop, config, list(range(steps)), layout, loss_fn=loss_fn, batch=batch
        )
        if "real" in wanted:
            out["real"] = (t_steps, [layout.to_flax(g) for g in given])
        for name, sequence in _sequences(given[0], scaled).items():
            if name in wanted:
                t_other, given_other = torch_replay(
                    pair, loop, config, sequence, layout, loss_fn=loss_fn, batch=batch
                )
                out[name] = (t_other, [layout.to_flax(g) for g in given_other])
    return out


def replay_optimizers(
    pair: Any,
    loop: TrainingLoop,
    config: Any,
    batch: Any,
    *,
    steps: int = 4,
    jit: bool = True,
    scenarios: tuple[str, ...] | None = None,
) -> ReplayResult:
    """Both optimizers on the same gradient sequences; see the module docstring.

    Args:
      pair: the `parity.models.ModelPair` (its weights are the start; its mapping pairs leaves).
      loop: the user's `TrainingLoop` (its optimizers; its torch loss makes the real gradients).
      config: the run's `RunConfig` (its recipe decides loss scaling; replays run in float32).
      batch: ``k -> (inputs, targets)``.
      steps: K, the real batches replayed.
      jit: run the JAX step under ``jax.jit`` (as training does) or eagerly.
      scenarios: a subset of ``("real", "tiny", "extremes", "non-finite")`` (default: all).

    Example::

        result = replay_optimizers(pair, loop, RunConfig(), stream.batch)
        if not result.passed:
            print(result.first.message)  # e.g. "lr at step 0: torch 0 (warm-up), JAX 0.005; ..."
    """
    start = time.perf_counter()
    layout = Layout(pair)
    sequences = torch_sequences(
        pair, loop, config, batch, steps=steps, scenarios=scenarios, layout=layout
    )
    stepper = jax_stepper(pair, loop, config, jit=jit)
    return judge_sequences(sequences, stepper, layout, start=start)
