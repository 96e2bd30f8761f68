"""Layer-level weight transfer between torch modules and Flax linen parameter dicts.

Each layer type has a pair of functions, each the layer's layout in `parity.pairs.layer_entries`
(written once there: the built-in models' and the automatic mappings are made of the same
entries) applied to the layer alone:

- ``<layer>_to_flax(torch_layer) -> dict``: the Flax parameter subtree (float32 ``jnp`` arrays) for the
  matching ``flax.linen`` layer, e.g. ``{"kernel": ..., "bias": ...}`` for ``nn.Dense``;
- ``<layer>_from_flax(params, torch_layer) -> None``: copy a Flax subtree into the torch layer in place
  (any float dtype in, the torch layer's dtype out).

Layout conventions handled here:

====================  ===============================  ======================================
layer                 torch                            flax.linen
====================  ===============================  ======================================
Linear / Dense        weight (out, in), bias           kernel (in, out), bias
Conv2d / Conv         weight OIHW (NCHW data)          kernel HWIO (NHWC data)
LayerNorm             weight, bias (eps 1e-5)          scale, bias (set ``epsilon=1e-5``)
BatchNorm2d           weight, bias, running_mean/var   params scale/bias; batch_stats mean/var
Embedding             weight (num, features)           embedding (num, features)
LSTM                  weight_ih (4H, in), weight_hh,   ``OptimizedLSTMCell``/``LSTMCell``:
                      b_ih + b_hh; gate rows i,f,g,o   ii/if/ig/io kernels (no bias),
                                                       hi/hf/hg/ho kernels + bias
LSTM (two biases)     weight_ih, weight_hh, b_ih,      ``parity.twins.layers.TorchLSTM``:
                      b_hh                             kernel_ih (in, 4H), bias_ih,
                                                       kernel_hh (H, 4H), bias_hh
MultiheadAttention    in_proj_weight (3E, E) q;k;v,    ``MultiHeadDotProductAttention``:
                      out_proj (E, E)                  query/key/value kernel (E, H, D),
                                                       bias (H, D); out kernel (H, D, E)
====================  ===============================  ======================================

torch's LSTM has two biases per gate, Flax's cells one: ``lstm_to_flax`` sums them;
``lstm_from_flax`` puts the Flax bias in ``bias_hh`` and zeros ``bias_ih`` (same function, different
split). That is enough for a forward pass but not for training: the optimizer updates each torch
bias separately (AdamW moves both by ~lr per step, so their sum moves twice as far as one Flax
bias). For training parity use ``TorchLSTM`` with ``torch_lstm_to_flax``/``torch_lstm_from_flax``,
which keep both biases.

A linear layer that follows a flatten sees features in ``C, H, W`` order in torch (NCHW) and
``H, W, C`` order in Flax (NHWC): pass ``input_chw=(C, H, W)`` to ``linear_to_flax`` /
``linear_from_flax`` and the input rows are permuted accordingly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

# The automatic mapping's one public address is this module (`parity.transfer.auto`); its
# implementation is the package parity.automap, beside the layer layouts it builds on
# (parity.pairs.layer_entries).
from parity.automap.core import auto
from parity.automap.explain import explain, format_explanation
from parity.automap.units import TransferError
from parity.automap.validate import validate_variables
from parity.pairs.layer_entries import (
    LSTM_GATES,
    attention_entries,
    conv_entries,
    embedding_entries,
    linear_entries,
    lstm_cell_entries,
    norm_entries,
    torch_lstm_entries,
)
from parity.pairs.mapping import MappingEntry, MappingError, WeightMapping

__all__ = [
    "TransferError",
    "auto",
    "explain",
    "format_explanation",
    "validate_variables",
    "attention_from_flax",
    "attention_to_flax",
    "batchnorm_from_flax",
    "batchnorm_to_flax",
    "conv_from_flax",
    "conv_to_flax",
    "embedding_from_flax",
    "embedding_to_flax",
    "layernorm_from_flax",
    "layernorm_to_flax",
    "linear_from_flax",
    "linear_to_flax",
    "lstm_from_flax",
    "lstm_to_flax",
    "to_jax",
    "to_numpy",
    "torch_lstm_from_flax",
    "torch_lstm_to_flax",
]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A float32 numpy copy of a torch tensor (any float dtype, any device)."""
    return tensor.detach().to(device="cpu", dtype=torch.float32).numpy().copy()


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """A float32 ``jnp`` array from a torch tensor."""
    return jnp.asarray(to_numpy(tensor), dtype=jnp.float32)


def _as_float32(array: Any) -> np.ndarray:
    # np.array(..., copy) keeps the result writable: torch.from_numpy warns on read-only arrays.
    return np.array(np.asarray(array), dtype=np.float32, copy=True)


def _copy_into(target: torch.Tensor, value: Any, what: str) -> None:
    array = _as_float32(value)
    if tuple(array.shape) != tuple(target.shape):
        raise ValueError(
            f"{what}: shape {tuple(array.shape)} from Flax does not match the torch shape "
            f"{tuple(target.shape)}; check the layer sizes of the two models."
        )
    with torch.no_grad():
        target.copy_(torch.from_numpy(array).to(device=target.device, dtype=target.dtype))


def _check_type(layer: Any, expected: type | tuple[type, ...], function: str) -> None:
    if not isinstance(layer, expected):
        names = (
            " or ".join(t.__name__ for t in expected)
            if isinstance(expected, tuple)
            else expected.__name__
        )
        raise TypeError(
            f"{function}: `torch_layer` must be a torch.nn.{names}, got {type(layer).__name__}."
        )


def _get(params: Mapping[str, Any], key: str, function: str) -> Any:
    try:
        return params[key]
    except (KeyError, TypeError):
        keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        raise ValueError(
            f"{function}: `params` has no entry {key!r} (got {keys}); pass the subtree of this layer."
        ) from None


# Every layout below is the layer's entries in `parity.pairs.layer_entries` (the same entries the
# built-in models' and the automatic mappings are made of), applied through a `WeightMapping` to
# the layer alone: this module checks what the layer must be and what the caller passed.


def _to_flax(entries: list[MappingEntry], torch_layer: nn.Module) -> dict[str, Any]:
    """The layer's Flax variables (``{"params": ..., "batch_stats": ...}``, float32)."""
    return WeightMapping(tuple(entries)).to_flax(torch_layer)


def _from_flax(
    entries: list[MappingEntry], variables: Mapping[str, Any], torch_layer: nn.Module, function: str
) -> None:
    """Copies `variables` (``{"params": the layer's subtree, ...}``) into `torch_layer` in place,
    naming a missing entry or a shape that does not fit as the layer function `function`."""
    for entry in entries:
        node = variables
        for key in entry.flax_path:
            node = _get(node, key, function)
    try:
        WeightMapping(tuple(entries)).to_torch(variables, torch_layer)
    except MappingError as e:
        raise ValueError(f"{function}: {e}") from None


# --- Linear / Dense ------------------------------------------------------------------------------


def linear_to_flax(
    torch_layer: nn.Linear, *, input_chw: tuple[int, int, int] | None = None
) -> dict[str, jax.Array]:
    """``nn.Linear`` -> ``flax.linen.Dense`` params (kernel = weight transposed).

    Args:
      torch_layer: the torch layer.
      input_chw: ``(C, H, W)`` when the layer's input is a flattened NCHW feature map whose Flax
        counterpart is a flattened NHWC map; the kernel rows are permuted to HWC order.
    """
    _check_type(torch_layer, nn.Linear, "linear_to_flax")
    if input_chw is not None:
        _check_chw(input_chw, torch_layer.in_features, "linear_to_flax")
    return _to_flax(linear_entries("", (), torch_layer, input_chw=input_chw), torch_layer)["params"]


def linear_from_flax(
    params: Mapping[str, Any],
    torch_layer: nn.Linear,
    *,
    input_chw: tuple[int, int, int] | None = None,
) -> None:
    """``flax.linen.Dense`` params -> ``nn.Linear`` in place (inverse of ``linear_to_flax``)."""
    _check_type(torch_layer, nn.Linear, "linear_from_flax")
    if input_chw is not None:
        _check_chw(input_chw, torch_layer.in_features, "linear_from_flax")
    entries = linear_entries("", (), torch_layer, input_chw=input_chw)
    _from_flax(entries, {"params": params}, torch_layer, "linear_from_flax")


def _check_chw(input_chw: Any, features: int, function: str) -> None:
    if (
        not isinstance(input_chw, tuple | list)
        or len(input_chw) != 3
        or int(np.prod(input_chw)) != features
    ):
        raise ValueError(
            f"{function}: `input_chw` must be a (C, H, W) tuple whose product is the layer's "
            f"{features} input features, got {input_chw!r}."
        )


# --- Conv -------------------------------------------------------------------------------------


def _check_conv(torch_layer: nn.Conv2d, function: str) -> None:
    _check_type(torch_layer, nn.Conv2d, function)
    if torch_layer.groups != 1:
        raise ValueError(f"{function}: `groups` must be 1, got {torch_layer.groups}.")


def conv_to_flax(torch_layer: nn.Conv2d) -> dict[str, jax.Array]:
    """``nn.Conv2d`` (OIHW) -> ``flax.linen.Conv`` params (HWIO). Groups and dilation must be 1."""
    _check_conv(torch_layer, "conv_to_flax")
    return _to_flax(conv_entries("", (), torch_layer), torch_layer)["params"]


def conv_from_flax(params: Mapping[str, Any], torch_layer: nn.Conv2d) -> None:
    """``flax.linen.Conv`` params (HWIO) -> ``nn.Conv2d`` (OIHW) in place."""
    _check_conv(torch_layer, "conv_from_flax")
    kernel = np.asarray(_get(params, "kernel", "conv_from_flax"))
    if kernel.ndim != 4:
        raise ValueError(f"conv_from_flax: kernel must be 4-D HWIO, got shape {kernel.shape}.")
    _from_flax(conv_entries("", (), torch_layer), {"params": params}, torch_layer, "conv_from_flax")


# --- LayerNorm --------------------------------------------------------------------------------


def _check_layernorm(torch_layer: nn.LayerNorm, function: str) -> None:
    _check_type(torch_layer, nn.LayerNorm, function)
    if len(torch_layer.normalized_shape) != 1:
        raise ValueError(
            f"{function}: only a 1-D `normalized_shape` (the last axis) is supported, got "
            f"{tuple(torch_layer.normalized_shape)}."
        )


def layernorm_to_flax(torch_layer: nn.LayerNorm) -> dict[str, jax.Array]:
    """``nn.LayerNorm`` -> ``flax.linen.LayerNorm`` params. Build the Flax layer with
    ``epsilon=torch_layer.eps`` (torch 1e-5; Flax defaults to 1e-6) and ``use_fast_variance=False``."""
    _check_layernorm(torch_layer, "layernorm_to_flax")
    return _to_flax(norm_entries("", (), torch_layer), torch_layer).get("params", {})


def layernorm_from_flax(params: Mapping[str, Any], torch_layer: nn.LayerNorm) -> None:
    """``flax.linen.LayerNorm`` params -> ``nn.LayerNorm`` in place."""
    _check_type(torch_layer, nn.LayerNorm, "layernorm_from_flax")
    entries = norm_entries("", (), torch_layer)
    _from_flax(entries, {"params": params}, torch_layer, "layernorm_from_flax")


# --- BatchNorm --------------------------------------------------------------------------------


def _check_batchnorm(torch_layer: nn.BatchNorm1d | nn.BatchNorm2d, function: str) -> None:
    _check_type(torch_layer, (nn.BatchNorm1d, nn.BatchNorm2d), function)
    if torch_layer.running_mean is None or torch_layer.running_var is None:
        raise ValueError(
            f"{function}: the torch layer has no running statistics "
            "(track_running_stats=False); Flax BatchNorm needs them."
        )


def batchnorm_to_flax(
    torch_layer: nn.BatchNorm1d | nn.BatchNorm2d,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """``nn.BatchNorm{1,2}d`` -> ``(params, batch_stats)`` for ``flax.linen.BatchNorm``.

    Returns ``params = {"scale", "bias"}`` and ``batch_stats = {"mean", "var"}`` (the running
    statistics). Build the Flax layer with ``momentum = 1 - torch momentum`` (0.9 for torch's 0.1)
    and ``epsilon = torch eps``.

    Warning: in training, torch updates ``running_var`` with the *unbiased* batch variance
    (``n / (n - 1)`` times the biased one used for normalising); ``flax.linen.BatchNorm`` uses the
    biased one, so running variances drift apart. ``parity.twins.layers.TorchBatchNorm`` matches
    torch exactly and uses the same parameter names.
    """
    _check_batchnorm(torch_layer, "batchnorm_to_flax")
    variables = _to_flax(norm_entries("", (), torch_layer), torch_layer)
    return variables.get("params", {}), variables["batch_stats"]


def batchnorm_from_flax(
    params: Mapping[str, Any],
    batch_stats: Mapping[str, Any],
    torch_layer: nn.BatchNorm1d | nn.BatchNorm2d,
) -> None:
    """``flax.linen.BatchNorm`` params and batch_stats -> ``nn.BatchNorm{1,2}d`` in place."""
    _check_type(torch_layer, (nn.BatchNorm1d, nn.BatchNorm2d), "batchnorm_from_flax")
    entries = norm_entries("", (), torch_layer)
    variables = {"params": params, "batch_stats": batch_stats}
    _from_flax(entries, variables, torch_layer, "batchnorm_from_flax")


# --- Embedding --------------------------------------------------------------------------------


def embedding_to_flax(torch_layer: nn.Embedding) -> dict[str, jax.Array]:
    """``nn.Embedding`` -> ``flax.linen.Embed`` params (same layout)."""
    _check_type(torch_layer, nn.Embedding, "embedding_to_flax")
    return _to_flax(embedding_entries("", (), torch_layer), torch_layer)["params"]


def embedding_from_flax(params: Mapping[str, Any], torch_layer: nn.Embedding) -> None:
    """``flax.linen.Embed`` params -> ``nn.Embedding`` in place."""
    _check_type(torch_layer, nn.Embedding, "embedding_from_flax")
    entries = embedding_entries("", (), torch_layer)
    _from_flax(entries, {"params": params}, torch_layer, "embedding_from_flax")


# --- LSTM -------------------------------------------------------------------------------------


def _check_lstm(torch_layer: nn.LSTM, layer: int, function: str) -> None:
    _check_type(torch_layer, nn.LSTM, function)
    if torch_layer.bidirectional or torch_layer.proj_size:
        raise ValueError(
            f"{function}: only unidirectional LSTMs without projection are supported "
            f"(bidirectional={torch_layer.bidirectional}, proj_size={torch_layer.proj_size})."
        )
    if not 0 <= layer < torch_layer.num_layers:
        raise ValueError(
            f"{function}: `layer` must be in [0, {torch_layer.num_layers}), got {layer}."
        )


def lstm_to_flax(torch_layer: nn.LSTM, *, layer: int = 0) -> dict[str, dict[str, jax.Array]]:
    """One layer of ``nn.LSTM`` -> ``flax.linen.OptimizedLSTMCell``/``LSTMCell`` params.

    torch stacks the gates as rows ``i, f, g, o`` of ``weight_ih_l{layer}`` (4H, in) and
    ``weight_hh_l{layer}`` (4H, H); Flax has one Dense per gate: ``i{gate}`` (input, no bias) and
    ``h{gate}`` (hidden, with bias). The two torch biases are summed into ``h{gate}.bias`` (zeros
    where torch's ``bias=False``). Both start from a zero carry and compute ``c' = f*c + i*g``,
    ``h' = o*tanh(c')``.
    """
    _check_lstm(torch_layer, layer, "lstm_to_flax")
    params = _to_flax(lstm_cell_entries("", (), torch_layer, layer=layer), torch_layer)["params"]
    if not torch_layer.bias:  # a Flax cell always has its hidden biases
        zeros = jnp.zeros((torch_layer.hidden_size,), jnp.float32)
        params = {
            name: {**dense, "bias": zeros} if name[0] == "h" else dense
            for name, dense in params.items()
        }
    return params


def lstm_from_flax(params: Mapping[str, Any], torch_layer: nn.LSTM, *, layer: int = 0) -> None:
    """Flax LSTM cell params -> one layer of ``nn.LSTM`` in place (the summed bias into
    ``bias_hh``, ``bias_ih`` zeroed: their sum is what the Flax cell holds)."""
    function = "lstm_from_flax"
    _check_lstm(torch_layer, layer, function)
    entries = lstm_cell_entries("", (), torch_layer, layer=layer)
    weights = [e for e in entries if not e.torch_name.startswith("bias")]
    _from_flax(weights, {"params": params}, torch_layer, function)
    bias = np.concatenate(
        [
            _as_float32(_get(_get(params, f"h{gate}", function), "bias", function))
            for gate in LSTM_GATES
        ]
    )
    if torch_layer.bias:
        _copy_into(getattr(torch_layer, f"bias_hh_l{layer}"), bias, "bias_hh")
        _copy_into(getattr(torch_layer, f"bias_ih_l{layer}"), np.zeros_like(bias), "bias_ih")
    elif np.any(bias != 0):
        raise ValueError(
            f"{function}: the torch LSTM has bias=False but the Flax biases are non-zero."
        )


def torch_lstm_to_flax(torch_layer: nn.LSTM, *, layer: int = 0) -> dict[str, jax.Array]:
    """One layer of ``nn.LSTM`` -> ``parity.twins.layers.TorchLSTM`` params, both biases kept.

    ``kernel_ih = weight_ih_l{layer}.T`` (in, 4H), ``kernel_hh = weight_hh_l{layer}.T`` (H, 4H),
    ``bias_ih``/``bias_hh`` as they are (omitted when torch's ``bias=False``; build the Flax layer
    with ``use_bias=False`` then). Gate order ``i, f, g, o`` in both.
    """
    _check_lstm(torch_layer, layer, "torch_lstm_to_flax")
    entries = torch_lstm_entries("", (), torch_layer, layer=layer)
    return _to_flax(entries, torch_layer)["params"]


def torch_lstm_from_flax(
    params: Mapping[str, Any], torch_layer: nn.LSTM, *, layer: int = 0
) -> None:
    """``parity.twins.layers.TorchLSTM`` params -> one layer of ``nn.LSTM`` in place."""
    function = "torch_lstm_from_flax"
    _check_lstm(torch_layer, layer, function)
    if not torch_layer.bias and ("bias_ih" in params or "bias_hh" in params):
        raise ValueError(
            f"{function}: the torch LSTM has bias=False but the Flax params have biases."
        )
    entries = torch_lstm_entries("", (), torch_layer, layer=layer)
    _from_flax(entries, {"params": params}, torch_layer, function)


# --- Multi-head attention ---------------------------------------------------------------------


def _check_attention(torch_layer: nn.MultiheadAttention, function: str) -> None:
    _check_type(torch_layer, nn.MultiheadAttention, function)
    if not torch_layer._qkv_same_embed_dim or torch_layer.in_proj_weight is None:
        raise ValueError(f"{function}: kdim/vdim different from embed_dim are not supported.")
    if torch_layer.bias_k is not None or torch_layer.add_zero_attn:
        raise ValueError(f"{function}: add_bias_kv and add_zero_attn are not supported.")


def attention_to_flax(torch_layer: nn.MultiheadAttention) -> dict[str, dict[str, jax.Array]]:
    """``nn.MultiheadAttention`` -> ``flax.linen.MultiHeadDotProductAttention`` params.

    Build the Flax layer with the same ``num_heads``, ``qkv_features = out_features = embed_dim``
    and ``use_bias`` as torch's ``bias``. Both scale queries by ``1/sqrt(head_dim)``.
    """
    _check_attention(torch_layer, "attention_to_flax")
    return _to_flax(attention_entries("", (), torch_layer), torch_layer)["params"]


def attention_from_flax(params: Mapping[str, Any], torch_layer: nn.MultiheadAttention) -> None:
    """``flax.linen.MultiHeadDotProductAttention`` params -> ``nn.MultiheadAttention`` in place."""
    _check_attention(torch_layer, "attention_from_flax")
    entries = attention_entries("", (), torch_layer)
    _from_flax(entries, {"params": params}, torch_layer, "attention_from_flax")
