"""The public functions: autocast, autocast_trace, full_precision, autocast_op_list."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxamp._autocast import oplists
from jaxamp._autocast.dtypes import F32, cast
from jaxamp._autocast.explicit_casts import marking_explicit_casts
from jaxamp._autocast.interpreter import DtypeRecord, Hook, Interpreter
from jaxamp._autocast.options import check_device, check_dtype
from jaxamp._autocast.rules import FULL_PRECISION_SCOPE, Rules
from jaxamp._numerics import is_array, over_array_leaves
from jaxamp._policy import parse_dtype
from jaxamp._reduce import reduce_in
from jaxamp.fp8._convert import AutocastFp8

__all__ = ["autocast", "autocast_op_list", "autocast_trace", "full_precision"]


def _trace_and_eval(fn: Callable, args: tuple, kwargs: dict, interp: Interpreter) -> Any:
    flat_fn, dyn_vals = over_array_leaves(fn, args, kwargs)
    with marking_explicit_casts():
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_vals)
    outs = interp.eval_closed(closed, dyn_vals, None)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)


def autocast(
    fn: Callable,
    *,
    dtype: Any = None,
    device: str | None = None,
    overrides: Mapping[Any, str | None] | None = None,
    reduce_dtype: Any = None,
    fp8: Any = None,
    fp8_filter: Any = None,
) -> Callable:
    """Runs ``fn`` with torch.autocast's per-op precision rules for a torch device type.

    Ops on torch's lower-precision list for ``device`` (``dot_general``, ``conv_general_dilated``)
    run in ``dtype``; ops on its float32 lists (on ``"cuda"``: ``exp``, ``log``, ``pow``,
    ``rsqrt``, sums, products, cumulative sums, layer norm, losses, ...) run in float32; the rest
    keep their input dtype, with JAX's standard promotion where inputs now differ. Only float16,
    bfloat16 and float32 values are cast. The rules reach inside ``jit``, ``scan``, ``while``,
    ``cond``, ``checkpoint``, ``custom_jvp``/``custom_vjp`` (whose derivative rules still apply,
    under the same casts) and ``shard_map``.

    Decisions where JAX and torch differ:

    * ``dot_general``/``conv_general_dilated`` with a ``preferred_element_type`` other than their
      input dtype (e.g. bfloat16 inputs accumulated in float32) are explicit and left alone. JAX
      records the input dtype there by default, so a float32 matmul is autocast.
    * Loop carries and ``cond`` outputs keep their traced dtypes (a loop state cannot change type).
    * A cast the user wrote (``x.astype(f32)``, ``jnp.astype``/``asarray``/``array`` with a dtype,
      ``lax.convert_element_type``) is honoured even where ``x`` was already that dtype when
      traced (JAX elides such casts; autocast records them while tracing ``fn``), as torch's
      ``.float()`` is. Not seen: casts made inside JAX's own library code or through
      ``jnp.float32(x)``, and those in an inner ``jit``/``scan`` body whose trace JAX had cached
      from a call outside autocast. Inside a lower-precision kernel region (flax ``Dense``) they
      are absorbed by the kernel's cast. ``batch_norm``'s running statistics keep their dtype.
    * Inner ``jit`` calls are inlined into the caller (XLA inlines them anyway); their explicit
      ``in_shardings``/``out_shardings`` are not re-applied.
    * Composites that torch runs as one kernel (flax's LayerNorm, optax's l2/cross-entropy losses,
      ``jnp.mean``, ...) follow that kernel's category; see `autocast_op_list`.
    * Autocast applies to every op in ``fn``'s jaxpr. Put it on the forward pass or loss and
      differentiate outside (as with torch): the backward pass then mirrors the forward's dtypes.

    Args:
      fn: the function to transform. Array arguments (any pytree of them) are traced; Python
        scalars, strings and other leaves are passed through as static values.
      dtype: the lower-precision dtype, float16 or bfloat16 (float32 allowed); default torch's
        default for ``device`` (cpu: bfloat16, cuda: float16).
      device: torch device type whose lists to use, ``"cpu"`` or ``"cuda"``; default ``"cuda"`` on
        a GPU backend, else ``"cpu"``.
      overrides: move ops between lists for this call: key -> one of
        :data:`AUTOCAST_CATEGORIES` (``None`` means ``"keep"``). A key is either a JAX
        primitive (or its name, e.g. ``"dot_general"``), whose category then holds wherever it
        runs, inside library composites too (a flax ``Dense`` is a ``linear`` whose kernel is
        ``dot_general``, so overriding ``dot_general`` moves the whole layer); or a torch op
        name from the op lists (e.g. ``"linear"``, ``"softmax"``), which moves that op as if
        torch's list said so (``"linear"`` moves flax ``Dense`` but not a bare ``a @ b``, which
        is torch's ``matmul``). Unknown keys raise ``ValueError`` with the closest valid name.
      reduce_dtype: FSDP2's ``reduce_dtype`` (e.g. ``"float32"``): the gradients of the inputs
        autocast narrows (float32 params cast to ``dtype``) are accumulated in it, so the
        cross-device gradient sums of a sharded batch (SPMD all-reduce / reduce-scatter,
        ``shard_map``'s psum) run in it; forward values are unchanged. Default None: JAX's
        own gradients (their cross-device sums run in ``dtype``).
      fp8: a `jaxamp.fp8` recipe (or its name: ``"tensorwise"``, ``"rowwise"``,
        ``"rowwise_with_gw_hp"``): the selected linear-layer matmuls run in fp8 on the operands
        autocast chose (torchao's ``Float8Linear`` under autocast); a selected matmul that cannot
        raises. Dynamic recipes; for ``"delayed"`` use ``jaxamp.fp8.convert``. See
        ``jaxamp.fp8.report`` for which matmuls ran in fp8.
      fp8_filter: which matmuls (``jaxamp.fp8.convert``'s ``fp8_filter``): None (every matmul
        without batch dimensions), path globs, or a callable on `jaxamp.fp8.MatmulInfo`. A
        filter that selects no matmul raises ``ValueError`` naming the paths it saw.

    Returns:
      A function with ``fn``'s signature. Output dtypes are what the ops produce under autocast
      (e.g. a linear model returns ``dtype``), as under torch.autocast.

    Examples:
      >>> def loss_fn(w, x):
      ...     return jnp.sum(jnp.tanh(x @ w))
      >>> w, x = jnp.full((4, 2), 0.5), jnp.ones((3, 4))
      >>> loss = jaxamp.autocast(loss_fn, device="cpu", dtype=jnp.bfloat16)
      >>> loss(w, x).dtype  # the matmul ran in bfloat16, tanh and sum kept its dtype
      dtype(bfloat16)
      >>> jax.grad(loss)(w, x).dtype  # float32 params get float32 grads
      dtype('float32')
      >>> jaxamp.autocast(loss_fn, device="cuda", overrides={"dot_general": "fp32"})(w, x).dtype
      dtype('float32')
    """
    fp8_hooks = None
    if fp8 is not None:
        fp8_hooks = AutocastFp8(fp8, fp8_filter)
    elif fp8_filter is not None:
        raise ValueError("autocast: fp8_filter= needs fp8= (a jaxamp.fp8 recipe).")
    out = transform(
        fn,
        dtype=dtype,
        device=device,
        overrides=overrides,
        hooks=None if fp8_hooks is None else fp8_hooks.hooks,
    )
    if fp8_hooks is not None:
        out = functools.wraps(fn)(fp8_hooks.checked(out))
    if reduce_dtype is not None:
        out = reduce_in(out, parse_dtype(reduce_dtype, where="autocast(reduce_dtype=...)"))
    return out


def transform(
    fn: Callable,
    *,
    dtype: Any = None,
    device: str | None = None,
    overrides: Mapping[Any, str | None] | None = None,
    hooks: Mapping[str, Hook] | None = None,
) -> Callable:
    """`autocast` with op hooks: the extension point for features that replace ops (fp8).

    Args:
      fn, dtype, device, overrides: as for `autocast`.
      hooks: primitive name -> `jaxamp._autocast.interpreter.Hook`, called for every equation
        of that primitive with the operands autocast chose; see that module's docstring.
    """
    if not callable(fn):
        raise TypeError(f"autocast: `fn` must be callable, got {type(fn).__name__}.")
    device = check_device(device)
    dt = check_dtype(dtype, device)
    rules = Rules.build(device, overrides)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return _trace_and_eval(fn, args, kwargs, Interpreter(device, dt, rules, None, hooks))

    return wrapped


def autocast_trace(
    fn: Callable,
    *args: Any,
    dtype: Any = None,
    device: str | None = None,
    overrides: Mapping[Any, str | None] | None = None,
    hooks: Mapping[str, Hook] | None = None,
    **kwargs: Any,
) -> list[DtypeRecord]:
    """The dtypes each op of ``fn(*args, **kwargs)`` runs in under :func:`autocast`.

    Nothing is computed: the function is evaluated abstractly. The torch counterpart, recording
    the same table under torch.autocast, is ``parity.training.dtype_trace.torch_dtype_trace``.

    Args:
      fn: the function.
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      dtype: as for :func:`autocast`.
      device: as for :func:`autocast`.
      overrides: as for :func:`autocast`.
      hooks: as for `transform` (op replacements, e.g. fp8 matmuls, show in the trace).
      **kwargs: its keyword arguments.

    Returns:
      A list of :class:`DtypeRecord` ``(op, in_dtypes, out_dtypes)``, one per primitive in
      program order (higher-order primitives are entered, not listed).

    Examples:
      >>> for record in jaxamp.autocast_trace(
      ...     lambda x: jnp.exp(x @ x), jnp.ones((2, 2)), device="cuda"
      ... ):
      ...     print(record)
      DtypeRecord(op='dot_general', in_dtypes=('float16', 'float16'), out_dtypes=('float16',))
      DtypeRecord(op='exp', in_dtypes=('float32',), out_dtypes=('float32',))

    The casts autocast inserts are not listed; they show in ``in_dtypes``.
    """
    device = check_device(device)
    dt = check_dtype(dtype, device)
    rules = Rules.build(device, overrides)
    record: list[DtypeRecord] = []
    interp = Interpreter(device, dt, rules, record, hooks)

    def run(*a):
        return _trace_and_eval(fn, a, kwargs, interp)

    jax.eval_shape(run, *args)
    return record


def full_precision(fn: Callable) -> Callable:
    """Runs ``fn`` in float32 with autocast disabled, like ``torch.autocast(enabled=False)``.

    Floating float16/bfloat16 array arguments are cast to float32 and, inside :func:`autocast`,
    every op of ``fn`` runs as written (in the dtypes it was traced with). Outside autocast it is
    ``fn`` with its low-precision inputs upcast.

    Args:
      fn: the function to run in full precision.

    Returns:
      A function with ``fn``'s signature.

    Examples:
      >>> stable_loss = jaxamp.full_precision(
      ...     lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      ... )
      >>> w, x, y = jnp.ones((4, 3)), jnp.ones((2, 4)), jnp.array([0, 2])
      >>> loss = jax.jit(jaxamp.autocast(lambda w, x, y: stable_loss(x @ w, y), device="cpu"))
      >>> loss(w, x, y).dtype  # the matmul ran in bfloat16, the loss in float32
      dtype('float32')
    """
    if not callable(fn):
        raise TypeError(f"full_precision: `fn` must be callable, got {type(fn).__name__}.")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.named_scope(FULL_PRECISION_SCOPE):
            args, kwargs = jax.tree_util.tree_map(
                lambda x: cast(x, F32) if is_array(x) else x, (args, kwargs)
            )
            return fn(*args, **kwargs)

    return wrapped


def autocast_op_list(device: str | None = None) -> oplists.OpList:
    """torch.autocast's op lists for a torch device type, as autocast uses them.

    Args:
      device: ``"cpu"`` or ``"cuda"``; default from JAX's backend, as for `autocast`.

    Returns:
      An `OpList`: ``ops`` maps torch op names (``name`` or ``name.overload``) to categories,
      ``category(op)`` looks one up, ``torch_version`` says which torch the lists mirror, and
      ``primitives(op)``/``functions(op)`` give the JAX primitives and library functions that
      implement a torch op.

    Examples:
      >>> ops = jaxamp.autocast_op_list("cuda")
      >>> ops.category("linear"), ops.category("softmax"), ops.torch_version
      ('lower_precision_fp', 'fp32_set_opt_dtype', '2.13.0')
      >>> ops.primitives("mm")
      ('dot_general',)
    """
    return oplists.OP_LISTS[check_device(device)]
