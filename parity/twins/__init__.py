"""The built-in pairs' Flax twins, importable where torch is not installed.

`parity.models` pairs each twin with its torch module (and imports torch); here are the Flax
sides alone, so that ``python -m parity check --golden G`` of a built-in model's golden file
runs on a machine without torch: the golden records the pair's configuration, and `flax_twin`
builds the twin from it. The layers whose numerics follow torch's (`layers.TorchBatchNorm`,
`layers.TorchLayerNorm`, `layers.TorchLSTM`, NNX's `nnx_layers.TorchBatchNorm`) live here too,
for your own torch-free Flax ports.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

__all__ = ["TWIN_NAMES", "flax_twin"]

# built-in model name -> module of its twin (cnn_bn is cnn with batch_norm=True in its config)
_MODULES = {
    "mlp": "mlp",
    "mlp_nnx": "mlp_nnx",
    "cnn": "cnn",
    "cnn_bn": "cnn",
    "lstm": "lstm",
    "transformer": "transformer",
    "resnet": "resnet",
}
TWIN_NAMES: tuple[str, ...] = tuple(_MODULES)


def flax_twin(
    name: str, config: Mapping[str, Any], dtype: Any = None, param_dtype: Any = jnp.float32
) -> Any:
    """The Flax twin of built-in model `name` with the pair's configuration `config`.

    Args:
      name: one of `TWIN_NAMES` (`parity.models.MODEL_NAMES`).
      config: the pair's full configuration (``ModelPair.config``; a golden file's
        ``model.config``).
      dtype, param_dtype: the Flax module's computation and parameter dtypes.

    Raises:
      ValueError: an unknown name (with the closest), or a configuration missing a field.

    Example:
      >>> twin = flax_twin("mlp", {"image_shape": [4, 4, 1], "hidden": 8, "num_classes": 3})
      >>> type(twin).__name__, twin.hidden
      ('FlaxMLP', 8)
    """
    if name not in _MODULES:
        close = difflib.get_close_matches(str(name), TWIN_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"flax_twin: unknown built-in model {name!r}{hint}; built-in: {', '.join(TWIN_NAMES)}."
        )
    module = importlib.import_module(f"parity.twins.{_MODULES[name]}")
    try:
        return module.flax_model(dict(config), dtype, param_dtype)
    except KeyError as e:
        raise ValueError(
            f"flax_twin({name!r}): the configuration lacks {e.args[0]!r} (give the pair's full "
            "configuration, as a golden file records it)."
        ) from None
