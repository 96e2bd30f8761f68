"""The torch side of the dtype trace: which dtype each aten op runs in under torch.autocast.

``jaxamp.autocast_trace`` records ``(op, input dtypes, output dtypes)`` for every JAX primitive an
autocast function runs; :func:`torch_dtype_trace` records the same table for a torch function under
``torch.autocast`` (with a ``TorchDispatchMode``, so the ops are the aten ops autocast dispatched,
casts included). :func:`diff_dtype_traces` lines the two up through the op counterpart table in
``jaxamp._oplists`` and names the ops that run in different precision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from jaxamp import _oplists
from jaxamp.autocast import DtypeRecord

__all__ = ["DtypeRecord", "diff_dtype_traces", "torch_dtype_trace"]

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
      A list of :class:`jaxamp.autocast.DtypeRecord`, one per aten op in dispatch order.

    Examples:
      >>> torch_dtype_trace(lambda x: x @ x, torch.ones(2, 2))[-1]
      DtypeRecord(op='mm', in_dtypes=('bfloat16', 'bfloat16'), out_dtypes=('bfloat16',))
    """
    recorder = _Recorder()
    with torch.autocast(device_type, dtype=dtype), recorder:
        fn(*args, **kwargs)
    return recorder.records


def _primitive_of(torch_op: str) -> str | None:
    prims = _oplists.PRIMITIVE_COUNTERPARTS.get(torch_op.split(".")[0])
    return prims[0] if prims else None


def diff_dtype_traces(
    jax_trace: Sequence[DtypeRecord], torch_trace: Sequence[DtypeRecord]
) -> list[str]:
    """Names the ops that run in different precision in two dtype traces.

    The k-th torch op with a JAX counterpart primitive ``P`` is matched with the k-th ``P`` in the
    JAX trace (``mm``/``addmm``/``bmm`` with ``dot_general``, ``exp`` with ``exp``, ...); their
    output dtypes are compared. Ops without a counterpart are ignored.

    Args:
      jax_trace: from ``jaxamp.autocast_trace``.
      torch_trace: from :func:`torch_dtype_trace`.

    Returns:
      One line per mismatch (empty when the traces agree), e.g.
      ``"dot_general #0: jax float32, torch bfloat16 (aten addmm)"``; also a line when a
      primitive occurs a different number of times.
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
    return problems
