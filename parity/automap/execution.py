"""The order in which layers run in one forward pass, on each side, with what each one saw.

torch: forward hooks on the layer modules. Flax linen (and Hugging Face Flax models, which are
linen modules): `flax.linen.intercept_methods`. Flax NNX: the ``__call__`` of every module class
in the model's graph is wrapped for the length of the call (NNX has no interceptor). A layer that
runs twice (reused, tied) keeps its first call: it is one layer. Inputs and outputs are kept as
float64 numpy arrays where they are concrete (inside ``nn.scan``/``jit`` they are not: then only
the order is known).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as fnn
import jax
import numpy as np
import torch
from flax import nnx

from parity.pairs.adapters import FlaxModel, nnx_load, output_logits

__all__ = ["Call", "Trace", "flax_trace", "torch_trace"]


@dataclasses.dataclass
class Call:
    """One layer's first call: its position among the calls, what it received and returned."""

    index: int
    inputs: np.ndarray | None
    output: np.ndarray | None


@dataclasses.dataclass
class Trace:
    """The layers of one forward pass in the order they ran (keyed by torch module name or Flax
    module path), and the model's output."""

    calls: dict[Any, Call]
    output: np.ndarray | None

    def position(self, key: Any) -> int | None:
        call = self.calls.get(key)
        return None if call is None else call.index


def _first_array(value: Any) -> Any:
    """The first tensor/array in a layer's output (torch MHA and LSTM return tuples)."""
    if isinstance(value, torch.Tensor) or hasattr(value, "shape"):
        return value
    if isinstance(value, tuple | list) and value:
        return _first_array(value[-1] if _is_flax_carry(value) else value[0])
    return None


def _is_flax_carry(value: Any) -> bool:
    # Flax recurrent cells return (carry, y): the output is the second element.
    return len(value) == 2 and isinstance(value[0], tuple | list)


def _numpy(value: Any) -> np.ndarray | None:
    value = _first_array(value)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return None
        return value.detach().to("cpu", torch.float64).numpy()
    if isinstance(value, jax.core.Tracer):
        return None
    array = np.asarray(value)
    return array.astype(np.float64) if np.issubdtype(array.dtype, np.floating) else None


def _call_torch(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)


def torch_trace(model: torch.nn.Module, names: Iterable[str], inputs: Any) -> Trace:
    """One eval-mode forward pass of `model`; the first call of each module in `names`, in the
    order the calls started."""
    calls: dict[str, Call] = {}
    finished: set[str] = set()
    handles = []

    def before(name):
        def record(module, args):
            if name not in calls:
                calls[name] = Call(len(calls), _numpy(args[0] if args else None), None)

        return record

    def after(name):
        def record(module, args, output):
            if name not in finished:
                finished.add(name)
                calls[name].output = _numpy(output)

        return record

    for name in dict.fromkeys(names):
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(before(name)))
        handles.append(module.register_forward_hook(after(name)))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            output = _call_torch(model, inputs)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return Trace(calls, _numpy(output_logits(output, "torch")))


def flax_trace(model: FlaxModel, variables: Mapping, inputs: Any) -> Trace:
    """One eval-mode forward pass of the Flax model with `variables`; the first call of each
    module path, in the order the calls started."""
    calls: dict[tuple[str, ...], Call] = {}
    if model.kind == "nnx":
        with _nnx_recorder(calls) as run:
            output = run(model, variables, inputs)
        return Trace(calls, _numpy(output_logits(output, "flax")))

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        path = tuple(str(p) for p in context.module.path)
        first = path not in calls
        if first:
            calls[path] = Call(len(calls), _numpy(args[0] if args else None), None)
        output = next_fun(*args, **kwargs)
        if first:
            calls[path].output = _numpy(output)
        return output

    with fnn.intercept_methods(interceptor):
        output, _ = model.apply(variables, inputs, train=False)
    return Trace(calls, _numpy(output))


@contextlib.contextmanager
def _nnx_recorder(calls: dict[tuple[str, ...], Call]):
    """Wraps ``__call__`` of the model's module classes while the run lasts (restored after)."""
    patched: dict[type, Any] = {}
    paths: dict[int, tuple[str, ...]] = {}

    def wrap(original):
        def __call__(self, *args, **kwargs):
            path = paths.get(id(self))
            first = path is not None and path not in calls
            if first:
                calls[path] = Call(len(calls), _numpy(args[0] if args else None), None)
            output = original(self, *args, **kwargs)
            if first:
                calls[path].output = _numpy(output)
            return output

        return __call__

    def run(model: FlaxModel, variables, inputs):
        module = copy.deepcopy(model.module)  # merge() would share the model's Variables
        nnx_load(module, variables)
        module.eval()
        for path, node in nnx.iter_graph(module):
            if isinstance(node, nnx.Dropout):
                node.deterministic = True
            if isinstance(node, nnx.Module):
                paths[id(node)] = tuple(str(p) for p in path)
                cls = type(node)
                if cls not in patched and "__call__" in vars(cls):
                    patched[cls] = vars(cls)["__call__"]
                    cls.__call__ = wrap(patched[cls])
        return module(inputs, **model.call_kwargs(inputs, False))

    try:
        yield run
    finally:
        for cls, original in patched.items():
            cls.__call__ = original
