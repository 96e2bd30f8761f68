"""parity: train the same model in PyTorch (torch.amp) and JAX (jaxamp) and compare.

Command line: ``python -m parity run|compare|matrix`` (see `parity.cli`). Library:
`compare_models` (your own torch module, Flax module and weight transfer).
"""

from parity.api import ParityResult as ParityResult
from parity.api import compare_models as compare_models
from parity.config import PRECISIONS as PRECISIONS
from parity.config import RunConfig as RunConfig

__all__ = [
    "PRECISIONS",
    "ParityResult",
    "RunConfig",
    "compare_models",
]
