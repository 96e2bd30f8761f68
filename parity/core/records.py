"""Run records: the one schema of ``results.json``, how records are built, validated, merged and written.

``results.json`` is ``{"runs": [run, ...]}``. A run record::

    {"framework": "torch" | "jax", "model", "precision", "policy", "device", "status",
     "seed", "variant", "versions", "hardware", "config", "steps": [step, ...], "summary": {...}}

``status`` is ``"completed"`` (trained; it may still have diverged: see ``summary.diverged``),
``"error"`` (the trainer raised; ``summary.error`` says what) or ``"unsupported"`` (this hardware
cannot run the cell; ``reason`` says why; never a failure). ``variant`` is ``""`` for the run
that is compared across frameworks and names a calibration run otherwise (``"noise"``: the same
framework with an ulp-level perturbation, see `parity.verdicts.judge`). A step is ``{"step", "loss",
"loss_finite", "loss_scale", "skipped", "time_s"}``; a non-finite loss is stored as null.

Both trainers build their records here (`build_run_record`), so the fields cannot drift, and
this module imports neither torch nor the models: ``parity.training.train_jax`` runs without torch.

Every write goes to a temporary file in the same folder, gets the mode a plain ``open`` would
give (``0o666`` minus the umask), and is moved into place with ``os.replace``: an interrupted run
leaves the previous complete file, never half of one; `merge_runs` holds a lock on the folder's
results file around its read-modify-write, so concurrent writers lose no run. `load_results`
validates the whole file (`parity.core.schema`: every field a reader uses, step-0 rows and ``config``
included) and raises one `ResultsFileError` naming the file, the run and the field; rows stored
before rows had kinds are read as rows are written now (`parity.core.stored_rows`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jaxamp
from parity.core.config import ConfigError, RunConfig
from parity.core.eval_logits import eval_logit_sample
from parity.core.hardware import hardware_info, versions
from parity.core.losses import eval_metric_name
from parity.core.recipes import get_recipe
from parity.core.schema import MAX_DEPTH, RUN_SCHEMA, check_schema, depth_exceeds, describe
from parity.core.stored_rows import StoredRowError, upgrade_run

__all__ = [
    "MEMORY_METHODS",
    "RESULTS_FILE",
    "ResultsFileError",
    "TRAJECTORY_FIELDS",
    "build_error_record",
    "build_run_record",
    "build_unsupported_record",
    "comparable_labels",
    "config_differences",
    "config_run_key",
    "load_results",
    "merge_runs",
    "run_config",
    "run_key",
    "run_label",
    "run_seed",
    "run_status",
    "validate_results",
    "validate_run",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]

# The record's ``summary.peak_memory_method`` values and what each measured.
MEMORY_METHODS = {
    "torch_cuda_max_memory_allocated": "torch.cuda.max_memory_allocated() over the measured steps",
    "jax_gpu_peak_bytes_in_use": (
        "jax device.memory_stats()['peak_bytes_in_use'] with XLA_PYTHON_CLIENT_PREALLOCATE=false; "
        "process-wide (JAX has no reset), so run GPU cells in separate processes for per-run peaks"
    ),
    "xla_memory_analysis": "compiled train step memory_analysis(): argument + output + temp - alias bytes",
    "torch_profiler_cpu_allocations": (
        "torch.profiler(profile_memory=True) over one step: max running sum of CPU allocator "
        "events + bytes of params, optimizer state and batch live before the step"
    ),
}

RESULTS_FILE = "results.json"
FRAMEWORKS = ("torch", "jax")


class ResultsFileError(ValueError):
    """A results file (or an in-memory run record) that does not follow the schema.

    Attributes:
      path: the file (None for in-memory records).
      run_index: the index of the offending run in ``runs`` (None for file-level problems).
      field: the offending field, e.g. ``"steps[3].loss"`` (None for file-level problems).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike | None = None,
        run_index: int | None = None,
        field: str | None = None,
    ):
        self.path = None if path is None else str(path)
        self.run_index = run_index
        self.field = field
        where = self.path or "run records"
        if run_index is not None:
            where += f": run {run_index}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {message}")


# --- atomic writes -----------------------------------------------------------------------------


def _umask() -> int:
    # os.umask can only be read by setting it; /proc has it without the (racy) round trip.
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Writes `data` to `path` atomically, with the mode ``open(path, "w")`` would give.

    Args:
      path: the destination; missing parent folders are created.
      data: the file's bytes.

    Returns:
      `path` as a `Path`.

    Example:
      >>> import tempfile, pathlib
      >>> p = write_bytes_atomic(pathlib.Path(tempfile.mkdtemp()) / "x.bin", b"abc")
      >>> p.read_bytes()
      b'abc'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; the rename would keep that, so CI artifacts would be unreadable.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Writes `text` (UTF-8) to `path` atomically; see `write_bytes_atomic`.

    Example:
      >>> import tempfile, pathlib
      >>> write_text_atomic(pathlib.Path(tempfile.mkdtemp()) / "r.md", "# hi\\n").read_text()
      '# hi\\n'
    """
    return write_bytes_atomic(path, text.encode("utf-8"))


def _clean(value: Any) -> Any:
    # Strict JSON has no NaN/inf: a non-finite float becomes null (its `loss_finite` says why).
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Strict JSON (non-finite floats as null), written atomically.

    Example:
      >>> import tempfile, pathlib
      >>> p = write_json_atomic(pathlib.Path(tempfile.mkdtemp()) / "v.json", {"x": float("nan")})
      >>> p.read_text()
      '{\\n "x": null\\n}\\n'
    """
    return write_text_atomic(path, json.dumps(_clean(data), indent=1, allow_nan=False) + "\n")


# --- identity ----------------------------------------------------------------------------------


def run_seed(run: Mapping[str, Any]) -> int:
    """The run's data seed: ``config.data_seed``, else the top-level ``seed``, else ``config.seed``."""
    config = run.get("config") or {}
    seed = config.get("data_seed")
    if seed is None:
        seed = run.get("seed")
    if seed is None:
        seed = config.get("seed", 0)
    return int(seed)


def run_key(run: Mapping[str, Any]) -> tuple:
    """Identity of a run inside a results file: writing a run replaces the one with its key.

    ``(model, precision, device, framework, torch mode, data seed, variant, data)``: the K seeds
    of seed statistics and the calibration variants live beside the main run, and so do runs on
    other data (``config.data``; records without it ran on ``"synthetic"``).
    """
    mode = run.get("torch_mode", "") if run["framework"] == "torch" else ""
    # A distributed run's sides ("torch ddp", "jax:jit ddp"...) live beside each other.
    mode = run.get("distributed") or mode
    return (
        run["model"],
        run["precision"],
        run["device"],
        run["framework"],
        mode or "",
        run_seed(run),
        run.get("variant") or "",
        (run.get("config") or {}).get("data") or "synthetic",
    )


def config_run_key(framework: str, config: Any, variant: str = "") -> tuple:
    """The `run_key` the run of `framework` with `config` will have (for resuming a matrix)."""
    mode = ("compile" if config.torch_compile else "eager") if framework == "torch" else ""
    return (
        config.model,
        config.precision,
        config.device,
        framework,
        mode,
        config.stream_seed,
        variant,
        getattr(config, "data", None) or "synthetic",
    )


def run_label(run: Mapping[str, Any]) -> str:
    """``"torch"``, ``"torch-compile"`` or ``"jax"``; a distributed run's side names its arm
    (``"torch ddp"``, ``"jax:shard_map ddp"``); a calibration variant adds ``"~noise"``."""
    label = run["framework"]
    if run.get("distributed"):
        label = run["distributed"]
    elif run["framework"] == "torch" and run.get("torch_mode") == "compile":
        label = "torch-compile"
    if run.get("variant"):
        label += f"~{run['variant']}"
    return label


def comparable_labels(runs: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The (torch label, JAX label) pairs compared among one cell's main runs: each torch label
    against each JAX label of the same arm (``run["arm"]``: one device, or a distributed
    strategy, whose JAX side may run several modes).

    Example:
      >>> comparable_labels([{"framework": "torch"}, {"framework": "jax"}])
      [('torch', 'jax')]
    """
    arms: dict[str, dict[str, str]] = {"torch": {}, "jax": {}}
    for run in runs:
        arms[run["framework"]][run_label(run)] = run.get("arm") or "single"
    return sorted(
        (ref, cand)
        for ref, ref_arm in arms["torch"].items()
        for cand, cand_arm in arms["jax"].items()
        if ref_arm == cand_arm
    )


def run_status(run: Mapping[str, Any]) -> str:
    """``"completed"``, ``"error"`` or ``"unsupported"`` (records written before the field existed:
    derived from ``summary.error``)."""
    status = run.get("status")
    if status:
        return status
    return "error" if (run.get("summary") or {}).get("error") else "completed"


# `parity.core.config.RunConfig` fields that shape a trajectory: runs that differ in one are not
# comparable (their gap would measure the setting, not the port). The model, precision and device
# are the cell; the data seed groups runs (seed statistics vary it on purpose); timing warm-up,
# evaluation and torch.compile change no loss.
TRAJECTORY_FIELDS = (
    "steps",
    "batch_size",
    "seed",
    "data",
    "model_overrides",
    "optimizer",
    "lr",
    "weight_decay",
    "schedule",
    "lr_warmup_steps",
    "clip_norm",
)
_OPTIMIZER_FIELDS = {"adamw": ("betas", "eps"), "sgd": ("momentum",)}
_LOSS_SCALE_FIELDS = ("init_scale", "growth_interval")


def _stopped_early(run: Mapping[str, Any]) -> bool:
    summary = run["summary"]
    return bool(
        run_status(run) != "completed" or summary.get("diverged") or summary.get("stopped_reason")
    )


def config_differences(ref: Mapping[str, Any], cand: Mapping[str, Any]) -> list[str]:
    """What keeps two runs from being compared step for step: each differing trajectory setting
    with both values, and a difference in recorded steps (unless a run stopped early).

    Example:
      >>> a = {"framework": "torch", "config": {"lr": 1e-3}, "steps": [], "summary": {}}
      >>> config_differences(a, {**a, "framework": "jax", "config": {"lr": 1e-2}})
      ['lr (torch 0.001, jax 0.01)']
    """
    a, b = run_config(ref), run_config(cand)
    fields = TRAJECTORY_FIELDS + _OPTIMIZER_FIELDS.get(a.optimizer, ())
    if a.loss_scaling or b.loss_scaling:
        fields += _LOSS_SCALE_FIELDS
    names = (run_label(ref), run_label(cand))
    out = [
        f"{name} ({names[0]} {getattr(a, name)!r}, {names[1]} {getattr(b, name)!r})"
        for name in fields
        if getattr(a, name) != getattr(b, name)
    ]
    lengths = (len(ref["steps"]), len(cand["steps"]))
    if lengths[0] != lengths[1] and not (_stopped_early(ref) or _stopped_early(cand)):
        out.append(f"recorded steps ({names[0]} {lengths[0]}, {names[1]} {lengths[1]})")
    return out


# --- building ----------------------------------------------------------------------------------


def _policy_text(config: Any) -> str:
    return str(config.policy)


def _common(framework: str, config: Any, status: str) -> dict[str, Any]:
    if framework not in FRAMEWORKS:
        raise ValueError(f"run record: `framework` must be one of {FRAMEWORKS}; got {framework!r}.")
    return {
        "framework": framework,
        "model": config.model,
        "precision": config.precision,
        "policy": _policy_text(config),
        "device": config.device,
        "status": status,
        "seed": config.seed,
        "variant": "",
        "versions": versions(),
        "hardware": hardware_info(),
        "config": config.to_dict(),
    }


def build_run_record(
    *,
    framework: str,
    config: Any,
    pair: Any,
    stream: Any,
    steps_log: list[dict[str, Any]],
    timing: dict[str, Any],
    compile_time_s: float | None,
    compile_method: str | None,
    peak_memory: int | None,
    memory_method: str | None,
    eval_metric: float | None,
    stopped_reason: str | None,
    extra: dict[str, Any] | None = None,
    memory_detail: dict[str, Any] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    eval_logits: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The record of a completed (possibly diverged) run; both trainers call it.

    Args:
      framework: ``"torch"`` or ``"jax"``.
      config: the run's `parity.core.config.RunConfig`.
      pair: the model pair (its ``task`` and ``config`` are recorded).
      stream: the batch stream (its ``input_shape`` gives tokens/s for language models).
      steps_log: `parity.perf.measure.StepLog.steps`.
      timing: `parity.perf.measure.step_time_summary` output.
      compile_time_s, compile_method: compile time and how it was measured (None: nothing compiled).
      peak_memory, memory_method: peak bytes and the `MEMORY_METHODS` key.
      eval_metric: held-out metric, or None.
      stopped_reason: why the run stopped early (divergence guard), or None.
      extra: framework-specific top-level fields (``torch_mode``, ``mixed_precision_method``...).
      memory_detail: XLA's memory analysis fields, if any.
      optimizer_state: ``optimizer_state_bytes``, ``param_count``,
        ``optimizer_state_bytes_per_param`` and ``optimizer_state_method``
        (`parity.perf.measure.torch_optimizer_state` / `jax_optimizer_state`), into the summary.
      eval_logits: a language model's `parity.core.eval_logits.eval_logit_point` per eval
        point (``run["eval_logits"]``).

    Returns:
      The run record (see the module docstring); `validate_run` accepts it.

    Example:
      >>> # inside a trainer, after the loop:
      >>> # record = build_run_record(framework="jax", config=config, pair=pair, stream=stream,
      >>> #     steps_log=log.steps, timing=timing, ...)
    """
    losses = [s["loss"] for s in steps_log]
    nonfinite = [s["step"] for s in steps_log if not s["loss_finite"]]
    median = timing["step_time_median_s"]
    samples_per_s = config.batch_size / median if median else None
    tokens_per_s = None
    if pair.task == "lm" and median:
        tokens = 1
        for dim in stream.input_shape:
            tokens *= int(dim)
        tokens_per_s = config.batch_size * tokens / median
    tail = [x for x in losses[-5:] if x is not None]
    summary = {
        "step_time_median_s": median,
        "step_time_p10_s": timing["step_time_p10_s"],
        "step_time_p90_s": timing["step_time_p90_s"],
        "first_step_time_s": timing["first_step_time_s"],
        "measured_steps": timing["measured_steps"],
        "compile_time_s": compile_time_s,
        "compile_time_method": compile_method,
        "throughput_samples_per_s": samples_per_s,
        "throughput_tokens_per_s": tokens_per_s,
        "peak_memory_bytes": peak_memory,
        "peak_memory_method": memory_method,
        "peak_memory_method_description": MEMORY_METHODS.get(memory_method),
        "final_loss": losses[-1] if losses else None,
        "final_loss_mean_last5": sum(tail) / len(tail)
        if len(tail) == len(losses[-5:]) and tail
        else None,
        "eval_metric": eval_metric,
        "eval_metric_name": eval_metric_name(pair.task),
        "skipped_steps": sum(1 for s in steps_log if s["skipped"]),
        "steps_completed": len(steps_log),
        "diverged": bool(nonfinite) or stopped_reason is not None,
        "first_nonfinite_step": nonfinite[0] if nonfinite else None,
        "stopped_reason": stopped_reason,
    }
    if memory_detail:
        summary["peak_memory_detail"] = memory_detail
    summary.update(optimizer_state or {})
    run = _common(framework, config, "completed")
    run["model_config"] = {
        k: list(v) if isinstance(v, tuple) else v for k, v in dict(pair.config).items()
    }
    run["steps"] = steps_log
    run["summary"] = summary
    if eval_logits:
        run["eval_logits"] = list(eval_logits)
    run.update(extra or {})
    return run


def _empty_summary(**fields: Any) -> dict[str, Any]:
    summary = {
        "step_time_median_s": None,
        "compile_time_s": None,
        "peak_memory_bytes": None,
        "peak_memory_method": None,
        "final_loss": None,
        "eval_metric": None,
        "skipped_steps": 0,
        "diverged": False,
        "steps_completed": 0,
    }
    summary.update(fields)
    return summary


def _torch_mode(framework: str, config: Any) -> dict[str, str]:
    if framework != "torch":
        return {}
    return {"torch_mode": "compile" if config.torch_compile else "eager"}


def build_error_record(framework: str, config: Any, error: BaseException) -> dict[str, Any]:
    """The record of a run that raised: kept in results.json and failed by `compare`, not a crash.

    Example:
      >>> # except Exception as e: runs.append(build_error_record("jax", config, e))
    """
    run = _common(framework, config, "error")
    run["steps"] = []
    run["summary"] = _empty_summary(error=f"{type(error).__name__}: {str(error)[:500]}")
    run.update(_torch_mode(framework, config))
    return run


def build_unsupported_record(framework: str, config: Any, reason: str) -> dict[str, Any]:
    """The record of a cell this hardware cannot run: reported, never a failure.

    Args:
      framework: ``"torch"`` or ``"jax"``.
      config: the cell's `RunConfig`.
      reason: why, in words (e.g. from `parity.core.hardware.unsupported_reason`).

    Example:
      >>> # build_unsupported_record("torch", config, "torch has no bf16 LSTM kernel on AVX2")
    """
    if not isinstance(reason, str) or not reason:
        raise ValueError(
            f"build_unsupported_record: `reason` must be a non-empty string; got {reason!r}."
        )
    run = _common(framework, config, "unsupported")
    run["reason"] = reason
    run["steps"] = []
    run["summary"] = _empty_summary()
    run.update(_torch_mode(framework, config))
    return run


# --- validation --------------------------------------------------------------------------------


def run_config(run: Mapping[str, Any]) -> RunConfig:
    """The `RunConfig` a record's ``config`` describes (its missing fields at their defaults;
    fields this version does not know are left out, so older and newer records load).

    Raises:
      ConfigError: a field out of range or of the wrong kind (``error.field`` names it).
    """
    names = {f.name for f in dataclasses.fields(RunConfig)} | {"policy"}
    config = run.get("config") or {}
    return RunConfig.from_dict({k: v for k, v in config.items() if k in names})


def validate_run(run: Any, index: int | None = None, path: str | os.PathLike | None = None) -> None:
    """Checks one run record against the schema; raises `ResultsFileError` naming the field.

    Every field a reader uses is checked: the identity (framework, a precision a recipe runs,
    device), each step (a loss scale is a finite number > 0), the summary, the hardware
    record, the step-0 rows (each for the run's own cell) and ``config`` (every `RunConfig`
    field in range, agreeing with the run's model, precision and device).

    Args:
      run: the record.
      index: its index in ``runs`` (for the message).
      path: the file it came from (for the message).

    Example:
      >>> validate_run({"framework": "jax"})
      Traceback (most recent call last):
      ...
      parity.core.records.ResultsFileError: run records, field 'model': missing (required)
    """

    def fail(field: str, message: str):
        raise ResultsFileError(message, path=path, run_index=index, field=field)

    if not isinstance(run, dict):
        raise ResultsFileError(
            f"a run must be a JSON object; got {describe(run)}", path=path, run_index=index
        )
    if depth_exceeds(run, MAX_DEPTH):
        raise ResultsFileError(f"nested deeper than {MAX_DEPTH} levels", path=path, run_index=index)
    check_schema(run, RUN_SCHEMA, "", fail)
    if run["framework"] not in FRAMEWORKS:
        fail("framework", f"must be one of {FRAMEWORKS}; got {run['framework']!r}")
    if run["device"] not in ("cpu", "gpu"):
        fail("device", f"must be 'cpu' or 'gpu'; got {run['device']!r}")
    try:
        recipe = get_recipe(run["precision"])
    except ValueError as e:
        fail("precision", str(e))
    if run.get("policy") is not None:
        try:
            policy = jaxamp.get_policy(run["policy"])
        except (ValueError, TypeError) as e:
            fail("policy", str(e))
        if policy != recipe.policy:
            fail(
                "policy",
                f"{run['policy']!r} is not precision {run['precision']!r}'s policy "
                f"({str(recipe.policy)!r})",
            )
    if run.get("status") == "unsupported" and not isinstance(run.get("reason"), str):
        fail("reason", "an unsupported run must say why (a string)")
    for i, step in enumerate(run["steps"]):
        if step["step"] != i:
            fail(
                f"steps[{i}].step", f"must be {i} (steps are recorded in order); got {step['step']}"
            )
        if step.get("loss_scale") == 0 and not step.get("skipped"):
            fail(
                f"steps[{i}].loss_scale", "is 0 on a step that was not skipped (a zero scale skips)"
            )
    for i, point in enumerate(run.get("eval_logits") or []):
        try:
            eval_logit_sample(point)
        except ValueError as e:
            fail(f"eval_logits[{i}].logits_b64", str(e))
    cell = (run["model"], recipe.name, run["device"])
    for i, row in enumerate((run.get("step0") or {}).get("verdicts") or []):
        try:
            row_precision = get_recipe(row["precision"]).name
        except ValueError:
            row_precision = row["precision"]
        if (row["model"], row_precision, row["device"]) != cell:
            fail(
                f"step0.verdicts[{i}]",
                f"is a row of cell {(row['model'], row['precision'], row['device'])}, not of "
                f"this run's {cell}",
            )
    try:
        config = run_config(run)
    except ConfigError as e:
        fail(f"config.{e.field}", str(e))
    except (ValueError, TypeError) as e:
        fail("config", str(e))
    given = run.get("config") or {}
    for name, value in (("model", run["model"]), ("device", run["device"])):
        if name in given and getattr(config, name) != value:
            fail(f"config.{name}", f"{given[name]!r} disagrees with the run's {name} {value!r}")
    if "precision" in given and config.precision != recipe.name:
        fail("config.precision", f"{given['precision']!r} disagrees with {run['precision']!r}")


def validate_results(data: Any, path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Checks a whole results document (``{"runs": [...]}``); returns it.

    Raises:
      ResultsFileError: the first problem, naming `path`, the run index and the field.

    Example:
      >>> validate_results({"runs": []})
      {'runs': []}
    """
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ResultsFileError(
            f"not a parity results file (expected an object {{'runs': [...]}}; got {describe(data)})",
            path=path,
        )
    if depth_exceeds(data, MAX_DEPTH + 2):
        raise ResultsFileError(f"nested deeper than {MAX_DEPTH} levels", path=path)
    for index, run in enumerate(data["runs"]):
        validate_run(run, index, path)
    return data


def _read_results(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"runs": []}
    if not path.is_file():
        raise ResultsFileError("is not a file (a folder or a device?)", path=path)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"not valid JSON ({e})", path=path) from e
    except UnicodeDecodeError as e:
        raise ResultsFileError(f"not UTF-8 text ({e})", path=path) from e
    except RecursionError:
        raise ResultsFileError("nested too deeply to read", path=path) from None
    except OSError as e:
        raise ResultsFileError(f"cannot be read ({e.strerror or e})", path=path) from e
    validate_results(data, path)
    for index, run in enumerate(data["runs"]):  # rows stored before rows had kinds
        try:
            upgrade_run(run)
        except StoredRowError as e:
            raise ResultsFileError(e.reason, path=path, run_index=index, field=e.field) from None
    return data


def load_results(out_dir: str | os.PathLike) -> dict[str, Any]:
    """``DIR/results.json``, validated (``{"runs": []}`` if the file does not exist).

    Args:
      out_dir: the folder holding ``results.json``.

    Returns:
      ``{"runs": [run, ...]}``.

    Raises:
      ResultsFileError: the file is not JSON, not a file, or a run breaks the schema (the
        message names the file, the run and the field).

    Example:
      >>> import tempfile
      >>> load_results(tempfile.mkdtemp())
      {'runs': []}
    """
    return _read_results(Path(out_dir) / RESULTS_FILE)


@contextlib.contextmanager
def _results_lock(out_dir: Path) -> Iterator[None]:
    """An exclusive lock on the folder itself (fcntl.flock on its descriptor: no lock file is
    left behind, and the kernel releases it when the holder dies, so a crashed writer never
    leaves the folder locked)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def merge_runs(out_dir: str | os.PathLike, runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Adds `runs` to ``DIR/results.json`` (replacing runs with the same `run_key`), atomically.

    The read-modify-write holds an exclusive lock on the folder's results file, so processes
    merging into one folder at once (a matrix, a run and `compare_models` side by side) each
    keep every run; the write itself is atomic (`write_json_atomic`).

    Raises:
      ResultsFileError: the existing file or a new run breaks the schema (nothing is written).

    Example:
      >>> # data = merge_runs("runs/x", [torch_run, jax_run])
    """
    runs = list(runs)
    for index, run in enumerate(runs):
        validate_run(run, index)
    out = Path(out_dir)
    with _results_lock(out):
        data = load_results(out)
        new_keys = {run_key(r) for r in runs}
        kept = [r for r in data["runs"] if run_key(r) not in new_keys]
        data["runs"] = kept + runs
        write_json_atomic(out / RESULTS_FILE, data)
    return data
