"""The PyTorch original (only `export_golden.py` and the torch-reference test import it)."""

from __future__ import annotations

import torch

from examples.parity_ci.data import CLASSES, FEATURES


class TorchNet(torch.nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(hidden, CLASSES)

    def forward(self, x):
        return self.fc2(self.act(self.norm(self.fc1(x))))


def reference(seed: int = 0) -> TorchNet:
    """The original at its initial weights (torch's own initialisation from `seed`)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TorchNet()
