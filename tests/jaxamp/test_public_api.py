"""The public API: `jaxamp.__all__` is pinned; the contract's names are all present."""

import inspect

import pytest

import jaxamp

# The exact public list (sorted). Adding or removing a public name is an API change: update
# this list in the same commit.
EXPECTED_ALL = sorted(
    [
        "AUTOCAST_CATEGORIES",
        "AmpInfo",
        "DtypeRecord",
        "DynamicLossScale",
        "LossScale",
        "LossScaleDivergedError",
        "LossScaledState",
        "LossScaledTransformation",
        "MultiStepsState",
        "NoOpLossScale",
        "Policy",
        "StaticLossScale",
        "all_finite",
        "amp_info",
        "apply_gradients",
        "apply_updates",
        "autocast",
        "autocast_op_list",
        "autocast_rules",
        "autocast_trace",
        "cast_floating",
        "default_loss_scale",
        "full_precision",
        "get_loss_scale",
        "get_policy",
        "loss_scaled",
        "loss_scaled_states",
        "multi_steps",
        "parse_dtype",
        "set_loss_scale",
        "value_and_grad",
    ]
)

# The public contract: names examples and downstream code rely on.
CONTRACT = [
    "Policy",
    "get_policy",
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "all_finite",
    "loss_scaled",
    "get_loss_scale",
    "autocast",
    "amp_info",
]

CONTRACT_MEMBERS = {
    "Policy": ["cast_to_param", "cast_to_compute", "cast_to_output", "with_output_dtype"],
    "DynamicLossScale": [
        "create",
        "from_preset",
        "loss_scale",
        "scale",
        "unscale",
        "adjust",
        "state_dict",
        "from_state_dict",
    ],
    "StaticLossScale": ["loss_scale", "scale", "unscale", "adjust"],
    "NoOpLossScale": ["loss_scale", "scale", "unscale", "adjust"],
}


def test_all_is_pinned():
    assert sorted(jaxamp.__all__) == EXPECTED_ALL
    assert len(set(jaxamp.__all__)) == len(jaxamp.__all__), "duplicate names in __all__"


@pytest.mark.parametrize("name", EXPECTED_ALL)
def test_every_public_name_resolves(name):
    obj = getattr(jaxamp, name)
    assert obj is not None
    if inspect.isclass(obj) or inspect.isfunction(obj):
        assert inspect.getdoc(obj), f"jaxamp.{name} has no docstring"


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_names_are_public(name):
    assert name in jaxamp.__all__
    assert hasattr(jaxamp, name)


@pytest.mark.parametrize("name", sorted(CONTRACT_MEMBERS))
def test_contract_members(name):
    # Instances: `loss_scale` is a dataclass field, present on objects, not on the class.
    instances = {
        "Policy": lambda: jaxamp.get_policy("bf16-mixed"),
        "DynamicLossScale": jaxamp.DynamicLossScale.create,
        "StaticLossScale": lambda: jaxamp.StaticLossScale(2.0),
        "NoOpLossScale": jaxamp.NoOpLossScale,
    }
    obj = instances[name]()
    for member in CONTRACT_MEMBERS[name]:
        assert hasattr(obj, member), f"jaxamp.{name}.{member} is missing"


def test_star_import_matches_all():
    namespace = {}
    exec("from jaxamp import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == EXPECTED_ALL


def test_version():
    assert isinstance(jaxamp.__version__, str) and jaxamp.__version__.count(".") >= 1


def test_namespace_is_the_api():
    # No submodule is listed beside the API, and `jaxamp.autocast` is only the function.
    import types

    assert sorted(dir(jaxamp)) == sorted([*EXPECTED_ALL, "__version__"])
    assert inspect.isfunction(jaxamp.autocast)
    assert not any(isinstance(getattr(jaxamp, n), types.ModuleType) for n in jaxamp.__all__)
    assert list(jaxamp.__all__) == sorted(jaxamp.__all__)
    # The modules that define the names are private: nothing public lives at a module address.
    import pkgutil

    public_modules = {
        info.name
        for info in pkgutil.walk_packages(jaxamp.__path__, "jaxamp.")
        if not any(part.startswith("_") for part in info.name.split("."))
    }
    namespaces = {"jaxamp.flax", "jaxamp.fp8", "jaxamp.optim_precision", "jaxamp.mx"}
    flax_namespaces = {"jaxamp.flax.linen", "jaxamp.flax.nnx", "jaxamp.flax.checkpoint"}
    assert public_modules == namespaces | flax_namespaces


def test_loss_scaled_transformation_is_exported():
    import optax

    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    assert isinstance(tx, jaxamp.LossScaledTransformation)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)


def test_op_lists_are_public():
    ops = jaxamp.autocast_op_list("cpu")
    assert ops.device == "cpu" and ops.category("linear") == "lower_precision_fp"
    assert ops.primitives("matmul") == ("dot_general",)
    assert "flax.linen:Dense.__call__" in ops.functions("linear")
    assert jaxamp.autocast_op_list("cuda").category("softmax.int") == "fp32_set_opt_dtype"
    with pytest.raises(ValueError, match="device"):
        jaxamp.autocast_op_list("tpu")


def test_every_public_name_has_one_home():
    # A function or class is public at exactly one address across the namespaces (no name
    # exported both at the top level and in a subpackage), and the modules that define them are
    # private (an underscore in their path) or the namespace itself.
    import importlib

    namespaces = [
        "jaxamp",
        "jaxamp.flax",
        "jaxamp.flax.linen",
        "jaxamp.flax.nnx",
        "jaxamp.flax.checkpoint",
        "jaxamp.fp8",
        "jaxamp.optim_precision",
        "jaxamp.mx",
    ]
    homes: dict[int, list[str]] = {}
    for namespace in namespaces:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            homes.setdefault(id(obj), []).append(f"{namespace}.{name}")
            defined_in = obj.__module__
            assert defined_in == namespace or any(
                part.startswith("_") for part in defined_in.split(".")
            ), f"{namespace}.{name} is defined in the public module {defined_in}"
    shared = sorted(addresses for addresses in homes.values() if len(addresses) > 1)
    assert not shared, f"public at more than one address: {shared}"
