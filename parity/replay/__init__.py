"""The user's training loop replayed on identical inputs: both optimizers on the same gradients
(torch's side `parity.replay.optimizers` and `parity.replay.gradients`, JAX's
`parity.replay.jax_side`), both losses on the same logits (`parity.replay.losses`), judged within
float32 rounding and named by the first quantity that differs (`parity.replay.explain`,
`parity.replay.judge`); `parity.replay.rows` turns them into step-0 verdict rows, and
`parity.replay.record` keeps torch's side in a golden file for a check without torch."""
