"""The example project's own CI tests: does the Flax port still train like its torch original?

The passing case and the planted port bug are checked against the committed golden file
(`port.golden.npz`, written by `export_golden.py`): they need no torch. The last test takes
the torch module itself as the reference where torch is installed (both sides run; a failing
step 0 stops before training, so it is quick) and its diagnosis names the diverging layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.parity_ci.data import make_batches
from examples.parity_ci.flax_model import FlaxNet, buggy_port
from parity.testing import assert_trains_like

GOLDEN = Path(__file__).with_name("port.golden.npz")


def test_port_trains_like_the_torch_original(trains_like):
    outcome = trains_like(GOLDEN, FlaxNet())
    assert outcome.status == "PASS"
    assert "final loss" in outcome.report


def test_planted_port_bug_fails_with_the_diagnosis():
    with pytest.raises(AssertionError) as failure:
        assert_trains_like(GOLDEN, buggy_port())
    message = str(failure.value)
    print(message)  # what a CI log shows
    assert "does not train like the golden" in message and ": FAIL" in message
    assert "step 0 fp32: eval-mode output" in message  # the verdict table
    assert "diagnosis: first failing check 'step 0 fp32: eval-mode output'" in message
    assert "worst parameter: norm/scale" in message


def test_planted_port_bug_against_torch_names_the_layer():
    pytest.importorskip("torch")
    from examples.parity_ci.torch_model import reference  # torch: only where it is installed

    with pytest.raises(AssertionError) as failure:
        assert_trains_like(reference(), buggy_port(), make_batches(4), precision="fp32")
    message = str(failure.value)
    print(message)
    assert "step 0 FAILED" in message and "first diverging layer" in message
    assert "first diverging layer: fc2" in message  # the first output after the GELU
