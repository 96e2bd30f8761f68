"""One framework's run of a cell, as a record whatever happens.

`train_framework` calls `parity.training.train_torch.train_torch` or `parity.training.train_jax.train_jax` and turns
what stops them into records: a cell this machine cannot run (`UnsupportedHere`: no GPU, no
oneDNN kernel, a recipe an arm cannot run) is an ``unsupported`` record, any other exception an
``error`` record that `parity.verdicts.judge` fails. The main runs of a cell (`parity.cell`) and its
calibration runs (`parity.verdicts.calibrate`) both come through here.
"""

from __future__ import annotations

import sys
from typing import Any

from parity.core.hardware import UnsupportedHere
from parity.core.records import build_error_record, build_unsupported_record
from parity.training import train_jax as jax_trainer
from parity.training import train_torch as torch_trainer

__all__ = ["train_framework"]


def train_framework(
    framework: str,
    config: Any,
    pair: Any,
    stream: Any = None,
    *,
    progress: bool = False,
    record_as: str | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Trains `pair` on `framework` (``"torch"`` or ``"jax"``) with `config`; always a record.

    Args:
      framework: which trainer runs.
      config: the run's `RunConfig`.
      pair: the model pair.
      stream: the batches (default: the pair's data at the run's data seed).
      progress: report progress.
      record_as: the framework an unsupported/error record names (default `framework`).
      **kwargs: passed to the trainer (``variables=`` for the JAX side).
    """
    if framework not in ("torch", "jax"):
        raise ValueError(
            f"train_framework: `framework` must be 'torch' or 'jax'; got {framework!r}."
        )
    # Looked up at call time: tests and tools replace a trainer on its module.
    trainer = torch_trainer.train_torch if framework == "torch" else jax_trainer.train_jax
    if stream is not None:
        kwargs["stream"] = stream
    try:
        return trainer(config, pair, progress=progress, **kwargs)
    except UnsupportedHere as e:  # this machine cannot run the cell: reported, not failed
        return build_unsupported_record(record_as or framework, config, e.reason)
    except Exception as e:  # recorded and failed by `compare`; a matrix goes on
        print(f"error: {framework} {config.model} {config.precision}: {e}", file=sys.stderr)
        return build_error_record(record_as or framework, config, e)
