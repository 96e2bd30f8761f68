"""The torch side of the optimizer replay: the user's loop as a torch script runs it.

``p.grad`` set to the (scaled) gradient, ``GradScaler.unscale_`` where the run scales the loss,
the user's clipping, ``scaler.step`` / ``optimizer.step``, ``scaler.update``,
``scheduler.step()``, from the pair's weights and a fresh state. Every step records, in the
Flax layout (`parity.replay.jax_side.SideStep`, as the JAX side's steps), the parameters before,
the update, the optimizer state both expose (Adam's moments, the momentum trace, the step
count), the learning rate in effect and whether the step was skipped, and adds the gradients the
optimizer saw (after clipping), the clipping factor, its param group's hyperparameters and,
where a group's learning rate is 0, its update at learning rate 1 (the direction the
explanation fits).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from parity.replay.jax_side import SideStep
from parity.replay.layout import Layout
from parity.training.user_loop import TrainingLoop

__all__ = ["FEW_PARAMETERS", "TORCH_STATE", "replay_threads", "torch_replay"]

# Below this many parameters the replay's torch side runs on one intra-op thread: its eager ops
# (a few kernels per parameter per step) are too small to split, and splitting them costs more
# than it saves (measured on the built-in transformer, 137k parameters, 2 cores under load:
# 1.45 CPU s / 4.4 wall s on two threads, 0.17 / 0.6 on one).
FEW_PARAMETERS = 2**20

# torch optimizer state key -> the quantity's name (optax's field name)
TORCH_STATE = {
    "exp_avg": "mu",
    "exp_avg_sq": "nu",
    "max_exp_avg_sq": "nu_max",
    "momentum_buffer": "trace",
}


@contextlib.contextmanager
def replay_threads(model: Any) -> Iterator[None]:
    """torch's intra-op threads for the replay of `model`: one below `FEW_PARAMETERS`
    parameters, unchanged above; restored after."""
    before = torch.get_num_threads()
    small = sum(p.numel() for p in model.parameters()) < FEW_PARAMETERS
    if small and before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _hyper(group: dict) -> dict:
    keep = ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "nesterov", "amsgrad")
    out = {}
    for key in keep:
        if key in group:
            value = group[key]
            value = value.item() if isinstance(value, torch.Tensor) else value
            out[key] = tuple(float(v) for v in value) if key == "betas" else value
    return out


def torch_replay(
    pair: Any,
    loop: TrainingLoop,
    config: Any,
    gradients: Sequence[Any],
    layout: Layout,
    *,
    loss_fn: Any,
    batch: Any,
) -> tuple[list[SideStep], list[dict[str, torch.Tensor]]]:
    """The user's torch loop on a gradient sequence.

    Args:
      gradients: per step, ``{torch name: unscaled gradient}`` or an int ``k``: the model's own
        gradient of ``loss_fn`` on ``batch(k)`` at its current weights (a real step).
      loss_fn: ``(logits, targets) -> loss`` of the torch side.
      batch: ``k -> (inputs, targets)`` numpy.

    Returns:
      ``(steps, gradients used)``: the records, and each step's unscaled gradient as given to
      the optimizer before clipping (the JAX side replays these).
    """
    model = copy.deepcopy(pair.torch_model).float().cpu()
    optimizer, scheduler = loop.build_torch(model)
    names = layout.names
    named = dict(model.named_parameters())
    params = [named[n] for n in names]
    scaler = config.recipe.torch_grad_scaler(config, "cpu")
    if scaler is not None:
        scaler.scale(torch.zeros(()))  # GradScaler makes its scale on first use
    group_of = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            group_of[id(p)] = group
    steps, given = [], []
    for spec in gradients:
        if isinstance(spec, int):
            inputs, targets = batch(spec)
            model.zero_grad(set_to_none=True)
            logits = pair.torch_forward(model, torch.as_tensor(inputs), train=True)
            loss_fn(logits, torch.as_tensor(targets)).backward()
            grads = {
                n: (named[n].grad if named[n].grad is not None else torch.zeros_like(named[n]))
                for n in names
            }
            grads = {n: g.detach().float().clone() for n, g in grads.items()}
        else:
            grads = {n: spec[n].detach().float().clone() for n in names}
        given.append(grads)
        before = {n: named[n].detach().clone() for n in names}
        lr = {n: float(group_of[id(named[n])]["lr"]) for n in names}
        groups = {n: _hyper(group_of[id(named[n])]) for n in names}
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        with torch.no_grad():
            for n in names:
                named[n].grad = (grads[n] * scale).to(named[n].dtype)
        if scaler is not None:
            scaler.unscale_(optimizer)
        unclipped = [named[n].grad.detach().clone() for n in names]
        loop.clip_torch(params)
        used = {n: named[n].grad.detach().clone() for n in names}
        norm_before = float(torch.linalg.vector_norm(torch.stack([u.norm() for u in unclipped])))
        dot = sum(float((used[n] * u).sum()) for n, u in zip(names, unclipped, strict=True))
        clip = dot / norm_before**2 if norm_before > 0 and np.isfinite(norm_before) else 1.0
        direction = None
        if any(v == 0.0 for v in lr.values()):
            direction = _unit_lr_update(optimizer, model, names)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
            skipped = float(scaler.get_scale()) < scale
        else:
            optimizer.step()
            skipped = False
        loop.step_scheduler(scheduler)
        lr_next = {n: float(group_of[id(named[n])]["lr"]) for n in names}
        state: dict[str, dict[str, torch.Tensor]] = {}
        count = None
        for n in names:
            held = optimizer.state.get(named[n], {})
            for key, quantity in TORCH_STATE.items():
                if key in held and isinstance(held[key], torch.Tensor):
                    state.setdefault(quantity, {})[n] = held[key]
            if "step" in held and count is None:
                count = int(float(held["step"]))
        after = {n: named[n].detach() for n in names}
        steps.append(
            SideStep(
                params=layout.to_flax(before),
                update=layout.to_flax({n: after[n] - before[n] for n in names}),
                state={
                    q: layout.to_flax(
                        {n: tensors.get(n, torch.zeros_like(named[n])) for n in names}
                    )
                    for q, tensors in state.items()
                },
                count=count,
                lr=layout.per_path(lr),
                skipped=skipped,
                scale=scale,
                grads=layout.to_flax(used),
                clip=clip,
                grad_norm=norm_before,
                groups=layout.per_path(groups),
                lr_next=layout.per_path(lr_next),
                direction=layout.to_flax(direction) if direction is not None else None,
            )
        )
    return steps, given


def _unit_lr_update(optimizer: Any, model: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """The optimizer's update of this step at learning rate 1 (on copies; nothing changes)."""
    probe_model = copy.deepcopy(model)
    mapping = dict(zip(model.parameters(), probe_model.parameters(), strict=True))
    probe = type(optimizer)(
        [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [mapping[p] for p in g["params"]],
            }
            for g in optimizer.param_groups
        ]
    )
    for p, q in mapping.items():
        q.grad = None if p.grad is None else p.grad.detach().clone()
        if p in optimizer.state:
            probe.state[q] = copy.deepcopy(optimizer.state[p])
    for group in probe.param_groups:
        group["lr"] = 1.0
    before = {n: p.detach().clone() for n, p in probe_model.named_parameters()}
    probe.step()
    return {n: p.detach() - before[n] for n, p in probe_model.named_parameters() if n in names}
