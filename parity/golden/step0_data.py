"""What a golden file holds for step 0 beyond the model's outputs and gradients: the layer
probe's torch side, torch's per-layer outputs for the diagnosis, the rows only torch can
compute (stochastic modules, folded tensors, embedding padding rows) and, for a low-bit AdamW
precision, torchao's optimizer step. Encoded as JSON header fields and arrays (`encode_probe`,
`encode_layers`, `encode_optimizer`), read back and checked (`decode_probe`, `decode_layers`,
`decode_optimizer`); no torch here.

Arrays: ``probe/inputs``; ``probe/S/variables/...`` (the probe weights, Flax layout);
``probe/S/MODE/L/in0..`` and ``probe/S/MODE/L/out`` (layer ``L``'s inputs and output in Flax's
layout, torch's execution order); ``probe/S/MODE/output``; ``probe/S/train/stats/...``;
``layers/STAGE/MODE/L`` (torch's layer outputs at a step-0 stage); a train-mode array equal to
the eval-mode one at the same place is stored once (under ``eval``). The header's ``step0.probe``
holds names, floors and bands, ``step0.layers`` the module pairs and each pass's order.

A low-bit AdamW precision's optimizer step (`parity.verdicts.optim_judge.OptimizerRecord`):
``optim/moments/I/codes`` (uint8) and ``optim/moments/I/scale`` (float32) of each quantized
moment, ``optim/after/...`` (torch's weights after the step, Flax layout), ``optim/grads/...``
and ``optim/params/...`` only where they differ from the step-0 float32 gradients and the
initial weights the file holds anyway, and ``optim/order/...`` (int32: each Flax leaf's elements
in its torch tensor's order, the block order of the JAX state); the header's
``step0.optimizer`` names them and holds each moment's torch name, block size and pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parity.verdicts.optim_judge import OptimizerRecord, TorchMoment
from parity.verdicts.probe_judge import ProbeLayer, ProbeMode, ProbeRecord, ProbeScale
from parity.verdicts.sides import flatten

__all__ = [
    "MODES",
    "decode_layers",
    "decode_optimizer",
    "decode_probe",
    "encode_layers",
    "encode_optimizer",
    "encode_probe",
]

MODES = ("eval", "train")


def _nest(flat: Mapping[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split("/")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return tree


def _put(arrays: dict[str, np.ndarray], key: str, value: np.ndarray) -> None:
    """Stores a train-mode array only where it differs from the eval-mode one at the same place
    (a model without dropout or BatchNorm computes the same in both: stored once)."""
    twin = key.replace("/train/", "/eval/")
    if twin != key and twin in arrays and _same(arrays[twin], value):
        return
    arrays[key] = value


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


def _get(arrays: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    """`_put`'s reverse: a train-mode array not stored is the eval-mode one."""
    return arrays[key] if key in arrays else arrays[key.replace("/train/", "/eval/")]


def encode_probe(record: ProbeRecord | None, error: str | None) -> tuple[dict, dict]:
    """``(header, arrays)`` of torch's side of the layer probe (or of why it did not run)."""
    if record is None:
        return {"error": str(error)}, {}
    arrays: dict[str, np.ndarray] = {"probe/inputs": np.asarray(record.inputs)}
    scales = []
    for s, probe in enumerate(record.scales):
        for key, value in flatten(probe.variables).items():
            arrays[f"probe/{s}/variables/{key}"] = np.asarray(value, np.float32)
        modes = {}
        for mode_name, mode in zip(MODES, (probe.eval, probe.train), strict=True):
            prefix = f"probe/{s}/{mode_name}"
            arrays[f"{prefix}/output"] = np.asarray(mode.output, np.float32)
            for key, value in mode.stats.items():
                arrays[f"{prefix}/stats/{key}"] = np.asarray(value, np.float32)
            layers = []
            for i, layer in enumerate(mode.layers):
                for k, value in enumerate(layer.inputs):
                    _put(arrays, f"{prefix}/{i}/in{k}", np.asarray(value))
                if layer.output is not None:
                    _put(arrays, f"{prefix}/{i}/out", np.asarray(layer.output, np.float32))
                layers.append(
                    {
                        "name": layer.name,
                        "inputs": len(layer.inputs),
                        "output": layer.output is not None,
                        "floor": layer.floor,
                        "band": layer.band,
                    }
                )
            modes[mode_name] = {"layers": layers, "stats": sorted(mode.stats)}
        scales.append({"scale": probe.scale, "modes": modes})
    header = {
        "flax_of": [[name, list(path)] for name, path in record.flax_of.items()],
        "skipped": dict(record.skipped),
        "scales": scales,
    }
    return header, arrays


def decode_probe(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> ProbeRecord:
    """The `ProbeRecord` `encode_probe` wrote.

    Raises:
      KeyError / TypeError / ValueError: a field or array missing or malformed (the golden
        reader turns it into a `parity.golden.format.GoldenFileError`).
    """
    flax_of = {str(name): tuple(str(p) for p in path) for name, path in header["flax_of"]}
    scales = []
    for s, probe in enumerate(header["scales"]):
        modes = []
        for mode_name in MODES:
            prefix = f"probe/{s}/{mode_name}"
            info = probe["modes"][mode_name]
            layers = [
                ProbeLayer(
                    name=str(layer["name"]),
                    inputs=[
                        _get(arrays, f"{prefix}/{i}/in{k}") for k in range(int(layer["inputs"]))
                    ],
                    output=_get(arrays, f"{prefix}/{i}/out") if layer["output"] else None,
                    floor=None if layer["floor"] is None else float(layer["floor"]),
                    band=float(layer["band"]),
                )
                for i, layer in enumerate(info["layers"])
            ]
            stats = {key: arrays[f"{prefix}/stats/{key}"] for key in info["stats"]}
            modes.append(ProbeMode(layers, arrays[f"{prefix}/output"], stats))
        start = f"probe/{s}/variables/"
        variables = _nest({k[len(start) :]: v for k, v in arrays.items() if k.startswith(start)})
        scales.append(ProbeScale(float(probe["scale"]), variables, *modes))
    return ProbeRecord(arrays["probe/inputs"], flax_of, dict(header["skipped"]), scales)


def encode_layers(
    pairs: list[tuple[str, tuple[str, ...]]],
    unmatched: list[str],
    outputs: Mapping[str, tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]],
) -> tuple[dict, dict]:
    """``(header, arrays)`` of torch's layer outputs per step-0 stage (eval and train mode, each
    ``{torch module: array}`` in execution order) and the module pairs they are matched by."""
    arrays: dict[str, np.ndarray] = {}
    stages = {}
    for stage, passes in outputs.items():
        orders = {}
        for mode_name, captured in zip(MODES, passes, strict=True):
            orders[mode_name] = list(captured)
            for i, value in enumerate(captured.values()):
                _put(arrays, f"layers/{stage}/{mode_name}/{i}", np.asarray(value, np.float32))
        stages[stage] = orders
    header = {
        "pairs": [[name, list(path)] for name, path in pairs],
        "unmatched": list(unmatched),
        "stages": stages,
    }
    return header, arrays


def decode_layers(
    header: Mapping[str, Any], arrays: Mapping[str, np.ndarray], stage: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """torch's layer outputs at `stage`: ``(eval, train)``, each in execution order."""
    orders = header["stages"][stage]
    return tuple(
        {
            str(name): _get(arrays, f"layers/{stage}/{mode}/{i}")
            for i, name in enumerate(orders[mode])
        }
        for mode in MODES
    )


def _orders(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """A nested ``{module: {leaf: order}}`` block order, flattened to ``{"module/leaf": order}``."""
    out: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_orders(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = np.asarray(value, np.int32)
    return out


def encode_optimizer(
    record: OptimizerRecord, block_order: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
) -> tuple[dict, dict]:
    """``(header, arrays)`` of torchao's recorded step and the JAX state's block order.

    `arrays`: the file's other arrays; the step's weights and gradients are stored only where
    they differ from the initial weights (``init/params/...``) and the float32 step-0 gradients
    (``step0/fp32/grads/...``) stored there.
    """
    out: dict[str, np.ndarray] = {}
    for group, values, twin in (
        ("params", record.params, "init/params/"),
        ("grads", record.grads, "step0/fp32/grads/"),
    ):
        for key, value in values.items():
            value = np.asarray(value, np.float32)
            if twin + key not in arrays or not _same(arrays[twin + key], value):
                out[f"optim/{group}/{key}"] = value
    for key, value in record.after.items():
        out[f"optim/after/{key}"] = np.asarray(value, np.float32)
    moments = []
    for i, moment in enumerate(record.moments):
        out[f"optim/moments/{i}/codes"] = np.asarray(moment.codes, np.uint8).reshape(-1)
        out[f"optim/moments/{i}/scale"] = np.asarray(moment.scale, np.float32).reshape(-1)
        moments.append(
            {
                "torch_name": moment.torch_name,
                "moment": moment.moment,
                "block_size": int(moment.block_size),
                "pieces": [[int(f), int(n), str(p)] for f, n, p in moment.pieces],
            }
        )
    orders = _orders(block_order)
    for key, order in orders.items():
        out[f"optim/order/{key}"] = order
    header = {
        "moments": moments,
        "params": sorted(record.params),
        "grads": sorted(record.grads),
        "after": sorted(record.after),
        "order": sorted(orders),
    }
    return header, out


def decode_optimizer(
    header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
) -> tuple[OptimizerRecord, dict[str, Any]]:
    """``(torchao's recorded step, the JAX state's nested block order)`` `encode_optimizer` wrote.

    Raises:
      KeyError / TypeError / ValueError: a field or array missing or malformed.
    """

    def group(name: str, twin: str) -> dict[str, np.ndarray]:
        return {
            str(k): arrays[f"optim/{name}/{k}"]
            if f"optim/{name}/{k}" in arrays
            else arrays[twin + k]
            for k in header[name]
        }

    moments = []
    for i, moment in enumerate(header["moments"]):
        codes = arrays[f"optim/moments/{i}/codes"]
        if codes.dtype != np.uint8:
            raise ValueError(f"optim/moments/{i}/codes must be uint8; got {codes.dtype}")
        moments.append(
            TorchMoment(
                torch_name=str(moment["torch_name"]),
                moment=str(moment["moment"]),
                codes=codes,
                scale=np.asarray(arrays[f"optim/moments/{i}/scale"], np.float32),
                block_size=int(moment["block_size"]),
                pieces=tuple((int(f), int(n), str(p)) for f, n, p in moment["pieces"]),
            )
        )
    record = OptimizerRecord(
        params=group("params", "init/params/"),
        grads=group("grads", "step0/fp32/grads/"),
        after={str(k): arrays[f"optim/after/{k}"] for k in header["after"]},
        moments=moments,
    )
    return record, _nest({str(k): arrays[f"optim/order/{k}"] for k in header["order"]})
