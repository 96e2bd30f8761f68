"""A training loop and its optax port, for `python -m parity replay` and the golden replay.

`torch_loop` is the torch script's loop (AdamW with two parameter groups, a LambdaLR warm-up and
cosine, global-norm clipping, label smoothing); `jax_loop` its optax port (imports no torch).
The model and batches are `examples.parity_ci`'s.
"""

LR, WEIGHT_DECAY, WARMUP, STEPS, CLIP, SMOOTHING = 1e-2, 0.1, 2, 6, 1.0, 0.1
HIDDEN = 8  # the golden's model (`export_golden`): 8 wide keeps the file small


def batches():
    """The run's batches: `examples.parity_ci.data.make_batches` for `STEPS` steps."""
    from examples.parity_ci.data import make_batches

    return make_batches(STEPS)


def flax_port():
    """The Flax port at the golden's width (what its check imports, torch-free)."""
    from examples.parity_ci.flax_model import FlaxNet

    return FlaxNet(hidden=HIDDEN)
