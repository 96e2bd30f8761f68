"""`auto`: a torch module's ``state_dict`` onto a Flax variable tree, without guessing.

Layers are paired, in this order, by explicit rules; by names that agree one to one; by the
order in which the layers run in one forward pass on each side (same type and shape; a layer
run twice is one layer); and where order leaves a choice (siblings that receive one input,
layers the pass did not reach), by function (`parity.automap.function`). What none of these
settles is an error naming the candidates and the ``rules=`` entry that settles it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from parity.automap.execution import Trace, flax_trace, torch_trace
from parity.automap.explain import folded_tensors
from parity.automap.function import MAX_CHOICE, Choice, decide, random_flax, random_torch
from parity.automap.units import (
    FlaxNode,
    TorchUnit,
    TransferError,
    canonical,
    flax_nodes,
    parse_rule,
    propose,
    torch_units,
    trace_flatten,
)
from parity.pairs.adapters import AdapterError, FlaxModel, as_flax_model
from parity.pairs.mapping import (
    TRANSFORM_OPS,
    MappingEntry,
    MappingError,
    WeightMapping,
    transform_shape,
)
from parity.pairs.variables import as_variables, flatten_variables

__all__ = ["auto"]

Path = tuple[str, ...]


@dataclasses.dataclass
class _Matching:
    """The pairing under construction: unit index -> Flax module path, and how it was decided."""

    units: list[TorchUnit]
    nodes: dict[Path, FlaxNode]
    assignment: dict[int, Path] = dataclasses.field(default_factory=dict)
    how: dict[int, str] = dataclasses.field(default_factory=dict)
    cache: dict[tuple[int, Path], list[MappingEntry] | None] = dataclasses.field(
        default_factory=dict
    )
    disputed: set[Path] = dataclasses.field(default_factory=set)  # named in an ambiguity

    def proposal(self, index: int, path: Path) -> list[MappingEntry] | None:
        key = (index, path)
        if key not in self.cache:
            self.cache[key] = propose(self.units[index], self.nodes[path])
        return self.cache[key]

    def free(self, path: Path) -> bool:
        taken = set(self.assignment.values())
        if any(path[: len(t)] == t for t in taken):  # taken itself or inside a taken module
            return False
        return bool(self.nodes[path].direct) or not any(t[: len(path)] == path for t in taken)

    def take(self, index: int, path: Path, how: str) -> None:
        self.assignment[index] = path
        self.how[index] = how

    def open_units(self) -> list[int]:
        return [i for i in range(len(self.units)) if i not in self.assignment]


def _names_agree(unit_name: Path, node_name: Path, suffix: bool) -> bool:
    if unit_name == node_name:
        return True
    if not suffix or not unit_name or not node_name:
        return False
    short, long = sorted((unit_name, node_name), key=len)
    # A bare index ("0") is no name: leave it to execution order.
    named = any(not part.isdigit() for part in short)
    return named and long[len(long) - len(short) :] == short


def _match_names(matching: _Matching) -> None:
    """Names decide where they agree one to one: ``blocks.0.fc`` = ``blocks_0/fc`` = NNX
    ``blocks/0/fc`` (then with a wrapper prefix such as ``model.`` missing on one side). Two
    torch layers claiming one Flax name (``a.1`` and ``a_1``) leave it to execution order."""
    canon_nodes = {path: canonical(path) for path in matching.nodes}
    for suffix in (False, True):
        claims: dict[int, list[Path]] = {}
        for index in matching.open_units():
            name = canonical([matching.units[index].name])
            claims[index] = [
                path
                for path, canon in canon_nodes.items()
                if _names_agree(name, canon, suffix)
                and matching.free(path)
                and matching.proposal(index, path) is not None
            ]
        claimants: dict[Path, int] = {}
        for paths in claims.values():
            for path in paths:
                claimants[path] = claimants.get(path, 0) + 1
        for index, paths in claims.items():
            if len(paths) == 1 and claimants[paths[0]] == 1 and matching.free(paths[0]):
                matching.take(index, paths[0], "name")


def _components(matching: _Matching) -> list[tuple[list[int], list[Path]]]:
    """Groups of open torch units and free Flax modules that could pair (same type and shape)."""
    units = matching.open_units()
    paths = [p for p in matching.nodes if matching.free(p)]
    parent: dict[Any, Any] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for index in units:
        find(("u", index))
        for path in paths:
            if matching.proposal(index, path) is not None:
                parent[find(("u", index))] = find(("n", path))
    groups: dict[Any, tuple[list[int], list[Path]]] = {}
    for index in units:
        groups.setdefault(find(("u", index)), ([], []))[0].append(index)
    for path in paths:
        if ("n", path) in parent:
            groups.setdefault(find(("n", path)), ([], []))[1].append(path)
    return list(groups.values())


def _node_position(trace: Trace, path: Path) -> int | None:
    position = trace.position(path)
    if position is None:  # a container whose own __call__ was not seen: its first layer's
        inside = [c.index for key, c in trace.calls.items() if key[: len(path)] == path]
        position = min(inside, default=None)
    return position


def _flax_input(trace: Trace, path: Path):
    call = trace.calls.get(path)
    return None if call is None else call.inputs


def _same_input(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and np.array_equal(a, b)


class _Traces:
    """The two forward passes, run once and only when a choice needs them."""

    def __init__(self, torch_module, flax_model, flat, example_inputs, flax_inputs):
        self._args = (torch_module, flax_model, flat, example_inputs, flax_inputs)
        self._done = False
        self.missing = ""
        self.torch = self.flax = self.weights = None

    @property
    def model(self) -> FlaxModel | None:
        return self._args[1]

    @property
    def flax_inputs(self) -> Any:
        return self._args[4]

    def get(self) -> bool:
        if not self._done:
            self._done = True
            self._run()
        return self.torch is not None

    def _run(self) -> None:
        torch_module, flax_model, flat, example_inputs, flax_inputs = self._args
        if example_inputs is None or flax_model is None or flax_inputs is None:
            self.missing = (
                "no forward pass to order them: pass example_inputs= (torch layout) and "
                "flax_model= (the Flax module; flax_inputs= when the inputs are not one array)"
            )
            return
        names = [u.module_name for u in torch_units(torch_module)[0]]
        try:
            weights = random_torch(torch_module)
            torch_side = torch_trace(weights, names, example_inputs)
            flax_side = flax_trace(flax_model, random_flax(flat), flax_inputs)
        except AdapterError:
            raise
        except Exception as error:  # any failure of a user model: say so, decide nothing by order
            self.missing = (
                f"the forward pass that orders them failed ({type(error).__name__}: {error})"
            )
            return
        self.torch, self.flax, self.weights = torch_side, flax_side, weights


def _order(
    matching: _Matching, units: list[int], paths: list[Path], traces: _Traces, problems, choices
) -> None:
    """Pairs one group by execution order; siblings and unseen layers become choices."""
    names = [u.module_name for u in matching.units]
    unit_pos = {i: traces.torch.position(names[i]) for i in units}
    node_pos = {p: _node_position(traces.flax, p) for p in paths}
    called_units = sorted(
        (i for i in units if unit_pos[i] is not None),
        key=lambda i: (unit_pos[i], matching.units[i].layer),
    )
    called_nodes = sorted((p for p in paths if node_pos[p] is not None), key=node_pos.get)
    rest_units = [i for i in units if unit_pos[i] is None]
    rest_nodes = [p for p in paths if node_pos[p] is None]
    pairs = list(zip(called_units, called_nodes, strict=False))
    if len(called_units) != len(called_nodes) or any(
        matching.proposal(i, p) is None for i, p in pairs
    ):
        reason = "the two passes run them in numbers or types that differ"
        _choice_or_problem(matching, units, paths, reason, problems, choices)
        return
    how = "execution order" if len(units) > 1 else "only candidate"
    for i, p in pairs:
        matching.take(i, p, how)
    # Siblings: layers that received the very same input; the code's call order is arbitrary.
    groups = list(range(len(pairs)))
    for a in range(len(pairs)):
        for b in range(a + 1, len(pairs)):
            ua, pa = pairs[a]
            ub, pb = pairs[b]
            if names[ua] == names[ub]:  # layers of one nn.LSTM/GRU run in their own order
                continue
            torch_same = _same_input(
                traces.torch.calls[names[ua]].inputs, traces.torch.calls[names[ub]].inputs
            )
            flax_same = _same_input(_flax_input(traces.flax, pa), _flax_input(traces.flax, pb))
            if torch_same or flax_same:
                old, new = groups[b], groups[a]
                groups = [new if g == old else g for g in groups]
    for group in dict.fromkeys(groups):
        members = [k for k, g in enumerate(groups) if g == group]
        if len(members) > 1:
            _choice_or_problem(
                matching,
                [pairs[k][0] for k in members],
                [pairs[k][1] for k in members],
                "they receive the same input, so the order of their calls is the code's choice",
                problems,
                choices,
            )
    if len(rest_units) == len(rest_nodes) == 1 and matching.proposal(rest_units[0], rest_nodes[0]):
        matching.take(rest_units[0], rest_nodes[0], "only candidate")
    elif rest_units or rest_nodes:
        problems.append(
            _ambiguous(matching, rest_units, rest_nodes, "the forward pass does not call them")
        )


def _choice_or_problem(matching, units, paths, reason, problems, choices) -> None:
    if len(units) == len(paths) and len(units) <= MAX_CHOICE:
        for i, p in zip(units, paths, strict=True):
            matching.take(i, p, "function")  # tentative until `decide` confirms
        choices.append(Choice(list(units), list(paths), reason))
    else:
        problems.append(_ambiguous(matching, units, paths, reason))


def _rule_line(matching: _Matching, index: int, path: Path) -> str:
    entries = matching.proposal(index, path) or []
    body = ", ".join(
        f"{e.torch_name!r}: ({'/'.join(e.flax_path)!r}, {e.transform!r})" for e in entries
    )
    return f"rules={{{body}}}"


def _ambiguous(matching: _Matching, units, paths, reason: str, fitting=None) -> str:
    matching.disputed.update(paths)
    torch_side = ", ".join(matching.units[i].name or "<root>" for i in units)
    flax_side = ", ".join("/".join(p) for p in paths)
    line = f"torch {torch_side} and Flax {flax_side}: {reason}"
    if fitting is not None:
        line += (
            "; no pairing reproduces the torch layers' outputs"
            if not fitting
            else "; pairings that fit: "
            + " | ".join(
                ", ".join(
                    f"{matching.units[i].name} -> {'/'.join(p)}"
                    for i, p in zip(units, order, strict=True)
                )
                for order in fitting
            )
        )
    if units and paths:
        unit = matching.units[units[0]]
        target = fitting[0][0] if fitting else None
        if target is None:  # an example only: the Flax module whose name is closest
            names = ["/".join(p) for p in paths]
            close = difflib.get_close_matches(unit.name.replace(".", "/"), names, n=1, cutoff=0)
            target = paths[names.index(close[0])] if close else paths[0]
        if matching.proposal(units[0], target) is not None:
            line += (
                f". Settle it with one entry per layer, naming the Flax module each torch layer "
                f"really is, e.g. {_rule_line(matching, units[0], target)}"
            )
    return line


def _flax_runner(flax_model: Any, flax_variables: Any) -> FlaxModel | None:
    source = flax_model if flax_model is not None else flax_variables
    if source is None or isinstance(source, Mapping):
        return None
    try:
        return as_flax_model(source)
    except AdapterError:
        if flax_model is not None:
            raise
        return None  # an nnx.State: weights only


def _flax_example(example_inputs: Any, units: list[TorchUnit]) -> Any:
    """The Flax-layout twin of one torch input tensor: NCHW -> NHWC when the model convolves."""
    if not isinstance(example_inputs, torch.Tensor):
        return None
    array = example_inputs.detach().cpu()
    dims = {u.module.weight.dim() - 2 for u in units if u.kind in ("conv", "conv_transpose")}
    if array.is_floating_point() and array.dim() - 2 in dims and array.dim() >= 3:
        array = array.movedim(1, -1)
    return array.float().numpy() if array.is_floating_point() else array.numpy().astype(np.int32)


def auto(
    torch_module: nn.Module,
    flax_variables: Any,
    *,
    rules: Mapping[str, Any] | None = None,
    example_inputs: Any = None,
    flax_model: Any = None,
    flax_inputs: Any = None,
    check: bool = True,
) -> WeightMapping:
    """Maps a torch module's ``state_dict`` onto a Flax variable tree, layer by layer.

    Pairing, in this order: explicit `rules`; layers whose names agree one to one
    (``blocks.0.fc`` = ``blocks_0/fc`` = NNX ``blocks/0/fc``; a common prefix such as ``model.``
    may be missing on one side); then layers of one type and shape in the order they run in one
    forward pass of each model (a layer run twice is one layer); where that order leaves a
    choice (siblings such as q/k/v projections that receive one input; layers the pass does not
    reach), the pairing under which the Flax model, given the torch weights, computes what the
    torch layers compute. Anything still open is an error listing the candidates and the
    ``rules=`` entry that settles it; nothing is paired by how names sort. Every torch
    parameter, every BatchNorm running statistic and every Flax leaf is matched exactly once;
    other torch buffers (masks, counters) are left out; tied torch weights map once.
    `parity.automap.explain` shows how each pair was decided.

    Args:
      torch_module: the torch model.
      flax_variables: linen variables (``{"params": ..., "batch_stats": ...}``; shapes from
        ``jax.eval_shape`` will do), a bare params dict, an ``nnx.Module`` / ``nnx.State``, or
        a Hugging Face Flax model.
      rules: explicit entries, ``{"torch.state_dict.key": ("flax/path/leaf", "transform")}``
        (the collection may be omitted for ``params``; a bare ``"flax/path"`` means
        ``"identity"``; ``None`` leaves that torch tensor out). Transforms: see
        `parity.pairs.mapping` (``identity``, ``linear``, ``conv``, ``chunk(0,1,3)|linear`` ...).
      example_inputs: torch-side inputs (a tensor, tuple or kwargs dict): the forward pass
        that orders the layers, and, with convolutions followed by a Linear, shows whether the
        Linear reads a flattened NCHW map (its rows are then permuted to Flax's NHWC order).
      flax_model: the Flax model to run (linen module, ``nnx.Module``, Hugging Face Flax model
        or `parity.pairs.adapters.FlaxModel`); default: `flax_variables` when it is a model.
      flax_inputs: Flax-side inputs; default: `example_inputs` as an array (NCHW -> NHWC when
        the torch model convolves).
      check: run the torch -> Flax -> torch round-trip check (bit-exact).

    Returns:
      A `parity.pairs.mapping.WeightMapping`; each entry's ``decided_by`` says how it was paired.

    Raises:
      TransferError: unmatched or undecided tensors/leaves, listed with shapes and candidates,
        with a ``rules=`` line built from the model's own names.

    Warns:
      UserWarning: when the mapping folds trainable tensors (two torch biases summed into one
        Flax bias): the two models then train differently.

    Examples:
      >>> import flax.linen as fnn, jax, jax.numpy as jnp
      >>> t = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
      >>> class F(fnn.Module):
      ...     @fnn.compact
      ...     def __call__(self, x):
      ...         hidden = fnn.relu(fnn.Dense(8)(x))  # Dense_0
      ...         return fnn.Dense(2)(hidden)  # Dense_1
      >>> variables = F().init(jax.random.key(0), jnp.zeros((1, 4)))
      >>> mapping = auto(t, variables)
      >>> [(e.torch_name, "/".join(e.flax_path), e.decided_by) for e in mapping.entries][:2]
      [('0.weight', 'params/Dense_0/kernel', 'only candidate'), ('0.bias', 'params/Dense_0/bias', 'only candidate')]
    """
    if not isinstance(torch_module, nn.Module):
        raise TypeError(
            f"auto: `torch_module` must be a torch.nn.Module, got {type(torch_module).__name__}."
        )
    variables = as_variables(flax_variables)
    flat = flatten_variables(variables)
    units, aliases = torch_units(torch_module)
    state = torch_module.state_dict(keep_vars=True)

    fixed: list[MappingEntry] = []
    ruled: set[str] = set()
    for key, value in dict(rules or {}).items():
        if key not in state:
            close = difflib.get_close_matches(key, sorted(state), n=1)
            raise TransferError(
                f"rules: {key!r} is not a key of the torch state_dict"
                + (f"; closest: {close[0]!r}" if close else "")
                + "."
            )
        ruled.add(aliases.get(key, key))
        entry = parse_rule(key, value, flat)
        if entry is not None:
            transform_shape(entry.transform, tuple(state[key].shape))
            fixed.append(dataclasses.replace(entry, decided_by="rule"))
    used_leaves = {e.flax_path for e in fixed}

    # Units fully covered by rules drop out; partially covered keep their other tensors.
    remaining = []
    for unit in units:
        unit.tensors = {k: v for k, v in unit.tensors.items() if k not in ruled}
        if unit.tensors:
            remaining.append(unit)
    units = remaining
    _flatten_layouts(torch_module, units, example_inputs, flat)

    matching = _Matching(units, flax_nodes({k: v for k, v in flat.items() if k not in used_leaves}))
    _match_names(matching)

    runner = _flax_runner(flax_model, flax_variables)
    if flax_inputs is None:
        flax_inputs = _flax_example(example_inputs, units)
    traces = _Traces(torch_module, runner, flat, example_inputs, flax_inputs)
    problems: list[str] = []
    choices: list[Choice] = []
    unmatched_units: list[int] = []
    for group_units, group_paths in _components(matching):
        if not group_paths:
            unmatched_units += group_units
        elif len(group_units) == len(group_paths) == 1:
            matching.take(group_units[0], group_paths[0], "only candidate")
        elif len(group_units) != len(group_paths):
            problems.append(
                _ambiguous(
                    matching,
                    group_units,
                    group_paths,
                    f"{len(group_units)} torch layer(s) of this type and shape but "
                    f"{len(group_paths)} Flax module(s)",
                )
            )
        elif traces.get():
            _order(matching, group_units, group_paths, traces, problems, choices)
        else:
            problems.append(
                _ambiguous(
                    matching,
                    group_units,
                    group_paths,
                    f"{len(group_units)} layers of one type and shape, and {traces.missing}",
                )
            )
    problems += _orient_conv1d(matching)

    if choices and not problems:

        def entries_for(index: int, path: Path) -> list[MappingEntry]:
            return matching.proposal(index, path) or []

        failed = decide(
            choices,
            matching.assignment,
            entries_for,
            fixed,
            [u.module_name for u in units],
            traces.torch,
            traces.model,
            traces.flax_inputs,
            traces.weights,
        )
        for choice, fitting in failed:
            problems.append(
                _ambiguous(matching, choice.units, choice.nodes, choice.reason, fitting)
            )

    entries = list(fixed)
    for index in sorted(matching.assignment):
        how = matching.how[index]
        proposal = matching.proposal(index, matching.assignment[index]) or []
        entries += [dataclasses.replace(e, decided_by=how) for e in proposal]
    covered = {e.flax_path for e in entries}
    unmatched_torch = [units[i] for i in unmatched_units]
    if not problems:
        unmatched_torch += [
            u
            for i, u in enumerate(units)
            if i not in matching.assignment and i not in unmatched_units
        ]
    unmatched_flax = [
        path
        for path in flat
        if path not in covered and not any(path[1 : 1 + len(d)] == d for d in matching.disputed)
    ]
    if unmatched_torch or unmatched_flax or problems:
        raise TransferError(_report(unmatched_torch, unmatched_flax, flat, problems))
    mapping = WeightMapping(tuple(entries))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    folded = folded_tensors(mapping, shapes)
    if folded:
        groups: dict[tuple[str, ...], list[str]] = {}
        for path, names in folded.items():
            groups.setdefault(tuple(names), []).append("/".join(path[1:-1]) or "<root>")
        listed = "; ".join(
            f"{' + '.join(names)} -> {', '.join(dict.fromkeys(modules))}"
            for names, modules in groups.items()
        )
        warnings.warn(
            f"auto: torch tensors summed into one Flax leaf ({listed}): the Flax model has one "
            "trainable tensor where torch has two, so the two train differently (a Flax layer "
            "with both biases, such as parity.twins.layers.TorchLSTM, trains alike).",
            UserWarning,
            stacklevel=2,
        )
    if check:
        mapping.check_round_trip(torch_module)
    return mapping


def _orient_conv1d(matching: _Matching) -> list[str]:
    """Hugging Face Conv1D with a square weight: orientation from the model's other Conv1D."""
    proposals = {i: matching.proposal(i, p) for i, p in matching.assignment.items()}
    orientations = {
        e.transform
        for index, proposal in proposals.items()
        if matching.units[index].kind == "hf_conv1d"
        for e in proposal or []
        if e.torch_name.endswith("weight") and e.transform in ("identity", "linear")
    }
    problems = []
    for index, proposal in proposals.items():
        if not any(e.transform == "?conv1d" for e in proposal or []):
            continue
        if len(orientations) != 1:
            problems.append(
                f"{matching.units[index].describe()}: square Conv1D weight and no non-square "
                "Conv1D to tell whether the Flax kernel is (in, out) or transposed"
            )
            continue
        (orientation,) = orientations
        matching.cache[(index, matching.assignment[index])] = [
            dataclasses.replace(e, transform=orientation) if e.transform == "?conv1d" else e
            for e in proposal
        ]
    return problems


def _flatten_layouts(
    torch_module: nn.Module, units: list[TorchUnit], example_inputs: Any, flat: Mapping
) -> None:
    """Linear after a flatten of a channels-first map: its rows are permuted (NHWC in Flax)."""
    if example_inputs is not None:
        for name, chw in trace_flatten(torch_module, example_inputs).items():
            for unit in units:
                if unit.kind == "linear" and unit.name == name:
                    unit.chw = chw
        return
    if not any(u.kind in ("conv", "conv_transpose") and u.module.weight.dim() >= 4 for u in units):
        return
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
        linear = next(u for u in units if u.name == suspects[0])
        key = f"{suspects[0]}.weight"
        target = (
            _closest_leaf(key, tuple(linear.module.weight.shape), "linear", list(flat), flat)
            or "flax/path"
        )
        raise TransferError(
            f"auto: the torch model has convolutions and Linear layer(s) {suspects} that may read "
            "a flattened NCHW feature map (Flax flattens NHWC: the rows must be permuted). "
            "Pass `example_inputs=` (a torch-layout batch) so auto can trace it, or a rule such "
            f"as rules={{{key!r}: ({target!r}, 'linear|chw(C,H,W)')}} with the (C, H, W) of "
            "the map it reads."
        )


def _report(unmatched_torch, unmatched_flax, flat, problems) -> str:
    lines = ["auto: the torch state_dict and the Flax variables do not match one to one."]
    if unmatched_torch:
        lines.append("Unmatched torch layers (state_dict key shape):")
        lines += [f"  {u.describe()}" for u in unmatched_torch]
    if unmatched_flax:
        lines.append("Unmatched Flax leaves (path shape):")
        lines += [f"  {'/'.join(p)} {tuple(np.shape(flat[p]))}" for p in unmatched_flax]
    if problems:
        lines.append("Ambiguous:")
        lines += [f"  {p}" for p in problems]
    if unmatched_torch:
        unit = unmatched_torch[0]
        key, shape = next(iter(unit.tensors.items()))
        transform = {"linear": "linear", "conv": "conv"}.get(unit.kind, "identity")
        target = _closest_leaf(key, shape, transform, unmatched_flax, flat, only=True)
        if target is None:  # no leaf reads like it or is left for it: name none
            target = "flax/path"
            lines.append(
                f"No Flax leaf left unfilled reads like {key} or is the only one of its shape "
                "(a weight the Flax model ties to another leaf has none: leave it out)."
            )
        lines.append(
            f"Fix: make the layer names or shapes agree, or pass explicit rules, e.g. "
            f"auto(model, variables, rules={{{key!r}: ({target!r}, {transform!r})}}) "
            f"(transforms: {', '.join(sorted(TRANSFORM_OPS))}; ops join with '|'; a rule value "
            "None leaves a torch tensor out)."
        )
    elif unmatched_flax and not problems:
        lines.append(
            "Fix: the Flax model has leaves no torch tensor fills; map them with rules "
            "(rules={'torch.key': ('flax/path', 'transform')}) or remove them from the Flax model."
        )
    return "\n".join(lines)


def _module_words(name: str) -> str:
    return re.sub(r"[._/]+", "/", name).strip("/")


def _closest_leaf(key: str, shape, transform: str, candidates, flat, only=False) -> str | None:
    """A Flax leaf for the fix hint, from names, never from a shape alone: among `candidates`
    of the shape the tensor gets, the one whose module path reads like the torch key's (close by
    name), or with `only` (candidates: the leaves no torch tensor fills) the one such leaf left.
    None when neither: a leaf of the same shape elsewhere in the model is no evidence."""
    try:
        want = transform_shape(transform, shape)
    except MappingError:
        want = None
    pool = [p for p in candidates if want is None or tuple(np.shape(flat[p])) == want]
    module = _module_words(key.rsplit(".", 1)[0])
    by_module = {_module_words("/".join(p[1:-1])): "/".join(p) for p in pool}
    close = difflib.get_close_matches(module, list(by_module), n=1, cutoff=0.6)
    if close:
        return by_module[close[0]]
    if only and len(pool) == 1:
        return "/".join(pool[0])
    return None
