"""Layer-level weight transfer between torch modules and Flax linen parameter dicts.

Each layer type has a pair of functions:

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

# The automatic mapping is part of this module's public face (`parity.transfer.auto`); it lives in
# parity.automap, beside the layer layouts it builds on (parity.pairs.layer_entries).
from parity.automap import TransferError, auto, explain, validate_variables
from parity.pairs.layer_entries import LSTM_GATES

__all__ = [
    "TransferError",
    "auto",
    "explain",
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


def _chw_permutation(input_chw: tuple[int, int, int]) -> np.ndarray:
    """Index map: position j in an HWC-flattened vector holds CHW-flattened feature perm[j]."""
    channels, height, width = input_chw
    return (
        np.arange(channels * height * width)
        .reshape(channels, height, width)
        .transpose(1, 2, 0)
        .ravel()
    )


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
    kernel = to_numpy(torch_layer.weight).T
    if input_chw is not None:
        _check_chw(input_chw, kernel.shape[0], "linear_to_flax")
        kernel = kernel[_chw_permutation(input_chw)]
    params = {"kernel": jnp.asarray(kernel, dtype=jnp.float32)}
    if torch_layer.bias is not None:
        params["bias"] = to_jax(torch_layer.bias)
    return params


def linear_from_flax(
    params: Mapping[str, Any],
    torch_layer: nn.Linear,
    *,
    input_chw: tuple[int, int, int] | None = None,
) -> None:
    """``flax.linen.Dense`` params -> ``nn.Linear`` in place (inverse of ``linear_to_flax``)."""
    _check_type(torch_layer, nn.Linear, "linear_from_flax")
    kernel = _as_float32(_get(params, "kernel", "linear_from_flax"))
    if input_chw is not None:
        _check_chw(input_chw, kernel.shape[0], "linear_from_flax")
        inverse = np.empty_like(perm := _chw_permutation(input_chw))
        inverse[perm] = np.arange(perm.size)
        kernel = kernel[inverse]
    _copy_into(torch_layer.weight, kernel.T, "linear_from_flax kernel")
    if torch_layer.bias is not None:
        _copy_into(
            torch_layer.bias, _get(params, "bias", "linear_from_flax"), "linear_from_flax bias"
        )


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


def conv_to_flax(torch_layer: nn.Conv2d) -> dict[str, jax.Array]:
    """``nn.Conv2d`` (OIHW) -> ``flax.linen.Conv`` params (HWIO). Groups and dilation must be 1."""
    _check_type(torch_layer, nn.Conv2d, "conv_to_flax")
    if torch_layer.groups != 1:
        raise ValueError(f"conv_to_flax: `groups` must be 1, got {torch_layer.groups}.")
    params = {"kernel": jnp.asarray(to_numpy(torch_layer.weight).transpose(2, 3, 1, 0))}
    if torch_layer.bias is not None:
        params["bias"] = to_jax(torch_layer.bias)
    return params


def conv_from_flax(params: Mapping[str, Any], torch_layer: nn.Conv2d) -> None:
    """``flax.linen.Conv`` params (HWIO) -> ``nn.Conv2d`` (OIHW) in place."""
    _check_type(torch_layer, nn.Conv2d, "conv_from_flax")
    kernel = _as_float32(_get(params, "kernel", "conv_from_flax"))
    if kernel.ndim != 4:
        raise ValueError(f"conv_from_flax: kernel must be 4-D HWIO, got shape {kernel.shape}.")
    _copy_into(torch_layer.weight, kernel.transpose(3, 2, 0, 1), "conv_from_flax kernel")
    if torch_layer.bias is not None:
        _copy_into(torch_layer.bias, _get(params, "bias", "conv_from_flax"), "conv_from_flax bias")


# --- LayerNorm --------------------------------------------------------------------------------


def layernorm_to_flax(torch_layer: nn.LayerNorm) -> dict[str, jax.Array]:
    """``nn.LayerNorm`` -> ``flax.linen.LayerNorm`` params. Build the Flax layer with
    ``epsilon=torch_layer.eps`` (torch 1e-5; Flax defaults to 1e-6) and ``use_fast_variance=False``."""
    _check_type(torch_layer, nn.LayerNorm, "layernorm_to_flax")
    if len(torch_layer.normalized_shape) != 1:
        raise ValueError(
            "layernorm_to_flax: only a 1-D `normalized_shape` (the last axis) is supported, got "
            f"{tuple(torch_layer.normalized_shape)}."
        )
    params = {}
    if torch_layer.weight is not None:
        params["scale"] = to_jax(torch_layer.weight)
    if torch_layer.bias is not None:
        params["bias"] = to_jax(torch_layer.bias)
    return params


def layernorm_from_flax(params: Mapping[str, Any], torch_layer: nn.LayerNorm) -> None:
    """``flax.linen.LayerNorm`` params -> ``nn.LayerNorm`` in place."""
    _check_type(torch_layer, nn.LayerNorm, "layernorm_from_flax")
    if torch_layer.weight is not None:
        _copy_into(torch_layer.weight, _get(params, "scale", "layernorm_from_flax"), "scale")
    if torch_layer.bias is not None:
        _copy_into(torch_layer.bias, _get(params, "bias", "layernorm_from_flax"), "bias")


# --- BatchNorm --------------------------------------------------------------------------------


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
    _check_type(torch_layer, (nn.BatchNorm1d, nn.BatchNorm2d), "batchnorm_to_flax")
    params = {}
    if torch_layer.affine:
        params = {"scale": to_jax(torch_layer.weight), "bias": to_jax(torch_layer.bias)}
    if torch_layer.running_mean is None or torch_layer.running_var is None:
        raise ValueError(
            "batchnorm_to_flax: the torch layer has no running statistics "
            "(track_running_stats=False); Flax BatchNorm needs them."
        )
    stats = {"mean": to_jax(torch_layer.running_mean), "var": to_jax(torch_layer.running_var)}
    return params, stats


def batchnorm_from_flax(
    params: Mapping[str, Any],
    batch_stats: Mapping[str, Any],
    torch_layer: nn.BatchNorm1d | nn.BatchNorm2d,
) -> None:
    """``flax.linen.BatchNorm`` params and batch_stats -> ``nn.BatchNorm{1,2}d`` in place."""
    _check_type(torch_layer, (nn.BatchNorm1d, nn.BatchNorm2d), "batchnorm_from_flax")
    if torch_layer.affine:
        _copy_into(torch_layer.weight, _get(params, "scale", "batchnorm_from_flax"), "scale")
        _copy_into(torch_layer.bias, _get(params, "bias", "batchnorm_from_flax"), "bias")
    if torch_layer.running_mean is not None and torch_layer.running_var is not None:
        _copy_into(
            torch_layer.running_mean, _get(batch_stats, "mean", "batchnorm_from_flax"), "mean"
        )
        _copy_into(torch_layer.running_var, _get(batch_stats, "var", "batchnorm_from_flax"), "var")


# --- Embedding --------------------------------------------------------------------------------


def embedding_to_flax(torch_layer: nn.Embedding) -> dict[str, jax.Array]:
    """``nn.Embedding`` -> ``flax.linen.Embed`` params (same layout)."""
    _check_type(torch_layer, nn.Embedding, "embedding_to_flax")
    return {"embedding": to_jax(torch_layer.weight)}


def embedding_from_flax(params: Mapping[str, Any], torch_layer: nn.Embedding) -> None:
    """``flax.linen.Embed`` params -> ``nn.Embedding`` in place."""
    _check_type(torch_layer, nn.Embedding, "embedding_from_flax")
    _copy_into(torch_layer.weight, _get(params, "embedding", "embedding_from_flax"), "embedding")


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
    ``h{gate}`` (hidden, with bias). The two torch biases are summed into ``h{gate}.bias``. Both
    start from a zero carry and compute ``c' = f*c + i*g``, ``h' = o*tanh(c')``.
    """
    _check_lstm(torch_layer, layer, "lstm_to_flax")
    hidden = torch_layer.hidden_size
    w_ih = to_numpy(getattr(torch_layer, f"weight_ih_l{layer}"))
    w_hh = to_numpy(getattr(torch_layer, f"weight_hh_l{layer}"))
    bias = np.zeros((4 * hidden,), np.float32)
    if torch_layer.bias:
        bias = to_numpy(getattr(torch_layer, f"bias_ih_l{layer}")) + to_numpy(
            getattr(torch_layer, f"bias_hh_l{layer}")
        )
    params: dict[str, dict[str, jax.Array]] = {}
    for index, gate in enumerate(LSTM_GATES):
        rows = slice(index * hidden, (index + 1) * hidden)
        params[f"i{gate}"] = {"kernel": jnp.asarray(w_ih[rows].T)}
        params[f"h{gate}"] = {"kernel": jnp.asarray(w_hh[rows].T), "bias": jnp.asarray(bias[rows])}
    return params


def lstm_from_flax(params: Mapping[str, Any], torch_layer: nn.LSTM, *, layer: int = 0) -> None:
    """Flax LSTM cell params -> one layer of ``nn.LSTM`` in place (bias into ``bias_hh``)."""
    _check_lstm(torch_layer, layer, "lstm_from_flax")
    w_ih, w_hh, bias = [], [], []
    for gate in LSTM_GATES:
        w_ih.append(
            _as_float32(
                _get(_get(params, f"i{gate}", "lstm_from_flax"), "kernel", "lstm_from_flax")
            ).T
        )
        hidden_dense = _get(params, f"h{gate}", "lstm_from_flax")
        w_hh.append(_as_float32(_get(hidden_dense, "kernel", "lstm_from_flax")).T)
        bias.append(_as_float32(_get(hidden_dense, "bias", "lstm_from_flax")))
    _copy_into(getattr(torch_layer, f"weight_ih_l{layer}"), np.concatenate(w_ih), "weight_ih")
    _copy_into(getattr(torch_layer, f"weight_hh_l{layer}"), np.concatenate(w_hh), "weight_hh")
    if torch_layer.bias:
        b_hh = np.concatenate(bias)
        _copy_into(getattr(torch_layer, f"bias_hh_l{layer}"), b_hh, "bias_hh")
        _copy_into(getattr(torch_layer, f"bias_ih_l{layer}"), np.zeros_like(b_hh), "bias_ih")
    elif np.any(np.concatenate(bias) != 0):
        raise ValueError(
            "lstm_from_flax: the torch LSTM has bias=False but the Flax biases are non-zero."
        )


def torch_lstm_to_flax(torch_layer: nn.LSTM, *, layer: int = 0) -> dict[str, jax.Array]:
    """One layer of ``nn.LSTM`` -> ``parity.twins.layers.TorchLSTM`` params, both biases kept.

    ``kernel_ih = weight_ih_l{layer}.T`` (in, 4H), ``kernel_hh = weight_hh_l{layer}.T`` (H, 4H),
    ``bias_ih``/``bias_hh`` as they are (omitted when torch's ``bias=False``; build the Flax layer
    with ``use_bias=False`` then). Gate order ``i, f, g, o`` in both.
    """
    _check_lstm(torch_layer, layer, "torch_lstm_to_flax")
    params = {
        "kernel_ih": jnp.asarray(to_numpy(getattr(torch_layer, f"weight_ih_l{layer}")).T),
        "kernel_hh": jnp.asarray(to_numpy(getattr(torch_layer, f"weight_hh_l{layer}")).T),
    }
    if torch_layer.bias:
        params["bias_ih"] = to_jax(getattr(torch_layer, f"bias_ih_l{layer}"))
        params["bias_hh"] = to_jax(getattr(torch_layer, f"bias_hh_l{layer}"))
    return params


def torch_lstm_from_flax(
    params: Mapping[str, Any], torch_layer: nn.LSTM, *, layer: int = 0
) -> None:
    """``parity.twins.layers.TorchLSTM`` params -> one layer of ``nn.LSTM`` in place."""
    function = "torch_lstm_from_flax"
    _check_lstm(torch_layer, layer, function)
    for name in ("ih", "hh"):
        kernel = _as_float32(_get(params, f"kernel_{name}", function)).T
        _copy_into(getattr(torch_layer, f"weight_{name}_l{layer}"), kernel, f"weight_{name}")
    has_bias = "bias_ih" in params or "bias_hh" in params
    if torch_layer.bias:
        for name in ("ih", "hh"):
            bias = _get(params, f"bias_{name}", function)
            _copy_into(getattr(torch_layer, f"bias_{name}_l{layer}"), bias, f"bias_{name}")
    elif has_bias:
        raise ValueError(
            f"{function}: the torch LSTM has bias=False but the Flax params have biases."
        )


# --- Multi-head attention ---------------------------------------------------------------------


def _check_attention(torch_layer: nn.MultiheadAttention, function: str) -> tuple[int, int, int]:
    _check_type(torch_layer, nn.MultiheadAttention, function)
    if not torch_layer._qkv_same_embed_dim or torch_layer.in_proj_weight is None:
        raise ValueError(f"{function}: kdim/vdim different from embed_dim are not supported.")
    if torch_layer.bias_k is not None or torch_layer.add_zero_attn:
        raise ValueError(f"{function}: add_bias_kv and add_zero_attn are not supported.")
    embed, heads = torch_layer.embed_dim, torch_layer.num_heads
    return embed, heads, embed // heads


def attention_to_flax(torch_layer: nn.MultiheadAttention) -> dict[str, dict[str, jax.Array]]:
    """``nn.MultiheadAttention`` -> ``flax.linen.MultiHeadDotProductAttention`` params.

    Build the Flax layer with the same ``num_heads``, ``qkv_features = out_features = embed_dim``
    and ``use_bias`` as torch's ``bias``. Both scale queries by ``1/sqrt(head_dim)``.
    """
    embed, heads, head_dim = _check_attention(torch_layer, "attention_to_flax")
    weight = to_numpy(torch_layer.in_proj_weight)  # rows: q, k, v
    bias = None if torch_layer.in_proj_bias is None else to_numpy(torch_layer.in_proj_bias)
    params: dict[str, dict[str, jax.Array]] = {}
    for index, name in enumerate(("query", "key", "value")):
        rows = slice(index * embed, (index + 1) * embed)
        params[name] = {"kernel": jnp.asarray(weight[rows].T.reshape(embed, heads, head_dim))}
        if bias is not None:
            params[name]["bias"] = jnp.asarray(bias[rows].reshape(heads, head_dim))
    out = torch_layer.out_proj
    params["out"] = {"kernel": jnp.asarray(to_numpy(out.weight).T.reshape(heads, head_dim, embed))}
    if out.bias is not None:
        params["out"]["bias"] = to_jax(out.bias)
    return params


def attention_from_flax(params: Mapping[str, Any], torch_layer: nn.MultiheadAttention) -> None:
    """``flax.linen.MultiHeadDotProductAttention`` params -> ``nn.MultiheadAttention`` in place."""
    embed, _, _ = _check_attention(torch_layer, "attention_from_flax")
    weights, biases = [], []
    for name in ("query", "key", "value"):
        dense = _get(params, name, "attention_from_flax")
        weights.append(
            _as_float32(_get(dense, "kernel", "attention_from_flax")).reshape(embed, embed).T
        )
        if torch_layer.in_proj_bias is not None:
            biases.append(_as_float32(_get(dense, "bias", "attention_from_flax")).reshape(embed))
    _copy_into(torch_layer.in_proj_weight, np.concatenate(weights), "in_proj_weight")
    if torch_layer.in_proj_bias is not None:
        _copy_into(torch_layer.in_proj_bias, np.concatenate(biases), "in_proj_bias")
    out = _get(params, "out", "attention_from_flax")
    kernel = _as_float32(_get(out, "kernel", "attention_from_flax")).reshape(embed, embed)
    _copy_into(torch_layer.out_proj.weight, kernel.T, "out_proj.weight")
    if torch_layer.out_proj.bias is not None:
        _copy_into(
            torch_layer.out_proj.bias, _get(out, "bias", "attention_from_flax"), "out_proj.bias"
        )
