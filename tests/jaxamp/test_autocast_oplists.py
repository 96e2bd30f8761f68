"""The op lists are torch's: parsed from the installed header and read from torch's registrations."""

import pathlib
import re

import pytest

from jaxamp._autocast import oplists as _oplists

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def _header_lists():
    header = pathlib.Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    text = header.read_text()
    out = {}
    for macro, cat in [
        ("AT_FORALL_LOWER_PRECISION_FP", "lower_precision_fp"),
        ("AT_FORALL_FP32", "fp32"),
        ("AT_FORALL_FP32_SET_OPT_DTYPE", "fp32_set_opt_dtype"),
        ("AT_FORALL_PROMOTE", "promote"),
    ]:
        body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S).group(1)
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body):
            out[f"{name}.{overload}" if overload else name] = cat
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.S)
    for name in re.findall(r'"(norm\.\w+)"', body.group(1)):
        out[name] = "fp32_append_dtype"
    return out


CONSTRAINTS = pathlib.Path(__file__).resolve().parents[2] / "constraints.txt"
INSTALLED = torch.__version__.split("+")[0]
# The list-equality tests compare with the installed torch's own lists, which move between torch
# versions (torch 2.13 puts rms_norm on its CUDA fp32 list; 2.11 still registers the Dimname
# overloads such as softmax.Dimname and cumsum.dimname): they hold for the torch the lists were
# recorded from, which is the project's pinned torch (test_versions_recorded).
same_torch = pytest.mark.skipif(
    INSTALLED != _oplists.TORCH_VERSION,
    reason=f"the op lists were recorded from torch {_oplists.TORCH_VERSION} (the pin in "
    f"constraints.txt); this is torch {INSTALLED}, whose lists differ",
)


def test_versions_recorded():
    pinned = re.search(r"^torch==(\S+)$", CONSTRAINTS.read_text(), re.M).group(1)
    for device, oplist in _oplists.OP_LISTS.items():
        assert oplist.device == device
        assert oplist.torch_version == pinned == _oplists.TORCH_VERSION


@same_torch
def test_cuda_list_equals_header():
    header = _header_lists()
    ours = {
        k: v for k, v in _oplists.CUDA.ops.items() if not k.startswith("cudnn_") and v != "banned"
    }
    assert ours == header


def _registrations(key):
    return {
        n.removeprefix("aten::") for n in torch._C._dispatch_get_registrations_for_dispatch_key(key)
    }


@same_torch
def test_cuda_list_equals_registrations():
    regs = _registrations("AutocastCUDA")
    # The header's `convolution`/`linalg_vecdot` style names; `_scaled_dot_product_flash_attention`
    # etc. all registered. cudnn_convolution* and the banned op come from the .cpp.
    assert set(_oplists.CUDA.ops) == regs


@same_torch
def test_cpu_list_equals_registrations():
    assert set(_oplists.CPU.ops) == _registrations("AutocastCPU")


def _test_lists(class_name):
    """Op names in torch.testing._internal.autocast_test_lists (read with ast: importing it needs
    expecttest, which is not installed)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torch.testing._internal.autocast_test_lists")
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            target = node.targets[0]
            if isinstance(target, ast.Attribute):
                out[target.attr] = [
                    elt.elts[0].value
                    for elt in node.value.elts
                    if isinstance(elt, ast.Tuple) and isinstance(elt.elts[0], ast.Constant)
                ]
    return out


def test_cpu_list_agrees_with_torch_test_lists():
    lists = _test_lists("AutocastCPUTestLists")
    for name in lists["torch_16"] + lists["nn_16"]:
        assert _oplists.CPU.category(name) == "lower_precision_fp", name
    for name in lists["torch_fp32"] + lists["nn_fp32"]:
        assert _oplists.CPU.category(name) == "fp32", name
    for name in lists["torch_need_autocast_promote"]:
        assert _oplists.CPU.category(name) == "promote", name


def test_cuda_list_agrees_with_torch_test_lists():
    lists = _test_lists("AutocastTestLists")
    assert lists["torch_fp16"] and lists["torch_fp32"]
    for name in lists["torch_fp16"] + lists["nn_fp16"] + lists["linalg_fp16"]:
        assert _oplists.CUDA.category(name) == "lower_precision_fp", name
    for name in lists["methods_fp16"]:
        assert _oplists.CUDA.category(name.strip("_")) == "lower_precision_fp", name
    fp32 = ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype")
    for name in lists["torch_fp32"] + lists["nn_fp32"]:
        assert _oplists.CUDA.category(name) in fp32, name
    for name in lists["torch_need_autocast_promote"]:
        assert _oplists.CUDA.category(name) == "promote", name


# Ops with a JAX primitive counterpart, run under torch.autocast("cpu") to confirm the category.
_CPU_RUNNABLE = {
    "mm": lambda x: torch.mm(x, x),
    "bmm": lambda x: torch.bmm(x[None], x[None]),
    "matmul": lambda x: x @ x,
    "prod": lambda x: torch.prod(x),
    "sum": lambda x: torch.sum(x),
    "cumsum": lambda x: torch.cumsum(x, 0),
    "exp": torch.exp,
    "log": lambda x: torch.log(x.abs()),
    "rsqrt": lambda x: torch.rsqrt(x.abs()),
    "pow": lambda x: x**2,
    "cat": lambda x: torch.cat([x, x]),
}


@pytest.mark.parametrize("op", sorted(_CPU_RUNNABLE))
def test_cpu_categories_by_running_torch(op):
    x32 = torch.rand(4, 4) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        from_f32 = _CPU_RUNNABLE[op](x32).dtype
        from_bf16 = _CPU_RUNNABLE[op](x32.bfloat16()).dtype
    cat = _oplists.CPU.category(op)
    if cat == "lower_precision_fp":
        assert from_f32 == torch.bfloat16
    elif cat == "fp32":
        assert from_bf16 == torch.float32
    else:
        assert (from_f32, from_bf16) == (torch.float32, torch.bfloat16)


def test_every_torch_op_with_jax_counterpart_classified_the_same():
    """Each primitive's category equals that of every torch op mapped to it (or a divergence)."""
    import jaxamp

    for device, oplist in _oplists.OP_LISTS.items():
        rules = jaxamp.autocast_rules(device)
        for torch_op, prims in _oplists.PRIMITIVE_COUNTERPARTS.items():
            cat = oplist.category(torch_op)
            for prim in prims:
                if torch_op in _oplists.DIVERGENCES:
                    continue
                if cat is None:
                    # Composite in torch (einsum on cpu) or on no list: the primitive is either
                    # "keep" or reached through a listed op.
                    assert rules[prim] == "keep" or any(
                        oplist.category(o) == rules[prim]
                        for o, ps in _oplists.PRIMITIVE_COUNTERPARTS.items()
                        if prim in ps
                    ), (device, torch_op)
                else:
                    assert rules[prim] == cat, (device, torch_op, prim)
