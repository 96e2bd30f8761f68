"""Configuration of the torch port example (configs as code)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters; every field can be overridden from the command line (see main.py).

    Attributes:
      precision: a jaxamp policy name. The torch side runs the matching torch.amp setup:
        `torch.autocast("cpu", compute dtype)` for mixed policies (plus `GradScaler("cpu")` when
        float16 is involved), the model cast to the param dtype for "-true" policies.
      image_size, channels, hidden, num_classes: the model and synthetic images.
      batch_size, num_steps, learning_rate, momentum: SGD with momentum, same on both sides.
      seed: torch init seed (the Flax model gets the torch weights) and data seed.
      progress: show a progress bar (only on a terminal).
    """

    precision: str = "bf16-mixed"
    image_size: int = 16
    channels: tuple[int, int] = (16, 32)
    hidden: int = 64
    num_classes: int = 10
    batch_size: int = 32
    num_steps: int = 100
    learning_rate: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    progress: bool = True


def get_config(**overrides) -> Config:
    """The default config, with `overrides` applied."""
    return dataclasses.replace(Config(), **overrides)
