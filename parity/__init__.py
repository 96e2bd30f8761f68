"""parity: train the same model in PyTorch (torch.amp) and JAX (jaxamp) and compare.

Command line: ``python -m parity run|compare|matrix`` (see `parity.cli.commands`). Library:
`compare_models` (your own torch module, Flax module and weight transfer). The layout and the
route of one run are drawn in ``parity/README.md``.
"""

import importlib
from typing import Any

from parity.core.config import PRECISIONS as PRECISIONS
from parity.core.config import RunConfig as RunConfig

__all__ = [
    "PRECISIONS",
    "ParityResult",
    "RunConfig",
    "compare_models",
    "replay_loop",
]

# Loaded on first use: `parity.api` imports torch, and `import parity.training.train_jax` must not.
_LAZY = {
    "ParityResult": "parity.api",
    "compare_models": "parity.api",
    "replay_loop": "parity.api",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'parity' has no attribute {name!r}")
