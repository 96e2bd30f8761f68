"""Deterministic batches for the example: 64 features with class structure, 10 classes (numpy)."""

from __future__ import annotations

import numpy as np

FEATURES = 64
CLASSES = 10


def make_batches(steps: int, batch_size: int = 8, seed: int = 0):
    """``steps`` pairs ``(inputs float32 (B, 64), labels int32 (B,))``: noisy class prototypes."""
    rng = np.random.default_rng(seed)
    prototypes = rng.normal(size=(CLASSES, FEATURES)).astype(np.float32)
    batches = []
    for _ in range(steps):
        labels = rng.integers(0, CLASSES, size=batch_size).astype(np.int32)
        noise = rng.normal(size=(batch_size, FEATURES)).astype(np.float32)
        batches.append((prototypes[labels] + noise, labels))
    return batches
