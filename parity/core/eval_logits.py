"""A language model's eval logits in a run record: a bounded float32 sample per eval point.

KL divergence and top-k agreement are computed across the two frameworks' records
(`parity.verdicts.logits`), so each record carries the logits themselves: float32, at most
`EVAL_LOGIT_TOKENS` tokens of the first eval batch, fewer where the vocabulary is large (at most
`EVAL_LOGIT_VALUES` values, never fewer than `EVAL_LOGIT_MIN_TOKENS` tokens). The built-in
transformer (vocabulary 256): 64 tokens, 64 KiB per point (87 KiB in base64); a GPT-2 vocabulary:
8 tokens, 1.6 MB. This module imports neither torch nor JAX (both trainers call it).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "EVAL_LOGIT_MIN_TOKENS",
    "EVAL_LOGIT_TOKENS",
    "EVAL_LOGIT_VALUES",
    "eval_logit_point",
    "eval_logit_sample",
]

EVAL_LOGIT_TOKENS = 64
EVAL_LOGIT_VALUES = 2**16
EVAL_LOGIT_MIN_TOKENS = 8


def _inputs_digest(inputs: Any) -> str:
    array = np.asarray(inputs)
    kind = np.int64 if np.issubdtype(array.dtype, np.integer) else np.float32
    return hashlib.sha256(np.ascontiguousarray(array, dtype=kind).tobytes()).hexdigest()[:16]


def eval_logit_point(step: int, logits: Any, inputs: Any) -> dict[str, Any]:
    """One eval point of a run record's ``eval_logits``: a bounded float32 sample of `logits`.

    Args:
      step: the optimizer updates applied before this evaluation (0: the initial weights).
      logits: ``(..., vocab)`` logits of the first eval batch (any float dtype; numpy, JAX or a
        CPU torch tensor converted by the caller).
      inputs: that batch's inputs as the stream gave them (their digest shows both frameworks
        sampled the same tokens).

    Returns:
      ``{"step", "vocab", "positions", "inputs_sha256", "logits_b64"}``: the sampled rows of the
      flattened ``(tokens, vocab)`` logits, evenly spaced over the batch, little-endian float32
      in base64 (exact, and a quarter of the size of JSON numbers).

    Example:
      >>> point = eval_logit_point(0, np.zeros((2, 3, 5)), np.zeros((2, 3), int))
      >>> point["positions"], eval_logit_sample(point).shape
      ([0, 1, 2, 3, 4, 5], (6, 5))
    """
    values = np.asarray(logits, dtype=np.float32)
    vocab = int(values.shape[-1])
    flat = values.reshape(-1, vocab)
    count = min(
        EVAL_LOGIT_TOKENS, flat.shape[0], max(EVAL_LOGIT_MIN_TOKENS, EVAL_LOGIT_VALUES // vocab)
    )
    # Spacing >= 1 when count <= tokens, so rounding never repeats a position.
    positions = np.round(np.linspace(0, flat.shape[0] - 1, count)).astype(np.int64)
    sample = np.ascontiguousarray(flat[positions], dtype="<f4")
    return {
        "step": int(step),
        "vocab": vocab,
        "positions": [int(p) for p in positions],
        "inputs_sha256": _inputs_digest(inputs),
        "logits_b64": base64.b64encode(sample.tobytes()).decode("ascii"),
    }


def eval_logit_sample(point: Mapping[str, Any]) -> np.ndarray:
    """The ``(len(positions), vocab)`` float32 logits of an `eval_logit_point`.

    Raises:
      ValueError: ``logits_b64`` is not base64 or does not hold ``len(positions) * vocab``
        float32 values.
    """
    try:
        raw = base64.b64decode(point["logits_b64"], validate=True)
    except ValueError as e:
        raise ValueError(f"logits_b64: not base64 ({e})") from e
    shape = (len(point["positions"]), int(point["vocab"]))
    if len(raw) != 4 * shape[0] * shape[1]:
        raise ValueError(
            f"logits_b64: holds {len(raw)} bytes; {shape[0]} positions x vocab {shape[1]} "
            f"float32 values need {4 * shape[0] * shape[1]}"
        )
    return np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
