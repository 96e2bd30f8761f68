"""Training: precision recipes (`recipes`, the one registry of precisions), the one torch step and
the one JAX step (`steps`), the trainers built on them (`trainers`, `train_torch`, `train_jax`),
fp8 capture (`fp8`), losses, dtype traces and the run record (`records`, `schema`)."""
