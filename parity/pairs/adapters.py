"""Adapters: any torch / Flax model pair into the harness's ``logits = f(inputs, train)`` form.

The harness calls ``torch_model(inputs)`` and a Flax function ``(variables, inputs, train) ->
(logits, new_batch_stats)``. Real models differ; this module bridges them and turns every raw
failure into a message that names the problem and the fix:

- outputs: a Hugging Face ``ModelOutput`` (``.logits``), a dict (``"logits"``), a tuple (first
  element) or a tensor, on either side (`output_logits`);
- Flax call signatures: ``train`` / ``training`` / ``deterministic`` / ``use_running_average``
  or none of them; extra inputs such as ``attention_mask`` / ``position_ids`` (filled with ones
  and ``arange``) or anything else through ``flax_kwargs``;
- Flax flavours: ``flax.linen`` modules, ``flax.nnx`` modules, Hugging Face Flax models
  (``.module`` + ``.params``) (`FlaxModel`);
- dropout: NNX ``Dropout`` layers are made deterministic, linen modules get
  ``deterministic=True`` when they take it; a Flax module that still asks for a ``'dropout'``
  PRNG key is refused, naming every active linen ``nn.Dropout`` and its rate
  (`parity.pairs.dropout`, which also turns torch's dropout off and reads both sides' rates);
- image layout: NHWC data, NCHW torch models (`check_image_layout`).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parity.pairs.dropout import linen_dropouts
from parity.pairs.variables import as_variables, flatten_variables, nnx_collection

__all__ = [
    "AdapterError",
    "FlaxModel",
    "as_flax_model",
    "check_image_layout",
    "intercept_calls",
    "nnx_load",
    "output_logits",
]


class AdapterError(TypeError):
    """A model that the harness cannot call as it is; the message says what to change."""


# --- outputs ----------------------------------------------------------------------------------


def output_logits(output: Any, side: str = "torch") -> Any:
    """The logits in a model's output: a tensor/array as is, ``.logits`` (Hugging Face
    ``ModelOutput``), ``output["logits"]``, or the first element of a tuple/list.

    Args:
      output: what the model's forward returned.
      side: ``"torch"`` or ``"flax"`` (for the error message).

    Raises:
      AdapterError: no logits in the output (names what was found).

    Example:
      >>> output_logits({"logits": np.zeros(3), "loss": 1.0}).shape
      (3,)
    """
    if hasattr(output, "shape") and hasattr(output, "dtype"):
        return output
    logits = getattr(output, "logits", None)
    if logits is not None:
        return logits
    if isinstance(output, Mapping):
        if "logits" in output:
            return output["logits"]
        found = sorted(map(str, output))
    elif isinstance(output, tuple | list) and output:
        return output_logits(output[0], side)
    else:
        found = type(output).__name__
    raise AdapterError(
        f"the {side} model returned {type(output).__name__} ({found}) with no logits: return a "
        "tensor, a tuple whose first element is the logits, a dict with 'logits', or an object "
        "with a `.logits` attribute (Hugging Face ModelOutput)."
    )


# --- torch side -------------------------------------------------------------------------------


def check_image_layout(
    torch_model: Any, inputs: np.ndarray, torch_channels_first: bool | None
) -> bool:
    """Decides whether 4-D image batches (NHWC, as Flax takes them) go to torch as NCHW.

    Args:
      torch_model: the torch model.
      inputs: one input batch (NHWC for images).
      torch_channels_first: the caller's answer, or None to detect it: the first ``Conv2d``'s
        ``in_channels`` must equal the last axis (NHWC) or the second (data given NCHW).

    Returns:
      Whether ``torch_forward`` must permute NHWC -> NCHW.

    Raises:
      AdapterError: the data are NCHW (Flax needs NHWC), or the layout cannot be decided.

    Example:
      >>> import torch
      >>> check_image_layout(torch.nn.Conv2d(3, 4, 3), np.zeros((2, 8, 8, 3)), None)
      True
    """
    import torch

    array = np.asarray(inputs)
    if array.ndim != 4 or not np.issubdtype(array.dtype, np.floating):
        return bool(torch_channels_first)
    conv = next((m for m in torch_model.modules() if isinstance(m, torch.nn.Conv2d)), None)
    if conv is None:
        return bool(torch_channels_first)
    channels = conv.in_channels
    _, d1, _, d3 = array.shape
    if d3 == channels:
        if torch_channels_first is False:
            raise AdapterError(
                f"the torch model starts with Conv2d(in_channels={channels}) but "
                f"torch_channels_first=False: images are given NHWC {array.shape}, so torch would "
                "read H as channels. Pass torch_channels_first=True (the harness permutes to NCHW "
                "for torch) or leave it None to detect it."
            )
        return True
    if d1 == channels:
        raise AdapterError(
            f"the images are NCHW {array.shape}, but Flax convolutions take NHWC: give the "
            "batches as NHWC (np.transpose(x, (0, 2, 3, 1))) and the harness permutes them to "
            "NCHW for torch."
        )
    raise AdapterError(
        f"cannot match image batches of shape {array.shape} to the torch model's first "
        f"Conv2d(in_channels={channels}): give NHWC images with {channels} channels."
    )


# --- Flax side --------------------------------------------------------------------------------


_INTERCEPT: contextvars.ContextVar = contextvars.ContextVar("parity_intercept", default=None)


@contextlib.contextmanager
def intercept_calls(intercept: Callable[..., Any]):
    """Runs ``intercept(path, next_fun, args, kwargs)`` around every submodule call of a Flax
    model applied inside the context (a linen module, a Hugging Face Flax model, or an NNX module
    through `FlaxModel.apply`); ``path`` is the submodule's path (``("blocks_0", "fc1")``), and
    ``next_fun(*args, **kwargs)`` makes the call. The per-layer diagnosis and the layer probe
    read and replace layer inputs and outputs with it.

    Example:
      >>> import flax.linen as fnn
      >>> seen = []
      >>> def record(path, next_fun, args, kwargs):
      ...     seen.append(path)
      ...     return next_fun(*args, **kwargs)
      >>> with intercept_calls(record):
      ...     _ = fnn.Dense(2).apply({"params": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}},
      ...                            jnp.ones(3))
      >>> seen
      [()]
    """
    import flax.linen as fnn

    def linen(next_fun, args, kwargs, context):
        scope = context.module.scope
        if context.method_name != "__call__" or scope is None:
            return next_fun(*args, **kwargs)
        return intercept(tuple(str(p) for p in scope.path), next_fun, args, kwargs)

    token = _INTERCEPT.set(intercept)
    try:
        with fnn.intercept_methods(linen):
            yield
    finally:
        _INTERCEPT.reset(token)


@contextlib.contextmanager
def _nnx_intercepted(model):
    """NNX has no interceptors: while the call lasts, every submodule's class is swapped for a
    subclass whose ``__call__`` goes through the active `intercept_calls` (restored after)."""
    intercept = _INTERCEPT.get()
    if intercept is None:
        yield
        return
    nnx = _nnx()
    swapped = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        original = type(node)
        key = tuple(str(p) for p in path)

        def __call__(self, *args, _original=original, _key=key, **kwargs):
            def next_fun(*a, **k):
                return _original.__call__(self, *a, **k)

            return intercept(_key, next_fun, args, kwargs)

        node.__class__ = type(original.__name__, (original,), {"__call__": __call__})
        swapped.append((node, original))
    try:
        yield
    finally:
        for node, original in swapped:
            node.__class__ = original


def _nnx():
    from flax import nnx

    return nnx


def nnx_load(model: Any, variables: Any) -> None:
    """Writes ``{"params": ..., "batch_stats": ...}`` into an ``nnx.Module``'s variables in place.

    Example:
      >>> from flax import nnx
      >>> layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
      >>> nnx_load(layer, {"params": {"kernel": np.ones((2, 3)), "bias": np.zeros(3)}})
      >>> float(layer.kernel[...].sum())
      6.0
    """

    nnx = _nnx()
    flat = flatten_variables(as_variables(variables))
    missing = []
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        if not isinstance(variable, nnx.Variable):
            continue
        collection = nnx_collection(type(variable))
        if collection is None:
            continue
        key = (collection, *map(str, path))
        if key not in flat:
            if collection == "params":
                missing.append("/".join(key))
            continue
        variable.set_value(jnp.asarray(flat[key]))
    if missing:
        raise AdapterError(
            f"nnx_load: no values for {missing}; pass variables with every Param of the model."
        )


def _nnx_stats(model) -> dict | None:
    stats = as_variables(model).get("batch_stats")
    return stats or None


_TRAIN_ARGS = {
    "train": lambda train: train,
    "training": lambda train: train,
    "is_training": lambda train: train,
    "use_running_average": lambda train: not train,
}


def _call_parameters(fn) -> dict[str, inspect.Parameter]:
    try:
        parameters = dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}
    parameters.pop("self", None)
    return parameters


def _auto_kwargs(
    parameters: dict[str, inspect.Parameter], inputs, train: bool, what: str, given=()
) -> dict[str, Any]:
    """Keyword arguments for a Flax ``__call__``: train flags, masks, positions."""
    kwargs: dict[str, Any] = {}
    names = list(parameters)
    for name, value in _TRAIN_ARGS.items():
        if name in parameters:
            kwargs[name] = value(train)
    if "deterministic" in parameters:
        kwargs["deterministic"] = True  # dropout off; BatchNorm follows `train`
    shape = tuple(inputs.shape)
    if "attention_mask" in parameters:
        kwargs["attention_mask"] = jnp.ones(shape[:2], jnp.int32)
    for name in ("position_ids", "positions"):
        if name in parameters and len(shape) >= 2:
            kwargs[name] = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape[:2])
    required = [
        name
        for name in names[1:]
        if name not in kwargs
        and name not in given
        and parameters[name].default is inspect.Parameter.empty
        and parameters[name].kind
        in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    if required:
        raise AdapterError(
            f"the Flax {what}'s __call__ needs {required} besides the inputs; pass "
            f"flax_kwargs=lambda inputs: {{{', '.join(repr(r) + ': ...' for r in required)}}} "
            "(called with the input batch, returns the extra keyword arguments)."
        )
    return kwargs


@dataclasses.dataclass
class FlaxModel:
    """The Flax side of a pair as one call: ``apply(variables, inputs, train) -> (logits,
    new_batch_stats)``, whatever the module flavour.

    Build it with `as_flax_model`. ``variables`` are always ``{"params": ..., "batch_stats":
    ...}`` plain dicts (for NNX too), so the trainer, the mapping and the checks see one form.

    Attributes:
      kind: ``"linen"``, ``"nnx"`` or ``"hf"`` (a Hugging Face Flax model).
      module: the linen module (``hf``: its ``.module``) or the ``nnx.Module``.
      variables: the model's own variables when it carries them (NNX, Hugging Face), else None.
      flax_kwargs: ``inputs -> extra keyword arguments`` for the call, or None.
      notes: what the adapter changed (dropout disabled, arguments filled), for the report.
      factory: NNX only: ``(dtype=..., param_dtype=...) -> nnx.Module``, so `clone` can rebuild
        the model in another precision (linen modules clone themselves).
    """

    kind: str
    module: Any
    variables: dict | None = None
    flax_kwargs: Callable[[Any], dict] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    factory: Callable[..., Any] | None = None

    @property
    def dtype(self) -> Any:
        """The computation dtype the model was built with (None: the inputs')."""
        return _first_attr(self.module, "dtype")

    @property
    def param_dtype(self) -> Any:
        """The parameter dtype the model was built with."""
        return _first_attr(self.module, "param_dtype")

    def clone(self, **overrides: Any) -> FlaxModel:
        """The same model with other constructor fields, e.g. ``clone(dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16)`` (linen: ``module.clone``; NNX: rebuilt with `factory`)."""
        if self.kind != "nnx":
            return dataclasses.replace(self, module=self.module.clone(**overrides))
        if self.factory is None:
            raise AdapterError(
                "clone: this NNX model has no factory; pass as_flax_model(model, factory=lambda "
                "dtype, param_dtype: MyModel(..., dtype=dtype, param_dtype=param_dtype, rngs=...))."
            )
        args = {"dtype": self.dtype, "param_dtype": self.param_dtype, **overrides}
        return as_flax_model(
            self.factory(**args), flax_kwargs=self.flax_kwargs, factory=self.factory
        )

    def init(self, rngs: Any, inputs: Any, **kwargs: Any) -> dict:
        """linen: ``module.init(rngs, inputs, **kwargs)``; NNX and Hugging Face: the model's own
        variables (already initialised; `rngs` and `kwargs` are not needed)."""
        if self.variables is not None:
            return self.variables
        return self.module.init(rngs, inputs, **{**self._kwargs(inputs, False), **kwargs})

    def _extra(self, inputs) -> dict:
        if self.flax_kwargs is None:
            return {}
        extra = self.flax_kwargs(inputs)
        if not isinstance(extra, Mapping):
            raise AdapterError(
                f"flax_kwargs must return a dict of keyword arguments, got {type(extra).__name__}."
            )
        return dict(extra)

    def _kwargs(self, inputs, train):
        extra = self._extra(inputs)
        parameters = _call_parameters(self.module.__call__)
        kwargs = _auto_kwargs(parameters, inputs, train, type(self.module).__name__, extra)
        return {**kwargs, **extra}

    def apply(self, variables: Mapping, inputs: Any, train: bool) -> tuple[Any, Any]:
        """``(logits, new_batch_stats)``; the statistics are None unless ``train`` and the
        variables hold ``batch_stats``."""
        if self.kind == "nnx":
            return self._apply_nnx(variables, inputs, train)
        kwargs = self._kwargs(inputs, train)
        try:
            if train and "batch_stats" in variables:
                out, updates = self.module.apply(
                    variables, inputs, mutable=["batch_stats"], **kwargs
                )
                return output_logits(out, "flax"), updates["batch_stats"]
            return output_logits(self.module.apply(variables, inputs, **kwargs), "flax"), None
        except Exception as error:
            raise _explain(error, self, inputs, kwargs) from error

    def _apply_nnx(self, variables, inputs, train):
        nnx = _nnx()
        graphdef, state = self._split
        # Fresh Variables in the current trace (the cached ones belong to the outer context).
        model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, state))
        nnx_load(model, variables)
        if train:
            model.train()
        else:
            model.eval()
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Dropout):
                node.deterministic = True
        with _nnx_intercepted(model):
            out = model(inputs, **self._kwargs_nnx(model, inputs, train))
        stats = _nnx_stats(model) if train and "batch_stats" in variables else None
        return output_logits(out, "flax"), stats

    def call_kwargs(self, inputs: Any, train: bool) -> dict[str, Any]:
        """The keyword arguments `apply` passes to the module's ``__call__`` besides the inputs
        (train flags, masks, positions, ``flax_kwargs``): for callers that run the module
        themselves (the automatic mapping records which layers it calls)."""
        if self.kind == "nnx":
            return self._kwargs_nnx(self.module, inputs, train)
        return self._kwargs(inputs, train)

    def _kwargs_nnx(self, model, inputs, train):
        extra = self._extra(inputs)
        parameters = _call_parameters(type(model).__call__)
        kwargs = _auto_kwargs(parameters, inputs, train, type(model).__name__, extra)
        return {**kwargs, **extra}

    @property
    def _split(self):
        if not hasattr(self, "_graph"):
            self._graph = _nnx().split(self.module)
        return self._graph

    def init_variables(self, inputs: Any) -> dict:
        """The module's own variables (NNX / Hugging Face), or shapes and dtypes from an
        abstract ``init`` (linen): the reference `parity.transfer.validate_variables` checks
        against."""
        if self.variables is not None:
            return self.variables
        kwargs = self._kwargs(inputs, False)
        try:
            shapes = jax.eval_shape(
                lambda x: self.module.init(
                    {"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, **kwargs
                ),
                inputs,
            )
        except Exception as error:
            raise _explain(error, self, inputs, kwargs) from error
        return as_variables(shapes)


def _explain(
    error: Exception,
    model: FlaxModel,
    inputs: Any = None,
    kwargs: Mapping[str, Any] | None = None,
) -> Exception:
    text = str(error)
    if isinstance(error, AdapterError):
        return error
    if "dropout" in text and ("rng" in text.lower() or "PRNG" in text):
        asking = re.search(r"(\S+) needs PRNG for", text)
        where = f" (its submodule {asking.group(1)!r})" if asking else ""
        named = (
            linen_dropouts(model.module, inputs, kwargs or {})
            if model.kind != "nnx" and inputs is not None
            else []
        )
        if named:
            where = f": linen nn.Dropout {', '.join(named)}"
        return AdapterError(
            f"the Flax module {type(model.module).__name__} applies dropout in training{where} "
            "(it asked for a 'dropout' PRNG key): the two frameworks would draw different masks, "
            "so parity cannot be checked. The harness sets torch dropout rates to 0 in its own "
            "copy, but a linen module's rate and `deterministic` flag are its own code: build it "
            "with dropout rate 0, or give its __call__ a `deterministic` argument (the harness "
            "passes deterministic=True)."
        )
    if "unexpected keyword argument" in text:
        return AdapterError(
            f"calling the Flax module {type(model.module).__name__} failed: {text}. Its __call__ "
            "takes other arguments than the harness passed; pass flax_kwargs=... with the ones it "
            "needs, or give it a `train` argument."
        )
    if "ScopeCollectionNotFound" in type(error).__name__ or "batch_stats" in text:
        return AdapterError(
            f"the Flax module needs a collection the variables lack ({text.splitlines()[0]}): a "
            "transfer must return {'params': ..., 'batch_stats': ...} for BatchNorm models "
            "(parity.transfer.auto does)."
        )
    return error


def _first_attr(module: Any, name: str) -> Any:
    if hasattr(module, name):
        return getattr(module, name)
    try:
        nnx = _nnx()
        for _, node in nnx.iter_graph(module):
            if isinstance(node, nnx.Module) and node is not module and hasattr(node, name):
                return getattr(node, name)
    except TypeError:
        pass
    return None


def as_flax_model(
    obj: Any,
    *,
    flax_kwargs: Callable[[Any], dict] | None = None,
    factory: Callable[..., Any] | None = None,
) -> FlaxModel:
    """Wraps a linen module, an ``nnx.Module``, a Hugging Face Flax model, or an existing
    `FlaxModel`.

    Raises:
      AdapterError: anything else (with what is accepted).

    Example:
      >>> import flax.linen as fnn
      >>> as_flax_model(fnn.Dense(3)).kind
      'linen'
    """
    import flax.linen as fnn

    if isinstance(obj, FlaxModel):
        if flax_kwargs is not None:
            obj = dataclasses.replace(obj, flax_kwargs=flax_kwargs)
        return obj
    nnx = _nnx()
    if isinstance(obj, nnx.Module):
        model = copy.deepcopy(obj)
        notes = []
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Dropout) and node.rate > 0:
                notes.append(f"nnx.Dropout at {'/'.join(map(str, path))} made deterministic")
        return FlaxModel("nnx", model, as_variables(model), flax_kwargs, notes, factory)
    if isinstance(obj, fnn.Module):
        return FlaxModel("linen", obj, None, flax_kwargs)
    module = getattr(obj, "module", None)
    if isinstance(module, fnn.Module) and hasattr(obj, "params"):
        notes = ["Hugging Face Flax model: its .module is applied with deterministic=True"]
        return FlaxModel(
            "hf", module, {"params": as_variables(obj.params)["params"]}, flax_kwargs, notes
        )
    raise AdapterError(
        f"the Flax side must be a flax.linen Module, a flax.nnx Module or a Hugging Face Flax "
        f"model (with .module and .params), got {type(obj).__name__}"
        + (" (it has no .apply: wrap it or pass its .module)" if not hasattr(obj, "apply") else "")
        + "."
    )
