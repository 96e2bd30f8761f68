"""Flax variable trees in one form: ``{"params": ..., "batch_stats": ...}`` nested dicts.

`as_variables` reads what a transfer or a model may hand over (linen variables, a bare params
dict, an NNX ``State``, a Hugging Face Flax model); `flatten_variables` and
`unflatten_variables` convert to and from ``{path tuple: array}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["as_variables", "flatten_variables", "nnx_collection", "unflatten_variables"]

_NNX_COLLECTIONS = {"Param": "params", "BatchStat": "batch_stats"}
_COLLECTION_NAMES = ("params", "batch_stats")


def nnx_collection(variable_type: type) -> str | None:
    """The linen collection an NNX variable type belongs to (``"params"``, ``"batch_stats"``)."""
    from flax import nnx

    if issubclass(variable_type, nnx.Param):
        return "params"
    if issubclass(variable_type, nnx.BatchStat):
        return "batch_stats"
    if issubclass(variable_type, nnx.RngState):
        return None
    name = variable_type.__name__
    return _NNX_COLLECTIONS.get(name, re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower())


def _nnx_state_to_variables(state) -> dict:
    from flax import nnx

    out: dict = {}
    for path, variable in nnx.to_flat_state(state):
        if isinstance(variable, nnx.Variable):
            collection = nnx_collection(type(variable))
            value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        else:
            collection, value = "params", variable
        if collection is None or not hasattr(value, "shape"):
            continue
        node = out.setdefault(collection, {})
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return out


def as_variables(obj: Any) -> dict:
    """A plain ``{"params": ..., "batch_stats": ...}`` nested dict from any Flax weight container.

    Accepts linen variables (``{"params": ...}``, a ``FrozenDict``), a bare params dict (no
    collection level: wrapped as ``{"params": obj}``), an ``nnx.Module`` or ``nnx.State``
    (``Param`` -> ``"params"``, ``BatchStat`` -> ``"batch_stats"``, RNG state dropped), and a
    Hugging Face Flax model (its ``.params``). Keys become strings (NNX list indices too).

    Example:
      >>> as_variables({"fc": {"kernel": np.zeros((2, 3))}})["params"]["fc"]["kernel"].shape
      (2, 3)
    """
    try:
        from flax import nnx

        if isinstance(obj, nnx.Module):
            return _nnx_state_to_variables(nnx.state(obj))
        if isinstance(obj, nnx.State):
            return _nnx_state_to_variables(obj)
    except ImportError:  # pragma: no cover - flax is a dependency
        pass
    if not isinstance(obj, Mapping) and hasattr(obj, "params") and hasattr(obj, "module"):
        return as_variables(obj.params)  # Hugging Face Flax wrapper
    if not isinstance(obj, Mapping):
        raise TypeError(
            "Flax variables must be a dict like {'params': ...}, a bare params dict, an "
            f"nnx.Module / nnx.State or a Hugging Face Flax model; got {type(obj).__name__}."
        )
    plain = _plain(obj)
    if "params" in plain or (plain and all(k in _COLLECTION_NAMES for k in plain)):
        return plain
    return {"params": plain}


def _plain(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {str(k): _plain(v) for k, v in tree.items()}
    return tree


def flatten_variables(variables: Mapping) -> dict[tuple[str, ...], Any]:
    """``{("params", "fc", "kernel"): array, ...}`` in the tree's own key order.

    Example:
      >>> list(flatten_variables({"params": {"fc": {"kernel": 1}}}))
      [('params', 'fc', 'kernel')]
    """
    out: dict[tuple[str, ...], Any] = {}

    def walk(node, prefix):
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, (*prefix, str(key)))
        else:
            out[prefix] = node

    walk(variables, ())
    return out


def unflatten_variables(flat: Mapping[tuple[str, ...], Any]) -> dict:
    """The inverse of `flatten_variables`.

    Example:
      >>> unflatten_variables({("params", "fc", "kernel"): 1})
      {'params': {'fc': {'kernel': 1}}}
    """
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out
