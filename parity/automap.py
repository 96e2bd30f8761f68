"""Automatic weight mapping: a torch module's ``state_dict`` onto a Flax variable tree.

`auto` matches torch layers to Flax modules by module structure and names, then by layer type,
shape and order, with the layouts of `parity.transfer` (Linear, ConvNd incl. grouped and
transposed, LayerNorm, RMSNorm, GroupNorm, BatchNorm with running statistics, Embedding,
LSTM/GRU gates, multi-head attention with fused or separate q/k/v, Hugging Face's ``Conv1D``),
tied weights (mapped once) and buffers. It returns a `parity.mapping.WeightMapping` and checks
that torch -> Flax -> torch gives every tensor back bit for bit. `validate_variables` checks a
transfer's result against the Flax module's own initialisation before any training step.
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

from parity import layer_entries as layouts
from parity.mapping import (
    TRANSFORM_OPS,
    MappingEntry,
    MappingError,
    WeightMapping,
    layer_entries,
    transform_shape,
)
from parity.variables import as_variables, flatten_variables

__all__ = ["TransferError", "auto", "validate_variables"]


class TransferError(MappingError):
    """A weight transfer that does not fit the Flax model: lists every offending name."""


# --- names ------------------------------------------------------------------------------------


def _canonical(parts) -> tuple[str, ...]:
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


def _natural_key(path: tuple[str, ...]):
    return [[int(t) if t.isdigit() else t for t in re.split(r"(\d+)", part)] for part in path]


# --- torch side -------------------------------------------------------------------------------


@dataclasses.dataclass
class _TorchUnit:
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


def _torch_units(model: nn.Module) -> tuple[list[_TorchUnit], dict[str, str]]:
    """Layer units in registration order, and aliases (tied tensors: alias key -> canonical key)."""
    state = model.state_dict(keep_vars=True)
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, tensor in state.items():
        if id(tensor) in seen:
            aliases[key] = seen[id(tensor)]
        else:
            seen[id(tensor)] = key
    units: list[_TorchUnit] = []
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
                        _TorchUnit(unit_name, kind, module, tensors, layer, module_name=name)
                    )
                continue
        units.append(
            _TorchUnit(
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


def _trace_flatten(model: nn.Module, example_inputs: Any) -> dict[str, tuple[int, ...]]:
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
class _FlaxNode:
    path: tuple[str, ...]  # module path, no collection
    direct: dict[tuple[str, ...], tuple[int, ...]]  # (collection, leaf) -> shape
    subtree: dict[tuple[str, ...], tuple[int, ...]]  # (collection, *relative path) -> shape

    def describe(self, composite: bool = False) -> str:
        leaves = self.subtree if composite else self.direct
        shapes = ", ".join(f"{'/'.join(k)} {tuple(v)}" for k, v in leaves.items())
        return f"{'/'.join(self.path) or '<root>'}: {shapes}"


def _flax_nodes(flat: Mapping[tuple[str, ...], Any]) -> dict[tuple[str, ...], _FlaxNode]:
    nodes: dict[tuple[str, ...], _FlaxNode] = {}
    for full, value in flat.items():
        collection, *rest = full
        module, leaf = tuple(rest[:-1]), rest[-1]
        shape = tuple(int(d) for d in np.shape(value))
        for depth in range(len(module) + 1):
            path = module[:depth]
            node = nodes.setdefault(path, _FlaxNode(path, {}, {}))
            node.subtree[(collection, *module[depth:], leaf)] = shape
        nodes[module].direct[(collection, leaf)] = shape
    return dict(sorted(nodes.items(), key=lambda item: _natural_key(item[0])))


# --- proposals: the entries a torch unit would give on a Flax node ----------------------------


def _fits(entries: list[MappingEntry], unit: _TorchUnit, node_leaves, node: _FlaxNode) -> bool:
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


def _variants(unit: _TorchUnit, node: _FlaxNode) -> list[list[MappingEntry]]:
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


def _leaves(node: _FlaxNode):
    """A module with leaves of its own is a layer; one without, a composite (MHA, LSTM cell)."""
    return node.direct if node.direct else node.subtree


def _signature(node: _FlaxNode):
    return tuple(sorted(_leaves(node).items()))


def _allowed(unit: _TorchUnit, node: _FlaxNode) -> bool:
    if node.direct:
        return unit.kind not in ("mha", "gru")
    return unit.kind in ("mha", "lstm", "gru")


def _propose(unit: _TorchUnit, node: _FlaxNode) -> list[MappingEntry] | None:
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


def _parse_rule(key, value, flat) -> MappingEntry | None:
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


# --- auto -------------------------------------------------------------------------------------


def auto(
    torch_module: nn.Module,
    flax_variables: Any,
    *,
    rules: Mapping[str, Any] | None = None,
    example_inputs: Any = None,
    check: bool = True,
) -> WeightMapping:
    """Maps a torch module's ``state_dict`` onto a Flax variable tree, layer by layer.

    Matching, in this order: explicit `rules`; layers whose names agree (``blocks.0.fc`` =
    ``blocks_0/fc`` = NNX ``blocks/0/fc``; a common prefix such as ``model.`` may be missing on
    one side); then the rest by layer type, shape and order (torch registration order, Flax
    module paths in natural order). Every torch parameter, every BatchNorm running statistic and
    every Flax leaf must be matched exactly once; other torch buffers (masks, counters) are left
    out. Tied torch weights (one tensor under two names) map once.

    Args:
      torch_module: the torch model.
      flax_variables: linen variables (``{"params": ..., "batch_stats": ...}``), a bare params
        dict, an ``nnx.Module`` / ``nnx.State``, or a Hugging Face Flax model.
      rules: explicit entries, ``{"torch.state_dict.key": ("flax/path/leaf", "transform")}``
        (the collection may be omitted for ``params``; a bare ``"flax/path"`` means
        ``"identity"``; ``None`` leaves that torch tensor out). Transforms: see
        `parity.mapping` (``identity``, ``linear``, ``conv``, ``chunk(0,1,3)|linear`` ...).
      example_inputs: torch-side inputs (a tensor, tuple or kwargs dict). With convolutions
        followed by a Linear they are needed to see whether the Linear reads a flattened
        NCHW map (its rows are then permuted to the NHWC order Flax flattens in).
      check: run the torch -> Flax -> torch round-trip check (bit-exact).

    Returns:
      A `parity.mapping.WeightMapping`.

    Raises:
      TransferError: unmatched or ambiguous tensors/leaves, listed with shapes, and how to pass
        rules for them.

    Example:
      >>> import flax.linen as fnn, jax, jax.numpy as jnp
      >>> t = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
      >>> class F(fnn.Module):
      ...     @fnn.compact
      ...     def __call__(self, x):
      ...         hidden = fnn.relu(fnn.Dense(8)(x))  # Dense_0
      ...         return fnn.Dense(2)(hidden)  # Dense_1
      >>> variables = F().init(jax.random.key(0), jnp.zeros((1, 4)))
      >>> mapping = auto(t, variables)
      >>> [(e.torch_name, "/".join(e.flax_path), e.transform) for e in mapping.entries][:2]
      [('0.weight', 'params/Dense_0/kernel', 'linear'), ('0.bias', 'params/Dense_0/bias', 'identity')]
    """
    if not isinstance(torch_module, nn.Module):
        raise TypeError(
            f"auto: `torch_module` must be a torch.nn.Module, got {type(torch_module).__name__}."
        )
    variables = as_variables(flax_variables)
    flat = flatten_variables(variables)
    units, aliases = _torch_units(torch_module)
    state_keys = set(torch_module.state_dict(keep_vars=True))

    entries: list[MappingEntry] = []
    used_leaves: set[tuple[str, ...]] = set()
    ruled: set[str] = set()
    for key, value in dict(rules or {}).items():
        if key not in state_keys:
            close = difflib.get_close_matches(key, sorted(state_keys), n=1)
            raise TransferError(
                f"rules: {key!r} is not a key of the torch state_dict"
                + (f"; closest: {close[0]!r}" if close else "")
                + "."
            )
        ruled.add(aliases.get(key, key))
        entry = _parse_rule(key, value, flat)
        if entry is not None:
            transform_shape(entry.transform, tuple(torch_module.state_dict()[key].shape))
            entries.append(entry)
            used_leaves.add(entry.flax_path)

    # Units fully covered by rules drop out; partially covered keep their other tensors.
    remaining_units = []
    for unit in units:
        unit.tensors = {k: v for k, v in unit.tensors.items() if k not in ruled}
        if unit.tensors:
            remaining_units.append(unit)
    units = remaining_units
    free_flat = {k: v for k, v in flat.items() if k not in used_leaves}
    nodes = _flax_nodes(free_flat)

    # Linear after flatten of a channels-first map: permuted rows.
    has_maps = any(
        u.kind in ("conv", "conv_transpose") and u.module.weight.dim() >= 4 for u in units
    )
    if example_inputs is not None:
        for name, chw in _trace_flatten(torch_module, example_inputs).items():
            for unit in units:
                if unit.kind == "linear" and unit.name == name:
                    unit.chw = chw
    elif has_maps:
        suspects = [
            u.name
            for u in units
            if u.kind == "linear"
            and any(
                c.kind == "conv"
                and u.module.in_features % c.module.out_channels == 0
                and u.module.in_features > c.module.out_channels
                for c in units
            )
        ]
        if suspects:
            raise TransferError(
                f"auto: the torch model has convolutions and Linear layer(s) {suspects} that may read "
                "a flattened NCHW feature map (Flax flattens NHWC: the rows must be permuted). "
                "Pass `example_inputs=` (a torch-layout batch) so auto can trace it, or a rule such "
                f"as rules={{'{suspects[0]}.weight': ('<flax path>/kernel', 'linear|chw(C,H,W)')}}."
            )

    matched: dict[int, list[MappingEntry]] = {}
    taken: set[tuple[str, ...]] = set()

    def free(node: _FlaxNode) -> bool:
        path = node.path
        if any(path[: len(t)] == t for t in taken):  # taken itself or inside a taken module
            return False
        return bool(node.direct) or not any(t[: len(path)] == path for t in taken)

    def take(index: int, unit: _TorchUnit, node: _FlaxNode, proposal) -> None:
        matched[index] = proposal
        taken.add(node.path)

    canon_nodes: dict[tuple[str, ...], list[_FlaxNode]] = {}
    for node in nodes.values():
        canon_nodes.setdefault(_canonical(node.path), []).append(node)

    # 1. names equal; 2. one name a suffix of the other (a wrapper prefix on one side)
    for suffix in (False, True):
        for index, unit in enumerate(units):
            if index in matched:
                continue
            name = _canonical([unit.name])
            candidates = []
            for canon, group in canon_nodes.items():
                same = canon == name
                if suffix and not same and canon and name:
                    short, long = sorted((canon, name), key=len)
                    # A bare index ("0") is no name: leave it to type, shape and order.
                    named = any(not part.isdigit() for part in short)
                    same = named and long[len(long) - len(short) :] == short
                if same:
                    candidates += group
            fits = []
            for node in candidates:
                if not free(node):
                    continue
                proposal = _propose(unit, node)
                if proposal is not None:
                    fits.append((node, proposal))
            if len(fits) == 1:
                take(index, unit, *fits[0])

    # 3. type, shape, order
    ambiguous: list[str] = []
    for index, unit in enumerate(units):
        if index in matched:
            continue
        options = [
            (node, proposal)
            for node in nodes.values()
            if free(node) and (proposal := _propose(unit, node)) is not None
        ]
        if not options:
            continue
        first = options[0][0]
        signature = _signature(first)
        same_nodes = [n for n in nodes.values() if free(n) and _signature(n) == signature]
        rivals = [j for j, other in enumerate(units) if j not in matched and _propose(other, first)]
        if len(rivals) != len(same_nodes):
            ambiguous.append(
                f"{unit.describe()}: {len(rivals)} torch layer(s) of this type and shape but "
                f"{len(same_nodes)} Flax module(s) ({', '.join('/'.join(n.path) for n in same_nodes[:4])})"
            )
            continue
        take(index, unit, *options[0])

    # Hugging Face Conv1D with a square weight: orientation from the model's other Conv1D layers.
    orientations = {
        e.transform
        for index, proposal in matched.items()
        if units[index].kind == "hf_conv1d"
        for e in proposal
        if e.torch_name.endswith("weight") and e.transform in ("identity", "linear")
    }
    for index, proposal in list(matched.items()):
        if any(e.transform == "?conv1d" for e in proposal):
            if len(orientations) != 1:
                ambiguous.append(
                    f"{units[index].describe()}: square Conv1D weight and no non-square Conv1D "
                    "to tell whether the Flax kernel is (in, out) or transposed"
                )
                del matched[index]
                continue
            (orientation,) = orientations
            matched[index] = [
                dataclasses.replace(e, transform=orientation) if e.transform == "?conv1d" else e
                for e in proposal
            ]

    for index in sorted(matched):
        entries += matched[index]
    covered_leaves = {e.flax_path for e in entries}
    unmatched_torch = [u for i, u in enumerate(units) if i not in matched]
    unmatched_flax = [path for path in flat if path not in covered_leaves]
    if unmatched_torch or unmatched_flax or ambiguous:
        raise TransferError(_report(unmatched_torch, unmatched_flax, flat, ambiguous))
    mapping = WeightMapping(tuple(entries))
    if check:
        mapping.check_round_trip(torch_module)
    return mapping


def _report(unmatched_torch, unmatched_flax, flat, ambiguous) -> str:
    lines = ["auto: the torch state_dict and the Flax variables do not match one to one."]
    if unmatched_torch:
        lines.append("Unmatched torch layers (state_dict key shape):")
        lines += [f"  {u.describe()}" for u in unmatched_torch]
    if unmatched_flax:
        lines.append("Unmatched Flax leaves (path shape):")
        lines += [f"  {'/'.join(p)} {tuple(np.shape(flat[p]))}" for p in unmatched_flax]
    if ambiguous:
        lines.append("Ambiguous:")
        lines += [f"  {a}" for a in ambiguous]
    example_torch = next(iter(unmatched_torch[0].tensors)) if unmatched_torch else "layer.weight"
    example_flax = "/".join(unmatched_flax[0]) if unmatched_flax else "params/Dense_0/kernel"
    lines.append(
        "Fix: make the layer names or shapes agree, or pass explicit rules, e.g. "
        f"auto(model, variables, rules={{{example_torch!r}: ({example_flax!r}, 'linear')}}) "
        f"(transforms: {', '.join(sorted(TRANSFORM_OPS))}; ops join with '|'; a rule value None "
        "leaves a torch tensor out)."
    )
    return "\n".join(lines)


# --- validation -------------------------------------------------------------------------------


def validate_variables(variables: Any, reference: Any, *, check_dtype: bool = True) -> None:
    """Checks a transfer's result against the Flax model's own variables before training.

    Args:
      variables: what the transfer produced (any form `parity.variables.as_variables` takes).
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
