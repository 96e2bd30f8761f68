"""Both optimizers on the same gradient sequence: the replay's two sides.

The torch side is the user's loop as a torch script runs it: ``p.grad`` set to the (scaled)
gradient, ``GradScaler.unscale_`` where the run scales the loss, the user's clipping,
``scaler.step`` / ``optimizer.step``, ``scaler.update``, ``scheduler.step()``. The JAX side is the
user's optax transformation inside the run's ``jaxamp.loss_scaled`` (`parity.training.user_loop.
loop_optimizer`), fed the same gradients in the Flax layout times its own loss scale, through
``jaxamp.apply_gradients`` (jitted or eager). Both start from the pair's weights and fresh
states; every step records, in the Flax layout, the parameters before, the update, the optimizer
state both expose (Adam's moments, the momentum trace, the step count), the learning rate in
effect and whether the step was skipped; the torch side adds the gradients the optimizer saw
(after clipping), the clipping factor, its param group's hyperparameters and, where a group's
learning rate is 0, its update at learning rate 1 (the direction the explanation fits).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

import jaxamp
from parity.replay.layout import Layout
from parity.training.user_loop import TrainingLoop, loop_optimizer

__all__ = ["SideStep", "jax_replay", "jax_stepper", "torch_replay"]

# torch optimizer state key -> the quantity's name (optax's field name)
TORCH_STATE = {
    "exp_avg": "mu",
    "exp_avg_sq": "nu",
    "max_exp_avg_sq": "nu_max",
    "momentum_buffer": "trace",
}
STATE_FIELDS = ("mu", "nu", "nu_max", "trace")


@dataclasses.dataclass
class SideStep:
    """One replayed step of one side (arrays in the Flax layout, keyed by leaf path)."""

    params: dict[str, np.ndarray]  # before the step
    update: dict[str, np.ndarray]  # after - before
    state: dict[str, dict[str, np.ndarray]]  # quantity -> path -> array, after the step
    count: int | None  # the optimizer's step count after the step
    lr: dict[str, float] | float | None  # torch: per path; JAX: the injected rate, if any
    skipped: bool
    scale: float  # the loss scale the step's gradients were multiplied by
    # torch only
    grads: dict[str, np.ndarray] | None = None  # unscaled, after clipping
    clip: float | None = None  # global clipping factor (||after|| / ||before||)
    grad_norm: float | None = None  # global norm before clipping
    groups: dict[str, dict] | None = None  # path -> its param group's hyperparameters
    lr_next: dict[str, float] | None = None  # the group's rate after scheduler.step()
    direction: dict[str, np.ndarray] | None = None  # update at lr 1 (only where a group's lr is 0)


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


# -- JAX -----------------------------------------------------------------------------------------


def _walk_state(node: Any, found: dict, lrs: list, counts: list) -> None:
    """Collects mu/nu/nu_max/trace trees, the count beside them and injected learning rates."""
    if isinstance(node, optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState):
        if "learning_rate" in node.hyperparams:
            lrs.append(node.hyperparams["learning_rate"])
        _walk_state(node.inner_state, found, lrs, counts)
        return
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        fields = node._fields
        for field in STATE_FIELDS:
            if field in fields:
                for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(node, field))[0]:
                    if hasattr(leaf, "shape"):
                        key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                        found.setdefault(field, {})[key] = np.asarray(leaf, np.float32)
        if "count" in fields and any(f in fields for f in STATE_FIELDS):
            counts.append(int(np.asarray(node.count)))
        for field in fields:
            if field not in STATE_FIELDS:
                _walk_state(getattr(node, field), found, lrs, counts)
        return
    if isinstance(node, tuple | list):
        for item in node:
            _walk_state(item, found, lrs, counts)
    elif isinstance(node, dict):
        for item in node.values():
            _walk_state(item, found, lrs, counts)


def _flat(tree: Any) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        out[key] = np.asarray(leaf, np.float32)
    return out


def _unflat(flat: dict[str, np.ndarray], like: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    values = []
    for path, leaf in leaves:
        key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        values.append(jnp.asarray(flat[key], leaf.dtype))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), values)


def jax_stepper(pair: Any, loop: TrainingLoop, config: Any, *, jit: bool = True):
    """``(initial params, init, step)`` of the JAX side: ``step(unscaled grads, state, params)
    -> (params, state, scale used, applied)`` multiplies the gradients by the state's loss scale
    (as ``jaxamp.value_and_grad`` returns them) and runs ``jaxamp.apply_gradients``; both are
    jitted once when `jit` (eager otherwise: optax op by op)."""
    params = jax.tree_util.tree_map(jnp.asarray, pair.torch_to_flax()["params"])
    tx = loop_optimizer(loop, config, params, pair=pair)

    def step(grads, state, params):
        scale = jaxamp.amp_info(state).loss_scale
        grads = jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), grads)
        params, state = jaxamp.apply_gradients(tx, grads, state, params)
        return params, state, scale, jaxamp.amp_info(state).last_step_applied

    if jit:
        return params, jax.jit(tx.init), jax.jit(step)
    return params, tx.init, step


def jax_replay(
    stepper: tuple[Any, Any, Any], gradients: Sequence[dict[str, np.ndarray]]
) -> list[SideStep]:
    """The user's optax transformation (`jax_stepper`) on the gradient sequence (Flax layout,
    unscaled), from the initial params and a fresh state."""
    params, init, run = stepper
    state = init(params)
    steps = []
    for flat in gradients:
        grads = _unflat(flat, params)
        before = _flat(params)
        params, state, scale, applied = run(grads, state, params)
        after = _flat(params)
        found: dict = {}
        lrs: list = []
        counts: list = []
        _walk_state(state, found, lrs, counts)
        steps.append(
            SideStep(
                params=before,
                update={k: after[k] - before[k] for k in before},
                state=found,
                count=counts[0] if counts else None,
                lr=float(np.asarray(lrs[0])) if len(lrs) == 1 else None,
                skipped=not bool(applied),
                scale=float(scale),
            )
        )
    return steps
