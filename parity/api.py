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

import copy
import dataclasses
import difflib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from parity.cell import NOISE_FRAMEWORKS, run_cell, write_outputs
from parity.core.config import FP16_STRESS, RunConfig
from parity.core.losses import TASKS
from parity.data import BatchStream
from parity.models import ModelPair
from parity.pairs import adapters
from parity.pairs.dropout import (
    disable_torch_dropout,
    dropout_settings,
    flax_dropout_settings,
    torch_dropout_layers,
)
from parity.pairs.mapping import WeightMapping
from parity.pairs.variables import as_variables
from parity.perf.measure import set_threads
from parity.replay.rows import replay_status, replay_verdicts
from parity.training.user_loop import TrainingLoop, run_config_fields
from parity.transfer import auto, validate_variables
from parity.verdicts.calibrate import seed_runs
from parity.verdicts.judge import compare_runs
from parity.verdicts.outcomes import overall_status

__all__ = ["ParityResult", "compare_models", "replay_loop"]


@dataclasses.dataclass(frozen=True)
class ParityResult:
    """What `compare_models` returns.

    Attributes:
      runs: the run records (the ``results.json`` schema), torch first.
      verdicts: `parity.verdicts.rows.Verdict` rows (``passed`` is None for informational rows).
      passed: no verdict failed and at least one passed (`parity.verdicts.outcomes.overall_status` is "PASS").
      report_path: ``report.md`` when `out_dir` was given, else None.
      status: ``"PASS"``, ``"FAIL"``, ``"INCONCLUSIVE"`` (nothing failed, no check could have:
        the report's bottom line gives what would decide) or ``"NOTHING COMPARED"``.
      replay: with your own optimizer or loss, the replay's record (`parity.replay.rows.
        replay_verdicts`: each gradient sequence's finding and per-step lr, clip factor,
        skips and counts; the loss cases), else None.
    """

    runs: list[dict[str, Any]]
    verdicts: list[Any]
    passed: bool
    report_path: Path | None
    status: str = ""
    replay: dict[str, Any] | None = None


class _UserBatches:
    """A `BatchStream`-like view of user batches: a sequence of pairs or a ``step -> pair`` callable."""

    def __init__(self, batches, eval_batches, function: str = "compare_models"):
        self._function = function
        if callable(batches):
            self._get = batches
            self._count = None
        elif isinstance(batches, Sequence) and len(batches) > 0:
            self._get = batches.__getitem__
            self._count = len(batches)
        else:
            raise TypeError(
                f"{function}(batches=...) takes a BatchStream, a non-empty sequence of "
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
                f"{self._function}: steps exceeds the {self._count} batches given (asked for "
                f"step {step})."
            )
        inputs, targets = self._get(step)
        return np.asarray(inputs), np.asarray(targets)

    def eval_batches(self):
        return [(np.asarray(x), np.asarray(y)) for x, y in (self._eval or [])]


def user_stream(
    function: str, batches: Any, eval_batches: Any, steps: int | None
) -> tuple[Any, int, bool]:
    """The batches a library call was given as a `BatchStream`-like object.

    Args:
      function: the caller's name, for the messages.
      batches: a `parity.data.BatchStream`, a non-empty sequence of ``(inputs, targets)`` pairs,
        or a callable ``step -> (inputs, targets)``.
      eval_batches: held-out pairs (a BatchStream brings its own).
      steps: the steps asked for, or None.

    Returns:
      ``(stream, steps, held-out batches available)``; steps default to the number of pairs of
      a sequence, else 30.

    Raises:
      TypeError: `batches` of another kind. ValueError: more steps than pairs given.

    Example:
      >>> pairs = [(np.zeros((2, 3)), np.zeros(2, int))] * 4
      >>> stream, steps, held_out = user_stream("f", pairs, None, None)
      >>> steps, held_out, stream.batch_size
      (4, False, 2)
    """
    if batches is None:
        raise TypeError(f"{function}: `batches` is required (a BatchStream, pairs or a callable).")
    if isinstance(batches, BatchStream):
        return batches, 30 if steps is None else steps, True
    stream = _UserBatches(batches, eval_batches, function)
    if steps is not None and stream._count and steps > stream._count:
        raise ValueError(
            f"{function}(steps={steps}): only {stream._count} batches were given; pass at "
            "most that many steps, or a callable / BatchStream for longer runs."
        )
    return stream, (stream._count or 30) if steps is None else steps, bool(eval_batches)


def _no_reverse_transfer(variables, torch_module):
    raise NotImplementedError("compare_models needs only the torch -> Flax transfer.")


def prepare_pair(
    torch_module: Any,
    flax_module: Any,
    transfer: Callable[[Any], dict] | None,
    stream: Any,
    *,
    task: str = "classification",
    name: str = "user_model",
    torch_channels_first: bool | None = None,
    rules: dict[str, Any] | None = None,
    flax_kwargs: Callable[[Any], dict] | None = None,
    dropout: str = "disable",
) -> Any:
    """A checked `parity.models.ModelPair` from user models: the adapters, the weight mapping
    (given `transfer` or `parity.transfer.auto`), validation against the Flax model's own
    variables, and one abstract forward pass on the first batch, all before any training step.

    Args: as `compare_models`; `stream` is a `BatchStream`-like object (``batch(step)``).

    Returns:
      A `ModelPair` whose ``torch_model`` is a copy (dropout disabled when asked).

    Raises:
      parity.pairs.adapters.AdapterError / parity.transfer.TransferError: naming the problem and the fix.

    Examples:
      >>> import flax.linen as fnn, torch
      >>> batches = [(np.zeros((4, 3), np.float32), np.zeros(4, np.int32))]
      >>> pair = prepare_pair(torch.nn.Linear(3, 2), fnn.Dense(2), None, _UserBatches(batches, None))
      >>> [e.transform for e in pair.mapping.entries]
      ['linear', 'identity']
    """
    if task not in TASKS:
        close = difflib.get_close_matches(str(task), TASKS, n=1)
        raise ValueError(
            f"`task` must be one of {TASKS}, got {task!r}"
            + (f"; did you mean {close[0]!r}?" if close else ".")
        )
    if dropout not in ("disable", "refuse"):
        raise ValueError(f"`dropout` must be 'disable' or 'refuse', got {dropout!r}.")
    if not isinstance(torch_module, torch.nn.Module):
        raise adapters.AdapterError(
            f"`torch_module` must be a torch.nn.Module, got {type(torch_module).__name__}."
        )
    flax = adapters.as_flax_model(flax_module, flax_kwargs=flax_kwargs)
    inputs, targets = stream.batch(0)
    inputs, targets = np.asarray(inputs), np.asarray(targets)
    channels_first = adapters.check_image_layout(torch_module, inputs, torch_channels_first)
    model = copy.deepcopy(torch_module)
    # both sides' rates before they are turned off: step 0 names a difference (not tested)
    rates = {
        "torch": dropout_settings(model),
        "flax": flax_dropout_settings(flax, inputs),
    }
    found = torch_dropout_layers(model)
    if found and dropout == "refuse":
        raise adapters.AdapterError(
            f"the torch model has dropout {found}: the two frameworks draw different masks, so "
            "parity cannot be checked. Set the rates to 0, or pass dropout='disable'."
        )
    disable_torch_dropout(model)

    example = torch.as_tensor(inputs)
    if example.is_floating_point():
        if channels_first and example.dim() == 4:
            example = example.permute(0, 3, 1, 2)
    else:
        example = example.long()
    reference = flax.init_variables(jnp.asarray(inputs))
    mapping = None
    if transfer is None:
        mapping = auto(
            model,
            reference,
            rules=rules,
            example_inputs=example,
            flax_model=flax,
            flax_inputs=jnp.asarray(inputs),
        )
        to_flax, from_flax = mapping.to_flax, mapping.to_torch
    else:
        to_flax, from_flax = (lambda m: as_variables(transfer(m))), _no_reverse_transfer
    variables = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), to_flax(model))
    validate_variables(
        variables, jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.float32), reference)
    )
    validate_variables(variables, reference, check_dtype=False)
    pair = ModelPair(
        name=name,
        task=task,
        torch_model=model,
        flax_model=flax,
        config={},
        to_flax=to_flax,
        from_flax=from_flax,
        data=None,
        torch_channels_first=channels_first,
        mapping=mapping if isinstance(mapping, WeightMapping) else None,
        dropout=rates,
    )
    # One abstract forward pass each side: signatures, outputs and shapes fail here, not mid-run.
    logits = jax.eval_shape(
        lambda v, x: pair.flax_apply(v, x, train=True)[0], variables, jnp.asarray(inputs)
    )
    _check_logits(task, tuple(logits.shape), targets, "Flax")
    with torch.no_grad():
        torch_logits = pair.torch_forward(
            copy.deepcopy(model), torch.as_tensor(inputs), train=False
        )
    _check_logits(task, tuple(torch_logits.shape), targets, "torch")
    return pair


def _check_logits(task: str, shape: tuple[int, ...], targets: np.ndarray, side: str) -> None:
    expected = {
        "classification": ("(batch, classes)", len(shape) == 2 and shape[:1] == targets.shape),
        "lm": ("(batch, time, vocab)", len(shape) == 3 and shape[:2] == targets.shape),
        "regression": (f"the targets' shape {targets.shape}", shape == targets.shape),
    }
    description, ok = expected[task]
    if not ok:
        hint = ""
        if task == "classification" and len(shape) == 3:
            hint = " A sequence model's per-token logits: pass task='lm'."
        elif task == "lm" and len(shape) == 2:
            hint = " One logit vector per example: pass task='classification'."
        raise ValueError(
            f"task={task!r}: the {side} model returned logits of shape {shape} for targets of "
            f"shape {targets.shape}; expected {description}.{hint}"
        )


def resolve_eval(function: str, config: dict[str, Any], available: bool) -> bool:
    """Whether a library run evaluates: on when held-out batches are `available`, unless the
    caller's ``eval=False`` (popped from `config`) turns it off; ``eval=True`` without them is
    refused, naming what to pass.

    Examples:
      >>> resolve_eval("compare_models", {"eval": False}, True)
      False
    """
    wanted = config.pop("eval", available)
    if not isinstance(wanted, bool):
        raise TypeError(f"{function}(eval={wanted!r}): eval must be True or False")
    if wanted and not available:
        raise ValueError(
            f"{function}(eval=True): no held-out batches to evaluate on; pass eval_batches=[...] "
            "(or a BatchStream as batches), or leave eval out"
        )
    return wanted


def compare_models(
    torch_module: Any,
    flax_module: Any,
    transfer: Callable[[Any], dict] | None = None,
    batches: Any = None,
    *,
    precision: str = "fp32",
    task: str = "classification",
    steps: int | None = None,
    eval_batches: Sequence[tuple[Any, Any]] | None = None,
    out_dir: str | Path | None = None,
    plots: bool = True,
    name: str = "user_model",
    torch_channels_first: bool | None = None,
    rules: dict[str, Any] | None = None,
    flax_kwargs: Callable[[Any], dict] | None = None,
    dropout: str = "disable",
    progress: bool = False,
    step0: bool = True,
    noise: str = "none",
    seeds: int = 1,
    threads: int | None = None,
    fp16_stress: bool = False,
    budget: int | None = None,
    torch_optimizer: Callable[[Any], Any] | None = None,
    torch_scheduler: Callable[[Any], Any] | None = None,
    torch_clip: float | Callable[[list], Any] | None = None,
    jax_optimizer: Any = None,
    torch_loss: Callable[[Any, Any], Any] | None = None,
    jax_loss: Callable[[Any, Any], Any] | None = None,
    replay_steps: int = 4,
    **config: Any,
) -> ParityResult:
    """Trains `torch_module` under torch.amp and `flax_module` under jaxamp, and compares them.

    Both start from the torch module's current weights (`transfer` converts them), see the same
    batches in the same order and use the same optimizer, schedule, clipping and loss scaling;
    the verdicts and tolerances are `parity.verdicts.judge`'s.

    Args:
      torch_module: a ``torch.nn.Module``; ``forward(inputs)`` returns logits, or a Hugging Face
        ``ModelOutput`` / dict with ``logits`` / tuple with the logits first. Not modified (the
        trainers train copies).
      flax_module: a ``flax.linen`` module, a ``flax.nnx`` module, or a Hugging Face Flax model
        (``.module`` + ``.params``); see `parity.pairs.adapters` for the call signatures it takes.
      transfer: ``torch_module -> {"params": ..., optionally "batch_stats": ...}`` (a bare params
        dict is accepted), or None (default): `parity.transfer.auto` maps the weights.
        Either way the result is checked against the Flax model's own variables (names, shapes,
        dtypes) before any step.
      batches: a `parity.data.BatchStream`, a sequence of ``(inputs, targets)`` numpy pairs (one
        per step), or a callable ``step -> (inputs, targets)``.
      precision: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"`` or ``"bf16-true"``.
      task: ``"classification"`` (logits ``(B, C)``, int targets ``(B,)``), ``"lm"`` (logits
        ``(B, T, V)``, targets ``(B, T)``): mean cross-entropy; or ``"regression"`` (outputs and
        float targets of one shape): mean squared error. Losses are computed in float32.
      steps: training steps (default: the number of batches in a sequence, else 30).
      eval_batches: held-out ``(inputs, targets)`` pairs for the eval metric (default: none;
        a BatchStream brings its own). Evaluation runs when there are some; ``eval=False``
        turns it off, ``eval=True`` without them is refused (`resolve_eval`).
      out_dir: if given, ``results.json``, ``steps.csv``, ``report.md`` and plots go there.
      plots: False writes ``report.md`` without its PNG plots (as the CLI's ``--no-plots``;
        ``python -m parity compare OUT_DIR`` draws them later from the same files).
      name: the model name in records and the report.
      torch_channels_first: permute 4-D NHWC inputs to NCHW for the torch module; None
        (default) detects it from the first ``Conv2d`` (`parity.pairs.adapters.check_image_layout`).
        Images are always given NHWC (Flax's layout).
      rules: explicit mapping rules for `parity.transfer.auto` (when `transfer` is None).
      flax_kwargs: ``inputs -> dict`` of extra keyword arguments for the Flax call.
      dropout: ``"disable"`` (default: torch dropout layers get ``p=0`` in the trained copies,
        NNX dropout is made deterministic, linen modules get ``deterministic=True`` when they
        take it) or ``"refuse"`` (raise when the torch model has dropout).
      progress: tqdm progress bars.
      step0: run the step-0 checks (`parity.verdicts.step0`) first and skip training when they fail.
      noise: ``"none"`` (default), ``"torch"``, ``"jax"`` or ``"both"``: calibration runs from
        weights nudged by one ulp (`parity.verdicts.calibrate.noise_runs`), so a chaotic model's per-step
        gap is judged against its own self-divergence (`parity.verdicts.judge`, noise-calibrated mode).
      seeds: data orders per framework (``--seeds``); >= 2 decides final loss and eval metric
        by an equivalence test (`parity.verdicts.judge`). Other orders of user batches are
        seeded permutations of them (a BatchStream: its own stream at the next seeds).
      threads: intra-op CPU threads for torch and XLA alike (``--threads``,
        `parity.perf.measure.set_threads`; call before JAX has started for XLA's count to apply).
      fp16_stress: fp16 initial scale 2**20 and growth interval 5 (``--fp16-stress``), so the
        loss-scale trajectory has events to compare.
      budget: escalation. When the verdict is INCONCLUSIVE, train one more data order per
        framework at a time, up to `budget` orders in all, until the equivalence test decides;
        first, where a row exceeded its band that a 1-ulp torch run decides (no calibration
        past step 30), that run is made (`parity.cell.run_cell`'s ``escalate``) (None: no
        escalation).
      torch_optimizer: your torch optimizer, as ``torch module -> torch.optim.Optimizer``
        (called with the trained copy: build param groups from its ``named_parameters()``);
        with `jax_optimizer`, both sides train with yours instead of the harness's
        (``optimizer``, ``lr``, ``schedule``, ``clip_norm``... are then refused), and the
        step-0 gate replays both on identical gradients (`parity.replay`).
      torch_scheduler: ``optimizer -> LRScheduler``, stepped after every optimizer step.
      torch_clip: the torch side's clipping after unscaling: a max global norm
        (``clip_grad_norm_``) or a callable ``parameters -> Any``; None: none.
      jax_optimizer: your ``optax.GradientTransformation`` (its own schedule and clipping);
        the run's loss scaling wraps it (``jaxamp.loss_scaled``) unless it holds its own.
      torch_loss, jax_loss: your losses, ``(logits, targets) -> scalar`` (both or neither);
        the gate compares them on identical logits (`parity.replay.losses`).
      replay_steps: real batches the replay feeds both optimizers.
      **config: any other `RunConfig` field (``optimizer``, ``lr``, ``clip_norm``, ``device``,
        ``init_scale``, ``growth_interval``, ...).

    Returns:
      A `ParityResult`; ``status`` says PASS, FAIL, INCONCLUSIVE or NOTHING COMPARED.

    Raises:
      TypeError / ValueError: bad batches or configuration (naming the parameter).
    """
    for option, value, low in (("seeds", seeds, 1), ("budget", budget, 1)):
        if value is None and option == "budget":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(
                f"compare_models({option}={value!r}): must be an integer >= {low}"
                + (" (None: no escalation)." if option == "budget" else ".")
            )
    if threads is not None:
        set_threads(threads)
    loop = TrainingLoop(
        torch_optimizer=torch_optimizer,
        torch_scheduler=torch_scheduler,
        torch_clip=torch_clip,
        jax_optimizer=jax_optimizer,
        torch_loss=torch_loss,
        jax_loss=jax_loss,
        replay_steps=replay_steps,
    )
    config = run_config_fields("compare_models", loop, config)
    if fp16_stress:
        config = {**FP16_STRESS, **config}
    if transfer is not None and not callable(transfer):
        raise TypeError(
            "compare_models(transfer=...) takes a callable torch module -> flax variables, or "
            f"None for the automatic mapping; got {type(transfer).__name__}."
        )
    stream, steps, held_out = user_stream("compare_models", batches, eval_batches, steps)
    run_config = RunConfig(
        model=name,
        precision=precision,
        steps=steps,
        batch_size=int(stream.batch_size),
        eval=resolve_eval("compare_models", config, held_out),
        **config,
    )
    pair = prepare_pair(
        torch_module,
        flax_module,
        transfer,
        stream,
        task=task,
        name=name,
        torch_channels_first=torch_channels_first,
        rules=rules,
        flax_kwargs=flax_kwargs,
        dropout=dropout,
    )
    if noise not in NOISE_FRAMEWORKS:
        raise ValueError(
            f"compare_models(noise={noise!r}): must be one of {tuple(NOISE_FRAMEWORKS)}."
        )
    # Step 0 (outputs and gradients on the first batch) before training; a broken port is not
    # trained: its records are errors naming the worst output, parameter and first bad layer.
    pair = dataclasses.replace(pair, data=_seeded_streams(stream, run_config.stream_seed))
    if loop.has_optimizer or loop.has_loss:
        pair = dataclasses.replace(pair, loop=loop)
    runs = run_cell(
        run_config,
        pair=pair,
        stream=stream,
        progress=progress,
        step0_checks=step0,
        echo=progress,
        noise=noise,
        seeds=seeds,
        escalate=budget is not None,
    )
    verdicts = compare_runs(runs)
    done = seeds
    # Escalation: one more data order per framework until the equivalence test decides.
    while budget is not None and done < budget and overall_status(verdicts) == "INCONCLUSIVE":
        runs += seed_runs(run_config, pair, done + 1, first=done, progress=progress)
        done += 1
        verdicts = compare_runs(runs)
    report_path = write_outputs(out_dir, runs, plots=plots)[2] if out_dir is not None else None
    status = overall_status(verdicts)
    return ParityResult(
        runs=runs,
        verdicts=verdicts,
        passed=status == "PASS",
        report_path=report_path,
        status=status,
        replay=next((r["replay"] for r in runs if "replay" in r), None),
    )


def replay_loop(
    torch_module: Any,
    flax_module: Any,
    transfer: Callable[[Any], dict] | None = None,
    batches: Any = None,
    *,
    torch_optimizer: Callable[[Any], Any] | None = None,
    torch_scheduler: Callable[[Any], Any] | None = None,
    torch_clip: float | Callable[[list], Any] | None = None,
    jax_optimizer: Any = None,
    torch_loss: Callable[[Any, Any], Any] | None = None,
    jax_loss: Callable[[Any, Any], Any] | None = None,
    precision: str = "fp32",
    task: str = "classification",
    steps: int = 4,
    jit: bool = True,
    name: str = "user_model",
    torch_channels_first: bool | None = None,
    rules: dict[str, Any] | None = None,
    flax_kwargs: Callable[[Any], dict] | None = None,
) -> ParityResult:
    """Only the replay of your training loop, without training: both optimizers on identical
    gradients and both losses on identical logits (`parity.replay`), in seconds.

    Arguments as `compare_models`'s; `steps` real batches are replayed (at most the batches
    given), `jit` runs the JAX optimizer step and loss under ``jax.jit``.

    Returns:
      A `ParityResult` with no runs: ``verdicts`` are the replay rows, ``replay`` their record.

    Example::

        result = parity.api.replay_loop(TorchNet(), FlaxNet(), batches=batches,
                                        torch_optimizer=..., jax_optimizer=optax.adamw(...))
        print(result.status, [v.detail for v in result.verdicts])
    """
    loop = TrainingLoop(
        torch_optimizer=torch_optimizer,
        torch_scheduler=torch_scheduler,
        torch_clip=torch_clip,
        jax_optimizer=jax_optimizer,
        torch_loss=torch_loss,
        jax_loss=jax_loss,
        replay_steps=steps,
        replay_jit=jit,
    )
    if not (loop.has_optimizer or loop.has_loss):
        raise ValueError(
            "replay_loop: nothing to replay; pass torch_optimizer and jax_optimizer, or "
            "torch_loss and jax_loss (or both pairs)."
        )
    stream, count, _ = user_stream("replay_loop", batches, None, None)
    if isinstance(batches, BatchStream):
        count = steps
    config = RunConfig(
        model=name, precision=precision, steps=min(steps, count), batch_size=stream.batch_size
    )
    pair = prepare_pair(
        torch_module,
        flax_module,
        transfer,
        stream,
        task=task,
        name=name,
        torch_channels_first=torch_channels_first,
        rules=rules,
        flax_kwargs=flax_kwargs,
    )
    rows, record = replay_verdicts(pair, config, stream.batch, loop, steps=steps, jit=jit)
    status = replay_status(rows)  # the replay rows decide by themselves
    return ParityResult(
        runs=[],
        verdicts=rows,
        passed=status == "PASS",
        report_path=None,
        status=status,
        replay=record,
    )


def _seeded_streams(stream: Any, main_seed: int) -> Callable[[int, int], Any]:
    """``(seed, batch_size) -> stream`` for seed statistics: the main seed's is `stream`; a
    BatchStream gives its own batches at another seed; user batches come in a seeded
    permutation of their order (the same batches, another data order)."""

    def make(seed: int, batch_size: int) -> Any:
        if seed == main_seed:
            return stream
        if isinstance(stream, BatchStream):
            other = copy.copy(stream)
            other.seed = seed
            return other
        count = stream._count
        if count is None:  # a callable: steps are reordered within the first 1,000
            count = 1000
        order = np.random.default_rng(seed).permutation(count)
        other = copy.copy(stream)
        other._get = lambda step, get=stream._get: get(int(order[step % count]))
        return other

    return make
