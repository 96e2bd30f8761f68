"""Records the torch side once: ``python -m examples.parity_ci.export_golden`` (needs torch).

Writes ``examples/parity_ci/port.golden.npz``: the initial weights, the batches, torch's step-0
outputs and gradients and its per-step trajectory at bf16-mixed. Commit the file; the CI job
then checks the Flax port against it without torch (``test_port.py``, or
``python -m parity check --golden examples/parity_ci/port.golden.npz``).
"""

from __future__ import annotations

from pathlib import Path

from examples.parity_ci.data import make_batches
from examples.parity_ci.torch_model import reference
from parity.golden.export import export_models

GOLDEN = Path(__file__).with_name("port.golden.npz")
PRECISION = "bf16-mixed"
STEPS = 12


def main() -> Path:
    return export_models(
        GOLDEN,
        reference(),
        "examples.parity_ci.flax_model:FlaxNet",
        make_batches(STEPS),
        precision=PRECISION,
        name="parity_ci_port",
        lr_warmup_steps=4,
    )


if __name__ == "__main__":
    print(main())
