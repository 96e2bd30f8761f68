"""The user's training loop replayed on identical inputs: both optimizers on the same gradients
(`parity.replay.optimizers`), both losses on the same logits (`parity.replay.losses`), judged
within float32 rounding and named by the first quantity that differs (`parity.replay.explain`);
`parity.replay.rows` turns them into step-0 verdict rows."""
