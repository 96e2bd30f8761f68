"""parity: train the same model in PyTorch (torch.amp) and JAX (jaxamp) and compare.

Command line: ``python -m parity run|compare|matrix`` (see `parity.cli.commands`). Library:
`compare_models` (your own torch module, Flax module and weight transfer). The layout and the
route of one run are drawn in ``parity/README.md``.
"""

import importlib
from typing import Any

__all__ = [
    "PRECISIONS",
    "ParityResult",
    "RunConfig",
    "compare_models",
    "replay_loop",
]

# Loaded on first use: `parity.api` imports torch, and `import parity.training.train_jax` must not;
# `parity.core.config` imports jaxamp and JAX, which a process importing only a JAX-free module
# (`parity.core.hardware` beside torch alone, `parity.distributed.procs`) need not.
_LAZY = {
    "PRECISIONS": "parity.core.config",
    "RunConfig": "parity.core.config",
    "ParityResult": "parity.api",
    "compare_models": "parity.api",
    "replay_loop": "parity.api",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'parity' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
