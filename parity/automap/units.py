"""The pieces the automatic mapping matches: torch layer units, Flax module nodes, and the
entries a unit would give on a node.

A torch *unit* is one layer with weights (a Linear, a Conv, a BatchNorm with its running
statistics, one layer of an LSTM/GRU, a MultiheadAttention); a Flax *node* is one module path of
the variable tree. `propose` says whether a unit fits a node (same leaves, same shapes through
the layouts of `parity.pairs.layer_entries`) and with which `parity.pairs.mapping.MappingEntry` rows.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from parity.pairs import layer_entries as layouts
from parity.pairs.mapping import (
    MappingEntry,
    MappingError,
    layer_entries,
    transform_shape,
)

__all__ = [
    "FlaxNode",
    "TorchUnit",
    "TransferError",
    "canonical",
    "flax_nodes",
    "natural_key",
    "parse_rule",
    "propose",
    "torch_units",
    "trace_flatten",
]


class TransferError(MappingError):
    """A weight transfer that does not fit the Flax model: lists every offending name."""


# --- names ------------------------------------------------------------------------------------


def canonical(parts) -> tuple[str, ...]:
    """``blocks_0`` / ``blocks.0`` / ``("blocks", 0)`` -> ``("blocks", "0")``; lowercase."""
    out: list[str] = []
    for part in parts:
        for piece in str(part).split("."):
            if not piece:
                continue
            match = re.fullmatch(r"(.*\D)_(\d+)", piece)
            if match:
                out += [match.group(1).lower(), match.group(2)]
            else:
                out.append(piece.lower())
    return tuple(out)


def natural_key(path: tuple[str, ...]):
    return [[int(t) if t.isdigit() else t for t in re.split(r"(\d+)", part)] for part in path]


# --- torch side -------------------------------------------------------------------------------


@dataclasses.dataclass
class TorchUnit:
    name: str  # torch module name (virtual "name.l{k}" for stacked LSTM/GRU layers)
    kind: str
    module: nn.Module
    tensors: dict[str, tuple[int, ...]]  # state_dict key -> shape
    layer: int = 0
    chw: tuple[int, ...] | None = None
    module_name: str = ""

    def describe(self) -> str:
        shapes = ", ".join(f"{k} {tuple(v)}" for k, v in self.tensors.items())
        return f"{type(self.module).__name__} {self.name or '<root>'}: {shapes}"


def _is_hf_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
if hasattr(nn, "RMSNorm"):
    _NORMS = (*_NORMS, nn.RMSNorm)


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.MultiheadAttention):
        return "mha"
    if isinstance(module, nn.LSTM):
        return "lstm"
    if isinstance(module, nn.GRU):
        return "gru"
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return "conv_transpose"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, nn.Linear):
        return "linear"
    if _is_hf_conv1d(module):
        return "hf_conv1d"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batchnorm"
    if isinstance(module, _NORMS):
        return "norm"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "generic"


def torch_units(model: nn.Module) -> tuple[list[TorchUnit], dict[str, str]]:
    """Layer units in registration order, and aliases (tied tensors: alias key -> canonical key)."""
    state = model.state_dict(keep_vars=True)
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, tensor in state.items():
        if id(tensor) in seen:
            aliases[key] = seen[id(tensor)]
        else:
            seen[id(tensor)] = key
    units: list[TorchUnit] = []
    claimed: set[str] = set()
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed):
            continue
        prefix = f"{name}." if name else ""
        kind = _kind(module)
        if kind == "mha":
            claimed.add(name)
            local = {k: v for k, v in state.items() if k.startswith(prefix)}
        else:
            # Buffers other than BatchNorm statistics (masks, counters) have no Flax twin.
            owned = list(module._parameters)
            if kind == "batchnorm":
                owned += list(module._buffers)
            local = {prefix + n: state[prefix + n] for n in owned if prefix + n in state}
        local = {
            k: v
            for k, v in local.items()
            if k not in aliases and not k.endswith("num_batches_tracked")
        }
        if not local:
            continue
        if kind in ("lstm", "gru"):
            if module.bidirectional or getattr(module, "proj_size", 0):
                kind = "generic"
            else:
                for layer in range(module.num_layers):
                    tensors = {
                        k: tuple(v.shape) for k, v in local.items() if k.endswith(f"_l{layer}")
                    }
                    unit_name = name if module.num_layers == 1 else f"{name}.{layer}"
                    units.append(
                        TorchUnit(unit_name, kind, module, tensors, layer, module_name=name)
                    )
                continue
        units.append(
            TorchUnit(
                name, kind, module, {k: tuple(v.shape) for k, v in local.items()}, module_name=name
            )
        )
    return units, aliases


_CHANNELS_FIRST = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
)


_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "_ReshapeAlias")
_ELEMENTWISE = ("Relu", "Gelu", "Silu", "Tanh", "Sigmoid", "Elu", "LeakyRelu", "Hardtanh", "Mul")


def _flattened_shape(x: torch.Tensor) -> tuple[int, ...] | None:
    """The shape of the >= 3-D tensor that a 2-D `x` is a flatten of, from the autograd graph
    (through elementwise ops); None if `x` is no flatten or the map was permuted first (then
    it is already channels-last)."""
    node = x.grad_fn
    for _ in range(6):
        if node is None:
            return None
        name = type(node).__name__
        if any(name.startswith(v) for v in _VIEWS):
            sizes = tuple(int(d) for d in getattr(node, "_saved_self_sym_sizes", ()))
            if len(sizes) < 3:
                return None
            before = [n for n, _ in node.next_functions if n is not None]
            for _ in range(2):  # reshape of a permuted map: Clone <- Permute
                names = [type(n).__name__ for n in before]
                if any(n.startswith(("Permute", "Transpose")) for n in names):
                    return None
                before = [m for n in before for m, _ in n.next_functions if m is not None]
            return sizes
        if not any(name.startswith(e) for e in _ELEMENTWISE):
            return None
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def trace_flatten(model: nn.Module, example_inputs: Any) -> dict[str, tuple[int, ...]]:
    """Linear layers fed by ``flatten`` of a channels-first map: name -> (C, *spatial)."""
    last: dict[str, Any] = {}
    found: dict[str, tuple[int, ...]] = {}
    handles = []

    def record(module, args, output):
        if isinstance(output, torch.Tensor) and output.dim() >= 3:
            if isinstance(module, _CHANNELS_FIRST) or (
                "map" in last and tuple(output.shape) == tuple(last["map"].shape)
            ):
                last["map"] = output

    def before_linear(name):
        def hook(module, args):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.dim() == 2:
                flattened = _flattened_shape(x)
                if flattened is not None:
                    if math.prod(flattened[1:]) == x.shape[1] and math.prod(flattened[2:]) > 1:
                        found[name] = tuple(int(d) for d in flattened[1:])
                    return
            feature_map = last.get("map")
            if (
                isinstance(x, torch.Tensor)
                and x.dim() == 2
                and feature_map is not None
                and math.prod(feature_map.shape[1:]) == x.shape[1]
                and math.prod(feature_map.shape[2:]) > 1
            ):
                found[name] = tuple(int(d) for d in feature_map.shape[1:])

        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(record))
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(before_linear(name)))
    was_training = model.training
    try:
        model.eval()
        with torch.enable_grad():  # the autograd graph shows where a flatten happened
            if isinstance(example_inputs, tuple | list):
                model(*example_inputs)
            elif isinstance(example_inputs, Mapping):
                model(**example_inputs)
            else:
                model(example_inputs)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return found


# --- Flax side --------------------------------------------------------------------------------


@dataclasses.dataclass
class FlaxNode:
    path: tuple[str, ...]  # module path, no collection
    direct: dict[tuple[str, ...], tuple[int, ...]]  # (collection, leaf) -> shape
    subtree: dict[tuple[str, ...], tuple[int, ...]]  # (collection, *relative path) -> shape

    def describe(self, composite: bool = False) -> str:
        leaves = self.subtree if composite else self.direct
        shapes = ", ".join(f"{'/'.join(k)} {tuple(v)}" for k, v in leaves.items())
        return f"{'/'.join(self.path) or '<root>'}: {shapes}"


def flax_nodes(flat: Mapping[tuple[str, ...], Any]) -> dict[tuple[str, ...], FlaxNode]:
    nodes: dict[tuple[str, ...], FlaxNode] = {}
    for full, value in flat.items():
        collection, *rest = full
        module, leaf = tuple(rest[:-1]), rest[-1]
        shape = tuple(int(d) for d in np.shape(value))
        for depth in range(len(module) + 1):
            path = module[:depth]
            node = nodes.setdefault(path, FlaxNode(path, {}, {}))
            node.subtree[(collection, *module[depth:], leaf)] = shape
        nodes[module].direct[(collection, leaf)] = shape
    return dict(sorted(nodes.items(), key=lambda item: natural_key(item[0])))


# --- proposals: the entries a torch unit would give on a Flax node ----------------------------


def _fits(entries: list[MappingEntry], unit: TorchUnit, node_leaves, node: FlaxNode) -> bool:
    produced: dict[tuple[str, ...], tuple[int, ...]] = {}
    for entry in entries:
        if entry.torch_name not in unit.tensors:
            return False
        try:
            shape = transform_shape(entry.transform, unit.tensors[entry.torch_name])
        except MappingError:
            return False
        relative = (entry.flax_path[0], *entry.flax_path[1 + len(node.path) :])
        if produced.setdefault(relative, shape) != shape:
            return False
    covered = {e.torch_name for e in entries}
    return produced == dict(node_leaves) and covered == set(unit.tensors)


def _linear_variants(unit, node):
    module = unit.module
    path = node.path
    variants = [layouts.linear_entries(unit.name, path, module, input_chw=unit.chw)]
    kernel = node.direct.get(("params", "kernel"))
    if kernel is not None and len(kernel) > 2 and unit.chw is None:
        out_f, in_f = module.weight.shape
        bias = module.bias is not None
        if kernel[0] == in_f and math.prod(kernel[1:]) == out_f:  # DenseGeneral (E -> H, D)
            rows = [("weight", "kernel", f"linear|reshape({','.join(map(str, kernel))})")]
            if bias:
                rows.append(("bias", "bias", f"reshape({','.join(map(str, kernel[1:]))})"))
            variants.append(_layer_entries(unit, path, rows))
        if kernel[-1] == out_f and math.prod(kernel[:-1]) == in_f:  # DenseGeneral ((H, D) -> E)
            rows = [("weight", "kernel", f"linear|reshape({','.join(map(str, kernel))})")]
            if bias:
                rows.append(("bias", "bias", "identity"))
            variants.append(_layer_entries(unit, path, rows))
    return variants


def _layer_entries(unit, path, rows):
    return layer_entries(unit.name, path, rows)


def _variants(unit: TorchUnit, node: FlaxNode) -> list[list[MappingEntry]]:
    module, path = unit.module, node.path
    if unit.kind == "linear":
        return _linear_variants(unit, node)
    if unit.kind == "conv":
        return [layouts.conv_entries(unit.name, path, module)]
    if unit.kind == "conv_transpose":
        entries = layouts.conv_entries(unit.name, path, module)
        flipped = [
            dataclasses.replace(e, transform="conv_transpose_t")
            if e.transform == "conv_transpose"
            else e
            for e in entries
        ]
        return [entries, flipped]
    if unit.kind in ("norm", "batchnorm"):
        return [layouts.norm_entries(unit.name, path, module)]
    if unit.kind == "embedding":
        return [layouts.embedding_entries(unit.name, path, module)]
    if unit.kind == "hf_conv1d":
        rows = [("weight", "kernel", "identity"), ("bias", "bias", "identity")]
        transposed = [("weight", "kernel", "linear"), ("bias", "bias", "identity")]
        return [_layer_entries(unit, path, rows), _layer_entries(unit, path, transposed)]
    if unit.kind == "mha":
        return [layouts.attention_entries(unit.name, path, module)]
    if unit.kind == "lstm":
        return [
            _retarget(
                layouts.torch_lstm_entries(unit.module_name, path, module, layer=unit.layer), unit
            ),
            _retarget(
                layouts.lstm_cell_entries(unit.module_name, path, module, layer=unit.layer), unit
            ),
            _retarget(
                layouts.lstm_cell_entries(
                    unit.module_name, path, module, layer=unit.layer, forget_name="if_"
                ),
                unit,
            ),
        ]
    if unit.kind == "gru":
        return [
            _retarget(
                layouts.gru_cell_entries(unit.module_name, path, module, layer=unit.layer), unit
            )
        ]
    # generic: same leaf names (or one tensor <-> one leaf), same shapes, same layout
    prefix = f"{unit.name}." if unit.name else ""
    rows = []
    leaves = [k for k in node.direct]
    names = {key[len(prefix) :]: key for key in unit.tensors}
    if len(names) == 1 and len(leaves) == 1:
        (local,) = names
        rows.append((local, leaves[0], "identity"))
    else:
        for local in names:
            match = [leaf for leaf in leaves if leaf[-1] == local]
            if len(match) != 1:
                return []
            rows.append((local, match[0], "identity"))
    return [_layer_entries(unit, path, rows)]


def _retarget(entries, unit):
    """Entries built from the nn.LSTM module name, owned by the unit (one layer of it)."""
    return [dataclasses.replace(e, torch_module=unit.name) for e in entries]


def _leaves(node: FlaxNode):
    """A module with leaves of its own is a layer; one without, a composite (MHA, LSTM cell)."""
    return node.direct if node.direct else node.subtree


def _signature(node: FlaxNode):
    return tuple(sorted(_leaves(node).items()))


def _allowed(unit: TorchUnit, node: FlaxNode) -> bool:
    if node.direct:
        return unit.kind not in ("mha", "gru")
    return unit.kind in ("mha", "lstm", "gru")


def propose(unit: TorchUnit, node: FlaxNode) -> list[MappingEntry] | None:
    leaves = _leaves(node)
    if not leaves or not _allowed(unit, node):
        return None
    fitting = [v for v in _variants(unit, node) if v and _fits(v, unit, leaves, node)]
    if not fitting:
        return None
    if unit.kind == "hf_conv1d" and len(fitting) > 1:
        return [
            dataclasses.replace(e, transform="?conv1d")
            if e.transform in ("identity", "linear") and e.torch_name.endswith("weight")
            else e
            for e in fitting[0]
        ]
    return fitting[0]


# --- rules ------------------------------------------------------------------------------------


def parse_rule(key, value, flat) -> MappingEntry | None:
    if value is None:
        return None
    if isinstance(value, str):
        flax, transform = value, None
    elif isinstance(value, tuple | list) and len(value) == 2:
        flax, transform = value
    else:
        raise TransferError(
            f"rules[{key!r}] must be 'flax/path', ('flax/path', 'transform') or None, got {value!r}."
        )
    parts = tuple(p for p in (flax.split("/") if isinstance(flax, str) else flax) if p != "")
    if parts and parts[0] not in {p[0] for p in flat}:
        parts = ("params", *parts)
    if parts not in flat:
        known = ["/".join(p) for p in flat]
        close = difflib.get_close_matches("/".join(parts), known, n=1)
        raise TransferError(
            f"rules[{key!r}]: the Flax tree has no leaf {'/'.join(parts)!r}"
            + (f"; closest: {close[0]!r}" if close else "")
            + "."
        )
    if transform is None:
        transform = "identity"
    module = key.rsplit(".", 1)[0] if "." in key else ""
    return MappingEntry(key, parts, transform, module, parts[1:-1])
