"""Put this folder on PYTHONPATH to run Python as if torch were not installed.

A meta-path finder refuses ``torch``, ``torch.*`` and ``torchao`` before any other finder looks:
``import torch`` raises ImportError, as on a CI machine without torch
(tests/test_parity_golden.py runs the golden check and the example project's tests so).
"""

import sys

BLOCKED = ("torch", "torchao", "torchvision")


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {name!r} (blocked: torch is not installed here)", name=name
            )
        return None


sys.meta_path.insert(0, _NoTorch())
