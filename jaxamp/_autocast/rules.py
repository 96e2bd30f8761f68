"""Rule tables: the category autocast gives each primitive and each library composite.

Built from the torch op lists (`jaxamp._autocast.oplists`) and the user's ``overrides``:

* `primitive_categories`: primitive name -> category, by the torch ops each primitive serves;
* `function_table`: JAX/Flax/optax library functions that implement one torch op as a composite
  (flax ``Dense`` is torch's ``linear``) -> that op's category: a *region*;
* `Rules`: both, plus the primitive overrides that hold everywhere, for one autocast call.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from jaxamp._autocast import oplists
from jaxamp._autocast.oplists import AUTOCAST_CATEGORIES
from jaxamp._autocast.options import check_device, check_overrides

FULL_PRECISION_SCOPE = "jaxamp_full_precision"
FP32_CATEGORIES = frozenset({"fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "banned"})
# torch ops that torch itself decomposes (no kernel of their own): their JAX counterparts are left
# to the primitive rules unless the op is on a list.
_COMPOSITE_IN_TORCH = frozenset({"cross_entropy_loss", "einsum"})
# torch ops that also update buffers (running statistics) that keep their dtype under autocast.
OPS_WITH_BUFFERS = frozenset({"batch_norm"})

__all__ = ["AUTOCAST_CATEGORIES", "autocast_rules"]


def op_category(device: str, torch_op: str, op_overrides: Mapping[str, str]) -> str | None:
    """The category of ``torch_op`` on ``device``, after the caller's torch-op overrides."""
    for name in (torch_op, torch_op.split(".")[0]):
        if name in op_overrides:
            return op_overrides[name]
    return oplists.OP_LISTS[device].category(torch_op)


@functools.cache
def primitive_categories(
    device: str, op_overrides: tuple[tuple[str, str], ...] = ()
) -> Mapping[str, str]:
    """Primitive name -> category, derived from the torch op list and the counterpart table."""
    changed = dict(op_overrides)
    votes: dict[str, list[str]] = {}
    for torch_op, prims in oplists.PRIMITIVE_COUNTERPARTS.items():
        if torch_op in oplists.DIVERGENCES and torch_op not in changed:
            continue
        cat = op_category(device, torch_op, changed)
        for prim in prims:
            votes.setdefault(prim, [])
            if cat is not None:
                votes[prim].append(cat)
    out = {}
    for prim, cats in votes.items():
        # Composite torch ops (einsum on cpu) reach the same primitive through listed ones; the
        # listed category wins, the most common one if several.
        out[prim] = max(set(cats), key=cats.count) if cats else "keep"
    return out


def autocast_rules(
    device: str | None = None, overrides: Mapping[Any, str | None] | None = None
) -> dict[str, str]:
    """The category autocast gives each JAX primitive on ``device`` (primitives not named: "keep").

    Args:
      device: torch device type, ``"cpu"`` or ``"cuda"``; default from JAX's backend.
      overrides: primitive (or its name) or torch op name -> category, as accepted by
        :func:`autocast`.

    Returns:
      A new dict from primitive name to one of :data:`AUTOCAST_CATEGORIES`.

    Examples:
      >>> jaxamp.autocast_rules("cuda")["exp"]
      'fp32'
      >>> jaxamp.autocast_rules("cpu", overrides={"dot_general": "fp32"})["dot_general"]
      'fp32'
    """
    device = check_device(device)
    rules = Rules.build(device, overrides)
    return dict(rules.primitives)


@dataclasses.dataclass(frozen=True)
class Rules:
    """Everything autocast decides by, for one device and one set of overrides.

    ``primitives``: primitive name -> category (torch op lists through the counterpart table,
    then the primitive overrides). ``forced``: primitives the user overrode; their category holds
    wherever they run, inside composite regions too. ``functions``: library function (file,
    first line) -> (torch op, category), the composite regions.
    """

    primitives: Mapping[str, str]
    forced: Mapping[str, str]
    functions: Mapping[tuple[str, int], tuple[str, str]]

    @staticmethod
    def build(device: str, overrides: Mapping[Any, str | None] | None) -> Rules:
        prims, ops = check_overrides(overrides)
        op_key = tuple(sorted(ops.items()))
        primitives = {**primitive_categories(device, op_key), **prims}
        return Rules(primitives, prims, function_table(device, op_key))

    def region_category(self, torch_op: str, category: str) -> str:
        """A composite's category: a primitive override of its kernel (linear's dot_general)
        moves the whole composite, as moving the torch op would."""
        kernel = [
            self.forced[p]
            for p in oplists.PRIMITIVE_COUNTERPARTS.get(torch_op.split(".")[0], ())
            if p in self.forced
        ]
        return kernel[0] if kernel else category


def _resolve(spec: str) -> Any:
    module_name, qualname = spec.split(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@functools.cache
def function_table(
    device: str, op_overrides: tuple[tuple[str, str], ...] = ()
) -> Mapping[tuple[str, int], tuple[str, str]]:
    """(file, first line) of JAX library functions -> (torch op, category)."""
    changed = dict(op_overrides)
    table = {}
    for torch_op, specs in oplists.FUNCTION_COUNTERPARTS.items():
        cat = op_category(device, torch_op, changed)
        if cat is None and torch_op in _COMPOSITE_IN_TORCH:
            continue  # torch decomposes it; the primitive rules already match its pieces
        for spec in specs:
            try:
                fn = inspect.unwrap(_resolve(spec))
                code = fn.__code__
            except (ImportError, AttributeError):
                continue  # an optional library or a renamed function: no region for it
            table[(code.co_filename, code.co_firstlineno)] = (torch_op, cat or "keep")
    return table


@dataclasses.dataclass(frozen=True)
class Region:
    """A stretch of equations that follows one category: a torch op's composite or a marker."""

    category: str  # a category, or "as_written" for full-precision regions
    key: Any = None
    cast_outputs_like_input: bool = False
    # Only outputs shaped like the input take its dtype (batch_norm's running statistics are
    # buffers that keep their own dtype in torch).
    only_input_shaped: bool = False
    # The torch op whose composite this is (e.g. "linear" for flax Dense); None for markers.
    torch_op: str | None = None


AS_WRITTEN = Region("as_written", key="full_precision")
