"""`low_precision_state`: an optax optimizer whose chosen state leaves are kept in bf16, fp8 or
8-/4-bit block-wise codes, dequantized inside `update`; torchao's AdamW8bit/4bit/Fp8 as optax."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._optim import LossScaledTransformation
from jaxamp.optim_precision._codecs import (
    BLOCK_FORMATS,
    STATE_FORMATS,
    BlockOrder,
    QuantizedArray,
    _check_block_size,
    _unknown_format,
    decode_blockwise,
    encode_blockwise,
)

__all__ = [
    "LowPrecisionState",
    "adamw_4bit",
    "adamw_8bit",
    "adamw_fp8",
    "low_precision_state",
    "state_bytes",
]

# torchao and bitsandbytes quantize a state tensor only from this many elements on.
DEFAULT_MIN_SIZE = 4096


class LowPrecisionState(NamedTuple):
    """State of `low_precision_state`.

    Attributes:
      inner_state: the wrapped optimizer's state, its chosen leaves replaced by
        `QuantizedArray` codes (block formats) or bfloat16 arrays (``"bf16"``); every other
        leaf as the wrapped optimizer made it.

    Examples:
      >>> tx = jaxamp.optim_precision.low_precision_state(optax.adam(1e-3), "8bit")
      >>> state = tx.init({"w": jnp.zeros((64, 64))})
      >>> type(state.inner_state[0].mu["w"]).__name__, state.inner_state[0].mu["w"].codes.dtype
      ('QuantizedArray', dtype('uint8'))
    """

    inner_state: optax.OptState


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def _is_float_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)


def _field_names(path) -> list[str]:
    # Only attribute keys (NamedTuple and dataclass fields) name state fields; dict keys are the
    # parameter names inside them (a parameter called "mu" must not be selected).
    return [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]


def to_compute(tree: Any, *, decode: bool = True) -> Any:
    """Float32 values of a state or update tree: codes dequantized (unless not `decode`: a
    wrapper around `low_precision_state` leaves its codes to it), narrow floating leaves upcast
    (torchao computes every step in float32); other leaves as they are."""

    def up(x):
        if _is_quantized(x):
            return decode_blockwise(x) if decode else x
        if _is_float_array(x) and jnp.dtype(x.dtype).itemsize < 4:
            return x.astype(jnp.float32)
        return x

    return jax.tree_util.tree_map(up, tree, is_leaf=_is_quantized)


def like_stored(new: Any, stored: Any) -> Any:
    """`new` (float32 compute values) back in `stored`'s storage: re-encoded where `stored` holds
    codes, cast to the stored dtype elsewhere (so the state's types never drift step to step)."""

    def down(old, value):
        if _is_quantized(value):  # encoded already, by a low_precision_state inside
            return value
        if _is_quantized(old):
            return encode_blockwise(
                value,
                old.state_format,
                signed=old.signed,
                block_size=old.block_size,
                order=old.order,
            )
        if _is_float_array(old) and value.dtype != old.dtype:
            return value.astype(old.dtype)
        return value

    return jax.tree_util.tree_map(down, stored, new, is_leaf=_is_quantized)


def low_precision_state(
    inner: optax.GradientTransformation,
    state_format: str,
    *,
    fields: Iterable[str] = ("mu", "nu"),
    unsigned: Iterable[str] = ("nu",),
    block_size: int | None = None,
    min_size: int | None = None,
    block_order: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Keeps chosen leaves of `inner`'s state in a narrower format, dequantized inside `update`.

    Each step decodes the stored state to float32, runs `inner` in float32 on float32 gradients
    and parameters (the moments and the update of this step are exact float32, as torchao's
    ``single_param_adam`` computes them), and stores the new state back in its formats. The
    codes of the block formats equal torchao's bit for bit after a step from zeros (the
    first step); after that, optax's moment EMA ``(1 - b) * g + b * m`` and torch's
    ``lerp`` round differently in the last bit, so codes can differ by one level at a
    rounding boundary (torchao's own compiled and eager steps differ the same way).

    Compose it inside `jaxamp.loss_scaled` (a skipped step then keeps the codes bit for bit),
    and inside `jaxamp.multi_steps` or `optax.MultiSteps`; codes of 8-bit and fp8 leaves have
    the parameter's shape, so they shard like it.

    Args:
      inner: the optax optimizer, e.g. ``optax.adamw(1e-3)``.
      state_format: ``"bf16"`` (round to nearest), ``"fp8"`` (``float8_e4m3fn`` codes with a
        scale per block), ``"8bit"`` or ``"4bit"`` (block-wise codes into torchao's maps).
      fields: names of the state fields to store narrowly (``NamedTuple`` attributes anywhere in
        `inner`'s state: ``mu`` and ``nu`` of ``optax.scale_by_adam``, ``trace`` of
        ``optax.trace``...). At least one must exist in the state.
      unsigned: which of `fields` never hold negative values (second moments): they use the
        unsigned map, as torchao's ``exp_avg_sq``.
      block_size: elements per scale (block formats); default torchao's: 256 (``"8bit"``,
        ``"fp8"``), 128 (``"4bit"``).
      min_size: leaves with fewer elements, or whose size is not a multiple of `block_size`,
        stay in their own dtype, as in torchao (bitsandbytes' rule); default 4096 for the block
        formats, 0 for ``"bf16"``.
      block_order: the element order each parameter's state is blocked in (block formats): a
        pytree with the parameters' structure whose leaves are None (row-major) or a
        permutation of ``range(leaf.size)`` (an integer array or a `BlockOrder`; see
        `BlockOrder`). A Flax model whose twin is a torch model gives each kernel torch's
        order, so that blocks hold the elements torchao's hold (a ``Dense`` kernel ``k``:
        ``np.arange(k.size).reshape(k.shape).T.reshape(-1)``). Default: row-major throughout.

    Returns:
      A `GradientTransformationExtraArgs`; its state is a `LowPrecisionState`. Updates have the
      gradients' dtypes.

    Raises:
      ValueError: an unknown `state_format` (with the closest name), a bad `block_size` or
        `min_size`, a `block_order` with the bf16 format or whose leaf is not a permutation,
        or (at ``init``) `fields` naming no leaf of `inner`'s state, or a `block_order` whose
        structure or sizes differ from the parameters' (names the parameter and the closest
        valid name).

    Examples:
      >>> tx = jaxamp.loss_scaled(jaxamp.optim_precision.low_precision_state(optax.adamw(1e-3), "8bit"))
      >>> params = {"w": jnp.ones((64, 64))}
      >>> opt_state = tx.init(params)
      >>> update = jax.jit(tx.update)
      >>> updates, opt_state = update({"w": jnp.full((64, 64), 65536.0)}, opt_state, params)
      >>> round(float(updates["w"][0, 0]), 6)  # Adam's first step: -lr * sign(grad)
      -0.001
      >>> jaxamp.optim_precision.state_bytes(opt_state) / 4096  # bytes per parameter
      2.0...

    References:
      Dettmers et al., 8-bit Optimizers via Block-wise Quantization (2022); Li et al., Memory
      Efficient Optimizers with 4-bit States (2023); torchao ``torchao/optim``.
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "low_precision_state(inner=...) takes an optax GradientTransformation (e.g. "
            f"optax.adamw(1e-3)); got {type(inner).__name__} {inner!r}."
        )
    if isinstance(inner, LossScaledTransformation):
        raise ValueError(
            "low_precision_state(inner=loss_scaled(...)): put loss_scaled outside, "
            "loss_scaled(low_precision_state(...)), so that a skipped step keeps the codes "
            "bit for bit instead of re-encoding decoded values."
        )
    if state_format not in STATE_FORMATS:
        raise ValueError(_unknown_format("low_precision_state", state_format, STATE_FORMATS))
    fields = _names("fields", fields)
    unsigned = _names("unsigned", unsigned)
    if not fields:
        raise ValueError("low_precision_state(fields=()): name at least one state field.")
    block = state_format in BLOCK_FORMATS
    block_size = _check_block_size("low_precision_state", state_format, block_size) if block else 1
    if min_size is None:
        min_size = 4096 if block else 0
    if isinstance(min_size, (bool, np.bool_)) or not isinstance(min_size, (int, np.integer)):
        raise ValueError(f"low_precision_state(min_size={min_size!r}): must be an int >= 0.")
    if min_size < 0:
        raise ValueError(f"low_precision_state(min_size={min_size!r}): must be an int >= 0.")
    orders = _block_orders(block_order)
    if orders and not block:
        raise ValueError(
            f"low_precision_state(state_format={state_format!r}, block_order=...): only the "
            f"block formats ({', '.join(BLOCK_FORMATS)}) have blocks to order."
        )
    inner = optax.with_extra_args_support(inner)

    def encode(path, leaf):
        names = _field_names(path)
        chosen = [n for n in names if n in fields]
        if not chosen or not _is_float_array(leaf):
            return leaf
        size = math.prod(leaf.shape)
        if size < min_size or size % block_size:
            return leaf
        if not block:
            return leaf.astype(jnp.bfloat16)
        order = orders.get(_param_path(path, chosen[-1]))
        if order is not None and order.size != size:
            raise ValueError(
                f"low_precision_state(block_order=...): the order of parameter "
                f"{_path_name(_param_path(path, chosen[-1]))} has {order.size} elements; the "
                f"parameter has {size} (shape {tuple(leaf.shape)})."
            )
        if order is not None and order.is_identity:
            order = None
        return encode_blockwise(
            leaf,
            state_format,
            signed=chosen[-1] not in unsigned,
            block_size=block_size,
            order=order,
        )

    def encode_initial(path, leaf):
        # torchao starts a state from `zeros` (codes 0, scales 0: exactly zero), not from
        # quantizing zeros (scales clipped to 1e-12: the 4-bit unsigned map holds no zero, so
        # the second moment would start at 1/16 * 1e-12 and bend the first update).
        if _is_float_array(leaf):
            # The initial state is a constant: XLA would fold the whole encoding (a gather of
            # every element, with a block order) at compile time, seconds per leaf.
            leaf = jax.lax.optimization_barrier(leaf)
        stored = encode(path, leaf)
        if not isinstance(stored, QuantizedArray):
            return stored
        blocks = jnp.reshape(leaf, -1)
        if stored.order is not None:
            blocks = jnp.take(blocks, jnp.asarray(stored.order.order))
        zero = jnp.all(blocks.reshape(-1, stored.block_size) == 0, axis=-1)
        return dataclasses.replace(stored, scale=jnp.where(zero, 0.0, stored.scale))

    def init(params):
        _check_orders(orders, params)
        inner_state = inner.init(params)
        present = {
            name
            for path, _ in jax.tree_util.tree_flatten_with_path(inner_state)[0]
            for name in _field_names(path)
        }
        if not present & set(fields):
            close = difflib.get_close_matches(fields[0], sorted(present), n=1, cutoff=0.4)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"low_precision_state(fields={fields!r}): no such field in the wrapped "
                f"optimizer's state; its fields are {sorted(present)}.{hint}"
            )
        return LowPrecisionState(jax.tree_util.tree_map_with_path(encode_initial, inner_state))

    def update(updates, state, params=None, **extra_args):
        if not isinstance(state, LowPrecisionState):
            raise TypeError(
                "low_precision_state.update(state=...) takes the LowPrecisionState made by "
                f"init; got {type(state).__name__}."
            )
        new_updates, inner_state = inner.update(
            to_compute(updates),
            to_compute(state.inner_state),
            to_compute(params),
            **extra_args,
        )
        new_updates = jax.tree_util.tree_map(
            lambda u, g: u.astype(g.dtype) if _is_float_array(g) else u, new_updates, updates
        )
        return new_updates, LowPrecisionState(like_stored(inner_state, state.inner_state))

    return optax.GradientTransformationExtraArgs(init, update)


def _key(k: Any) -> Any:
    # One path key as a plain value: a dict key, a sequence index or an attribute name.
    for attribute in ("key", "idx", "name"):
        if hasattr(k, attribute):
            return getattr(k, attribute)
    return str(k)


def _path_name(path: tuple) -> str:
    return "/".join(str(k) for k in path) or "(the root)"


def _param_path(state_path, field: str) -> tuple:
    """The parameter path inside a state field (``mu`` / ``nu``...): the keys after it."""
    keys = list(state_path)
    last = max(
        i for i, k in enumerate(keys) if isinstance(k, jax.tree_util.GetAttrKey) and k.name == field
    )
    return tuple(_key(k) for k in keys[last + 1 :])


def _block_orders(block_order: Any) -> dict[tuple, BlockOrder]:
    """``{parameter path: BlockOrder}`` of a `block_order` pytree (None leaves left out)."""
    if block_order is None:
        return {}
    orders = {}
    leaves = jax.tree_util.tree_flatten_with_path(
        block_order, is_leaf=lambda x: x is None or isinstance(x, (BlockOrder, np.ndarray))
    )[0]
    for path, leaf in leaves:
        name = tuple(_key(k) for k in path)
        if leaf is None:
            continue
        if isinstance(leaf, BlockOrder):
            orders[name] = leaf
            continue
        try:
            orders[name] = BlockOrder(leaf)
        except ValueError as error:
            raise ValueError(
                f"low_precision_state(block_order=...): parameter {_path_name(name)}: {error}"
            ) from None
    return orders


def _check_orders(orders: dict[tuple, BlockOrder], params: Any) -> None:
    """Every ordered path is a parameter of the same size (else the order would be ignored)."""
    if not orders:
        return
    sizes = {
        tuple(_key(k) for k in path): math.prod(np.shape(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    for name, order in orders.items():
        if name not in sizes:
            valid = sorted(_path_name(p) for p in sizes)
            close = difflib.get_close_matches(_path_name(name), valid, n=1, cutoff=0.4)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"low_precision_state(block_order=...): {_path_name(name)!r} is not a parameter; "
                f"the parameters are {valid}.{hint}"
            )
        if sizes[name] != order.size:
            raise ValueError(
                f"low_precision_state(block_order=...): the order of parameter "
                f"{_path_name(name)!r} has {order.size} elements; the parameter has "
                f"{sizes[name]}."
            )


def _names(argument: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    try:
        names = tuple(value)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"low_precision_state({argument}={value!r}): must be field names (strs), e.g. "
            "('mu', 'nu')."
        )
    return names


def state_bytes(tree: Any) -> int:
    """Bytes held by the array leaves of `tree` (an optimizer state), codes and scales included.

    Divide by the parameter count for bytes per parameter.

    Examples:
      >>> params = {"w": jnp.zeros((64, 64))}
      >>> jaxamp.optim_precision.state_bytes(optax.adam(1e-3).init(params)) / 4096
      8.0009765625
    """
    return sum(
        int(np.dtype(x.dtype).itemsize) * math.prod(x.shape)
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype") and hasattr(x, "shape")
    )


def _adamw(
    state_format: str,
    name: str,
    default_block: int,
) -> Callable[..., optax.GradientTransformationExtraArgs]:
    def factory(
        learning_rate: optax.ScalarOrSchedule = 1e-3,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = default_block,
        min_size: int = DEFAULT_MIN_SIZE,
        block_order: Any = None,
    ) -> optax.GradientTransformationExtraArgs:
        return low_precision_state(
            optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
            state_format,
            block_size=block_size,
            min_size=min_size,
            block_order=block_order,
        )

    factory.__name__ = factory.__qualname__ = f"adamw_{state_format}"
    factory.__doc__ = f"""AdamW with both moments in {state_format} codes: torchao's ``{name}``.

    ``low_precision_state(optax.adamw(...), {state_format!r})`` with torchao's defaults (lr 1e-3,
    betas (0.9, 0.999), eps 1e-8, weight decay 1e-2, block size {default_block}, leaves of at
    least 4096 elements); the first moment on the signed map, the second on the unsigned one.
    `block_order`: see `low_precision_state` (torch's element order for a Flax twin's kernels).

    Warning:
      torchao adds eps to ``sqrt(nu) / sqrt(1 - b2**t)``, optax to ``sqrt(nu / (1 - b2**t))``:
      the parameter updates differ in the last bits (the codes do not, after a first step).

    Examples:
      >>> tx = jaxamp.optim_precision.adamw_{state_format}()
      >>> state = tx.init({{"w": jnp.zeros((64, 64))}})
      >>> jaxamp.optim_precision.state_bytes(state) < 4 * 4096
      True
    """
    return factory


adamw_8bit = _adamw("8bit", "AdamW8bit", 256)
adamw_4bit = _adamw("4bit", "AdamW4bit", 128)
adamw_fp8 = _adamw("fp8", "AdamWFp8", 256)
