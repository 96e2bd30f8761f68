"""The command-line spelling of a run's settings: which option sets each `RunConfig` field, and
the ``python -m parity run`` arguments that reproduce a recorded config (`run_arguments`).

`parity.cli.commands` reads options into a `RunConfig` through these names; the verdicts' deciding
command (`parity.verdicts.outcomes.deciding_command`) writes a run's config back as arguments, so
the command printed under an inconclusive cell reruns that cell, not another experiment.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from parity.core.config import RunConfig

__all__ = ["option", "run_arguments"]

# The option behind a RunConfig field where it is not spelled "--" + field with dashes.
_OPTIONS = {"timing_warmup": "--warmup", "model_overrides": "--model-override"}

# Fields `python -m parity run` sets with an option taking a value (the cell's model and
# precision come first; flags and fields with a spelling of their own are below).
_VALUED = (
    "device",
    "steps",
    "batch_size",
    "seed",
    "data",
    "optimizer",
    "lr",
    "weight_decay",
    "momentum",
    "schedule",
    "lr_warmup_steps",
    "clip_norm",
    "timing_warmup",
    "init_scale",
    "growth_interval",
)


def option(field: str) -> str:
    """The option that sets `RunConfig` field `field`.

    Example:
      >>> option("batch_size"), option("timing_warmup")
      ('--batch-size', '--warmup')
    """
    return _OPTIONS.get(field, "--" + field.replace("_", "-"))


def _number(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def run_arguments(config: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``python -m parity run`` arguments that set every field of `config` (a run record's
    ``config``: `RunConfig.to_dict`) the command line can set, and the fields it cannot set
    that differ from `RunConfig`'s defaults (a rerun needs `parity.compare_models` for those).

    Every settable field is written, defaults included: a matrix cell's steps and batch size
    are its recipe's plan, not the command line's defaults.

    Example:
      >>> args, unset = run_arguments({"model": "mlp", "precision": "fp32", "steps": 3})
      >>> args, unset
      (['--model', 'mlp', '--precision', 'fp32', '--steps', '3'], [])
    """
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    args = []
    for field in ("model", "precision", *_VALUED):
        if field not in config:
            continue
        value = config[field]
        if field == "clip_norm" and value is None:
            value = 0  # --clip-norm 0 disables clipping
        args += [option(field), _number(value)]
    if config.get("torch_compile"):
        args.append("--torch-compile")
    if config.get("eval") is False:
        args.append("--no-eval")
    for key, value in (config.get("model_overrides") or {}).items():
        value = list(value) if isinstance(value, tuple) else value
        args += [option("model_overrides"), f"{key}={json.dumps(value, separators=(',', ':'))}"]
    unset = []
    for field in ("betas", "eps", "data_seed"):
        if field in config and _differs(config[field], defaults.get(field)):
            unset.append(f"{field}={config[field]!r}")
    return args, unset


def _differs(value: Any, default: Any) -> bool:
    if isinstance(value, list | tuple) and isinstance(default, list | tuple):
        return list(value) != list(default)
    return value != default
