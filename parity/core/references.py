"""Objects named on a command line as ``package.module:attr``: resolved, called where they are
factories, and refused in one line naming the option, the value, what it takes and the closest
name the module has. Imports no torch (``python -m parity check`` runs without it).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any

import optax

__all__ = [
    "call_factory",
    "closest",
    "load_function",
    "load_optax",
    "load_reference",
    "required_arguments",
]


def closest(value: str, allowed: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(value, list(allowed), n=1)
    return f"; did you mean {close[0]!r}?" if close else "."


def load_reference(option: str, reference: str) -> Any:
    """The object ``"package.module:attr"`` names (``attr`` may be dotted).

    Raises:
      ValueError: naming `option`, the reference, what it takes and, for a missing attribute,
        the closest name the module has.

    Example:
      >>> load_reference("--jax-loss", "math:pi")
      3.141592653589793
      >>> load_reference("--jax-loss", "math:pii")
      Traceback (most recent call last):
      ...
      ValueError: --jax-loss 'math:pii': module 'math' has no attribute 'pii'; did you mean 'pi'?
    """
    if not isinstance(reference, str) or reference.count(":") != 1 or reference.startswith(":"):
        raise ValueError(
            f"{option} takes 'package.module:attr' (an importable module, a colon, a name in "
            f"it); got {reference!r}."
        )
    module_name, attr = reference.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{option} {reference!r}: module {module_name!r} does not import ({e}); name a "
            "module importable from here (the current folder, or one on PYTHONPATH)."
        ) from None
    except Exception as e:  # the module's own code failed while importing
        raise ValueError(
            f"{option} {reference!r}: importing module {module_name!r} failed "
            f"({type(e).__name__}: {e})."
        ) from None
    where = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("__")]
            raise ValueError(
                f"{option} {reference!r}: {'module ' if where == module_name else ''}"
                f"{where!r} has no attribute {part!r}{closest(part, names)}"
            )
        obj = getattr(obj, part)
        where = f"{where}.{part}" if where != module_name else f"{module_name}:{part}"
    return obj


def required_arguments(fn: Any) -> int | None:
    """How many positional arguments `fn` requires (None: not inspectable)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sum(
        1
        for p in sig.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


def call_factory(option: str, reference: str, factory: Any) -> Any:
    try:
        return factory()
    except Exception as e:  # the user's factory failed: bad input, named
        raise ValueError(
            f"{option} {reference!r}: calling it with no arguments failed "
            f"({type(e).__name__}: {e})."
        ) from None


def load_function(option: str, reference: str | None, arity: int, takes: str) -> Any:
    """A callable of `arity` positional arguments (None when not given)."""
    if reference is None:
        return None
    fn = load_reference(option, reference)
    if not callable(fn):
        raise ValueError(f"{option} {reference!r} is a {type(fn).__name__}; it takes {takes}.")
    try:
        inspect.signature(fn).bind(*range(arity))
    except TypeError:
        raise ValueError(
            f"{option} {reference!r} cannot be called with {arity} argument"
            f"{'s' if arity > 1 else ''}; it takes {takes}."
        ) from None
    except ValueError:  # no signature to inspect (a builtin): taken as it is
        pass
    return fn


def load_optax(option: str, reference: str | None) -> Any:
    """The ``optax.GradientTransformation`` `reference` names, or the one the zero-argument
    factory it names returns (None when not given).

    Example:
      >>> load_optax("--jax-optimizer", "optax:sgd")
      Traceback (most recent call last):
      ...
      ValueError: --jax-optimizer 'optax:sgd' gives a function; it takes an optax...
    """
    if reference is None:
        return None
    takes = "an optax.GradientTransformation or a zero-argument factory returning one"
    obj = load_reference(option, reference)
    if (
        not isinstance(obj, optax.GradientTransformation)
        and callable(obj)
        and required_arguments(obj) == 0
    ):
        obj = call_factory(option, reference, obj)
    if not isinstance(obj, optax.GradientTransformation):
        raise ValueError(f"{option} {reference!r} gives a {type(obj).__name__}; it takes {takes}.")
    return obj
