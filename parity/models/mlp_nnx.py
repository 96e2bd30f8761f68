"""`mlp_nnx`: the `mlp` pair with a Flax NNX module on the JAX side.

The same torch model (``TorchMLP``) and the same parameter names (``fc1/fc2/fc3`` with
``kernel``/``bias``), so the mapping and the data are `mlp`'s; the Flax side is an
``nnx.Module`` wrapped by `parity.pairs.adapters.as_flax_model`, which presents it to the trainer as
``(variables, inputs, train) -> logits`` with plain ``{"params": ...}`` dicts.
"""

from __future__ import annotations

from typing import Any

from parity.models import mlp
from parity.twins import mlp_nnx as twin
from parity.twins.mlp_nnx import NNXMLP  # noqa: F401  (the pair's Flax side)

DEFAULTS: dict[str, Any] = dict(mlp.DEFAULTS)


def build(config, dtype, param_dtype):
    torch_model, _ = mlp.build(config, dtype, param_dtype)
    return torch_model, twin.flax_model(config, dtype, param_dtype)


mapping = mlp.mapping
make_data = mlp.make_data
