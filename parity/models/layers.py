"""Moved: `parity.twins.layers` (importable without torch). This address warns, for one release."""

import warnings

from parity.twins.layers import TorchBatchNorm, TorchLayerNorm, TorchLSTM

__all__ = ["TorchBatchNorm", "TorchLSTM", "TorchLayerNorm"]

warnings.warn(
    "parity.models.layers moved to parity.twins.layers (importable without torch); import "
    "TorchBatchNorm, TorchLayerNorm and TorchLSTM from there.",
    DeprecationWarning,
    stacklevel=2,
)
