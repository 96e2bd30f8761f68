"""The golden file: its schema, its one writer and its reader (`parity.golden.check` checks it).

One ``.npz`` (``numpy.savez_compressed``; read with ``allow_pickle=False``): arrays under
``init/`` (the initial Flax variables, float32), ``batch/K/`` and ``eval/K/`` (``inputs``,
``targets``), ``step0/STAGE/`` (torch's ``eval_logits``, ``train_logits``, ``grads/...``,
``stats/...``), ``probe/`` and ``layers/`` (the layer probe's torch side and torch's layer
outputs, `parity.golden.step0_data`), and the JSON header under ``header.json``: ``format`` (`FORMAT`),
``schema_version`` (`SCHEMA_VERSION`), ``config`` (`RunConfig.to_dict`), ``model`` (name, task,
configuration, the ``"module:attr"`` of the Flax module under test), ``torch_run`` (torch's run
record, `parity.core.records` schema), ``step0.stages`` (stage, precision, dtype, loss scale, loss,
matmul FLOPs by dtype), ``step0.probe`` / ``step0.layers`` (what those arrays are),
``step0.torch_rows`` (the rows only torch computes: stochastic modules, folded tensors, padding
rows, dropout rates that differ) and ``step0.padding``, ``step0.optimizer`` (a low-bit AdamW
precision's torchao step, arrays under ``optim/``), ``data`` (batch counts), ``versions`` and
``hardware``. `load_golden`
validates all of it before anything runs and names the offending field. No torch here.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parity.core.config import RunConfig
from parity.core.hardware import hardware_info, versions
from parity.core.records import ResultsFileError, validate_run, write_bytes_atomic
from parity.core.stored_rows import LEGACY_KINDS
from parity.golden.step0_data import (
    decode_layers,
    decode_optimizer,
    decode_probe,
    encode_layers,
    encode_optimizer,
    encode_probe,
)
from parity.replay.record import TorchReplay, decode_replay, encode_replay
from parity.verdicts.checks import CHECKS
from parity.verdicts.optim_judge import OptimizerRecord
from parity.verdicts.probe_judge import ProbeRecord
from parity.verdicts.rows import Verdict
from parity.verdicts.sides import Side, flatten

__all__ = [
    "FORMAT",
    "HEADER_KEY",
    "SCHEMA_VERSION",
    "BatchList",
    "Golden",
    "GoldenFileError",
    "load_golden",
    "upgrade_header",
    "validate_golden",
    "write_golden",
]

FORMAT = "parity-golden"
# 2: step 0's rows beyond outputs and gradients recorded (the layer probe's torch side, torch's
# layer outputs for the diagnosis, the torch-only rows): a version-1 file would check fewer rows.
# 3: every torch-only row carries its kind (`Verdict.kind`), which the diagnosis reads to name a
# cause (a random draw torch made, tensors the mapping folds); a version-2 file is read by
# `upgrade_header`, which names its rows' kinds.
SCHEMA_VERSION = 3

# The labels version 2's writer gave the torch-only rows it wrote without a kind, each with the
# kind run records' old rows of that label have (`parity.core.stored_rows.LEGACY_KINDS`, where
# every label's kind is written once).
_V2_KINDS = {
    label: LEGACY_KINDS[label]
    for label in (
        "step 0: deterministic train-mode forward (torch)",
        "step 0: tensors folded by the mapping",
        "step 0: embedding rows torch never trains (padding_idx)",
        "step 0: dropout rates differ (turned off on both sides)",
    )
}
HEADER_KEY = "header.json"


class GoldenFileError(ValueError):
    """A golden file that cannot be read or breaks the schema.

    Attributes:
      path: the file (None in memory).
      field: the offending header field or array key (None for file-level problems).
    """

    def __init__(self, message: str, *, path: Any = None, field: str | None = None):
        self.path = None if path is None else str(path)
        self.field = field
        where = self.path or "golden"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {message}")


def _nest(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split("/")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


@dataclasses.dataclass(frozen=True)
class Golden:
    """A loaded, validated golden file (`load_golden`).

    Attributes:
      header: the JSON header (format, schema version, config, model, torch run, step 0,
        data, versions, hardware).
      arrays: every array by key.
      path: where it was read from (None in memory).
    """

    header: dict[str, Any]
    arrays: dict[str, np.ndarray]
    path: str | None = None

    @property
    def config(self) -> RunConfig:
        """The cell's `RunConfig` (the one both sides were configured with)."""
        return RunConfig.from_dict(self.header["config"])

    @property
    def torch_run(self) -> dict[str, Any]:
        """torch's run record (`parity.core.records` schema)."""
        return self.header["torch_run"]

    @property
    def stages(self) -> list[dict[str, Any]]:
        """Step-0 stages: ``{"stage", "precision", "dtype", "loss_scale", "loss", "flops"}``."""
        return self.header["step0"]["stages"]

    @property
    def replay(self) -> TorchReplay | None:
        """torch's side of the replay of the user's torch loop (None when not recorded)."""
        if "replay" not in self.header:
            return None
        return decode_replay(self.header["replay"], self.arrays)

    def variables(self) -> dict[str, Any]:
        """The initial Flax variables (``{"params": ..., maybe "batch_stats": ...}``, float32)."""
        return _nest(
            {k[len("init/") :]: v for k, v in self.arrays.items() if k.startswith("init/")}
        )

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(inputs, targets)`` of training step `step`."""
        count = self.header["data"]["train_batches"]
        if not 0 <= step < count:
            raise ValueError(f"golden: step {step} outside the {count} recorded batches.")
        return self.arrays[f"batch/{step}/inputs"], self.arrays[f"batch/{step}/targets"]

    def eval_batches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The recorded held-out batches (empty when the run did not evaluate)."""
        return [
            (self.arrays[f"eval/{k}/inputs"], self.arrays[f"eval/{k}/targets"])
            for k in range(self.header["data"]["eval_batches"])
        ]

    def probe(self) -> ProbeRecord | None:
        """torch's side of the layer probe (None when it did not run: `probe_error` says why)."""
        info = self.header["step0"]["probe"]
        return None if "error" in info else decode_probe(info, self.arrays)

    @property
    def probe_error(self) -> str | None:
        """Why torch's side of the layer probe did not run (None when it did)."""
        return self.header["step0"]["probe"].get("error")

    def layer_outputs(self, stage: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """torch's layer outputs at `stage`, ``(eval, train)`` in execution order (the
        diagnosis's torch side)."""
        return decode_layers(self.header["step0"]["layers"], self.arrays, stage)

    def module_pairs(self) -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
        """``([(torch module, Flax module path), ...], unmatched torch modules)``."""
        layers = self.header["step0"]["layers"]
        pairs = [(str(t), tuple(str(p) for p in f)) for t, f in layers["pairs"]]
        return pairs, [str(n) for n in layers["unmatched"]]

    def torch_rows(self) -> list[Verdict]:
        """The step-0 rows only torch computes (stochastic modules, folded tensors, padding
        rows), as recorded."""
        return [Verdict.from_dict(row) for row in self.header["step0"]["torch_rows"]]

    def optimizer(self) -> tuple[OptimizerRecord, dict[str, Any]] | None:
        """torchao's recorded optimizer step and the JAX state's block order (a low-bit AdamW
        precision), or None (any other precision)."""
        info = self.header["step0"].get("optimizer")
        return None if info is None else decode_optimizer(info, self.arrays)

    def padding(self) -> dict[str, tuple[str, int]]:
        """``{Flax gradient key: (torch weight, padding_idx)}``: embedding rows torch never
        trains, left out of the gradient comparison."""
        return {k: (str(v[0]), int(v[1])) for k, v in self.header["step0"]["padding"].items()}

    def side(self, stage: str) -> Side:
        """torch's step-0 `Side` at `stage` (``"fp32"`` or the run's precision)."""
        info = next(s for s in self.stages if s["stage"] == stage)
        prefix = f"step0/{stage}/"

        def group(name: str) -> dict[str, np.ndarray]:
            start = f"{prefix}{name}/"
            return {k[len(start) :]: v for k, v in self.arrays.items() if k.startswith(start)}

        return Side(
            self.arrays[prefix + "eval_logits"],
            self.arrays[prefix + "train_logits"],
            float(info["loss"]),
            group("grads"),
            group("stats"),
            info.get("flops"),
        )


def write_golden(
    path: str | os.PathLike,
    *,
    config: RunConfig,
    model: Mapping[str, Any],
    torch_run: Mapping[str, Any],
    variables: Mapping[str, Any],
    batches: Sequence[tuple[Any, Any]],
    eval_batches: Sequence[tuple[Any, Any]],
    sides: Sequence[tuple[str, str, float, Side]],
    step0: Mapping[str, Any],
    replay: TorchReplay | None = None,
) -> Path:
    """Writes a golden file atomically (the one writer; `parity.golden.export` calls it).

    Args:
      path: the ``.npz`` file.
      config: the cell's configuration.
      model: ``{"name", "task", "config", "flax_model"}`` (``flax_model``: ``"module:attr"`` of
        the Flax module or of a zero-argument factory, or None).
      torch_run: torch's run record.
      variables: the initial Flax variables (float32).
      batches: one ``(inputs, targets)`` pair per training step.
      eval_batches: the held-out batches (empty when the run does not evaluate).
      sides: ``(stage, precision, loss scale, torch Side)`` per step-0 stage.
      step0: the rest of torch's step 0 (`parity.golden.export`): ``probe`` (a
        `parity.verdicts.probe_judge.ProbeRecord`, or None with ``probe_error``), ``pairs`` and
        ``unmatched`` (module pairs), ``layers`` (``{stage: (eval, train)}`` layer outputs),
        ``torch_rows`` (`Verdict` rows only torch computes), ``padding`` (embedding rows),
        ``optimizer`` (a low-bit AdamW precision: ``(parity.verdicts.optim_judge.OptimizerRecord,
        block order)``; absent or None otherwise).
      replay: torch's side of the replay of the user's torch loop (`parity.replay.record`), or
        None (the harness's own loop, or none of the user's to replay).

    Returns:
      `path` as a `Path`, validated by reading it back.
    """
    arrays: dict[str, np.ndarray] = {}
    for key, value in flatten(dict(variables)).items():
        arrays[f"init/{key}"] = value
    for kind, group in (("batch", batches), ("eval", eval_batches)):
        for k, (inputs, targets) in enumerate(group):
            arrays[f"{kind}/{k}/inputs"] = np.asarray(inputs)
            arrays[f"{kind}/{k}/targets"] = np.asarray(targets)
    stages = []
    for stage, precision, scale, side in sides:
        prefix = f"step0/{stage}/"
        arrays[prefix + "eval_logits"] = np.asarray(side.eval_logits, np.float32)
        arrays[prefix + "train_logits"] = np.asarray(side.train_logits, np.float32)
        for name, group_ in (("grads", side.grads), ("stats", side.stats)):
            for key, value in group_.items():
                arrays[f"{prefix}{name}/{key}"] = np.asarray(value, np.float32)
        stages.append(
            {
                "stage": stage,
                "precision": precision,
                "dtype": RunConfig(model=config.model, precision=precision).compute_dtype,
                "loss_scale": float(scale),
                "loss": float(side.loss),
                "flops": side.flops,
            }
        )
    probe_header, probe_arrays = encode_probe(step0["probe"], step0.get("probe_error"))
    layers_header, layers_arrays = encode_layers(
        step0["pairs"], step0["unmatched"], step0["layers"]
    )
    arrays.update(probe_arrays)
    arrays.update(layers_arrays)
    optimizer_header = None
    if step0.get("optimizer") is not None:
        record, block_order = step0["optimizer"]
        optimizer_header, optimizer_arrays = encode_optimizer(record, block_order, arrays)
        arrays.update(optimizer_arrays)
    header = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "config": config.to_dict(),
        "model": dict(model),
        "torch_run": dict(torch_run),
        "step0": {
            "stages": stages,
            "probe": probe_header,
            "layers": layers_header,
            "torch_rows": [row.to_dict() for row in step0["torch_rows"]],
            "padding": {k: [v[0], int(v[1])] for k, v in step0["padding"].items()},
            "optimizer": optimizer_header,
        },
        "data": {"train_batches": len(batches), "eval_batches": len(eval_batches)},
        "versions": versions(),
        "hardware": hardware_info(),
    }
    if replay is not None:
        header["replay"], replay_arrays = encode_replay(replay)
        arrays.update(replay_arrays)
    arrays[HEADER_KEY] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    validate_golden(header, arrays, path)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    out = write_bytes_atomic(path, buffer.getvalue())
    load_golden(out)
    return out


def _require(header: Any, key: str, kind: type | tuple, path, prefix="") -> Any:
    if not isinstance(header, Mapping):
        raise GoldenFileError(
            f"must be a JSON object; got {type(header).__name__}",
            path=path,
            field=prefix.rstrip(".") or None,
        )
    if key not in header:
        raise GoldenFileError("missing", path=path, field=prefix + key)
    value = header[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise GoldenFileError(
            f"must be {getattr(kind, '__name__', kind)}; got {type(value).__name__}",
            path=path,
            field=prefix + key,
        )
    return value


def validate_golden(header: Any, arrays: Mapping[str, np.ndarray], path: Any = None) -> None:
    """Checks a golden file's header and arrays against the schema.

    Raises:
      GoldenFileError: naming the file and the first offending field or array.
    """
    if not isinstance(header, dict):
        raise GoldenFileError(
            f"header must be a JSON object; got {type(header).__name__}", path=path
        )
    if header.get("format") != FORMAT:
        raise GoldenFileError(
            f"not a golden file (format {header.get('format')!r}, expected {FORMAT!r})",
            path=path,
            field="format",
        )
    version = header.get("schema_version")
    if version != SCHEMA_VERSION:
        raise GoldenFileError(
            f"schema_version {version!r}; this parity reads version {SCHEMA_VERSION} (export the "
            "golden again with this version, or check it with the parity that wrote it)",
            path=path,
            field="schema_version",
        )
    for key, kind in (
        ("config", dict),
        ("model", dict),
        ("torch_run", dict),
        ("step0", dict),
        ("data", dict),
        ("versions", dict),
        ("hardware", dict),
    ):
        _require(header, key, kind, path)
    try:
        config = RunConfig.from_dict(header["config"])
    except (TypeError, ValueError) as e:
        raise GoldenFileError(str(e), path=path, field="config") from None
    model = header["model"]
    _require(model, "name", str, path, "model.")
    _require(model, "task", str, path, "model.")
    if model.get("flax_model") is not None and not isinstance(model["flax_model"], str):
        raise GoldenFileError("must be 'module:attr' or null", path=path, field="model.flax_model")
    try:
        validate_run(header["torch_run"])
    except ResultsFileError as e:
        field = "torch_run" + (f".{e.field}" if e.field else "")
        raise GoldenFileError(str(e).split(": ", 1)[-1], path=path, field=field) from None
    if header["torch_run"]["framework"] != "torch":
        raise GoldenFileError("must be torch's run", path=path, field="torch_run.framework")
    data = header["data"]
    count = _require(data, "train_batches", int, path, "data.")
    evals = _require(data, "eval_batches", int, path, "data.")
    for kind, n in (("batch", count), ("eval", evals)):
        held = sum(1 for k in arrays if k.startswith(f"{kind}/") and k.endswith("/inputs"))
        if n != held:
            raise GoldenFileError(
                f"says {n} {kind} batches; the archive holds {held}",
                path=path,
                field=f"data.{'train' if kind == 'batch' else 'eval'}_batches",
            )
    if "replay" in header:
        try:
            decode_replay(header["replay"], arrays)
        except ValueError as e:
            raise GoldenFileError(str(e), path=path, field="replay") from None
    if count < config.steps:
        raise GoldenFileError(
            f"{count} training batches for {config.steps} steps",
            path=path,
            field="data",
        )
    needed = [
        f"{kind}/{k}/{part}"
        for kind, n in (("batch", count), ("eval", evals))
        for k in range(n)
        for part in ("inputs", "targets")
    ]
    if not any(k.startswith("init/params/") for k in arrays):
        needed.append("init/params/...")
    stages = _require(header["step0"], "stages", list, path, "step0.")
    if not stages:
        raise GoldenFileError("no step-0 stage recorded", path=path, field="step0.stages")
    for i, stage in enumerate(stages):
        where = f"step0.stages[{i}]."
        name = _require(stage, "stage", str, path, where)
        _require(stage, "precision", str, path, where)
        _require(stage, "loss_scale", (int, float), path, where)
        _require(stage, "loss", (int, float), path, where)
        needed += [f"step0/{name}/eval_logits", f"step0/{name}/train_logits"]
        needed += [
            f"step0/{name}/grads/{k[len('init/params/') :]}"
            for k in arrays
            if k.startswith("init/params/")
        ]
    step0 = header["step0"]
    for key, kind in (("probe", dict), ("layers", dict), ("torch_rows", list), ("padding", dict)):
        _require(step0, key, kind, path, "step0.")
    optimizer = step0.get("optimizer")
    if optimizer is None and getattr(config.recipe, "torchao_class", None):
        raise GoldenFileError(
            f"precision {config.precision!r} is judged at step 0 on torchao's optimizer step, "
            "which this file does not hold; export it again with this parity",
            path=path,
            field="step0.optimizer",
        )
    try:
        if optimizer is not None:
            decode_optimizer(optimizer, arrays)
        if "error" not in step0["probe"]:
            decode_probe(step0["probe"], arrays)
        for stage in step0["layers"]["stages"]:
            decode_layers(step0["layers"], arrays, stage)
        kinds = [Verdict.from_dict(row).kind for row in step0["torch_rows"]]
    except KeyError as e:
        raise GoldenFileError(
            f"step-0 record incomplete: {e.args[0]!r} missing", path=path, field="step0"
        ) from None
    except (TypeError, ValueError, AttributeError) as e:
        raise GoldenFileError(f"step-0 record malformed ({e})", path=path, field="step0") from None
    for i, kind in enumerate(kinds):
        if kind not in CHECKS:
            raise GoldenFileError(
                f"kind {kind!r} is no check's (known: {', '.join(sorted(CHECKS))})",
                path=path,
                field=f"step0.torch_rows[{i}].kind",
            )
    missing = [k for k in needed if k not in arrays and not k.endswith("...")]
    missing += [k for k in needed if k.endswith("...")]
    if missing:
        raise GoldenFileError(
            f"arrays missing: {missing[:5]}" + (" ..." if len(missing) > 5 else ""),
            path=path,
            field=missing[0],
        )
    float_arrays = ("init/", "step0/", "optim/params/", "optim/grads/", "optim/after/")
    for key, value in arrays.items():
        if key.startswith(float_arrays) and value.dtype != np.float32:
            raise GoldenFileError(f"must be float32; got {value.dtype}", path=path, field=key)
        if key.startswith(float_arrays) and not np.all(np.isfinite(value)):
            raise GoldenFileError("holds non-finite values", path=path, field=key)


def _read_archive(path: Path) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at `path`; a file that cannot be read is a `GoldenFileError`
    saying what it looks like (empty, truncated or not an archive, damaged member)."""
    size = path.stat().st_size
    if size == 0:
        raise GoldenFileError("empty file (0 bytes): not a golden .npz archive", path=path)
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"PK\x03\x04":
        raise GoldenFileError(
            f"not a golden .npz archive (its first bytes are {magic!r}, a zip archive starts "
            "with b'PK\\x03\\x04')",
            path=path,
        )
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise GoldenFileError(
            f"truncated or damaged .npz archive of {size} bytes ({e}: its index at the end is "
            "missing or broken); export it again or restore it",
            path=path,
        ) from None
    arrays = {}
    with archive:
        for info in archive.infolist():
            key = info.filename[: -len(".npy")] if info.filename.endswith(".npy") else None
            if key is None:
                raise GoldenFileError(
                    f"archive member {info.filename!r} is not a .npy array", path=path
                )
            try:
                with archive.open(info) as member:
                    arrays[key] = np.lib.format.read_array(member, allow_pickle=False)
            except Exception as e:  # any parse error of a damaged member: zlib, zip CRC, npy header
                raise GoldenFileError(
                    f"damaged array {key!r} ({type(e).__name__}: {e}); export it again or "
                    "restore it",
                    path=path,
                    field=key,
                ) from None
    return arrays


def load_golden(path: str | os.PathLike) -> Golden:
    """Reads and validates a golden file.

    Raises:
      GoldenFileError: the file is missing, a folder, empty, not an ``.npz`` archive, truncated,
        damaged (a member that does not decompress or fails its checksum), or breaks the schema;
        the message names the file and what is wrong.
    """
    path = Path(path)
    if path.is_dir():
        raise GoldenFileError("is a folder; give the golden .npz file", path=path)
    if not path.is_file():
        raise GoldenFileError("no such file", path=path)
    try:
        arrays = _read_archive(path)
    except OSError as e:
        raise GoldenFileError(f"cannot be read ({e.strerror or e})", path=path) from None
    if HEADER_KEY not in arrays:
        raise GoldenFileError(
            f"no {HEADER_KEY} entry: an .npz archive, but not a golden file",
            path=path,
            field=HEADER_KEY,
        )
    try:
        header = json.loads(arrays.pop(HEADER_KEY).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise GoldenFileError(f"header is not JSON ({e})", path=path, field=HEADER_KEY) from None
    validate_golden(upgrade_header(header, path), arrays, path)
    return Golden(header, arrays, str(path))


def upgrade_header(header: Any, path: Any = None) -> Any:
    """A version-2 header read as version 3, in place (any other header unchanged): each
    torch-only step-0 row without a kind gets the kind of its label (`_V2_KINDS`), so an older
    file's rows name their causes as a new one's do.

    Raises:
      GoldenFileError: a version-2 row without a kind whose label version 2 never wrote.

    Example:
      >>> h = {"schema_version": 2, "step0": {"torch_rows": [
      ...     {"check": "step 0: tensors folded by the mapping", "kind": ""}]}}
      >>> upgrade_header(h)["step0"]["torch_rows"][0]["kind"], h["schema_version"]
      ('folded', 3)
    """
    if not isinstance(header, dict) or header.get("schema_version") != 2:
        return header
    rows = (header.get("step0") or {}).get("torch_rows") or []
    for i, row in enumerate(rows):
        if isinstance(row, dict) and not row.get("kind"):
            if row.get("check") not in _V2_KINDS:
                raise GoldenFileError(
                    f"a version-2 torch row without a kind, labelled {row.get('check')!r}, "
                    f"which version 2 never wrote (its labels: {sorted(_V2_KINDS)})",
                    path=path,
                    field=f"step0.torch_rows[{i}].check",
                )
            row["kind"] = _V2_KINDS[row["check"]]
    header["schema_version"] = 3
    return header


class BatchList:
    """Batches held in memory as a `parity.data.BatchStream`-like object: ``batch(step)``,
    ``eval_batches()``, ``batch_size``, ``input_shape`` (a golden file's, or a user's list).

    Raises:
      ValueError: no batches, or a step beyond them.
    """

    def __init__(self, batches: Sequence[tuple[Any, Any]], eval_batches: Sequence = ()):
        if isinstance(batches, str | bytes) or not isinstance(batches, Sequence) or not batches:
            raise ValueError(
                "batches: expected a non-empty sequence of (inputs, targets) pairs; got "
                f"{type(batches).__name__}."
            )
        self._batches = [(np.asarray(x), np.asarray(y)) for x, y in batches]
        self._eval = [(np.asarray(x), np.asarray(y)) for x, y in eval_batches or ()]
        inputs, _ = self._batches[0]
        self.batch_size = int(inputs.shape[0])
        self.input_shape = tuple(inputs.shape[1:])

    def __len__(self) -> int:
        return len(self._batches)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= step < len(self._batches):
            raise ValueError(f"batches: step {step} outside the {len(self._batches)} given.")
        return self._batches[step]

    def eval_batches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return list(self._eval)
