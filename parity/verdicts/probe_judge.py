"""The layer probe's judging, from torch's side recorded: torch-free.

`parity.verdicts.layer_probe` runs torch on probe weights and records, per probe scale and mode,
each mapped layer's inputs and output (in Flax's layout), its noise floor and its band
(`ProbeRecord`); `judge_probe` feeds each Flax layer those inputs and judges its outputs. The
two halves run in one process for `parity.compare_models` (`layer_probe.probe_layers`) and in two
for a golden file: recorded where torch is installed (`parity.golden.export`), judged where it
is not (`parity.golden.check`). The method and the bands are `parity.verdicts.layer_probe`'s
docstring's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parity.core.once import once_jit
from parity.pairs.adapters import intercept_calls, output_logits
from parity.verdicts.layer_table import PROBE_CHECK, shaped_error
from parity.verdicts.qualifiers import verdict
from parity.verdicts.rows import Verdict, cell_fields
from parity.verdicts.sides import flatten
from parity.verdicts.tolerance import SAFETY, unit_roundoff

__all__ = [
    "NOISE_K",
    "PROBE_CHECK",
    "PROBE_EXAMPLES",
    "PROBE_FLOPS",
    "PROBE_MIN_EXAMPLES",
    "PROBE_SCALES",
    "LayerProbe",
    "ProbeLayer",
    "ProbeMode",
    "ProbeRecord",
    "ProbeScale",
    "judge_probe",
    "probe_row",
]

# Output RMS of every mapped layer in the two probes: the nonlinear range, and the range where a
# normalisation's epsilon is comparable with its variance.
PROBE_SCALES = (1.0, 1e-2)


# A layer may differ from torch by this many times torch's own float32 rounding (the floor).
NOISE_K = 32.0


# The probe runs on the batch's first examples: it asks whether each layer computes the same
# function, which a few examples show (thousands of values per layer); the whole batch would
# multiply every float64 floor and comparison by the batch size for nothing.
PROBE_EXAMPLES = 8


# ... or on fewer: as many as one forward pass of PROBE_FLOPS matmul FLOPs holds (never fewer
# than PROBE_MIN_EXAMPLES), so that the probe's passes (rescaling, capture, float64 floors, the
# Flax side) cost about as much at every model size instead of growing with the layers' work.
# The built-in models at their default sizes stay at PROBE_EXAMPLES; a 512-wide, 8-layer
# transformer at context 64 (2.2 GFLOP an example) is probed on 2 examples, 64 positions each:
# 32,768 values per layer output.
PROBE_FLOPS = 2**30
PROBE_MIN_EXAMPLES = 2


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


def _same_program(a: Any, b: Any) -> bool:
    """Whether two lowered programs are the same program taking the same arguments (the same
    StableHLO text and argument structure): one compiled executable serves both."""
    return a.in_tree == b.in_tree and a.as_text() == b.as_text()


def _signature(args: Any) -> Any:
    """The pytree structure, shapes and dtypes of a program's arguments (what selects its
    compiled form)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((np.shape(v), str(getattr(v, "dtype", type(v)))) for v in leaves)


def _ratio(row: dict[str, Any]) -> float:
    threshold = row["threshold"]
    return row["error"] / threshold if threshold > 0 else math.inf


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
        # One compiled program per mode whose arguments are the probe weights and every layer's
        # substituted input: traced and compiled once, then reused for every probe scale (same
        # shapes). A model whose train mode computes what its eval mode does (no dropout, no
        # batch statistics: the two modes lower to the same program) compiles it once and runs
        # it for both. ``meta`` holds the facts of each mode's one trace.
        self.program = once_jit(self._forward, static_argnums=3)
        self.compiled: dict[Any, Any] = {}  # (mode, argument signature) -> executable

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

    def _executables(self, args: dict[bool, tuple]) -> dict[bool, Any]:
        """The compiled program of each mode for these arguments' shapes: traced per mode (each
        mode's ``meta``), compiled once where both modes lower to the same program."""
        keys = {train: (train, _signature(a)) for train, a in args.items()}
        if all(key in self.compiled for key in keys.values()):
            return {train: self.compiled[key] for train, key in keys.items()}
        lowered = {train: self.program.trace(*a, train).lower() for train, a in args.items()}
        same = _same_program(lowered[False], lowered[True])
        eval_program = lowered[False].compile()
        self.compiled[keys[False]] = eval_program
        self.compiled[keys[True]] = eval_program if same else lowered[True].compile()
        return {train: self.compiled[key] for train, key in keys.items()}

    def __call__(self, variables, inputs, substitutes_eval, substitutes_train):
        x = jnp.asarray(inputs)
        args = {
            False: (dict(variables), x, substitutes_eval),
            True: (dict(variables), x, substitutes_train),
        }
        with jax.default_matmul_precision("highest"):
            programs = self._executables(args)
            both = [jax.device_get(programs[train](*args[train])) for train in (False, True)]
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


# --- torch's side, recorded -----------------------------------------------------------------------


@dataclasses.dataclass
class ProbeLayer:
    """One mapped layer's first call in torch on probe weights.

    Attributes:
      name: the torch module.
      inputs: its array arguments in Flax's layout (what the Flax layer is fed).
      output: its first output in Flax's layout (None when it returned no tensor).
      floor: torch's float32 output against float64 on the same input (None: not measured).
      band: ``SAFETY * (sqrt(fan-in) + 1) * u(float32) * sqrt(T)`` for the layer.
    """

    name: str
    inputs: list[np.ndarray]
    output: np.ndarray | None
    floor: float | None
    band: float


@dataclasses.dataclass
class ProbeMode:
    """One torch forward pass on probe weights (eval or train mode).

    Attributes:
      layers: the mapped layers torch called, in its execution order.
      output: the model's output.
      stats: the running statistics the pass left (train mode; Flax keys).
    """

    layers: list[ProbeLayer]
    output: np.ndarray
    stats: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ProbeScale:
    """One probe: the weights (Flax layout) giving every mapped layer output RMS `scale`."""

    scale: float
    variables: dict[str, Any]
    eval: ProbeMode
    train: ProbeMode


@dataclasses.dataclass
class ProbeRecord:
    """torch's side of the layer probe (`parity.verdicts.layer_probe.probe_torch`).

    Attributes:
      inputs: the probed examples.
      flax_of: ``{torch module: Flax module path}`` of every mapped layer, in the mapping's order.
      skipped: ``{torch module: reason}`` for layers that cannot be probed.
      scales: one `ProbeScale` per probe.
    """

    inputs: np.ndarray
    flax_of: dict[str, tuple[str, ...]]
    skipped: dict[str, str]
    scales: list[ProbeScale]


def _substitutes(mode: ProbeMode) -> dict[str, list[np.ndarray]]:
    return {layer.name: list(layer.inputs) for layer in mode.layers}


def judge_probe(pair: Any, record: ProbeRecord) -> LayerProbe:
    """Feeds each Flax layer of `pair` torch's recorded inputs and judges its outputs.

    Args:
      pair: the Flax half of a pair (``flax_apply``; `parity.models.ModelPair` or a golden's).
      record: torch's side (`parity.verdicts.layer_probe.probe_torch`).

    Returns:
      A `LayerProbe` (rows in torch's execution order per probe scale and mode).
    """
    runner = _FlaxRunner(pair, record.flax_of)
    skipped = dict(record.skipped)
    rows: list[dict[str, Any]] = []
    for probe in record.scales:
        results = runner(
            probe.variables, record.inputs, _substitutes(probe.eval), _substitutes(probe.train)
        )
        for train, mode in ((False, probe.eval), (True, probe.train)):
            rows += _judge(
                record.flax_of,
                mode,
                results[train],
                probe.scale,
                "train" if train else "eval",
                skipped,
            )
    return LayerProbe(rows, skipped)


def _judge(flax_of, mode: ProbeMode, flax_entries, scale, mode_name, skipped):
    rows: list[dict[str, Any]] = []
    layer_rows = []
    torch_entries = {layer.name: layer for layer in mode.layers}
    # Execution order (torch's pre-hooks fired in it); layers never called go last.
    ordered = [n for n in torch_entries if n in flax_of] + [
        n for n in flax_of if n not in torch_entries
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
        band = t.band
        base = {"layer": name, "flax": "/".join(flax_of[name]), "scale": scale, "mode": mode_name}
        if t.output is not None and f.get("output") is not None:
            error, note = shaped_error(f["output"], t.output)
            threshold = _threshold(band, t.floor)
            layer_rows.append(
                base
                | {
                    "kind": "output",
                    "error": error,
                    "floor": t.floor,
                    "band": band,
                    "threshold": threshold,
                    "passed": bool(error <= threshold),
                    "note": note,
                }
            )
        stats = _stats_error(mode.stats, flax_entries[""].get("stats"), name, flax_of)
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
        if t.inputs and f.get("own_input") is not None:
            error, note = shaped_error(f["own_input"], t.inputs[0])
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
    error, note = shaped_error(flax_entries[""]["output"], mode.output)
    rows.append(
        {
            "layer": "(model output)",
            "flax": "",
            "scale": scale,
            "mode": mode_name,
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


# --- the step-0 row -------------------------------------------------------------------------------


def probe_row(config: Any, probe: LayerProbe | None, error: str | None = None) -> Verdict:
    """The probe's step-0 row: from its `LayerProbe`, or informational with why it did not run
    (`error`: the probe raised)."""
    compared = "jax vs torch, each Flax layer fed torch's input, on probe weights"
    if probe is None:
        return verdict(
            check=PROBE_CHECK,
            kind="layer probe",
            compared=compared,
            value="not run",
            tolerance="-",
            passed=None,
            detail=f"the probe raised {error}",
            mode="step 0",
            **cell_fields(config),
        )
    if not probe.rows:
        return verdict(
            check=PROBE_CHECK,
            kind="layer probe",
            compared=compared,
            value="no layer probed",
            tolerance="-",
            passed=None,
            detail="; ".join(f"{k}: {v}" for k, v in probe.skipped.items())[:500],
            mode="step 0",
            **cell_fields(config),
        )
    failed = probe.failed
    row = failed[0] if failed else probe.worst
    layers = {r["layer"] for r in probe.rows} - {"(model output)"}
    # In execution order, so the first named is where the two models first part.
    over = list(dict.fromkeys(f"{r['layer']} {r['kind']}" for r in probe.rows if not r["passed"]))
    detail = (
        f"worst: {probe.describe(row)}; "
        + (
            f"over their thresholds, in execution order: {', '.join(over[:8])}"
            + (f" and {len(over) - 8} more" if len(over) > 8 else "")
            + "; "
            if failed
            else ""
        )
        + f"{len(layers)} layers (and the model output), each fed torch's input, with every "
        f"layer's output rescaled to RMS {' and '.join(f'{s:g}' for s in PROBE_SCALES)} and zero "
        "biases / unit scales offset at random, eval and train mode; each output against "
        f"{NOISE_K:g} x its noise floor (torch's float32 layer against float64), inputs and "
        "running statistics against the layer's own band (8 x (sqrt(fan-in) + 1) x "
        "u(float32)), never grown by the model's depth"
        + (f"; not probed: {probe.skipped}" if probe.skipped else "")
    )
    return verdict(
        check=PROBE_CHECK,
        kind="layer probe",
        compared=compared,
        value=float(row["error"]),
        tolerance=float(row["threshold"]),
        passed=not failed,
        detail=detail,
        mode="step 0",
        **cell_fields(config),
    )
