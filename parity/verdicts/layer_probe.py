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

import numpy as np
import torch

from parity.pairs.mapping import apply_transform, parse_transform
from parity.verdicts.diagnose import first_tensor, module_pairs
from parity.verdicts.layer_table import shaped_error
from parity.verdicts.probe_judge import (
    NOISE_K,
    PROBE_EXAMPLES,
    PROBE_FLOPS,
    PROBE_MIN_EXAMPLES,
    PROBE_SCALES,
    LayerProbe,
    ProbeLayer,
    ProbeMode,
    ProbeRecord,
    ProbeScale,
    _band,
    judge_probe,
)
from parity.verdicts.sides import flatten
from parity.verdicts.tolerance import examples_within, forward_flops

__all__ = [
    "NOISE_K",
    "PROBE_EXAMPLES",
    "PROBE_SCALES",
    "LayerProbe",
    "probe_examples",
    "probe_layers",
    "probe_torch",
]


# Relative spread of the random offsets given to constant vector parameters.
_OFFSET = 0.5


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
                # drawn on the CPU whatever the model's device: the same offsets everywhere
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
                p.add_(noise.to(device=p.device, dtype=p.dtype) * _OFFSET * base)


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


# --- the probe -----------------------------------------------------------------------------------


def _substitutes(pair, torch_entries) -> dict[str, list[np.ndarray]]:
    """Each layer's torch inputs in Flax's layout (what the Flax layer is fed)."""
    return {
        name: [
            _to_flax_layout(pair, a, _feature_order(pair, name))
            for a in entry["args"]
            if torch.is_tensor(a)
        ]
        for name, entry in torch_entries.items()
        if name
    }


def _same_call(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two captured calls of a layer had equal inputs and gave an equal output."""

    def same(x, y):
        if torch.is_tensor(x) or torch.is_tensor(y):
            return (
                torch.is_tensor(x)
                and torch.is_tensor(y)
                and x.shape == y.shape
                and x.dtype == y.dtype
                and bool(torch.equal(x, y))
            )
        return x is y or (type(x) is type(y) and bool(x == y))

    try:
        return (
            a.get("output") is not None
            and b.get("output") is not None
            and len(a["args"]) == len(b["args"])
            and a["kwargs"].keys() == b["kwargs"].keys()
            and same(a["output"], b["output"])
            and all(same(x, y) for x, y in zip(a["args"], b["args"], strict=True))
            and all(same(v, b["kwargs"][k]) for k, v in a["kwargs"].items())
        )
    except (RuntimeError, TypeError, ValueError):  # an argument without a plain equality
        return False


def _record_mode(pair, model, entries, train: bool, eval_pass=None) -> ProbeMode:
    """One torch pass's layers, recorded: inputs and output in Flax's layout, floor and band.

    `eval_pass` (``(entries, ProbeMode)`` of the eval-mode pass) gives the train-mode pass a
    layer's float64 floor where that layer's call was the same in both modes (equal inputs, equal
    float32 output: the layer computed the same function on the same values, so its float64 twin
    would too); only layers whose call differs (a BatchNorm, anything downstream of one) are
    run in float64 again."""
    inputs = _substitutes(pair, entries)
    earlier, earlier_floors = {}, {}
    if eval_pass is not None:
        earlier = eval_pass[0]
        earlier_floors = {layer.name: layer.floor for layer in eval_pass[1].layers}
    layers = []
    for name, entry in entries.items():
        if not name:
            continue
        module = model.get_submodule(name)
        output = entry.get("output")
        if output is None:
            floor = None
        elif name in earlier_floors and _same_call(entry, earlier[name]):
            floor = earlier_floors[name]
        else:
            floor = _float64_floor(module, entry, train)
        layers.append(
            ProbeLayer(
                name=name,
                inputs=inputs[name],
                output=None if output is None else _to_flax_layout(pair, output),
                floor=floor,
                band=_band(_fan_in(module, entry), _steps(module, entry)),
            )
        )
    return ProbeMode(
        layers,
        entries[""]["output"].float().cpu().numpy(),
        dict(entries[""].get("stats") or {}),
    )


def probe_examples(pair: Any, inputs: Any, flops: int | None = None) -> int:
    """How many of the batch's first examples the probe runs on: ``PROBE_EXAMPLES``, or as many
    as a forward pass of ``PROBE_FLOPS`` matmul FLOPs holds (at least ``PROBE_MIN_EXAMPLES``);
    never more than the batch.

    Args:
      pair: the model pair.
      inputs: the batch.
      flops: the float32 forward pass's matmul FLOPs on the whole batch (default: counted here
        from the Flax program, `parity.verdicts.tolerance.forward_flops`).

    Example:
      >>> probe_examples(get_model_pair("mlp"), inputs)
      8
    """
    size = len(inputs)
    if flops is None:
        flops = forward_flops(pair, pair.torch_to_flax(), inputs)
    return max(1, examples_within(size, flops, PROBE_FLOPS, PROBE_MIN_EXAMPLES, PROBE_EXAMPLES))


def probe_torch(
    pair: Any,
    inputs: Any,
    *,
    scales: tuple[float, ...] = PROBE_SCALES,
    seed: int = 0,
    device: str = "cpu",
    flops: int | None = None,
) -> ProbeRecord:
    """torch's side of the layer probe: the probe weights (Flax layout) and, per probe scale and
    mode, each mapped layer's inputs, output, noise floor and band (`ProbeRecord`), for
    `parity.verdicts.probe_judge.judge_probe` here or from a golden file.

    Args: as `probe_layers`.
    """
    inputs = np.asarray(inputs)
    inputs = inputs[: probe_examples(pair, inputs, flops)]
    variables = pair.torch_to_flax()
    pairs, unmatched = module_pairs(pair, variables)
    names = [t for t, _ in pairs]
    flax_of = {t: tuple(f) for t, f in pairs}
    skipped = {name: "no Flax counterpart found" for name in unmatched}
    device = torch.device(device)
    previous = torch.get_float32_matmul_precision()
    previous_threads = torch.get_num_threads()
    previous_cudnn_tf32 = torch.backends.cudnn.allow_tf32
    # IEEE float32 everywhere: no TF32 in matmuls ("highest") nor in cuDNN's convolutions.
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    if device.type == "cpu":
        # One layer at a time on small batches: extra threads only contend (70x slower measured
        # on a loaded 2-core machine for the tiny resnet).
        torch.set_num_threads(1)
    probes = []
    try:
        for scale in scales:
            generator = torch.Generator().manual_seed(seed)
            # On the device the pair trains on: on a GPU, GPT-2 small's probe passes (float32
            # and the float64 floors) took 92 s of CPU when run on the host.
            model = copy.deepcopy(pair.torch_model).float().to(device)
            x = torch.from_numpy(np.ascontiguousarray(inputs)).to(device)
            _offset_constant_vectors(model, generator)
            _rescale(pair, model, names, x, scale)
            probe_pair = dataclasses.replace(pair, torch_model=model)
            modes = {}
            eval_pass = None
            # A train-mode pass changes buffers only (running statistics): without any, it runs
            # on the probe model itself, and there are no statistics to read back.
            buffers = any(True for _ in model.buffers())
            for train in (False, True):
                trained = copy.deepcopy(model) if train and buffers else model
                entries = _torch_capture(probe_pair, trained, names, x, train)
                if train and "batch_stats" in variables:  # the statistics the pass left behind
                    entries[""]["stats"] = flatten(
                        probe_pair.to_flax(trained).get("batch_stats", {})
                    )
                modes[train] = _record_mode(pair, model, entries, train, eval_pass)
                eval_pass = (entries, modes[train])
            probes.append(
                ProbeScale(float(scale), probe_pair.torch_to_flax(), modes[False], modes[True])
            )
    finally:
        torch.set_num_threads(previous_threads)
        torch.set_float32_matmul_precision(previous)
        torch.backends.cudnn.allow_tf32 = previous_cudnn_tf32
    return ProbeRecord(inputs, flax_of, skipped, probes)


def probe_layers(
    pair: Any,
    inputs: Any,
    *,
    scales: tuple[float, ...] = PROBE_SCALES,
    seed: int = 0,
    device: str = "cpu",
    flops: int | None = None,
) -> LayerProbe:
    """Compares every mapped layer of a pair on probe weights, each fed the same input.

    Runs in float32 at the highest matmul precision (the probe asks whether the port computes
    the same function; the precision checks are step 0's other rows): torch's side
    (`probe_torch`), then the Flax side judged against it
    (`parity.verdicts.probe_judge.judge_probe`).

    Args:
      pair: a `parity.models.ModelPair` (linen, Hugging Face Flax or NNX on the Flax side).
      inputs: one input batch (numpy); its first ``PROBE_EXAMPLES`` examples are probed, or
        fewer for a large model (`probe_examples`).
      scales: the output RMS each probe gives every mapped layer.
      seed: the seed of the random offsets.
      device: torch's device for the probe's passes (``"cuda"`` where the run trains on a GPU);
        the probe weights and inputs are drawn on the CPU, the same on every device.
      flops: the forward pass's matmul FLOPs on `inputs`, when known (`probe_examples`).

    Returns:
      A `LayerProbe`.

    Example:
      >>> probe = probe_layers(get_model_pair("mlp"), inputs)
      >>> probe.failed
      []
    """
    record = probe_torch(pair, inputs, scales=scales, seed=seed, device=device, flops=flops)
    return judge_probe(pair, record)
