"""The torch side of the dtype trace: which dtype each aten op runs in under torch.autocast.

``jaxamp.autocast_trace`` records ``(op, input dtypes, output dtypes)`` for every JAX primitive an
autocast function runs; :func:`torch_dtype_trace` records the same table for a torch function under
``torch.autocast`` (with a ``TorchDispatchMode``, so the ops are the aten ops autocast dispatched,
casts included). :func:`diff_dtype_traces` lines the two up through the op counterpart table in
``jaxamp.autocast_op_list`` and names the ops that run in different precision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from jaxamp import DtypeRecord, autocast_op_list

__all__ = [
    "DtypeRecord",
    "diff_dtype_traces",
    "torch_dtype_trace",
    "torch_matmul_flops",
]

# Ops that only move or view data: they never change precision and have no place in the diff.
_IGNORED = frozenset({"detach", "t", "view", "_unsafe_view", "expand", "transpose", "clone"})


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[DtypeRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [x for x in tree_leaves((args, kwargs or {})) if isinstance(x, torch.Tensor)]
        outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        name = func._schema.name.split("::")[-1]
        self.records.append(
            DtypeRecord(
                name, tuple(_dtype_name(x) for x in ins), tuple(_dtype_name(x) for x in outs)
            )
        )
        return out


def torch_dtype_trace(
    fn: Callable, *args: Any, device_type: str = "cpu", dtype: torch.dtype | None = None, **kwargs
) -> list[DtypeRecord]:
    """Records ``(aten op, input dtypes, output dtypes)`` for ``fn`` under ``torch.autocast``.

    Args:
      fn: a torch function.
      *args: its positional arguments.
      device_type: torch device type for ``torch.autocast`` (``"cpu"`` or ``"cuda"``).
      dtype: autocast dtype; default torch's default for ``device_type``.
      **kwargs: its keyword arguments.

    Returns:
      A list of :class:`jaxamp.DtypeRecord`, one per aten op in dispatch order.

    Examples:
      >>> torch_dtype_trace(lambda x: x @ x, torch.ones(2, 2))[-1]
      DtypeRecord(op='mm', in_dtypes=('bfloat16', 'bfloat16'), out_dtypes=('bfloat16',))
    """
    recorder = _Recorder()
    with torch.autocast(device_type, dtype=dtype), recorder:
        fn(*args, **kwargs)
    return recorder.records


def _primitive_of(torch_op: str) -> str | None:
    prims = autocast_op_list("cpu").primitives(torch_op)
    return prims[0] if prims else None


# Per-op precision categories: ops that round where they run, lined up across frameworks by
# category (torch fuses what JAX spells out: addmm is a matmul plus a bias add, _softmax is
# max/sub/exp/sum/div, native_layer_norm has its reductions and rsqrt inside).
_TORCH_CATEGORIES: dict[str, str] = {
    **{op: "add" for op in ("add", "add_", "sub", "sub_", "rsub")},
    **{op: "softmax" for op in ("_softmax", "_log_softmax", "softmax", "log_softmax")},
    **{
        op: "normalisation"
        for op in (
            "native_layer_norm",
            "native_batch_norm",
            "_native_batch_norm_legit",
            "_native_batch_norm_legit_functional",
            "_native_batch_norm_legit_no_training",
            "native_group_norm",
            "rsqrt",
            "sqrt",
        )
    },
    **{
        op: "reduction"
        for op in (
            "sum",
            "mean",
            "var",
            "var_mean",
            "std",
            "amax",
            "amin",
            "max",
            "min",
            "prod",
            "logsumexp",
            "norm",
            "linalg_vector_norm",
        )
    },
}
_JAX_CATEGORIES: dict[str, str] = {
    "add": "add",
    "sub": "add",
    "exp": "softmax",
    "rsqrt": "normalisation",
    "sqrt": "normalisation",
    "reduce_sum": "reduction",
    "reduce_max": "reduction",
    "reduce_min": "reduction",
    "reduce_prod": "reduction",
}
# torch ops with a fused bias add: (number of non-bias inputs, the position of the bias).
_FUSED_BIAS = {"addmm": 0, "baddbmm": 0, "addbmm": 0, "_addmm_activation": 0, "convolution": 2}
CATEGORIES = ("add", "softmax", "normalisation", "reduction")


def _categorised(trace: Sequence[DtypeRecord], side: str) -> dict[str, list[tuple[str, str]]]:
    """``{category: [(dtype it ran in, op), ...]}`` in program order for one trace."""
    out: dict[str, list[tuple[str, str]]] = {c: [] for c in CATEGORIES}
    for rec in trace:
        op = rec.op.split(".")[0]
        dtype = rec.out_dtypes[0] if rec.out_dtypes else (rec.in_dtypes[:1] or ("?",))[0]
        if side == "torch":
            category = _TORCH_CATEGORIES.get(op)
            if op in _FUSED_BIAS and len(rec.in_dtypes) > _FUSED_BIAS[op]:
                # convolution(input, weight, bias): a bias is there when a third tensor came in.
                if op != "convolution" or len(rec.in_dtypes) >= 3:
                    out["add"].append((dtype, f"aten {op} bias"))
        else:
            category = _JAX_CATEGORIES.get(op)
        if category is not None:
            out[category].append((dtype, f"{'aten ' if side == 'torch' else ''}{op}"))
    return out


def _histogram(entries: list[tuple[str, str]]) -> str:
    counts: dict[str, int] = {}
    for dtype, _ in entries:
        counts[dtype] = counts.get(dtype, 0) + 1
    return ", ".join(f"{d} x{n}" for d, n in sorted(counts.items())) or "none"


def diff_dtype_traces(
    jax_trace: Sequence[DtypeRecord], torch_trace: Sequence[DtypeRecord]
) -> list[str]:
    """Names the ops that run in different precision in two dtype traces.

    Two passes:

    1. Counterpart ops: the k-th torch op with a JAX counterpart primitive ``P`` is matched with
       the k-th ``P`` in the JAX trace (``mm``/``addmm``/``bmm`` with ``dot_general``, ``exp``
       with ``exp``, ...); their output dtypes are compared.
    2. Per-op precision by category, in order: ``add`` (bias and residual adds; the bias add
       torch fuses into ``addmm``/``baddbmm``/``convolution`` counts as one), ``softmax``
       (torch ``_softmax``/``_log_softmax`` against JAX's ``exp``), ``normalisation`` (torch's
       fused norms and ``rsqrt`` against JAX's ``sqrt``/``rsqrt``) and ``reduction``
       (``sum``/``mean``/``amax``/... against ``reduce_*``). When both sides have the same
       number of ops of a category, the k-th are compared; otherwise (JAX spells out what
       torch fuses) the sets of dtypes are compared, so an op that runs in float32 on one side
       and only in bfloat16 on the other is still named.

    Args:
      jax_trace: from ``jaxamp.autocast_trace``.
      torch_trace: from :func:`torch_dtype_trace`.

    Returns:
      One line per mismatch (empty when the traces agree), e.g.
      ``"dot_general #0: jax float32, torch bfloat16 (aten addmm)"`` or
      ``"add #0: jax float32 (add), torch bfloat16 (aten addmm bias)"``; also a line when a
      counterpart primitive occurs a different number of times.

    Examples:
      >>> diff_dtype_traces(
      ...     [DtypeRecord("dot_general", ("bfloat16",) * 2, ("bfloat16",)),
      ...      DtypeRecord("add", ("float32", "float32"), ("float32",))],
      ...     [DtypeRecord("addmm", ("bfloat16",) * 3, ("bfloat16",))])
      ['add #0: jax float32 (add), torch bfloat16 (aten addmm bias)']
    """
    by_prim_torch: dict[str, list[DtypeRecord]] = {}
    for rec in torch_trace:
        if rec.op in _IGNORED:
            continue
        prim = _primitive_of(rec.op)
        if prim is not None:
            by_prim_torch.setdefault(prim, []).append(rec)
    by_prim_jax: dict[str, list[DtypeRecord]] = {}
    for rec in jax_trace:
        if rec.op in by_prim_torch:
            by_prim_jax.setdefault(rec.op, []).append(rec)
    problems = []
    for prim, t_recs in by_prim_torch.items():
        j_recs = by_prim_jax.get(prim, [])
        if len(j_recs) != len(t_recs):
            problems.append(f"{prim}: {len(j_recs)} in jax, {len(t_recs)} in torch")
        for k, (j, t) in enumerate(zip(j_recs, t_recs, strict=False)):
            if j.out_dtypes[:1] != t.out_dtypes[:1]:
                problems.append(
                    f"{prim} #{k}: jax {', '.join(j.out_dtypes)}, torch {', '.join(t.out_dtypes)} "
                    f"(aten {t.op})"
                )
    jax_cats = _categorised(jax_trace, "jax")
    torch_cats = _categorised(torch_trace, "torch")
    for category in CATEGORIES:
        j_ops, t_ops = jax_cats[category], torch_cats[category]
        if not j_ops or not t_ops:
            continue
        if len(j_ops) == len(t_ops):
            for k, ((j_dtype, j_op), (t_dtype, t_op)) in enumerate(zip(j_ops, t_ops, strict=True)):
                if j_dtype != t_dtype:
                    problems.append(
                        f"{category} #{k}: jax {j_dtype} ({j_op}), torch {t_dtype} ({t_op})"
                    )
        elif {d for d, _ in j_ops} != {d for d, _ in t_ops}:
            problems.append(
                f"{category}: dtypes differ: jax {_histogram(j_ops)}; torch {_histogram(t_ops)}"
            )
    return problems


# --- compute dtype: torch's matmul/conv FLOPs by dtype (JAX's: `parity.perf.flops`) ----------


class _FlopRecorder(TorchDispatchMode):
    """Matmul/conv FLOPs by operand dtype, with torch's own FLOP formulas (torch.utils.flop_counter)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.totals: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func._overloadpacket)
        if formula is not None:
            tensors = [
                x
                for x in tree_leaves((args, kwargs))
                if isinstance(x, torch.Tensor) and x.dim() > 1
            ]
            dtypes = sorted({_dtype_name(x) for x in tensors if x.is_floating_point()})
            key = "/".join(dtypes) if dtypes else "unknown"
            self.totals[key] = self.totals.get(key, 0) + int(formula(*args, **kwargs, out_val=out))
        return out


def torch_matmul_flops(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, int]:
    """Runs ``fn`` and counts the FLOPs of its matmuls and convolutions by operand dtype.

    Every aten op torch's FLOP counter knows (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
    ``convolution``, ``convolution_backward``, attention kernels) is counted at dispatch, so ops
    run by autograd in the backward pass (when ``fn`` calls ``backward()``) count too, and the
    dtype is the one the kernel received (after autocast's casts). Run ``fn`` inside
    ``torch.autocast`` yourself if wanted.

    Args:
      fn: a torch function.
      *args: its positional arguments.
      **kwargs: its keyword arguments.

    Returns:
      ``{dtype name: FLOPs}``; an op whose matrix operands differ in dtype is filed under
      ``"a/b"``.

    Examples:
      >>> torch_matmul_flops(lambda a, b: a @ b, torch.ones(2, 3), torch.ones(3, 4))
      {'float32': 48}
    """
    recorder = _FlopRecorder()
    with recorder:
        fn(*args, **kwargs)
    return recorder.totals
