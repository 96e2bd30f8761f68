"""The speed figure of a cell: the two frameworks timed in alternating blocks, in one process.

Each framework's training run times its own steps, one run after the other: load that changes
between the two runs moves their ratio (five identical GPT-2 runs gave 0.95x to 1.94x, each with
a narrow interval). `time_cell` times them again in turns instead: a torch block of
`block_steps` steps, a JAX block, torch, JAX... (the order rotated every round), after an
untimed warm-up of each (JAX compiles before it, apart), with the device synced after every
step and both frameworks on the same thread budget (`parity.perf.measure.set_threads`; torch's OpenMP
threads sleep instead of spinning, ``OMP_WAIT_POLICY=PASSIVE``). Each round gives one paired
ratio; `parity.perf.speed.block_verdict` turns the rounds into the quotable figure, "not
reproducible here" or a refusal (other processes held the cores: measured from ``/proc/stat``
while the blocks ran).

The steps are the trainers' own (`parity.training.train_torch.build_torch_step`,
`parity.training.train_jax.build_jax_step`: the recipe's model, optimizer and step from
`parity.training.steps`; JAX's executable is the run's own when it ran first), fresh from the
pair's initial weights, on the run's first batches.
The record goes into both main runs of the cell as ``speed_blocks``.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from parity.core.hardware import torch_matmul_probe
from parity.perf import measure
from parity.perf.speed import MIN_BLOCKS, blocks_verdict
from parity.training.train_jax import build_jax_step
from parity.training.train_torch import build_torch_step

__all__ = [
    "DEFAULT_BLOCKS",
    "DEFAULT_BLOCK_STEPS",
    "DEFAULT_WARMUP",
    "attach_speed_blocks",
    "check_speed_blocks",
    "time_cell",
]

DEFAULT_BLOCKS = 6
DEFAULT_BLOCK_STEPS = 5
# Untimed steps of each framework first: torch.compile compiles on its first call (and may once
# more on the second); a JAX executable's first call allocates.
DEFAULT_WARMUP = 3
# At most this many distinct batches are cycled (converted before timing, kept on the device).
_BATCHES = 4

PROTOCOL = (
    "alternating blocks in one process: torch block, JAX block, ... (order rotated every round), "
    "the same intra-op threads for both, untimed warm-up steps first (JAX compiled before, "
    "apart), device synced after every step; per round the ratio of the two blocks' median step "
    "times; the figure is their geometric mean with a Student-t 95% interval over the rounds"
)


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def time_cell(
    config: Any,
    pair: Any,
    stream: Any = None,
    *,
    blocks: int = DEFAULT_BLOCKS,
    block_steps: int | None = None,
    warmup: int = DEFAULT_WARMUP,
) -> dict[str, Any]:
    """Times the cell's torch and JAX train steps in alternating blocks; returns the record.

    Args:
      config: the cell's `RunConfig` (recipe, optimizer, batch size, device, torch.compile).
      pair: the model pair.
      stream: the batches (default: the pair's data at the run's data seed).
      blocks: rounds (one block per framework each); `parity.perf.speed.MIN_BLOCKS` at least for a
        ratio.
      block_steps: timed steps per block (default: the run's steps shared among the blocks,
        1 to `DEFAULT_BLOCK_STEPS`: the timing costs no more steps than the run).
      warmup: untimed steps per framework first.

    Returns:
      ``{"protocol", "device", "torch_label", "blocks", "block_steps", "warmup_steps", "times":
      {"torch": [[s, ...], ...], "jax": [...]}, "order", "others_cpu_cores",
      "others_cpu_cores_total", "wall_s", "threads", "load_average_before",
      "load_average_after", "jax_compile_time_s", "torch_probe", "verdict"}``.

    Raises:
      ValueError: `blocks` or `block_steps` < 1.
      parity.core.hardware.UnsupportedHere: a framework cannot run the cell here.

    Example:
      >>> # record = time_cell(config, get_model_pair("mlp"), blocks=6, block_steps=5)
      >>> # record["verdict"]["status"]  -> "ratio", "not reproducible" or "refused"
    """
    if stream is None:
        stream = pair.make_data(config.stream_seed, config.batch_size)
    if block_steps is None:
        block_steps = min(max(config.steps // max(blocks, 1), 1), DEFAULT_BLOCK_STEPS)
    torch_side = build_torch_step(config, pair)
    jax_side = build_jax_step(config, pair, stream, reuse_compiled=True)
    count = max(1, min(_BATCHES, config.steps))
    torch_batches = [torch_side.batch(stream, i) for i in range(count)]
    jax_batches = [jax_side.host_batch(i) for i in range(count)]
    total = warmup + blocks * block_steps
    rates = [jnp.float32(config.lr_at(min(i, config.steps - 1))) for i in range(total)]
    jax.block_until_ready((jax_batches, rates))
    torch_index, jax_index = [0], [0]
    carry = [jax_side.params, jax_side.batch_stats, jax_side.opt_state]

    def torch_step():
        index = torch_index[0]
        loss = torch_side.step(index, *torch_batches[index % count])
        loss.item()  # a device sync: the step is done
        measure.torch_sync(config.device)
        torch_index[0] += 1

    def jax_step():
        index = jax_index[0]
        inputs, targets = jax_batches[index % count]
        params, batch_stats, opt_state, metrics = jax_side.compiled(
            *carry, inputs, targets, rates[index]
        )
        jax.block_until_ready((params, opt_state, metrics))
        carry[:] = [params, batch_stats, opt_state]
        jax_index[0] += 1

    load_before = _load()
    with jax.default_matmul_precision("highest"):
        timed = measure.time_blocks(
            {"torch": torch_step, "jax": jax_step},
            blocks=blocks,
            block_steps=block_steps,
            warmup=warmup,
        )
    record: dict[str, Any] = {
        "protocol": PROTOCOL,
        "device": config.device,
        "torch_label": "torch-compile" if config.torch_compile else "torch",
        "blocks": blocks,
        "block_steps": block_steps,
        "warmup_steps": warmup,
        **timed,
        "threads": measure.thread_settings(),
        "load_average_before": load_before,
        "load_average_after": _load(),
        "jax_compile_time_s": jax_side.compile_time_s,
        "torch_probe": None,
    }
    dtype = config.policy.compute_dtype.name
    if config.device == "cpu" and dtype in ("float16", "bfloat16"):
        record["torch_probe"] = torch_matmul_probe(dtype)
    record["verdict"] = blocks_verdict(record)
    return record


def attach_speed_blocks(
    runs: list[dict[str, Any]],
    config: Any,
    pair: Any,
    stream: Any = None,
    *,
    blocks: int = DEFAULT_BLOCKS,
    block_steps: int | None = None,
) -> list[dict[str, Any]]:
    """`time_cell` for a cell whose torch and JAX runs both completed; the record goes into both
    runs as ``speed_blocks`` (returned, the same list). Nothing is timed for one framework, a
    failed run or ``blocks=0``. A timing that raises costs no run: its record is a refusal
    naming the error.

    Example:
      >>> attach_speed_blocks([], None, None)
      []
    """
    completed = {r["framework"]: r for r in runs if r.get("status") == "completed"}
    if not blocks or set(completed) != {"torch", "jax"}:
        return runs
    try:
        record = time_cell(config, pair, stream, blocks=blocks, block_steps=block_steps)
    except Exception as e:  # the parity runs stand without a speed figure
        reason = f"the alternating-block timing failed ({type(e).__name__}: {e})"
        record = {
            "protocol": PROTOCOL,
            "device": config.device,
            "torch_label": "torch-compile" if config.torch_compile else "torch",
            "times": {},
            "error": reason,
            "verdict": {"status": "refused", "reason": reason},
        }
    for run in completed.values():
        run["speed_blocks"] = record
    return runs


def check_speed_blocks(blocks: Any) -> int:
    """`blocks` when it is 0 (no alternating-block timing) or at least
    `parity.perf.speed.MIN_BLOCKS`; else a ValueError naming ``--speed-blocks``.

    Example:
      >>> check_speed_blocks(6)
      6
    """
    if (
        isinstance(blocks, bool)
        or not isinstance(blocks, int)
        or 0 < blocks < MIN_BLOCKS
        or blocks < 0
    ):
        raise ValueError(
            f"--speed-blocks must be 0 (no alternating-block timing) or an integer >= {MIN_BLOCKS} "
            f"(an interval over blocks needs {MIN_BLOCKS}); got {blocks!r}."
        )
    return blocks
