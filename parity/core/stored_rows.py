"""Verdict rows a run record stores (``step0.verdicts``: step 0's rows; ``distributed_verdicts``:
a distributed run's own checks), read as rows are written now.

Records saved before rows carried their check kind (`parity.verdicts.checks.CHECKS`) hold rows
without one, and step-0 rows without a mode. `upgrade_run` names each such row's kind from the
label that version wrote (`LEGACY_KINDS`: the one place a row's kind is read from its label) and
gives a step-0 row the mode ``"step 0"``, as `parity.golden.format.upgrade_header` does for golden
files of version 2; a kindless row whose label no version wrote is refused, naming it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["LEGACY_KINDS", "StoredRowError", "stored_rows", "upgrade_run"]

# The labels rows were written with before they had kinds, and the kind each is. ``P`` stands
# for a precision's name ("fp32", "bf16-mixed", "mxfp8-floor"...).
LEGACY_KINDS: dict[str, str] = {
    "step 0 P: eval-mode output": "step 0 output",
    "step 0 P: train-mode output": "step 0 output",
    "step 0 P: gradients": "step 0 gradients",
    "compute dtype (torch)": "compute dtype",
    "compute dtype (jax)": "compute dtype",
    "step 0 fp32: each layer on its operating range": "layer probe",
    "step 0: deterministic train-mode forward (torch)": "stochastic",
    "step 0: tensors folded by the mapping": "folded",
    "step 0: dropout rates differ (turned off on both sides)": "dropout",
    "step 0: embedding rows torch never trains (padding_idx)": "padding rows",
    "step 0 P: fp8 layers": "quantized layers",
    "step 0 P: fp8 input scales and codes": "quantized layers",
    "step 0 P: fp8 weight scales and codes": "quantized layers",
    "step 0 P: fp8 grad_output scales and codes": "quantized layers",
    "step 0 P: optimizer state codes and scales": "optimizer state",
    "step 0 P: weights after one optimizer step": "optimizer state",
    "step 0": "step 0 ran",
    "batch 0 data finite": "data finite",
    "step 0 replay: optimizer on identical gradients": "replay optimizer",
    "step 0 replay: loss on identical logits": "replay loss",
    "loss scale and skips identical across ranks": "ranks agree",
    "injected overflow (rank R, step S) skipped on every rank": "injected overflow",
    "replicated params identical across ranks": "replicated params",
    "gradient reduction dtype": "reduction dtype",
    "JAX mode": "jax mode",
}

_PLACEHOLDERS = {"P": r"[\w.-]+", "R": r"\d+", "S": r"\d+"}


def _pattern(label: str) -> re.Pattern[str]:
    parts = re.split(r"\b([PRS])\b", label)
    return re.compile(
        "".join(_PLACEHOLDERS[p] if i % 2 else re.escape(p) for i, p in enumerate(parts)) + r"\Z"
    )


_PATTERNS = [(_pattern(label), kind) for label, kind in LEGACY_KINDS.items()]

# Where a record stores rows, and the mode a row stored there without one has.
_FIELDS = {"step0.verdicts": "step 0", "distributed_verdicts": ""}


class StoredRowError(ValueError):
    """A stored row without a kind whose label no version wrote.

    Attributes:
      field: where it is stored, e.g. ``"step0.verdicts[3]"``.
      reason: what is wrong with it.
    """

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


def _rows(run: Mapping[str, Any], field: str) -> list[Any]:
    holder = run.get("step0") if field == "step0.verdicts" else run
    if not isinstance(holder, Mapping):
        return []
    return list(holder.get(field.rsplit(".", 1)[-1]) or [])


def _upgraded(row: Mapping[str, Any], field: str, mode: str) -> dict[str, Any]:
    out = dict(row)
    if not out.get("kind"):
        label = out.get("check")
        kind = next((k for p, k in _PATTERNS if isinstance(label, str) and p.match(label)), None)
        if kind is None:
            closest = difflib.get_close_matches(str(label), LEGACY_KINDS, n=1, cutoff=0.0)
            raise StoredRowError(
                field,
                f"a row without a kind, labelled {label!r}, which no version of the harness "
                f"wrote (closest: {closest[0]!r}; the labels rows had before kinds, P a "
                f"precision: {sorted(LEGACY_KINDS)})",
            )
        out["kind"] = kind
    if mode and not out.get("mode"):
        out["mode"] = mode
    return out


def stored_rows(run: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(field, row)`` for every row `run` stores, each upgraded (a copy: `run` is unchanged).

    Raises:
      StoredRowError: a row without a kind whose label no version wrote.

    Example:
      >>> run = {"step0": {"verdicts": [{"check": "step 0 bf16-mixed: gradients", "mode": ""}]}}
      >>> [(f, r["kind"], r["mode"]) for f, r in stored_rows(run)]
      [('step0.verdicts[0]', 'step 0 gradients', 'step 0')]
    """
    for field, mode in _FIELDS.items():
        for i, row in enumerate(_rows(run, field)):
            if isinstance(row, Mapping):
                yield f"{field}[{i}]", _upgraded(row, f"{field}[{i}]", mode)


def upgrade_run(run: dict[str, Any]) -> dict[str, Any]:
    """`run` with every stored row as `stored_rows` reads it, in place; returns `run`.

    Raises:
      StoredRowError: a row without a kind whose label no version wrote (nothing is changed).
    """
    upgraded: dict[str, list[dict[str, Any]]] = {}
    for field, row in stored_rows(run):
        upgraded.setdefault(field.split("[", 1)[0], []).append(row)
    for field, rows in upgraded.items():
        holder = run["step0"] if field == "step0.verdicts" else run
        holder[field.rsplit(".", 1)[-1]] = rows
    return run
