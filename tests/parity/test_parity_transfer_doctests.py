"""The docstring examples of the mapping / adapter / data modules, the FLOP count and the step-0
tolerances run."""

from __future__ import annotations

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")

_MODULES = (
    "parity.pairs.mapping",
    "parity.pairs.variables",
    "parity.automap.core",
    "parity.automap.explain",
    "parity.automap.validate",
    "parity.pairs.adapters",
    "parity.pairs.dropout",
    "parity.twins.nnx_layers",
    "parity.perf.flops",
    "parity.verdicts.tolerance",
)
_DATA_NAMES = ("load_digits", "load_text", "text_fraction", "text_stream", "DataSpec")


def _tests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = {}
    for name in _MODULES:
        module = importlib.import_module(name)
        for test in finder.find(module, name, module=module):
            if test.examples:
                found.setdefault(test.name, test)
    data = importlib.import_module("parity.data")
    for name in _DATA_NAMES:
        for test in finder.find(getattr(data, name), f"parity.data.{name}", module=data):
            if test.examples:
                found.setdefault(test.name, test)
    api = importlib.import_module("parity.api")
    for test in finder.find(api.prepare_pair, "parity.api.prepare_pair", module=api):
        if test.examples:
            found.setdefault(test.name, test)
    return [found[k] for k in sorted(found)]


DOCTESTS = _tests()


@pytest.mark.standard_promotion
@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_examples_run(test):
    test.globs = {**test.globs, "np": np, "jax": jax, "jnp": jnp}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    runner.run(test, out=report.append)
    if runner.failures:
        pytest.fail("".join(report), pytrace=False)
