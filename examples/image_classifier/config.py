"""Configuration of the image classifier example (configs as code)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters; every field can be overridden from the command line (see main.py).

    Attributes:
      precision: a jaxamp policy name ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true", jmp's
        "p=f32,c=bf16,o=f32", ...). The same string is recorded in metrics.json.
      dataset: "synthetic" (default; no files needed), "fashion_mnist" or "cifar10" (then
        `data_dir` is the folder with the original files).
      data_dir: folder of the real dataset.
      image_size: side of the synthetic images (real datasets use their own size).
      num_classes: classes of the synthetic task.
      widths: conv channels per stage (each stage: conv, BatchNorm, relu, 2x2 pool).
      batch_size, num_steps, learning_rate, weight_decay, warmup_steps: training.
      eval_every: steps between evaluations (and at the end).
      seed: data and init seed.
      progress: show a progress bar (only on a terminal).
    """

    precision: str = "bf16-mixed"
    dataset: str = "synthetic"
    data_dir: str | None = None
    image_size: int = 32
    num_classes: int = 10
    widths: tuple[int, ...] = (32, 64)
    batch_size: int = 64
    num_steps: int = 300
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 20
    eval_every: int = 100
    seed: int = 0
    progress: bool = True


def get_config(**overrides) -> Config:
    """The default config, with `overrides` applied."""
    return dataclasses.replace(Config(), **overrides)
