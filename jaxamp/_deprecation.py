"""Old addresses of public names: they keep working for one release, with a `DeprecationWarning`
naming the new address.

One table holds them all (`MODULES`: old modules, `NAMES`: old names in a package namespace), so
a test can enumerate every old address. The old modules have no file: `install` puts a finder on
`sys.meta_path` that makes each one (``import jaxamp.policy`` works) as a module forwarding its
attributes through `module_getattr`; the packages forward through `package_getattr`. This module
imports nothing of jaxamp: the private modules load only when an old address is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

# old module -> (the private module that now holds its names, {name: new public address or
# None where the name has no public address any more}).
MODULES: dict[str, tuple[str, dict[str, str | None]]] = {
    "jaxamp.policy": (
        "jaxamp._policy",
        {
            "Policy": "jaxamp.Policy",
            "get_policy": "jaxamp.get_policy",
            "cast_floating": "jaxamp.cast_floating",
            "parse_dtype": "jaxamp.parse_dtype",
            "PRESETS": None,
            "auto_policy_name": None,
            "check_param_dtypes": None,
            "short_dtype_name": None,
        },
    ),
    "jaxamp.loss_scale": (
        "jaxamp._loss_scale",
        {
            "LossScale": "jaxamp.LossScale",
            "NoOpLossScale": "jaxamp.NoOpLossScale",
            "StaticLossScale": "jaxamp.StaticLossScale",
            "DynamicLossScale": "jaxamp.DynamicLossScale",
            "default_loss_scale": "jaxamp.default_loss_scale",
            "PRESET_NAMES": None,
            "as_loss_scale": None,
        },
    ),
    "jaxamp.loss_scaled_state": (
        "jaxamp._loss_scaled_state",
        {
            "AmpInfo": "jaxamp.AmpInfo",
            "LossScaledState": "jaxamp.LossScaledState",
            "amp_info": "jaxamp.amp_info",
            "get_loss_scale": "jaxamp.get_loss_scale",
            "loss_scaled_states": "jaxamp.loss_scaled_states",
            "set_loss_scale": "jaxamp.set_loss_scale",
            "check_outermost": None,
            "find_states_with_keys": None,
            "one_state": None,
            "unwrap_variables": None,
        },
    ),
    "jaxamp.optim": (
        "jaxamp._optim",
        {
            "LossScaleDivergedError": "jaxamp.LossScaleDivergedError",
            "LossScaledTransformation": "jaxamp.LossScaledTransformation",
            "apply_gradients": "jaxamp.apply_gradients",
            "apply_updates": "jaxamp.apply_updates",
            "loss_scaled": "jaxamp.loss_scaled",
        },
    ),
    "jaxamp.grad": (
        "jaxamp._grad",
        {"value_and_grad": "jaxamp.value_and_grad", "scaled_loss": None},
    ),
    "jaxamp.accumulate": (
        "jaxamp._accumulate",
        {"MultiStepsState": "jaxamp.MultiStepsState", "multi_steps": "jaxamp.multi_steps"},
    ),
    "jaxamp.flax.train_state": (
        "jaxamp.flax._train_state",
        {"TrainState": "jaxamp.flax.TrainState"},
    ),
    "jaxamp.flax.nnx_optimizer": (
        "jaxamp.flax._nnx_optimizer",
        {
            "Optimizer": "jaxamp.flax.Optimizer",
            "nnx_value_and_grad": "jaxamp.flax.nnx_value_and_grad",
        },
    ),
    "jaxamp.flax.report": (
        "jaxamp.flax._report",
        {
            "ModuleReport": "jaxamp.flax.ModuleReport",
            "PrecisionReport": "jaxamp.flax.PrecisionReport",
            "precision_report": "jaxamp.flax.precision_report",
        },
    ),
}

# package -> {old name: new public address}: names that moved to another namespace or were
# renamed for what they do.
NAMES: dict[str, dict[str, str]] = {
    "jaxamp": {
        "KahanSummationState": "jaxamp.optim_precision.KahanSummationState",
        "LowPrecisionState": "jaxamp.optim_precision.LowPrecisionState",
        "StochasticRoundingState": "jaxamp.optim_precision.StochasticRoundingState",
        "kahan_summation": "jaxamp.optim_precision.kahan_summation",
        "low_precision_state": "jaxamp.optim_precision.low_precision_state",
        "stochastic_round": "jaxamp.optim_precision.stochastic_round",
        "stochastic_rounding": "jaxamp.optim_precision.stochastic_rounding",
    },
    "jaxamp.flax": {"default_loss_scale": "jaxamp.default_loss_scale"},
    "jaxamp.fp8": {
        "quantize": "jaxamp.fp8.to_fp8_dynamic",
        "quantize_with_scale": "jaxamp.fp8.to_fp8",
        "dequantize": "jaxamp.fp8.from_fp8",
        "recipe": "jaxamp.fp8.get_recipe",
    },
    "jaxamp.mx": {
        "format": "jaxamp.mx.get_format",
        "recipe": "jaxamp.mx.get_recipe",
        "quantize": "jaxamp.mx.to_block_scaled",
        "dequantize": "jaxamp.mx.from_block_scaled",
    },
    "jaxamp.optim_precision": {
        "quantize": "jaxamp.optim_precision.encode_blockwise",
        "dequantize": "jaxamp.optim_precision.decode_blockwise",
    },
}


def _resolve(address: str) -> Any:
    module, _, name = address.rpartition(".")
    return getattr(importlib.import_module(module), name)


def module_getattr(old: str):
    """The ``__getattr__`` of the old module `old`: each of its names, with a warning."""
    private, names = MODULES[old]

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}", name=name)
        new = names[name]
        if new is None:
            message = (
                f"{old}.{name} is deprecated and is no longer public; it will be removed in the "
                f"next release. The module {old} itself is deprecated: its public names are at "
                f"one address each, listed in the API reference."
            )
        else:
            message = (
                f"{old}.{name} is deprecated: use {new} (this address goes in the next release)."
            )
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(private), name)

    return __getattr__


class _OldModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and makes the old modules of `MODULES` (after every other finder: a real file of that
    name would win)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        old = module.__name__
        module.__doc__ = (
            f"Deprecated address: the public names of {old} are at one address each (see the API "
            f"reference); this module forwards them with a DeprecationWarning naming the new "
            f"address, for one release."
        )
        module.__getattr__ = module_getattr(old)


def install() -> None:
    """Makes the old modules importable (once per process)."""
    if not any(isinstance(finder, _OldModules) for finder in sys.meta_path):
        sys.meta_path.append(_OldModules())


def package_getattr(package: str, name: str) -> Any:
    """An old address inside `package` (a moved name or an old module), with a warning; raises
    `AttributeError` for anything else."""
    new = NAMES.get(package, {}).get(name)
    if new is not None:
        warnings.warn(
            f"{package}.{name} is deprecated: use {new} (this address goes in the next release).",
            DeprecationWarning,
            stacklevel=3,
        )
        return _resolve(new)
    old_module = f"{package}.{name}"
    if old_module in MODULES:
        warnings.warn(
            f"the module {old_module} is deprecated: its public names are at one address each "
            f"(e.g. {next(v for v in MODULES[old_module][1].values() if v)}); it goes in the next "
            f"release.",
            DeprecationWarning,
            stacklevel=3,
        )
        return importlib.import_module(old_module)
    raise AttributeError(f"module {package!r} has no attribute {name!r}", name=name)
