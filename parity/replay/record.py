"""torch's side of the replay, recorded in a golden file and judged against a JAX loop without
torch.

A golden exported with the user's torch loop (`parity.golden.export.export_models`) holds, for
every gradient sequence of the optimizer replay, torch's steps (`parity.replay.jax_side.SideStep`:
parameters, updates, optimizer state, learning rates, clipping factor, param-group
hyperparameters) and the gradients it was fed; and torch's loss on its logits' cases (values and
gradients w.r.t. the logits). `parity.golden.check.check_golden` feeds the same gradients to the
user's optax transformation and the same logits to their JAX loss, and judges them as the
harness does (`parity.replay.judge`): the same rows, the same named findings.

Arrays (under ``replay/``): ``opt/SCENARIO/K/FIELD`` (``FIELD``: ``params``, ``update``,
``grads``, ``direction``, ``given``, ``state/QUANTITY``; every leaf in one float32 vector, in
``shapes``' order), ``loss/logits/K``, ``loss/targets/K``, ``loss/grad/I``. Header
(``replay``): ``task``, ``owners`` (Flax path -> torch names), ``shapes`` (Flax path -> shape),
``optimizer`` (per scenario, per step: count, lr, skipped, scale, clip, grad_norm, groups,
lr_next, the fields stored), ``loss`` (per case: torch's value, or why torch had none) and ``aliases``
(an array equal to one stored before is stored once: ``{key: the stored key}``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from parity.replay.jax_side import SideStep, jax_stepper
from parity.replay.judge import judge_sequences, loss_row, optimizer_row
from parity.replay.losses import compare_losses
from parity.verdicts.rows import Verdict

__all__ = [
    "PREFIX",
    "RecordedLayout",
    "TorchReplay",
    "decode_replay",
    "encode_replay",
    "judge_recorded",
    "recorded_gate",
]

PREFIX = "replay/"
_ARRAY_FIELDS = ("params", "update", "grads", "direction")
_SCALARS = ("count", "lr", "skipped", "scale", "clip", "grad_norm", "groups", "lr_next")


@dataclasses.dataclass
class TorchReplay:
    """torch's side of a replay.

    Attributes:
      task: the pair's task (the loss cases depend on it).
      owners: ``{Flax path: [torch parameter names]}``.
      sequences: ``{scenario: (torch's steps, the gradients fed, Flax layout)}``, or None (no
        torch optimizer of the user's).
      loss: ``(logits, targets, torch values per case)``, or None (no torch loss of the user's).
    """

    task: str
    owners: dict[str, list[str]]
    sequences: dict[str, tuple[list[SideStep], list[dict[str, np.ndarray]]]] | None
    loss: tuple[list[np.ndarray], list[np.ndarray], list] | None


class RecordedLayout:
    """The torch names behind each Flax leaf, as recorded (`parity.replay.layout.Layout`'s
    naming half, without torch).

    Example:
      >>> RecordedLayout({"fc1/kernel": ["fc1.weight"]}).torch_name("fc1/kernel")
      'fc1.weight'
    """

    def __init__(self, owners: Mapping[str, list[str]]):
        self.owners = {path: list(names) for path, names in owners.items()}

    def torch_name(self, path: str) -> str:
        return ", ".join(self.owners.get(path, [])) or "?"

    def torch_names(self, path: str) -> list[str]:
        return list(self.owners.get(path, []))


def _json(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


class _Pool(dict):
    """Arrays by key, each distinct array stored once: a repeat (every sequence starts from the
    same weights and batch 0's gradient) is an alias in the header, ``{key: stored key}``."""

    def __init__(self):
        super().__init__()
        self.aliases: dict[str, str] = {}
        self._seen: dict[tuple, str] = {}

    def put(self, key: str, value: Any) -> None:
        value = np.ascontiguousarray(value)
        digest = (value.dtype.str, value.shape, hashlib.sha256(value.tobytes()).hexdigest())
        if digest in self._seen:
            self.aliases[key] = self._seen[digest]
        else:
            self._seen[digest] = key
            self[key] = value


def encode_replay(replay: TorchReplay) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(header, arrays)`` of torch's side (array keys under `PREFIX`; an array equal to one
    stored before is stored once, under ``aliases``)."""
    arrays = _Pool()
    header: dict[str, Any] = {"task": replay.task, "owners": _json(replay.owners)}
    if replay.sequences is not None:
        paths = sorted(replay.sequences[next(iter(replay.sequences))][0][0].params)
        shapes = {}
        optimizer = {}
        for scenario, (steps, given) in replay.sequences.items():
            rows = []
            for k, (step, fed) in enumerate(zip(steps, given, strict=True)):
                at = f"{PREFIX}opt/{scenario}/{k}/"
                per_field = {f: getattr(step, f) for f in _ARRAY_FIELDS if getattr(step, f)}
                per_field.update({f"state/{q}": v for q, v in step.state.items()})
                per_field["given"] = fed
                for field, per_path in per_field.items():
                    for path in paths:
                        shapes.setdefault(path, list(np.shape(per_path[path])))
                    arrays.put(at + field, _pack(per_path, paths))
                rows.append({name: _json(getattr(step, name)) for name in _SCALARS})
                rows[-1]["fields"] = sorted(per_field)
            optimizer[scenario] = rows
        header["shapes"] = shapes
        header["optimizer"] = optimizer
    if replay.loss is not None:
        logits, targets, values = replay.loss
        for k, (x, y) in enumerate(zip(logits, targets, strict=True)):
            arrays.put(f"{PREFIX}loss/logits/{k}", np.asarray(x, np.float32))
            arrays.put(f"{PREFIX}loss/targets/{k}", np.asarray(y))
        cases = []
        for i, value in enumerate(values):
            if isinstance(value, str):
                cases.append(value)
            else:
                cases.append(float(value[0]))
                arrays.put(f"{PREFIX}loss/grad/{i}", np.asarray(value[1], np.float32))
        header["loss"] = {"batches": len(logits), "cases": cases}
    header["aliases"] = arrays.aliases
    return header, dict(arrays)


def _pack(per_path: Mapping[str, Any], paths: list[str]) -> np.ndarray:
    """One float32 vector of every leaf, in `paths`' order (one archive member, not one each)."""
    return np.concatenate([np.asarray(per_path[p], np.float32).ravel() for p in paths])


def _unpack(flat: np.ndarray, shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """`_pack`'s reverse (`shapes` in the same order)."""
    sizes = [int(np.prod(shape)) for shape in shapes.values()]
    if flat.ndim != 1 or flat.size != sum(sizes):
        raise ValueError(f"a packed array of {flat.size} values for {sum(sizes)} parameters")
    parts = np.split(flat, np.cumsum(sizes)[:-1])
    return {p: part.reshape(shape) for (p, shape), part in zip(shapes.items(), parts, strict=True)}


def decode_replay(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> TorchReplay:
    """`encode_replay`'s reverse.

    Raises:
      ValueError: a field or array the header names is missing or malformed (naming it).
    """
    try:
        aliases = header.get("aliases") or {}
        missing = sorted({v for v in aliases.values() if v not in arrays})
        if missing:
            raise ValueError(f"aliases name arrays the file does not hold: {missing[:3]}")
        arrays = {**arrays, **{key: arrays[stored] for key, stored in aliases.items()}}
        sequences = None
        if "optimizer" in header:
            shapes = {path: tuple(shape) for path, shape in header["shapes"].items()}
            sequences = {}
            for scenario, rows in header["optimizer"].items():
                steps, given = [], []
                for k, row in enumerate(rows):
                    at = f"{PREFIX}opt/{scenario}/{k}/"
                    fields = {f: _unpack(arrays[at + f], shapes) for f in row["fields"]}
                    state = {f[len("state/") :]: v for f, v in fields.items() if "/" in f}
                    steps.append(
                        SideStep(
                            params=fields["params"],
                            update=fields["update"],
                            state=state,
                            grads=fields.get("grads"),
                            direction=fields.get("direction"),
                            **{name: row[name] for name in _SCALARS},
                        )
                    )
                    given.append(fields["given"])
                sequences[scenario] = (steps, given)
        loss = None
        if "loss" in header:
            count = int(header["loss"]["batches"])
            logits = [arrays[f"{PREFIX}loss/logits/{k}"] for k in range(count)]
            targets = [arrays[f"{PREFIX}loss/targets/{k}"] for k in range(count)]
            values = [
                value if isinstance(value, str) else (value, arrays[f"{PREFIX}loss/grad/{i}"])
                for i, value in enumerate(header["loss"]["cases"])
            ]
            loss = (logits, targets, values)
        return TorchReplay(str(header["task"]), dict(header["owners"]), sequences, loss)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"the replay's record is malformed ({type(e).__name__}: {e})") from None


def judge_recorded(
    replay: TorchReplay,
    pair: Any,
    loop: Any,
    config: Any,
    params: Any,
    *,
    jit: bool = True,
) -> tuple[list[Verdict], dict[str, Any]]:
    """The replay rows of the user's JAX loop against torch's recorded side (as
    `parity.replay.rows.replay_verdicts` makes them with torch at hand).

    Args:
      replay: torch's side (`decode_replay`).
      pair: the JAX half of the pair (its task; the recipe's optimizer wrapping may read it).
      loop: a `parity.training.user_loop.TrainingLoop` with the JAX optimizer and/or loss.
      config: the cell's `RunConfig`.
      params: the initial Flax params (the golden's).
      jit: the JAX optimizer step and loss under ``jax.jit``.

    Returns:
      ``(rows, record)``, as `replay_verdicts`.
    """
    base = {"model": config.model, "precision": config.precision, "device": config.device}
    rows, record = [], {}
    start = time.perf_counter()
    if loop.jax_optimizer is not None and replay.sequences is not None:
        stepper = jax_stepper(pair, loop, config, jit=jit, params=params)
        result = judge_sequences(replay.sequences, stepper, RecordedLayout(replay.owners))
        row, record["optimizer"] = optimizer_row(result, **base)
        rows.append(row)
    if loop.jax_loss is not None and replay.loss is not None:
        logits, targets, values = replay.loss
        finding, cases = compare_losses(
            replay.task, values, loop.jax_loss, logits, targets, jit=jit
        )
        row, record["loss"] = loss_row(finding, cases, **base)
        rows.append(row)
    record["seconds"] = time.perf_counter() - start
    return rows, record


def recorded_gate(step0: Any, replay: TorchReplay | None, pair: Any, config: Any, params: Any):
    """`judge_recorded`'s rows added to a passing step-0 result of a golden check, gating
    training as in `parity.cell.run_cell` (a failing row fails it); unchanged without the
    user's JAX loop or a recorded replay."""
    loop = getattr(pair, "loop", None)
    if not step0.passed or loop is None or replay is None:
        return step0
    rows, _ = judge_recorded(replay, pair, loop, config, params, jit=loop.replay_jit)
    return dataclasses.replace(
        step0,
        verdicts=list(step0.verdicts) + rows,
        passed=not any(row.passed is False for row in rows),
    )
