"""Loss scales: immutable pytrees implementing jmp's LossScale protocol with torch's update rule.

`DynamicLossScale.create()` moves the scale exactly as `torch.amp.GradScaler` does, with one
deliberate difference: the scale never falls below `min_scale` (default: the smallest normal
float32), so it cannot decay to 0.0 the way torch's does after ~150 overflows in a row.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._numerics import (
    F32_MAX,
    F32_TINY,
    INT32_MAX,
    mul_like_torch,
    scale_tree,
    unscale_tree,
)

__all__ = [
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "as_loss_scale",
    "default_loss_scale",
    "PRESET_NAMES",
]


@runtime_checkable
class LossScale(Protocol):
    """jmp's loss-scale protocol; jmp's own loss-scale objects satisfy it too.

    Examples:
      >>> import jmp
      >>> isinstance(jaxamp.DynamicLossScale.create(), jaxamp.LossScale)
      True
      >>> isinstance(jmp.DynamicLossScale(jnp.float32(2.0**15)), jaxamp.LossScale)
      True
    """

    @property
    def loss_scale(self) -> jax.Array: ...

    def scale(self, tree: Any) -> Any: ...

    def unscale(self, tree: Any) -> Any: ...

    def adjust(self, grads_finite: jax.Array) -> LossScale: ...


def _host_number(name: str, value: Any, allowed: str) -> int | float:
    """`value` as a Python int or float: a number, or a concrete 0-d NumPy/JAX array of an int
    or float dtype (jmp's idiom ``jnp.float32(2 ** 15)``). Bools, strings, tracers and arrays of
    any other shape are refused, naming `name` and what it must be (`allowed`)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a concrete number ({allowed}); got a traced value "
            f"({value.aval.str_short()}). Loss scales hold their settings as Python numbers: "
            "build them outside jax.jit/vmap/grad, e.g. once before the training loop."
        )
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {allowed}; got the bool {value!r}.")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return value
    if isinstance(value, (np.ndarray, jax.Array)):
        dtype = np.dtype(value.dtype)
        real = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
        if value.shape != () or not real or dtype == np.bool_:
            raise TypeError(
                f"{name} must be {allowed}: a number or a 0-d int/float array; got an array "
                f"of shape {value.shape} and dtype {dtype.name}."
            )
        return int(value) if jnp.issubdtype(dtype, jnp.integer) else float(value)
    raise TypeError(f"{name} must be {allowed}; got {type(value).__name__} {value!r}.")


def _check_scale_value(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """`value` as a float that is finite and > 0 (>= 0) *after* rounding to float32.

    1e-50 is 0.0 in float32 and 1e50 is inf: both would be stored as such, so both are refused.
    """
    allowed = ">= 0" if allow_zero else "> 0"
    as_float = float(
        _host_number(name, value, f"a real number (int or float), finite and {allowed} in float32")
    )
    with np.errstate(over="ignore", under="ignore"):
        as_f32 = float(np.float32(as_float)) if math.isfinite(as_float) else as_float
    ok = math.isfinite(as_f32) and (as_f32 >= 0 if allow_zero else as_f32 > 0)
    if not ok or (as_float > 0 and as_f32 == 0 and not allow_zero):
        raise ValueError(
            f"{name} must be finite and {allowed} in float32 (between {F32_TINY:.3g} and "
            f"{F32_MAX:.4g} for a scale); got {value!r}, which is {as_f32!r} in float32."
        )
    return as_float


class _ScaleMixin:
    """scale/unscale shared by every loss scale with a `loss_scale` field."""

    loss_scale: jax.Array

    def scale(self, tree: Any) -> Any:
        """Multiplies floating leaves (e.g. the loss) by the scale.

        Returns float32 for float16/bfloat16/float32 leaves (float64 stays float64): a float16
        loss times 2**16 would overflow, so scaling happens in float32.
        """
        return scale_tree(tree, self.loss_scale)

    def unscale(self, tree: Any) -> Any:
        """Multiplies floating leaves by torch's float32(1/scale); each leaf keeps its dtype.

        float32 leaves come back float32; float16 and bfloat16 leaves come back in their own dtype
        (computed in float32, then rounded once). Bit-identical to torch's `unscale_` wherever
        torch's result is a normal float32, at every scale up to float32 max, also on backends
        that flush subnormals (where 1/scale above 2**126 is one: see `inverse_scale`).
        """
        return unscale_tree(tree, self.loss_scale)

    def inverse_scale(self) -> jax.Array:
        """torch's float32(1/scale) as one float32 array.

        Warning:
          Above 2**126 this is a float32 subnormal, which XLA flushes to zero on CPU and TPU.
          `unscale` does not use it; it multiplies by `reciprocal_factors(scale)`, exact there.
        """
        return jnp.float32(1.0) / jnp.asarray(self.loss_scale, jnp.float32)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(_ScaleMixin):
    """No loss scaling: `scale` and `unscale` return their input unchanged.

    Examples:
      >>> scale = jaxamp.NoOpLossScale()
      >>> float(scale.loss_scale), float(scale.scale(jnp.float32(3.0)))
      (1.0, 3.0)
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: Any) -> Any:
        return tree

    def unscale(self, tree: Any) -> Any:
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        del grads_finite
        return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale(_ScaleMixin):
    """A constant loss scale (float32). `adjust` returns it unchanged.

    Examples:
      >>> scale = jaxamp.StaticLossScale(1024.0)
      >>> float(scale.scale(jnp.float32(2.0))), float(scale.unscale(jnp.float32(2048.0)))
      (2048.0, 2.0)
      >>> scale.adjust(jnp.array(False)) is scale
      True
    """

    loss_scale: jax.Array

    def __init__(self, loss_scale: Any = 2.0**15):
        """Args:
          loss_scale: a number or a concrete 0-d array (``jnp.float32(1024)``), finite and > 0
            in float32.

        Raises:
          TypeError / ValueError: anything else (a string, a bool, a list, None, a traced
            value, 0, inf, a negative or non-scalar array).

        Only a user's call validates: JAX rebuilds this pytree (`tree_map`, `vmap`, `pmap`,
        `flax.jax_utils.replicate`) without calling `__init__`, so stacked or replicated
        scales (shape ``(n,)``) and tracers pass through.
        """
        value = _check_scale_value("StaticLossScale(loss_scale=...)", loss_scale)
        object.__setattr__(self, "loss_scale", jnp.asarray(value, jnp.float32))

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        del grads_finite
        return self


_STATIC_FIELDS = tuple(f.name for f in dataclasses.fields(StaticLossScale))


def _rebuild_static(aux: tuple, children: Any) -> StaticLossScale:
    del aux
    rebuilt = object.__new__(StaticLossScale)  # not __init__: it validates a user's value
    for name, value in zip(_STATIC_FIELDS, children, strict=True):
        object.__setattr__(rebuilt, name, value)
    return rebuilt


# Not `register_dataclass`: it rebuilds through `__init__`, which refused the stacked (n,)
# scales of vmap/pmap. The children are every dataclass field, so none is dropped on a round
# trip (jmp's hand-written flatten drops `min_loss_scale`).
jax.tree_util.register_pytree_with_keys(
    StaticLossScale,
    lambda s: (tuple((jax.tree_util.GetAttrKey(n), getattr(s, n)) for n in _STATIC_FIELDS), ()),
    _rebuild_static,
    lambda s: (tuple(getattr(s, n) for n in _STATIC_FIELDS), ()),
)


GrowthRule = Literal["torch", "flax"]
PRESET_NAMES = ("torch", "jmp", "flax", "keras", "megatron")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["loss_scale", "growth_tracker", "hysteresis_tracker"],
    meta_fields=[
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "min_scale",
        "max_scale",
        "hysteresis",
        "growth_rule",
    ],
)
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(_ScaleMixin):
    """A dynamic loss scale with torch.amp.GradScaler's update rule; an immutable pytree.

    Data (pytree children): `loss_scale` (float32 scalar), `growth_tracker` (int32: consecutive
    finite steps since the last growth or backoff), `hysteresis_tracker` (int32: overflows left
    before a backoff). Every other field is a static hyperparameter, kept through `jit`,
    `tree_map` and checkpoints. Build one with `create` or `from_preset`.

    The update (`adjust`), as torch's `_amp_update_scale_`:

    * non-finite step: `growth_tracker = 0`; `hysteresis_tracker -= 1`; if it is now <= 0,
      `scale = max(scale * backoff_factor, min_scale)`.
    * finite step: `growth_tracker += 1`; when it reaches `growth_interval`,
      `scale = scale * growth_factor` (capped at `max_scale`; skipped if not finite),
      `growth_tracker = 0` and `hysteresis_tracker = hysteresis`.

    With `growth_rule="flax"` growth happens one finite step later (Flax checks the counter
    before incrementing it).

    Warning:
      Unlike torch, the scale never goes below `min_scale` (default: the smallest normal
      float32, 2**-126). torch's scale reaches 0.0 after ~150 consecutive overflows and its
      unscaling then writes NaN into the parameters. `min_scale=0.0` lets the scale collapse to
      0.0 as torch's does; XLA on CPU flushes float32 values below 2**-126 to zero, so it gets
      there in fewer steps than torch, which walks through the subnormals (tested).

    Examples:
      >>> scale = jaxamp.DynamicLossScale.create(init_scale=2.0**15, growth_interval=2)
      >>> float(scale.loss_scale)
      32768.0
      >>> grads = scale.unscale(scale.scale({"w": jnp.ones(2)}))
      >>> float(scale.adjust(jnp.array(False)).loss_scale)  # overflow: back off
      16384.0
      >>> float(scale.adjust(jnp.array(True)).adjust(jnp.array(True)).loss_scale)  # grow
      65536.0
      >>> jaxamp.DynamicLossScale.from_preset("jmp").growth_interval
      2000
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = F32_TINY
    max_scale: float | None = None
    hysteresis: int = 1
    growth_rule: GrowthRule = "torch"

    @classmethod
    def create(
        cls,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = F32_TINY,
        max_scale: float | None = None,
        hysteresis: int = 1,
        growth_rule: GrowthRule = "torch",
    ) -> DynamicLossScale:
        """Creates a dynamic loss scale; the defaults equal `torch.amp.GradScaler()`'s.

        Args:
          init_scale: initial scale, finite and > 0 (torch: 2**16).
          growth_factor: multiplier after `growth_interval` finite steps in a row, > 1.
          backoff_factor: multiplier after an overflow, in (0, 1).
          growth_interval: consecutive finite steps before growth, an int >= 1.
          min_scale: floor for backoff, >= 0 (default: smallest normal float32; 0.0 is torch's
            unsafe behaviour).
          max_scale: ceiling for growth, or None (growth is then skipped only if the result
            would be inf, as in torch).
          hysteresis: overflows tolerated before backing off (Megatron-LM), an int >= 1;
            1 backs off on every overflow, as torch does.
          growth_rule: "torch" (grow on the N-th finite step) or "flax" (on the N+1-th).

        Raises:
          ValueError / TypeError: a value outside the ranges above, naming it.
        """
        init_scale = _check_scale_value("init_scale", init_scale)
        growth_factor = _check_scale_value("growth_factor", growth_factor)
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1; got {growth_factor!r}.")
        backoff_factor = _check_scale_value("backoff_factor", backoff_factor)
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1); got {backoff_factor!r}.")
        growth_interval = _check_int("growth_interval", growth_interval)
        hysteresis = _check_int("hysteresis", hysteresis)
        min_scale = _check_scale_value("min_scale", min_scale, allow_zero=True)
        if max_scale is not None:
            max_scale = _check_scale_value("max_scale", max_scale)
            if max_scale < min_scale:
                raise ValueError(f"max_scale ({max_scale!r}) must be >= min_scale ({min_scale!r}).")
        if not isinstance(growth_rule, str) or growth_rule not in ("torch", "flax"):
            raise ValueError(
                f"growth_rule must be 'torch' or 'flax'; got {growth_rule!r}."
                f"{_did_you_mean(growth_rule, ('torch', 'flax'))}"
            )
        if init_scale > F32_MAX:
            raise ValueError(f"init_scale must fit in float32 (<= {F32_MAX}); got {init_scale!r}.")
        if min_scale > init_scale:
            raise ValueError(
                f"min_scale ({min_scale!r}) must be <= init_scale ({init_scale!r}): the scale "
                "would start below its own floor. Lower min_scale or raise init_scale."
            )
        if max_scale is not None and max_scale < init_scale:
            raise ValueError(
                f"max_scale ({max_scale!r}) must be >= init_scale ({init_scale!r}): the scale "
                "would start above its own ceiling. Raise max_scale or lower init_scale."
            )
        return cls(
            loss_scale=jnp.asarray(init_scale, jnp.float32),
            growth_tracker=jnp.zeros((), jnp.int32),
            hysteresis_tracker=jnp.asarray(hysteresis, jnp.int32),
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            growth_rule=growth_rule,
        )

    @classmethod
    def from_preset(cls, name: str = "torch", **overrides: Any) -> DynamicLossScale:
        """A loss scale that moves like another library's.

        * ``"torch"``: `torch.amp.GradScaler` (init 2**16, x2 / x0.5, interval 2000), with
          jaxamp's floor instead of torch's collapse to 0.
        * ``"jmp"``: `jmp.DynamicLossScale` as its docs use it (init 2**15, period 2000,
          factor 2, minimum 1.0 — kept under `jit`, where jmp itself loses it).
        * ``"flax"``: `flax.training.dynamic_scale.DynamicScale` (init 2**16, grows one finite
          step later than torch, capped at float32 max, floor float32 tiny).
        * ``"keras"``: Keras 3 `LossScaleOptimizer` (init 2**15, x2 / /2, 2000 steps).
        * ``"megatron"``: Megatron-LM `DynamicGradScaler` (init 2**32, min 1.0, interval 1000,
          hysteresis 2).

        Args:
          name: one of "torch", "jmp", "flax", "keras", "megatron".
          **overrides: any `create` argument, applied on top of the preset.
        """
        presets: dict[str, dict[str, Any]] = {
            "torch": {},
            "jmp": {"init_scale": 2.0**15, "min_scale": 1.0},
            "flax": {"growth_rule": "flax", "max_scale": F32_MAX},
            "keras": {"init_scale": 2.0**15},
            "megatron": {
                "init_scale": 2.0**32,
                "min_scale": 1.0,
                "growth_interval": 1000,
                "hysteresis": 2,
            },
        }
        valid = ", ".join(repr(p) for p in PRESET_NAMES)
        if not isinstance(name, str):
            raise TypeError(
                f"DynamicLossScale.from_preset(name=...) takes a preset name (a str: {valid}); "
                f"got {type(name).__name__} {name!r}."
            )
        if name not in presets:
            raise ValueError(
                f"DynamicLossScale.from_preset(name={name!r}): unknown preset; valid names are "
                f"{valid}.{_did_you_mean(name, PRESET_NAMES)}"
            )
        return cls.create(**{**presets[name], **overrides})

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """Returns the next loss scale, given whether this step's gradients were finite.

        Args:
          grads_finite: a scalar bool (traced or not).
        """
        grads_finite = _check_grads_finite(grads_finite)
        if grads_finite.shape != () or grads_finite.dtype != jnp.bool_:
            raise TypeError(
                f"adjust(grads_finite=...) takes a scalar bool; got shape {grads_finite.shape} "
                f"dtype {grads_finite.dtype}."
            )
        scale = jnp.asarray(self.loss_scale, jnp.float32)
        tracker = jnp.asarray(self.growth_tracker, jnp.int32)
        hysteresis_left = jnp.asarray(self.hysteresis_tracker, jnp.int32)

        if self.growth_rule == "torch":
            counted = optax.safe_increment(tracker)
            grow = counted >= self.growth_interval
        else:  # flax: compare the count of earlier finite steps, then count this one
            counted = optax.safe_increment(tracker)
            grow = tracker >= self.growth_interval
        grown = mul_like_torch(scale, self.growth_factor)
        if self.max_scale is not None:
            grown = jnp.minimum(grown, jnp.float32(self.max_scale))
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        finite_scale = jnp.where(grow, grown, scale)
        finite_tracker = jnp.where(grow, 0, counted)
        finite_hysteresis = jnp.where(grow, self.hysteresis, hysteresis_left)

        # Saturate instead of wrapping: the tracker only counts to 0 after enough overflows.
        overflow_hysteresis = jnp.maximum(hysteresis_left - 1, -INT32_MAX)
        backed_off = jnp.maximum(
            mul_like_torch(scale, self.backoff_factor), jnp.float32(self.min_scale)
        )
        overflow_scale = jnp.where(overflow_hysteresis <= 0, backed_off, scale)

        return dataclasses.replace(
            self,
            loss_scale=jnp.where(grads_finite, finite_scale, overflow_scale),
            growth_tracker=jnp.where(grads_finite, finite_tracker, 0).astype(jnp.int32),
            hysteresis_tracker=jnp.where(
                grads_finite, finite_hysteresis, overflow_hysteresis
            ).astype(jnp.int32),
        )

    # --- torch GradScaler interop -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This scale in `torch.amp.GradScaler.state_dict()`'s format (host values; syncs).

        Keys: ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``. Load it with `GradScaler.load_state_dict`. jaxamp-only settings
        (min/max scale, hysteresis, growth rule) are not part of torch's format; they are
        returned under ``jaxamp`` so `from_state_dict` can restore them exactly.
        """
        return {
            "scale": float(self.loss_scale),
            "growth_factor": float(self.growth_factor),
            "backoff_factor": float(self.backoff_factor),
            "growth_interval": int(self.growth_interval),
            "_growth_tracker": int(self.growth_tracker),
            "jaxamp": {
                "min_scale": self.min_scale,
                "max_scale": self.max_scale,
                "hysteresis": self.hysteresis,
                "hysteresis_tracker": int(self.hysteresis_tracker),
                "growth_rule": self.growth_rule,
            },
        }

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any], **overrides: Any) -> DynamicLossScale:
        """Reads `torch.amp.GradScaler.state_dict()` (or `state_dict()` above).

        Args:
          state_dict: a mapping with ``scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval`` and ``_growth_tracker``.
          **overrides: other `create` arguments (e.g. ``min_scale``).

        Raises:
          ValueError: a key is missing (an empty dict is what a disabled GradScaler saves).
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"from_state_dict(state_dict=...) takes a mapping; got {type(state_dict).__name__}."
            )
        required = (
            "scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "_growth_tracker",
        )
        missing = [k for k in required if k not in state_dict]
        if missing:
            raise ValueError(
                f"from_state_dict: missing keys {missing}; expected torch GradScaler's format with "
                f"keys {list(required)} (an empty state_dict comes from a disabled GradScaler)."
            )
        kwargs: dict[str, Any] = {
            "init_scale": state_dict["scale"],
            "growth_factor": state_dict["growth_factor"],
            "backoff_factor": state_dict["backoff_factor"],
            "growth_interval": state_dict["growth_interval"],
        }
        if "init_scale" not in overrides:
            try:
                _check_scale_value("from_state_dict: state_dict['scale']", kwargs["init_scale"])
            except ValueError as e:
                raise ValueError(
                    f"{e} torch's scale collapses to 0.0 after ~150 overflows in a row; pass "
                    "init_scale=... to restart from a healthy scale."
                ) from None
        for key in ("growth_factor", "backoff_factor"):
            _check_scale_value(f"from_state_dict: state_dict[{key!r}]", kwargs[key])
        _check_int("from_state_dict: state_dict['growth_interval']", kwargs["growth_interval"])
        extra = _jaxamp_settings(state_dict.get("jaxamp"))
        hysteresis_tracker = extra.pop("hysteresis_tracker", None)
        kwargs = {**kwargs, **extra, **overrides}
        scale = cls.create(**kwargs)
        tracker = _check_int(
            "from_state_dict: state_dict['_growth_tracker']", state_dict["_growth_tracker"], low=0
        )
        # torch grows when its tracker *equals* the interval, so a tracker at or above it would
        # never grow there; flax's rule counts one further.
        highest = (
            scale.growth_interval - 1 if scale.growth_rule == "torch" else scale.growth_interval
        )
        if tracker > highest:
            raise ValueError(
                f"from_state_dict: state_dict['_growth_tracker'] must be in [0, {highest}] "
                f"(growth_interval={scale.growth_interval}, growth_rule={scale.growth_rule!r}); "
                f"got {tracker}."
            )
        if hysteresis_tracker is None:
            hysteresis_tracker = scale.hysteresis
        hysteresis_tracker = _check_int(
            "from_state_dict: state_dict['jaxamp']['hysteresis_tracker']",
            hysteresis_tracker,
            low=-INT32_MAX,
        )
        if hysteresis_tracker > scale.hysteresis:
            raise ValueError(
                f"from_state_dict: state_dict['jaxamp']['hysteresis_tracker'] must be <= "
                f"hysteresis ({scale.hysteresis}); got {hysteresis_tracker}."
            )
        return dataclasses.replace(
            scale,
            growth_tracker=jnp.asarray(tracker, jnp.int32),
            hysteresis_tracker=jnp.asarray(hysteresis_tracker, jnp.int32),
        )


def default_loss_scale(policy: Any) -> LossScale:
    """The loss scale ``loss_scale="auto"`` picks for a `jaxamp.Policy`: torch's dynamic scale
    where float16 takes part in the policy, no scaling otherwise (bfloat16 has float32's range).

    Examples:
      >>> type(jaxamp.default_loss_scale(jaxamp.get_policy("fp16-mixed"))).__name__
      'DynamicLossScale'
      >>> type(jaxamp.default_loss_scale(jaxamp.get_policy("bf16-mixed"))).__name__
      'NoOpLossScale'
    """
    return DynamicLossScale.create() if policy.needs_loss_scaling else NoOpLossScale()


def as_loss_scale(loss_scale: Any, caller: str = "loss_scaled") -> Any:
    """`loss_scale` as a loss scale object: None gives torch's defaults
    (`DynamicLossScale.create()`), a string a preset, a loss scale (jaxamp's or jmp's) itself.

    Raises:
      TypeError: anything else, naming `caller`'s ``loss_scale`` parameter and what it takes.
    """
    if loss_scale is None:
        return DynamicLossScale.create()
    if isinstance(loss_scale, str):
        return DynamicLossScale.from_preset(loss_scale)
    if isinstance(loss_scale, LossScale):  # jaxamp's and jmp's loss scales alike
        return loss_scale
    raise TypeError(
        f"{caller}(loss_scale=...) takes None (torch's defaults), a preset name "
        f"({', '.join(repr(p) for p in PRESET_NAMES)}), a jaxamp loss scale "
        "(DynamicLossScale, StaticLossScale, NoOpLossScale) or a jmp loss scale; got "
        f"{type(loss_scale).__name__} {loss_scale!r}."
    )


_JAXAMP_SETTINGS = ("min_scale", "max_scale", "hysteresis", "hysteresis_tracker", "growth_rule")


def _jaxamp_settings(settings: Any) -> dict[str, Any]:
    """`state_dict()["jaxamp"]` (jaxamp's settings beyond torch's format) as a dict, checked."""
    if settings is None:
        return {}
    where = "from_state_dict: state_dict['jaxamp']"
    if not isinstance(settings, Mapping):
        raise TypeError(
            f"{where} must be a mapping with keys among {list(_JAXAMP_SETTINGS)} (as "
            f"DynamicLossScale.state_dict() writes it); got {type(settings).__name__} "
            f"{settings!r}."
        )
    unknown = [k for k in settings if k not in _JAXAMP_SETTINGS]
    if unknown:
        raise ValueError(
            f"{where} has unknown key {unknown[0]!r}; valid keys are {list(_JAXAMP_SETTINGS)}."
            f"{_did_you_mean(unknown[0], _JAXAMP_SETTINGS)}"
        )
    return dict(settings)


def _did_you_mean(value: Any, valid: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), valid, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _check_grads_finite(grads_finite: Any) -> jax.Array:
    if isinstance(grads_finite, (bool, np.bool_)):
        return jnp.asarray(grads_finite)
    if isinstance(grads_finite, (jax.Array, np.ndarray)):
        return jnp.asarray(grads_finite)
    raise TypeError(
        f"adjust(grads_finite=...) takes a scalar bool (a Python bool or a bool array); got "
        f"{type(grads_finite).__name__} {grads_finite!r}."
    )


def _check_int(name: str, value: Any, *, low: int = 1) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= {low}; got {type(value).__name__} {value!r}.")
    if not low <= int(value) <= INT32_MAX:
        raise ValueError(f"{name} must be an int in [{low}, {INT32_MAX}]; got {value!r}.")
    return int(value)
