"""Moved: `parity.twins.nnx_layers` (importable without torch). This address warns, for one
release."""

import warnings

from parity.twins.nnx_layers import TorchBatchNorm

__all__ = ["TorchBatchNorm"]

warnings.warn(
    "parity.models.nnx_layers moved to parity.twins.nnx_layers (importable without torch); "
    "import TorchBatchNorm from there.",
    DeprecationWarning,
    stacklevel=2,
)
