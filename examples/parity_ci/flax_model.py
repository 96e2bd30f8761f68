"""The Flax port under test (imports no torch: the CI job checks it against a golden file)."""

from __future__ import annotations

import flax.linen as nn

from examples.parity_ci.data import CLASSES


class FlaxNet(nn.Module):
    """The port of `examples.parity_ci.torch_model.TorchNet`: Dense -> LayerNorm -> exact GELU
    -> Dense. torch's ``nn.GELU()`` is the erf form and ``nn.LayerNorm``'s epsilon is 1e-5."""

    hidden: int = 32
    approximate_gelu: bool = False  # the planted port bug sets it: flax's nn.gelu default

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(self.hidden, name="fc1")(x)
        x = nn.LayerNorm(epsilon=1e-5, name="norm")(x)
        x = nn.gelu(x, approximate=self.approximate_gelu)
        return nn.Dense(CLASSES, name="fc2")(x)


def buggy_port() -> FlaxNet:
    """The port with a classic porting bug: flax's ``nn.gelu`` defaults to the tanh
    approximation, torch's ``nn.GELU()`` to the exact erf form."""
    return FlaxNet(approximate_gelu=True)
