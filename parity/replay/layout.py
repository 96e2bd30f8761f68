"""Per-parameter quantities of the torch side (gradients, updates, Adam's moments) in the Flax
layout, and which torch parameter each Flax leaf comes from.

With the pair's `WeightMapping` the transforms are the mapping's (``grads_to_flax``: linear, so
they carry updates and moments like weights); without one, the pair's weight transfer is applied
to a copy of the model holding the quantity in place of its weights.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from parity.verdicts.sides import flatten, pair_mapping

__all__ = ["Layout"]


class Layout:
    """Torch names <-> Flax leaf paths (``"a/b/kernel"``, without the ``params`` collection) of
    one pair.

    Example:
      >>> from parity.models import get_model_pair
      >>> layout = Layout(get_model_pair("mlp", seed=0))
      >>> layout.torch_name("fc1/kernel")
      'fc1.weight'
    """

    def __init__(self, pair: Any):
        self.pair = pair
        self.model = copy.deepcopy(pair.torch_model).float().cpu()
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.mapping = pair_mapping(pair)
        self._owner: dict[str, list[str]] = {}
        if self.mapping is not None:
            for entry in self.mapping.entries:
                if entry.flax_path[0] == "params" and entry.torch_name in self.names:
                    owners = self._owner.setdefault("/".join(entry.flax_path[1:]), [])
                    if entry.torch_name not in owners:
                        owners.append(entry.torch_name)
        else:  # each parameter filled with its index + 1: the leaves say where they came from
            params = dict(self.model.named_parameters())
            tagged = {n: torch.full_like(params[n], float(i + 1)) for i, n in enumerate(self.names)}
            for path, value in self.to_flax(tagged).items():
                found = sorted({int(v) for v in np.unique(value) if v >= 1})
                self._owner[path] = [self.names[i - 1] for i in found if i - 1 < len(self.names)]

    def torch_name(self, path: str) -> str:
        """The torch parameter(s) behind a Flax leaf, comma-joined (``"?"`` when none)."""
        return ", ".join(self._owner.get(path, [])) or "?"

    def torch_names(self, path: str) -> list[str]:
        return list(self._owner.get(path, []))

    @property
    def owners(self) -> dict[str, list[str]]:
        """``{Flax path: [torch names]}`` (what a golden file records of the layout)."""
        return {path: list(names) for path, names in self._owner.items()}

    def per_path(self, per_name: dict[str, Any]) -> dict[str, Any]:
        """``{torch name: value}`` -> ``{Flax path: the value of its (first) torch parameter}``."""
        return {path: per_name[names[0]] for path, names in self._owner.items() if names}

    def to_flax(self, named: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """``{torch name: tensor}`` (every trained parameter) -> ``{Flax path: float32 array}``."""
        named = {n: named[n].detach().float().cpu() for n in self.names}
        if self.mapping is not None:
            tree = self.mapping.grads_to_flax(named)
            return flatten(tree.get("params", tree))
        holder = self.model
        with torch.no_grad():
            saved = {n: p.detach().clone() for n, p in holder.named_parameters()}
            try:
                for n, p in holder.named_parameters():
                    if n in named:
                        p.copy_(named[n])
                return flatten(self.pair.to_flax(holder)["params"])
            finally:
                for n, p in holder.named_parameters():
                    p.copy_(saved[n])
