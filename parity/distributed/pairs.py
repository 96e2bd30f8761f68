"""The pair of a distributed run, built alike by the runner (for step 0) and by every worker.

Its own module so that a worker (`parity.distributed.worker`) imports the pair builder without
the runner's cell pipeline (`parity.cell`: verdicts, report, plots): every worker process starts
by importing what it needs, and what it does not need is paid once per process.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from parity import models
from parity.core.config import RunConfig

__all__ = ["load_pair_factory", "make_pair"]


def make_pair(config: RunConfig, pair_factory: str | None = None) -> Any:
    """The run's pair: the built-in pair of ``config.model`` with the run's seed, data and
    overrides (as `parity.cell.builtin_pair` builds it for a single-device cell), or the user's
    factory's (``"package.module:function"``, called with ``seed=``)."""
    if pair_factory is None:
        return models.get_model_pair(
            config.model, seed=config.seed, data=config.data, **config.model_overrides
        )
    return load_pair_factory(pair_factory)(seed=config.seed)


def load_pair_factory(spec: str):
    """Imports ``"package.module:function"`` (a user's `ModelPair` factory)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"pair_factory must be 'package.module:function'; got {spec!r}.")
    module_name, attr = spec.split(":")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"pair_factory: {module_name} has no {attr!r}.{hint}")
    return getattr(module, attr)
