"""The torch side's training loop (what the torch script does around the model)."""

from __future__ import annotations

import math

import torch

from examples.training_loop import CLIP, LR, SMOOTHING, STEPS, WARMUP, WEIGHT_DECAY

__all__ = ["CLIP", "loss", "optimizer", "scheduler"]


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW, weight decay on the matrices only (biases and LayerNorm in a group without)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": WEIGHT_DECAY},
            {"params": vectors, "weight_decay": 0.0},
        ],
        lr=LR,
    )


def warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return step / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def scheduler(optimizer: torch.optim.Optimizer):
    """Stepped after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.float(), targets.long(), label_smoothing=SMOOTHING
    )
