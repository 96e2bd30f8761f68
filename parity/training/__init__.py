"""Training: the one torch step and the one JAX step (`steps`), the trainers built on them
(`trainers`, `train_torch`, `train_jax`), the speed blocks that time both in turns (`blocks`) and
dtype traces. Precisions, losses and the run record live in `parity.core`."""
