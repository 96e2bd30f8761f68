"""The documentation site's worked examples run as written, and every page of a topic has one.

A page's ``pycon`` blocks (``>>>`` sessions) are one doctest, run top to bottom in one namespace
holding the usual imports; ``python`` blocks are illustrations and are not run. Scripts a page
includes from ``docs/examples/`` are run by their own tests.
"""

from __future__ import annotations

import doctest
import re
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
import jaxamp.flax as jf

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
_FENCE = re.compile(r"^```pycon\n(.*?)^```", re.MULTILINE | re.DOTALL)
_INCLUDE = re.compile(r'^--8<-- "(docs/examples/[^"]+)"', re.MULTILINE)
_OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p.parent.name != "api")


def _session(page: Path) -> str:
    return "\n".join(_FENCE.findall(page.read_text()))


def _param(page: Path):
    # The harness pages' examples train both frameworks, run the CLI or read the example
    # project's golden file: they run from the repository root, as a reader's would.
    marks = [pytest.mark.integration, pytest.mark.torch] if page.parent.name == "harness" else []
    return pytest.param(page, marks=marks, id=str(page.relative_to(DOCS)))


PAGES_WITH_EXAMPLES = [_param(p) for p in _pages() if _session(p)]


@pytest.mark.standard_promotion
@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES)
def test_page_examples_run(page, tmp_path, monkeypatch):
    if page.parent.name == "harness":
        pytest.importorskip("torch")
        monkeypatch.chdir(REPO)
        monkeypatch.syspath_prepend(str(REPO))
    else:
        monkeypatch.chdir(tmp_path)  # examples that write files write here
    globs = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jaxamp": jaxamp, "jf": jf}
    globs.update(nn=nn, nnx=nnx)
    name = str(page.relative_to(DOCS))
    test = doctest.DocTestParser().get_doctest(_session(page), globs, name, str(page), 0)
    runner = doctest.DocTestRunner(optionflags=_OPTIONS)
    report: list[str] = []
    runner.run(test, out=report.append)
    if runner.failures:
        pytest.fail("".join(report), pytrace=False)


# Pages of a topic (a guide or a harness page) must carry a worked example that runs: a pycon
# session here, or a script under docs/examples/ with its own test.
TOPIC_PAGES = [p for p in _pages() if p.parent.name in ("guide", "harness")]


@pytest.mark.parametrize("page", TOPIC_PAGES, ids=[p.name for p in TOPIC_PAGES])
def test_every_topic_page_has_a_worked_example(page):
    text = page.read_text()
    includes = _INCLUDE.findall(text)
    for path in includes:
        assert (REPO / path).is_file(), f"{page.name} includes a missing {path}"
    assert _session(page) or includes, f"{page.name}: no pycon session and no included example"


def _load_example(name: str):
    import importlib.util

    path = DOCS / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (flax modules) look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.standard_promotion
def test_flax_training_loop_trains_checkpoints_and_resumes(tmp_path):
    loop = _load_example("flax_training_loop")
    state, log = loop.train(tmp_path, steps=8, log_every=4, checkpoint_every=4)
    assert [row["step"] for row in log] == [4, 8]
    assert {"loss", "loss_scale", "last_step_applied", "skipped_steps"} <= set(log[0])
    xs, ys = loop.make_batches(0, 8, 32)
    fresh = loop.create_state(
        jax.random.key(0), xs[0], policy="fp16-mixed", learning_rate=3e-3, accumulate=2
    )

    @jax.jit
    def loss_of(params):
        logits = state.apply_fn({"params": params}, xs.reshape(-1, xs.shape[-1]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, ys.ravel()).mean()

    assert float(loss_of(state.params)) < float(
        loss_of(fresh.params)
    )  # it learns, accumulating 2 micro-batches a step
    assert log[-1]["last_step_applied"] and log[-1]["loss_scale"] == 2.0**16
    # Accumulation: the inner optimizer stepped once per 2 micro-batches.
    assert int(jaxamp.get_loss_scale(state.opt_state).loss_scale) == 2**16
    restored = loop.resume(tmp_path)
    assert int(restored.step) == int(state.step)
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(
        jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_api_page_check_names_a_missing_entry(tmp_path):
    # The check CI runs on the built site (scripts/check_docs_api.py): a page that lacks one
    # public name's entry is reported, by name; with every entry present nothing is.
    import importlib

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        check = importlib.import_module("check_docs_api")
    finally:
        sys.path.remove(str(REPO / "scripts"))
    pages: dict[str, list[str]] = {}
    for module_name, page in check.PAGES.items():
        module = importlib.import_module(module_name)
        for name in module.__all__:
            address = f"{module_name}.{name}"
            entry = f"<code>{address}</code>" if address in check.SECTIONS else f'id="{address}"'
            pages.setdefault(page, []).append(f"<h2 {entry}></h2>")
    for page, entries in pages.items():
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("\n".join(entries))
    assert check.missing_names(tmp_path) == []
    page = tmp_path / check.PAGES["jaxamp"]
    page.write_text(page.read_text().replace('id="jaxamp.loss_scaled"', ""))
    assert check.missing_names(tmp_path) == [
        "jaxamp.loss_scaled (expected on api/jaxamp/index.html)"
    ]
