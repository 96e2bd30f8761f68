"""The examples in jaxamp's docstrings run, and every public name has one.

Each docstring with ``>>>`` lines is one test, run with `doctest` in a namespace that holds the
usual imports (``jax``, ``jnp``, ``np``, ``optax``, ``jaxamp``, ``jf`` = ``jaxamp.flax``, ``nn`` =
``flax.linen``, ``nnx``). Examples use JAX's default (standard) dtype promotion, as users do.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
import jaxamp.flax as jf
import jaxamp.mx

_OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
    names = ["jaxamp"]
    for info in pkgutil.walk_packages(jaxamp.__path__, "jaxamp."):
        names.append(info.name)
    return sorted(names)


def _doctests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for test in finder.find(module, name, module=module):
            if test.examples and test.name not in found:
                found[test.name] = test
    return [found[k] for k in sorted(found)]


DOCTESTS = _doctests()


def _globs() -> dict:
    return {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jaxamp": jaxamp, "jf": jf}


@pytest.mark.slow  # compiles: a few seconds each on a loaded 2-core machine
@pytest.mark.standard_promotion
@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_examples_run(test, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files (checkpoints) write here
    test.globs = {**test.globs, **_globs(), "nn": nn, "nnx": nnx}
    runner = doctest.DocTestRunner(optionflags=_OPTIONS)
    report: list[str] = []
    runner.run(test, out=report.append)
    if runner.failures:
        pytest.fail("".join(report), pytrace=False)


def _public_objects() -> dict[str, object]:
    out = {f"jaxamp.{n}": getattr(jaxamp, n) for n in jaxamp.__all__}
    out.update({f"jaxamp.flax.{n}": getattr(jf, n) for n in jf.__all__})
    for sub in ("linen", "nnx", "checkpoint"):
        module = getattr(jf, sub)
        out.update({f"jaxamp.flax.{sub}.{n}": getattr(module, n) for n in module.__all__})
    for module in (jaxamp.fp8, jaxamp.optim_precision, jaxamp.mx):
        out.update({f"{module.__name__}.{n}": getattr(module, n) for n in module.__all__})
    return out


# Values, not functions or classes: they have no docstring of their own; the docstring of the
# function that uses them documents them (with an example).
_DATA = {
    "jaxamp.AUTOCAST_CATEGORIES": "jaxamp.autocast_rules",
    "jaxamp.flax.float32_compute": "jaxamp.flax.override",
    "jaxamp.flax.linen.DEFAULT_RULES": "jaxamp.flax.linen.with_policy",
    "jaxamp.flax.nnx.DEFAULT_RULES": "jaxamp.flax.nnx.apply_policy",
    "jaxamp.fp8.RECIPE_NAMES": "jaxamp.fp8.get_recipe",
    "jaxamp.mx.FORMAT_NAMES": "jaxamp.mx.get_format",
    "jaxamp.mx.RECIPE_NAMES": "jaxamp.mx.get_recipe",
    "jaxamp.mx.SCALE_MODES": "jaxamp.mx.Format",
    "jaxamp.optim_precision.PRESETS": "jaxamp.optim_precision.preset",
    "jaxamp.optim_precision.STATE_FORMATS": "jaxamp.optim_precision.low_precision_state",
}
PUBLIC = _public_objects()


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_name_has_an_example(name):
    obj = PUBLIC[name]
    if name in _DATA:
        obj = PUBLIC[_DATA[name]]
    doc = obj.__doc__ if inspect.ismodule(obj) else inspect.getdoc(obj)
    assert doc and ">>>" in doc, f"{name}: its docstring has no example"
    assert doc.strip().splitlines()[0], f"{name}: no one-line summary"


def test_examples_are_collected():
    # A failure to import or find them must not pass silently.
    names = {t.name for t in DOCTESTS}
    assert "jaxamp._policy.get_policy" in names
    assert "jaxamp._autocast.api.autocast" in names
    assert len(DOCTESTS) > 20
