"""Records the torch side of a cell into a golden file (`parity.golden.check`); needs torch.

`export_golden` runs what `parity.cell.run_cell` runs on torch's side of a cell - the step-0
numbers at float32 and at the run's precision (`parity.verdicts.torch_side.torch_stage_side`,
under the full-float32 matmul settings of `parity.verdicts.step0`) and torch's training run
(`parity.training.trainers.train_framework`) - and writes them with the initial weights and the
batches through `parity.golden.check.write_golden`. `export_models` does the same for your own torch
module and Flax port (the pair `parity.api.prepare_pair` builds).

Example::

    from parity.golden.export import export_models

    export_models(
        "tests/data/my_port.golden.npz",
        torch_module=MyTorchNet(),
        flax_module="my_package.flax_net:MyFlaxNet",   # what `check` imports, torch-free
        batches=[(x0, y0), (x1, y1), ...],
        precision="bf16-mixed",
    )
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parity.api import prepare_pair, resolve_eval, user_stream
from parity.cell import builtin_pair
from parity.core.config import RunConfig
from parity.golden.check import flax_model_of
from parity.golden.format import write_golden
from parity.replay.rows import record_replay
from parity.training.trainers import train_framework
from parity.training.user_loop import TrainingLoop, run_config_fields
from parity.verdicts.diagnose import module_pairs
from parity.verdicts.layer_probe import probe_torch
from parity.verdicts.optim_step0 import torch_optimizer_step
from parity.verdicts.step0_batch import step0_batch
from parity.verdicts.step0_checks import (
    dropout_verdict,
    folded_verdict,
    padding_rows,
    padding_verdict,
    stochastic_verdict,
)
from parity.verdicts.torch_side import layer_arrays, torch_stage_side

__all__ = ["export_golden", "export_models"]


def _torch_step0(pair: Any, config: RunConfig, inputs, targets) -> tuple[list, dict[str, Any]]:
    """torch's step 0 as `parity.verdicts.step0.check_step0` computes it, recorded: ``(stage,
    precision, loss scale, Side)`` per stage, and the rest (`parity.golden.format.write_golden`'s
    ``step0``): the layer probe's torch side, torch's layer outputs at each stage for the
    diagnosis, the rows only torch computes and, for a low-bit AdamW precision, torchao's
    optimizer step from torch's step-0 gradients with the JAX state's block order."""
    if config.recipe.compute_dtype_name == "float8":
        raise ValueError(
            f"export: precision {config.precision!r} is judged at step 0 by torchao's per-layer "
            "fp8 scales and codes, which a golden file does not hold; export another precision."
        )
    stages = [("fp32", config.replace(precision="fp32"))]
    if not config.recipe.baseline:
        stages.append((config.precision, config))
    previous = torch.get_float32_matmul_precision()
    previous_cudnn_tf32 = torch.backends.cudnn.allow_tf32
    # as parity.verdicts.step0: full float32 on both sides
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        pairs, unmatched = module_pairs(pair, pair.torch_to_flax())
        names = [name for name, _ in pairs]
        sides, layers = [], {}
        for stage, stage_config in stages:
            low = not stage_config.recipe.baseline
            # each mapped layer's outputs kept from the same passes (the diagnosis's torch side)
            side, scale = torch_stage_side(
                pair, inputs, targets, stage_config, trace_flops=low, layers=names
            )
            sides.append((stage, stage_config.precision, scale, side))
            layers[stage] = tuple(layer_arrays(pair, captured) for captured in side.layers)
        try:
            probe, probe_error = probe_torch(pair, inputs), None
        except Exception as e:  # recorded as check_step0 reports it: the probe did not run
            probe, probe_error = None, f"{type(e).__name__}: {str(e)[:300]}"
        optimizer = None
        if getattr(config.recipe, "torchao_class", None):  # a low-bit AdamW state
            try:
                block_order = config.recipe.torch_block_order(pair)
            except ValueError as e:  # no mapping to take it from: the run would fail step 0
                raise ValueError(f"export: {e}") from None
            optimizer = (torch_optimizer_step(pair, config, inputs, targets), block_order)
        padding = padding_rows(pair)
        # in check_step0's order; the probe's row goes after the first (the check inserts it)
        torch_rows = [stochastic_verdict(pair, config, inputs)]
        torch_rows += [
            row
            for row in (
                folded_verdict(pair, config),
                padding_verdict(config, padding),
                dropout_verdict(pair, config),
            )
            if row is not None
        ]
    finally:
        torch.backends.cudnn.allow_tf32 = previous_cudnn_tf32
        torch.set_float32_matmul_precision(previous)
    step0 = {
        "probe": probe,
        "probe_error": probe_error,
        "pairs": pairs,
        "unmatched": unmatched,
        "layers": layers,
        "torch_rows": torch_rows,
        "padding": padding,
        "optimizer": optimizer,
    }
    return sides, step0


def export_golden(
    path: str | os.PathLike,
    config: RunConfig,
    *,
    pair: Any = None,
    stream: Any = None,
    flax_model: str | None = None,
    progress: bool = False,
) -> Path:
    """Trains torch's side of a cell and writes its golden file.

    Args:
      path: the ``.npz`` file to write.
      config: the cell (model, precision, steps, batch size, optimizer...).
      pair: the model pair (default: the built-in pair of ``config.model``).
      stream: the batches (default: the pair's data at the run's data seed).
      flax_model: ``"module:attr"`` of the Flax module under test (or a zero-argument factory
        of it), recorded so that ``python -m parity check`` finds it without torch; None for a
        built-in pair (its twin is found by name, which needs torch).
      progress: report progress.

    Returns:
      The written path.

    Raises:
      ValueError: an fp8 precision (its step 0 is per-layer fp8 codes), a low-bit AdamW
        precision for a pair without a weight mapping (the JAX state's block order comes from
        it), a `flax_model` that does not import, or a torch run that did not complete.
    """
    if flax_model is not None:
        flax_model_of(flax_model)  # a reference that is not a model fails here, not in someone's CI
    if pair is None:
        pair = builtin_pair(config)
    if stream is None:
        stream = pair.make_data(config.stream_seed, config.batch_size)
    variables = pair.torch_to_flax()  # before training: the weights both sides start from
    batches = [tuple(np.asarray(b) for b in stream.batch(step)) for step in range(config.steps)]
    eval_batches = (
        [tuple(np.asarray(b) for b in e) for e in stream.eval_batches()] if config.eval else []
    )
    # step 0 compares the batch's first examples where it is large, as check_step0 does
    bounded = step0_batch(pair, variables, *batches[0])
    sides, step0 = _torch_step0(pair, config, bounded.inputs, bounded.targets)
    loop = getattr(pair, "loop", None)
    replay = None
    if loop is not None:  # the user's torch loop on the replay's gradients and logits
        replay = record_replay(pair, config, stream.batch, loop)
    torch_run = train_framework("torch", config, pair, stream, progress=progress)
    if torch_run.get("status") != "completed":
        reason = torch_run.get("reason") or torch_run["summary"].get("error")
        raise ValueError(f"export: torch's run did not complete ({reason}); nothing written.")
    model = {
        "name": pair.name,
        "task": pair.task,
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in dict(pair.config).items()},
        "flax_model": flax_model,
    }
    if getattr(pair, "loop", None) is not None:
        model["training_loop"] = pair.loop.describe()
    return write_golden(
        path,
        config=config,
        model=model,
        torch_run=torch_run,
        variables=variables,
        batches=batches,
        eval_batches=eval_batches,
        sides=sides,
        step0=step0,
        replay=replay,
    )


def export_models(
    path: str | os.PathLike,
    torch_module: Any,
    flax_module: str,
    batches: Any,
    *,
    transfer: Any = None,
    precision: str = "fp32",
    task: str = "classification",
    steps: int | None = None,
    eval_batches: Sequence[tuple[Any, Any]] | None = None,
    name: str = "user_model",
    flax_kwargs: Any = None,
    progress: bool = False,
    torch_optimizer: Any = None,
    torch_scheduler: Any = None,
    torch_clip: Any = None,
    torch_loss: Any = None,
    replay_steps: int = 4,
    **config: Any,
) -> Path:
    """`export_golden` for your own torch module and Flax port.

    Args:
      path: the ``.npz`` file to write.
      torch_module: the reference ``torch.nn.Module`` (not modified).
      flax_module: ``"module:attr"`` of the Flax port (a module or a zero-argument factory),
        importable without torch: the check imports it from there.
      batches: as `parity.compare_models`: a `parity.data.BatchStream`, ``(inputs, targets)``
        numpy pairs (one per step) or a callable ``step -> (inputs, targets)``; the golden
        records the batches of the steps it runs (and a stream's held-out batches).
      transfer, task, eval_batches, name, flax_kwargs: as `parity.compare_models`.
      precision: the cell's precision.
      steps: training steps (default: one per batch of a sequence, else 30).
      progress: report progress.
      torch_optimizer, torch_scheduler, torch_clip, torch_loss: your torch training loop, as
        `parity.compare_models` takes it: torch trains with it, the golden records what it is
        (``model.training_loop``), and `parity.golden.check.check_golden` then needs your
        ``jax_optimizer`` / ``jax_loss``; the golden also holds torch's side of the replay
        (`parity.replay.record`), against which the check replays your JAX loop.
      replay_steps: real batches of that replay (as `parity.compare_models`'s).
      **config: any other `RunConfig` field (``lr``, ``optimizer``, ``clip_norm``...; not
        beside `torch_optimizer`).

    Returns:
      The written path.
    """
    loop = TrainingLoop(
        torch_optimizer=torch_optimizer,
        torch_scheduler=torch_scheduler,
        torch_clip=torch_clip,
        torch_loss=torch_loss,
        replay_steps=replay_steps,
        sides="torch",
    )
    config = run_config_fields("export_models", loop, config)
    stream, steps, held_out = user_stream("export_models", batches, eval_batches, steps)
    evaluate = resolve_eval("export_models", config, held_out)
    flax = flax_model_of(flax_module, flax_kwargs=flax_kwargs)
    pair = prepare_pair(
        torch_module, flax, transfer, stream, task=task, name=name, flax_kwargs=flax_kwargs
    )
    if torch_optimizer is not None or torch_loss is not None:
        pair = dataclasses.replace(pair, loop=loop)
    run_config = RunConfig(
        model=name,
        precision=precision,
        steps=steps,
        batch_size=int(stream.batch_size),
        eval=evaluate,
        **config,
    )
    return export_golden(
        path, run_config, pair=pair, stream=stream, flax_model=flax_module, progress=progress
    )
