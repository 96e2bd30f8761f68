"""Per-layer weight layouts as data: `MappingEntry` rows for a `parity.pairs.mapping.WeightMapping`.

Each layer's layout is written here once (Linear, Conv, norms, Embedding, LSTM cells, GRU cells,
attention), as mapping entries: the built-in model pairs (`parity.models`) and the automatic
mapping (`parity.automap`) build their `WeightMapping` from them, and the layer functions of
`parity.transfer` (``linear_to_flax``...) apply them to one layer.
"""

from __future__ import annotations

from torch import nn

from parity.pairs.mapping import MappingEntry, layer_entries

__all__ = [
    "LSTM_GATES",
    "attention_entries",
    "conv_entries",
    "embedding_entries",
    "gru_cell_entries",
    "linear_entries",
    "lstm_cell_entries",
    "norm_entries",
    "torch_lstm_entries",
]

LSTM_GATES = ("i", "f", "g", "o")  # torch's row order in weight_ih / weight_hh


def _flax_path(flax_module) -> tuple[str, ...]:
    if isinstance(flax_module, str):
        return tuple(p for p in flax_module.split("/") if p)
    return tuple(str(p) for p in flax_module)


def linear_entries(
    torch_name: str,
    flax_module,
    torch_layer: nn.Module,
    *,
    input_chw: tuple[int, ...] | None = None,
) -> list[MappingEntry]:
    """Entries for ``nn.Linear`` -> ``Dense``; `input_chw` as in `linear_to_flax`.

    Example:
      >>> [e.transform for e in linear_entries("fc", "fc", nn.Linear(4, 2))]
      ['linear', 'identity']
    """
    transform = "linear" if input_chw is None else f"linear|chw({','.join(map(str, input_chw))})"
    rows = [("weight", "kernel", transform)]
    if getattr(torch_layer, "bias", None) is not None:
        rows.append(("bias", "bias", "identity"))
    return layer_entries(torch_name, _flax_path(flax_module), rows)


def conv_entries(torch_name: str, flax_module, torch_layer: nn.Module) -> list[MappingEntry]:
    """Entries for ``nn.ConvNd`` (any groups) -> ``Conv`` (``feature_group_count=groups``), or
    ``nn.ConvTransposeNd`` -> ``ConvTranspose`` (``transpose_kernel=False``)."""
    kind = "conv_transpose" if isinstance(torch_layer, nn.modules.conv._ConvTransposeNd) else "conv"
    rows = [("weight", "kernel", kind)]
    if torch_layer.bias is not None:
        rows.append(("bias", "bias", "identity"))
    return layer_entries(torch_name, _flax_path(flax_module), rows)


def norm_entries(torch_name: str, flax_module, torch_layer: nn.Module) -> list[MappingEntry]:
    """Entries for LayerNorm / RMSNorm / GroupNorm (``weight`` -> ``scale``, ``bias``) and for
    BatchNorm (plus ``running_mean``/``running_var`` -> ``batch_stats`` ``mean``/``var``)."""
    rows = []
    if getattr(torch_layer, "weight", None) is not None:
        rows.append(("weight", "scale", "identity"))
    if getattr(torch_layer, "bias", None) is not None:
        rows.append(("bias", "bias", "identity"))
    if getattr(torch_layer, "running_mean", None) is not None:
        rows.append(("running_mean", ("batch_stats", "mean"), "identity"))
        rows.append(("running_var", ("batch_stats", "var"), "identity"))
    return layer_entries(torch_name, _flax_path(flax_module), rows)


def embedding_entries(torch_name: str, flax_module, torch_layer: nn.Module) -> list[MappingEntry]:
    """Entries for ``nn.Embedding`` -> ``Embed``."""
    return layer_entries(torch_name, _flax_path(flax_module), [("weight", "embedding", "identity")])


def torch_lstm_entries(
    torch_name: str, flax_module, torch_layer: nn.LSTM, *, layer: int = 0
) -> list[MappingEntry]:
    """Entries for one ``nn.LSTM`` layer -> ``parity.twins.layers.TorchLSTM``."""
    rows = [
        (f"weight_ih_l{layer}", "kernel_ih", "linear"),
        (f"weight_hh_l{layer}", "kernel_hh", "linear"),
    ]
    if torch_layer.bias:
        rows += [(f"bias_ih_l{layer}", "bias_ih", "identity")]
        rows += [(f"bias_hh_l{layer}", "bias_hh", "identity")]
    return layer_entries(torch_name, _flax_path(flax_module), rows)


def lstm_cell_entries(
    torch_name: str,
    flax_module,
    torch_layer: nn.LSTM,
    *,
    layer: int = 0,
    forget_name: str = "if",
) -> list[MappingEntry]:
    """Entries for one ``nn.LSTM`` layer -> a Flax ``LSTMCell``/``OptimizedLSTMCell``
    (``forget_name="if_"`` for ``nnx.LSTMCell``). The two torch biases are summed into
    ``h{gate}.bias``: fine for a forward pass, not for training (see `lstm_to_flax`)."""
    rows = []
    for index, gate in enumerate(LSTM_GATES):
        gate_name = forget_name if gate == "f" else f"i{gate}"
        chunk = f"chunk(0,{index},4)"
        rows.append((f"weight_ih_l{layer}", (gate_name, "kernel"), f"{chunk}|linear"))
        rows.append((f"weight_hh_l{layer}", (f"h{gate}", "kernel"), f"{chunk}|linear"))
        if torch_layer.bias:
            rows.append((f"bias_ih_l{layer}", (f"h{gate}", "bias"), chunk))
            rows.append((f"bias_hh_l{layer}", (f"h{gate}", "bias"), chunk))
    return layer_entries(
        torch_name, _flax_path(flax_module), [(t, ("params", *f), x) for t, f, x in rows]
    )


def gru_cell_entries(
    torch_name: str, flax_module, torch_layer: nn.GRU, *, layer: int = 0
) -> list[MappingEntry]:
    """Entries for one ``nn.GRU`` layer -> ``flax.linen.GRUCell`` (gate rows r, z, n; ``ir/iz``
    biases hold ``b_i + b_h`` summed, ``in`` holds ``b_in`` and ``hn`` holds ``b_hn``)."""
    rows = []
    for index, gate in enumerate(("r", "z", "n")):
        chunk = f"chunk(0,{index},3)"
        rows.append((f"weight_ih_l{layer}", (f"i{gate}", "kernel"), f"{chunk}|linear"))
        rows.append((f"weight_hh_l{layer}", (f"h{gate}", "kernel"), f"{chunk}|linear"))
        if torch_layer.bias:
            rows.append((f"bias_ih_l{layer}", (f"i{gate}", "bias"), chunk))
            target = "hn" if gate == "n" else f"i{gate}"
            rows.append((f"bias_hh_l{layer}", (target, "bias"), chunk))
    return layer_entries(
        torch_name, _flax_path(flax_module), [(t, ("params", *f), x) for t, f, x in rows]
    )


def attention_entries(
    torch_name: str, flax_module, torch_layer: nn.MultiheadAttention
) -> list[MappingEntry]:
    """Entries for ``nn.MultiheadAttention`` -> ``MultiHeadDotProductAttention`` (linen) /
    ``nnx.MultiHeadAttention``: fused ``in_proj`` split into query/key/value ``(E, H, D)``
    kernels, or separate ``q/k/v_proj_weight``; ``out_proj`` -> ``out`` ``(H, D, E)``."""
    embed, heads = torch_layer.embed_dim, torch_layer.num_heads
    head_dim = embed // heads
    rows = []
    for index, name in enumerate(("query", "key", "value")):
        if torch_layer.in_proj_weight is not None:
            piece = f"chunk(0,{index},3)|"
            weight = "in_proj_weight"
        else:
            piece = ""
            weight = f"{name[0]}_proj_weight"
        in_features = getattr(torch_layer, weight).shape[-1] if not piece else embed
        rows.append(
            (weight, (name, "kernel"), f"{piece}linear|reshape({in_features},{heads},{head_dim})")
        )
        if torch_layer.in_proj_bias is not None:
            rows.append(
                ("in_proj_bias", (name, "bias"), f"chunk(0,{index},3)|reshape({heads},{head_dim})")
            )
    rows.append(
        ("out_proj.weight", ("out", "kernel"), f"linear|reshape({heads},{head_dim},{embed})")
    )
    if torch_layer.out_proj.bias is not None:
        rows.append(("out_proj.bias", ("out", "bias"), "identity"))
    return layer_entries(
        torch_name, _flax_path(flax_module), [(t, ("params", *f), x) for t, f, x in rows]
    )
