"""Mixed-precision policies: jmp's (param, compute, output) dtypes, plus FSDP2's reduce dtype.

`get_policy` accepts jmp's grammar (``"p=f32,c=bf16,o=f32"``) extended with ``r=`` (the
gradient-reduction dtype), the preset names used by PyTorch Lightning, Keras and Hugging Face
Accelerate, and ``"auto"``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import numpy as np

__all__ = [
    "PRESETS",
    "Policy",
    "auto_policy_name",
    "cast_floating",
    "check_param_dtypes",
    "short_dtype_name",
    "get_policy",
    "parse_dtype",
]

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
_KEYS.update({"o": "output", "output": "output", "r": "reduce", "reduce": "reduce"})


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts the floating-point array leaves of `tree` to `dtype`; other leaves are untouched.

    Integer, boolean and PRNG-key arrays, Python scalars and non-array leaves keep their type.
    `dtype` must be a floating dtype or its name (``cast_floating(tree, "int8")`` raises).

    Examples:
      >>> tree = jaxamp.cast_floating({"w": jnp.ones(2), "step": jnp.int32(3)}, jnp.bfloat16)
      >>> tree["w"].dtype, tree["step"].dtype
      (dtype(bfloat16), dtype('int32'))
    """
    dtype = parse_dtype(dtype, where=f"cast_floating(dtype={dtype!r})")

    def cast(x):
        if isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype) if x.dtype != dtype else x
        return x

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy(jmp.Policy):
    """A mixed-precision policy: the dtypes of parameters, computation, outputs and reductions.

    A subclass of `jmp.Policy`, so it can be passed wherever jmp expects one. Dtypes are
    normalised to `numpy.dtype`; casting touches floating array leaves only.

    ``reduce_dtype`` has FSDP2's meaning (``MixedPrecisionPolicy.reduce_dtype``): the dtype in
    which gradients are reduced across devices (all-reduce / reduce-scatter). ``None`` (the
    default) means the param dtype, which is what torch DDP and FSDP2 do with float32
    parameters: the mixed presets reduce in float32, the ``*-true`` presets in their own dtype.
    Equality and hashing include it; `str` shows it only when it differs from the param dtype,
    so policies without a separate reduce dtype print in jmp's grammar.

    Examples:
      >>> policy = jaxamp.get_policy("bf16-mixed")
      >>> str(policy)
      'p=f32,c=bf16,o=f32'
      >>> policy.reduce_dtype
      dtype('float32')
      >>> compute_params = policy.cast_to_compute({"w": jnp.ones(2)})
      >>> compute_params["w"].dtype
      dtype(bfloat16)
      >>> str(jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.float32, reduce_dtype=jnp.bfloat16))
      'p=f32,c=bf16,o=f32,r=bf16'
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any
    reduce_dtype: Any = None

    def __post_init__(self):
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.param_dtype)
        for field in ("param_dtype", "compute_dtype", "output_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is None or isinstance(value, bool):
                # np.dtype(None) is float64: never what a missing dtype means.
                raise TypeError(
                    f"Policy({field}={value!r}): must be a floating dtype (float16, bfloat16, "
                    "float32, float64) or its name."
                )
            if isinstance(value, str):
                try:
                    dtype = parse_dtype(value, where=f"Policy({field}={value!r})")
                except ValueError as e:
                    raise TypeError(str(e)) from None
                object.__setattr__(self, field, dtype)
                continue
            try:
                dtype = np.dtype(value)
            except TypeError as e:
                raise TypeError(
                    f"Policy({field}={value!r}): must be a floating dtype (float16, bfloat16, "
                    "float32, float64)."
                ) from e
            if dtype not in _DTYPE_NAMES:
                raise ValueError(
                    f"Policy({field}={dtype}): must be one of float16, bfloat16, float32, float64."
                )
            object.__setattr__(self, field, dtype)

    def cast_to_param(self, x):
        """Casts floating leaves of `x` to the param dtype.

        Examples:
          >>> jaxamp.get_policy("bf16-true").cast_to_param(jnp.ones(2)).dtype
          dtype(bfloat16)
        """
        return cast_floating(x, self.param_dtype)

    def cast_to_compute(self, x):
        """Casts floating leaves of `x` to the compute dtype.

        Examples:
          >>> jaxamp.get_policy("fp16-mixed").cast_to_compute(jnp.ones(2)).dtype
          dtype('float16')
        """
        return cast_floating(x, self.compute_dtype)

    def cast_to_output(self, x):
        """Casts floating leaves of `x` to the output dtype.

        Examples:
          >>> jaxamp.get_policy("bf16-mixed").cast_to_output(jnp.ones(2, jnp.bfloat16)).dtype
          dtype('float32')
        """
        return cast_floating(x, self.output_dtype)

    def cast_to_reduce(self, x):
        """Casts floating leaves of `x` to the reduce dtype (before a cross-device reduction).

        Examples:
          >>> jaxamp.get_policy("bf16-mixed").cast_to_reduce(jnp.ones(2, jnp.bfloat16)).dtype
          dtype('float32')
        """
        return cast_floating(x, self.reduce_dtype)

    def with_output_dtype(self, output_dtype) -> Policy:
        """Returns a copy of this policy with another output dtype.

        Examples:
          >>> str(jaxamp.get_policy("bf16-mixed").with_output_dtype(jnp.bfloat16))
          'p=f32,c=bf16,o=bf16'
        """
        return dataclasses.replace(self, output_dtype=output_dtype)

    def with_reduce_dtype(self, reduce_dtype) -> Policy:
        """Returns a copy of this policy with another reduce dtype (None: the param dtype).

        Examples:
          >>> str(jaxamp.get_policy("bf16-mixed").with_reduce_dtype(jnp.bfloat16))
          'p=f32,c=bf16,o=f32,r=bf16'
        """
        return dataclasses.replace(self, reduce_dtype=reduce_dtype)

    @property
    def is_mixed(self) -> bool:
        """True when computation runs in a narrower dtype than the parameters are stored in.

        Examples:
          >>> jaxamp.get_policy("bf16-mixed").is_mixed, jaxamp.get_policy("bf16-true").is_mixed
          (True, False)
        """
        return self.compute_dtype.itemsize < self.param_dtype.itemsize

    @property
    def needs_loss_scaling(self) -> bool:
        """True when float16 takes part in computation (its range needs a loss scale).

        Examples:
          >>> jaxamp.get_policy("fp16-mixed").needs_loss_scaling
          True
        """
        return _F16 in (self.compute_dtype, self.param_dtype)

    def __str__(self) -> str:
        text = "p={},c={},o={}".format(
            *(
                short_dtype_name(d)
                for d in (self.param_dtype, self.compute_dtype, self.output_dtype)
            )
        )
        if self.reduce_dtype != self.param_dtype:
            text += f",r={short_dtype_name(self.reduce_dtype)}"
        return text

    def __repr__(self) -> str:
        return f"Policy({str(self)!r})"


def _policy(param, compute, output, reduce=None) -> Policy:
    return Policy(
        param_dtype=param, compute_dtype=compute, output_dtype=output, reduce_dtype=reduce
    )


# Preset name -> (param, compute, output). Mixed presets keep params and outputs in float32.
# Every preset reduces gradients in its param dtype (DDP/FSDP2 with float32 params reduce in
# float32), so the mixed presets reduce in float32 and the *-true presets in their own dtype.
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

_KEY_NAMES = "p/params, c/compute, o/output, r/reduce"
# Short on purpose: get_policy's docstring holds the full list of names.
_VALID_FORMS = (
    "presets " + ", ".join(PRESETS) + "; 'auto'; a dtype name; or "
    "'p=<dtype>,c=<dtype>,o=<dtype>,r=<dtype>' (all names: help(jaxamp.get_policy))"
)
_DTYPE_CHOICES = ", ".join(names[0] for names in _DTYPE_NAMES.values())


def _did_you_mean(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else "."


def parse_dtype(value: Any, *, where: str = "dtype") -> np.dtype:
    """Parses a floating dtype given by name or as a dtype: the one dtype grammar of jaxamp.

    `get_policy`, `jaxamp.flax.override` and the precision report all read dtypes with it.

    Args:
      value: a name (``"f32"``, ``"float32"``, ``"fp32"``, ``"full"``, ``"float"``, ``"bf16"``,
        ``"bfloat16"``, ``"f16"``, ``"float16"``, ``"fp16"``, ``"half"`` (float16, bfloat16 on
        TPU), ``"f64"``, ``"float64"``, ``"fp64"``, ``"double"``; case and spaces ignored), or a
        numpy/jax floating dtype.
      where: how the caller names the parameter in error messages, e.g. ``"override(compute=...)"``.

    Returns:
      A `numpy.dtype`: float16, bfloat16, float32 or float64.

    Raises:
      ValueError: an unknown name (with the closest valid one) or a non-floating dtype.
      TypeError: `value` is neither a string nor a dtype.

    Examples:
      >>> jaxamp.parse_dtype("BF16"), jaxamp.parse_dtype("full"), jaxamp.parse_dtype(jnp.float16)
      (dtype(bfloat16), dtype('float32'), dtype('float16'))
    """
    if isinstance(value, str):
        token = "".join(value.split()).lower()
        if token == "half":
            return _F16 if jax.devices()[0].platform != "tpu" else _BF16
        if token in _NAME_TO_DTYPE:
            return _NAME_TO_DTYPE[token]
        raise ValueError(
            f"{where}: unknown dtype {value!r}"
            f"{_did_you_mean(token, [*_NAME_TO_DTYPE, 'half'])} Dtypes: {_DTYPE_CHOICES}, "
            "or long names such as 'bfloat16'."
        )
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{where}: expected a floating dtype or its name; got {value!r}.")
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(
            f"{where}: expected a floating dtype or its name ({_DTYPE_CHOICES}); got "
            f"{type(value).__name__} {value!r}."
        ) from None
    if dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"{where}: {dtype} is not a floating dtype; use one of float16, bfloat16, float32, "
            "float64."
        )
    return dtype


def short_dtype_name(dtype: Any) -> str:
    """The short name jaxamp prints for a dtype: f32, bf16, f16 or f64 (the names `str(policy)`
    uses); any other dtype keeps its NumPy name.

    Examples:
      >>> from jaxamp._policy import short_dtype_name
      >>> short_dtype_name(jnp.bfloat16), short_dtype_name("float32"), short_dtype_name("int32")
      ('bf16', 'f32', 'int32')
    """
    dtype = jnp.dtype(dtype)
    names = _DTYPE_NAMES.get(dtype)
    return names[0] if names else dtype.name


def leaf_path_name(path: tuple) -> str:
    """A pytree key path as '/'-joined names (``{"dense": {"kernel": x}}`` -> ``dense/kernel``)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def check_param_dtypes(
    params: Any, expected: Any, policy: Policy, caller: str, fix: str | None = None
) -> None:
    """Raises `TypeError` naming every floating param leaf whose dtype is not allowed.

    torch refuses to unscale float16 gradients (float16 master weights lose small updates and
    overflow); a policy that says float32 params while the params are float16 would silently
    train in float16.

    Args:
      params: the parameter pytree.
      expected: ``path -> set of allowed dtypes`` (the path '/'-joined).
      policy: the policy, named in the message.
      caller: what the user called, named in the message.
      fix: the sentence that tells the user what to do; default: cast with the policy.
    """
    wrong = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            continue
        name = leaf_path_name(path)
        allowed = expected(name)
        if np.dtype(dtype) not in allowed:
            wrong.append(
                f"{name or '<root>'} ({np.dtype(dtype).name}; expected "
                f"{' or '.join(sorted(d.name for d in allowed))})"
            )
    if wrong:
        shown = ", ".join(wrong[:8]) + (f" and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        fix = fix or "Fix: cast them first: policy.cast_to_param(params)."
        raise TypeError(
            f"{caller}: {len(wrong)} parameter leaves are not in the policy's param dtype "
            f"(policy {str(policy)!r}): {shown}. Training them as they are would ignore the "
            f"policy (torch likewise refuses to unscale float16 gradients). {fix}"
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
    try:
        return parse_dtype(token, where=f"get_policy(spec={spec!r})")
    except ValueError as e:
        raise ValueError(f"{e} Valid specs: {_VALID_FORMS}.") from None


_SINGLE_NAMES = (*PRESETS, *_ALIASES, *_NAME_TO_DTYPE, "half", "auto")


def get_policy(spec: Policy | jmp.Policy | str) -> Policy:
    """Returns the policy named by `spec`.

    Args:
      spec: one of

        * a `Policy` (returned as is) or a `jmp.Policy` (converted; reduce dtype = param dtype);
        * a preset: ``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"``, ``"bf16-true"``,
          ``"fp16-true"``;
        * an alias from Lightning/Keras/Accelerate: ``"32-true"``, ``"32"``, ``"no"``,
          ``"float32"`` (fp32); ``"mixed_bfloat16"``, ``"bf16"`` (bf16-mixed); ``"16-mixed"``,
          ``"16"``, ``"mixed_float16"``, ``"fp16"`` (fp16-mixed); ``"16-true"`` (fp16-true);
        * ``"auto"``: bf16-mixed on TPU and GPUs of compute capability >= 8.0, fp16-mixed on
          older GPUs, fp32 on CPU (`jaxamp._policy.auto_policy_name`);
        * a single dtype name, for all four dtypes: ``f32``/``float32``/``fp32``/``full``/
          ``float``, ``bf16``/``bfloat16``, ``f16``/``float16``/``fp16``, ``half`` (float16;
          bfloat16 on TPU), ``f64``/``float64``/``fp64``/``double``;
        * jmp's grammar extended with the reduce dtype: comma-separated ``key=dtype`` parts
          with keys ``p``/``params``, ``c``/``compute``, ``o``/``output``, ``r``/``reduce``,
          in any order, e.g. ``"p=f32,c=bf16,o=f32"`` or ``"p=f32,c=bf16,o=f32,r=bf16"``.
          Unspecified params are float32, compute follows params, output follows compute, and
          reduce follows params.

        Case and spaces are ignored.

    Returns:
      A `Policy`. `str(policy)` is in this grammar and round-trips through `get_policy`.

    Raises:
      TypeError: `spec` is not a string or policy.
      ValueError: `spec` is malformed; the message names the closest valid spelling.

    Examples:
      >>> jaxamp.get_policy("bf16-mixed")
      Policy('p=f32,c=bf16,o=f32')
      >>> jaxamp.get_policy("p=f32,c=bf16,r=bf16")
      Policy('p=f32,c=bf16,o=bf16,r=bf16')
      >>> jaxamp.get_policy("bf16-mixd")
      Traceback (most recent call last):
      ...
      ValueError: get_policy(spec='bf16-mixd'): unknown name 'bf16-mixd'; did you mean 'bf16-mixed'? ...
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
        if name not in _NAME_TO_DTYPE and name != "half":
            raise ValueError(
                f"get_policy(spec={spec!r}): unknown name {name!r}"
                f"{_did_you_mean(name, _SINGLE_NAMES)} Valid specs: {_VALID_FORMS}."
            )
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
                f"get_policy(spec={spec!r}): unknown key {key!r}{_did_you_mean(key, _KEYS)} "
                f"Keys are {_KEY_NAMES}. Valid specs: {_VALID_FORMS}."
            )
        if field in values:
            raise ValueError(
                f"get_policy(spec={spec!r}): {field} dtype given twice. Valid specs: {_VALID_FORMS}."
            )
        values[field] = _parse_dtype(value, spec)
    param = values.get("param", _F32)
    compute = values.get("compute", param)
    output = values.get("output", compute)
    return _policy(param, compute, output, values.get("reduce"))
