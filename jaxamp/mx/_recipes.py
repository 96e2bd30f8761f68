"""Block-scaled training recipes as data: which operand of which of a linear layer's three matmuls
takes which format (torchao's ``mx_mm`` / ``MXFP8TrainingOpConfig``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxamp.mx._formats import SCALE_MODES, Format, _closest
from jaxamp.mx._formats import get_format as _make_format

__all__ = ["RECIPE_NAMES", "Recipe", "get_recipe"]

RECIPE_NAMES = ("mxfp8", "mxfp8_floor", "mxfp8_wgrad_with_hp", "mxfp4", "mxfp4_floor")
_OPERANDS = (
    "input",
    "weight",
    "grad_output",
    "input_for_grad_weight",
    "weight_for_grad_input",
    "grad_output_for_grad_weight",
)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A block-scaled recipe for a linear layer ``y = x @ w`` (``x (M, K)``, ``w (K, N)``).

    The three matmuls and the axis each operand is blocked along (always the matmul's
    contracting axis, as torchao's ``mx_mm`` quantizes them):

    * ``output = input @ weight``: input blocked along K (its rows), weight along K (its
      columns; torch's ``(N, K)`` weight along its rows).
    * ``grad_input = grad_output @ weight.T``: grad_output along N, weight along N
      (`weight_for_grad_input`).
    * ``grad_weight = input.T @ grad_output``: both along M, the batch
      (`input_for_grad_weight`, `grad_output_for_grad_weight`); or in high precision with
      `grad_weight_hp` (torchao's ``wgrad_with_hp``).

    Each matmul runs on the operands dequantized to their own dtype, in float32 (``emulate=True``:
    torchao's ``KernelPreference.EMULATED``); with ``emulate=False`` on a GPU's block-scaled
    matmul units (``jax.nn.scaled_matmul``), refused where there are none.

    Attributes:
      name: the recipe's name.
      input, weight, grad_output: `Format` of each tensor where it feeds ``output`` /
        ``grad_input``.
      input_for_grad_weight, weight_for_grad_input, grad_output_for_grad_weight: the same
        tensors' formats where they feed the other matmul (None: the partner's format).
      grad_weight_hp: run ``grad_weight`` in high precision from the unquantized tensors.
      emulate: quantize, dequantize, float32 matmul (any backend); False: block-scaled matmul
        hardware (NVIDIA sm100+), refused elsewhere.

    Examples:
      A recipe of your own (`jaxamp.mx.get_recipe` makes the named ones): MXFP8 operands with
      RCEIL scales, the gradients' elements e5m2, run emulated; a matmul takes it as
      ``recipe=`` (as `jaxamp.mx.convert` and ``jaxamp.autocast(fp8=...)`` do):

      >>> import jax, jax.numpy as jnp, jaxamp.mx
      >>> e4m3 = jaxamp.mx.get_format("mxfp8", scale_mode="rceil")
      >>> e5m2 = jaxamp.mx.get_format("mxfp8_e5m2", scale_mode="rceil")
      >>> mine = jaxamp.mx.Recipe("e5m2_grads", e4m3, e4m3, e5m2, emulate=True)
      >>> print(mine.describe())
      e5m2_grads: output=mxfp8/rceil x mxfp8/rceil (blocks along K), grad_input=mxfp8_e5m2/rceil x mxfp8/rceil (along N), grad_weight=mxfp8/rceil x mxfp8_e5m2/rceil (along M), emulated
      >>> @jax.jit
      ... def matmul(x, w):
      ...     return jaxamp.mx.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=mine)
      >>> y = matmul(jnp.full((32, 64), 0.5), jnp.ones((64, 32)))
      >>> y.shape, y[0, 0].item()  # 0.5 and 1.0 are exact in every format
      ((32, 32), 32.0)
    """

    name: str
    input: Format = dataclasses.field(default_factory=lambda: _make_format("mxfp8"))
    weight: Format = dataclasses.field(default_factory=lambda: _make_format("mxfp8"))
    grad_output: Format = dataclasses.field(default_factory=lambda: _make_format("mxfp8"))
    input_for_grad_weight: Format | None = None
    weight_for_grad_input: Format | None = None
    grad_output_for_grad_weight: Format | None = None
    grad_weight_hp: bool = False
    emulate: bool = False

    # What jaxamp.fp8's matmul rewrite (convert, report, autocast's fp8= hook) reads of a recipe.
    scaling = "dynamic"

    def __post_init__(self):
        for field, partner in (
            ("input_for_grad_weight", "input"),
            ("weight_for_grad_input", "weight"),
            ("grad_output_for_grad_weight", "grad_output"),
        ):
            if getattr(self, field) is None:
                object.__setattr__(self, field, getattr(self, partner))
        for field in _OPERANDS:
            value = getattr(self, field)
            if isinstance(value, str):
                value = _make_format(value)
                object.__setattr__(self, field, value)
            if not isinstance(value, Format):
                raise TypeError(
                    f"Recipe: `{field}` must be a jaxamp.mx.Format or a format name; got {value!r}."
                )
        for a, b, gemm in (
            ("input", "weight", "output"),
            ("grad_output", "weight_for_grad_input", "grad_input"),
            ("input_for_grad_weight", "grad_output_for_grad_weight", "grad_weight"),
        ):
            fa, fb = getattr(self, a), getattr(self, b)
            if fa.block_size != fb.block_size:
                raise ValueError(
                    f"Recipe {self.name!r}: the {gemm} matmul's operands have block sizes "
                    f"{fa.block_size} ({a}) and {fb.block_size} ({b}); one matmul contracts "
                    "blocks of one size."
                )
        for flag in ("grad_weight_hp", "emulate"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"Recipe: {flag} must be a bool; got {getattr(self, flag)!r}.")

    def replace(self, **changes: Any) -> Recipe:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def how(self) -> str:
        """How its matmuls run, for `report` rows."""
        fmts = sorted(
            {f.name + "/" + (f.scale_mode or "e4m3") for f, _ in self.operands().values()}
        )
        where = (
            "emulated (float32 matmul of dequantized blocks)"
            if self.emulate
            else "block-scaled matmul"
        )
        return f"{self.name} ({', '.join(fmts)}), {where}" + (
            ", grad_weight in high precision" if self.grad_weight_hp else ""
        )

    def with_scale_mode(self, mode: str) -> Recipe:
        """This recipe with every e8m0-scaled operand in scale mode `mode`."""
        if mode not in SCALE_MODES:
            raise ValueError(
                f"Recipe.with_scale_mode: mode must be one of {SCALE_MODES}; got {mode!r}."
                f"{_closest(str(mode).lower(), SCALE_MODES)}"
            )
        changes = {
            f: getattr(self, f).replace(scale_mode=mode)
            for f in _OPERANDS
            if getattr(self, f).scale == "e8m0"
        }
        return self.replace(**changes)

    def operands(self) -> dict[str, tuple[Format, str]]:
        """``{operand: (format, blocked axis)}`` for the six operands (the three matmuls)."""
        return {
            "input": (self.input, "K"),
            "weight": (self.weight, "K"),
            "grad_output": (self.grad_output, "N"),
            "weight_for_grad_input": (self.weight_for_grad_input, "N"),
            "input_for_grad_weight": (self.input_for_grad_weight, "M"),
            "grad_output_for_grad_weight": (self.grad_output_for_grad_weight, "M"),
        }

    def describe(self) -> str:
        """One line: each matmul's operand formats.

        Examples:
          >>> import jaxamp.mx
          >>> print(jaxamp.mx.get_recipe("mxfp8_wgrad_with_hp").describe())
          mxfp8_wgrad_with_hp: output=mxfp8/rceil x mxfp8/rceil (blocks along K), grad_input=mxfp8/rceil x mxfp8/rceil (along N), grad_weight=high precision
        """

        def f(fmt: Format) -> str:
            return f"{fmt.name}/{fmt.scale_mode or 'e4m3'}"

        gw = (
            "high precision"
            if self.grad_weight_hp
            else f"{f(self.input_for_grad_weight)} x {f(self.grad_output_for_grad_weight)} "
            "(along M)"
        )
        return (
            f"{self.name}: output={f(self.input)} x {f(self.weight)} (blocks along K), "
            f"grad_input={f(self.grad_output)} x {f(self.weight_for_grad_input)} (along N), "
            f"grad_weight={gw}" + (", emulated" if self.emulate else "")
        )


def get_recipe(name: str | Recipe, *, scale_mode: str | None = None, **changes: Any) -> Recipe:
    """A block-scaled training recipe by name (torchao's ``mx_mm`` configurations).

    * ``mxfp8``: every operand MXFP8 (e4m3, 32-element e8m0 blocks), RCEIL scales: torchao's
      ``MXFP8TrainingOpConfig()`` / recipe ``MXFP8_RCEIL`` (``MXFP8_EMULATED_RCEIL`` with
      ``emulate=True``).
    * ``mxfp8_floor``: the same with FLOOR scales (``scale_calculation_mode=FLOOR``).
    * ``mxfp8_wgrad_with_hp``: RCEIL, ``grad_weight`` in high precision (``MXFP8_RCEIL_WGRAD_WITH_HP``).
    * ``mxfp4`` / ``mxfp4_floor``: every operand MXFP4 (e2m1, 32-element e8m0 blocks), RCEIL /
      FLOOR scales (torchao's ``mx_mm`` with ``float4_e2m1fn_x2`` elements).

    Args:
      name: a name above, or a `Recipe` (returned with the changes applied).
      scale_mode: if given, every e8m0 operand's scale mode (``"floor"``, ``"rceil"``, ...).
      **changes: `Recipe` fields to override, e.g. ``emulate=True``.

    Examples:
      >>> import jaxamp.mx
      >>> r = jaxamp.mx.get_recipe("mxfp8", emulate=True)
      >>> r.input.scale_mode, r.grad_output.element, r.emulate
      ('rceil', 'e4m3', True)
    """
    if isinstance(name, Recipe):
        base = name
    elif name in ("mxfp8", "mxfp8_floor", "mxfp8_wgrad_with_hp", "mxfp4", "mxfp4_floor"):
        fmt = _make_format(
            "mxfp4" if name.startswith("mxfp4") else "mxfp8",
            scale_mode="floor" if name.endswith("_floor") else "rceil",
        )
        base = Recipe(name, fmt, fmt, fmt, grad_weight_hp=name == "mxfp8_wgrad_with_hp")
    else:
        raise ValueError(
            f"jaxamp.mx.get_recipe: unknown recipe {name!r}; valid: {RECIPE_NAMES}."
            f"{_closest(name, RECIPE_NAMES)}"
        )
    if scale_mode is not None:
        base = base.with_scale_mode(scale_mode)
    return base.replace(**changes) if changes else base
