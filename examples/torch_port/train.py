"""Torch port: transfer a torch model's weights to Flax, check the port, train both side by side.

1. Build the torch model (seeded) and copy its weights into the Flax port (`models.port_weights`).
2. Forward check: the two models' logits on one batch, in float32 (the port itself) and under the
   precision (torch.autocast / GradScaler vs a jaxamp policy).
3. Train both from the same weights on the same batches with the same optimizer, under the same
   precision, and record both loss curves (and both loss scales).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jaxamp
import jaxamp.flax as jf
from examples import utils
from examples.torch_port.config import Config
from examples.torch_port.models import FlaxNet, TorchNet, port_weights
from parity import data as data_lib

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Forward-check tolerance on logits, relative to their largest magnitude, per compute dtype.
_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


@dataclasses.dataclass
class TorchSide:
    """torch's version of a jaxamp policy."""

    model: torch.nn.Module
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None  # None: no autocast
    scaler: torch.amp.GradScaler
    note: str

    def forward(self, images: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)
        x = x.to(self.param_dtype)
        with torch.autocast(
            "cpu",
            dtype=self.autocast_dtype or torch.bfloat16,
            enabled=self.autocast_dtype is not None,
        ):
            return self.model(x)


def torch_side(model: TorchNet, policy: jaxamp.Policy) -> TorchSide:
    """`model` set up as torch.amp would run `policy` on the CPU."""
    param_dtype = _TORCH_DTYPES[policy.param_dtype.name]
    compute_dtype = _TORCH_DTYPES[policy.compute_dtype.name]
    model = model.to(param_dtype)
    autocast = compute_dtype if compute_dtype != param_dtype else None
    note = ""
    scaling = policy.needs_loss_scaling
    if scaling and param_dtype == torch.float16:
        # GradScaler refuses float16 gradients ("Attempting to unscale FP16 gradients").
        scaling, note = False, "torch GradScaler cannot unscale float16 params: torch runs unscaled"
    return TorchSide(
        model, param_dtype, autocast, torch.amp.GradScaler("cpu", enabled=scaling), note
    )


def cross_entropy_jax(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def forward_check(
    torch_model: TorchNet, flax_model: FlaxNet, variables: dict, images: np.ndarray, policy
) -> dict[str, Any]:
    """Max |logits difference| between torch and Flax, in float32 and under `policy`."""
    with torch.no_grad():
        reference = torch_model(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()
    # jitted, as the train step runs the model: one compile each, not one per op
    ported = np.asarray(jax.jit(flax_model.apply)(variables, jnp.asarray(images)))
    fp32_diff = float(np.max(np.abs(reference - ported)))
    scale = max(1.0, float(np.max(np.abs(reference))))

    side = torch_side(copy.deepcopy(torch_model), policy)
    with torch.no_grad():
        torch_logits = side.forward(images).float().numpy()
    apply = jax.jit(jf.linen.with_policy(flax_model.apply, policy))
    jax_logits = np.asarray(
        apply(policy.cast_to_param(variables), jnp.asarray(images)).astype(jnp.float32)
    )
    policy_diff = float(np.max(np.abs(torch_logits - jax_logits)))
    tolerance = _TOLERANCE[policy.compute_dtype.name] * scale
    return {
        "fp32_max_abs_diff": fp32_diff,
        "fp32_tolerance": _TOLERANCE["float32"] * scale,
        "fp32_verdict": "ok" if fp32_diff <= _TOLERANCE["float32"] * scale else "MISMATCH",
        "policy_max_abs_diff": policy_diff,
        "policy_tolerance": tolerance,
        "policy_verdict": "ok" if policy_diff <= tolerance else "MISMATCH",
    }


@jax.jit
def jax_train_step(state: jf.TrainState, images, labels):
    def loss_fn(params, images, labels):
        return cross_entropy_jax(state.apply_fn({"params": params}, images), labels)

    loss, grads = state.value_and_grad(loss_fn)(state.params, images, labels)
    state = state.apply_gradients(grads=grads)
    return state, loss, state.amp_info()


def torch_train_step(side: TorchSide, optimizer, images, labels) -> tuple[float, float, bool]:
    optimizer.zero_grad(set_to_none=True)
    logits = side.forward(images)
    loss = torch.nn.functional.cross_entropy(logits.float(), torch.from_numpy(labels).long())
    scale_before = side.scaler.get_scale() if side.scaler.is_enabled() else 1.0
    side.scaler.scale(loss).backward()
    side.scaler.step(optimizer)
    side.scaler.update()
    scale_after = side.scaler.get_scale() if side.scaler.is_enabled() else 1.0
    return loss.item(), float(scale_after), scale_after < scale_before


def train_and_evaluate(config: Config, workdir: str) -> dict[str, Any]:
    """Forward check, then trains both sides; writes metrics.json and loss.png.

    Returns:
      The metrics dict written to ``workdir/metrics.json``.
    """
    workdir_path = Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    policy = jaxamp.get_policy(config.precision)
    torch.manual_seed(config.seed)
    torch_model = TorchNet(3, config.image_size, config.channels, config.hidden, config.num_classes)
    flax_model = FlaxNet(tuple(config.channels), config.hidden, config.num_classes)
    variables = port_weights(torch_model)
    stream = data_lib.synthetic_images(
        config.seed,
        config.batch_size,
        (config.image_size, config.image_size, 3),
        config.num_classes,
    )
    check = forward_check(torch_model, flax_model, variables, stream.batch(0)[0], policy)

    state = jf.TrainState.create(
        apply_fn=flax_model.apply,
        params=policy.cast_to_param(variables["params"]),
        tx=optax.sgd(config.learning_rate, momentum=config.momentum),
        policy=policy,
    )
    side = torch_side(torch_model, policy)
    torch_optimizer = torch.optim.SGD(
        side.model.parameters(), lr=config.learning_rate, momentum=config.momentum
    )
    pending, records = [], []
    start = time.perf_counter()
    for step in utils.progress(
        range(config.num_steps), total=config.num_steps, enabled=config.progress, desc="train"
    ):
        images, labels = stream.batch(step)
        state, loss, info = jax_train_step(state, jnp.asarray(images), jnp.asarray(labels))
        torch_loss, torch_scale, torch_skipped = torch_train_step(
            side, torch_optimizer, images, labels
        )
        pending.append((step, loss, info))
        records.append((torch_loss, torch_scale, torch_skipped))
    host = jax.device_get([(loss, info) for _, loss, info in pending])
    elapsed = time.perf_counter() - start
    steps = [
        {
            "step": step,
            "loss_jax": float(loss),
            "loss_torch": torch_loss,
            "loss_scale_jax": float(info.loss_scale),
            "loss_scale_torch": torch_scale,
            "skipped_jax": not bool(info.last_step_applied),
            "skipped_torch": torch_skipped,
        }
        for (step, _, _), (loss, info), (torch_loss, torch_scale, torch_skipped) in zip(
            pending, host, records, strict=True
        )
    ]
    tail = steps[-10:]
    gap = float(np.mean([abs(s["loss_jax"] - s["loss_torch"]) for s in tail])) if tail else 0.0
    metrics = {
        "example": "torch_port",
        "precision": config.precision,
        "policy": str(policy),
        "config": dataclasses.asdict(config),
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "torch_setup": {
            "param_dtype": str(side.param_dtype),
            "autocast_dtype": None if side.autocast_dtype is None else str(side.autocast_dtype),
            "grad_scaler": side.scaler.is_enabled(),
            "note": side.note,
        },
        "forward_check": check,
        "steps": steps,
        "summary": {
            "final_loss_jax": steps[-1]["loss_jax"] if steps else float("nan"),
            "final_loss_torch": steps[-1]["loss_torch"] if steps else float("nan"),
            "mean_abs_loss_gap_last_10": gap,
            "skipped_steps_jax": int(sum(s["skipped_jax"] for s in steps)),
            "skipped_steps_torch": int(sum(s["skipped_torch"] for s in steps)),
            "wall_time_s": elapsed,
        },
    }
    utils.write_json_atomic(workdir_path / "metrics.json", metrics)
    utils.plot_losses(
        workdir_path / "loss.png",
        [s["step"] for s in steps],
        [s["loss_jax"] for s in steps],
        title=f"torch port ({config.precision}): JAX vs torch",
        label="jax (jaxamp)",
        others={"torch (torch.amp)": [s["loss_torch"] for s in steps]},
        loss_scales=[s["loss_scale_jax"] for s in steps],
    )
    return metrics
