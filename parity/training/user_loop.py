"""The user's own training loop: their torch optimizer, scheduler, clipping and loss, and the
optax transformation and loss of their port.

Without one the harness trains both sides with its own optimizer (`parity.training.steps`),
schedule (`parity.core.config.RunConfig.lr_at`), clipping and loss (`parity.core.losses`). With
one, the trainers use the user's pieces instead, and `parity.replay` replays them on identical
gradients and logits before training. This module imports no torch at import time.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import optax

import jaxamp

__all__ = [
    "LOOP_CONFIG_FIELDS",
    "SIDES",
    "TrainingLoop",
    "contains_loss_scaled",
    "loop_optimizer",
    "run_config_fields",
]

SIDES = ("both", "torch", "jax")

# RunConfig fields that describe the harness's own optimizer: refused next to a user optimizer.
LOOP_CONFIG_FIELDS = (
    "optimizer",
    "lr",
    "weight_decay",
    "momentum",
    "betas",
    "eps",
    "schedule",
    "lr_warmup_steps",
    "clip_norm",
)


def _callable_or_none(name: str, value: Any, what: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"`{name}` must be {what} or None; got {type(value).__name__}.")


@dataclasses.dataclass(frozen=True)
class TrainingLoop:
    """The pieces of a training loop that differ between a torch script and its JAX port.

    Attributes:
      torch_optimizer: ``torch module -> torch.optim.Optimizer`` (called with the trained copy,
        so param groups can be built from ``named_parameters()``).
      torch_scheduler: ``optimizer -> torch.optim.lr_scheduler.LRScheduler``, stepped after every
        ``optimizer.step()`` as a torch loop does; None: the optimizer's lr stays.
      torch_clip: a max global norm (``clip_grad_norm_`` after ``GradScaler.unscale_``), a
        callable ``list of parameters -> Any`` run at that point, or None (no clipping).
      jax_optimizer: an ``optax.GradientTransformation`` with its own schedule and clipping
        (the harness wraps it in the run's ``jaxamp.loss_scaled``, unless it already holds one).
      torch_loss: ``(logits, targets) -> scalar tensor``; None: the harness's loss of the task.
      jax_loss: ``(logits, targets) -> scalar array``; None: the harness's loss of the task.
      replay_steps: real batches the step-0 replay feeds both optimizers (`parity.replay`).
      replay_jit: the replay runs the JAX optimizer step under ``jax.jit`` (as training does).
      sides: ``"both"`` (a comparison: the optimizers and the losses come in pairs), or
        ``"torch"`` / ``"jax"`` for one side only (a golden export records torch's side; a
        golden check runs JAX's against it).

    Example:
      >>> import optax, torch
      >>> loop = TrainingLoop(
      ...     torch_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
      ...     jax_optimizer=optax.sgd(0.1),
      ... )
      >>> loop.has_optimizer, loop.has_loss
      (True, False)
    """

    torch_optimizer: Callable[[Any], Any] | None = None
    torch_scheduler: Callable[[Any], Any] | None = None
    torch_clip: float | Callable[[list], Any] | None = None
    jax_optimizer: optax.GradientTransformation | None = None
    torch_loss: Callable[[Any, Any], Any] | None = None
    jax_loss: Callable[[Any, Any], Any] | None = None
    replay_steps: int = 4
    replay_jit: bool = True
    sides: str = "both"

    def __post_init__(self):
        if self.sides not in SIDES:
            raise ValueError(f"`sides` must be one of {SIDES}; got {self.sides!r}.")
        steps = self.replay_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`replay_steps` must be an integer >= 1; got {steps!r}.")
        if not isinstance(self.replay_jit, bool):
            raise TypeError(f"`replay_jit` must be True or False; got {self.replay_jit!r}.")
        _callable_or_none(
            "torch_optimizer", self.torch_optimizer, "a callable torch module -> optimizer"
        )
        _callable_or_none(
            "torch_scheduler", self.torch_scheduler, "a callable optimizer -> LRScheduler"
        )
        _callable_or_none("torch_loss", self.torch_loss, "a callable (logits, targets) -> loss")
        _callable_or_none("jax_loss", self.jax_loss, "a callable (logits, targets) -> loss")
        clip = self.torch_clip
        if clip is not None and not callable(clip):
            if isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0:
                raise ValueError(
                    f"`torch_clip` must be a positive max norm, a callable parameters -> Any, or "
                    f"None; got {clip!r}."
                )
        tx = self.jax_optimizer
        if tx is not None and not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                "`jax_optimizer` must be an optax.GradientTransformation (e.g. optax.adamw(...)); "
                f"got {type(tx).__name__}."
            )
        if self.sides != "both":
            other = "jax" if self.sides == "torch" else "torch"
            given = [
                f"{other}_{n}"
                for n in (
                    ("optimizer", "loss")
                    if other == "jax"
                    else ("optimizer", "scheduler", "clip", "loss")
                )
                if getattr(self, f"{other}_{n}") is not None
            ]
            if given:
                raise ValueError(
                    f"a loop of the {self.sides} side only takes no {', '.join(given)}: "
                    f"{'a golden export records torch' if self.sides == 'torch' else 'a golden check runs JAX'}'s side"
                )
            for name in ("torch_scheduler", "torch_clip"):
                if getattr(self, name) is not None and self.torch_optimizer is None:
                    raise ValueError(
                        f"`{name}` needs `torch_optimizer` (it belongs to the user's loop)."
                    )
            return
        if (self.torch_optimizer is None) != (tx is None):
            given, missing = (
                ("torch_optimizer", "jax_optimizer")
                if tx is None
                else ("jax_optimizer", "torch_optimizer")
            )
            raise ValueError(
                f"`{given}` was given without `{missing}`: the replay compares the two "
                "optimizers, so pass both (or neither: the harness's own optimizer)."
            )
        for name in ("torch_scheduler", "torch_clip"):
            if getattr(self, name) is not None and self.torch_optimizer is None:
                raise ValueError(
                    f"`{name}` needs `torch_optimizer` (it belongs to the user's loop)."
                )
        if (self.torch_loss is None) != (self.jax_loss is None):
            given, missing = (
                ("torch_loss", "jax_loss") if self.jax_loss is None else ("jax_loss", "torch_loss")
            )
            raise ValueError(
                f"`{given}` was given without `{missing}`: pass both losses (or neither)."
            )

    @property
    def has_optimizer(self) -> bool:
        """Both optimizers are given (the replay compares them)."""
        return self.torch_optimizer is not None and self.jax_optimizer is not None

    @property
    def has_loss(self) -> bool:
        """Both losses are given (the replay compares them)."""
        return self.torch_loss is not None and self.jax_loss is not None

    def build_torch(self, model: Any) -> tuple[Any, Any]:
        """``(optimizer, scheduler or None)`` for `model`, checked."""
        import torch  # torch: optional for JAX users

        optimizer = self.torch_optimizer(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "`torch_optimizer` must return a torch.optim.Optimizer for the module it is "
                f"given; it returned {type(optimizer).__name__}."
            )
        trained = {id(p) for p in model.parameters() if p.requires_grad}
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if held - trained:
            raise ValueError(
                "`torch_optimizer` built an optimizer over tensors that are not the module's "
                "parameters: build it from the module it is called with (a copy of yours)."
            )
        scheduler = None
        if self.torch_scheduler is not None:
            scheduler = self.torch_scheduler(optimizer)
            if not hasattr(scheduler, "step") or not hasattr(scheduler, "get_last_lr"):
                raise TypeError(
                    "`torch_scheduler` must return a torch LRScheduler for the optimizer it is "
                    f"given; it returned {type(scheduler).__name__}."
                )
        return optimizer, scheduler

    def clip_torch(self, params: list) -> None:
        """The user's clipping on unscaled gradients (nothing without one)."""
        import torch  # torch: optional for JAX users

        if self.torch_clip is None:
            return
        if callable(self.torch_clip):
            self.torch_clip(params)
        else:
            torch.nn.utils.clip_grad_norm_(params, float(self.torch_clip))

    def step_scheduler(self, scheduler: Any) -> None:
        """``scheduler.step()``, without torch's warning that a skipped fp16 step came first."""
        if scheduler is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                scheduler.step()

    def describe(self) -> dict[str, str]:
        """What the run record says about the loop (reprs, for the report)."""
        out = {}
        for name in ("torch_optimizer", "torch_scheduler", "torch_clip", "torch_loss", "jax_loss"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value if isinstance(value, int | float) else _name(value)
        if self.jax_optimizer is not None:
            out["jax_optimizer"] = _name(self.jax_optimizer.update)
        return out


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def contains_loss_scaled(tx: optax.GradientTransformation, params: Any) -> bool:
    """Whether `tx`'s state holds a ``jaxamp.loss_scaled`` state (the user scaled it already)."""
    return bool(jaxamp.loss_scaled_states(jax.eval_shape(tx.init, params)))


def loop_optimizer(loop: TrainingLoop, config: Any, params: Any, pair: Any = None, axis_name=None):
    """The JAX side's whole optimizer: the user's transformation inside the run's loss scaling
    (``config.recipe.jax_optimizer``), or as given when it holds its own ``jaxamp.loss_scaled``."""
    tx = loop.jax_optimizer
    if contains_loss_scaled(tx, params):
        return tx
    return config.recipe.jax_optimizer(tx, config, axis_name, pair=pair)


def run_config_fields(function: str, loop: TrainingLoop, config: dict[str, Any]) -> dict[str, Any]:
    """The `RunConfig` fields of a run with the user's optimizer: the harness's own optimizer
    fields (`LOOP_CONFIG_FIELDS`) refused beside it, its clipping off and its schedule constant
    (they describe nothing the run does). Unchanged without a user optimizer.

    Raises:
      ValueError: naming the fields given and what replaces them.
    """
    if loop.torch_optimizer is None and loop.jax_optimizer is None:
        return config
    clash = sorted(set(config) & set(LOOP_CONFIG_FIELDS))
    if clash:
        raise ValueError(
            f"{function}: {', '.join(clash)} describe the harness's own optimizer; with your "
            "optimizer, its schedule and clipping are used (torch_scheduler, torch_clip, and the "
            "optax chain): leave them out."
        )
    return {**config, "clip_norm": None, "schedule": "constant"}
