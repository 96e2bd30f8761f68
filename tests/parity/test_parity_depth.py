"""A thin PASS says how deep it goes: a planted chaotic pair whose own noise exceeds the loss
bound after a few steps PASSes on those steps only, and its bottom line (the command line's
summary, the golden check's report, report.md) says so with the command that decides more."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from test_parity_power import _chaos, _judged, _run  # noqa: E402

from parity.verdicts.outcomes import cell_bottom_lines, format_verdicts, overall_status  # noqa: E402


def test_a_chaotic_pass_states_its_depth():
    n = 40
    base, noisy = _chaos(n, 1e-7, seed=1)  # torch's own 1-ulp run parts by 1.6x a step
    _, jax = _chaos(n, 2e-6, seed=2)
    runs = [_run("torch", base), _run("jax", jax), _run("torch", noisy, variant="noise")]
    judged = _judged(runs)
    assert overall_status(judged) == "PASS", [(v.check, v.passed) for v in judged]
    cell = judged[0].cell
    bottom = cell_bottom_lines(judged)[cell]
    window = next(v.check for v in judged if v.check.endswith("(horizon)"))
    last = window.split("steps ")[1].split("-")[1].split(" ")[0]
    assert bottom.startswith("parity PASS")
    depth = bottom[bottom.index("PASS on steps") :]
    assert depth.startswith(f"PASS on steps 0-{last} only: from step {int(last) + 1} to {n - 1}")
    assert "the model's own noise exceeds the bound" in depth and "--seeds" in depth
    # the command line's summary (what `parity run` and `parity check` print) says it too
    summary = format_verdicts(judged)
    assert f"{' '.join(cell)}: {bottom}" in summary.splitlines()
    # a PASS on every step says nothing more
    steady = np.linspace(2.3, 1.0, n)
    calm = _judged([_run("torch", steady), _run("jax", steady * (1 + 1e-6))])
    assert overall_status(calm) == "PASS"
    assert "PASS on steps" not in cell_bottom_lines(calm)[calm[0].cell]
    assert "PASS on steps" not in format_verdicts(calm)
