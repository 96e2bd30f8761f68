"""One training step per framework, built from a precision recipe.

- `jax_train_step` is the README's step ("Mixed precision in four lines"): the gradient function
  (``jaxamp.value_and_grad``, made by the recipe), ``jaxamp.apply_gradients``,
  ``jaxamp.amp_info``. `tests/test_parity_steps.py` checks it against the README's code.
- `torch_train_step` is torch.amp's recipe: autocast forward and loss, ``GradScaler`` scale /
  unscale / clip / step / update where the recipe has a scaler, else backward / clip / step.

The single-device trainers and the distributed workers call these; a worker only adds process
groups or sharding around them. The optimizers are built here once for both sides
(`build_torch_optimizer`, `build_jax_optimizer`) from one `RunConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxamp

# The loss-scaled optimizer's own per-gradient maximum (its finiteness check): the signal reuses
# the computation rather than adding a second reduction of every gradient.
from jaxamp._numerics import largest_magnitude

__all__ = [
    "build_jax_optimizer",
    "build_torch_optimizer",
    "clip_by_global_norm_torch",
    "jax_forward",
    "jax_train_step",
    "observed",
    "observed_step",
    "scheduled",
    "set_learning_rate",
    "step_signals",
    "torch_train_step",
]


# -- JAX -----------------------------------------------------------------------------------------


def jax_train_step(grad_fn: Callable, tx: optax.GradientTransformation) -> Callable:
    """The README's train step with `grad_fn` for ``jaxamp.value_and_grad(loss_fn, ...)``.

    Args:
      grad_fn: the recipe's gradient function (`Recipe.jax_value_and_grad`): called with the
        params, the batch and ``loss_scale=opt_state``.
      tx: the recipe's optimizer (`Recipe.jax_optimizer`: ``jaxamp.loss_scaled(...)``).

    Returns:
      ``train_step(params, opt_state, *batch) -> (params, opt_state, loss, amp_info)``.
    """

    def train_step(params, opt_state, *batch):
        loss, grads = grad_fn(params, *batch, loss_scale=opt_state)
        params, opt_state = jaxamp.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss, jaxamp.amp_info(opt_state)

    return train_step


def scheduled(train_step: Callable, *, signals: bool = False, feed_lr: bool = True) -> Callable:
    """`train_step` (`jax_train_step`'s) with the iteration's learning rate fed in and the loss
    scale it used logged: ``step(params, opt_state, learning_rate, *batch) -> (params,
    opt_state, loss, metrics)``, metrics ``{"loss_scale", "skipped"}`` as arrays.

    With ``signals=True`` the train step's gradient function is `observed` (its loss comes with
    the gradient signals) and metrics add ``grad_norm``, ``update_norm`` and, where `observed`
    measures it, ``max_scaled_grad`` (`observed_step`). ``feed_lr=False`` leaves the
    optimizer's own rate (a user's transformation with its own schedule; `learning_rate` is then
    ignored)."""

    def step(params, opt_state, learning_rate, *batch):
        if feed_lr:
            opt_state = set_learning_rate(opt_state, learning_rate)
        scale_used = jaxamp.amp_info(opt_state).loss_scale
        new_params, opt_state, loss, info = train_step(params, opt_state, *batch)
        metrics = {"loss_scale": scale_used, "skipped": jnp.logical_not(info.last_step_applied)}
        if signals:
            loss, gradient_signals = loss
            metrics.update(gradient_signals, update_norm=_norm(new_params, params))
        return new_params, opt_state, loss, metrics

    return step


def _norm(tree, minus=None):
    """The global L2 norm of `tree` (of ``tree - minus``), computed in float32."""
    leaves = jax.tree_util.tree_leaves(tree)
    if minus is not None:
        others = jax.tree_util.tree_leaves(minus)
        leaves = [
            a.astype(jnp.float32) - b.astype(jnp.float32)
            for a, b in zip(leaves, others, strict=True)
        ]
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _unscaled(grads, opt_state):
    """`grads` (of the scaled loss) unscaled as the loss-scaled optimizer in `opt_state` unscales
    them for the optimizer inside it: by jaxamp's loss scale's own ``unscale`` (torch's float32
    reciprocal; the computation is the optimizer's, so XLA computes it once for both, and a
    clipping norm of the same values once for both), then float32. A loss scale of another
    library divides by its scale (the same numbers for every power-of-two scale)."""
    loss_scale = jaxamp.get_loss_scale(opt_state)
    own = jaxamp.NoOpLossScale | jaxamp.DynamicLossScale | jaxamp.StaticLossScale
    if isinstance(loss_scale, own):  # NoOpLossScale's unscale returns the gradients as they are
        unscaled = loss_scale.unscale(grads)
    else:
        scale = jnp.asarray(loss_scale.loss_scale, jnp.float32)
        unscaled = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32) / scale, grads)
    return jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), unscaled)


_IEEE = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def _largest(g) -> jax.Array:
    """The largest |element| of one gradient as float32, +inf where one is inf or NaN: for an
    IEEE float, computed as ``jaxamp.loss_scaled`` checks each gradient's finiteness (its
    integer maximum of the magnitudes' bits), so the program holds that reduction once."""
    if g.dtype in _IEEE:
        return largest_magnitude(g).astype(jnp.float32)
    return jnp.max(jnp.abs(g.astype(jnp.float32)))


def observed(grad_fn: Callable, *, max_scaled_grad: bool = True) -> Callable:
    """`grad_fn` (``jaxamp.value_and_grad``'s) whose value comes with the gradient signals:
    ``(value, {"grad_norm", "max_scaled_grad"})``, the gradients unchanged.

    ``grad_norm`` is the global norm of the unscaled gradients (as the loss-scaled optimizer
    hands them to the optimizer inside it: before clipping; inf where they overflowed);
    ``max_scaled_grad`` maps each parameter's path to its largest |scaled gradient| (what
    float16 had to hold; inf where it did not, NaN counted as inf): the maximum the
    loss-scaled optimizer's finiteness check takes of the same gradients (`_largest`), which
    XLA then computes once for both. ``max_scaled_grad=False`` leaves it out (a run without
    loss scaling records none).
    """

    def wrapped(params, *batch, loss_scale):
        value, grads = grad_fn(params, *batch, loss_scale=loss_scale)
        signals = {"grad_norm": _norm(_unscaled(grads, loss_scale))}
        if max_scaled_grad:
            signals["max_scaled_grad"] = {
                _path(path): _largest(g)
                for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
                if g.size
            }
        return (value, signals), grads

    return wrapped


def observed_step(
    grad_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    feed_lr: bool = True,
    max_scaled_grad: bool = True,
) -> Callable:
    """`scheduled` `jax_train_step` with the gradient signals: the step of the trainer.

    Metrics: ``loss_scale``, ``skipped``, ``grad_norm`` (unscaled, before clipping),
    ``update_norm`` (``||params after - params before||``) and, with `max_scaled_grad` (the
    run's loss is scaled: `step_signals` records it), ``max_scaled_grad``.
    """
    step = jax_train_step(observed(grad_fn, max_scaled_grad=max_scaled_grad), tx)
    return scheduled(step, signals=True, feed_lr=feed_lr)


def _finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def step_signals(metrics: dict, scaled: bool) -> dict[str, Any]:
    """A step's signals for its record (JSON: None where not finite): ``grad_norm``,
    ``update_norm`` and, where the loss is scaled, ``max_scaled_grad`` ({parameter: value})."""
    out: dict[str, Any] = {
        "grad_norm": _finite(metrics["grad_norm"]),
        "update_norm": _finite(metrics["update_norm"]),
    }
    if scaled:
        out["max_scaled_grad"] = {k: _finite(v) for k, v in metrics["max_scaled_grad"].items()}
    return out


def jax_forward(pair: Any, recipe: Any, device: str, *, train: bool, arm: str = "single"):
    """``forward(params, batch_stats, inputs) -> (logits, new_stats)`` of `pair`'s Flax model at
    the recipe's precision (the one JAX forward of the harness; the loss stays outside)."""

    def forward(params, batch_stats, inputs):
        variables = {"params": params}
        if batch_stats is not None:
            variables["batch_stats"] = batch_stats
        return pair.flax_apply(variables, inputs, train=train)

    return recipe.jax_forward(forward, device, arm)


class ClipState(NamedTuple):
    """Stateless."""


def clip_by_global_norm_torch(max_norm: float) -> optax.GradientTransformation:
    """Global-norm clipping with torch's exact formula.

    ``torch.nn.utils.clip_grad_norm_`` multiplies by ``min(max_norm / (norm + 1e-6), 1)``;
    ``optax.clip_by_global_norm`` has no 1e-6, which would move fp32 runs apart by ~1e-6 per step.
    """

    def init(params):
        del params
        return ClipState()

    def update(updates, state, params=None):
        del params
        leaves = jax.tree_util.tree_leaves(updates)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))
        coef = jnp.minimum(jnp.float32(max_norm) / (norm + jnp.float32(1e-6)), jnp.float32(1.0))
        # torch multiplies a low-precision gradient by the float32 coefficient in float32 (its
        # op math for a scalar operand), then rounds back to the gradient's dtype
        scaled = jax.tree_util.tree_map(
            lambda x: (x.astype(jnp.float32) * coef).astype(x.dtype), updates
        )
        return scaled, state

    return optax.GradientTransformation(init, update)


def _sgd(learning_rate, momentum, weight_decay):
    # torch.optim.SGD's weight_decay is L2 added to the gradient before momentum.
    return optax.chain(
        optax.add_decayed_weights(weight_decay),
        optax.sgd(learning_rate, momentum=momentum),
    )


def _optax_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` (optax's own transformations) traced under JAX's standard dtype promotion, whatever
    the caller's ``jax_numpy_dtype_promotion``: optax computes Adam's bias correction as a
    Python float to the power of its int32 step count, which strict promotion refuses, and a
    user's training runs optax under the default. The harness's own step around it (clipping,
    the recipe's loss scaling, the forward pass) keeps the caller's mode."""

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates, state, params=None, **extra_args):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


def build_jax_optimizer(
    config: Any, axis_name: str | None = None, pair: Any = None
) -> optax.GradientTransformation:
    """The optax twin of `build_torch_optimizer`, clipped, wrapped by the recipe
    (``jaxamp.loss_scaled``; `axis_name` for a step inside ``shard_map``). `pair` is the run's
    `parity.models.ModelPair` (built-in or the user's), for recipes whose optimizer depends on
    the model (the low-bit AdamW states take each torch tensor's block order from its mapping).

    The learning rate is injected (``optax.inject_hyperparams``) so the host-computed rate of
    each iteration is fed in; the other hyperparameters stay static Python floats (as float32
    arrays they would promote bf16-true optimizer state to float32).
    """
    if config.optimizer == "adamw":
        inner = _optax_promotion(
            optax.inject_hyperparams(
                optax.adamw,
                static_args=("b1", "b2", "eps", "weight_decay"),
                hyperparam_dtype=jnp.float32,
            )(
                learning_rate=config.lr,
                b1=config.betas[0],
                b2=config.betas[1],
                eps=config.eps,
                weight_decay=config.weight_decay,
            )
        )
    else:
        inner = _optax_promotion(
            optax.inject_hyperparams(
                _sgd, static_args=("momentum", "weight_decay"), hyperparam_dtype=jnp.float32
            )(learning_rate=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
        )
    if config.clip_norm is not None:
        inner = optax.chain(clip_by_global_norm_torch(config.clip_norm), inner)
    return config.recipe.jax_optimizer(inner, config, axis_name, pair=pair)


def _is_inject_state(x) -> bool:
    return isinstance(x, optax.InjectStatefulHyperparamsState | optax.InjectHyperparamsState)


def set_learning_rate(opt_state, learning_rate):
    """`opt_state` with the injected learning rate replaced (in-graph; no retrace)."""

    def replace(x):
        if _is_inject_state(x):
            hyper = dict(x.hyperparams)
            hyper["learning_rate"] = jnp.asarray(learning_rate, jnp.float32)
            return x._replace(hyperparams=hyper)
        return x

    return jax.tree_util.tree_map(replace, opt_state, is_leaf=_is_inject_state)


# -- torch ---------------------------------------------------------------------------------------


def build_torch_optimizer(config: Any, params) -> Any:
    """AdamW or momentum SGD with the run's hyperparameters (foreach off: one code path), or the
    recipe's own optimizer (`Recipe.torch_optimizer`: torchao's low-bit AdamW...)."""
    import torch  # torch: optional for JAX users (the JAX trainer never imports it)

    params = list(params)
    own = config.recipe.torch_optimizer(config, params)
    if own is not None:
        return own
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    return torch.optim.SGD(
        params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )


def torch_train_step(
    config: Any,
    forward_loss: Callable,
    optimizer: Any,
    scaler: Any,
    params: list,
    names: list[str] | None = None,
    loop: Any = None,
    scheduler: Any = None,
) -> Callable:
    """torch.amp's step: ``step(index, *batch) -> loss``.

    Args:
      config: the run (learning rate schedule, clipping).
      forward_loss: ``forward_loss(*batch) -> loss``, run inside the recipe's autocast.
      optimizer: `build_torch_optimizer`'s optimizer.
      scaler: the recipe's ``GradScaler`` (`Recipe.torch_grad_scaler`) or None.
      params: the parameters clipped (``clip_grad_norm_`` after ``unscale_``).
      names: the parameters' names: the step then measures, into ``step.signals`` (the last
        step's, as `step_signals` gives JAX's), ``grad_norm`` (unscaled, before clipping),
        ``update_norm`` and, with a scaler, ``max_scaled_grad`` ({name: largest |scaled
        gradient|}, None where not finite).
      loop: the user's `parity.training.user_loop.TrainingLoop` with an optimizer: its
        clipping replaces the run's, its `scheduler` is stepped after the optimizer, and the
        run's learning rate is not written into the param groups.
      scheduler: the user's torch scheduler (with `loop`).
    """
    import torch  # torch: optional for JAX users (the JAX trainer never imports it)

    def clip():
        if loop is not None:
            loop.clip_torch(params)
        elif config.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, config.clip_norm)

    def finite(values) -> list[float | None]:
        return [x if math.isfinite(x) else None for x in values]

    def whole(x):
        # FSDP2 shards parameters and gradients (DTensor): a per-shard max or sum is reduced
        # over the ranks, so every rank records the whole model's figure, as DDP's ranks do.
        return x.full_tensor() if hasattr(x, "full_tensor") else x

    def observe_scaled() -> None:
        if names is not None:
            grads = [p.grad for p in params]
            maxima = torch.stack(
                [
                    whole(g.detach().abs().max()).float() if g is not None else torch.zeros(())
                    for g in grads
                ]
            )
            step.signals["max_scaled_grad"] = dict(zip(names, finite(maxima.tolist()), strict=True))

    def observe_unscaled() -> list | None:
        if names is None:
            return None
        grads = [p.grad.detach().float() for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(
            torch.stack([whole(torch.linalg.vector_norm(g)) for g in grads])
        )
        step.signals["grad_norm"] = finite([float(norm)])[0]
        return [p.detach().clone() for p in params]

    def observe_update(before) -> None:
        if before is not None:
            with torch.no_grad():
                squares = [
                    whole(torch.sum(torch.square(p.detach().float() - b.float())))
                    for p, b in zip(params, before, strict=True)
                ]
            step.signals["update_norm"] = finite([float(torch.sqrt(torch.stack(squares).sum()))])[0]

    def step(index, *batch):
        # The rate of every iteration (what LambdaLR does, without its warning when GradScaler
        # skips step 0).
        for group in optimizer.param_groups if loop is None else ():
            if isinstance(group["lr"], torch.Tensor):  # torchao keeps it a tensor (in place)
                group["lr"].fill_(config.lr_at(index))
            else:
                group["lr"] = config.lr_at(index)
        optimizer.zero_grad(set_to_none=True)
        loss = forward_loss(*batch)
        if scaler is None:
            loss.backward()
            before = observe_unscaled()
            clip()
            optimizer.step()
            if loop is not None:
                loop.step_scheduler(scheduler)
            observe_update(before)
            return loss
        scaler.scale(loss).backward()
        observe_scaled()
        scaler.unscale_(optimizer)  # clip the true gradients
        before = observe_unscaled()
        clip()
        scaler.step(optimizer)
        scaler.update()
        if loop is not None:
            loop.step_scheduler(scheduler)
        observe_update(before)
        return loss

    step.signals = {}
    return step
