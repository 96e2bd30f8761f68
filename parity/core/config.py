"""One configuration object per parity run, shared by the torch and the JAX trainer.

Both trainers read the same `RunConfig`, so optimizer, schedule, clipping, batch order and loss
scaling cannot drift apart. The precision is named as users write it (``"bf16-mixed"``) and
travels as the `jaxamp.Policy` it resolves to (`RunConfig.policy`): the trainers, the verdicts and
the report ask the policy (compute dtype, param dtype, loss scaling) instead of decoding the name.
Both the name and ``str(policy)`` (``"p=f32,c=bf16,o=f32"``) are written into ``results.json``;
`RunConfig.from_dict` reads them back and checks that they still agree.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

import numpy as np

import jaxamp
from parity.core.recipes import RECIPES, Recipe, get_recipe, precision_names
from parity.data import DataSpec

__all__ = [
    "DEVICES",
    "ConfigError",
    "FP16_STRESS",
    "FP8_PRECISIONS",
    "FRAMEWORKS",
    "MAX_SEED",
    "OPTIMIZERS",
    "PRECISIONS",
    "SCHEDULES",
    "RunConfig",
    "learning_rate_at",
    "precision_policy",
    "torch_device_type",
]

# The built-in precision names (from the recipe registry, `parity.core.recipes`; a recipe
# registered later is accepted everywhere too: ask `precision_names()`).
PRECISIONS = precision_names()
# fp8-*: torchao's float8 training recipes (parity.core.fp8); float32 outside the fp8 linear layers.
FP8_PRECISIONS = tuple(n for n, cls in RECIPES.items() if cls.compute_dtype_name == "float8")
# fp16 verdicts must see the scaler act: at torch's defaults (2**16, growth every 2000 steps) a
# short run often has no overflow and no growth, and "identical scale trajectory" compares
# nothing. At 2**20 the built-in models' scaled float16 gradients overflow in the first steps
# (backoff, skipped steps) and growth every 5 finite steps brings the scale back up.
FP16_STRESS: dict[str, float | int] = {"init_scale": 2.0**20, "growth_interval": 5}
FRAMEWORKS = ("torch", "jax")
DEVICES = ("cpu", "gpu")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine")
# Seeds go to torch.manual_seed, numpy's SeedSequence and jax.random.PRNGKey: the last takes a
# C long, so the largest seed every side accepts is int64's maximum (data seeds too).
MAX_SEED = 2**63 - 1
# Hyperparameters reach the JAX step as float32: a larger value would become inf there.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class ConfigError(ValueError):
    """A `RunConfig` field out of its range or of the wrong kind.

    Attributes:
      field: the offending field (``"init_scale"``), so a caller can name its own spelling of it
        (the command line's ``--init-scale``, a results file's ``config.init_scale``).
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            name, f"RunConfig: `{name}` must be one of {allowed}; got {value!r}.{hint}"
        )
    return value


def precision_policy(precision: str) -> jaxamp.Policy:
    """The `jaxamp.Policy` a precision name stands for.

    Args:
      precision: a registered precision name, or any name ``jaxamp.get_policy`` reads that a
        recipe runs (``"bf16"``, ``"16-mixed"``).

    Returns:
      The policy, e.g. ``p=f32,c=bf16,o=f32`` for ``"bf16-mixed"``.

    Examples:
      >>> str(precision_policy("fp16-mixed"))
      'p=f32,c=f16,o=f32'
    """
    return get_recipe(precision).policy


def torch_device_type(device: str) -> str:
    """torch's device type for a harness device name (``"gpu"`` is CUDA); needs no torch.

    Examples:
      >>> torch_device_type("gpu")
      'cuda'
    """
    _choice("device", device, DEVICES)
    return "cuda" if device == "gpu" else "cpu"


def _positive_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(
            name, f"RunConfig: `{name}` must be an integer {allowed}; got {_show(value)}."
        )
    return value


def _number(name: str, value: Any, *, positive: bool = False, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))
        or abs(value) > _FLOAT32_MAX
    ):
        raise ConfigError(
            name,
            f"RunConfig: `{name}` must be a number that float32 holds (|x| <= {_FLOAT32_MAX:.4g}); "
            f"got {_show(value)}.",
        )
    if positive and value <= 0:
        raise ConfigError(name, f"RunConfig: `{name}` must be > 0; got {_show(value)}.")
    if not positive and value < 0:
        raise ConfigError(name, f"RunConfig: `{name}` must be >= 0; got {_show(value)}.")
    return float(value)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs; identical for the torch and the JAX side.

    Attributes:
      model: a name from `parity.models.MODEL_NAMES` (or a user model's name via `parity.api`).
      precision: a registered precision (`PRECISIONS`: ``"fp32"``, ``"bf16-mixed"``,
        ``"fp16-mixed"``, ``"bf16-true"``, ``"fp8-*"``) or a name ``jaxamp.get_policy`` reads
        for one (``"bf16"`` is ``"bf16-mixed"``); stored as the registered name.
      steps: training steps.
      batch_size: examples per step.
      seed: torch initialisation seed (and data seed unless `data_seed` is given).
      data_seed: the batch stream's seed (default: `seed`). Seed statistics vary it with the
        initial weights fixed.
      device: ``"cpu"`` or ``"gpu"`` (CUDA for torch, the GPU backend for JAX).
      optimizer: ``"adamw"`` (torch.optim.AdamW / optax.adamw) or ``"sgd"`` (momentum SGD).
      lr: peak learning rate.
      weight_decay: decoupled (AdamW) or L2 (SGD, as torch's ``weight_decay``) decay.
      momentum: SGD momentum.
      betas, eps: AdamW moments' decay rates and epsilon (added outside the square root on both
        sides).
      schedule: ``"constant"`` or ``"cosine"`` (cosine decay to 0 over `steps`), after
        `lr_warmup_steps` of linear warm-up; indexed by the iteration, as torch's LambdaLR is
        (skipped fp16 steps advance it too).
      lr_warmup_steps: linear learning-rate warm-up steps.
      clip_norm: global gradient-norm clipping after unscaling (torch's ``clip_grad_norm_``), or
        None for no clipping.
      init_scale, growth_interval: fp16 loss scaling (torch GradScaler / jaxamp torch preset).
      timing_warmup: first steps excluded from the step-time median (compilation, caches).
      torch_compile: the torch side runs its model under ``torch.compile``.
      eval: evaluate on the stream's held-out batches after training.
      model_overrides: architecture hyperparameters passed to `get_model_pair`.
      data: the batches (`parity.data.DataSpec`): ``"synthetic"``, ``"digits"``, ``"text"``,
        ``"text:PATH"``, ``"fashion-mnist:DIR"`` or ``"cifar10:DIR"``.
    """

    model: str = "mlp"
    precision: str = "fp32"
    steps: int = 30
    batch_size: int = 32
    seed: int = 0
    data_seed: int | None = None
    device: str = "cpu"
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: str = "cosine"
    lr_warmup_steps: int = 0
    clip_norm: float | None = 1.0
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    timing_warmup: int = 3
    torch_compile: bool = False
    eval: bool = True
    model_overrides: dict = dataclasses.field(default_factory=dict)
    data: str = "synthetic"

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(
                "model", f"RunConfig: `model` must be a non-empty string; got {self.model!r}."
            )
        try:
            precision = get_recipe(self.precision).name
        except (ValueError, TypeError) as e:
            raise ConfigError("precision", f"RunConfig: {e}") from None
        object.__setattr__(self, "precision", precision)
        _choice("device", self.device, DEVICES)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.optimizer not in get_recipe(precision).optimizers:
            raise ConfigError(
                "optimizer",
                f"RunConfig: precision {precision!r} runs its own optimizer, "
                f"{' or '.join(get_recipe(precision).optimizers)}; got `optimizer` "
                f"{self.optimizer!r} (use optimizer='adamw' or another precision).",
            )
        _choice("schedule", self.schedule, SCHEDULES)
        _positive_int("steps", self.steps)
        _positive_int("batch_size", self.batch_size)
        _positive_int("seed", self.seed, 0, MAX_SEED)
        if self.data_seed is not None:
            _positive_int("data_seed", self.data_seed, 0, MAX_SEED)
        _positive_int("lr_warmup_steps", self.lr_warmup_steps, 0)
        _positive_int("growth_interval", self.growth_interval)
        _positive_int("timing_warmup", self.timing_warmup, 0)
        _number("lr", self.lr, positive=True)
        _number("weight_decay", self.weight_decay)
        _number("momentum", self.momentum)
        _number("eps", self.eps, positive=True)
        _number("clip_norm", self.clip_norm, positive=True, allow_none=True)
        _number("init_scale", self.init_scale, positive=True)
        betas = tuple(self.betas) if isinstance(self.betas, tuple | list) else ()
        if len(betas) != 2 or not all(
            isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
        ):
            raise ConfigError(
                "betas", f"RunConfig: `betas` must be two numbers in [0, 1); got {self.betas!r}."
            )
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        for name in ("torch_compile", "eval"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    name, f"RunConfig: `{name}` must be a bool; got {getattr(self, name)!r}."
                )
        try:
            object.__setattr__(self, "data", str(DataSpec.parse(self.data)))
        except ValueError as e:
            raise ConfigError("data", f"RunConfig: {e}") from None
        if not isinstance(self.model_overrides, dict):
            raise ConfigError(
                "model_overrides",
                f"RunConfig: `model_overrides` must be a dict; got {type(self.model_overrides).__name__}.",
            )

    @property
    def recipe(self) -> Recipe:
        """The precision's recipe (`parity.core.recipes`): every consumer asks it."""
        return get_recipe(self.precision)

    @property
    def policy(self) -> jaxamp.Policy:
        """The `jaxamp.Policy` of `precision` (``str()`` gives e.g. ``"p=f32,c=bf16,o=f32"``)."""
        return self.recipe.policy

    @property
    def stream_seed(self) -> int:
        """The batch stream's seed: `data_seed`, else `seed`."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def compute_dtype(self) -> str:
        """The policy's compute dtype name: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
        return self.policy.compute_dtype.name

    @property
    def param_dtype(self) -> str:
        """The policy's param dtype name (``"bfloat16"`` for ``bf16-true``)."""
        return self.policy.param_dtype.name

    @property
    def full_precision(self) -> bool:
        """Everything in float32 (the fp32 baseline)."""
        policy = self.policy
        return policy.compute_dtype.name == "float32" and policy.param_dtype.name == "float32"

    @property
    def mixed(self) -> bool:
        """Autocast-style mixed precision (float32 params, low-precision compute)."""
        policy = self.policy
        return policy.param_dtype.name == "float32" and policy.compute_dtype.name != "float32"

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling is on (the recipe's GradScaler / DynamicLossScale)."""
        return self.recipe.loss_scaling

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, including the derived ``policy`` string."""
        out = dataclasses.asdict(self)
        out["betas"] = list(self.betas)
        out["model_overrides"] = {
            k: list(v) if isinstance(v, tuple) else v for k, v in self.model_overrides.items()
        }
        out["policy"] = str(self.policy)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Reads `to_dict`'s output back; checks that the logged policy still matches."""
        data = dict(data)
        policy = data.pop("policy", None)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"RunConfig.from_dict: unknown keys {unknown}; allowed: {sorted(names)}."
            )
        if isinstance(data.get("betas"), list):
            data["betas"] = tuple(data["betas"])
        if isinstance(data.get("model_overrides"), dict):
            data["model_overrides"] = {
                k: tuple(v) if isinstance(v, list) else v
                for k, v in data["model_overrides"].items()
            }
        config = cls(**data)
        try:
            logged = None if policy is None else jaxamp.get_policy(policy)
        except (ValueError, TypeError) as e:
            raise ConfigError("policy", f"RunConfig.from_dict: logged policy: {e}") from None
        if logged is not None and logged != config.policy:
            raise ConfigError(
                "policy",
                f"RunConfig.from_dict: logged policy {policy!r} does not match precision "
                f"{config.precision!r} (which is {str(config.policy)!r}).",
            )
        return config

    def lr_at(self, step: int) -> float:
        """The learning rate of iteration `step` (0-based); see `learning_rate_at`."""
        return learning_rate_at(self, step)


def learning_rate_at(config: RunConfig, step: int) -> float:
    """Warm-up then constant or cosine learning rate at iteration `step` (a Python float).

    Computed on the host for both sides (the JAX step takes it as an argument), so torch's
    LambdaLR and the JAX trainer use bit-identical rates.
    """
    peak = config.lr
    warm = config.lr_warmup_steps
    if warm and step < warm:
        return peak * (step + 1) / warm
    if config.schedule == "constant":
        return peak
    progress = min(max((step - warm) / max(config.steps - warm, 1), 0.0), 1.0)
    return 0.5 * peak * (1.0 + math.cos(math.pi * progress))
