"""How deep a PASS goes: the steps its decisive per-step rows cover, when they end early.

A noise-calibrated per-step row is split at the horizon (`parity.verdicts.power`): the steps
whose tolerance stays within the loss bound decide, the rest are inconclusive because the
model's own 1-ulp divergence exceeds the bound there. A PASS decided by ``per-step loss, steps
0-1 (horizon)`` says that two steps agree, not that the run does; `pass_depth` says so in one
sentence for the bottom line (the golden check's report, the command line's summary).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from parity.verdicts.rows import Verdict, deciding_command, is_decisive

__all__ = ["pass_depth"]

_WINDOW = re.compile(r"^(?P<what>.+), steps (?P<a>\d+)-(?P<b>\d+)( \(horizon\))?$")
_BEYOND = re.compile(r"^(?P<what>.+), steps (?P<a>\d+)-(?P<b>\d+) \(beyond the horizon\)$")


def pass_depth(
    verdicts: Sequence[Verdict],
    configs: Mapping[tuple[str, str, str], Mapping[str, Any]] | None = None,
) -> dict[tuple[str, str, str], str]:
    """``{cell: sentence}`` for each passing cell whose decisive per-step rows stop at a horizon
    (cells that pass on every step, or fail, get none).

    Example:
      >>> rows = [
      ...     Verdict("m", "fp32", "cpu", "per-step loss, steps 0-1 (horizon)", "", 0.0, 0.1,
      ...             True, mode="noise-calibrated"),
      ...     Verdict("m", "fp32", "cpu", "per-step loss, steps 2-29 (beyond the horizon)", "",
      ...             0.5, 0.9, None, mode="inconclusive"),
      ... ]
      >>> pass_depth(rows)[("m", "fp32", "cpu")].split(":")[0]
      'PASS on steps 0-1 only'
    """
    cells: dict[tuple[str, str, str], list[Verdict]] = {}
    for v in verdicts:
        cells.setdefault(v.cell, []).append(v)
    out = {}
    for cell, rows in cells.items():
        if any(v.passed is False for v in rows):
            continue
        covered = [int(m["b"]) for v in rows if is_decisive(v) and (m := _WINDOW.match(v.check))]
        beyond = [(v, _BEYOND.match(v.check)) for v in rows if v.passed is not True]
        beyond = [(v, m) for v, m in beyond if m is not None]
        if not covered or not beyond:
            continue
        depth = max(covered)
        start = min(int(m["a"]) for _, m in beyond)
        stop = max(int(m["b"]) for _, m in beyond)
        if depth >= start:  # a decisive row covers those steps too
            continue
        command = deciding_command(cell, config=(configs or {}).get(cell))
        out[cell] = (
            f"PASS on steps 0-{depth} only: from step {start} to {stop} the model's own noise "
            f"exceeds the bound ({', '.join(v.check for v, _ in beyond)}: inconclusive); more "
            f"data orders decide more: {command}"
        )
    return out
