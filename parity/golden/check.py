"""Golden trajectories: the torch side of a cell recorded once, the JAX side checked without torch.

A golden file holds everything the JAX side of a cell needs and everything its verdicts compare
against: the initial weights (Flax layout, float32), every training batch (and the held-out
batches when the run evaluates), torch's step-0 numbers at each stage (eval and train logits,
loss, every parameter's gradient, running statistics, matmul FLOPs by dtype, the loss scale),
torch's run record (per-step loss, loss scale and skips, and whatever else the trainer logs per
step; summary, config, versions, hardware) and the model's name, task and configuration.

`parity.golden.export.export_golden` (or ``python -m parity export``) writes it where torch is
installed; `check_golden` (or ``python -m parity check --golden FILE``) runs only the JAX side and
judges it with the harness's own verdicts: step 0 as `parity.verdicts.step0.check_step0`
computes it (`parity.golden.step0`: the output and gradient rows, the layer probe, the rows only
torch computes, the compute dtype, and on a failure the per-layer diagnosis naming the first
diverging layer) against the recorded torch side, then `parity.verdicts.judge.compare_runs` (as `parity.cell` judges a cell: every step covered, the
per-step gradient and update norms where both runs log them) on the recorded torch run and the
new JAX run. Neither this module nor anything it imports loads torch.

The file's schema, writer and reader are `parity.golden.format`'s (one ``.npz``: arrays and a
JSON header, versioned, validated before anything runs).

Recorded and current machines may differ. What the JAX side computes here is compared with what
torch computed there; the step-0 bands (`parity.verdicts.tolerance`) count one change of
accumulation order and one rounding to the compute dtype per layer between the two sides. When
torch's low-precision kernels there were of another class than torch's would be here (native
AVX512-BF16 / AMX / AVX512-FP16 kernels against their emulation), the recorded side may hold one
more rounding to the compute dtype per layer (an epilogue - bias add, activation - applied after
the product was stored in the compute dtype instead of before), so the low-precision step-0
bands grow by ``SAFETY * depth * u(dtype)`` (`hardware_allowance`), and only those. Float32
kernels on two CPUs differ only in accumulation order, which the band's ``sqrt(fan-in) *
u(float32)`` term already covers for any two implementations: no allowance. The trajectory bands
are not rounding counts and do not grow. A different JAX version is what the check exists to
catch: no allowance. The report lists every difference and what it changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from parity.core.config import RunConfig
from parity.core.hardware import UnsupportedHere, hardware_info, versions
from parity.core.records import (
    build_error_record,
    build_unsupported_record,
    write_json_atomic,
)
from parity.core.references import load_function, load_optax
from parity.golden.format import BatchList, Golden, GoldenFileError, load_golden
from parity.golden.step0 import golden_step0
from parity.pairs.adapters import AdapterError, as_flax_model
from parity.pairs.variables import as_variables, flatten_variables
from parity.replay.record import recorded_gate
from parity.training.train_jax import train_jax
from parity.training.user_loop import TrainingLoop
from parity.twins import TWIN_NAMES, flax_twin
from parity.verdicts.judge import compare_runs
from parity.verdicts.outcomes import (
    cell_bottom_lines,
    cell_configs,
    format_verdicts,
    overall_status,
)
from parity.verdicts.qualifiers import verdict
from parity.verdicts.rows import Verdict, cell_fields
from parity.verdicts.step0_result import Step0Failure, Step0Result
from parity.verdicts.tolerance import (
    SAFETY,
)

__all__ = [
    "EXIT_CODES",
    "GoldenResult",
    "add_check_parser",
    "bad_input",
    "check_golden",
    "check_fits",
    "check_pair",
    "flax_model_of",
    "flax_pair",
    "hardware_allowance",
    "load_flax_model",
    "main",
    "resolve_object",
    "run_check",
]

# `python -m parity`'s exit codes (README): one contract for every command.
EXIT_CODES = {"PASS": 0, "FAIL": 1, "NOTHING COMPARED": 3, "INCONCLUSIVE": 4}
BAD_INPUT = 2


# --- recorded against current machine ---------------------------------------------------------


def _capability(flags: set[str], restricted: str | None) -> str:
    """The ATen CPU capability a torch would pick from these CPU flags and ATEN_CPU_CAPABILITY."""
    detected = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "DEFAULT"
    order = ("DEFAULT", "AVX2", "AVX512")
    wanted = (restricted or "").upper()
    if wanted in order and order.index(wanted) < order.index(detected):
        return wanted
    return detected


def _kernel_classes(hardware: Mapping[str, Any], *, here: bool) -> dict[str, Any]:
    """Which kernels torch runs (or would run) float32, bfloat16 and float16 matmuls with."""
    flags = set((hardware.get("cpu") or {}).get("flags") or ())
    env = hardware.get("env") or {}
    recorded = hardware.get("torch") or {}
    capability = (
        str(recorded["cpu_capability"]).upper()
        if not here and recorded.get("cpu_capability")
        else _capability(flags, env.get("ATEN_CPU_CAPABILITY"))
    )
    # the rule of `parity.core.hardware.torch_bf16_is_emulated`, read from these flags and this env
    isa = str(env.get("ONEDNN_MAX_CPU_ISA") or "ALL").upper()
    onednn_low = isa == "ALL" or any(key in isa for key in ("BF16", "AMX", "FP16", "AVX10"))
    wide = capability in ("AVX512", "AMX") and onednn_low
    recorded_emulated = None if here else hardware.get("torch_bf16_emulated")
    bf16_native = (
        not recorded_emulated
        if recorded_emulated is not None
        else (wide and bool({"avx512_bf16", "amx_bf16"} & flags) if flags else None)
    )
    fp16_native = wide and bool({"avx512_fp16", "amx_fp16"} & flags) if flags else None
    return {"float32": capability, "bfloat16": bf16_native, "float16": fp16_native}


def _kernel_name(dtype: str, native: Any) -> str:
    if dtype == "float32":
        return f"ATen {native}"
    return {
        True: f"native {dtype}",
        False: f"{dtype} emulated in float32",
        None: "unknown",
    }[native]


def hardware_allowance(
    header: Mapping[str, Any], current: Mapping[str, Any] | None = None
) -> tuple[dict[str, float], list[str]]:
    """What the recorded machine's difference from this one justifies, and what it does not.

    Args:
      header: a golden header (its ``hardware`` and ``versions`` are the recorded machine's).
      current: `parity.core.hardware.hardware_info` of this machine (default: measured now).

    Returns:
      ``({dtype: extra roundings per layer}, notes)``: for each compute dtype whose torch
      kernel class differs (native against emulated), ``1.0`` (one more rounding to that
      dtype per layer, see the module docstring); notes say every difference found and what it
      changed (nothing, for float32 kernels, versions and thread counts).

    Example:
      >>> header = {"hardware": {"cpu": {"flags": ["avx2"]}, "torch_bf16_emulated": True,
      ...           "torch": {"cpu_capability": "AVX2"}}, "versions": {}}
      >>> here = {"cpu": {"flags": ["avx2", "avx512f", "avx512_bf16"]}, "env": {}}
      >>> extra, notes = hardware_allowance(header, here)
      >>> extra
      {'bfloat16': 1.0}
    """
    current = hardware_info() if current is None else current
    recorded_hw = header.get("hardware") or {}
    there = _kernel_classes(recorded_hw, here=False)
    here = _kernel_classes(current, here=True)
    extra: dict[str, float] = {}
    notes = []
    for dtype in ("float32", "bfloat16", "float16"):
        a, b = there[dtype], here[dtype]
        if a is None or b is None or a == b:
            continue
        change = f"torch's {dtype} kernels: recorded {_kernel_name(dtype, a)}, here {_kernel_name(dtype, b)}"
        if dtype == "float32":
            notes.append(
                f"{change}: float32 kernels differ in accumulation order only, which the step-0 "
                "band's sqrt(fan-in) x u(float32) term covers for any two implementations; "
                "no allowance"
            )
        else:
            extra[dtype] = 1.0
            notes.append(
                f"{change}: the recorded side may round each layer's output to {dtype} once "
                f"more (an epilogue after the stored product); the {dtype} step-0 bands grow by "
                f"{SAFETY:g} x depth x u({dtype}), the trajectory bands do not"
            )
    recorded_versions = header.get("versions") or {}
    now = versions()
    for name in ("jax", "jaxlib", "flax", "optax", "jaxamp", "numpy"):
        if recorded_versions.get(name) not in (None, now.get(name)):
            notes.append(
                f"{name} {recorded_versions[name]} when recorded, {now.get(name)} here: the JAX "
                "side is what is checked, so no allowance"
            )
    env_then = recorded_hw.get("env") or {}
    env_now = current.get("env") or {}
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        if env_then.get(name) != env_now.get(name):
            notes.append(
                f"{name}={env_then.get(name)} when recorded, {env_now.get(name)} here: it "
                "restricts torch's kernels only (XLA ignores it); counted in the kernel classes "
                "above"
            )
    return extra, notes


# --- the JAX side -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Pair:
    """The JAX half of a model pair (what `parity.training.train_jax` and the step-0 JAX side read)."""

    name: str
    task: str
    flax_model: Any
    config: dict
    mapping: Any = None
    loop: Any = None  # the user's JAX optimizer and loss (`TrainingLoop`, sides "jax")
    # a low-bit AdamW state's block order, recorded with torch (`_LowBitAdamW.torch_block_order`)
    block_order: Any = None

    def flax_apply(self, variables, inputs, train: bool):
        return self.flax_model.apply(variables, inputs, train)


def resolve_object(reference: str) -> Any:
    """The object ``"package.module:attr"`` names (``attr`` may be dotted).

    Raises:
      ValueError: a malformed reference, a module that does not import, a missing attribute.

    Example:
      >>> resolve_object("math:pi")
      3.141592653589793
    """
    if not isinstance(reference, str) or reference.count(":") != 1:
        raise ValueError(f"expected 'package.module:attr'; got {reference!r}.")
    module_name, attr = reference.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{reference!r}: module {module_name!r} does not import ({e}).") from None
    except Exception as e:  # the module's own code failed while importing: still bad input here
        raise ValueError(
            f"{reference!r}: importing module {module_name!r} failed ({type(e).__name__}: {e})."
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{reference!r}: {module_name!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    return obj


def _flax_model(golden: Golden, flax_model: Any) -> Any:
    if flax_model is None:
        reference = golden.header["model"].get("flax_model")
        if reference is None:
            # a built-in model's golden: its twin (torch-free) from the recorded configuration
            model = golden.header["model"]
            if model["name"] not in TWIN_NAMES:
                raise GoldenFileError(
                    f"names no Flax model (model {model['name']!r} is not a built-in one); pass "
                    "flax_model= (--flax-model MODULE:ATTR)",
                    path=golden.path,
                    field="model.flax_model",
                )
            try:
                return flax_twin(model["name"], model.get("config") or {})
            except (TypeError, ValueError) as e:
                raise GoldenFileError(str(e), path=golden.path, field="model.config") from None
        flax_model = reference
    return flax_model


def load_flax_model(reference: Any) -> Any:
    """A Flax model from ``"module:attr"`` (a module, a module class or a zero-argument
    factory), or `reference` itself when it is already a model.

    Raises:
      ValueError: the reference does not resolve, the factory fails, or what it gives is not a
        Flax model (a linen or NNX module, a Hugging Face Flax model); the message names it.
    """
    obj = resolve_object(reference) if isinstance(reference, str) else reference
    if isinstance(obj, type) or (
        callable(obj) and not hasattr(obj, "apply") and not hasattr(obj, "module")
    ):
        try:
            obj = obj()
        except Exception as e:  # a factory that needs arguments, or fails: bad input here
            raise ValueError(
                f"flax model {reference!r}: calling it with no arguments failed "
                f"({type(e).__name__}: {e}); name a Flax module or a zero-argument factory."
            ) from None
    return obj


def flax_model_of(reference: Any, *, flax_kwargs: Any = None) -> Any:
    """`load_flax_model` wrapped as a `parity.pairs.adapters.FlaxModel`.

    Raises:
      ValueError: as `load_flax_model`, or what the reference gives is not a Flax model (a
        linen or NNX module, a Hugging Face Flax model); the message names the reference.

    Example:
      >>> flax_model_of("os:getcwd")
      Traceback (most recent call last):
      ...
      ValueError: flax model 'os:getcwd' is not a Flax model: the Flax side must be ...
    """
    obj = load_flax_model(reference)
    try:
        return as_flax_model(obj, flax_kwargs=flax_kwargs)
    except AdapterError as e:
        raise ValueError(f"flax model {reference!r} is not a Flax model: {e}") from None


@dataclasses.dataclass(frozen=True)
class GoldenResult:
    """What `check_golden` returns.

    Attributes:
      status: ``"PASS"``, ``"FAIL"``, ``"INCONCLUSIVE"`` or ``"NOTHING COMPARED"``
        (`parity.verdicts.outcomes.overall_status`).
      verdicts: the step-0 rows, then `parity.verdicts.judge.compare_runs`'s.
      runs: ``[torch's recorded run, the JAX run]``.
      notes: every recorded-versus-current difference and what it changed.
      golden: the golden file checked.
    """

    status: str
    verdicts: list[Verdict]
    runs: list[dict[str, Any]]
    notes: list[str]
    golden: str | None

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    @property
    def exit_code(self) -> int:
        """`python -m parity`'s exit code for this outcome."""
        return EXIT_CODES.get(self.status, EXIT_CODES["NOTHING COMPARED"])

    def report(self) -> str:
        """The verdict table, the explanation of each failing row, the bottom line per cell
        and the recorded-versus-current notes."""
        configs = cell_configs(self.runs)
        lines = [format_verdicts(self.verdicts, configs)]
        for cell, line in cell_bottom_lines(self.verdicts, configs).items():
            line = f"{' '.join(cell)}: {line}"
            if line not in lines[0]:  # the table's summary already says an undecided cell's
                lines.append(line)
        diagnosis = (self.runs[1].get("step0") or {}).get("diagnosis")
        if diagnosis:  # the per-layer table and the first diverging layer, as compare_models
            lines.append(diagnosis["markdown"].rstrip())
        lines.append(f"golden: {self.golden}")
        recorded = self.runs[0]
        lines.append(
            "reference: torch run recorded "
            + ", ".join(
                f"{k} {v}"
                for k, v in (recorded.get("versions") or {}).items()
                if k in ("torch", "jax", "jaxamp")
            )
        )
        lines += [f"recorded vs here: {note}" for note in self.notes] or [
            "recorded vs here: same torch kernel classes and JAX versions; bands unchanged"
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "golden": self.golden,
            "notes": self.notes,
            "verdicts": [v.to_dict() for v in self.verdicts],
        }


def flax_pair(golden: Golden, flax_model: Any = None, *, flax_kwargs: Any = None) -> Any:
    """The JAX half of the golden's pair (what the JAX trainer and step 0 read): the model
    under test (`flax_model`, else the one the golden names) as a `parity.pairs.adapters.FlaxModel`."""
    model = golden.header["model"]
    optimizer = golden.optimizer()
    return _Pair(
        model["name"],
        model["task"],
        flax_model_of(_flax_model(golden, flax_model), flax_kwargs=flax_kwargs),
        dict(model.get("config") or {}),
        block_order=None if optimizer is None else optimizer[1],
    )


def check_fits(golden: Golden, pair: Any) -> None:
    """Refuses a golden whose recorded weights are not the Flax model's: another model's golden,
    or a ``--flax-model`` that names another port (names and shapes, before any work).

    Raises:
      GoldenFileError: naming the file, the model, and the first differing leaves.
    """
    recorded = {k: np.shape(v) for k, v in flatten_variables(golden.variables()).items()}
    inputs = golden.batch(0)[0]
    try:
        own = pair.flax_model.init_variables(inputs)
    except Exception as e:  # the model cannot even be initialised on the golden's inputs
        raise GoldenFileError(
            f"the Flax model cannot be initialised on the golden's inputs {np.shape(inputs)} "
            f"{np.asarray(inputs).dtype} ({type(e).__name__}: {str(e).splitlines()[0][:300]}); "
            f"the golden was recorded for model {golden.header['model']['name']!r}",
            path=golden.path,
        ) from None
    wanted = {k: tuple(np.shape(v)) for k, v in flatten_variables(as_variables(own)).items()}
    problems = [f"missing {'/'.join(k)} {v}" for k, v in wanted.items() if k not in recorded]
    problems += [f"extra {'/'.join(k)} {v}" for k, v in recorded.items() if k not in wanted]
    problems += [
        f"{'/'.join(k)}: recorded {recorded[k]}, the model has {v}"
        for k, v in wanted.items()
        if k in recorded and tuple(recorded[k]) != v
    ]
    if problems:
        raise GoldenFileError(
            f"recorded for model {golden.header['model']['name']!r}, whose weights do not fit "
            f"this Flax model ({len(problems)} differences: {'; '.join(problems[:4])}"
            + ("; ..." if len(problems) > 4 else "")
            + "): a golden of another model, or --flax-model names another port",
            path=golden.path,
        )


def _train(config: RunConfig, pair: _Pair, stream: BatchList, variables, progress: bool):
    try:
        return train_jax(config, pair, stream, variables=variables, progress=progress)
    except UnsupportedHere as e:
        return build_unsupported_record("jax", config, e.reason)
    except Exception as e:  # failed by `compare` with the message, as the harness does
        print(f"error: jax {config.model} {config.precision}: {e}", file=sys.stderr)
        return build_error_record("jax", config, e)


def check_golden(
    golden: str | os.PathLike | Golden,
    flax_model: Any = None,
    *,
    flax_kwargs: Any = None,
    progress: bool = False,
    current_hardware: Mapping[str, Any] | None = None,
    jax_optimizer: Any = None,
    jax_loss: Any = None,
) -> GoldenResult:
    """Runs the JAX side of a recorded cell and judges it against the recorded torch side.

    Step 0 first (the harness's rows: outputs and gradients at float32, then at the run's
    precision, and the compute-dtype rows); a failing step 0 stops before training, as in
    `parity.cell.run_cell`. Then the JAX run from the recorded weights on the recorded batches,
    judged by `parity.verdicts.judge.compare_runs` against
    torch's recorded run.

    Args:
      golden: a golden file (or a loaded `Golden`).
      flax_model: the Flax module under test (linen, NNX, Hugging Face Flax, a
        ``"module:attr"`` string or a zero-argument factory); default: the reference the golden
        recorded, else the built-in pair's twin (needs torch).
      flax_kwargs: ``inputs -> dict`` of extra keyword arguments for the Flax call.
      progress: report training progress.
      current_hardware: this machine's `parity.core.hardware.hardware_info` (default: measured).
      jax_optimizer, jax_loss: your JAX optimizer (optax) and loss, where the golden was
        exported with your torch optimizer / loss (`parity.golden.export.export_models`);
        required then, refused otherwise.

    Returns:
      A `GoldenResult` (``result.report()`` for the table and the notes).

    Raises:
      GoldenFileError: the file breaks the schema. ValueError: no Flax model can be found, or
      the golden's training loop and the JAX one given do not pair.
    """
    golden = golden if isinstance(golden, Golden) else load_golden(golden)
    pair = flax_pair(golden, flax_model, flax_kwargs=flax_kwargs)
    recorded = golden.header["model"].get("training_loop") or {}
    for torch_name, jax_name, given in (
        ("torch_optimizer", "jax_optimizer", jax_optimizer),
        ("torch_loss", "jax_loss", jax_loss),
    ):
        if (torch_name in recorded) != (given is not None):
            raise ValueError(
                f"check_golden({jax_name}=...): the golden was recorded "
                + (
                    f"with your torch {torch_name[6:]} ({recorded[torch_name]}): pass its JAX "
                    f"port as {jax_name}="
                    if torch_name in recorded
                    else f"with the harness's own {torch_name[6:]}: leave {jax_name} out (or "
                    f"export with torch_{torch_name[6:]}=)"
                )
            )
    if jax_optimizer is not None or jax_loss is not None:
        pair = dataclasses.replace(
            pair,
            loop=TrainingLoop(jax_optimizer=jax_optimizer, jax_loss=jax_loss, sides="jax"),
        )
    check_fits(golden, pair)
    return check_pair(golden, pair, progress=progress, current_hardware=current_hardware)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines() or [""])[0][:400]


def check_pair(
    golden: Golden,
    pair: Any,
    config: RunConfig | None = None,
    *,
    progress: bool = False,
    current_hardware: Mapping[str, Any] | None = None,
) -> GoldenResult:
    """`check_golden`'s body for a pair already built (`flax_pair`; `parity.bisect` passes one
    with modules kept in float32, and a `config` whose recipe carries autocast overrides).

    Args:
      golden: the loaded golden file.
      pair: the JAX half of the pair.
      config: the cell's config (default the recorded one; another must be comparable with it).
      progress, current_hardware: as `check_golden`.
    """
    config = golden.config if config is None else config
    variables = golden.variables()
    stream = BatchList(
        [golden.batch(k) for k in range(golden.header["data"]["train_batches"])],
        golden.eval_batches(),
    )
    extra, notes = hardware_allowance(golden.header, current_hardware)
    inputs, targets = stream.batch(0)
    try:
        result = golden_step0(golden, pair, config, variables, inputs, targets, extra)
    except Exception as e:  # the Flax model fails on the golden's inputs: the port's failure
        error = f"the Flax model raised {type(e).__name__}: {_first_line(e)}"
        print(f"error: jax {config.model}: step 0: {error}", file=sys.stderr)
        result = Step0Result(
            [
                verdict(
                    check="step 0",
                    compared="jax vs torch, step 0",
                    value="error",
                    tolerance="runs",
                    passed=False,
                    detail=error,
                    mode="step 0",
                    kind="step 0 ran",
                    **cell_fields(config),
                )
            ],
            False,
        )
    # the user's JAX loop against torch's recorded replay: a step-0 gate, as in run_cell
    result = recorded_gate(result, golden.replay, pair, config, variables["params"])
    if result.passed:
        jax_run = _train(config, pair, stream, variables, progress)
    else:  # a broken port is not trained, as in parity.cell.run_cell
        jax_run = build_error_record("jax", config, Step0Failure(result))
    # Stored as the harness stores its step-0 result (`parity.verdicts.step0.attach_step0`): the
    # rows enter the verdicts through the run record, with mode "step 0".
    jax_run["step0"] = result.to_dict()
    runs = [golden.torch_run, jax_run]
    verdicts = compare_runs(runs)
    return GoldenResult(overall_status(verdicts), verdicts, runs, notes, golden.path)


# --- command line -----------------------------------------------------------------------------


def add_check_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``check`` to `parity.cli.commands`'s subcommands (and to `main`'s own parser)."""
    check = sub.add_parser(
        "check",
        help="run the JAX side against a golden file (no torch needed); exit 0 PASS, 1 FAIL",
    )
    check.add_argument("--golden", required=True, help="golden file (python -m parity export)")
    check.add_argument(
        "--flax-model",
        default=None,
        metavar="MODULE:ATTR",
        help="the Flax module (or a zero-argument factory) under test; default: the one the "
        "golden names",
    )
    check.add_argument(
        "--jax-optimizer",
        default=None,
        metavar="MODULE:ATTR",
        help="your optax port (a GradientTransformation or a zero-argument factory), where the "
        "golden was exported with your torch optimizer: replayed against torch's recorded steps",
    )
    check.add_argument(
        "--jax-loss",
        default=None,
        metavar="MODULE:ATTR",
        help="your JAX loss (logits, targets) -> loss, where the golden has your torch loss",
    )
    check.add_argument("--json", default=None, help="also write the verdicts to this JSON file")
    check.add_argument("--no-progress", action="store_true", help="no progress output")
    return check


def bad_input(error: BaseException) -> int:
    """Prints `error` as one ``error: ...`` line on stderr; returns the bad-input exit code (2)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    print(f"error: {text}", file=sys.stderr)
    return BAD_INPUT


def run_check(args: argparse.Namespace) -> int:
    """``check``'s body: prints the report; returns the exit code."""
    try:
        loop = {
            "jax_optimizer": load_optax("--jax-optimizer", args.jax_optimizer),
            "jax_loss": load_function(
                "--jax-loss", args.jax_loss, 2, "a callable (logits, targets) -> loss"
            ),
        }
        result = check_golden(args.golden, args.flax_model, progress=not args.no_progress, **loop)
    except ValueError as e:  # GoldenFileError included: a damaged or wrong file is bad input
        text = str(e)
        for name in ("jax_optimizer", "jax_loss"):  # check_golden's names, as this command's
            text = text.replace(f"as {name}=", f"as --{name.replace('_', '-')}")
            text = text.replace(f"leave {name} out", f"leave --{name.replace('_', '-')} out")
        return bad_input(ValueError(text))
    print(result.report())
    if args.json:
        write_json_atomic(args.json, result.to_dict())
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    """``python -m parity check ...`` where torch is not installed (`parity.__main__`)."""
    parser = argparse.ArgumentParser(prog="python -m parity")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["check", *(sys.argv[2:] if argv is None else argv)])
    return run_check(args)
