"""pytest assertions for a JAX port: does it train like its PyTorch original?

`assert_trains_like` takes the reference as a torch module (both sides run:
`parity.compare_models`) or as a golden file (only the JAX side runs, torch need not be
installed: `parity.golden.check.check_golden`), and raises ``AssertionError`` unless the verdicts say
PASS. The message is the verdict table, the bottom line, and the diagnosis: the step-0 summary
(worst output, worst parameter) and, with a torch reference, the per-layer table naming the
first diverging layer.

Example (a test file of your project)::

    from parity.testing import assert_trains_like

    def test_port_trains_like_the_original():
        assert_trains_like("tests/data/port.golden.npz", MyFlaxNet())

    def test_port_against_torch():                       # where torch is installed
        assert_trains_like(MyTorchNet(), MyFlaxNet(), batches, precision="bf16-mixed", steps=10)

`assert_loop_matches` checks only your training loop, without training: your torch optimizer,
scheduler, clipping and loss against their optax/JAX port on identical gradients and logits
(`parity.api.replay_loop`, seconds)::

    def test_training_loop_port():
        assert_loop_matches(MyTorchNet(), MyFlaxNet(), batches,
                            torch_optimizer=make_adamw, torch_scheduler=make_warmup_cosine,
                            torch_clip=1.0, jax_optimizer=optax_port)

The fixture `trains_like` is the same assertion, and attaches every report (passing ones too)
to the test's report (``pytest -rA`` shows it). Import it into your ``conftest.py``::

    from parity.testing import trains_like  # noqa: F401
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

import pytest

from parity.golden.check import GoldenResult, check_golden
from parity.golden.format import Golden
from parity.verdicts.outcomes import (
    cell_bottom_lines,
    cell_configs,
    format_verdicts,
    overall_status,
)

__all__ = ["TrainsLike", "assert_loop_matches", "assert_trains_like", "trains_like"]


@dataclasses.dataclass(frozen=True)
class TrainsLike:
    """What `assert_trains_like` returns (and puts in its failure message).

    Attributes:
      status: ``"PASS"``, ``"FAIL"``, ``"INCONCLUSIVE"`` or ``"NOTHING COMPARED"``.
      verdicts: the verdict rows.
      runs: the run records (torch's, recorded or fresh, then JAX's).
      report: the text the assertion prints.
      reference: ``"golden FILE"`` or ``"torch module NAME"``.
    """

    status: str
    verdicts: list[Any]
    runs: list[dict[str, Any]]
    report: str
    reference: str


def _diagnosis(runs: list[dict[str, Any]]) -> list[str]:
    """The step-0 summary and the per-layer table stored in the run records, once."""
    for run in runs:
        step0 = run.get("step0")
        if not isinstance(step0, dict):
            continue
        lines = [f"diagnosis: {step0.get('summary')}"]
        diagnosis = step0.get("diagnosis")
        if isinstance(diagnosis, dict) and diagnosis.get("markdown"):
            lines.append(diagnosis["markdown"])
        elif step0.get("diagnosis_error"):
            lines.append(f"(no per-layer diagnosis: {step0['diagnosis_error']})")
        return lines
    return []


def _golden_diagnosis(result: GoldenResult) -> list[str]:
    failed = [v for v in result.verdicts if v.passed is False]
    if not failed:
        return []
    first = failed[0]
    where = f" at step {first.first_failing_step}" if first.first_failing_step is not None else ""
    return [
        f"diagnosis: first failing check {first.check!r}{where}: {first.value_text} against "
        f"{first.tolerance_text}; {first.detail}"
    ]


def assert_trains_like(
    reference: Any,
    flax_model: Any,
    batches: Any = None,
    *,
    precision: str | None = None,
    steps: int | None = None,
    allow_inconclusive: bool = False,
    flax_kwargs: Any = None,
    **options: Any,
) -> TrainsLike:
    """Asserts that `flax_model` trains like `reference`.

    Args:
      reference: a golden file (path or `parity.golden.check.Golden`; its batches, precision and steps
        are the recorded ones) or a ``torch.nn.Module`` (both sides train; needs torch).
      flax_model: the Flax port (linen, NNX, Hugging Face Flax; for a golden also a
        ``"module:attr"`` string or a zero-argument factory).
      batches: ``(inputs, targets)`` pairs, one per step (torch reference only; a golden holds
        its own).
      precision: the precision (torch reference; default ``"fp32"``). With a golden it must be
        the recorded one if given.
      steps: training steps (torch reference; default one per batch). With a golden it must be
        the recorded number if given.
      allow_inconclusive: accept INCONCLUSIVE (no check could decide) as well as PASS.
      flax_kwargs: ``inputs -> dict`` of extra keyword arguments for the Flax call.
      **options: for a torch reference, any `parity.compare_models` option (``transfer``,
        ``task``, ``lr``, ``noise``, your ``torch_optimizer`` and ``jax_optimizer``...); for a
        golden exported with your torch loop, ``jax_optimizer`` / ``jax_loss``.

    Returns:
      A `TrainsLike` (status, verdicts, runs, report).

    Raises:
      AssertionError: the verdicts are not PASS; the message is the verdict table, the bottom
        line and the diagnosis.
      ValueError / TypeError: bad arguments (before anything runs where possible).
    """
    if isinstance(reference, str | os.PathLike | Golden):
        loop = {k: options.pop(k) for k in ("jax_optimizer", "jax_loss") if k in options}
        if batches is not None or options:
            raise TypeError(
                "assert_trains_like: a golden reference holds its own batches and configuration; "
                f"got batches={'...' if batches is not None else None} and options "
                f"{sorted(options)} (pass a torch module to choose them)."
            )
        result = check_golden(reference, flax_model, flax_kwargs=flax_kwargs, **loop)
        config = result.runs[0]["config"]
        for name, given, recorded in (
            ("precision", precision, config["precision"]),
            ("steps", steps, config["steps"]),
        ):
            if given is not None and given != recorded:
                raise ValueError(
                    f"assert_trains_like({name}={given!r}): the golden file was recorded with "
                    f"{name}={recorded!r}; leave it out or export another golden."
                )
        status, verdicts, runs = result.status, result.verdicts, result.runs
        label = f"golden {result.golden}"
        lines = [result.report(), *_golden_diagnosis(result)]
    else:
        # A torch reference trains both sides: `parity.api` imports torch (a golden does not).
        api = importlib.import_module("parity.api")
        compared = api.compare_models(
            reference,
            flax_model,
            options.pop("transfer", None),
            batches,
            precision=precision or "fp32",
            steps=steps,
            flax_kwargs=flax_kwargs,
            **options,
        )
        verdicts, runs = compared.verdicts, compared.runs
        status = overall_status(verdicts)
        label = f"torch module {type(reference).__name__}"
        configs = cell_configs(runs)
        lines = [format_verdicts(verdicts, configs)]
        lines += [
            f"{' '.join(c)}: {line}" for c, line in cell_bottom_lines(verdicts, configs).items()
        ]
        lines += _diagnosis(runs)
    report = "\n".join(lines)
    outcome = TrainsLike(status, verdicts, runs, report, label)
    if status != "PASS" and not (allow_inconclusive and status == "INCONCLUSIVE"):
        raise AssertionError(f"the Flax model does not train like the {label}: {status}\n{report}")
    return outcome


def assert_loop_matches(
    torch_module: Any, flax_model: Any, batches: Any, **options: Any
) -> TrainsLike:
    """Asserts that your JAX training loop (optax transformation, loss) does what your torch
    loop (optimizer, scheduler, clipping, loss) does, replayed on identical gradients and
    logits (`parity.api.replay_loop`; `options` are its keyword arguments).

    Raises:
      AssertionError: a replay row failed; the message names the parameter, the step and the
        first quantity that differs.
    """
    api = importlib.import_module("parity.api")
    result = api.replay_loop(torch_module, flax_model, batches=batches, **options)
    report = "\n".join(
        f"{v.check}: {'pass' if v.passed else 'FAIL' if v.passed is False else 'undecided'}"
        f" ({v.detail})"
        for v in result.verdicts
    )
    label = f"torch loop of {type(torch_module).__name__}"
    outcome = TrainsLike(result.status, result.verdicts, [], report, label)
    if result.status != "PASS":
        raise AssertionError(
            f"the JAX training loop does not match the {label}: {result.status}\n{report}"
        )
    return outcome


@pytest.fixture
def trains_like(request: pytest.FixtureRequest):
    """`assert_trains_like`, with every report attached to the test's report (``-rA``)."""

    def check(reference: Any, flax_model: Any, batches: Any = None, **kwargs: Any) -> TrainsLike:
        try:
            outcome = assert_trains_like(reference, flax_model, batches, **kwargs)
        except AssertionError as e:
            request.node.add_report_section("call", "parity", str(e))
            raise
        request.node.add_report_section("call", "parity", outcome.report)
        return outcome

    return check
