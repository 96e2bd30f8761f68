"""The replay's step-0 verdict rows: ``step 0 replay: optimizer on identical gradients`` and
``step 0 replay: loss on identical logits``.

They sit beside the model's step-0 rows and gate training as they do: a failing row stops the
run before step 1, naming the parameter, the step and the first quantity that differs.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np
import torch

from parity.replay.gradients import replay_optimizers, torch_sequences
from parity.replay.judge import loss_row, optimizer_row
from parity.replay.layout import Layout
from parity.replay.losses import compare_losses, torch_loss_values
from parity.replay.optimizers import replay_threads
from parity.replay.record import TorchReplay
from parity.training.user_loop import TrainingLoop
from parity.verdicts.rows import Verdict

__all__ = [
    "attach_replay",
    "record_replay",
    "replay_gate",
    "replay_status",
    "replay_verdicts",
]


def _logits(pair: Any, batch: Any, steps: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    import copy

    model = copy.deepcopy(pair.torch_model).float().cpu()
    xs, ys = [], []
    with torch.no_grad(), replay_threads(model):
        for k in range(steps):
            inputs, targets = batch(k)
            logits = pair.torch_forward(model, torch.as_tensor(inputs), train=True)
            xs.append(logits.float().numpy())
            ys.append(np.asarray(targets))
    return xs, ys


def replay_verdicts(
    pair: Any,
    config: Any,
    batch: Any,
    loop: TrainingLoop,
    *,
    steps: int = 4,
    jit: bool = True,
) -> tuple[list[Verdict], dict[str, Any]]:
    """The replay rows of a user's loop, and what goes into the run record.

    Args:
      pair: the model pair; config: the run's `RunConfig`; batch: ``k -> (inputs, targets)``.
      loop: the user's `TrainingLoop` (optimizer rows when it has optimizers, loss rows when it
        has losses).
      steps: real batches replayed (at most the run's steps).
      jit: the JAX optimizer step under ``jax.jit``.

    Returns:
      ``(rows, record)``: record ``{"seconds", "optimizer": {...}, "loss": {...}}``.
    """
    base = {"model": config.model, "precision": config.precision, "device": config.device}
    steps = max(1, min(steps, config.steps))
    rows, record = [], {}
    start = time.perf_counter()
    if loop.has_optimizer:
        result = replay_optimizers(pair, loop, config, batch, steps=steps, jit=jit)
        row, record["optimizer"] = optimizer_row(result, **base)
        rows.append(row)
    if loop.has_loss:
        xs, ys = _logits(pair, batch, steps)
        with replay_threads(pair.torch_model):  # torch's loss on each case: small ops
            values = torch_loss_values(pair.task, loop.torch_loss, xs, ys)
        finding, cases = compare_losses(pair.task, values, loop.jax_loss, xs, ys, jit=jit)
        row, record["loss"] = loss_row(finding, cases, **base)
        rows.append(row)
    record["seconds"] = time.perf_counter() - start
    return rows, record


def record_replay(pair: Any, config: Any, batch: Any, loop: TrainingLoop) -> TorchReplay:
    """torch's side of the replay of the user's torch loop, for a golden file
    (`parity.replay.record`): every gradient sequence's torch steps and the gradients fed, and
    the torch loss on its logits' cases; ``loop.replay_steps`` real batches (at most the run's
    steps)."""
    steps = max(1, min(loop.replay_steps, config.steps))
    layout = Layout(pair)
    sequences = None
    if loop.torch_optimizer is not None:
        sequences = torch_sequences(pair, loop, config, batch, steps=steps, layout=layout)
    loss = None
    if loop.torch_loss is not None:
        xs, ys = _logits(pair, batch, steps)
        with replay_threads(pair.torch_model):
            loss = (xs, ys, torch_loss_values(pair.task, loop.torch_loss, xs, ys))
    return TorchReplay(pair.task, layout.owners, sequences, loss)


def replay_status(rows: list[Verdict]) -> str:
    """The replay's own status (no trajectory to wait for): FAIL when a row failed, PASS when
    every row passed, INCONCLUSIVE otherwise (a loss row that agrees on this data only).

    Example:
      >>> row = Verdict("m", "fp32", "cpu", "step 0 replay: ...", "", "agree", "", True)
      >>> replay_status([row]), replay_status([row, dataclasses.replace(row, passed=None)])
      ('PASS', 'INCONCLUSIVE')
    """
    if any(v.passed is False for v in rows):
        return "FAIL"
    return "PASS" if all(v.passed for v in rows) else "INCONCLUSIVE"


def replay_gate(step0: Any, config: Any, pair: Any, stream: Any, *, echo: bool = False):
    """`replay_verdicts` of ``pair.loop`` added to a passing step-0 result (a failing row fails
    it: training does not start). Returns ``(step0 result, replay record)``."""
    loop = pair.loop
    rows, record = replay_verdicts(
        pair, config, stream.batch, loop, steps=loop.replay_steps, jit=loop.replay_jit
    )
    verdicts = list(step0.verdicts) + rows
    passed = step0.passed and not any(v.passed is False for v in rows)
    if echo:
        for row in rows:
            outcome = "pass" if row.passed else f"FAILED: {row.detail.split('; sequences')[0]}"
            print(f"{config.model} {config.precision}: {row.check}: {outcome}", file=sys.stderr)
    return dataclasses.replace(step0, verdicts=verdicts, passed=passed), record


def attach_replay(
    runs: list[dict[str, Any]], record: dict[str, Any] | None, loop: Any = None
) -> list[dict[str, Any]]:
    """Stores the replay record under ``"replay"`` and the user's loop (``training_loop``: what
    it was) in every run record (the replay's cost is its ``replay`` phase, `parity.perf.phases`)."""
    for run in runs if loop is not None else ():
        run["training_loop"] = loop.describe()
    if record is not None:
        for run in runs:
            run["replay"] = record
    return runs
