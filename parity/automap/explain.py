"""What a weight mapping did, row by row: every torch name, its Flax path, and how it was paired.

`explain` is for people (print `format_explanation` of it) and for the run record (the report
shows it): a wrong pairing of two same-shape layers passes every shape check and every round
trip, so the only defence is to show how each pair was decided.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parity.pairs.mapping import MappingEntry, WeightMapping, apply_transform

__all__ = ["explain", "folded_tensors", "format_explanation", "record_mapping"]

_SPLIT_NOTE = (
    "split into {count} Flax leaves (pieces: they train alike under element-wise optimizers such "
    "as AdamW and SGD; block-wise quantized optimizer states see other blocks)"
)
_FOLD_NOTE = (
    "folded: summed with {others} into {leaf}; the Flax model has one trainable tensor where "
    "torch has {count}, so the two train differently (the optimizer moves each torch tensor on "
    "its own)"
)


def _shapes(torch_module: Any) -> dict[str, tuple[int, ...]]:
    if torch_module is None:
        return {}
    return {k: tuple(v.shape) for k, v in torch_module.state_dict(keep_vars=True).items()}


def folded_tensors(
    mapping: WeightMapping, shapes: Mapping[str, tuple[int, ...]]
) -> dict[tuple[str, ...], list[str]]:
    """Trainable Flax leaves (``params``) that hold a sum of several torch tensors: leaf path ->
    the torch names summed into it (GRU/LSTM cells with one bias where torch has two).

    Args:
      mapping: the mapping.
      shapes: torch ``state_dict`` key -> shape.
    """
    groups: dict[tuple[str, ...], list[MappingEntry]] = {}
    for entry in mapping.entries:
        groups.setdefault(tuple(entry.flax_path), []).append(entry)
    folded = {}
    for path, group in groups.items():
        if path[0] != "params" or len(group) < 2:
            continue
        if any(e.torch_name not in shapes for e in group):
            continue
        count = sum(
            apply_transform(e.transform, np.ones(shapes[e.torch_name], np.int32)) for e in group
        )
        if np.any(count > 1):
            folded[path] = list(dict.fromkeys(e.torch_name for e in group))
    return folded


def explain(mapping: WeightMapping, torch_module: Any = None) -> list[dict[str, str]]:
    """One row per torch tensor: where it goes and how that was decided.

    Args:
      mapping: a `parity.pairs.mapping.WeightMapping` (from `parity.transfer.auto`, or hand-written:
        ``decided_by`` is then ``"given"``).
      torch_module: the torch model, optional: with it, folded tensors are found and the
        ``state_dict`` keys the mapping leaves out are listed too (``"left out"``).

    Returns:
      Rows ``{"torch": name, "flax": "params/fc/kernel" (several joined by ", "), "transform",
      "decided_by", "note", "folded_into"}`` in mapping order; ``note`` says when a tensor is
      split into pieces or folded (summed) with another; ``folded_into`` names the trainable Flax
      leaves it is summed into with other torch tensors (``""``: none).

    Examples:
      >>> from parity.models import get_model_pair
      >>> pair = get_model_pair("mlp", seed=0)
      >>> explain(pair.mapping)[0]["flax"], explain(pair.mapping)[0]["decided_by"]
      ('params/fc1/kernel', 'given')
    """
    shapes = _shapes(torch_module)
    folded = folded_tensors(mapping, shapes) if shapes else {}
    folded_in = {name: path for path, names in folded.items() for name in names}
    by_torch: dict[str, list[MappingEntry]] = {}
    for entry in mapping.entries:
        by_torch.setdefault(entry.torch_name, []).append(entry)
    rows = []
    for name, group in by_torch.items():
        notes = []
        if len(group) > 1:
            notes.append(_SPLIT_NOTE.format(count=len(group)))
        if name in folded_in:
            path = folded_in[name]
            others = [n for n in folded[path] if n != name]
            notes.append(
                _FOLD_NOTE.format(
                    others=", ".join(others), leaf="/".join(path), count=len(folded[path])
                )
            )
        rows.append(
            {
                "torch": name,
                "flax": ", ".join("/".join(e.flax_path) for e in group),
                "transform": ", ".join(dict.fromkeys(e.transform for e in group)),
                "decided_by": group[0].decided_by or "given",
                "note": "; ".join(notes),
                "folded_into": ", ".join(
                    "/".join(path) for path, names in folded.items() if name in names
                ),
            }
        )
    for name in shapes:
        if name not in by_torch and not name.endswith("num_batches_tracked"):
            rows.append(
                {
                    "torch": name,
                    "flax": "",
                    "transform": "",
                    "decided_by": "left out",
                    "note": "",
                    "folded_into": "",
                }
            )
    return rows


def format_explanation(rows: list[dict[str, str]]) -> str:
    """`explain`'s rows as aligned text, one line per torch tensor.

    Examples:
      >>> print(format_explanation([{"torch": "fc.weight", "flax": "params/fc/kernel",
      ...     "transform": "linear", "decided_by": "name", "note": ""}]))
      fc.weight -> params/fc/kernel  [linear; name]
    """
    width = max((len(r["torch"]) for r in rows), default=0)
    lines = []
    for row in rows:
        target = row["flax"] or "(not mapped)"
        detail = "; ".join(x for x in (row["transform"], row["decided_by"]) if x)
        note = f"  -- {row['note']}" if row["note"] else ""
        lines.append(f"{row['torch']:<{width}} -> {target}  [{detail}]{note}")
    return "\n".join(lines)


def record_mapping(runs: list[dict[str, Any]], pair: Any) -> list[dict[str, Any]]:
    """Puts `explain`'s rows into each run record as ``weight_mapping`` (the report shows them)
    when the pair's mapping was made automatically or folds tensors; returns `runs`.

    A hand-written mapping whose rows are all ``"given"`` and note nothing is its own
    explanation and is left out of the records.
    """
    mapping = getattr(pair, "mapping", None)
    if not isinstance(mapping, WeightMapping):
        return runs
    rows = explain(mapping, getattr(pair, "torch_model", None))
    if all(r["decided_by"] in ("given", "left out") and not r["note"] for r in rows):
        return runs
    for run in runs:
        run["weight_mapping"] = rows
    return runs
