"""Old addresses of public names keep working for one release, each with a DeprecationWarning
that names the new address; every one is enumerated here from the one table that defines them."""

from __future__ import annotations

import importlib
import re

import pytest

import jaxamp
from jaxamp import _deprecation

MODULE_NAMES = [
    (old, name, new)
    for old, (_, names) in sorted(_deprecation.MODULES.items())
    for name, new in sorted(names.items())
]
PACKAGE_NAMES = [
    (package, name, new)
    for package, names in sorted(_deprecation.NAMES.items())
    for name, new in sorted(names.items())
]


def _public(address: str):
    module, _, name = address.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(
    "old, name, new", MODULE_NAMES, ids=[f"{o}.{n}" for o, n, _ in MODULE_NAMES]
)
def test_old_module_address_warns_and_gives_the_same_object(old, name, new):
    module = importlib.import_module(old)  # importing the old module alone does not warn
    if new is None:
        with pytest.warns(
            DeprecationWarning, match=rf"{re.escape(old)}\.{name} .*no longer public"
        ):
            obj = getattr(module, name)
        private, _ = _deprecation.MODULES[old]
        assert obj is getattr(importlib.import_module(private), name)
    else:
        with pytest.warns(DeprecationWarning, match=rf"use {re.escape(new)}\b"):
            obj = getattr(module, name)
        assert obj is _public(new)
        with pytest.warns(DeprecationWarning, match=re.escape(new)):
            exec(f"from {old} import {name}", {})


@pytest.mark.parametrize(
    "package, name, new", PACKAGE_NAMES, ids=[f"{p}.{n}" for p, n, _ in PACKAGE_NAMES]
)
def test_moved_or_renamed_name_warns_and_gives_the_same_object(package, name, new):
    namespace = importlib.import_module(package)
    with pytest.warns(
        DeprecationWarning,
        match=rf"{re.escape(package)}\.{name} is deprecated: use {re.escape(new)}\b",
    ):
        obj = getattr(namespace, name)
    assert obj is _public(new)
    assert name not in namespace.__all__


@pytest.mark.parametrize("old", sorted(_deprecation.MODULES))
def test_old_module_as_an_attribute_warns(old):
    package, _, name = old.rpartition(".")
    namespace = importlib.import_module(package)
    namespace.__dict__.pop(name, None)  # as if the old module had not been imported yet
    with pytest.warns(DeprecationWarning, match=rf"the module {re.escape(old)} is deprecated"):
        module = getattr(namespace, name)
    assert module.__name__ == old


def test_every_new_address_is_public_and_unknown_names_still_raise():
    for _, _, new in MODULE_NAMES + PACKAGE_NAMES:
        if new is not None:
            module, _, name = new.rpartition(".")
            assert name in importlib.import_module(module).__all__, new
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        jaxamp.nonexistent  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        importlib.import_module("jaxamp.policy").nonexistent  # noqa: B018
