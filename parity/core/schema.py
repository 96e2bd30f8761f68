"""The schema of a run record in ``results.json``: every field a reader uses, its JSON type and
range, checked by `parity.core.records.validate_run` before compare, the report or the plots read it.

A results file is read by compare, the report and the plots; each field they read is checked
first, so a malformed file gets one error naming the file, the run and the field instead of a
traceback from deep inside a reader. A schema entry is a `Kind` (a JSON type, nullable or not),
a dict of fields (an object; ``"!name"`` marks a required field; other keys are free), a
one-element list (a list of that kind) or `Nullable` around an object or list that may be null.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_DEPTH", "RUN_SCHEMA", "RUN_STATUSES", "check_schema", "depth_exceeds", "describe"]

RUN_STATUSES = ("completed", "error", "unsupported")

MAX_DEPTH = 32  # deeper JSON than any writer makes; refused before anything walks it


@dataclasses.dataclass(frozen=True)
class Kind:
    """A JSON scalar: what is allowed (in words, for the message), the check, and whether null
    is allowed."""

    allowed: str
    check: Callable[[Any], bool]
    nullable: bool = True

    def not_null(self) -> Kind:
        return dataclasses.replace(self, nullable=False)


@dataclasses.dataclass(frozen=True)
class Nullable:
    """An object or list schema whose value may also be null."""

    schema: Any


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    return _is_number(x) and math.isfinite(x)


_NUMBER = Kind("a number", _is_number)
_FINITE = Kind("a finite number", _finite)
_COUNT = Kind("an integer >= 0", lambda x: _is_int(x) and x >= 0)
_STR = Kind("a string", lambda x: isinstance(x, str))
_BOOL = Kind("true or false", lambda x: isinstance(x, bool))
_SCALAR = Kind("a string, number, boolean or null", lambda x: isinstance(x, str | int | float))
_DURATION = Kind("a finite number >= 0", lambda x: _finite(x) and x >= 0)
_BYTES = _DURATION
# A loss scale multiplies the loss: negative is no scale at all (and inf is an overflow). Zero is
# what torch's GradScaler reaches after ~165 backoffs (it has no floor); such a step can only
# skip, which `parity.core.records.validate_run` checks.
_SCALE = Kind("a finite number >= 0", lambda x: _finite(x) and x >= 0)

_STEP = {
    "!step": _COUNT.not_null(),
    "!loss": _NUMBER,
    "loss_finite": _BOOL.not_null(),
    "loss_scale": _SCALE,
    "skipped": _BOOL.not_null(),
    "time_s": _DURATION,
    # parity.training.steps: unscaled global gradient norm before clipping, update norm, and
    # with loss scaling {parameter: largest |scaled gradient|} (null where not finite)
    "grad_norm": _DURATION,
    "update_norm": _DURATION,
    "max_scaled_grad": Nullable({}),
}
_SUMMARY = {
    **{
        name: _NUMBER
        for name in (
            "final_loss",
            "final_loss_mean_last5",
            "eval_metric",
            "step_time_median_s",
            "step_time_p10_s",
            "step_time_p90_s",
            "first_step_time_s",
            "compile_time_s",
            "throughput_samples_per_s",
            "throughput_tokens_per_s",
            "optimizer_state_bytes_per_param",
        )
    },
    **{name: _BYTES for name in ("peak_memory_bytes", "optimizer_state_bytes")},
    **{name: _COUNT for name in ("param_count", "measured_steps", "first_nonfinite_step")},
    "skipped_steps": _COUNT.not_null(),
    "steps_completed": _COUNT.not_null(),
    "diverged": _BOOL.not_null(),
    **{
        name: _STR
        for name in (
            "error",
            "stopped_reason",
            "peak_memory_method",
            "peak_memory_method_description",
            "compile_time_method",
            "eval_metric_name",
            "optimizer_state_method",
        )
    },
    "peak_memory_detail": Nullable({}),
}
# What `parity.core.hardware.hardware_summary` and the speed tables read of `hardware_info()`.
_HARDWARE = {
    "!cpu": {
        "!model": _STR.not_null(),
        "!available_cpus": _COUNT,
        "!flags": [_STR.not_null()],
        "flags_known": _BOOL,
        "load_average": Nullable([_NUMBER.not_null()]),
    },
    "torch": Nullable(
        {
            "!version": _STR,
            "!cpu_capability": _STR,
            "!intra_op_threads": _COUNT,
            "cuda_devices": Nullable([_STR.not_null()]),
        }
    ),
    "jax": Nullable(
        {
            "!version": _STR,
            "!devices": [_STR.not_null()],
            "!cpu_intra_op_threads": _COUNT,
        }
    ),
    "torch_bf16_emulated": _BOOL,
    "env": Nullable({}),
}
# `parity.verdicts.rows.Verdict.to_dict()`, as `parity.verdicts.step0` stores it.
_VERDICT = {
    **{f"!{name}": _STR.not_null() for name in ("model", "precision", "device", "check")},
    "!compared": _STR.not_null(),
    "!value": _SCALAR,
    "!tolerance": _SCALAR,
    "!passed": _BOOL,
    "detail": _STR.not_null(),
    "mode": _STR.not_null(),
    "unit": _STR.not_null(),
    "first_failing_step": _COUNT,
    "worst_step": _COUNT,
    "step0_gap": _NUMBER,
    "absolute": _NUMBER,
    "power": _NUMBER,
}
_DIAGNOSIS = {
    "markdown": _STR,
    "first_failing": _SCALAR,
    "first_failing_kind": _SCALAR,
    "first_failing_stage": _SCALAR,
}
# `parity.core.records.eval_logit_point`: a language model's eval logits, sampled.
_EVAL_LOGITS = {
    "!step": _COUNT.not_null(),
    "!vocab": Kind("an integer >= 1", lambda x: _is_int(x) and x >= 1, nullable=False),
    "!positions": [_COUNT.not_null()],
    "inputs_sha256": _STR,
    "!logits_b64": _STR.not_null(),
}
# `parity.perf.phases.PhaseClock.as_records`: where the cell's time went.
_PHASE = {
    "!phase": _STR.not_null(),
    "!wall_s": _DURATION.not_null(),
    "!cpu_s": _DURATION.not_null(),
}
RUN_SCHEMA = {
    **{f"!{name}": _STR.not_null() for name in ("framework", "model", "precision", "device")},
    "status": Kind(f"one of {RUN_STATUSES}", lambda x: x in RUN_STATUSES),
    "reason": _STR,
    "seed": Kind(f"an integer in [0, {2**63 - 1}]", lambda x: _is_int(x) and 0 <= x < 2**63),
    "variant": _STR,
    "policy": _STR,
    "torch_mode": Kind("'eager' or 'compile'", lambda x: x in ("eager", "compile")),
    "mixed_precision_method": _STR,
    # A distributed run's side: its label ("jax:jit ddp"), its arm ("ddp"), the arm's checks.
    "distributed": _STR,
    "arm": _STR,
    "distributed_verdicts": [_VERDICT],
    "versions": {},
    "hardware": Nullable(_HARDWARE),
    "config": Nullable({}),
    "model_config": Nullable({}),
    "!steps": [_STEP],
    "!summary": _SUMMARY,
    "step0": Nullable(
        {
            "passed": _BOOL,
            "summary": _STR,
            "verdicts": [_VERDICT],
            "worst_output": Nullable([_SCALAR]),
            "worst_parameter": Nullable([_SCALAR]),
            "compute_flops": Nullable({}),
            "diagnosis": Nullable(_DIAGNOSIS),
            "diagnosis_error": _STR,
            "examples": Nullable({"!compared": _COUNT, "!batch": _COUNT}),
        }
    ),
    "diagnosis": Nullable(_DIAGNOSIS),
    "eval_logits": Nullable([_EVAL_LOGITS]),
    "phases": Nullable([_PHASE]),
}


def describe(x: Any) -> str:
    return "null" if x is None else f"{type(x).__name__} {x!r}"[:80]


def check_schema(value: Any, schema: Any, where: str, fail: Callable[[str, str], None]) -> None:
    """Checks `value` against `schema`; calls ``fail(field, message)`` at the first problem."""
    if isinstance(schema, Kind):
        if value is None:
            if not schema.nullable:
                fail(where, f"must be {schema.allowed}; got null")
        elif not schema.check(value):
            fail(where, f"must be {schema.allowed}; got {describe(value)}")
        return
    if isinstance(schema, Nullable):
        if value is None:
            return
        schema = schema.schema
    if isinstance(schema, list):
        if not isinstance(value, list):
            fail(where, f"must be a list; got {describe(value)}")
        for i, item in enumerate(value):
            check_schema(item, schema[0], f"{where}[{i}]", fail)
        return
    if not isinstance(value, dict):
        fail(where, f"must be an object; got {describe(value)}")
    for key, sub in schema.items():
        name = key.lstrip("!")
        field = f"{where}.{name}" if where else name
        if name not in value:
            if key.startswith("!"):
                fail(field, "missing (required)")
            continue
        check_schema(value[name], sub, field, fail)


def depth_exceeds(data: Any, limit: int) -> bool:
    """Whether `data` nests deeper than `limit` (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > limit:
                return True
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
    return False
