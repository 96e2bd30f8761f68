"""Each mapped layer on its whole operating range: a step-0 check that does not depend on the init.

A model's own initialisation can hide a port bug. With Hugging Face's ``initializer_range`` of
0.02 the pre-activations are so small that an erf GELU and its tanh approximation agree to float32
rounding; biases and LayerNorm shifts start at zero, so a dropped bias or two swapped LayerNorms
change nothing; attention logits are near zero, so a wrong ``1/sqrt(d)`` scale hardly moves the
softmax; and a LayerNorm epsilon of 1e-6 against 1e-5 is invisible next to a unit variance. A band
that grows with the model's depth then hides what is left.

So, besides the model's own init, the torch model is copied and *probed*:

1. every constant vector parameter (zero biases, unit LayerNorm/BatchNorm scales) gets a random
   offset, so a dropped or misplaced one shows;
2. every mapped layer's parameters are rescaled, in execution order, so that the layer's output
   has a chosen root-mean-square (LSUV-style, two passes): ``1`` puts every nonlinearity (GELU,
   tanh, sigmoid, softmax) in its curved range, ``1e-2`` puts every normalisation's variance near
   its epsilon;
3. the Flax twin gets the same weights through the pair's own transfer, and both run on the
   batch with **each Flax layer fed torch's input to that layer** (a forward pre-hook on torch's
   side, `parity.pairs.adapters.intercept_calls` on Flax's, linen or NNX): the difference of a layer's
   outputs is that layer's own, not its upstream's, so it is judged against a band of its own;
4. for each layer two differences are measured, in eval and in train mode: its **output** (the
   layer itself: a kernel layout, an epsilon, a padding, an attention scale or mask) and its
   **input** as the Flax model computed it (what runs between the previous mapped layer and
   this one: an activation variant, a missing ReLU, a position offset, a flatten order).

Judgement. The *noise floor* of a layer is what correct arithmetic gives: torch's own float32
layer against the same layer in float64 on the same input. A layer's output fails when it differs
from torch's by more than ``NOISE_K`` times its floor (never less than ``SAFETY * u(float32)``): a
correct port differs by about its floor (1-3x on the built-in pairs), a port bug by far more.
Where no floor is measured (running statistics) the layer's own band decides:
``SAFETY * (sqrt(fan_in) * u(float32) + u(float32))`` with the layer's fan-in (longest dot
product or normalisation reduction), times ``sqrt(T)`` for a recurrent layer over ``T`` steps,
never the model's depth. Input differences are judged against the largest layer band of the
model, or ``NOISE_K`` times the largest floor if that is more (the operations between two layers
reduce no further than the layers themselves, and carry what a layer upstream amplifies).
Recurrent layers keep their own scale (their outputs are bounded; scaled up they saturate into
chaos).

Layers whose inputs cannot be substituted (a different call structure, say a torch ``nn.GRU``
against a Flax cell called per time step) are listed as not probed, with the reason.

Example::

    from parity.verdicts.layer_probe import probe_layers

    probe = probe_layers(get_model_pair("transformer"), inputs)
    print(probe.worst, probe.failed)
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from parity.pairs.adapters import intercept_calls, output_logits
from parity.pairs.mapping import apply_transform, parse_transform
from parity.verdicts.diagnose import first_tensor, module_pairs, shaped_error
from parity.verdicts.sides import flatten
from parity.verdicts.tolerance import SAFETY, unit_roundoff

__all__ = ["NOISE_K", "PROBE_EXAMPLES", "PROBE_SCALES", "LayerProbe", "probe_layers"]

# Output RMS of every mapped layer in the two probes: the nonlinear range, and the range where a
# normalisation's epsilon is comparable with its variance.
PROBE_SCALES = (1.0, 1e-2)

# A layer may differ from torch by this many times torch's own float32 rounding (the floor).
NOISE_K = 32.0

# Relative spread of the random offsets given to constant vector parameters.
_OFFSET = 0.5

# The probe runs on the batch's first examples: it asks whether each layer computes the same
# function, which a few examples show (thousands of values per layer); the whole batch would
# multiply every float64 floor and comparison by the batch size for nothing.
PROBE_EXAMPLES = 8


@dataclasses.dataclass
class LayerProbe:
    """What `probe_layers` measured.

    Attributes:
      rows: one dict per (probe scale, mode, layer, kind): ``layer`` (torch name), ``flax``,
        ``scale``, ``mode`` (``"eval"``/``"train"``), ``kind`` (``"output"``/``"input"``),
        ``error``, ``floor`` (None for inputs), ``band``, ``threshold``, ``passed``, ``note``.
      skipped: ``{torch layer: reason}`` for layers that could not be probed.
    """

    rows: list[dict[str, Any]]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def failed(self) -> list[dict[str, Any]]:
        """Rows over their threshold, worst first (by error / threshold)."""
        bad = [r for r in self.rows if not r["passed"]]
        return sorted(bad, key=lambda r: -_ratio(r))

    @property
    def worst(self) -> dict[str, Any] | None:
        """The row nearest to (or furthest past) its threshold."""
        return max(self.rows, key=_ratio, default=None)

    def describe(self, row: dict[str, Any]) -> str:
        """``"blocks.0.fc2 input (eval, output RMS 1): 3.1e-04 = 410 x its noise floor"``."""
        text = (
            f"{row['layer']} {row['kind']} ({row['mode']}, layer outputs at RMS "
            f"{row['scale']:g}): {row['error']:.3g}"
        )
        if row.get("floor"):
            text += f" = {row['error'] / row['floor']:.3g} x its noise floor {row['floor']:.2g}"
        if row.get("note"):
            text += f" ({row['note']})"
        return text


def _ratio(row: dict[str, Any]) -> float:
    threshold = row["threshold"]
    return row["error"] / threshold if threshold > 0 else math.inf


# --- the probe weights ---------------------------------------------------------------------------


def _owned_parameters(model: torch.nn.Module, names: list[str]) -> dict[str, list[torch.Tensor]]:
    """Each mapped module's parameters, without those of a mapped module nested inside it."""
    claimed: dict[int, str] = {}
    for name in sorted(names, key=lambda n: -len(n)):  # the most specific module claims first
        for p in model.get_submodule(name).parameters():
            claimed.setdefault(id(p), name)
    owned: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for name in names:
        for p in model.get_submodule(name).parameters():
            if claimed[id(p)] == name:
                owned[name].append(p)
    return owned


def _offset_constant_vectors(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Zero biases and unit scales get a random offset (so a dropped or swapped one shows)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                base = float(p.flatten()[0].abs()) or 1.0
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
                p.add_(noise.to(p.dtype) * _OFFSET * base)


def _rescale(pair, model, names, x, target: float) -> None:
    """Scales each mapped layer's parameters, in execution order, towards output RMS `target`."""
    owned = _owned_parameters(model, names)
    for _ in range(2):  # the second pass corrects layers that are not linear in their weights
        seen: set[str] = set()

        def hook(name, seen):
            def rescale(module, args, output):
                out = first_tensor(output)
                if name in seen or not isinstance(out, torch.Tensor) or not owned[name]:
                    return None
                if isinstance(module, torch.nn.RNNBase):
                    # Its outputs are bounded and its own init already puts the gates in their
                    # curved range; scaled up, it saturates into chaos (rounding amplified).
                    return None
                seen.add(name)
                rms = float(out.detach().double().pow(2).mean().sqrt())
                if not math.isfinite(rms) or rms == 0.0:
                    return None
                factor = min(max(target / rms, 1e-2), 1e2)
                with torch.no_grad():
                    for p in owned[name]:
                        p.mul_(factor)
                # Downstream layers see (about) the rescaled output in this same pass.
                return output * factor if isinstance(output, torch.Tensor) else None

            return rescale

        handles = [model.get_submodule(n).register_forward_hook(hook(n, seen)) for n in names]
        try:
            with torch.no_grad():
                pair.torch_forward(model, x, train=False)
        finally:
            for handle in handles:
                handle.remove()


# --- capturing each layer's inputs and outputs ---------------------------------------------------


def _to_flax_layout(pair, value: torch.Tensor, features: np.ndarray | None = None) -> np.ndarray:
    """A torch tensor in Flax's layout: NCHW -> NHWC, and a flattened CHW feature axis in HWC
    order where the layer's mapping says so (`features`, from `_feature_order`)."""
    array = value.detach().cpu()
    array = array.float().numpy() if array.is_floating_point() else array.numpy()
    if pair.torch_channels_first and array.ndim == 4:
        array = array.transpose(0, 2, 3, 1)
    if features is not None and array.ndim >= 1 and array.shape[-1] == features.size:
        array = array[..., features]
    return np.ascontiguousarray(array)


def _feature_order(pair, name: str) -> np.ndarray | None:
    """The input-feature permutation of a layer whose mapping reorders its input rows (a
    ``chw(...)`` transform: torch flattens C,H,W where Flax flattens H,W,C), else None."""
    mapping = getattr(pair, "mapping", None)
    for entry in getattr(mapping, "entries", ()):
        if entry.torch_module != name:
            continue
        for op, args in parse_transform(entry.transform):
            if op == "chw":
                size = int(math.prod(args))
                return apply_transform(f"chw({','.join(map(str, args))})", np.arange(size))
    return None


def _torch_capture(pair, model, names, x, train: bool) -> dict[str, dict[str, Any]]:
    """Per layer (first call): the call's args/kwargs (detached), its first output, and the
    model's output under key ``""``."""
    captured: dict[str, dict[str, Any]] = {}

    def pre(name):
        def record(module, args, kwargs):
            if name not in captured:
                captured[name] = {
                    "args": tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args),
                    "kwargs": dict(kwargs),
                }

        return record

    def post(name):
        def record(module, args, kwargs, output):
            entry = captured.get(name)
            if entry is not None and "output" not in entry:
                out = first_tensor(output)
                entry["output"] = out.detach().clone() if torch.is_tensor(out) else None

        return record

    handles = []
    for name in names:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    try:
        with torch.no_grad():
            logits = pair.torch_forward(model, x, train=train)
    finally:
        for handle in handles:
            handle.remove()
    captured[""] = {"output": logits.detach().clone()}
    return captured


def _float64_floor(module: torch.nn.Module, entry: dict[str, Any], train: bool) -> float | None:
    """torch's float32 layer output against the same layer in float64 on the same input."""
    if entry.get("output") is None:
        return None

    def up(value):
        return value.double() if torch.is_tensor(value) and value.is_floating_point() else value

    twin = copy.deepcopy(module).double().train(train)
    try:
        with torch.no_grad():
            exact = first_tensor(
                twin(
                    *[up(a) for a in entry["args"]],
                    **{k: up(v) for k, v in entry["kwargs"].items()},
                )
            )
    except (RuntimeError, TypeError):  # a kernel without float64: no floor, the band decides
        return None
    if not torch.is_tensor(exact):
        return None
    got = entry["output"].double().cpu().numpy()
    return shaped_error(got, exact.cpu().numpy())[0]


def _trace_of(value: Any) -> Any:
    """The JAX trace a traced value belongs to (None for a concrete array)."""
    return getattr(value, "_trace", None) if isinstance(value, jax.core.Tracer) else None


def _nested(value: Any, outer: Any) -> bool:
    """Whether `value` is traced by a transform inside the program (a scan over time steps),
    not by the program itself."""
    return isinstance(value, jax.core.Tracer) and _trace_of(value) is not outer


class _FlaxRunner:
    """The Flax model with each mapped module fed torch's input to the matching layer, in eval
    and in train mode.

    Calling it returns, per mode, ``{torch name: {"own_input", "output", "substituted",
    "note"}}`` and, under ``""``, the model output and the running statistics it left.
    """

    def __init__(self, pair, flax_of: dict[str, tuple[str, ...]]):
        self.pair = pair
        self.torch_of = {tuple(str(p) for p in path): name for name, path in flax_of.items()}
        self.meta: dict[bool, dict[str, dict[str, Any]]] = {False: {}, True: {}}
        # One compiled program (eval and train mode) whose arguments are the probe weights and
        # every layer's substituted input: traced and compiled once, then reused for every probe
        # scale (same shapes). ``meta`` holds the facts of that one trace.
        self.program = jax.jit(self._both)

    def _both(self, variables, x, substitutes_eval, substitutes_train):
        return (
            self._forward(variables, x, substitutes_eval, False),
            self._forward(variables, x, substitutes_train, True),
        )

    def _forward(self, variables, x, substitutes, train: bool):
        meta = self.meta[train]  # static facts of the trace (which inputs were substituted)
        meta.clear()
        found: dict[str, dict[str, Any]] = {}
        outer = _trace_of(x)  # the program's own trace; a layer called under another is nested

        def interceptor(path, next_fun, args, kwargs):
            name = self.torch_of.get(path)
            if name is None or name in meta or name not in substitutes:
                return next_fun(*args, **kwargs)
            info = meta[name] = {"substituted": False, "note": ""}
            if any(_nested(a, outer) for a in jax.tree_util.tree_leaves(args)):
                # Inside a transform (nn.RNN's scan over time steps): a per-step call that
                # torch's whole-sequence layer has no counterpart of.
                info["note"] = "called inside a JAX transform (a scan over time steps)"
                return next_fun(*args, **kwargs)
            values: dict[str, Any] = {}
            new_args = list(args)
            arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array | np.ndarray)]
            if arrays:
                values["own_input"] = args[arrays[0]]
            given_all = substitutes[name]
            if not arrays or not given_all:
                info["note"] = "no array input to substitute"
            for position, index in enumerate(arrays[: len(given_all)]):
                own, given = args[index], given_all[position]
                try:
                    shape = np.broadcast_shapes(given.shape, own.shape)
                except ValueError:
                    shape = None
                if shape != tuple(own.shape):
                    info["note"] = (
                        f"input shapes differ: torch {tuple(given.shape)}, flax {tuple(own.shape)}"
                    )
                    new_args = list(args)
                    break
                new_args[index] = jnp.broadcast_to(given, own.shape).astype(own.dtype)
            else:
                info["substituted"] = bool(arrays and given_all)
            out = next_fun(*new_args, **kwargs)
            first = jax.tree_util.tree_leaves(out)
            if first:
                values["output"] = first[0]
            found[name] = values
            return out

        with intercept_calls(interceptor):
            logits, stats = self.pair.flax_apply(variables, x, train)
        return output_logits(logits, "flax"), found, stats

    def __call__(self, variables, inputs, substitutes_eval, substitutes_train):
        with jax.default_matmul_precision("highest"):
            both = jax.device_get(
                self.program(
                    dict(variables), jnp.asarray(inputs), substitutes_eval, substitutes_train
                )
            )
        results = {}
        for train, (logits, found, stats) in zip((False, True), both, strict=True):
            out = {
                name: {
                    **info,
                    **{k: np.asarray(v) for k, v in found.get(name, {}).items()},
                }
                for name, info in self.meta[train].items()
            }
            out[""] = {"output": np.asarray(logits), "substituted": True, "note": ""}
            out[""]["stats"] = flatten(stats) if stats is not None else {}
            results[train] = out
        return results


def _substitutes(pair, torch_entries) -> dict[str, list[np.ndarray]]:
    """Each layer's torch inputs in Flax's layout (the arguments of `_FlaxRunner`)."""
    return {
        name: [
            _to_flax_layout(pair, a, _feature_order(pair, name))
            for a in entry["args"]
            if torch.is_tensor(a)
        ]
        for name, entry in torch_entries.items()
        if name
    }


# --- bands ---------------------------------------------------------------------------------------


def _fan_in(module: torch.nn.Module, entry: dict[str, Any]) -> int:
    """The layer's longest reduction: its weights' input size, or a normalisation's length."""
    fan = 1
    vectors = []
    for p in module.parameters(recurse=False):
        if p.dim() >= 2:
            fan = max(fan, int(math.prod(p.shape[1:])))
        elif p.dim() == 1:
            vectors.append(p.numel())
    for child in module.children():  # attention's out_proj and the like
        for p in child.parameters():
            if p.dim() >= 2:
                fan = max(fan, int(math.prod(p.shape[1:])))
    inputs = [a for a in entry.get("args", ()) if torch.is_tensor(a)]
    if fan == 1 and vectors and inputs:
        features = max(vectors)
        # LayerNorm reduces over the features, BatchNorm over everything else.
        fan = max(features, inputs[0].numel() // max(features, 1))
    if isinstance(module, torch.nn.MultiheadAttention) and inputs and inputs[0].dim() >= 2:
        fan = max(fan, int(inputs[0].shape[-2]))  # the softmax-weighted sum over keys
    return fan


def _steps(module: torch.nn.Module, entry: dict[str, Any]) -> int:
    inputs = [a for a in entry.get("args", ()) if torch.is_tensor(a)]
    if isinstance(module, torch.nn.RNNBase) and inputs and inputs[0].dim() == 3:
        return int(inputs[0].shape[1 if module.batch_first else 0])
    return 1


def _band(fan_in: int, steps: int) -> float:
    u = unit_roundoff("float32")
    return SAFETY * (math.sqrt(fan_in) * u + u) * math.sqrt(steps)


def _threshold(band: float, floor: float | None) -> float:
    """``NOISE_K`` times the layer's noise floor (never below ``SAFETY * u(float32)``): below
    the band where the correct arithmetic is quiet, above it where the layer itself amplifies
    rounding (a recurrence); the band where no floor could be measured."""
    if floor is None:
        return band
    return max(NOISE_K * floor, SAFETY * unit_roundoff("float32"))


# --- the probe -----------------------------------------------------------------------------------


def probe_layers(
    pair: Any,
    inputs: Any,
    *,
    scales: tuple[float, ...] = PROBE_SCALES,
    seed: int = 0,
) -> LayerProbe:
    """Compares every mapped layer of a pair on probe weights, each fed the same input.

    Runs in float32 at the highest matmul precision (the probe asks whether the port computes
    the same function; the precision checks are step 0's other rows).

    Args:
      pair: a `parity.models.ModelPair` (linen, Hugging Face Flax or NNX on the Flax side).
      inputs: one input batch (numpy); its first ``PROBE_EXAMPLES`` examples are probed.
      scales: the output RMS each probe gives every mapped layer.
      seed: the seed of the random offsets.

    Returns:
      A `LayerProbe`.

    Example:
      >>> probe = probe_layers(get_model_pair("mlp"), inputs)
      >>> probe.failed
      []
    """
    inputs = np.asarray(inputs)[:PROBE_EXAMPLES]
    variables = pair.torch_to_flax()
    pairs, unmatched = module_pairs(pair, variables)
    names = [t for t, _ in pairs]
    flax_of = {t: f for t, f in pairs}
    skipped = {name: "no Flax counterpart found" for name in unmatched}
    rows: list[dict[str, Any]] = []
    previous = torch.get_float32_matmul_precision()
    previous_threads = torch.get_num_threads()
    torch.set_float32_matmul_precision("highest")
    # One layer at a time on small batches: extra threads only contend (70x slower measured on a
    # loaded 2-core machine for the tiny resnet).
    torch.set_num_threads(1)
    runner = _FlaxRunner(pair, flax_of)
    try:
        for scale in scales:
            generator = torch.Generator().manual_seed(seed)
            model = copy.deepcopy(pair.torch_model).float().cpu()
            x = torch.from_numpy(np.ascontiguousarray(inputs))
            _offset_constant_vectors(model, generator)
            _rescale(pair, model, names, x, scale)
            probe_pair = dataclasses.replace(pair, torch_model=model)
            probe_variables = probe_pair.torch_to_flax()
            captures = {}
            for train in (False, True):
                trained = copy.deepcopy(model)
                captures[train] = _torch_capture(probe_pair, trained, names, x, train)
                if train:  # the running statistics the train-mode pass left behind
                    captures[train][""]["stats"] = flatten(
                        probe_pair.to_flax(trained).get("batch_stats", {})
                    )
            flax_results = runner(
                probe_variables,
                inputs,
                _substitutes(pair, captures[False]),
                _substitutes(pair, captures[True]),
            )
            for train in (False, True):
                rows += _judge(
                    pair,
                    model,
                    names,
                    flax_of,
                    captures[train],
                    flax_results[train],
                    scale,
                    "train" if train else "eval",
                    train,
                    skipped,
                )
    finally:
        torch.set_num_threads(previous_threads)
        torch.set_float32_matmul_precision(previous)
    return LayerProbe(rows, skipped)


def _stats_error(torch_stats, flax_stats, name, flax_of) -> tuple[float, str] | None:
    """The worst running-statistic difference of one layer after the train-mode pass."""
    if not torch_stats:
        return None
    prefix = "/".join(flax_of[name]) + "/"
    keys = [k for k in torch_stats if k.startswith(prefix)]
    if not keys:
        return None
    worst, note = 0.0, ""
    for key in keys:
        if key not in (flax_stats or {}):
            return math.inf, f"{key} only on torch's side"
        error, shape_note = shaped_error(flax_stats[key], torch_stats[key])
        if error > worst:
            worst, note = error, key.rsplit("/", 1)[-1] + (f"; {shape_note}" if shape_note else "")
    return worst, note


def _judge(pair, model, names, flax_of, torch_entries, flax_entries, scale, mode, train, skipped):
    rows: list[dict[str, Any]] = []
    layer_rows = []
    # Execution order (torch's pre-hooks fired in it); layers never called go last.
    ordered = [n for n in torch_entries if n in flax_of] + [
        n for n in names if n not in torch_entries
    ]
    for name in ordered:
        t, f = torch_entries.get(name), flax_entries.get(name)
        if t is None or f is None:
            if t is None and f is None:
                continue  # not called by this forward pass (either side)
            side = "torch" if f is None else "flax"
            skipped.setdefault(name, f"called by {'torch' if t else 'flax'} only, not by {side}")
            continue
        if not f["substituted"]:
            skipped.setdefault(name, f["note"] or "input not substituted")
            continue
        module = model.get_submodule(name)
        band = _band(_fan_in(module, t), _steps(module, t))
        base = {"layer": name, "flax": "/".join(flax_of[name]), "scale": scale, "mode": mode}
        if t.get("output") is not None and f.get("output") is not None:
            error, note = shaped_error(f["output"], _to_flax_layout(pair, t["output"]))
            floor = _float64_floor(module, t, train)
            threshold = _threshold(band, floor)
            layer_rows.append(
                base
                | {
                    "kind": "output",
                    "error": error,
                    "floor": floor,
                    "band": band,
                    "threshold": threshold,
                    "passed": bool(error <= threshold),
                    "note": note,
                }
            )
        stats = _stats_error(
            torch_entries[""].get("stats"), flax_entries[""].get("stats"), name, flax_of
        )
        if stats is not None:
            error, note = stats
            layer_rows.append(
                base
                | {
                    "kind": "running stats",
                    "error": error,
                    "floor": None,
                    "band": band,
                    "threshold": band,
                    "passed": bool(error <= band),
                    "note": note,
                }
            )
        torch_inputs = [a for a in t["args"] if torch.is_tensor(a)]
        if torch_inputs and f.get("own_input") is not None:
            given = _to_flax_layout(pair, torch_inputs[0], _feature_order(pair, name))
            error, note = shaped_error(f["own_input"], given)
            layer_rows.append(
                base | {"kind": "input", "error": error, "floor": None, "band": band, "note": note}
            )
    # What runs between two layers reduces no further than the layers do, and carries what an
    # amplifying layer upstream (a recurrence) does to its own rounding.
    floors = [r["floor"] for r in layer_rows if r.get("floor")]
    input_band = max(
        [r["band"] for r in layer_rows] + [NOISE_K * f for f in floors] or [_band(1, 1)]
    )
    for row in layer_rows:
        if row["kind"] == "input":
            row["threshold"] = input_band
            row["passed"] = bool(row["error"] <= input_band)
        rows.append(row)
    t_out, f_out = torch_entries[""]["output"], flax_entries[""]["output"]
    error, note = shaped_error(f_out, t_out.float().cpu().numpy())
    rows.append(
        {
            "layer": "(model output)",
            "flax": "",
            "scale": scale,
            "mode": mode,
            "kind": "output",
            "error": error,
            "floor": None,
            "band": input_band,
            "threshold": input_band,
            "passed": bool(error <= input_band),
            "note": note,
        }
    )
    return rows
