"""Multi-device parity: torch DDP / FSDP2 ranks against JAX meshes, shard_map and processes.

::

    python -m parity run --model mlp --precision bf16-mixed --devices 2 --strategy ddp --out runs/d
    python -m parity run --model transformer --precision bf16-mixed --devices 2 --strategy fsdp \\
        --out runs/f

Library: `run_distributed(config, DistributedPlan(...), out, pair_factory="pkg.mod:make_pair")`.
"""

import importlib
from typing import Any

from parity.distributed.procs import WorkerError as WorkerError
from parity.distributed.procs import WorkerGroup as WorkerGroup
from parity.distributed.procs import free_port as free_port

__all__ = [
    "JAX_MODES",
    "STRATEGIES",
    "DistributedPlan",
    "DistributedResult",
    "WorkerError",
    "WorkerGroup",
    "format_distributed",
    "free_port",
    "run_distributed",
]

# The runner's names load on first use: a worker process (``python -m
# parity.distributed.worker``) imports this package first and needs none of the runner's cell
# pipeline (verdicts, report, plots), which every worker would otherwise import for nothing.
_LAZY = {
    name: "parity.distributed.run"
    for name in (
        "JAX_MODES",
        "STRATEGIES",
        "DistributedPlan",
        "DistributedResult",
        "format_distributed",
        "run_distributed",
    )
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'parity.distributed' has no attribute {name!r}")
