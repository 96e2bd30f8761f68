"""Mixed-precision policies: jmp's (param, compute, output) dtype triple, with preset names.

`get_policy` accepts jmp's grammar (``"p=f32,c=bf16,o=f32"``), the preset names used by
PyTorch Lightning, Keras and Hugging Face Accelerate, and ``"auto"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import numpy as np

__all__ = ["Policy", "get_policy", "PRESETS", "auto_policy_name", "cast_floating"]

_F16 = np.dtype(jnp.float16)
_BF16 = np.dtype(jnp.bfloat16)
_F32 = np.dtype(jnp.float32)
_F64 = np.dtype(jnp.float64)

# Short name used in `str(policy)`; every name jmp accepts, plus common spellings.
_DTYPE_NAMES: dict[np.dtype, tuple[str, ...]] = {
    _F32: ("f32", "float32", "full", "fp32", "float"),
    _BF16: ("bf16", "bfloat16"),
    _F16: ("f16", "float16", "fp16"),
    _F64: ("f64", "float64", "fp64", "double"),
}
_NAME_TO_DTYPE = {name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names}
_KEYS = {"p": "param", "params": "param", "param": "param", "c": "compute", "compute": "compute"}
_KEYS.update({"o": "output", "output": "output"})


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts the floating-point array leaves of `tree` to `dtype`; other leaves are untouched.

    Integer, boolean and PRNG-key arrays, Python scalars and non-array leaves keep their type.
    """
    dtype = np.dtype(dtype)

    def cast(x):
        if isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype) if x.dtype != dtype else x
        return x

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy(jmp.Policy):
    """A mixed-precision policy: the dtypes of parameters, of computation and of outputs.

    A subclass of `jmp.Policy`, so it can be passed wherever jmp expects one. Dtypes are
    normalised to `numpy.dtype`; casting touches floating array leaves only.

    Examples:
      >>> policy = jaxamp.get_policy("bf16-mixed")
      >>> str(policy)
      'p=f32,c=bf16,o=f32'
      >>> compute_params = policy.cast_to_compute(params)
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            value = getattr(self, field)
            try:
                dtype = np.dtype(value)
            except TypeError as e:
                raise TypeError(
                    f"Policy {field} must be a floating dtype (float16, bfloat16, float32, "
                    f"float64); got {value!r}."
                ) from e
            if dtype not in _DTYPE_NAMES:
                raise ValueError(
                    f"Policy {field} must be one of float16, bfloat16, float32, float64; got {dtype}."
                )
            object.__setattr__(self, field, dtype)

    def cast_to_param(self, x):
        """Casts floating leaves of `x` to the param dtype."""
        return cast_floating(x, self.param_dtype)

    def cast_to_compute(self, x):
        """Casts floating leaves of `x` to the compute dtype."""
        return cast_floating(x, self.compute_dtype)

    def cast_to_output(self, x):
        """Casts floating leaves of `x` to the output dtype."""
        return cast_floating(x, self.output_dtype)

    def with_output_dtype(self, output_dtype) -> Policy:
        """Returns a copy of this policy with another output dtype."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    @property
    def is_mixed(self) -> bool:
        """True when computation runs in a narrower dtype than the parameters are stored in."""
        return self.compute_dtype.itemsize < self.param_dtype.itemsize

    @property
    def needs_loss_scaling(self) -> bool:
        """True when float16 takes part in computation (its range needs a loss scale)."""
        return _F16 in (self.compute_dtype, self.param_dtype)

    def __str__(self) -> str:
        names = (
            _DTYPE_NAMES[d][0] for d in (self.param_dtype, self.compute_dtype, self.output_dtype)
        )
        return "p={},c={},o={}".format(*names)

    def __repr__(self) -> str:
        return f"Policy({str(self)!r})"


def _policy(param, compute, output) -> Policy:
    return Policy(param_dtype=param, compute_dtype=compute, output_dtype=output)


# Preset name -> (param, compute, output). Mixed presets keep params and outputs in float32.
PRESETS: Mapping[str, tuple[np.dtype, np.dtype, np.dtype]] = {
    "fp32": (_F32, _F32, _F32),
    "bf16-mixed": (_F32, _BF16, _F32),
    "fp16-mixed": (_F32, _F16, _F32),
    "bf16-true": (_BF16, _BF16, _BF16),
    "fp16-true": (_F16, _F16, _F16),
}
# Aliases from PyTorch Lightning, Keras and Accelerate.
_ALIASES = {
    "32-true": "fp32",
    "32": "fp32",
    "no": "fp32",
    "float32": "fp32",
    "mixed_bfloat16": "bf16-mixed",
    "bf16": "bf16-mixed",
    "16-mixed": "fp16-mixed",
    "16": "fp16-mixed",
    "mixed_float16": "fp16-mixed",
    "fp16": "fp16-mixed",
    "16-true": "fp16-true",
}

_VALID_FORMS = (
    "a jaxamp.Policy or jmp.Policy; a preset name ("
    + ", ".join(PRESETS)
    + "); an alias ("
    + ", ".join(_ALIASES)
    + "); 'auto'; a single dtype name for all three ("
    + ", ".join(sorted(n for n in _NAME_TO_DTYPE if n not in _ALIASES and n not in PRESETS))
    + ", 'half'); or jmp's grammar 'p=<dtype>,c=<dtype>,o=<dtype>' (keys p/params, c/compute, "
    "o/output; unspecified compute follows params, output follows compute)"
)


def auto_policy_name(platform: str | None = None, compute_capability: str | None = None) -> str:
    """The preset `"auto"` resolves to: bf16-mixed on TPU and GPUs of compute capability >= 8.0,
    fp16-mixed on older GPUs, fp32 on CPU.

    Args:
      platform: "cpu", "gpu"/"cuda"/"rocm" or "tpu"; default: JAX's default backend.
      compute_capability: e.g. "8.0"; default: read from the first device.
    """
    if platform is None:
        device = jax.devices()[0]
        platform = device.platform
        if compute_capability is None:
            compute_capability = getattr(device, "compute_capability", None)
    platform = platform.lower()
    if platform == "tpu":
        return "bf16-mixed"
    if platform in ("gpu", "cuda"):
        if compute_capability is None:
            return "fp16-mixed"
        major = int(str(compute_capability).split(".")[0])
        return "bf16-mixed" if major >= 8 else "fp16-mixed"
    if platform == "rocm":
        return "bf16-mixed"
    return "fp32"


def _parse_dtype(token: str, spec: str) -> np.dtype:
    if token == "half":
        return _F16 if jax.devices()[0].platform != "tpu" else _BF16
    try:
        return _NAME_TO_DTYPE[token]
    except KeyError:
        raise ValueError(
            f"get_policy(spec={spec!r}): unknown dtype {token!r}; dtypes are "
            f"{', '.join(_NAME_TO_DTYPE)} or 'half'. Valid specs: {_VALID_FORMS}."
        ) from None


def get_policy(spec: Policy | jmp.Policy | str) -> Policy:
    """Returns the policy named by `spec`.

    Args:
      spec: a `Policy` (returned as is), a `jmp.Policy` (converted), a preset name
        (``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"``, ``"bf16-true"``, ``"fp16-true"``), an alias
        from Lightning/Keras/Accelerate (``"16-mixed"``, ``"mixed_bfloat16"``, ``"bf16"``,
        ``"no"``, ...), ``"auto"``, a single dtype name (all three dtypes equal), or jmp's grammar
        ``"p=f32,c=bf16,o=f32"``. Case and spaces are ignored.

    Returns:
      A `Policy`. `str(policy)` is in jmp's grammar and round-trips through `get_policy`.

    Raises:
      TypeError: `spec` is not a string or policy.
      ValueError: `spec` is malformed; the message lists the valid forms.
    """
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, jmp.Policy):
        return _policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
    if not isinstance(spec, str):
        raise TypeError(
            f"get_policy(spec=...) takes a string or a Policy; got {type(spec).__name__} "
            f"{spec!r}. Valid specs: {_VALID_FORMS}."
        )
    name = "".join(spec.split()).lower()
    if name == "auto":
        name = auto_policy_name()
    name = _ALIASES.get(name, name)
    if name in PRESETS:
        return _policy(*PRESETS[name])
    if not name:
        raise ValueError(f"get_policy(spec={spec!r}): empty spec. Valid specs: {_VALID_FORMS}.")
    if "=" not in name:
        dtype = _parse_dtype(name, spec)
        return _policy(dtype, dtype, dtype)

    values: dict[str, np.dtype] = {}
    for part in name.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key or not value or "=" in value:
            raise ValueError(
                f"get_policy(spec={spec!r}): malformed part {part!r}; expected key=dtype. "
                f"Valid specs: {_VALID_FORMS}."
            )
        field = _KEYS.get(key)
        if field is None:
            raise ValueError(
                f"get_policy(spec={spec!r}): unknown key {key!r}; keys are p/params, "
                f"c/compute, o/output. Valid specs: {_VALID_FORMS}."
            )
        if field in values:
            raise ValueError(
                f"get_policy(spec={spec!r}): {field} dtype given twice. Valid specs: {_VALID_FORMS}."
            )
        values[field] = _parse_dtype(value, spec)
    param = values.get("param", _F32)
    compute = values.get("compute", param)
    output = values.get("output", compute)
    return _policy(param, compute, output)
