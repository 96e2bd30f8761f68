"""FP8 training recipes as data: torchao's three dynamic recipes and Flax-style delayed scaling."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["Cast", "Recipe", "RECIPE_NAMES", "get_recipe"]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_FP8_DTYPES = {"float8_e4m3fn": E4M3, "e4m3": E4M3, "float8_e5m2": E5M2, "e5m2": E5M2}
GRANULARITIES = ("tensorwise", "rowwise")
RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")
# Delayed scaling's margin: at log2(fp8_max / smallest subnormal) of e4m3 (the forward operands'
# dtype), 17.807, the amax quantizes to the smallest subnormal and every smaller value to 0.
_E4M3_INFO = jnp.finfo(E4M3)
MAX_MARGIN = float(np.log2(float(_E4M3_INFO.max) / float(_E4M3_INFO.smallest_subnormal)))


def _closest(value: Any, allowed) -> str:
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _fp8_dtype(value: Any, where: str) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = _FP8_DTYPES.get(str(value))
    if dtype is None or dtype not in (E4M3, E5M2):
        raise ValueError(
            f"{where}: dtype must be float8_e4m3fn or float8_e5m2 (or None for high precision); "
            f"got {value!r}.{_closest(value, _FP8_DTYPES)}"
        )
    return dtype


@dataclasses.dataclass(frozen=True)
class Cast:
    """How one operand of one matmul is cast (torchao's ``CastConfig``).

    Attributes:
      dtype: ``float8_e4m3fn``, ``float8_e5m2``, or None: the operand stays in high precision.
      granularity: ``"tensorwise"`` (one scale) or ``"rowwise"`` (one scale per row of the
        operand as the matmul sees it: the amax is taken over the matmul's contracting axis,
        torchao's ``AXISWISE``).

    Examples:
      >>> import jaxamp.fp8 as f8
      >>> str(f8.Cast("float8_e4m3fn", "rowwise")), f8.Cast().fp8  # Cast(): high precision
      ('e4m3/rowwise', False)
    """

    dtype: Any = None
    granularity: str = "tensorwise"

    def __post_init__(self):
        object.__setattr__(self, "dtype", _fp8_dtype(self.dtype, "Cast"))
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"Cast: granularity must be one of {GRANULARITIES}; got {self.granularity!r}."
                f"{_closest(self.granularity, GRANULARITIES)}"
            )

    @property
    def fp8(self) -> bool:
        """Whether the operand is cast to fp8 (False: high precision)."""
        return self.dtype is not None

    def __str__(self) -> str:
        if self.dtype is None:
            return "hp"
        return f"{'e4m3' if self.dtype == E4M3 else 'e5m2'}/{self.granularity}"


_HP = Cast(None)
_E4M3_T = Cast(E4M3, "tensorwise")
_E5M2_T = Cast(E5M2, "tensorwise")
_E4M3_R = Cast(E4M3, "rowwise")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An fp8 training recipe: which operand of which of a linear layer's three matmuls is cast how.

    The three matmuls of ``y = x @ w`` (torchao's names): ``output = input @ weight``,
    ``grad_input = grad_output @ weight.T``, ``grad_weight = input.T @ grad_output``. Each operand
    has its own `Cast`. Build recipes with `recipe`; the fields are public so a variant is one
    ``dataclasses.replace`` away.

    Attributes:
      name: the recipe's name (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``,
        ``"delayed"``, or a user's).
      scaling: ``"dynamic"`` (scale from this tensor's amax, torchao) or ``"delayed"`` (scale from
        an amax history carried between steps, Flax's ``Fp8DirectDotGeneralOp``).
      input, weight, grad_output: casts for the ``output``/``grad_input`` matmuls.
      input_for_grad_weight, weight_for_grad_input, grad_output_for_grad_weight: casts of the
        same tensors where they feed the other matmul.
      power_of_2_scales: round every scale down to a power of two (torchao's
        ``round_scales_to_power_of_2``).
      emulate: allow running on hardware without fp8 matmul units (CPU, GPUs before sm89) by
        dequantizing the fp8 operands to float32 before the matmul, exactly as torchao's
        ``emulate=True``. With False the matmul takes fp8 operands (``lax.dot_general`` on
        float8 arrays) and a backend without fp8 matmuls is refused.
      amax_history_length, margin: delayed scaling only (Flax defaults 1024 and 0): the scale
        is ``fp8_max / max(history) / 2**margin``.

    Examples:
      >>> import dataclasses, jaxamp.fp8 as f8
      >>> rec = f8.get_recipe("rowwise_with_gw_hp")
      >>> str(rec.input), str(rec.grad_output_for_grad_weight), rec.scaling
      ('e4m3/rowwise', 'hp', 'dynamic')
      >>> dataclasses.replace(rec, name="mine", emulate=True).name
      'mine'
    """

    name: str
    scaling: str = "dynamic"
    input: Cast = _E4M3_T
    weight: Cast = _E4M3_T
    grad_output: Cast = _E5M2_T
    input_for_grad_weight: Cast | None = None
    weight_for_grad_input: Cast | None = None
    grad_output_for_grad_weight: Cast | None = None
    power_of_2_scales: bool = False
    emulate: bool = False
    amax_history_length: int = 1024
    margin: float = 0.0

    def __post_init__(self):
        if self.scaling not in ("dynamic", "delayed"):
            raise ValueError(
                f"Recipe: scaling must be 'dynamic' or 'delayed'; got {self.scaling!r}."
                f"{_closest(self.scaling, ('dynamic', 'delayed'))}"
            )
        for field, partner in (
            ("input_for_grad_weight", "input"),
            ("weight_for_grad_input", "weight"),
            ("grad_output_for_grad_weight", "grad_output"),
        ):
            if getattr(self, field) is None:
                object.__setattr__(self, field, getattr(self, partner))
        for field in (
            "input",
            "weight",
            "grad_output",
            "input_for_grad_weight",
            "weight_for_grad_input",
            "grad_output_for_grad_weight",
        ):
            if not isinstance(getattr(self, field), Cast):
                raise TypeError(
                    f"Recipe: `{field}` must be a jaxamp.fp8.Cast; got {getattr(self, field)!r}."
                )
        # torchao's rule: both operands of one matmul are fp8, or both are high precision.
        for a, b, gemm in (
            ("input", "weight", "output"),
            ("grad_output", "weight_for_grad_input", "grad_input"),
            ("input_for_grad_weight", "grad_output_for_grad_weight", "grad_weight"),
        ):
            if getattr(self, a).fp8 != getattr(self, b).fp8:
                raise ValueError(
                    f"Recipe {self.name!r}: the {gemm} matmul mixes fp8 and high precision "
                    f"operands ({a}={getattr(self, a)}, {b}={getattr(self, b)}); both or neither."
                )
        if not (self.input.fp8 and self.weight.fp8):
            raise ValueError(f"Recipe {self.name!r}: the forward matmul must be fp8.")
        if (
            isinstance(self.amax_history_length, bool)
            or not isinstance(self.amax_history_length, int)
            or self.amax_history_length < 1
        ):
            raise ValueError(
                f"Recipe: amax_history_length must be an int >= 1; got {self.amax_history_length!r}."
            )
        if isinstance(self.margin, bool | np.bool_) or not isinstance(
            self.margin, int | float | np.integer | np.floating
        ):
            raise TypeError(
                f"Recipe: margin must be a real number (int or float) in [0, {MAX_MARGIN:.3f}); "
                f"got {type(self.margin).__name__} {self.margin!r}."
            )
        if not 0.0 <= float(self.margin) < MAX_MARGIN:
            raise ValueError(
                f"Recipe: margin must be in [0, {MAX_MARGIN:.3f}); got {self.margin!r}. The "
                "scale is fp8_max / amax / 2**margin: a negative margin scales the amax past "
                "fp8_max (saturating it); at log2(448 / 2**-9) = 17.807 the amax itself "
                "quantizes to float8_e4m3fn's smallest subnormal and every smaller value to 0."
            )
        object.__setattr__(self, "margin", float(self.margin))
        if not isinstance(self.power_of_2_scales, bool):
            raise TypeError(
                f"Recipe: power_of_2_scales must be a bool; got {self.power_of_2_scales!r}."
            )
        if self.scaling == "delayed" and (
            self.power_of_2_scales
            or any(
                c.granularity != "tensorwise" or c.dtype != d
                for c, d in (
                    (self.input, E4M3),
                    (self.weight, E4M3),
                    (self.grad_output, E5M2),
                    (self.input_for_grad_weight, E4M3),
                    (self.weight_for_grad_input, E4M3),
                    (self.grad_output_for_grad_weight, E5M2),
                )
            )
        ):
            raise ValueError(
                "Recipe: delayed scaling is tensorwise with e4m3 inputs/weights and e5m2 "
                "gradients (Flax's fp8 ops); other casts need scaling='dynamic'."
            )
        if not isinstance(self.emulate, bool):
            raise TypeError(f"Recipe: emulate must be a bool; got {self.emulate!r}.")

    def replace(self, **changes: Any) -> Recipe:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One line: the casts of the three matmuls."""
        return (
            f"{self.name} ({self.scaling}): output={self.input}x{self.weight}, "
            f"grad_input={self.grad_output}x{self.weight_for_grad_input}, "
            f"grad_weight={self.input_for_grad_weight}x{self.grad_output_for_grad_weight}"
            + (", power-of-2 scales" if self.power_of_2_scales else "")
            + (", emulated" if self.emulate else "")
        )


def get_recipe(name: str | Recipe, **changes: Any) -> Recipe:
    """An fp8 recipe by name: torchao's ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``, or ``delayed``.

    * ``tensorwise`` (torchao's default): one scale per tensor; e4m3 input and weight, e5m2
      gradient; ``scale = fp8_max / max(amax, 1e-12)``.
    * ``rowwise``: e4m3 for all operands, one scale per row (amax over each matmul's contracting
      axis), scales rounded down to powers of two.
    * ``rowwise_with_gw_hp``: rowwise input/weight/gradient for ``output`` and ``grad_input``
      (the weight tensorwise there), the ``grad_weight`` matmul in high precision.
    * ``delayed``: Flax's ``Fp8DirectDotGeneralOp``: tensorwise scales from an amax history
      (length 1024, margin 0), carried as explicit state (`init_state`).

    Args:
      name: a name above, or a `Recipe` (returned with `changes` applied).
      **changes: `Recipe` fields to override, e.g. ``emulate=True``, ``amax_history_length=16``.

    Returns:
      A frozen `Recipe`.

    Examples:
      >>> import jaxamp.fp8
      >>> jaxamp.fp8.get_recipe("rowwise", emulate=True).power_of_2_scales
      True
    """
    if isinstance(name, Recipe):
        return name.replace(**changes) if changes else name
    if name == "tensorwise":
        base = Recipe("tensorwise")
    elif name == "rowwise":
        base = Recipe(
            "rowwise",
            input=_E4M3_R,
            weight=_E4M3_R,
            grad_output=_E4M3_R,
            power_of_2_scales=True,
        )
    elif name == "rowwise_with_gw_hp":
        base = Recipe(
            "rowwise_with_gw_hp",
            input=_E4M3_R,
            weight=_E4M3_R,
            grad_output=_E4M3_R,
            weight_for_grad_input=_E4M3_T,
            input_for_grad_weight=_HP,
            grad_output_for_grad_weight=_HP,
            power_of_2_scales=True,
        )
    elif name == "delayed":
        base = Recipe("delayed", scaling="delayed")
    else:
        raise ValueError(
            f"jaxamp.fp8.get_recipe: unknown recipe {name!r}; valid: {RECIPE_NAMES}."
            f"{_closest(name, RECIPE_NAMES)}"
        )
    return base.replace(**changes) if changes else base
