"""The harness as a library: bring your own torch module, Flax module and weight transfer.

Example::

    import parity

    result = parity.compare_models(
        torch_module=MyTorchNet(),          # forward(inputs) -> logits
        flax_module=MyFlaxNet(),            # __call__(inputs, train: bool) -> logits
        transfer=my_torch_to_flax,          # torch module -> {"params": ...} (float32 arrays)
        batches=[(x0, y0), (x1, y1), ...],  # numpy (inputs, int targets), one per step
        precision="bf16-mixed",
        out_dir="runs/mine",                # results.json, report.md, plots; optional
    )
    print(result.passed, result.report_path)
    for verdict in result.verdicts:
        print(verdict.check, verdict.value, verdict.passed)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parity.config import RunConfig

__all__ = ["ParityResult", "compare_models"]


@dataclasses.dataclass(frozen=True)
class ParityResult:
    """What `compare_models` returns.

    Attributes:
      runs: the run records (the ``results.json`` schema), torch first.
      verdicts: `parity.compare.Verdict` rows (``passed`` is None for informational rows).
      passed: no verdict failed.
      report_path: ``report.md`` when `out_dir` was given, else None.
    """

    runs: list[dict[str, Any]]
    verdicts: list[Any]
    passed: bool
    report_path: Path | None


class _UserBatches:
    """A `BatchStream`-like view of user batches: a sequence of pairs or a ``step -> pair`` callable."""

    def __init__(self, batches, eval_batches):
        if callable(batches):
            self._get = batches
            self._count = None
        elif isinstance(batches, Sequence) and len(batches) > 0:
            self._get = batches.__getitem__
            self._count = len(batches)
        else:
            raise TypeError(
                "compare_models(batches=...) takes a BatchStream, a non-empty sequence of "
                "(inputs, targets) pairs, or a callable step -> (inputs, targets); got "
                f"{type(batches).__name__}."
            )
        inputs, targets = self.batch(0)
        self.batch_size = int(inputs.shape[0])
        self.input_shape = tuple(inputs.shape[1:])
        self._eval = list(eval_batches) if eval_batches is not None else None

    def batch(self, step: int):
        if self._count is not None and step >= self._count:
            raise ValueError(
                f"compare_models: steps exceeds the {self._count} batches given (asked for step {step})."
            )
        inputs, targets = self._get(step)
        return np.asarray(inputs), np.asarray(targets)

    def eval_batches(self):
        return [(np.asarray(x), np.asarray(y)) for x, y in (self._eval or [])]


def _no_reverse_transfer(variables, torch_module):
    raise NotImplementedError("compare_models needs only the torch -> Flax transfer.")


def compare_models(
    torch_module: Any,
    flax_module: Any,
    transfer: Callable[[Any], dict],
    batches: Any,
    *,
    precision: str = "fp32",
    task: str = "classification",
    steps: int | None = None,
    eval_batches: Sequence[tuple[Any, Any]] | None = None,
    out_dir: str | Path | None = None,
    name: str = "user_model",
    torch_channels_first: bool = False,
    progress: bool = False,
    step0: bool = True,
    **config: Any,
) -> ParityResult:
    """Trains `torch_module` under torch.amp and `flax_module` under jaxamp, and compares them.

    Both start from the torch module's current weights (`transfer` converts them), see the same
    batches in the same order and use the same optimizer, schedule, clipping and loss scaling;
    the verdicts and tolerances are `parity.compare`'s.

    Args:
      torch_module: a ``torch.nn.Module``; ``forward(inputs)`` returns logits. Not modified (the
        trainer trains a copy).
      flax_module: a linen module; ``apply(variables, inputs, train=bool)`` returns logits.
      transfer: ``torch_module -> {"params": ..., optionally "batch_stats": ...}``.
      batches: a `parity.data.BatchStream`, a sequence of ``(inputs, targets)`` numpy pairs (one
        per step), or a callable ``step -> (inputs, targets)``.
      precision: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"`` or ``"bf16-true"``.
      task: ``"classification"`` (logits ``(B, C)``, int targets ``(B,)``) or ``"lm"`` (logits
        ``(B, T, V)``, targets ``(B, T)``); the loss is mean cross-entropy in float32.
      steps: training steps (default: the number of batches in a sequence, else 30).
      eval_batches: held-out ``(inputs, targets)`` pairs for the eval metric (default: none;
        a BatchStream brings its own).
      out_dir: if given, ``results.json``, ``steps.csv``, ``report.md`` and plots go there.
      name: the model name in records and the report.
      torch_channels_first: permute 4-D NHWC inputs to NCHW for the torch module.
      progress: tqdm progress bars.
      step0: run the step-0 checks (`parity.step0`) first and skip training when they fail.
      **config: any other `RunConfig` field (``optimizer``, ``lr``, ``clip_norm``, ``device``,
        ``init_scale``, ``growth_interval``, ...).

    Returns:
      A `ParityResult`.

    Raises:
      TypeError / ValueError: bad batches or configuration (naming the parameter).
    """
    from parity.compare import compare_runs
    from parity.data import BatchStream
    from parity.models import ModelPair
    from parity.train_jax import train_jax
    from parity.train_torch import train_torch

    if not callable(transfer):
        raise TypeError(
            f"compare_models(transfer=...) takes a callable torch module -> flax variables; got {type(transfer).__name__}."
        )
    if isinstance(batches, BatchStream):
        stream = batches
        default_steps = 30
    else:
        stream = _UserBatches(batches, eval_batches)
        default_steps = stream._count or 30
    if steps is not None and getattr(stream, "_count", None) and steps > stream._count:
        raise ValueError(
            f"compare_models(steps={steps}): only {stream._count} batches were given; pass at "
            "most that many steps, or a callable / BatchStream for longer runs."
        )
    run_config = RunConfig(
        model=name,
        precision=precision,
        steps=default_steps if steps is None else steps,
        batch_size=int(stream.batch_size),
        eval=bool(eval_batches) or isinstance(batches, BatchStream),
        **config,
    )
    pair = ModelPair(
        name=name,
        task=task,
        torch_model=torch_module,
        flax_model=flax_module,
        config={},
        to_flax=transfer,
        from_flax=_no_reverse_transfer,
        data=None,
        torch_channels_first=torch_channels_first,
    )
    from parity.step0 import attach_step0, blocked_records, run_step0

    # Step 0 (outputs and gradients on the first batch) before training; a broken port is not
    # trained: its records are errors naming the worst output, parameter and first bad layer.
    check = run_step0(run_config, pair, stream, echo=progress) if step0 else None
    if check is not None and not check.passed:
        runs = blocked_records(run_config, check)
    else:
        runs = attach_step0(
            [
                train_torch(run_config, pair, stream, progress=progress),
                train_jax(run_config, pair, stream, progress=progress),
            ],
            check,
        )
    verdicts = compare_runs(runs)
    report_path = None
    if out_dir is not None:
        from parity.report import merge_runs, write_json_atomic, write_report

        out = Path(out_dir)
        data = merge_runs(out, runs)
        write_json_atomic(out / "verdicts.json", {"verdicts": [v.to_dict() for v in verdicts]})
        report_path = write_report(out, data["runs"], compare_runs(data["runs"]))
    return ParityResult(
        runs=runs,
        verdicts=verdicts,
        passed=not any(v.passed is False for v in verdicts),
        report_path=report_path,
    )
