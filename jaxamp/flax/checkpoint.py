"""orbax checkpoints of a full mixed-precision training state, loss scale included.

`save(directory, target, step)` writes every array leaf of `target` — a linen `TrainState`, any
pytree, or NNX modules/optimizers (their `nnx.state`) — keyed by its path, plus a JSON record of
the loss-scaling setup (where `loss_scaled` states sit, the loss scale's type and
hyperparameters, the policy) and the format of each quantized optimizer-state leaf.
`restore(directory, target)` reads it back into `target`'s structure and shardings, refusing a
leaf of another shape, dtype or format (nothing is cast); values come back bit for bit, so a
restored run continues exactly as the uninterrupted one would, skip decisions included (the
loss scale and its growth counter are state).

Restoring into a target whose loss scaling differs from the checkpoint's (saved without
`loss_scaled`, restored into a run with it; the reverse; another loss-scale type or other
hyperparameters) raises `ValueError` by default. With ``on_loss_scale_mismatch="reset"`` everything
else is restored and the loss-scaling state (scale, growth/hysteresis counters, skip counters)
is the target's own, fresh one — the documented reset. A checkpoint never loads partially: any
other missing or unexpected leaf is a `ValueError`, except the overflow record of
``loss_scaled(..., provenance=True)`` (it describes the last step only): restored where both sides
have it, else the target keeps its own, so a run can be restarted with provenance switched.

orbax-checkpoint is imported lazily (it is in the ``dev`` and ``parity`` extras).

Examples:
  >>> import os
  >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
  >>> state = {"params": {"w": jnp.ones(2)}, "opt": tx.init({"w": jnp.ones(2)})}
  >>> jf.checkpoint.save(os.path.abspath("ckpt"), state, step=1)
  >>> restored = jf.checkpoint.restore(os.path.abspath("ckpt"), state)
  >>> float(jaxamp.get_loss_scale(restored["opt"]).loss_scale)
  65536.0
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Literal

import jax
import numpy as np

from jaxamp._loss_scaled_state import LossScaledState
from jaxamp.optim_precision import QuantizedArray

__all__ = ["save", "restore", "latest_step", "all_steps", "amp_metadata"]

_FORMAT = 1
OnMismatch = Literal["error", "reset"]


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "jaxamp.flax.checkpoint needs orbax-checkpoint: pip install orbax-checkpoint "
            "(it is in jaxamp's 'dev' and 'parity' extras)."
        ) from e
    return ocp


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path(parts: Any) -> tuple[str, ...]:
    return tuple(_key_name(k) for k in parts)


def _is_nnx(target: Any) -> bool:
    from flax import nnx

    leaves = target if isinstance(target, (tuple, list)) else (target,)
    return bool(leaves) and all(isinstance(x, (nnx.Module, nnx.Optimizer)) for x in leaves)


def _as_tree(target: Any) -> Any:
    if _is_nnx(target):
        from flax import nnx

        return nnx.as_pure(nnx.state(target))
    return target


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[_path(path)] = leaf
    return out


def _dtype_name(leaf: Any) -> str:
    dtype = getattr(leaf, "dtype", None)
    return str(dtype if dtype is not None else np.asarray(leaf).dtype)


def _formats(tree: Any) -> dict[str, dict[str, Any]]:
    """The format of every quantized optimizer-state leaf (`QuantizedArray`) in `tree`, keyed
    by its path: what its codes mean beyond their dtype and shape (JSON-serialisable)."""
    out = {}
    is_quantized = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]:
        if not is_quantized(node):
            continue
        order = None
        if node.order is not None:
            order = hashlib.sha256(np.asarray(node.order.order).tobytes()).hexdigest()[:16]
        out["/".join(_path(path))] = {
            "format": node.state_format,
            "signed": bool(node.signed),
            "shape": [int(n) for n in node.shape],
            "block_size": int(node.block_size),
            "block_order": order,
        }
    return out


def _show_format(fmt: dict[str, Any]) -> str:
    order = fmt["block_order"]
    return (
        f"{fmt['format']} {'signed' if fmt['signed'] else 'unsigned'} codes of shape "
        f"{tuple(fmt['shape'])}, blocks of {fmt['block_size']}, "
        + ("row-major blocks" if order is None else f"block order {order}")
    )


def _describe_scale(scale: Any) -> dict[str, Any]:
    kind = type(scale).__name__
    config = {}
    if dataclasses.is_dataclass(scale):
        for field in dataclasses.fields(scale):
            value = getattr(scale, field.name)
            if isinstance(value, (int, float, str, bool)) or value is None:
                config[field.name] = value
    return {"type": kind, "config": config}


def _loss_scaled_states(target: Any) -> list[tuple[tuple[str, ...], LossScaledState]]:
    """Every `loss_scaled` state in `target`, with its path in `_as_tree(target)`."""

    def find(tree, prefix):
        found = []
        is_state = lambda x: isinstance(x, LossScaledState)  # noqa: E731
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_state):
            if is_state(leaf):
                found.append((prefix + _path(path), leaf))
        return found

    if not _is_nnx(target):
        return find(target, ())
    from flax import nnx

    found = []
    for path, node in nnx.iter_graph(target):
        if isinstance(node, nnx.Optimizer):
            prefix = tuple(str(p) for p in path) + ("opt_state",)
            found.extend(find(nnx.as_pure(node.opt_state), prefix))
    return found


def amp_metadata(target: Any, policy: Any = None) -> dict[str, Any]:
    """The loss-scaling record `save` writes next to the arrays (JSON-serialisable).

    Examples:
      >>> state = {"opt": jaxamp.loss_scaled(optax.sgd(0.1)).init({"w": jnp.ones(2)})}
      >>> meta = jf.checkpoint.amp_metadata(state, policy="fp16-mixed")
      >>> [entry["type"] for entry in meta["loss_scaled"]], meta["loss_scaled"][0]["path"]
      (['DynamicLossScale'], ['opt'])
    """
    if policy is None:
        policy = getattr(target, "policy", None)
    return {
        "format": _FORMAT,
        "policy": None if policy is None else str(policy),
        "loss_scaled": [
            {"path": list(path), **_describe_scale(state.loss_scale)}
            for path, state in _loss_scaled_states(target)
        ],
    }


def _manager(directory: str | os.PathLike, max_to_keep: int | None, create: bool):
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create)
    return ocp.CheckpointManager(
        os.fspath(os.path.abspath(directory)), options=options, item_names=("state", "amp")
    )


def _nest(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1] if path else "_"] = leaf
    return root


def _unnest(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_unnest(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def save(
    directory: str | os.PathLike,
    target: Any,
    step: int,
    *,
    max_to_keep: int | None = None,
    policy: Any = None,
) -> None:
    """Saves `target` (all its array leaves) and its loss-scaling record at `step`.

    Args:
      directory: the checkpoint directory (created if needed); steps are subfolders.
      target: a linen `TrainState`, any pytree of arrays, or an NNX module/optimizer or a tuple
        of them (``(model, optimizer)``).
      step: the step number (an int >= 0).
      max_to_keep: keep only the newest this many checkpoints (None: all).
      policy: recorded in the metadata (default: ``target.policy`` if there is one).

    Raises:
      ValueError: `step` is not an int >= 0, or a checkpoint for `step` exists already.

    Examples:
      >>> import os
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
      >>> state = {"params": {"w": jnp.ones(2)}, "opt": tx.init({"w": jnp.ones(2)})}
      >>> jf.checkpoint.save(os.path.abspath("ckpt"), state, step=1)
      >>> restored = jf.checkpoint.restore(os.path.abspath("ckpt"), state)
      >>> float(jaxamp.get_loss_scale(restored["opt"]).loss_scale)
      65536.0
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"save(step=...) takes an int >= 0; got {step!r}.")
    ocp = _ocp()
    flat = _flat(_as_tree(target))
    meta = amp_metadata(target, policy)
    meta["leaves"] = {
        "/".join(path): [list(np.shape(leaf)), _dtype_name(leaf)] for path, leaf in flat.items()
    }
    meta["formats"] = _formats(_as_tree(target))
    manager = _manager(directory, max_to_keep, create=True)
    if int(step) in manager.all_steps():
        manager.close()
        raise ValueError(
            f"save(step={step}): a checkpoint for step {step} already exists in {directory}."
        )
    manager.save(
        int(step),
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(_nest(flat)), amp=ocp.args.JsonSave(meta)
        ),
    )
    manager.wait_until_finished()
    manager.close()


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest saved step in `directory`, or None.

    Examples:
      >>> import os
      >>> state = {"w": jnp.ones(2)}
      >>> for step in (1, 5):
      ...     jf.checkpoint.save(os.path.abspath("ckpt"), state, step=step)
      >>> jf.checkpoint.latest_step(os.path.abspath("ckpt")), jf.checkpoint.latest_step("missing")
      (5, None)
    """
    manager = _manager(directory, None, create=False)
    try:
        return manager.latest_step()
    finally:
        manager.close()


def all_steps(directory: str | os.PathLike) -> list[int]:
    """All saved steps in `directory`, ascending.

    Examples:
      >>> import os
      >>> for step in (1, 5):
      ...     jf.checkpoint.save(os.path.abspath("ckpt"), {"w": jnp.ones(2)}, step=step)
      >>> jf.checkpoint.all_steps(os.path.abspath("ckpt"))
      [1, 5]
    """
    manager = _manager(directory, None, create=False)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def _signature(entries: list[dict[str, Any]]) -> dict[tuple[str, ...], tuple[str, dict]]:
    return {tuple(e["path"]): (e["type"], e["config"]) for e in entries}


def _mismatch_message(saved: dict, wanted: dict, directory: Any, step: int) -> str | None:
    saved_sig, wanted_sig = _signature(saved["loss_scaled"]), _signature(wanted["loss_scaled"])
    if saved_sig == wanted_sig:
        return None

    def show(sig):
        if not sig:
            return "no loss scaling (no jaxamp.loss_scaled optimizer)"
        return "; ".join(f"{'/'.join(p) or '<top>'}: {t} {c}" for p, (t, c) in sig.items())

    return (
        f"restore({directory!s}, step={step}): the checkpoint was saved with {show(saved_sig)}, "
        f"but the target has {show(wanted_sig)}. Build the target with the same loss scaling "
        "to continue the run exactly, or pass on_loss_scale_mismatch='reset' to restore "
        "everything else and start the target's own loss scale and skip counters afresh."
    )


def _starts(path: tuple[str, ...], prefix: tuple[str, ...]) -> bool:
    return path[: len(prefix)] == prefix


def _in_overflow_record(path: tuple[str, ...], amp_paths: list[tuple[str, ...]]) -> bool:
    """Whether `path` lies in the `overflow` field of a loss-scaled state at one of `amp_paths`."""
    return any(_starts(path, a) and path[len(a) : len(a) + 1] == ("overflow",) for a in amp_paths)


def _source_key(
    path: tuple[str, ...],
    saved_amp: list[tuple[str, ...]],
    wanted_amp: list[tuple[str, ...]],
) -> tuple[str, ...] | None:
    """Where a target leaf comes from under a reset (None: keep the target's value)."""
    for prefix in wanted_amp:
        if _starts(path, prefix):
            rest = path[len(prefix) :]
            if rest[:1] != ("inner_state",):
                return None  # loss scale and skip counters: the target's fresh ones
            if prefix in saved_amp:
                return path
            return prefix + rest[1:]  # the checkpoint had a plain optimizer here
    for prefix in saved_amp:
        if _starts(path, prefix):
            return prefix + ("inner_state",) + path[len(prefix) :]
    return path


def restore(
    directory: str | os.PathLike,
    target: Any,
    step: int | None = None,
    *,
    on_loss_scale_mismatch: OnMismatch = "error",
) -> Any:
    """Restores a checkpoint into `target`'s structure.

    Args:
      directory: the directory given to `save`.
      target: a state of the same structure (e.g. freshly created with the same config): its
        leaves give the shardings, and their shapes, dtypes and formats must be the
        checkpoint's. NNX modules/optimizers are updated in place.
      step: which step (default: the newest).
      on_loss_scale_mismatch: "error" (default) raises `ValueError` when the checkpoint's loss
        scaling differs from the target's; "reset" restores everything else and keeps the
        target's loss-scaling state (scale, counters) as it is.

    Returns:
      The restored state (for NNX: `target`, updated in place).

    Raises:
      ValueError: no checkpoint; a checkpoint `save` did not write (no loss-scaling record:
        a plain orbax checkpoint) or of another format version; loss scaling differs (with
        "error"); leaves are missing, unexpected, of another shape or of another dtype (a
        leaf is never cast), or quantized optimizer state of another format (codes,
        signedness, block size, block order): the message names each leaf, what the
        checkpoint holds and what the target expects.

    Examples:
      >>> import os
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
      >>> state = {"params": {"w": jnp.ones(2)}, "opt": tx.init({"w": jnp.ones(2)})}
      >>> jf.checkpoint.save(os.path.abspath("ckpt"), state, step=1)
      >>> restored = jf.checkpoint.restore(os.path.abspath("ckpt"), state)
      >>> float(jaxamp.get_loss_scale(restored["opt"]).loss_scale)
      65536.0
    """
    if on_loss_scale_mismatch not in ("error", "reset"):
        raise ValueError(
            f"on_loss_scale_mismatch must be 'error' or 'reset'; got {on_loss_scale_mismatch!r}."
        )
    ocp = _ocp()
    manager = _manager(directory, None, create=False)
    try:
        if step is None:
            step = manager.latest_step()
            if step is None:
                raise ValueError(f"restore: no checkpoint found in {directory}.")
        elif int(step) not in manager.all_steps():
            raise ValueError(
                f"restore(step={step}): no such checkpoint in {directory}; saved steps are "
                f"{sorted(manager.all_steps())}."
            )
        _check_amp_item(directory, step)
        saved = _read(
            manager, step, ocp.args.Composite(amp=ocp.args.JsonRestore()), "amp", directory
        )
        _check_record(saved, directory, step)
        wanted = amp_metadata(target)
        message = _mismatch_message(saved, wanted, directory, step)
        if message is not None and on_loss_scale_mismatch == "error":
            raise ValueError(message)

        tree = _as_tree(target)
        target_flat = _flat(tree)
        saved_leaves = {tuple(k.split("/")) if k else (): v for k, v in saved["leaves"].items()}
        saved_amp = [tuple(e["path"]) for e in saved["loss_scaled"]]
        wanted_amp = [tuple(e["path"]) for e in wanted["loss_scaled"]]
        if message is None:
            # The overflow record of loss_scaled(provenance=True) describes the last step
            # only: a checkpoint without it restores into a target with it (which keeps its
            # fresh record), and the other way round.
            sources = {
                path: None
                if path not in saved_leaves and _in_overflow_record(path, wanted_amp)
                else path
                for path in target_flat
            }
        else:
            sources = {path: _source_key(path, saved_amp, wanted_amp) for path in target_flat}
        used = {src for src in sources.values() if src is not None}
        missing = sorted("/".join(s) for s in used if s not in saved_leaves)
        ignorable = {p for p in saved_leaves if _in_overflow_record(p, saved_amp)}
        if message is not None:
            ignorable |= {
                p
                for p in saved_leaves
                if any(
                    _starts(p, a) and p[len(a) : len(a) + 1] != ("inner_state",) for a in saved_amp
                )
            }
        unexpected = sorted(
            "/".join(p) for p in saved_leaves if p not in used and p not in ignorable
        )
        if missing or unexpected:
            raise ValueError(
                f"restore({directory!s}, step={step}): the checkpoint does not match the "
                f"target (no partial loads). Missing in the checkpoint: {missing[:10]}; in the "
                f"checkpoint but not the target: {unexpected[:10]}."
            )
        problems = _leaf_problems(sources, saved_leaves, target_flat)
        problems += _format_problems(saved, tree, sources)
        if problems:
            raise ValueError(
                f"restore({directory!s}, step={step}): the checkpoint's leaves do not hold "
                f"what the target expects (nothing is cast): {'; '.join(problems[:10])}"
                + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
                + ". Build the target with the configuration the checkpoint was saved with."
            )

        abstract = {}
        default_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        by_source = {src: path for path, src in sources.items() if src is not None}
        for src, (shape, dtype) in saved_leaves.items():
            if src in by_source:
                leaf = target_flat[by_source[src]]
                sharding = getattr(leaf, "sharding", default_sharding)
                leaf_dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
                abstract[src] = jax.ShapeDtypeStruct(
                    tuple(shape), np.dtype(leaf_dtype), sharding=sharding
                )
            else:
                abstract[src] = jax.ShapeDtypeStruct(
                    tuple(shape), _dtype(dtype), sharding=default_sharding
                )
        restored = _read(
            manager,
            step,
            ocp.args.Composite(state=ocp.args.StandardRestore(_nest(abstract))),
            "state",
            directory,
        )
    finally:
        manager.close()
    restored_flat = _unnest(restored) if restored else {}
    if () in abstract:  # a single-leaf target
        restored_flat = {(): restored["_"]}
    new_leaves = []
    for path, leaf in target_flat.items():
        src = sources[path]
        new_leaves.append(leaf if src is None else restored_flat[src])
    new_tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), new_leaves)
    if _is_nnx(target):
        from flax import nnx

        nnx.update(target, new_tree)
        return target
    return new_tree


def _leaf_problems(sources: dict, saved_leaves: dict, target_flat: dict) -> list[str]:
    """Each target leaf whose checkpoint leaf has another shape or dtype, named."""
    problems = []
    for path, src in sources.items():
        if src is None:
            continue
        shape, dtype = saved_leaves[src]
        leaf = target_flat[path]
        name = "/".join(path)
        if tuple(shape) != tuple(np.shape(leaf)):
            problems.append(
                f"leaf {name} has shape {tuple(np.shape(leaf))} in the target but "
                f"{tuple(shape)} in the checkpoint"
            )
        elif _canonical(dtype) != _canonical(_dtype_name(leaf)):
            problems.append(
                f"leaf {name} holds {dtype} in the checkpoint but the target expects "
                f"{_dtype_name(leaf)}"
            )
    return problems


def _canonical(name: str) -> str:
    """The dtype JAX computes in for a recorded dtype name: a Python or NumPy int saved as
    int64 is the int32 a JAX target holds (without x64), not a mismatch."""
    try:
        return str(jax.dtypes.canonicalize_dtype(_dtype(name)))
    except TypeError:  # not a NumPy dtype (e.g. a typed PRNG key): compare the names
        return name


def _format_problems(saved: dict, tree: Any, sources: dict) -> list[str]:
    """Each quantized target leaf whose checkpoint codes have another format, named.

    Checkpoints written before `save` recorded formats carry none: their codes are checked by
    dtype and shape only."""
    if not isinstance(saved.get("formats"), dict):
        return []
    problems = []
    for name, wanted in _formats(tree).items():
        path = tuple(name.split("/")) if name else ()
        src = sources.get(path + ("codes",))
        if src is None:
            continue
        held = saved["formats"].get("/".join(src[:-1]))
        if held != json.loads(json.dumps(wanted)):
            shown = "no quantized leaf" if not isinstance(held, dict) else _show_format(held)
            problems.append(
                f"leaf {name}: {shown} in the checkpoint, but the target expects "
                f"{_show_format(wanted)}"
            )
    return problems


def _dtype(name: str) -> np.dtype:
    import jax.numpy as jnp

    return np.dtype(getattr(jnp, name)) if hasattr(jnp, name) else np.dtype(name)


def _item_path(directory: Any, step: int, item: str) -> str:
    return os.path.join(os.path.abspath(os.fspath(directory)), str(step), item)


def _read(manager: Any, step: int, args: Any, item: str, directory: Any) -> Any:
    """One item of a checkpoint; a corrupted or unreadable file is a `ValueError` naming it."""
    try:
        return manager.restore(step, args=args)[item]
    except Exception as e:  # orbax/tensorstore raise many types for damaged files
        error = e
    raise ValueError(
        f"restore({directory!s}, step={step}): the checkpoint file(s) at "
        f"{_item_path(directory, step, item)} are corrupted or unreadable "
        f"({type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}). "
        "Restore another step (jaxamp.flax.checkpoint.all_steps) or re-save."
    ) from error


def _check_amp_item(directory: Any, step: int) -> None:
    """Refuses a step folder without the loss-scaling record: a checkpoint `save` did not write."""
    step_dir = os.path.dirname(_item_path(directory, step, "amp"))
    if os.path.isdir(os.path.join(step_dir, "amp")):
        return
    items = sorted(
        name
        for name in (os.listdir(step_dir) if os.path.isdir(step_dir) else [])
        if os.path.isdir(os.path.join(step_dir, name))
    )
    found = f"the items {items}" if items else "no checkpoint items"
    raise ValueError(
        f"restore({directory!s}, step={step}): {step_dir} holds {found} and no 'amp' item, so it "
        "is not a checkpoint jaxamp.flax.checkpoint.save wrote: that writes two items, 'state' "
        "(the arrays) and 'amp' (the loss-scaling record restore checks the target against). "
        "Restore a plain orbax checkpoint with orbax itself (ocp.CheckpointManager(...).restore), "
        "then save it once with jaxamp.flax.checkpoint.save."
    )


def _check_format(saved: dict, path: str, directory: Any, step: int) -> None:
    """Refuses a record of another format version (or none), naming what it found."""
    if "format" not in saved:
        found = "has no 'format' field"
    else:
        version = saved["format"]
        if isinstance(version, int) and not isinstance(version, bool) and version == _FORMAT:
            return
        found = f"says format {version!r}"
    raise ValueError(
        f"restore({directory!s}, step={step}): the loss-scaling record {path} {found}; this "
        f"version of jaxamp reads format {_FORMAT} only (what jaxamp.flax.checkpoint.save "
        "writes). Restore it with the jaxamp that wrote it, or re-save the state with this one."
    )


def _check_record(saved: Any, directory: Any, step: int) -> None:
    """The JSON record `save` writes: a dict of a known format with the keys `restore` reads."""
    path = os.path.join(_item_path(directory, step, "amp"), "metadata")
    if isinstance(saved, dict):
        _check_format(saved, path, directory, step)
    problem = _record_problem(saved)
    if problem is not None:
        raise ValueError(
            f"restore({directory!s}, step={step}): the loss-scaling record {path} is corrupted: "
            f"{problem}. Restore another step or re-save."
        )


def _record_problem(saved: Any) -> str | None:
    if not isinstance(saved, dict):
        return f"it holds a {type(saved).__name__}, not a JSON object"
    if not isinstance(saved.get("leaves"), dict):
        return "its 'leaves' entry is missing or not an object"
    if not isinstance(saved.get("loss_scaled"), list) or not all(
        isinstance(e, dict) and {"path", "type", "config"} <= set(e) for e in saved["loss_scaled"]
    ):
        return "its 'loss_scaled' entry is missing or malformed"
    for name, entry in saved["leaves"].items():
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], list)
            and isinstance(entry[1], str)
        ):
            return f"leaf {name!r} has no [shape, dtype] record"
    formats = saved.get("formats", {})
    keys = {"format", "signed", "shape", "block_size", "block_order"}
    if not isinstance(formats, dict) or not all(
        isinstance(f, dict) and keys <= set(f) for f in formats.values()
    ):
        return "its 'formats' entry is malformed"
    return None
