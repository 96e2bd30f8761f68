"""Step-0 rows beyond the model's own init: the layer probe, stochastic layers, folded tensors.

`parity.verdicts.step0.check_step0` adds these to the float32 stage of every run, whatever its precision:

- ``step 0 fp32: each layer on its operating range`` (`probe_verdict`): every mapped layer on
  probe weights, fed the same input on both sides, against a band of its own and its noise floor
  (`parity.verdicts.layer_probe`): a port bug that the model's own init hides fails here, at any init and
  any depth.
- ``step 0: deterministic train-mode forward (torch)`` (`stochastic_verdict`): two identical
  train-mode calls of the torch model must agree; a module whose output differs (a dropout the
  harness did not turn off, such as transformers' ``BertSdpaSelfAttention``, which passes
  ``dropout_prob`` to SDPA) is named and fails the run.
- ``step 0: tensors folded by the mapping`` (`folded_verdict`, informational): Flax leaves that
  hold the sum of several torch tensors (a GRU/LSTM cell's two biases); the forward pass is the
  same, training is not (the optimizer moves each torch tensor on its own).
- ``step 0: dropout rates differ (turned off on both sides)`` (`dropout_verdict`,
  informational): the harness turns dropout off on both sides (the frameworks draw different
  masks), so rates that differ between the two models (a Flax config's 0.3 against torch's 0.1)
  are not tested; the row names them.
- ``step 0: embedding rows torch never trains (padding_idx)`` (`padding_verdict`,
  informational): a torch ``nn.Embedding(padding_idx=i)`` gives row ``i`` a zero gradient, where
  the Flax ``Embed`` it maps to trains it (BERT's word embeddings, ``pad_token_id`` 0). That row
  is left out of the gradient comparison (`mask_padding_rows`), and the trajectory rows past step
  0 say it (`parity.verdicts.judge`).

`explain_failure` then names the cause of a failed step 0 on the diagnosis: a non-layer check
(stochastic layers, the compute dtype) before any layer, and the probe's first failing layer
when the model's own init showed none.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch

from parity.automap.explain import folded_tensors
from parity.pairs.dropout import dropout_differences, torch_stochastic_modules
from parity.verdicts.layer_probe import probe_layers
from parity.verdicts.layer_table import (
    FOLDED_CHECK,
    STOCHASTIC_CHECK,
    explain_failure,
    mask_padding_rows,
)
from parity.verdicts.probe_judge import PROBE_CHECK, LayerProbe, probe_row
from parity.verdicts.qualifiers import verdict
from parity.verdicts.rows import PADDING_CHECK, Verdict, cell_fields
from parity.verdicts.sides import torch_device
from parity.verdicts.torch_side import torch_setup

__all__ = [
    "DROPOUT_CHECK",
    "PROBE_CHECK",
    "STOCHASTIC_CHECK",
    "dropout_verdict",
    "explain_failure",
    "folded_verdict",
    "mask_padding_rows",
    "padding_rows",
    "padding_verdict",
    "probe_verdict",
    "stochastic_verdict",
]


def probe_verdict(
    pair: Any, config: Any, inputs: Any, flops: int | None = None
) -> tuple[Verdict, LayerProbe | None]:
    """The probe's row (and the probe), or an informational row saying why it did not run
    (`flops`: the forward pass's matmul FLOPs on `inputs`, when known)."""
    try:
        probe = probe_layers(pair, inputs, device=torch_device(config), flops=flops)
    except Exception as e:  # a model the probe cannot drive: the other rows stand without it
        return probe_row(config, None, f"{type(e).__name__}: {str(e)[:300]}"), None
    return probe_row(config, probe), probe


# The examples the stochastic-module check runs (on the host): a random draw shows on a couple of
# examples as on the whole batch, and every module's inputs and outputs are copied twice (at GPT-2
# small's size the whole batch of 8 was two float32 passes of about 1.4 TFLOP each on the host).
STOCHASTIC_EXAMPLES = 2


def _same_output(pair: Any, config: Any, inputs: Any, reference: np.ndarray) -> bool:
    """Whether one more float32 train-mode call of the torch model, set up as step 0's float32
    torch side sets it up (`parity.verdicts.torch_side.torch_setup`: the run's device), gives
    exactly `reference`."""
    model, x = torch_setup(pair, inputs, dataclasses.replace(config, precision="fp32"))
    with torch.no_grad():
        again = pair.torch_forward(model, x, train=True).float().cpu().numpy()
    return again.shape == reference.shape and bool(np.array_equal(again, reference, equal_nan=True))


def stochastic_verdict(
    pair: Any, config: Any, inputs: Any, reference: np.ndarray | None = None
) -> Verdict:
    """Two identical train-mode torch calls must agree; the modules that do not are named.

    `reference`: the float32 train-mode output of a call already made on `inputs` (step 0's
    float32 torch side, `parity.verdicts.sides.Side.train_logits`). When one more call gives
    exactly that output, no module's random draw reached the output and that call is the whole
    check; otherwise two hooked calls on the first ``STOCHASTIC_EXAMPLES`` examples name the
    modules (an output that differs without a random draw, say a kernel chosen by grad mode,
    names none and passes)."""
    if reference is not None and _same_output(pair, config, inputs, reference):
        named = []
    else:
        model = copy.deepcopy(pair.torch_model).float().cpu()
        x = torch.from_numpy(np.ascontiguousarray(np.asarray(inputs)[:STOCHASTIC_EXAMPLES]))
        named = torch_stochastic_modules(model, lambda: pair.torch_forward(model, x, train=True))
    detail = (
        "two train-mode calls on the same batch agree"
        if not named
        else f"train-mode output differs between two identical calls in {', '.join(named)}: a "
        "dropout (or other random draw) the harness did not turn off; the two frameworks would "
        "draw different masks. Set its rate to 0 (for transformers: every *dropout* config "
        "field, e.g. attention_probs_dropout_prob) or pass dropout='disable' to compare_models"
    )
    return verdict(
        check=STOCHASTIC_CHECK,
        kind="stochastic",
        compared="torch train-mode forward, twice",
        value=", ".join(named) if named else "deterministic",
        tolerance="deterministic",
        passed=not named,
        detail=detail,
        mode="step 0",
        **cell_fields(config),
    )


def folded_verdict(pair: Any, config: Any) -> Verdict | None:
    """An informational row naming the Flax leaves that hold a sum of torch tensors."""
    mapping = getattr(pair, "mapping", None)
    if mapping is None or not hasattr(mapping, "entries"):
        return None
    shapes = {k: tuple(v.shape) for k, v in pair.torch_model.state_dict(keep_vars=True).items()}
    folded = folded_tensors(mapping, shapes)
    if not folded:
        return None
    listed = "; ".join(f"{' + '.join(names)} -> {'/'.join(path)}" for path, names in folded.items())
    return verdict(
        check=FOLDED_CHECK,
        kind="folded",
        compared="the weight mapping",
        value=f"{len(folded)} Flax leaves",
        tolerance="-",
        passed=None,
        detail=f"{listed}: the forward pass is the same (step 0 agrees), but Flax has one "
        "trainable tensor where torch has several; an optimizer moves each torch tensor on its "
        "own (AdamW about lr per tensor per step), so the summed bias moves about twice as far as "
        "Flax's and the trajectories part from step 1 without a port bug. Keep torch's "
        "parameterisation on the Flax side (e.g. parity.twins.layers.TorchLSTM) to compare "
        "training",
        mode="informational",
        **cell_fields(config),
    )


DROPOUT_CHECK = "step 0: dropout rates differ (turned off on both sides)"


def dropout_verdict(pair: Any, config: Any) -> Verdict | None:
    """An informational row naming the dropout settings on which the two models differ
    (``pair.dropout``, read before the adapters turned them off); None when they agree or were
    not read (a built-in pair)."""
    settings = getattr(pair, "dropout", None)
    if not settings:
        return None
    differences = dropout_differences(settings.get("torch", []), settings.get("flax", []))
    if not differences:
        return None
    return verdict(
        check=DROPOUT_CHECK,
        kind="dropout",
        compared="the two models' dropout settings",
        value=f"{len(differences)} differing",
        tolerance="-",
        passed=None,
        detail=f"{'; '.join(differences)}: the harness turns dropout off on both sides (the two "
        "frameworks would draw different masks), so this difference is not tested; trained "
        "with dropout on, the port would not train as the torch model does. Set the same rates "
        "on both sides",
        mode="informational",
        **cell_fields(config),
    )


def padding_rows(pair: Any) -> dict[str, tuple[str, int]]:
    """``{Flax gradient key: (torch weight name, padding_idx)}`` for every torch
    ``nn.Embedding`` with a ``padding_idx`` whose weight the mapping copies unchanged to one Flax
    leaf (rows on axis 0).

    Example:
      >>> import flax.linen as fnn, numpy as np
      >>> from parity import api
      >>> batches = [(np.ones((2, 3), np.int32), np.zeros(2, np.int32))]
      >>> class T(torch.nn.Module):
      ...     def __init__(self):
      ...         super().__init__()
      ...         self.emb = torch.nn.Embedding(5, 2, padding_idx=0)
      ...     def forward(self, x):
      ...         return self.emb(x).mean(1)
      >>> class F(fnn.Module):
      ...     @fnn.compact
      ...     def __call__(self, x):
      ...         return fnn.Embed(5, 2, name="emb")(x).mean(1)
      >>> padding_rows(api.prepare_pair(T(), F(), None, api._UserBatches(batches, None)))
      {'emb/embedding': ('emb.weight', 0)}
    """
    mapping = getattr(pair, "mapping", None)
    if mapping is None or not hasattr(mapping, "entries"):
        return {}
    padded = {
        f"{name}.weight": (module.padding_idx, tuple(module.weight.shape))
        for name, module in pair.torch_model.named_modules()
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None
    }
    out = {}
    for entry in mapping.entries:
        if entry.torch_name not in padded:
            continue
        index, shape = padded[entry.torch_name]
        path = tuple(entry.flax_path)
        if path and path[0] == "params":
            path = path[1:]
        if getattr(entry, "transform", "identity") == "identity":  # rows stay on axis 0
            out["/".join(path)] = (entry.torch_name, int(index) % shape[0])
    return out


def padding_verdict(config: Any, rows: dict[str, tuple[str, int]]) -> Verdict | None:
    """The informational row naming the embedding rows torch never trains (None: none)."""
    if not rows:
        return None
    listed = "; ".join(f"{name} row {index} -> {key}" for key, (name, index) in rows.items())
    return verdict(
        check=PADDING_CHECK,
        kind="padding rows",
        compared="the weight mapping",
        value=f"{len(rows)} embedding(s)",
        tolerance="-",
        passed=None,
        detail=f"{listed}: torch's nn.Embedding(padding_idx=...) gives that row a zero gradient "
        "(it never trains: only weight decay moves it), while the Flax Embed it maps to trains it "
        "wherever a batch holds that token. The row is left out of the step-0 gradient "
        "comparison (the forward pass is the same); past step 0 the two models train it "
        "differently, so a trajectory that parts cannot tell that from a port bug (step 0 "
        "decides). To compare training, zero that row's gradient on the Flax side (e.g. "
        "optax.masked / a stop_gradient on the row)",
        mode="informational",
        **cell_fields(config),
    )
