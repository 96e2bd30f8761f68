"""Precision recipes (parity.core.recipes) and the one step per framework
(parity.training.steps): names as jaxamp reads them, the README's step, every recipe through
every arm run as itself or refused (its single-device runs are mlp's and mlp_nnx's cells of every
model x precision), and a new precision added with one class and one line."""

import ast
import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_parity_train import check_records  # noqa: E402

import jaxamp  # noqa: E402
from parity.cli import commands as cli  # noqa: E402
from parity.core import recipes  # noqa: E402
from parity.core.config import PRECISIONS, RunConfig  # noqa: E402
from parity.core.hardware import UnsupportedHere  # noqa: E402
from parity.core.recipes import RECIPES, get_recipe, precision_names  # noqa: E402
from parity.core.records import load_results  # noqa: E402
from parity.distributed import worker  # noqa: E402
from parity.distributed.procs import free_port  # noqa: E402
from parity.models import get_model_pair  # noqa: E402
from parity.training import steps
from parity.training.train_jax import train_jax  # noqa: E402
from parity.training.train_torch import train_torch  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.standard_promotion]  # optax/flax internals

README = Path(__file__).resolve().parents[2] / "README.md"
TINY = {"image_shape": (4, 4, 3), "hidden": 8}
TINY_ARGS = ["--model-override", "image_shape=[4,4,3]", "--model-override", "hidden=8"]


# --- names ----------------------------------------------------------------------------------------


def test_precision_names_come_from_the_registry():
    assert PRECISIONS == precision_names() == tuple(RECIPES)
    assert {"fp32", "bf16-mixed", "fp16-mixed", "bf16-true"} <= set(PRECISIONS)
    matrix = cli.build_parser().parse_args(["matrix"])
    assert tuple(matrix.precisions) == precision_names()
    for name, cls in RECIPES.items():
        assert cls.name == name and get_recipe(name).name == name


@pytest.mark.parametrize(
    "name",
    [
        "fp32",
        "32-true",
        "32",
        "no",
        "float32",
        "auto",
        "bf16-mixed",
        "bf16",
        "mixed_bfloat16",
        "p=f32,c=bf16,o=f32",
        "fp16-mixed",
        "16-mixed",
        "16",
        "mixed_float16",
        "fp16",
        "bf16-true",
        "bfloat16",
    ],
)
def test_names_mean_what_jaxamp_get_policy_says(name):
    recipe = get_recipe(name)
    assert recipe.policy == jaxamp.get_policy(name)
    assert RunConfig(precision=name).precision == recipe.name
    args = cli.build_parser().parse_args(
        ["run", "--model", "mlp", "--precision", name, "--out", "x"]
    )
    assert args.precision == recipe.name


def test_unknown_and_unrunnable_names_are_refused_clearly():
    with pytest.raises(ValueError, match="Did you mean 'bf16-mixed'"):
        get_recipe("bf16-mixd")
    with pytest.raises(ValueError, match="Did you mean 'fp8-rowwise'"):
        RunConfig(precision="fp8-rowwse")
    # A policy jaxamp knows that no recipe runs: named, never run as another precision.
    for name in ("fp16-true", "16-true", "p=f32,c=bf16,o=f32,r=bf16"):
        with pytest.raises(ValueError, match="no parity recipe runs"):
            get_recipe(name)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--model", "mlp", "--precision", "fp8", "--out", "x"])


def test_cli_defaults_are_runconfigs():
    args = cli.build_parser().parse_args(["run", "--model", "mlp", "--out", "x"])
    config = cli._config_from_args(args, "mlp", args.precision)
    assert config == RunConfig(model="mlp", **cli.CLI_DEFAULTS)
    matrix = cli.build_parser().parse_args(["matrix"])
    cell = cli._config_from_args(matrix, "mlp", "fp16-mixed", cli.matrix_plan("fp16-mixed"))
    assert cell == cli.matrix_config("mlp", "fp16-mixed")
    assert cell.init_scale == 2.0**20 and cell.lr_warmup_steps == 10


# --- the README's step ----------------------------------------------------------------------------


def _readme_train_step_source() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "def train_step(params, opt_state, x, y)" in b]
    return block


def _body(tree: ast.AST, name: str) -> list[ast.stmt]:
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    return fn.body


def test_the_harness_jax_step_is_the_readme_step():
    source = _readme_train_step_source()
    readme = _body(ast.parse(source), "train_step")
    import inspect
    import textwrap

    harness = _body(
        ast.parse(textwrap.dedent(inspect.getsource(steps.jax_train_step))), "train_step"
    )
    assert len(readme) == len(harness) == 3
    # Same update and same return, statement for statement.
    assert ast.dump(readme[1]) == ast.dump(harness[1])
    assert ast.dump(readme[2]) == ast.dump(harness[2])
    # The gradient call: README's jaxamp.value_and_grad(loss_fn, policy=...) is the harness's
    # grad_fn, called with the params, the batch and loss_scale=opt_state.
    call_r, call_h = readme[0].value, harness[0].value
    assert ast.unparse(call_r.func).startswith("jaxamp.value_and_grad(")
    assert ast.dump(readme[0].targets[0]) == ast.dump(harness[0].targets[0])
    assert [ast.dump(k) for k in call_r.keywords] == [ast.dump(k) for k in call_h.keywords]

    # And the two compute the same numbers, bit for bit, through an overflow and a growth.
    def loss_fn(params, x, y):
        return jnp.mean(jnp.square(x @ params["w"] - y))

    params = {"w": jnp.full((3, 2), 0.5, jnp.float32)}
    namespace = {"jax": jax, "params": params, "loss_fn": loss_fn}
    exec(compile(source, "README.md", "exec"), namespace)
    tx = namespace["tx"]
    readme_step = namespace["train_step"]
    harness_step = jax.jit(
        steps.jax_train_step(jaxamp.value_and_grad(loss_fn, policy="fp16-mixed"), tx)
    )
    state_r = state_h = (params, tx.init(params))
    rng = np.random.default_rng(0)
    for i in range(4):
        x = rng.normal(size=(4, 3)).astype(np.float32) * (1e6 if i == 2 else 1.0)  # overflow
        y = rng.normal(size=(4, 2)).astype(np.float32)
        out_r = readme_step(*state_r, x, y)
        out_h = harness_step(*state_h, x, y)
        for a, b in zip(jax.tree.leaves(out_r), jax.tree.leaves(out_h), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        state_r, state_h = out_r[:2], out_h[:2]
    assert int(jaxamp.amp_info(state_h[1]).skipped_steps) >= 1  # the overflow was skipped


def test_train_jax_runs_the_step_through_apply_gradients(monkeypatch):
    calls = []
    original = jaxamp.apply_gradients

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(jaxamp, "apply_gradients", counting)
    config = RunConfig(model="mlp", steps=2, batch_size=4, eval=False, model_overrides=TINY)
    run = train_jax(config, get_model_pair("mlp", seed=0, **TINY))
    assert len(calls) == 1 and len(run["steps"]) == 2  # traced once, in the compiled step


# --- every recipe through every arm ---------------------------------------------------------------


def _config(precision):
    return RunConfig(
        model="mlp", precision=precision, steps=1, batch_size=4, eval=False, model_overrides=TINY
    )


# Big enough for one quantized state leaf (48 x 128 = 6144 >= torchao's 4096-element minimum).
QUANTIZED = {"image_shape": (4, 4, 3), "hidden": 128}
# The recipes whose NNX twin of mlp (the same program) is run beside mlp's, as every model is.
NNX_PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")


def _single_config(precision, model="mlp"):
    """A single-device cell: 3 steps and the held-out metric, as every model x precision runs
    (`check_records`); a recipe of the optimizer's state only on an mlp whose state it quantizes,
    one step past its first distinct one."""
    recipe = get_recipe(precision)
    return RunConfig(
        model=model,
        precision=precision,
        steps=max(3, recipe.first_distinct_step + 1),
        batch_size=4,
        timing_warmup=1,
        eval=True,
        model_overrides=QUANTIZED if recipe.first_distinct_step else TINY,
    )


def _spec(precision, **fields):
    return {"config": _config(precision).to_dict(), "pair_factory": None, "inject": None, **fields}


def _torch_rank(precision, strategy, monkeypatch):
    # One rank in this process (world 1): the worker's own code, no subprocess.
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):
        monkeypatch.setattr(dist, name, getattr(dist, name))  # the FSDP2 recorder is undone
    threads = torch.get_num_threads()
    try:
        spec = _spec(precision, side="torch", rank=0, world=1, strategy=strategy, port=free_port())
        return worker.torch_worker(spec)
    finally:
        torch.set_num_threads(threads)


def _jax_mesh(precision, strategy, mode):
    spec = _spec(precision, side="jax", rank=0, world=2, strategy=strategy, mode=mode)
    return worker._jax_train(spec)


def _train_both(config):
    pair = get_model_pair(config.model, seed=0, **config.model_overrides)
    return train_torch(config, pair), train_jax(config, pair)


@pytest.fixture(scope="module")
def fp32_runs():
    """float32's single-device runs, torch and JAX (fp32's cell of the every-recipe test): their
    step-0 losses have the same weights and first batch as every single-device and distributed
    cell of a recipe of the model's precision."""
    with jax.numpy_dtype_promotion("standard"):  # module scope: outside the per-test marker
        return _train_both(_single_config("fp32"))


@pytest.fixture(scope="module")
def fp32_losses(fp32_runs):
    torch_run, jax_run = fp32_runs
    return {"torch": torch_run["steps"][0]["loss"], "jax": jax_run["steps"][0]["loss"]}


@pytest.fixture(scope="module")
def fp32_optimizer_runs():
    """float32's single-device runs on the mlp whose state the optimizer's recipes quantize."""
    config = dataclasses.replace(_single_config("adamw-8bit"), precision="fp32")
    with jax.numpy_dtype_promotion("standard"):
        return _train_both(config)


def _runs_as_itself(recipe, loss, reference):
    """A low-precision recipe's step-0 loss is not the float32 one (the false PASS trained fp32)."""
    assert math.isfinite(loss)
    if recipe.baseline:
        assert loss == pytest.approx(reference, rel=1e-6)
    else:
        assert loss != reference


def _optimizer_recipe_runs_as_itself(recipe, runs, fp32_runs):
    """A recipe of the optimizer's state only: until `first_distinct_step` each side's losses are
    float32's to rounding (the first update comes from exact moments); from it they are not."""
    distinct = recipe.first_distinct_step
    for run, fp32 in zip(runs, fp32_runs, strict=True):
        assert fp32["config"]["steps"] == run["config"]["steps"] == distinct + 1
        assert run["mixed_precision_method"] == (
            recipe.torch_method() if run["framework"] == "torch" else recipe.jax_method("cpu")
        )
        losses = [step["loss"] for step in run["steps"]]
        exact = [step["loss"] for step in fp32["steps"]]
        # torchao's update is arranged differently from torch.optim.AdamW's: float32 rounding
        assert losses[:distinct] == pytest.approx(exact[:distinct], rel=1e-6)
        assert math.isfinite(losses[distinct])
        assert abs(losses[distinct] - exact[distinct]) > 1e-5 * abs(exact[distinct])


def _same_training(nnx_run, run):
    """The NNX twin of mlp trains as the linen one, bit for bit: same losses, norms, metric."""
    assert nnx_run["framework"] == run["framework"] and nnx_run["model"] == "mlp_nnx"
    signals = ("loss", "loss_scale", "skipped", "grad_norm", "update_norm")
    assert [[s.get(k) for k in signals] for s in nnx_run["steps"]] == [
        [s.get(k) for k in signals] for s in run["steps"]
    ]
    assert nnx_run["summary"]["eval_metric"] == run["summary"]["eval_metric"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch.distributed / autocast on CPU
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_recipe_runs_as_itself_or_is_refused_on_every_arm(
    precision, fp32_losses, monkeypatch, request
):
    if precision.startswith("mx"):
        pytest.skip(
            "block-scaled formats need linear layers with features in multiples of 32, which "
            "the tiny mlp lacks: tests/parity/test_mx_parity.py runs them on a single device"
        )
    recipe = get_recipe(precision)
    # single device: mlp's cell of every model x precision (and mlp_nnx's, the same program)
    config = _single_config(precision)
    if precision == "fp32":  # the reference runs are this cell's
        torch_run, jax_run = request.getfixturevalue("fp32_runs")
    else:
        torch_run, jax_run = _train_both(config)
    check_records(config, torch_run, jax_run)
    if recipe.first_distinct_step:
        fp32 = request.getfixturevalue("fp32_optimizer_runs")
        _optimizer_recipe_runs_as_itself(recipe, (torch_run, jax_run), fp32)
    else:
        assert torch_run["mixed_precision_method"] == recipe.torch_method()
        assert jax_run["mixed_precision_method"] == recipe.jax_method("cpu")
        _runs_as_itself(recipe, torch_run["steps"][0]["loss"], fp32_losses["torch"])
        _runs_as_itself(recipe, jax_run["steps"][0]["loss"], fp32_losses["jax"])
    if precision in NNX_PRECISIONS:
        nnx_config = _single_config(precision, "mlp_nnx")
        nnx_runs = _train_both(nnx_config)
        check_records(nnx_config, *nnx_runs)
        _same_training(nnx_runs[0], torch_run)
        _same_training(nnx_runs[1], jax_run)
    # torch DDP / FSDP2 ranks, and their JAX twins on a mesh of 2 devices (jit and shard_map)
    for strategy in ("ddp", "fsdp"):
        reason = recipe.unsupported(strategy)
        if reason is not None:
            with pytest.raises(UnsupportedHere, match=re.escape(reason[:40])):
                _torch_rank(precision, strategy, monkeypatch)
        else:
            result = _torch_rank(precision, strategy, monkeypatch)
            assert recipe.torch_method(strategy) in result["method"]
            _runs_as_itself(recipe, result["steps"][0]["loss"], fp32_losses["torch"])
        for mode in ("jit", "shard_map"):
            reason = recipe.unsupported(strategy, mode)
            if reason is not None:
                with pytest.raises(UnsupportedHere, match=re.escape(reason[:40])):
                    _jax_mesh(precision, strategy, mode)
                continue
            result = _jax_mesh(precision, strategy, mode)
            assert result["method"].endswith(recipe.jax_method("cpu", strategy))
            _runs_as_itself(recipe, result["steps"][0]["loss"], fp32_losses["jax"])


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp8_on_two_devices_trains_fp8_on_both_sides(tmp_path):
    """A false PASS once seen: fp8 on --devices 2 trained float32 on both sides."""
    out = tmp_path / "d"
    args = ["run", "--model", "mlp", "--precision", "fp8-tensorwise", "--devices", "2"]
    args += ["--steps", "3", "--batch-size", "8", "--out", str(out), "--timeout", "300"]
    # DDP against shard_map (each device scales its own shard)
    assert cli.main([*args, "--no-plots"]) == 0
    result = json.loads((out / "distributed.json").read_text())
    refused = [v for v in result["verdicts"] if v["value"] == "unsupported here"]
    assert {v["compared"] for v in refused} == {"jax:jit", "jax:multiprocess"}
    runs = {r["distributed"]: r for r in result["runs"]}
    assert set(runs) == {"torch ddp", "jax:shard_map ddp"}
    assert "torchao" in runs["torch ddp"]["mixed_precision_method"]
    assert "jaxamp.fp8" in runs["jax:shard_map ddp"]["mixed_precision_method"]
    pair = get_model_pair("mlp", seed=0)
    fp32 = train_torch(RunConfig(model="mlp", steps=3, batch_size=8, eval=False), pair)
    for run in runs.values():
        losses = [s["loss"] for s in run["steps"]]
        assert not np.allclose(losses, [s["loss"] for s in fp32["steps"]], rtol=1e-6, atol=0)
    # fsdp: refused with the reason, exit 2
    assert cli.main([*args, "--strategy", "fsdp"]) == 2


# --- adding a precision ---------------------------------------------------------------------------


class Fp32Again(recipes.Fp32):
    """A trivial new precision: float32 under another name."""

    name = "fp32-again"
    baseline = False
    claims_policy = False


@pytest.fixture
def registered():
    recipes.register(Fp32Again)
    try:
        yield Fp32Again
    finally:
        del RECIPES[Fp32Again.name]


@pytest.mark.integration
@pytest.mark.slow
def test_adding_a_precision_is_one_class_and_one_line(registered, tmp_path):
    assert registered.name in precision_names()
    out = tmp_path / "again"
    args = ["run", "--model", "mlp", "--precision", "fp32-again", "--steps", "2"]
    args += ["--batch-size", "4", "--no-eval", "--no-progress", "--out", str(out), *TINY_ARGS]
    assert cli.main(args) == 0
    runs = load_results(out)["runs"]
    assert {(r["framework"], r["precision"]) for r in runs} == {
        ("torch", "fp32-again"),
        ("jax", "fp32-again"),
    }
    assert all(r["config"]["policy"] == "p=f32,c=f32,o=f32" for r in runs)
    with pytest.raises(ValueError, match="already registered"):
        recipes.register(type("Other", (recipes.Fp32,), {"name": "fp32-again"}))
