"""One mapping object between a torch module's ``state_dict`` and a Flax variable tree.

A `WeightMapping` is data: a tuple of `MappingEntry` rows, each saying which torch tensor goes to
which Flax leaf through which *layout transform*. Every transform is linear and built from
permutations, reshapes, flips and slices, so the same transform moves weights and gradients
(a permutation's inverse is its transpose); the diagnosis (`parity.verdicts.diagnose`) uses
`WeightMapping.module_pairs` and `WeightMapping.grads_to_flax` to compare layer by layer.

Transforms are strings: one op or several joined by ``|`` (applied left to right, torch -> Flax)::

    identity                 same layout (Embedding, LayerNorm scale, biases)
    linear                   2-D transpose: torch (out, in) -> Flax kernel (in, out)
    conv                     ConvNd weight (O, I/groups, *S) -> Flax kernel (*S, I/groups, O)
    conv_transpose           ConvTransposeNd weight (I, O, *S) -> Flax ``ConvTranspose`` kernel
                             (*S, I, O) with the spatial axes flipped (``transpose_kernel=False``)
    conv_transpose_t         the same for ``transpose_kernel=True``: (*S, O, I), not flipped
    perm(a,b,...)            ``np.transpose`` with these axes
    flip(a,...)              reverse these axes
    reshape(d0,d1,...)       reshape (the inverse reshapes back to the torch shape)
    chunk(axis,k,n)          the k-th of n equal pieces along `axis` (fused qkv, LSTM gates)
    place(axis,k,n)          the inverse: zeros n times as long along `axis`, piece k filled
    chw(C,d1,...)            rows (axis 0) from channels-first flatten order (C, d1, ...) to
                             channels-last order (d1, ..., C): a Linear after ``flatten(1)`` of
                             an NCHW map whose Flax twin flattens NHWC

Several entries may target one Flax leaf: pieces (``place``) are assembled, and overlapping
entries are *summed* (torch LSTM's two biases into one Flax bias). Going back, a summed leaf is
split evenly between its torch tensors (their sum round-trips, not each one); gradients of a
summed leaf are the torch tensors' (equal) gradients, averaged.

Example:
    >>> from parity.models import get_model_pair
    >>> pair = get_model_pair("mlp", seed=0)
    >>> variables = pair.mapping.to_flax(pair.torch_model)
    >>> sorted(variables["params"]["fc1"])
    ['bias', 'kernel']
    >>> pair.mapping.module_pairs()[0]
    ('fc1', ('fc1',))
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from parity.pairs.variables import as_variables, flatten_variables, unflatten_variables

__all__ = [
    "TRANSFORM_OPS",
    "MappingEntry",
    "MappingError",
    "WeightMapping",
    "apply_transform",
    "layer_entries",
    "parse_transform",
    "register_transform",
    "transform_shape",
]


class MappingError(ValueError):
    """A mapping that does not fit its torch module or its Flax tree (names every offending entry)."""


# --- transforms ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Op:
    forward: Callable[[np.ndarray, tuple], np.ndarray]
    # adjoint(array, args, input_shape): the transpose of the linear map (for these 0/1 maps also
    # the inverse on the covered entries).
    adjoint: Callable[[np.ndarray, tuple, tuple], np.ndarray]
    shape: Callable[[tuple, tuple], tuple]
    doc: str


def _perm_shape(shape, perm):
    return tuple(shape[a] for a in perm)


def _conv_perm(ndim: int) -> tuple[int, ...]:
    return (*range(2, ndim), 1, 0)


def _inverse_perm(perm) -> tuple[int, ...]:
    inverse = [0] * len(perm)
    for i, a in enumerate(perm):
        inverse[a] = i
    return tuple(inverse)


def _chunk_slice(shape, axis, k, n):
    size = shape[axis]
    if size % n:
        raise MappingError(f"chunk/place: axis {axis} of size {size} is not divisible by {n}.")
    piece = size // n
    index = [slice(None)] * len(shape)
    index[axis] = slice(k * piece, (k + 1) * piece)
    return tuple(index), piece


def _chunk(x, args):
    axis, k, n = args
    index, _ = _chunk_slice(x.shape, axis, k, n)
    return x[index]


def _place(x, args):
    axis, k, n = args
    shape = list(x.shape)
    shape[axis] *= n
    out = np.zeros(shape, x.dtype)
    index, _ = _chunk_slice(tuple(shape), axis, k, n)
    out[index] = x
    return out


def _chunk_shape(shape, args):
    axis, k, n = args
    _chunk_slice(shape, axis, k, n)
    out = list(shape)
    out[axis] //= n
    return tuple(out)


def _place_shape(shape, args):
    axis, _, n = args
    out = list(shape)
    out[axis] *= n
    return tuple(out)


def _chw_perm(args) -> np.ndarray:
    dims = tuple(args)
    order = (*range(1, len(dims)), 0)
    return np.arange(int(np.prod(dims))).reshape(dims).transpose(order).ravel()


def _chw(x, args):
    perm = _chw_perm(args)
    if x.shape[0] != perm.size:
        raise MappingError(f"chw{tuple(args)}: axis 0 has {x.shape[0]} rows, not {perm.size}.")
    return x[perm]


def _chw_adjoint(x, args, shape):
    perm = _chw_perm(args)
    out = np.empty_like(x)
    out[perm] = x
    return out


def _reshape_shape(shape, args):
    if int(np.prod(shape)) != int(np.prod(args)):
        raise MappingError(f"reshape{tuple(args)}: cannot reshape {tuple(shape)}.")
    return tuple(args)


def _check_ndim(shape, ndim, name):
    if len(shape) != ndim:
        raise MappingError(f"{name}: needs a {ndim}-D tensor, got shape {tuple(shape)}.")


def _linear_shape(shape, args):
    _check_ndim(shape, 2, "linear")
    return shape[::-1]


def _conv_shape(shape, args):
    if len(shape) < 3:
        raise MappingError(f"conv: needs a weight (O, I, *spatial), got shape {tuple(shape)}.")
    return _perm_shape(shape, _conv_perm(len(shape)))


def _conv_transpose(x, args):
    spatial = tuple(range(2, x.ndim))
    return np.flip(x, spatial).transpose(*spatial, 0, 1)


def _conv_transpose_adjoint(x, args, shape):
    ndim = x.ndim
    perm = (*range(2, ndim), 0, 1)
    return np.flip(x.transpose(_inverse_perm(perm)), tuple(range(2, ndim)))


TRANSFORM_OPS: dict[str, _Op] = {}


def register_transform(
    name: str,
    forward: Callable[[np.ndarray, tuple], np.ndarray],
    adjoint: Callable[[np.ndarray, tuple, tuple], np.ndarray],
    shape: Callable[[tuple, tuple], tuple],
    doc: str = "",
) -> None:
    """Registers a linear layout op usable in transform strings.

    Args:
      name: the op's name (letters, digits, ``_``).
      forward: ``(array, args) -> array`` (torch layout -> Flax layout).
      adjoint: ``(array, args, input_shape) -> array``, the transpose of `forward` (for
        permutations and slices also its inverse on the covered entries).
      shape: ``(input_shape, args) -> output_shape``.
      doc: one line for error messages.

    Example:
      >>> register_transform("negate_free_swap", lambda x, a: x.T, lambda x, a, s: x.T,
      ...                    lambda s, a: s[::-1])
      >>> apply_transform("negate_free_swap", np.ones((2, 3))).shape
      (3, 2)
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"register_transform: `name` must be an identifier, got {name!r}.")
    TRANSFORM_OPS[name] = _Op(forward, adjoint, shape, doc)


register_transform("identity", lambda x, a: x, lambda x, a, s: x, lambda s, a: tuple(s), "same")
register_transform(
    "linear", lambda x, a: x.T, lambda x, a, s: x.T, _linear_shape, "(out, in) -> (in, out)"
)
register_transform(
    "conv",
    lambda x, a: x.transpose(_conv_perm(x.ndim)),
    lambda x, a, s: x.transpose(_inverse_perm(_conv_perm(x.ndim))),
    _conv_shape,
    "(O, I, *S) -> (*S, I, O)",
)
register_transform(
    "conv_transpose",
    _conv_transpose,
    _conv_transpose_adjoint,
    lambda s, a: (*s[2:], s[0], s[1]),
    "(I, O, *S) -> flipped (*S, I, O)",
)
register_transform(
    "conv_transpose_t",
    lambda x, a: x.transpose(*range(2, x.ndim), 1, 0),
    lambda x, a, s: x.transpose(_inverse_perm((*range(2, x.ndim), 1, 0))),
    lambda s, a: (*s[2:], s[1], s[0]),
    "(I, O, *S) -> (*S, O, I)",
)
register_transform(
    "perm",
    lambda x, a: x.transpose(a),
    lambda x, a, s: x.transpose(_inverse_perm(a)),
    _perm_shape,
    "np.transpose",
)
register_transform(
    "flip",
    lambda x, a: np.flip(x, a),
    lambda x, a, s: np.flip(x, a),
    lambda s, a: tuple(s),
    "reverse axes",
)
register_transform(
    "reshape",
    lambda x, a: x.reshape(a),
    lambda x, a, s: x.reshape(s),
    _reshape_shape,
    "reshape",
)
register_transform(
    "chunk",
    _chunk,
    lambda x, a, s: _place(x, a),
    _chunk_shape,
    "piece k of n along axis",
)
register_transform(
    "place", _place, lambda x, a, s: _chunk(x, a), _place_shape, "zeros with piece k filled"
)
register_transform("chw", _chw, _chw_adjoint, lambda s, a: tuple(s), "CHW rows -> HWC rows")

_OP_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\(([^()]*)\))?\s*$")


def parse_transform(transform: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``"chunk(0,1,3)|linear"`` -> ``(("chunk", (0, 1, 3)), ("linear", ()))``.

    Raises:
      MappingError: malformed op or unknown op name (with the closest registered one).

    Example:
      >>> parse_transform("linear|reshape(4,2,8)")
      (('linear', ()), ('reshape', (4, 2, 8)))
    """
    if not isinstance(transform, str) or not transform.strip():
        raise MappingError(f"transform must be a non-empty string, got {transform!r}.")
    ops = []
    for part in transform.split("|"):
        match = _OP_RE.match(part)
        if not match:
            raise MappingError(
                f"transform {transform!r}: cannot parse {part!r}; write ops like 'linear' or "
                "'chunk(0,1,3)' joined by '|'."
            )
        name, args = match.group(1), match.group(2)
        if name not in TRANSFORM_OPS:
            close = difflib.get_close_matches(name, TRANSFORM_OPS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise MappingError(
                f"transform {transform!r}: unknown op {name!r}; known ops: "
                f"{', '.join(sorted(TRANSFORM_OPS))}.{hint}"
            )
        try:
            values = tuple(int(v) for v in args.split(",") if v.strip()) if args else ()
        except ValueError:
            raise MappingError(
                f"transform {transform!r}: the arguments of {name!r} must be integers, got {args!r}."
            ) from None
        ops.append((name, values))
    return tuple(ops)


def transform_shape(transform: str, torch_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Flax shape a torch tensor of `torch_shape` gets through `transform`.

    Example:
      >>> transform_shape("conv", (8, 3, 5, 5))
      (5, 5, 3, 8)
    """
    shape = tuple(int(d) for d in torch_shape)
    for name, args in parse_transform(transform):
        shape = tuple(int(d) for d in TRANSFORM_OPS[name].shape(shape, args))
    return shape


def apply_transform(transform: str, array: Any) -> np.ndarray:
    """Applies `transform` (torch layout -> Flax layout) to a numpy-convertible array.

    Example:
      >>> apply_transform("linear", np.zeros((3, 2))).shape
      (2, 3)
    """
    x = np.asarray(array)
    for name, args in parse_transform(transform):
        x = TRANSFORM_OPS[name].forward(x, args)
    return np.ascontiguousarray(x)


def _adjoint_transform(transform: str, array: np.ndarray, torch_shape: tuple[int, ...]):
    ops = parse_transform(transform)
    shapes = [tuple(torch_shape)]
    for name, args in ops:
        shapes.append(tuple(TRANSFORM_OPS[name].shape(shapes[-1], args)))
    x = np.asarray(array)
    for (name, args), shape in zip(reversed(ops), reversed(shapes[:-1]), strict=True):
        x = TRANSFORM_OPS[name].adjoint(x, args, shape)
    return np.ascontiguousarray(x)


# --- the mapping ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MappingEntry:
    """One torch tensor -> one Flax leaf.

    Attributes:
      torch_name: ``state_dict`` key, e.g. ``"blocks.0.attn.c_attn.weight"``.
      flax_path: path including the collection, e.g. ``("params", "h_0", "attn", "kernel")``.
      transform: a transform string (see the module docstring); applies to weights and
        gradients alike.
      torch_module: the owning torch module, e.g. ``"blocks.0.attn.c_attn"``.
      flax_module: the owning Flax module path without the collection.
      decided_by: how the automatic mapping paired the layers (``"name"``, ``"execution
        order"``, ``"function"``, ``"only candidate"``, ``"rule"``); ``""`` for a mapping
        written by hand.
    """

    torch_name: str
    flax_path: tuple[str, ...]
    transform: str
    torch_module: str
    flax_module: tuple[str, ...]
    decided_by: str = ""

    def to_dict(self) -> dict:
        """JSON-able form."""
        out = {
            "torch_name": self.torch_name,
            "flax_path": list(self.flax_path),
            "transform": self.transform,
            "torch_module": self.torch_module,
            "flax_module": list(self.flax_module),
        }
        if self.decided_by:
            out["decided_by"] = self.decided_by
        return out


def _state_dict_of(torch_module_or_state_dict: Any) -> Mapping[str, Any]:
    if isinstance(torch_module_or_state_dict, Mapping):
        return torch_module_or_state_dict
    if hasattr(torch_module_or_state_dict, "state_dict"):
        return torch_module_or_state_dict.state_dict(keep_vars=True)
    raise TypeError(
        "expected a torch.nn.Module or a state_dict (name -> tensor), got "
        f"{type(torch_module_or_state_dict).__name__}."
    )


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        import torch  # torch: optional for JAX users (parity.training.train_jax imports this module)

        value = value.detach()
        if value.dtype in (torch.bfloat16, torch.float16):
            value = value.float()
        return value.cpu().numpy()
    return np.asarray(value)


def _combine(parts: list[tuple[np.ndarray, np.ndarray]], average: bool) -> np.ndarray:
    """Assembles contributions (value, coverage mask): pieces by position, overlaps summed."""
    if len(parts) == 1:
        return parts[0][0]
    out = np.zeros(parts[0][0].shape, np.result_type(*[p[0].dtype for p in parts]))
    count = np.zeros(out.shape, np.int32)
    for value, mask in parts:
        covered = mask != 0
        out = np.where(covered, np.where(count > 0, out + value, value), out)
        count += covered
    if average:
        out = np.where(count > 1, out / np.maximum(count, 1), out)
    return out


def _missing(names, known, what) -> str:
    lines = []
    for name in names:
        close = difflib.get_close_matches(name, list(known), n=1)
        lines.append(f"  {name}" + (f" (closest: {close[0]!r})" if close else ""))
    return f"{what}:\n" + "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class WeightMapping:
    """Torch ``state_dict`` <-> Flax variables, as data (see the module docstring).

    Example:
      >>> from parity.models import get_model_pair
      >>> pair = get_model_pair("cnn_bn", seed=0)
      >>> variables = pair.mapping.to_flax(pair.torch_model)
      >>> sorted(variables)
      ['batch_stats', 'params']
      >>> pair.mapping.to_torch(variables, pair.torch_model)
    """

    entries: tuple[MappingEntry, ...]

    def __post_init__(self):
        entries = tuple(self.entries)
        object.__setattr__(self, "entries", entries)
        for entry in entries:
            if not isinstance(entry, MappingEntry):
                raise TypeError(
                    f"WeightMapping.entries must hold MappingEntry rows, got {type(entry).__name__}."
                )
            parse_transform(entry.transform)
            if len(entry.flax_path) < 2:
                raise MappingError(
                    f"{entry.torch_name}: flax_path {entry.flax_path!r} must start with a "
                    "collection ('params', 'batch_stats', ...) and name a leaf."
                )

    # grouping helpers
    def _by_flax(self) -> dict[tuple[str, ...], list[MappingEntry]]:
        groups: dict[tuple[str, ...], list[MappingEntry]] = {}
        for entry in self.entries:
            groups.setdefault(tuple(entry.flax_path), []).append(entry)
        return groups

    def _by_torch(self) -> dict[str, list[MappingEntry]]:
        groups: dict[str, list[MappingEntry]] = {}
        for entry in self.entries:
            groups.setdefault(entry.torch_name, []).append(entry)
        return groups

    def torch_names(self) -> list[str]:
        """The torch ``state_dict`` keys the mapping reads, in entry order."""
        return list(dict.fromkeys(e.torch_name for e in self.entries))

    def flax_paths(self) -> list[tuple[str, ...]]:
        """The Flax leaf paths (collection first) the mapping writes, in entry order."""
        return list(dict.fromkeys(tuple(e.flax_path) for e in self.entries))

    def element_index(
        self, torch_shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[tuple[str, ...], list[tuple[str, np.ndarray]]]:
        """Where each Flax element comes from: ``{Flax path: [(torch name, index), ...]}``, one
        pair per entry whose torch tensor is in `torch_shapes`, ``index`` Flax-shaped and holding
        each element's flat row-major position in that torch tensor (a Dense kernel's index is
        torch's ``arange`` transposed; a piece of a split tensor holds its slice's positions).

        Args:
          torch_shapes: ``{torch name: shape}`` (e.g. of ``state_dict()``).
        """
        index: dict[tuple[str, ...], list[tuple[str, np.ndarray]]] = {}
        for entry in self.entries:
            shape = torch_shapes.get(entry.torch_name)
            if shape is None:
                continue
            positions = np.arange(int(np.prod(shape))).reshape(shape)
            index.setdefault(tuple(entry.flax_path), []).append(
                (entry.torch_name, apply_transform(entry.transform, positions))
            )
        return index

    def _flax_arrays(self, tensors: Mapping[str, Any], average: bool, dtype) -> dict:
        missing = [name for name in self.torch_names() if name not in tensors]
        if missing:
            raise MappingError(_missing(missing, tensors, "torch tensors missing from the input"))
        flat = {}
        for path, group in self._by_flax().items():
            parts = []
            for entry in group:
                value = _to_numpy(tensors[entry.torch_name])
                if dtype is not None:
                    value = value.astype(dtype)
                out = apply_transform(entry.transform, value)
                mask = (
                    apply_transform(entry.transform, np.ones(value.shape, np.int8))
                    if len(group) > 1
                    else None
                )
                parts.append((out, mask))
            flat[path] = _combine(parts, average)
        return flat

    def to_flax(self, torch_module_or_state_dict: Any, *, dtype: Any = np.float32) -> dict:
        """Flax variables (``{"params": ..., "batch_stats": ...}`` of ``jnp`` arrays) holding the
        torch weights.

        Args:
          torch_module_or_state_dict: a torch module or its ``state_dict``.
          dtype: the leaves' dtype (float32 by default; None keeps the torch dtype, bf16/f16 come
            out as float32 exactly).
        """
        tensors = _state_dict_of(torch_module_or_state_dict)
        flat = self._flax_arrays(tensors, average=False, dtype=dtype)
        return unflatten_variables({path: jnp.asarray(value) for path, value in flat.items()})

    def grads_to_flax(self, named_torch_grads: Any) -> dict:
        """Torch gradients -> a Flax-shaped gradient tree (same transforms as the weights).

        Args:
          named_torch_grads: ``{name: grad tensor}`` (e.g. ``{n: p.grad for n, p in
            model.named_parameters()}``), or a torch module whose ``.grad`` fields are read
            (tied parameters resolve through the module).

        Returns:
          ``{"params": ...}`` of float32 numpy arrays; entries without a gradient (buffers such as
          BatchNorm running statistics) are left out.
        """
        if hasattr(named_torch_grads, "named_parameters"):
            module = named_torch_grads
            grads = {}
            for name in self.torch_names():
                try:
                    parameter = module.get_parameter(name)
                except AttributeError:
                    continue
                if parameter.grad is not None:
                    grads[name] = parameter.grad
        elif isinstance(named_torch_grads, Mapping):
            grads = dict(named_torch_grads)
        else:
            raise TypeError(
                "grads_to_flax takes {name: grad tensor} or a torch module, got "
                f"{type(named_torch_grads).__name__}."
            )
        kept = WeightMapping(tuple(e for e in self.entries if e.torch_name in grads))
        params_missing = [
            e.torch_name
            for e in self.entries
            if e.torch_name not in grads and e.flax_path[0] == "params"
        ]
        if params_missing:
            raise MappingError(
                _missing(sorted(set(params_missing)), grads, "no gradient given for parameters")
            )
        flat = kept._flax_arrays(grads, average=True, dtype=np.float32)
        return unflatten_variables(flat)

    def to_torch(self, variables: Any, torch_module: Any) -> None:
        """Copies Flax `variables` (any float dtype) into `torch_module` in place, under no_grad,
        keeping each torch tensor's dtype and device."""
        import torch  # torch: optional for JAX users (parity.training.train_jax imports this module)

        flat = flatten_variables(as_variables(variables))
        missing = [path for path in self.flax_paths() if path not in flat]
        if missing:
            raise MappingError(
                _missing(
                    ["/".join(p) for p in missing],
                    ["/".join(p) for p in flat],
                    "Flax leaves missing from `variables`",
                )
            )
        state = torch_module.state_dict(keep_vars=True)
        absent = [name for name in self.torch_names() if name not in state]
        if absent:
            raise MappingError(_missing(absent, state, "torch tensors missing from the module"))
        by_flax = self._by_flax()
        for name, group in self._by_torch().items():
            target = state[name]
            shape = tuple(target.shape)
            parts = []
            for entry in group:
                value = np.asarray(flat[tuple(entry.flax_path)], dtype=np.float32)
                expected = transform_shape(entry.transform, shape)
                if tuple(value.shape) != expected:
                    raise MappingError(
                        f"{'/'.join(entry.flax_path)}: shape {tuple(value.shape)} does not fit "
                        f"torch {name} {shape} through {entry.transform!r} (expects {expected})."
                    )
                sharing = by_flax[tuple(entry.flax_path)]
                if len(sharing) > 1:
                    count = sum(
                        apply_transform(e.transform, np.ones(tuple(state[e.torch_name].shape)))
                        for e in sharing
                    )
                    value = np.where(count > 1, value / np.maximum(count, 1), value)
                back = _adjoint_transform(entry.transform, value, shape)
                mask = (
                    _adjoint_transform(entry.transform, np.ones(expected, np.int8), shape)
                    if len(group) > 1
                    else None
                )
                parts.append((back, mask))
            array = np.array(_combine(parts, average=False), dtype=np.float32, copy=True)
            with torch.no_grad():
                target.copy_(torch.from_numpy(array).to(device=target.device, dtype=target.dtype))

    def module_pairs(self) -> list[tuple[str, tuple[str, ...]]]:
        """``(torch module, Flax module path)`` pairs, one per mapped layer, in entry order."""
        return list(dict.fromkeys((e.torch_module, tuple(e.flax_module)) for e in self.entries))

    def check_round_trip(self, torch_module: Any) -> None:
        """torch -> Flax -> torch must give every tensor back bit for bit (summed leaves: the
        Flax values round-trip instead). Raises `MappingError` naming each tensor that does not.

        Example:
          >>> from parity.models import get_model_pair
          >>> pair = get_model_pair("lstm", seed=0)
          >>> pair.mapping.check_round_trip(pair.torch_model)
        """
        import torch  # torch: optional for JAX users (parity.training.train_jax imports this module)

        variables = self.to_flax(torch_module, dtype=None)
        clone = copy.deepcopy(torch_module)
        with torch.no_grad():
            for name in self.torch_names():
                tensor = clone.state_dict(keep_vars=True)[name]
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
        self.to_torch(variables, clone)
        summed_torch = {
            e.torch_name
            for path, group in self._by_flax().items()
            if len(group) > 1 and _overlapping(group, torch_module)
            for e in group
        }
        original = torch_module.state_dict()
        restored = clone.state_dict()
        bad = [
            name
            for name in self.torch_names()
            if name not in summed_torch and not _bit_equal(original[name], restored[name])
        ]
        again = flatten_variables(self.to_flax(clone, dtype=None))
        first = flatten_variables(variables)
        bad += [
            "/".join(path)
            for path in first
            if not np.array_equal(
                np.asarray(first[path]).view(np.uint8), np.asarray(again[path]).view(np.uint8)
            )
        ]
        if bad:
            raise MappingError(
                "round trip torch -> Flax -> torch is not bit-exact for: " + ", ".join(bad)
            )

    def to_dict(self) -> dict:
        """JSON-able form: ``{"entries": [...]}`` (see `from_dict`)."""
        return {"entries": [entry.to_dict() for entry in self.entries]}

    @classmethod
    def from_dict(cls, data: Mapping) -> WeightMapping:
        """Inverse of `to_dict`.

        Example:
          >>> m = WeightMapping((MappingEntry("w", ("params", "d", "kernel"), "linear", "", ("d",)),))
          >>> WeightMapping.from_dict(m.to_dict()) == m
          True
        """
        if not isinstance(data, Mapping) or "entries" not in data:
            raise MappingError(f"WeightMapping.from_dict needs {{'entries': [...]}}, got {data!r}.")
        entries = []
        for index, row in enumerate(data["entries"]):
            try:
                entries.append(
                    MappingEntry(
                        torch_name=str(row["torch_name"]),
                        flax_path=tuple(str(p) for p in row["flax_path"]),
                        transform=str(row["transform"]),
                        torch_module=str(row.get("torch_module", "")),
                        flax_module=tuple(str(p) for p in row.get("flax_module", ())),
                        decided_by=str(row.get("decided_by", "")),
                    )
                )
            except (KeyError, TypeError) as e:
                raise MappingError(
                    f"WeightMapping.from_dict: entry {index} is malformed: {e}"
                ) from e
        return cls(tuple(entries))

    def __len__(self) -> int:
        return len(self.entries)


def _overlapping(group: list[MappingEntry], torch_module: Any) -> bool:
    state = torch_module.state_dict()
    count = sum(
        apply_transform(e.transform, np.ones(tuple(state[e.torch_name].shape), np.int32))
        for e in group
    )
    return bool(np.any(count > 1))


def _bit_equal(a, b) -> bool:
    import torch  # torch: optional for JAX users (parity.training.train_jax imports this module)

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    return bool(torch.equal(a.cpu(), b.cpu()))


def layer_entries(
    torch_module: str,
    flax_module: tuple[str, ...] | str,
    leaves: list[tuple[str, tuple[str, ...] | str, str]],
    *,
    collection: str = "params",
) -> list[MappingEntry]:
    """Entries for one layer: ``(torch leaf, Flax leaf, transform)`` rows under two module paths.

    Args:
      torch_module: dotted torch module name (``""`` for the root).
      flax_module: Flax module path (tuple, or ``"a/b"``).
      leaves: rows ``(torch tensor name relative to the module, Flax leaf name or
        (collection, leaf...) tuple, transform)``; a plain leaf name goes into `collection`.
      collection: default collection.

    Example:
      >>> [e.flax_path for e in layer_entries("fc", "fc", [("weight", "kernel", "linear")])]
      [('params', 'fc', 'kernel')]
    """
    if isinstance(flax_module, str):
        flax_module = tuple(p for p in flax_module.split("/") if p)
    out = []
    for torch_leaf, flax_leaf, transform in leaves:
        if isinstance(flax_leaf, str):
            path = (collection, *flax_module, flax_leaf)
        else:
            path = (flax_leaf[0], *flax_module, *flax_leaf[1:])
        name = f"{torch_module}.{torch_leaf}" if torch_module else torch_leaf
        out.append(MappingEntry(name, path, transform, torch_module, tuple(flax_module)))
    return out
