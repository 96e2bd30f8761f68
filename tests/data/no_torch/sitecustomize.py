"""Put this folder on PYTHONPATH to run Python as a machine without torch behaves.

Every finder on ``sys.meta_path`` is wrapped so that it does not see ``torch``, ``torchao`` or
``torchvision`` (nor their installed distributions' metadata): ``importlib.util.find_spec``
returns None for them, ``import torch`` raises ``ModuleNotFoundError: No module named
'torch'`` and ``importlib.metadata.version("torch")`` raises ``PackageNotFoundError``, exactly
as where they are not installed. Libraries that probe optional packages (transformers, scipy)
then take their torch-less paths. (A finder that *raises* for them, or ``sys.modules["torch"] =
None``, is not what such a machine does, and breaks those probes.)

The torch-free CI stage (``.ci/run``) runs the same tests in an environment built without torch;
tests/parity/test_parity_golden.py uses this folder where torch is installed.
"""

import sys

HIDDEN = ("torch", "torchao", "torchvision")


def _hidden(name):
    return str(name).partition(".")[0].lower().replace("-", "_") in HIDDEN


class _Hiding:
    """A meta-path finder as it would be with the hidden packages not installed."""

    def __init__(self, finder):
        self._finder = finder
        if hasattr(finder, "find_distributions"):
            self.find_distributions = self._find_distributions

    def find_spec(self, name, path=None, target=None):
        if _hidden(name) or not hasattr(self._finder, "find_spec"):
            return None
        return self._finder.find_spec(name, path, target)

    def _find_distributions(self, *args, **kwargs):
        for distribution in self._finder.find_distributions(*args, **kwargs):
            if not _hidden(distribution.metadata["Name"]):
                yield distribution

    def invalidate_caches(self):
        if hasattr(self._finder, "invalidate_caches"):
            self._finder.invalidate_caches()


sys.meta_path[:] = [_Hiding(finder) for finder in sys.meta_path]
