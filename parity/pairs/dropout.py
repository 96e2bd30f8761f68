"""Dropout on both sides of a pair: found, turned off, and its rates compared.

The harness trains copies with dropout off, since the two frameworks would draw different masks:

- torch: ``nn.Dropout`` layers, and module attributes that name a dropout probability
  (``dropout``, ``dropout_prob`` as transformers' ``BertSdpaSelfAttention`` passes to SDPA,
  ``attn_pdrop``...), are listed (`torch_dropout_layers`) and set to 0 in the copy the harness
  trains (`disable_torch_dropout`); `torch_stochastic_modules` names any module whose train-mode
  output is still random;
- linen: every active ``nn.Dropout`` and its rate (`linen_dropouts`), for the refusal of a module
  that still asks for a ``'dropout'`` PRNG key: a linen module's rate and ``deterministic`` flag
  are its own code, where torch's rates are set in the harness's copy;
- the two sides' rates, read before they are turned off (`dropout_settings`,
  `flax_dropout_settings`) and compared (`dropout_differences`): turned off, a difference is not
  tested, so step 0 names it in an informational row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "disable_torch_dropout",
    "dropout_differences",
    "dropout_settings",
    "flax_dropout_settings",
    "linen_dropouts",
    "torch_dropout_layers",
    "torch_stochastic_modules",
]


def torch_dropout_layers(model: Any) -> list[tuple[str, float]]:
    """``(name, p)`` of every torch dropout layer with ``p > 0``, and of Hugging Face config
    fields (``*dropout*`` / ``*pdrop*``) above 0.

    Example:
      >>> import torch
      >>> torch_dropout_layers(torch.nn.Sequential(torch.nn.Dropout(0.1)))
      [('0', 0.1)]
    """
    import torch

    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append((name, float(module.p)))
        for attr in _dropout_attributes(module):
            found.append((f"{name}.{attr}" if name else attr, float(getattr(module, attr))))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        for key, value in config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
                found.append((f"config.{key}", value))
    return found


def _dropout_attributes(module: Any) -> list[str]:
    """A module's own float attributes above 0 that name a dropout probability: ``dropout``,
    ``attention_dropout``, ``dropout_prob`` (transformers' ``BertSdpaSelfAttention`` passes it to
    SDPA as ``dropout_p``), ``attn_pdrop``, ``drop_rate``...; not ``nn.Dropout`` layers."""
    return [
        attr
        for attr, value in vars(module).items()
        if ("dropout" in attr.lower() or "pdrop" in attr.lower() or "drop_" in attr.lower())
        and isinstance(value, float)
        and value > 0
    ]


def torch_stochastic_modules(model: Any, call: Callable[[], Any]) -> list[str]:
    """The torch modules whose train-mode output differs between two identical calls.

    `call` runs the model's train-mode forward pass (``lambda: pair.torch_forward(model, x,
    train=True)``); it is called twice, without resetting the random state, so a dropout draws
    a new mask for the second call. A module is named when its inputs were equal in both
    calls and its output was not, and none of its submodules is named (the innermost culprit:
    ``bert.encoder.layer.0.attention.self``, not ``bert.encoder``).

    Example:
      >>> import torch
      >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
      >>> x = torch.ones(2, 4)
      >>> torch_stochastic_modules(net, lambda: net.train()(x))
      ['1']
    """
    import torch

    records: list[dict[str, tuple[Any, Any]]] = [{}, {}]
    current: dict[str, tuple[Any, Any]] = {}

    def hook(name):
        def record(module, args, kwargs, output):
            if name in current:
                return
            tensors_in = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
            out = output
            while isinstance(out, tuple | list) and out:
                out = out[0]
            if torch.is_tensor(out):
                current[name] = (
                    [t.detach().clone() for t in tensors_in],
                    out.detach().clone(),
                )

        return record

    handles = [
        module.register_forward_hook(hook(name), with_kwargs=True)
        for name, module in model.named_modules()
    ]
    try:
        with torch.no_grad():
            for index in range(2):
                current = records[index]
                call()
    finally:
        for handle in handles:
            handle.remove()
    first, second = records
    named = []
    for name, (inputs_1, output_1) in first.items():
        if name not in second:
            continue
        inputs_2, output_2 = second[name]
        same_inputs = len(inputs_1) == len(inputs_2) and all(
            a.shape == b.shape and torch.equal(a, b)
            for a, b in zip(inputs_1, inputs_2, strict=True)
        )
        if same_inputs and not (
            output_1.shape == output_2.shape and torch.equal(output_1, output_2)
        ):
            named.append(name)
    # The root's name is "": a dropout in the model's own forward, blamed only when alone.
    children = [n for n in named if n]
    innermost = [n for n in children if not any(o.startswith(f"{n}.") for o in children)]
    return innermost or (["(the model's own forward)"] if named else [])


def disable_torch_dropout(model: Any) -> list[str]:
    """Sets every torch dropout layer's ``p`` to 0 (and Hugging Face ``*dropout*``/``*pdrop*``
    config floats, read by functional dropout calls) in place; returns what was changed.

    Example:
      >>> import torch
      >>> net = torch.nn.Sequential(torch.nn.Dropout(0.1))
      >>> disable_torch_dropout(net), net[0].p
      (['0'], 0.0)
    """
    import torch

    changed = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            changed.append(name)
        for attr in _dropout_attributes(module):
            setattr(module, attr, 0.0)
            changed.append(f"{name}.{attr}" if name else attr)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        for key, value in config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
                setattr(config, key, 0.0)
                changed.append(f"config.{key}")
    return changed


def _config_dropouts(obj: Any) -> list[tuple[str, float]]:
    """``("config.<field>", rate)`` of every ``*dropout*`` / ``*pdrop*`` float field of a Hugging
    Face configuration (``obj.config``), zeros included; none without one."""
    config = getattr(obj, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return []
    return [
        (f"config.{key}", float(value))
        for key, value in config.to_dict().items()
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float)
    ]


def dropout_settings(model: Any) -> list[tuple[str, float]]:
    """The torch side's dropout settings before the harness turns them off: ``(name, rate)`` of
    every dropout layer and dropout-rate attribute above 0 (`torch_dropout_layers`), and every
    ``*dropout*`` / ``*pdrop*`` field of a Hugging Face config, zeros included.

    Example:
      >>> import torch
      >>> dropout_settings(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
      [('1', 0.1)]
    """
    layers = [(n, r) for n, r in torch_dropout_layers(model) if not n.startswith("config.")]
    return layers + _config_dropouts(model)


def flax_dropout_settings(model: Any, inputs: Any) -> list[tuple[str, float]]:
    """The Flax side's dropout settings (`model`: a `parity.pairs.adapters.FlaxModel`), whether
    or not its calls are deterministic:
    ``(path, rate)`` of every NNX ``Dropout`` node, or of every linen ``nn.Dropout`` the module
    calls on `inputs` (an abstract ``init``: nothing is computed), with a rate above 0; and
    every ``*dropout*`` / ``*pdrop*`` field of a Hugging Face config (zeros included: its
    layers' rates come from there, so they are not traced).

    Example:
      >>> import flax.linen as fnn
      >>> class Net(fnn.Module):
      ...     @fnn.compact
      ...     def __call__(self, x, deterministic: bool = True):
      ...         return fnn.Dropout(0.3)(fnn.Dense(2)(x), deterministic=deterministic)
      >>> from parity.pairs.adapters import as_flax_model
      >>> flax_dropout_settings(as_flax_model(Net()), jnp.ones((1, 3)))
      [('Dropout_0', 0.3)]
    """
    configured = _config_dropouts(model.module)
    if configured:
        return configured
    if model.kind == "nnx":
        from flax import nnx

        return [
            (".".join(str(p) for p in path) or "Dropout", float(node.rate))
            for path, node in nnx.iter_graph(model.module)
            if isinstance(node, nnx.Dropout) and node.rate > 0
        ]
    import flax.linen as fnn

    found: dict[str, float] = {}

    def record(next_fun, args, call_kwargs, context):
        dropout = context.module
        if isinstance(dropout, fnn.Dropout) and context.method_name == "__call__":
            if dropout.rate > 0:
                path = "/".join(str(p) for p in dropout.scope.path) or "Dropout"
                found[path] = float(dropout.rate)
        return next_fun(*args, **call_kwargs)

    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    inputs = jnp.asarray(inputs)
    kwargs = model.call_kwargs(inputs, True)
    try:
        with fnn.intercept_methods(record):
            jax.eval_shape(lambda x: model.module.init(keys, x, **kwargs), inputs)
    except Exception:  # what was recorded before the failure stands
        pass
    return list(found.items())


def _rates(settings: list[tuple[str, float]]) -> dict[float, list[str]]:
    rates: dict[float, list[str]] = {}
    for name, rate in settings:
        if rate > 0:
            rates.setdefault(round(rate, 9), []).append(name)
    return dict(sorted(rates.items()))


def _listed(rates: dict[float, list[str]]) -> str:
    if not rates:
        return "no dropout"
    return ", ".join(
        f"{rate:g} ({', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''})"
        for rate, names in rates.items()
    )


def dropout_differences(
    torch_settings: list[tuple[str, float]], flax_settings: list[tuple[str, float]]
) -> list[str]:
    """Where the two sides' dropout settings (`dropout_settings`, `flax_dropout_settings`)
    differ: field by field where both sides have a Hugging Face config, else the rates their
    layers drop at. Empty when they agree.

    Example:
      >>> dropout_differences([("config.resid_pdrop", 0.1)], [("config.resid_pdrop", 0.3)])
      ['config.resid_pdrop: torch 0.1, Flax 0.3']
      >>> dropout_differences([("drop", 0.1)], [("Dropout_0", 0.3), ("Dropout_1", 0.1)])
      ['dropout rates: torch 0.1 (drop); Flax 0.1 (Dropout_1), 0.3 (Dropout_0)']
    """
    torch_config = {n: r for n, r in torch_settings if n.startswith("config.")}
    flax_config = {n: r for n, r in flax_settings if n.startswith("config.")}
    if torch_config and flax_config:
        return [
            f"{name}: torch {torch_config[name]:g}, Flax {flax_config[name]:g}"
            for name in sorted(torch_config.keys() & flax_config.keys())
            if round(torch_config[name], 9) != round(flax_config[name], 9)
        ]
    torch_rates = _rates([(n, r) for n, r in torch_settings if not n.startswith("config.")])
    flax_rates = _rates([(n, r) for n, r in flax_settings if not n.startswith("config.")])
    if not flax_rates and flax_config:  # a config's rates, no layers traced
        flax_rates = _rates(list(flax_config.items()))
    if set(torch_rates) == set(flax_rates):
        return []
    return [f"dropout rates: torch {_listed(torch_rates)}; Flax {_listed(flax_rates)}"]


def linen_dropouts(module: Any, inputs: Any, kwargs: Mapping[str, Any]) -> list[str]:
    """``"path (rate r)"`` of every linen ``nn.Dropout`` with a rate above 0 that `module`
    calls in a non-deterministic way on `inputs` (an abstract ``init``: nothing is computed).

    Example:
      >>> import flax.linen as fnn
      >>> class Net(fnn.Module):
      ...     @fnn.compact
      ...     def __call__(self, x):
      ...         return fnn.Dropout(0.3, deterministic=False)(fnn.Dense(2)(x))
      >>> linen_dropouts(Net(), jnp.ones((1, 3)), {})
      ['Dropout_0 (rate 0.3)']
    """
    import flax.linen as fnn

    found: list[str] = []

    def record(next_fun, args, call_kwargs, context):
        dropout = context.module
        if isinstance(dropout, fnn.Dropout) and context.method_name == "__call__":
            deterministic = call_kwargs.get("deterministic", dropout.deterministic)
            if len(args) > 1:
                deterministic = args[1]
            if dropout.rate > 0 and not deterministic:
                path = "/".join(str(p) for p in dropout.scope.path) or type(dropout).__name__
                found.append(f"{path} (rate {dropout.rate:g})")
        return next_fun(*args, **call_kwargs)

    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    try:
        with fnn.intercept_methods(record):
            jax.eval_shape(lambda x: module.init(keys, x, **kwargs), inputs)
    except Exception:  # what was recorded before the failure stands
        pass
    return list(dict.fromkeys(found))
