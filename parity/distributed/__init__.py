"""Multi-device parity: torch DDP / FSDP2 ranks against JAX meshes, shard_map and processes.

::

    python -m parity run --model mlp --precision bf16-mixed --devices 2 --strategy ddp --out runs/d
    python -m parity run --model transformer --precision bf16-mixed --devices 2 --strategy fsdp \\
        --out runs/f

Library: `run_distributed(config, DistributedPlan(...), out, pair_factory="pkg.mod:make_pair")`.
"""

from parity.distributed.procs import WorkerError as WorkerError
from parity.distributed.procs import WorkerGroup as WorkerGroup
from parity.distributed.procs import free_port as free_port
from parity.distributed.run import JAX_MODES as JAX_MODES
from parity.distributed.run import STRATEGIES as STRATEGIES
from parity.distributed.run import DistributedPlan as DistributedPlan
from parity.distributed.run import DistributedResult as DistributedResult
from parity.distributed.run import format_distributed as format_distributed
from parity.distributed.run import run_distributed as run_distributed

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
