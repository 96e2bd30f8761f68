"""`validate_variables`: a transfer's result checked against the Flax model's own variables."""

from __future__ import annotations

import difflib
from typing import Any

import numpy as np

from parity.automap.units import TransferError
from parity.pairs.variables import as_variables, flatten_variables

__all__ = ["validate_variables"]


def validate_variables(variables: Any, reference: Any, *, check_dtype: bool = True) -> None:
    """Checks a transfer's result against the Flax model's own variables before training.

    Args:
      variables: what the transfer produced (any form `parity.pairs.variables.as_variables` takes).
      reference: the Flax module's own variables (``module.init`` output, ``jax.eval_shape`` of
        it, or an ``nnx.Module``): the names, shapes and dtypes that must be there.
      check_dtype: also compare dtypes.

    Raises:
      TransferError: every missing, extra, mis-shaped or mis-typed leaf, named, with the fix.

    Example:
      >>> validate_variables({"params": {"fc": {"kernel": np.zeros((2, 3), np.float32)}}},
      ...                    {"params": {"fc": {"kernel": np.zeros((2, 3), np.float32)}}})
    """
    got = flatten_variables(as_variables(variables))
    want = flatten_variables(as_variables(reference))
    problems = []
    missing = [p for p in want if p not in got]
    extra = [p for p in got if p not in want]
    missing_collections = sorted({p[0] for p in missing} - {p[0] for p in got})
    for collection in missing_collections:
        hint = (
            " (BatchNorm running statistics: the transfer must return them too, e.g. "
            "batchnorm_to_flax's second value, or use parity.transfer.auto)"
            if collection == "batch_stats"
            else ""
        )
        problems.append(f"collection {collection!r} is missing{hint}")
    for path in missing:
        if path[0] in missing_collections:
            continue
        close = difflib.get_close_matches("/".join(path), ["/".join(p) for p in extra], n=1)
        problems.append(
            f"missing {'/'.join(path)} {tuple(np.shape(want[path]))}"
            + (f" (the transfer has {close[0]!r})" if close else "")
        )
    for path in extra:
        problems.append(
            f"extra {'/'.join(path)} {tuple(np.shape(got[path]))} (not in the Flax model)"
        )
    for path in want:
        if path not in got:
            continue
        have, need = tuple(np.shape(got[path])), tuple(np.shape(want[path]))
        if have != need:
            problems.append(f"shape of {'/'.join(path)}: {have}, the Flax model has {need}")
        elif check_dtype:
            have_dtype = np.dtype(getattr(got[path], "dtype", np.asarray(got[path]).dtype))
            need_dtype = np.dtype(getattr(want[path], "dtype", np.asarray(want[path]).dtype))
            if have_dtype != need_dtype:
                problems.append(
                    f"dtype of {'/'.join(path)}: {have_dtype}, the Flax model has {need_dtype}"
                )
    if problems:
        raise TransferError(
            "the transferred variables do not fit the Flax model:\n  "
            + "\n  ".join(problems)
            + "\nFix the transfer (or pass none: compare_models then maps the weights with "
            "parity.transfer.auto)."
        )
