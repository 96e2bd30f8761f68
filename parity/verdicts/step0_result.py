"""What the step-0 checks return (`Step0Result`) and raise (`Step0Failure`): torch-free, so that a
golden file's check (`parity.golden.check`) reports its step 0 as `parity.verdicts.step0` does."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from parity.verdicts.rows import Verdict

__all__ = ["Step0Failure", "Step0Result"]


class Step0Failure(RuntimeError):
    """Raised by the run flow when the step-0 checks fail: training would compare a broken port.

    Attributes:
      result: the `Step0Result` (verdicts, worst parameter and output, diagnosis).
    """

    def __init__(self, result: Step0Result):
        super().__init__(result.summary())
        self.result = result


@dataclasses.dataclass
class Step0Result:
    """What `check_step0` returns.

    Attributes:
      verdicts: `parity.verdicts.rows.Verdict` rows (check names start with ``"step 0"``).
      passed: no verdict failed.
      worst_output: ``(name, relative error)`` of the worst output of the first failing (or
        else the fp32) stage.
      worst_parameter: ``(name, relative error)`` of the worst gradient, likewise.
      compute_flops: ``{"torch": {dtype: FLOPs}, "jax": {...}}`` at the run's precision.
      diagnosis: the `parity.verdicts.diagnose.Diagnosis` made when a check failed (None otherwise).
      diagnosis_error: why the diagnosis could not be made, if it could not.
      probe: the `parity.verdicts.layer_probe.LayerProbe` of the float32 stage (None when not run).
      examples: ``{"compared": n, "batch": size}`` when step 0 compared only the batch's first
        ``n`` examples (`parity.verdicts.step0_batch`: a batch whose forward pass is more work
        than its bound); None when it compared the whole batch.
    """

    verdicts: list[Verdict]
    passed: bool
    worst_output: tuple[str, float] | None = None
    worst_parameter: tuple[str, float] | None = None
    compute_flops: dict[str, dict[str, int]] | None = None
    diagnosis: Any = None
    diagnosis_error: str | None = None
    probe: Any = None
    examples: dict[str, int] | None = None

    def summary(self) -> str:
        """One line: pass, or the failed checks with their worst output/parameter, and the first
        diverging layer; and how many examples were compared, when not the whole batch."""
        failed = [v for v in self.verdicts if v.passed is False]
        on = (
            f" (on the batch's first {self.examples['compared']} of {self.examples['batch']} "
            "examples: bounded by work)"
            if self.examples
            else ""
        )
        if not failed:
            return f"step 0: all checks pass{on}"
        parts = [
            f"{v.check}: {v.value_text} > {v.tolerance_text} ({v.detail.split(';')[0]})"
            for v in failed
        ]
        head = "step 0 FAILED"
        if self.diagnosis is not None and (
            getattr(self.diagnosis, "first_failing", None) or getattr(self.diagnosis, "cause", None)
        ):
            head = f"{head} ({self.diagnosis.summary()})"
        return f"{head}{on}: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (for run records and reports)."""
        return {
            "passed": self.passed,
            "summary": self.summary(),
            "verdicts": [v.to_dict() for v in self.verdicts],
            "worst_output": list(self.worst_output) if self.worst_output else None,
            "worst_parameter": list(self.worst_parameter) if self.worst_parameter else None,
            "compute_flops": self.compute_flops,
            "diagnosis": self.diagnosis.to_dict() if self.diagnosis is not None else None,
            "diagnosis_error": self.diagnosis_error,
            "examples": self.examples,
            "probe": (
                {
                    "failed": [
                        {
                            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                            for k, v in row.items()
                        }
                        for row in self.probe.failed[:20]
                    ],
                    "skipped": self.probe.skipped,
                }
                if self.probe is not None
                else None
            ),
        }
