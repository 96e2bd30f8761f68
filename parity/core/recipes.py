"""Precision recipes: the one place where a run's precision is decoded.

A recipe is an object with two faces, built once per run from its name:

- **torch face**: module conversion (`Recipe.torch_convert`: torchao's ``Float8Linear`` swap,
  ``model.to(torch.bfloat16)``), the forward context (`Recipe.torch_autocast`), the loss scaler
  (`Recipe.torch_grad_scaler`), the input dtype, and FSDP2's ``MixedPrecisionPolicy``;
- **JAX face**: forward wrapping (`Recipe.jax_forward`: ``jaxamp.autocast``,
  ``jaxamp.fp8.convert``), the state cast (`Recipe.jax_cast`), the gradient function
  (`Recipe.jax_value_and_grad`), the optimizer wrapping (`Recipe.jax_optimizer`: always
  ``jaxamp.loss_scaled``, so every run takes the README's step) and the method it reports.

A precision can also be the optimizer's: ``adamw-8bit``, ``adamw-4bit`` and ``adamw-fp8`` keep
AdamW's moments as torchao's block-wise codes (``torchao.optim.AdamW8bit`` / ``AdamW4bit`` /
``AdamWFp8`` against ``jaxamp.optim_precision.low_precision_state``) with float32 compute; ``bf16-true-sr`` is
``bf16-true`` whose weights are rounded stochastically (torchao's
``_AdamW(bf16_stochastic_round=True)`` against ``jaxamp.optim_precision.preset``). Their torch
face replaces the run's optimizer (`Recipe.torch_optimizer`); they run AdamW only.

Trainers, step 0, the diagnosis, the distributed workers, speed and compare ask the recipe; none
reads the precision string. An arm (``"single"``, ``"ddp"``, ``"fsdp"``) that cannot run a recipe
raises `UnsupportedHere` with the reason (`Recipe.unsupported`); nothing runs as another precision.

Adding a precision is one subclass and one `register` line. Names resolve as jaxamp's
`get_policy` reads them (``"bf16"``, ``"16-mixed"``, ``"32-true"``, ``"mixed_bfloat16"``,
``"p=f32,c=bf16,o=f32"``...): a name that is not a recipe's own goes through ``get_policy`` and
picks the recipe that runs that policy.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import optax

import jaxamp
from parity.core import fp8 as parity_fp8
from parity.core import mx as parity_mx
from parity.core.hardware import UnsupportedHere

__all__ = [
    "ARMS",
    "RECIPES",
    "Recipe",
    "get_recipe",
    "precision_names",
    "register",
    "resolve_precision",
]

# Where a recipe can be asked to run: one device, torch DDP / FSDP2 ranks and their JAX twins;
# on a JAX mesh also how the step runs (one program over the global batch, or per device).
ARMS = ("single", "ddp", "fsdp")
JAX_MODES = ("jit", "shard_map", "multiprocess")


def _torch_device_type(device: str) -> str:
    return "cuda" if device == "gpu" else "cpu"


class Recipe:
    """Base class of the hooks: float32 everywhere, no loss scaling.

    Class attributes:
      name: the precision name (``RunConfig.precision``, the CLI's ``--precision``).
      policy_spec: the `jaxamp.Policy` the recipe stands for (written into every record).
      claims_policy: whether a policy name (``"32-true"``, ``"p=..."``) resolves to this recipe.
      loss_scaling: dynamic loss scaling (GradScaler / ``jaxamp.DynamicLossScale``) is on.
      compute_dtype_name: the dtype the matmuls of the recipe run in (report and verdicts).
      matrix_plan: the matrix's steps/batch size (and loss-scale settings) for this precision.
      baseline: the float32 reference itself (step 0 checks it first, then the run's recipe).
      optimizers: the `RunConfig.optimizer` values the recipe runs (its own optimizer, where
        `torch_optimizer` replaces the run's, runs one kind only).
      first_distinct_step: the first step whose loss differs from the float32 run's beyond float32
        rounding when the recipe runs as itself: 0 where the forward pass changes; 2 where only
        the optimizer's stored state does (the first update is computed from exact moments).
      calibration: the matrix's calibration runs for the recipe (``{"noise": ...}``), merged over
        the model's prescription (`parity.models.calibration_prescribed`); empty: none of its own.
      verdict_checks: the trajectory checks a trained pair of this recipe is judged by, in
        order (kinds of `parity.verdicts.checks.CHECKS`: ``"loss"`` per step at float32's
        bands, ``"fp8 loss"``, ``"scale"`` and ``"skips"`` (loss scaling: each side's scale from its
        own skips, skip decisions apart only by rounding flips), ``"final loss"``).
      step0_checks: the recipe's own step-0 checks, beyond the outputs and gradients every
        recipe gets: ``"quantized layers"`` (every quantized layer's scales and element codes
        against torchao's, `quantized_layers_step0`, in place of the run-precision stage's
        outputs and gradients), ``"optimizer state"`` (one optimizer step's state codes and
        scales against torchao's, once the model's rows pass).
    """

    name: ClassVar[str] = ""
    baseline: ClassVar[bool] = False
    policy_spec: ClassVar[str] = "fp32"
    claims_policy: ClassVar[bool] = True
    loss_scaling: ClassVar[bool] = False
    compute_dtype_name: ClassVar[str] = "float32"
    matrix_plan: ClassVar[dict[str, Any]] = {"steps": 30, "batch_size": 16}
    optimizers: ClassVar[tuple[str, ...]] = ("adamw", "sgd")
    first_distinct_step: ClassVar[int] = 0
    calibration: ClassVar[dict[str, Any]] = {}
    verdict_checks: ClassVar[tuple[str, ...]] = ("loss",)
    step0_checks: ClassVar[tuple[str, ...]] = ()

    @property
    def policy(self) -> jaxamp.Policy:
        """The recipe's `jaxamp.Policy` (``str()`` gives e.g. ``"p=f32,c=bf16,o=f32"``)."""
        return jaxamp.get_policy(self.policy_spec)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    # -- where it runs ---------------------------------------------------------------------------

    def unsupported(self, arm: str, mode: str | None = None) -> str | None:
        """Why this recipe cannot run on `arm` (one of `ARMS`; on a JAX mesh in `mode`, one of
        `JAX_MODES`), or None."""
        if arm not in ARMS:
            raise ValueError(f"Recipe.unsupported: `arm` must be one of {ARMS}; got {arm!r}.")
        if mode is not None and mode not in JAX_MODES:
            raise ValueError(
                f"Recipe.unsupported: `mode` must be one of {JAX_MODES}; got {mode!r}."
            )
        return None

    def check_arm(self, arm: str, mode: str | None = None) -> None:
        """Raises `UnsupportedHere` (with the reason) where `unsupported` has one."""
        reason = self.unsupported(arm, mode)
        if reason is not None:
            where = arm if mode is None else f"{arm} (JAX {mode})"
            raise UnsupportedHere(f"{self.name} on {where}: {reason}")

    # -- torch face ------------------------------------------------------------------------------

    def torch_convert(self, model: Any, device: Any) -> tuple[Any, dict[str, Any]]:
        """``(model, record extras)`` for the run (in place where torch converts in place)."""
        del device
        return model, {}

    def torch_input_dtype(self) -> Any:
        """The torch dtype floating inputs are cast to, or None (inputs stay float32)."""
        return None

    def torch_autocast(self, device_type: str, arm: str = "single") -> Any:
        """The context the forward pass and loss run in."""
        del device_type, arm
        return contextlib.nullcontext()

    def torch_grad_scaler(self, config: Any, device_type: str, *, sharded: bool = False) -> Any:
        """``torch.amp.GradScaler`` (``ShardedGradScaler`` for FSDP2) or None."""
        del config, device_type, sharded
        return None

    def torch_optimizer(self, config: Any, params: list) -> Any:
        """The recipe's own torch optimizer over `params`, or None: the run's
        (`parity.training.steps.build_torch_optimizer`: torch.optim.AdamW or SGD)."""
        del config, params
        return None

    def torch_fsdp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for the recipe."""
        from torch.distributed.fsdp import MixedPrecisionPolicy  # torch: optional for JAX users

        return MixedPrecisionPolicy()

    def torch_method(self, arm: str = "single") -> str:
        """How the torch side realises the precision (logged)."""
        del arm
        return "float32"

    # -- JAX face --------------------------------------------------------------------------------

    def jax_forward(self, forward: Callable, device: str, arm: str = "single") -> Callable:
        """`forward` at the recipe's precision (the loss stays outside, in float32)."""
        del device, arm
        return forward

    def jax_cast(self, tree: Any) -> Any:
        """Params, batch statistics or inputs as the recipe holds them (floating leaves only)."""
        return tree

    def with_autocast_overrides(self, overrides: dict[str, str]) -> Recipe:
        """This recipe with ``jaxamp.autocast(..., overrides=overrides)`` as its JAX forward pass
        (`parity.bisect`'s primitive stage); torch.autocast has no per-op overrides, so the torch
        face is unchanged. Raises ValueError where the JAX forward pass is not autocast."""
        del overrides
        raise ValueError(
            f"precision {self.name!r}: the JAX forward pass is not jaxamp.autocast, so it takes "
            "no autocast overrides (bf16-mixed and fp16-mixed do)."
        )

    def jax_value_and_grad(self, loss_fn: Callable, arm: str = "single") -> Callable:
        """``jaxamp.value_and_grad`` of `loss_fn` (``has_aux=True``) for the recipe on `arm`."""
        del arm
        return jaxamp.value_and_grad(loss_fn, has_aux=True)

    def jax_loss_scale(self, config: Any) -> Any:
        """The loss scale `jax_optimizer` wraps the optimizer with."""
        del config
        return jaxamp.NoOpLossScale()

    def jax_optimizer(
        self,
        inner: optax.GradientTransformation,
        config: Any,
        axis_name: str | None = None,
        pair: Any = None,
    ) -> optax.GradientTransformation:
        """``jaxamp.loss_scaled(inner, scale)``: the README's optimizer for every recipe (with
        `NoOpLossScale` a finite step is bit-identical to `inner`'s). `pair` is the run's
        `parity.models.ModelPair`, for recipes whose optimizer depends on the model."""
        del pair
        return jaxamp.loss_scaled(inner, self.jax_loss_scale(config), axis_name=axis_name)

    def jax_method(self, device: str, arm: str = "single") -> str:
        """How the JAX side realises the precision (logged)."""
        del device, arm
        return "float32"

    # -- step 0 ----------------------------------------------------------------------------------

    def step0_loss_scale(self, config: Any) -> float:
        """The loss scale of the step-0 gradients (1 without loss scaling)."""
        del config
        return 1.0

    def quantized_layers_step0(self, pair: Any, inputs: Any, targets: Any) -> list[dict]:
        """Per-layer scale and code rows of a recipe whose `step0_checks` name ``"quantized
        layers"`` (`parity.core.fp8.step0_fp8`'s row format); raises ValueError when the two
        sides quantize different layers."""
        del pair, inputs, targets
        raise NotImplementedError(f"{self.name}: no quantized layers to compare at step 0")

    # -- records ---------------------------------------------------------------------------------

    def logged_scale(self, value: float) -> float | None:
        """The loss scale a step record carries: None without loss scaling."""
        return float(value) if self.loss_scaling else None


class Fp32(Recipe):
    """Everything in float32 (the baseline)."""

    name = "fp32"
    baseline = True


class _Mixed(Recipe):
    """Float32 params, low-precision compute: ``torch.autocast`` and ``jaxamp.autocast``.

    Under FSDP2 torch's ``MixedPrecisionPolicy`` casts every parameter to the compute dtype; its
    JAX twin is the jaxamp policy (params and inputs cast), not autocast's per-op rules.
    """

    torch_dtype_name: ClassVar[str] = "bfloat16"
    verdict_checks = ("final loss",)
    # jaxamp.autocast's per-op overrides on the JAX side (`with_autocast_overrides`); None: its lists
    autocast_overrides: dict[str, str] | None = None

    def with_autocast_overrides(self, overrides: dict[str, str]) -> Recipe:
        recipe = type(self)()
        recipe.autocast_overrides = dict(overrides)
        return recipe

    def _torch_dtype(self):
        import torch  # torch: optional for JAX users

        return getattr(torch, self.compute_dtype_name)

    def torch_autocast(self, device_type: str, arm: str = "single") -> Any:
        if arm == "fsdp":  # MixedPrecisionPolicy casts instead
            return contextlib.nullcontext()
        import torch  # torch: optional for JAX users

        return torch.autocast(device_type, dtype=self._torch_dtype())

    def torch_fsdp_policy(self) -> Any:
        import torch  # torch: optional for JAX users
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=self._torch_dtype(),
            reduce_dtype=getattr(torch, self.policy.reduce_dtype.name),
            output_dtype=torch.float32,
        )

    def torch_method(self, arm: str = "single") -> str:
        if arm == "fsdp":
            return (
                f"MixedPrecisionPolicy(param_dtype={self.compute_dtype_name}, "
                f"reduce_dtype={self.policy.reduce_dtype.name})"
            )
        return f"torch.autocast({self.compute_dtype_name})"

    def jax_forward(self, forward: Callable, device: str, arm: str = "single") -> Callable:
        if arm == "fsdp":  # the policy casts params and inputs in jax_value_and_grad
            return forward
        return jaxamp.autocast(
            forward,
            dtype=self.policy.compute_dtype,
            device=_torch_device_type(device),
            overrides=self.autocast_overrides,
        )

    def jax_value_and_grad(self, loss_fn: Callable, arm: str = "single") -> Callable:
        if arm == "fsdp":
            return jaxamp.value_and_grad(loss_fn, policy=self.policy, has_aux=True)
        if arm == "ddp":  # the all-reduce dtype is the policy's (float32 for the presets)
            return jaxamp.value_and_grad(
                loss_fn, reduce_dtype=self.policy.reduce_dtype, has_aux=True
            )
        # The forward pass is autocast (jax_forward); the loss is float32 (torch's
        # cross_entropy is on autocast's float32 list on every device).
        return jaxamp.value_and_grad(loss_fn, has_aux=True)

    def jax_method(self, device: str, arm: str = "single") -> str:
        if arm == "fsdp":
            return f"jaxamp policy {self.policy}"
        overrides = f", overrides={self.autocast_overrides!r}" if self.autocast_overrides else ""
        method = f"jaxamp.autocast(device={_torch_device_type(device)!r}{overrides})"
        if arm == "ddp":
            method += f" + value_and_grad(reduce_dtype={self.policy.reduce_dtype.name})"
        return method


class Bf16Mixed(_Mixed):
    """bfloat16 autocast, float32 params; no loss scaling."""

    name = "bf16-mixed"
    policy_spec = "bf16-mixed"
    compute_dtype_name = "bfloat16"


class Fp16Mixed(_Mixed):
    """float16 autocast with dynamic loss scaling (GradScaler / the torch preset of
    ``jaxamp.DynamicLossScale``: both sides move the scale identically)."""

    name = "fp16-mixed"
    policy_spec = "fp16-mixed"
    compute_dtype_name = "float16"
    loss_scaling = True
    verdict_checks = ("scale", "skips", "final loss")
    # The fp16 stress setting (parity.core.config.FP16_STRESS): the short run exercises overflow,
    # backoff and growth. torch's fp16 CPU kernels are slow: tiny runs.
    matrix_plan = {"steps": 20, "batch_size": 4, "init_scale": 2.0**20, "growth_interval": 5}

    def torch_grad_scaler(self, config: Any, device_type: str, *, sharded: bool = False) -> Any:
        import torch  # torch: optional for JAX users

        if sharded:
            # Sharded gradients: the found-inf flag must be all-reduced for every rank to skip
            # together (what ShardedGradScaler does).
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(
                device_type, init_scale=config.init_scale, growth_interval=config.growth_interval
            )
        return torch.amp.GradScaler(
            device_type, init_scale=config.init_scale, growth_interval=config.growth_interval
        )

    def step0_loss_scale(self, config: Any) -> float:
        # The run's initial scale capped at torch's default 2**16 (a stress setting such as 2**24
        # makes step 0 overflow on purpose). Without a scale, fp16 gradients underflow.
        return float(min(config.init_scale, 2.0**16))

    def jax_loss_scale(self, config: Any) -> Any:
        return jaxamp.DynamicLossScale.from_preset(
            "torch", init_scale=config.init_scale, growth_interval=config.growth_interval
        )


class Bf16True(Recipe):
    """The whole model in bfloat16 (``model.to(torch.bfloat16)``; params, statistics and inputs
    cast once on the JAX side); the optimizer keeps bfloat16 state."""

    name = "bf16-true"
    policy_spec = "bf16-true"
    compute_dtype_name = "bfloat16"
    verdict_checks = ("final loss",)

    def torch_convert(self, model: Any, device: Any) -> tuple[Any, dict[str, Any]]:
        del device
        return model.to(self.torch_input_dtype()), {}

    def torch_input_dtype(self) -> Any:
        import torch  # torch: optional for JAX users

        return getattr(torch, self.policy.param_dtype.name)

    def torch_method(self, arm: str = "single") -> str:
        del arm
        return f"model.to({self.policy.param_dtype.name})"

    def jax_cast(self, tree: Any) -> Any:
        return jaxamp.cast_floating(tree, self.policy.param_dtype)

    def jax_method(self, device: str, arm: str = "single") -> str:
        del device, arm
        return f"{self.policy.param_dtype.name} params and inputs"


class _Fp8(Recipe):
    """torchao's float8 training recipe (`parity.core.fp8`): torchao ``Float8Linear`` on the torch
    side, ``jaxamp.fp8.convert`` on the JAX side; float32 outside the fp8 linear layers."""

    claims_policy = False
    compute_dtype_name = "float8"
    verdict_checks = ("fp8 loss", "final loss")
    step0_checks = ("quantized layers",)

    def unsupported(self, arm: str, mode: str | None = None) -> str | None:
        super().unsupported(arm, mode)
        if arm == "fsdp":
            return (
                "FSDP2 shards each Float8Linear weight; torchao's fp8 all-gather and the JAX "
                "twin's per-shard amax are not wired into the harness (use --strategy ddp)"
            )
        if arm == "ddp" and mode in ("jit", "multiprocess"):
            return (
                "each DDP rank takes its fp8 scales from its own shard of the batch; a JAX "
                "program over the global batch takes them from the whole batch (measured: "
                "1.2e-3 apart at step 0 on mlp); shard_map scales per device as DDP does "
                "(use --jax-modes shard_map)"
            )
        return None

    def torch_convert(self, model: Any, device: Any) -> tuple[Any, dict[str, Any]]:
        layers = parity_fp8.convert_torch(model, self.name, device)
        return model, {"fp8_method": self.torch_method(), "fp8_layers": layers}

    def torch_method(self, arm: str = "single") -> str:
        del arm
        return parity_fp8.fp8_method(self.name, "torch")

    def jax_forward(self, forward: Callable, device: str, arm: str = "single") -> Callable:
        del arm
        return parity_fp8.wrap_jax_forward(forward, self.name, device)

    def jax_method(self, device: str, arm: str = "single") -> str:
        del arm
        return parity_fp8.fp8_method(self.name, "jax", device)

    def quantized_layers_step0(self, pair: Any, inputs: Any, targets: Any) -> list[dict]:
        return parity_fp8.step0_fp8(pair, self.name, inputs, targets)


class Fp8Tensorwise(_Fp8):
    """torchao's default fp8 recipe: tensorwise scales, e4m3 forward, e5m2 gradients."""

    name = "fp8-tensorwise"


class Fp8Rowwise(_Fp8):
    """torchao's rowwise recipe: e4m3 throughout, power-of-two row scales."""

    name = "fp8-rowwise"


class Fp8RowwiseGwHp(_Fp8):
    """torchao's rowwise recipe with the weight-gradient matmul in high precision."""

    name = "fp8-rowwise-gw-hp"


class _Mx(Recipe):
    """A block-scaled (MX) training recipe (`parity.core.mx`): torchao's ``mx_mm`` layers on the
    torch side (``MXFP8Linear``), ``jaxamp.mx.convert`` on the JAX side; float32 outside the
    converted linear layers. Step 0 compares every layer's scales and element codes."""

    claims_policy = False
    compute_dtype_name = "float8"  # e4m3 elements: fp8's step bands
    verdict_checks = ("fp8 loss", "final loss")
    step0_checks = ("quantized layers",)
    # The weight-gradient matmul blocks the batch rows in 32s: a batch of 32 (mlp: 32 rows).
    matrix_plan = {"steps": 30, "batch_size": 32}

    def unsupported(self, arm: str, mode: str | None = None) -> str | None:
        super().unsupported(arm, mode)
        if arm in ("ddp", "fsdp"):
            return (
                "each rank would block its own shard of the batch rows (the weight-gradient "
                "matmul's 32-row blocks) and the JAX twin the global batch; not wired into the "
                "distributed workers (run it on one device)"
            )
        return None

    def torch_convert(self, model: Any, device: Any) -> tuple[Any, dict[str, Any]]:
        layers = parity_mx.convert_torch(model, self.name, device)
        if not layers:
            raise UnsupportedHere(f"{self.name}: {parity_mx.NO_LAYER}")
        return model, {"fp8_method": self.torch_method(), "fp8_layers": layers}

    def torch_method(self, arm: str = "single") -> str:
        del arm
        return parity_mx.mx_method(self.name, "torch")

    def jax_forward(self, forward: Callable, device: str, arm: str = "single") -> Callable:
        del arm
        return parity_mx.wrap_jax_forward(forward, self.name, device)

    def jax_method(self, device: str, arm: str = "single") -> str:
        del arm
        return parity_mx.mx_method(self.name, "jax", device)

    def quantized_layers_step0(self, pair: Any, inputs: Any, targets: Any) -> list[dict]:
        """Per-layer MX scale and code rows (`parity.core.mx.step0_mx`), in fp8's row format."""
        return parity_mx.step0_mx(pair, self.name, inputs, targets)


class Mxfp8(_Mx):
    """MXFP8 everywhere with RCEIL scales: torchao's ``MXFP8TrainingOpConfig`` default."""

    name = "mxfp8"


class Mxfp8Floor(_Mx):
    """MXFP8 with FLOOR scales (the OCP MX 1.0 rule)."""

    name = "mxfp8-floor"


class Mxfp8WgradHp(_Mx):
    """MXFP8 (RCEIL) with the weight-gradient matmul in high precision (``wgrad_with_hp``)."""

    name = "mxfp8-wgrad-hp"


class Mxfp4(_Mx):
    """MXFP4 everywhere (e2m1 elements, RCEIL e8m0 scales): torchao's ``mx_mm`` with
    ``float4_e2m1fn_x2``. Judged by fp8's bands after step 0, whose codes are compared bit for
    bit as for MXFP8."""

    name = "mxfp4"


def _torchao_step(optimizer: Any, compiled: bool) -> Any:
    """`optimizer` (a torchao optimizer) whose ``step`` runs eagerly unless `compiled`.

    torchao's ``step`` wraps its update in ``torch.compile``; the harness's torch side is eager
    unless the run says ``torch_compile`` (then torchao runs as it ships).
    ``torch.compiler.set_stance("force_eager")`` runs the same Python update without compiling
    it (torchao's tests compare its eager and compiled steps: bit-identical on a first step).
    """
    if compiled:
        return optimizer
    import torch  # torch: optional for JAX users

    step = optimizer.step

    @functools.wraps(step)
    def eager_step(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return step(*args, **kwargs)

    optimizer.step = eager_step
    return optimizer


def _torchao_adamw_kwargs(config: Any) -> dict[str, Any]:
    # The run's AdamW hyperparameters (what torch.optim.AdamW and optax.adamw get in the other
    # recipes), not torchao's own defaults.
    return {
        "lr": config.lr,
        "betas": config.betas,
        "eps": config.eps,
        "weight_decay": config.weight_decay,
    }


class _LowBitAdamW(Fp32):
    """float32 compute; AdamW's two moments stored as block-wise codes: torchao's optimizer on
    the torch side, ``jaxamp.optim_precision.low_precision_state`` around the run's optax AdamW on the JAX side
    (torchao's maps, block sizes and 4096-element minimum: smaller leaves stay float32)."""

    baseline = False
    claims_policy = False
    optimizers = ("adamw",)
    first_distinct_step = 2
    step0_checks = ("optimizer state",)
    state_format: ClassVar[str] = ""
    torchao_class: ClassVar[str] = ""

    def unsupported(self, arm: str, mode: str | None = None) -> str | None:
        super().unsupported(arm, mode)
        if arm == "fsdp":
            return (
                f"FSDP2 shards each state: torchao's {self.torchao_class} quantizes every rank's "
                "local shard (its 4096-element minimum and its blocks per shard), "
                "jaxamp.optim_precision.low_precision_state the global array, so the two hold different codes"
            )
        if arm == "ddp":
            return (
                "the distributed workers measure no optimizer state and their torch and JAX "
                f"twins of {self.torchao_class} are not checked against each other; run it on "
                "one device"
            )
        return None

    def torch_optimizer(self, config: Any, params: list) -> Any:
        import torchao.optim  # torch: optional for JAX users

        optimizer = getattr(torchao.optim, self.torchao_class)
        return _torchao_step(
            optimizer(list(params), **_torchao_adamw_kwargs(config)), config.torch_compile
        )

    def torch_method(self, arm: str = "single") -> str:
        del arm
        return f"float32, torchao.optim.{self.torchao_class}"

    def jax_optimizer(
        self,
        inner: optax.GradientTransformation,
        config: Any,
        axis_name: str | None = None,
        pair: Any = None,
    ) -> optax.GradientTransformation:
        """``low_precision_state`` whose blocks hold the elements torchao's hold: each JAX
        parameter's state blocked in its torch tensor's order (`torch_block_order` of `pair`,
        the run's built-in or user pair).

        Raises:
          ValueError: `pair` is None.
        """
        if pair is None:
            raise ValueError(
                f"{self.name}.jax_optimizer(pair=None): torchao blocks each torch tensor in its "
                "own row-major order, and the JAX state needs the pair's weight mapping to hold "
                "the same blocks; pass the run's ModelPair (build_jax_optimizer(config, pair=...))."
            )
        low = jaxamp.optim_precision.low_precision_state(
            inner, self.state_format, block_order=self.torch_block_order(pair)
        )
        return jaxamp.loss_scaled(low, self.jax_loss_scale(config), axis_name=axis_name)

    @staticmethod
    def torch_block_order(pair: Any) -> dict:
        """``{flax module: {leaf: order}}``: each parameter's elements in the row-major order of
        the torch tensor it maps from (``pair.mapping``: a Dense kernel is torch's weight
        transposed, a conv kernel HWIO of OIHW, cnn's ``fc`` rows also CHW -> HWC), for
        ``low_precision_state(block_order=...)``. torchao blocks each torch tensor row-major;
        blocked in the Flax layout, a block would hold other elements under another scale.
        Leaves assembled from several torch tensors (pieces, sums) keep the Flax order. A pair
        without torch that carries the order recorded with torch (``pair.block_order``: a
        golden file's, `parity.golden.check`) gives it as recorded."""
        recorded = getattr(pair, "block_order", None)
        if recorded is not None:
            return recorded
        if pair.mapping is None:
            raise ValueError(
                f"pair {pair.name!r}: no weight mapping (a `transfer` callable was given), so "
                "the JAX state cannot take torchao's block order; pass transfer=None (the "
                "automatic mapping) or a mapping for the low-bit AdamW precisions."
            )
        shapes = {name: tuple(t.shape) for name, t in pair.torch_model.state_dict().items()}
        orders: dict = {}
        for path, found in pair.mapping.element_index(shapes).items():
            if path[0] != "params" or len(found) != 1:
                continue
            index = found[0][1]
            order = np.argsort(index.reshape(-1), kind="stable")
            if (order != np.arange(order.size)).any():
                node = orders
                for key in path[1:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = order
        return orders

    def jax_method(self, device: str, arm: str = "single") -> str:
        del device, arm
        return (
            f"float32, jaxamp.optim_precision.low_precision_state(adamw, {self.state_format!r}; "
            "blocked in torch's element order)"
        )


class AdamW8bit(_LowBitAdamW):
    """AdamW with 8-bit moments (bitsandbytes' dynamic-tree maps, blocks of 256)."""

    name = "adamw-8bit"
    state_format = "8bit"
    torchao_class = "AdamW8bit"


class AdamW4bit(_LowBitAdamW):
    """AdamW with 4-bit moments (torchao's 4-bit maps, blocks of 128)."""

    name = "adamw-4bit"
    state_format = "4bit"
    torchao_class = "AdamW4bit"
    # 4-bit codes amplify float32 rounding: torch's own 1-ulp-nudged run parts from torch as far
    # as JAX does (0.39% at step 27 of the matrix's mlp cell, past the fixed 1e-3 band), so the
    # trajectory is judged against torch's noise. The state's layout and blocks, which that noise
    # would hide end to end, are decided at step 0 (`parity.verdicts.optim_step0`, bit-exact).
    calibration = {"noise": "torch"}


class AdamWFp8(_LowBitAdamW):
    """AdamW with float8 (e4m3) moments, one scale per 256 elements."""

    name = "adamw-fp8"
    state_format = "fp8"
    torchao_class = "AdamWFp8"


class Bf16TrueSR(Bf16True):
    """``bf16-true`` whose weights still learn: each new weight rounded stochastically to
    bfloat16 (torchao ``_AdamW(bf16_stochastic_round=True)`` on a bfloat16 model against
    ``jaxamp.optim_precision.preset("bf16-true-sr", ...)``). The random bits come from torch's
    generator on one side and from the key in the optax state on the other: the two runs round
    differently from the first step, as two seeds of one framework do."""

    name = "bf16-true-sr"
    claims_policy = False
    optimizers = ("adamw",)

    def unsupported(self, arm: str, mode: str | None = None) -> str | None:
        super().unsupported(arm, mode)
        if arm in ("ddp", "fsdp"):
            return (
                "torchao draws the rounding bits from each rank's torch generator (per local "
                "shard under FSDP2), the JAX side from one key in the optimizer state; the "
                "workers do not align the ranks' generators, so replicas could round apart"
            )
        return None

    def torch_optimizer(self, config: Any, params: list) -> Any:
        import torch  # torch: optional for JAX users
        from torchao.optim import _AdamW

        # torchao draws the rounding bits from torch's default generator: seeded from the run's
        # seed, so a torch run reproduces as the JAX one does from its key.
        torch.manual_seed(config.seed)
        optimizer = _AdamW(
            list(params), **_torchao_adamw_kwargs(config), bf16_stochastic_round=True
        )
        return _torchao_step(optimizer, config.torch_compile)

    def torch_method(self, arm: str = "single") -> str:
        return f"{super().torch_method(arm)}, torchao _AdamW(bf16_stochastic_round=True)"

    def jax_optimizer(
        self,
        inner: optax.GradientTransformation,
        config: Any,
        axis_name: str | None = None,
        pair: Any = None,
    ) -> optax.GradientTransformation:
        del pair
        policy, tx = jaxamp.optim_precision.preset(self.name, inner, seed=config.seed)
        if policy != self.policy:  # the preset and the recipe name one precision
            raise ValueError(
                f"{self.name}: jaxamp's preset is the policy {str(policy)!r}, the recipe "
                f"{str(self.policy)!r}."
            )
        return jaxamp.loss_scaled(tx, self.jax_loss_scale(config), axis_name=axis_name)

    def jax_method(self, device: str, arm: str = "single") -> str:
        return f"{super().jax_method(device, arm)}, optim_precision.preset({self.name!r})"


RECIPES: dict[str, type[Recipe]] = {}


def register(cls: type[Recipe]) -> type[Recipe]:
    """Adds a recipe class to the registry (its `name` becomes a precision name)."""
    if not (isinstance(cls, type) and issubclass(cls, Recipe)) or not cls.name:
        raise TypeError(f"register: expected a Recipe subclass with a `name`; got {cls!r}.")
    if cls.name in RECIPES and RECIPES[cls.name] is not cls:
        raise ValueError(f"register: precision {cls.name!r} is already registered.")
    RECIPES[cls.name] = cls
    return cls


register(Fp32)
register(Bf16Mixed)
register(Fp16Mixed)
register(Bf16True)
register(Fp8Tensorwise)
register(Fp8Rowwise)
register(Fp8RowwiseGwHp)
register(Mxfp8)
register(Mxfp8Floor)
register(Mxfp8WgradHp)
register(Mxfp4)
register(Bf16TrueSR)
register(AdamW8bit)
register(AdamW4bit)
register(AdamWFp8)


def precision_names() -> tuple[str, ...]:
    """The registered precision names, in registration order."""
    return tuple(RECIPES)


def resolve_precision(name: Any) -> str:
    """The registered precision `name` stands for, read as ``jaxamp.get_policy`` reads it.

    Raises:
      ValueError: `name` is no recipe's and no policy jaxamp knows (the closest valid name is
        given), or a policy no recipe runs.

    Example:
      >>> resolve_precision("16-mixed"), resolve_precision("bf16")
      ('fp16-mixed', 'bf16-mixed')
    """
    if isinstance(name, str) and name in RECIPES:
        return name
    names = precision_names()
    if not isinstance(name, str):
        raise ValueError(f"`precision` must be one of {names}; got {name!r}.")
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    try:
        policy = jaxamp.get_policy(name)
    except ValueError:
        raise ValueError(
            f"`precision` must be one of {names} (or a name jaxamp.get_policy reads, e.g. "
            f"'bf16', '16-mixed'); got {name!r}.{hint}"
        ) from None
    for cls in RECIPES.values():
        if cls.claims_policy and cls().policy == policy:
            return cls.name
    raise ValueError(
        f"`precision` {name!r} is the jaxamp policy {str(policy)!r}, which no parity recipe runs; "
        f"recipes: {names}.{hint}"
    )


def get_recipe(precision: str | Recipe) -> Recipe:
    """The recipe object of a precision name (any name `resolve_precision` reads).

    Example:
      >>> get_recipe("mixed_bfloat16").name
      'bf16-mixed'
    """
    if isinstance(precision, Recipe):
        return precision
    return RECIPES[resolve_precision(precision)]()
