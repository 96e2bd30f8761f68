"""The examples step 0 compares: the whole batch, or its first examples where the batch's forward
pass is more work than ``STEP0_FLOPS`` matmul FLOPs.

Step 0's output and gradient comparison runs a forward and backward pass on each side, at
float32 and again at the run's precision: on the whole batch that is a training step's work per
pass, and it grows with the model as the training does. Bounded by work, step 0 compares as many
of the batch's first examples as a forward pass of ``STEP0_FLOPS`` matmul FLOPs holds (never
fewer than ``STEP0_MIN_EXAMPLES``, never more than the batch), and says so (`Step0Batch.note`,
kept in the step-0 result's summary and record).

The bands stay the ones derived for the examples compared: the fan-in and depth the tolerance
scales with (`parity.verdicts.tolerance.program_shapes`) are read from the programs on the
compared examples, so a gradient's batch-sized contraction is as long as the one actually
summed. Every built-in model at its default size and batch, and the README's main job, keeps its
whole batch (``tests/parity/test_step0_cost.py`` checks the margin): their recorded step-0 numbers
and golden files are the ones a whole-batch comparison gives. Torch-free: a golden file's check
(`parity.golden.step0`) bounds its recorded batch the same way its export did.

Example::

    batch = step0_batch(pair, variables, inputs, targets)
    batch.compared, batch.size, batch.shapes["forward"]
"""

from __future__ import annotations

import dataclasses
from typing import Any

from parity.perf.flops import jax_matmul_flops
from parity.verdicts.tolerance import examples_within, forward_jaxpr, program_shapes

__all__ = ["STEP0_FLOPS", "STEP0_MIN_EXAMPLES", "Step0Batch", "step0_batch", "step0_examples"]


# The most matmul/conv FLOPs of step 0's float32 forward pass on the examples it compares: 2^31,
# four times the largest built-in default (the transformer, batch 32: 5.4e8) and twice the layer
# probe's budget, so step 0 always compares at least the examples the probe runs on.
STEP0_FLOPS = 2**31
STEP0_MIN_EXAMPLES = 2


@dataclasses.dataclass(frozen=True)
class Step0Batch:
    """The examples step 0 compares.

    Attributes:
      inputs, targets: the batch's first ``compared`` examples (the batch itself when whole).
      shapes: `parity.verdicts.tolerance.program_shapes` on them (fan-in, depth, forward FLOPs).
      compared: how many examples step 0 compares.
      size: the batch's size.
      flops: the float32 forward pass's matmul FLOPs on the whole batch.
    """

    inputs: Any
    targets: Any
    shapes: dict[str, Any]
    compared: int
    size: int
    flops: int

    @property
    def bounded(self) -> bool:
        """Whether step 0 compares fewer examples than the batch holds."""
        return self.compared < self.size

    def note(self) -> str | None:
        """``"on the batch's first 2 of 8 examples (...)"`` when bounded, else None."""
        if not self.bounded:
            return None
        return (
            f"on the batch's first {self.compared} of {self.size} examples (a forward pass of "
            f"at most 2^{STEP0_FLOPS.bit_length() - 1} matmul FLOPs, at least "
            f"{STEP0_MIN_EXAMPLES} examples; the whole batch: {self.flops:.3g})"
        )

    def to_dict(self) -> dict[str, int]:
        """``{"compared": n, "batch": size}`` (JSON-able, for the step-0 record)."""
        return {"compared": self.compared, "batch": self.size}


def step0_examples(size: int, flops: float) -> int:
    """How many of a batch's first examples step 0 compares.

    Args:
      size: the batch's size.
      flops: the float32 forward pass's matmul FLOPs on the whole batch.

    Example:
      >>> step0_examples(32, 5.4e8), step0_examples(8, 2.6e10), step0_examples(1, 1e12)
      (32, 2, 1)
    """
    if size < 1:
        raise ValueError(f"step0_examples: `size` must be >= 1; got {size}.")
    return examples_within(size, flops, STEP0_FLOPS, STEP0_MIN_EXAMPLES, size)


def step0_batch(
    pair: Any, variables: dict, inputs: Any, targets: Any, *, examples: int | None = None
) -> Step0Batch:
    """The examples step 0 compares and the program shapes its bands read (`Step0Batch`).

    Args:
      pair: the model pair.
      variables: the Flax variables step 0 starts from.
      inputs, targets: the step-0 batch (numpy; examples along the first axis).
      examples: compare this many of the batch's first examples (a golden file's check: as
        many as its export compared); default `step0_examples`'s.

    Example:
      >>> batch = step0_batch(get_model_pair("mlp"), variables, inputs, targets)
      >>> batch.compared == len(inputs)
      True
    """
    # The whole batch's forward pass gives its FLOPs; its gradient is traced only when the
    # whole batch is compared (the shapes are the compared examples' programs').
    forward = forward_jaxpr(pair, variables, inputs)
    size = len(inputs)
    flops = int(sum(jax_matmul_flops(forward).values()))
    if examples is not None:
        compared = min(size, examples)
    else:
        compared = step0_examples(size, flops) if size else size
    if compared < size:
        inputs, targets = inputs[:compared], targets[:compared]
        forward = None
    shapes = program_shapes(pair, variables, inputs, targets, forward=forward)
    return Step0Batch(inputs, targets, shapes, compared, size, flops)
