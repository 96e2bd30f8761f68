"""The dtypes of cross-device reductions in XLA's partitioned program (post-SPMD HLO dumps).

XLA:CPU rewrites bfloat16 all-reduces to float32 late in compilation, so the final HLO cannot
show a low-precision gradient reduction. The module right after SPMD partitioning can: run with
``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_pass_re=spmd-partitioning"`` (see `dump_flags`) and
read ``DIR/*after_spmd-partitioning*`` with `reduction_collectives`.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

__all__ = ["dump_flags", "is_gradient_reduction", "reduction_collectives", "reduction_dtypes"]

_COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|reduce-scatter)\(")
_DTYPE = re.compile(r"\b([a-z]+\d+)\[")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# HLO element types that are floating point.
_FLOAT_TYPES = ("f16", "bf16", "f32", "f64", "f8e4m3fn", "f8e5m2")
HLO_TO_NUMPY = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}


def dump_flags(dump_dir: str | os.PathLike, module_re: str | None = None) -> str:
    """XLA flags that dump each module right after SPMD partitioning into `dump_dir`."""
    flags = f"--xla_dump_to={dump_dir} --xla_dump_hlo_pass_re=spmd-partitioning"
    if module_re:
        flags += f" --xla_dump_hlo_module_re={module_re}"
    return flags


def reduction_collectives(dump_dir: str | os.PathLike, module: str = "") -> list[dict[str, Any]]:
    """All-reduce / reduce-scatter ops of the partitioned modules whose file name has `module`.

    Returns:
      ``[{"op": "all-reduce", "dtypes": ["f32"], "op_name": "...", "file": "..."}]``.
    """
    out = []
    pattern = os.path.join(str(dump_dir), f"*{module}*after_spmd-partitioning*")
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            for line in f:
                m = _COLLECTIVE.search(line)
                if not m:
                    continue
                name = _OP_NAME.search(line)
                out.append(
                    {
                        "op": m.group(2),
                        "dtypes": sorted(set(_DTYPE.findall(m.group(1)))),
                        "op_name": name.group(1) if name else "",
                        "file": os.path.basename(path),
                    }
                )
    return out


def is_gradient_reduction(collective: dict[str, Any]) -> bool:
    """Whether a collective belongs to the backward pass (JAX names those ops ``transpose(...)``).

    Forward collectives (e.g. the all-reduce XLA uses to gather rows of a sharded embedding
    table) move parameters, as FSDP2's all-gather in ``param_dtype`` does, and are not judged.
    """
    return "transpose(" in collective.get("op_name", "")


def reduction_dtypes(
    collectives: list[dict[str, Any]], *, gradients_only: bool = False
) -> list[str]:
    """The floating dtypes (numpy names) reduced across devices, e.g. ``["float32"]``."""
    if gradients_only:
        collectives = [c for c in collectives if is_gradient_reduction(c)]
    found = {d for c in collectives for d in c["dtypes"] if d in _FLOAT_TYPES}
    return sorted(HLO_TO_NUMPY.get(d, d) for d in found)
