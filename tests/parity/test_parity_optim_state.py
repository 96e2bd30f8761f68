"""Optimizer-state bytes in the harness, measured from the state objects on both sides: torchao's
quantized tensor subclasses taken apart into their codes, scales and maps; jaxamp's
``low_precision_state`` through ``state_bytes``. The two agree to what each side keeps elsewhere."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.optim")

import jaxamp  # noqa: E402
import parity  # noqa: E402
import parity.api  # noqa: E402
from parity import cell  # noqa: E402
from parity.core.config import RunConfig  # noqa: E402
from parity.core.recipes import _LowBitAdamW, get_recipe  # noqa: E402
from parity.perf import measure  # noqa: E402
from parity.verdicts import optim_step0  # noqa: E402
from parity.verdicts.optim_step0 import optimizer_state_verdicts  # noqa: E402
from parity.verdicts.step0 import check_step0  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.standard_promotion]  # optax.adamw's bias correction

# torchao's per-tensor map (float32 entries), which jaxamp keeps as a constant of the program.
QMAP_ENTRIES = {"adamw-8bit": 256, "adamw-4bit": 16, "adamw-fp8": 0}


@pytest.fixture(autouse=True)
def _eager_torch_compile():
    with torch.compiler.set_stance("force_eager"):  # torchao's step without compiling it
        yield


@pytest.mark.filterwarnings("ignore::UserWarning")  # torchao's caching hint
@pytest.mark.parametrize("precision", sorted(QMAP_ENTRIES))
def test_state_bytes_per_parameter_agree_to_what_each_side_keeps_elsewhere(precision):
    recipe = get_recipe(precision)
    # 256 inputs, hidden 32: fc1's weight (8192 elements) is the one quantized tensor.
    overrides = {"image_shape": (16, 16, 1), "hidden": 32}
    config = RunConfig(model="mlp", precision=precision, model_overrides=overrides)
    pair = cell.builtin_pair(config)
    model = pair.torch_model
    optimizer = recipe.torch_optimizer(config, list(model.parameters()))
    model(torch.randn(4, 16, 16, 1)).sum().backward()
    optimizer.step()
    theirs = measure.torch_optimizer_state(optimizer, model.parameters())

    params = jax.tree_util.tree_map(jnp.zeros_like, pair.torch_to_flax()["params"])
    tx = recipe.jax_optimizer(
        optax.adamw(config.lr, weight_decay=config.weight_decay), config, pair=pair
    )
    ours = measure.jax_optimizer_state(jax.jit(tx.init)(params), params)  # one program

    small = 32 + 32 * 32 + 32 + 32 * 10 + 10  # fc1's bias, fc2, fc3
    assert theirs["param_count"] == ours["param_count"] == 256 * 32 + small
    quantized = 2  # the 8192-element weight's two moments (the rest is under 4096 elements)
    tensors = len(jax.tree_util.tree_leaves(params))
    # torch: a float32 step per parameter tensor and a map per quantized moment;
    # jaxamp: one int32 count.
    extra = 4 * tensors + 4 * QMAP_ENTRIES[precision] * quantized - 4
    assert theirs["optimizer_state_bytes"] - ours["optimizer_state_bytes"] == extra
    # 8192 codes of 1 byte (8-bit, fp8) or half a byte (4-bit), float32 scales per block
    codes = {"adamw-8bit": 8192 + 4 * 32, "adamw-4bit": 4096 + 4 * 64, "adamw-fp8": 8192 + 4 * 32}
    plain = 4 * small  # float32 moments of the small tensors
    assert ours["optimizer_state_bytes"] == 2 * (codes[precision] + plain) + 4


def test_plain_adamw_state_is_eight_bytes_per_parameter_on_both_sides():
    model = torch.nn.Linear(256, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    theirs = measure.torch_optimizer_state(optimizer, model.parameters())
    params = {"w": jnp.zeros((256, 64)), "b": jnp.zeros(64)}
    ours = measure.jax_optimizer_state(jaxamp.loss_scaled(optax.adamw(1e-3)).init(params), params)
    # two float32 moments per parameter; torch adds a float32 step per tensor, optax one count
    assert theirs["optimizer_state_bytes"] == 8 * theirs["param_count"] + 4 * 2
    assert ours["optimizer_state_bytes"] == 8 * ours["param_count"] + 4
    assert np.isclose(theirs["optimizer_state_bytes_per_param"], 8.0, atol=1e-3)


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_report_shows_each_sides_state_bytes_per_parameter(tmp_path):
    overrides = {"image_shape": (4, 4, 3), "hidden": 128}  # 6144 elements: one quantized leaf
    config = RunConfig(
        model="mlp",
        precision="adamw-8bit",
        steps=2,
        batch_size=4,
        eval=False,
        model_overrides=overrides,
    )
    runs = cell.run_cell(config, step0_checks=False, echo=False)
    per_param = {r["framework"]: r["summary"]["optimizer_state_bytes_per_param"] for r in runs}
    assert set(per_param) == {"torch", "jax"}
    assert 2.0 < per_param["jax"] < per_param["torch"] < 8.0  # codes, not float32 moments
    # the report's tables only (its plots are drawn and checked by the CLI run test)
    _, _, report_path = cell.write_outputs(tmp_path, runs, echo=False, plots=False)
    report = report_path.read_text()
    section = report.split("## Optimizer state", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| mlp | adamw-8bit")]
    assert len(rows) == 2 and f"{per_param['torch']:.3f}" in section


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_jax_state_blocks_each_parameter_in_its_torch_tensors_order(model):
    """torchao blocks each torch tensor row-major; the JAX state of the low-bit recipes takes
    each Flax leaf in that order (a Dense kernel transposed, a conv kernel HWIO -> OIHW, cnn's
    ``fc`` rows also CHW -> HWC), so that its blocks hold the same elements."""
    overrides = {"image_shape": (8, 8, 3)}
    pair = cell.builtin_pair(RunConfig(model=model, model_overrides=overrides))
    orders = get_recipe("adamw-8bit").torch_block_order(pair)
    flax = pair.torch_to_flax()["params"]
    torch_params = dict(pair.torch_model.named_parameters())
    ordered = 0
    for entry in pair.mapping.entries:
        if entry.flax_path[0] != "params":
            continue
        leaf = np.asarray(flax[entry.flax_path[1]][entry.flax_path[2]]).reshape(-1)
        order = orders.get(entry.flax_path[1], {}).get(entry.flax_path[2])
        ordered += order is not None
        in_order = leaf if order is None else leaf[order]
        expected = torch_params[entry.torch_name].detach().numpy().reshape(-1)
        np.testing.assert_array_equal(in_order, expected, err_msg=entry.torch_name)
    assert ordered == 3  # every weight; the biases keep their order


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_user_pair_runs_the_low_bit_recipes_with_its_own_mappings_block_order():
    """compare_models on user models: the JAX state takes torchao's block order from the user
    pair's (automatic) weight mapping, the pair the trainer is handed, no built-in pair."""
    overrides = {"image_shape": (4, 4, 3), "hidden": 128}  # fc1: 6144 elements, quantized
    builtin = cell.builtin_pair(RunConfig(model="mlp", model_overrides=overrides))
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(4, 4, 4, 3)).astype(np.float32), rng.integers(0, 10, 4)) for _ in range(2)
    ]
    result = parity.compare_models(
        builtin.torch_model,
        builtin.flax_model,
        None,
        batches,
        precision="adamw-8bit",
        name="mine",
        step0=False,
    )
    assert result.passed, result.status
    assert {r["framework"] for r in result.runs} == {"torch", "jax"}
    for run in result.runs:
        assert run["precision"] == "adamw-8bit" and len(run["steps"]) == 2
    assert "blocked in torch's element order" in str(result.runs)

    stream = parity.api._UserBatches(batches, None)
    user = parity.api.prepare_pair(builtin.torch_model, builtin.flax_model, None, stream)
    recipe = get_recipe("adamw-8bit")
    ours, theirs = recipe.torch_block_order(user), recipe.torch_block_order(builtin)
    assert ours.keys() == theirs.keys() == {"fc1", "fc2", "fc3"}
    for module in ours:
        np.testing.assert_array_equal(ours[module]["kernel"], theirs[module]["kernel"])
    with pytest.raises(ValueError, match=r"adamw-8bit.jax_optimizer\(pair=None\)"):
        recipe.jax_optimizer(optax.adamw(1e-3), RunConfig(model="mine", precision="adamw-8bit"))


@pytest.fixture(scope="module")
def low_bit_step0():
    """A tiny mlp (fc1 and fc2: 4096 elements each, both quantized by torchao) and its batch."""
    overrides = {"image_shape": (8, 8, 1), "hidden": 64}
    config = RunConfig(model="mlp", precision="adamw-4bit", batch_size=4, model_overrides=overrides)
    pair = cell.builtin_pair(config)
    return config, pair, pair.make_data(config.seed, config.batch_size).batch(0)


def _planted(monkeypatch, bug):
    if bug == "flax layout blocks":  # the state blocked in the Flax layout (no order)
        monkeypatch.setattr(_LowBitAdamW, "torch_block_order", staticmethod(lambda pair: {}))
    elif bug == "doubled block size":
        doubled = functools.partial(jaxamp.optim_precision.low_precision_state, block_size=256)
        monkeypatch.setattr(jaxamp.optim_precision, "low_precision_state", doubled)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("bug", [None, "flax layout blocks"])
def test_step0_optimizer_state_row_is_bit_exact_and_fails_planted_block_bugs(
    low_bit_step0, monkeypatch, bug
):
    """One torchao step and one jaxamp step from torch's step-0 gradients: the codes and scales
    equal bit for bit; blocks in the Flax layout or twice as long are other quantizations."""
    config, pair, batch = low_bit_step0
    _planted(monkeypatch, bug)
    codes_row, weights_row = optimizer_state_verdicts(pair, config, *batch)
    assert codes_row.check == "step 0 adamw-4bit: optimizer state codes and scales"
    assert codes_row.passed is (bug is None), codes_row.detail
    assert "fc1.weight, fc2.weight" in codes_row.detail
    assert codes_row.value == ("0/4 moments off" if bug is None else "4/4 moments off")
    assert weights_row.passed is True  # a first step's update does not read the stored codes
    assert optimizer_state_verdicts(pair, RunConfig(model="mlp"), *batch) is None  # fp32


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_step0_optimizer_state_row_joins_a_torch_tensor_split_into_jax_leaves(monkeypatch):
    """Attention's fused in_proj_weight (192 x 64) maps to three Flax kernels: their states,
    joined in torch's element order, are torchao's blocks bit for bit (each piece is 32 whole
    blocks); joined in another order they are not (the row fails)."""
    # one block: its attention is what the row joins (jaxamp's update compiles per leaf); a
    # 16-token vocabulary and 8 positions: the embeddings and the head stay under torchao's
    # 4096-element minimum (unquantized), the block's 64-wide layers are quantized
    overrides = {"num_layers": 1, "vocab_size": 16, "seq_len": 8}
    config = RunConfig(
        model="transformer", precision="adamw-8bit", batch_size=2, model_overrides=overrides
    )
    pair = cell.builtin_pair(config)
    x, y = pair.make_data(config.seed, config.batch_size).batch(0)
    codes_row, _ = optimizer_state_verdicts(pair, config, x, y)
    assert codes_row.passed is True, codes_row.detail
    assert "blocks.0.attn.in_proj_weight" in codes_row.detail
    pieces = optim_step0._pieces

    def value_query_key(*args):  # query's state where torch's key rows are, and so on
        out = pieces(*args)
        for name, found in out.items():
            paths = [p for _, _, p in found]
            out[name] = [
                (f, n, p) for (f, n, _), p in zip(found, paths[1:] + paths[:1], strict=True)
            ]
        return out

    monkeypatch.setattr(optim_step0, "_pieces", value_query_key)
    codes_row, _ = optimizer_state_verdicts(pair, config, x, y)
    assert codes_row.passed is False
    failing = codes_row.detail.split("failing: ", 1)[1].split(";")[0]
    assert "in_proj_weight" in failing and "not comparable" not in failing


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_planted_block_bug_stops_the_run_at_step0(low_bit_step0, monkeypatch):
    """The row gates: the model's own rows pass, the optimizer's fails step 0 (state blocks of
    256 elements where torchao's 4-bit blocks hold 128)."""
    config, pair, batch = low_bit_step0
    _planted(monkeypatch, "doubled block size")
    result = check_step0(pair, config, batch, diagnose=False)
    assert not result.passed
    failed = [v for v in result.verdicts if v.passed is False]
    assert [v.check for v in failed] == ["step 0 adamw-4bit: optimizer state codes and scales"]
    assert "16 scales of 256 elements, torchao 32 of 128" in failed[0].detail


def test_matrix_judges_adamw_4bit_against_torchs_noise(tmp_path, monkeypatch):
    """adamw-4bit's trajectory is judged against torch's own 1-ulp noise (4-bit codes amplify
    rounding past the fixed bands); its layout and blocks are decided at step 0 above. The other
    low-bit recipes keep the model's prescription, and an explicit --noise wins."""
    from parity.cli import commands as cli

    asked = []

    def fake_run_cell(config, frameworks, *, noise, seeds, **kwargs):
        asked.append((config.model, config.precision, noise, seeds))
        return []

    monkeypatch.setattr(cell, "run_cell", fake_run_cell)
    monkeypatch.setattr(cell, "write_outputs", lambda out, runs=None, **kw: ("PASS", [], None))
    args = ["matrix", "--out", str(tmp_path), "--models", "mlp", "resnet", "--no-progress"]
    args += ["--precisions", "adamw-4bit", "adamw-8bit"]
    assert cli.main(args) == 0
    assert asked == [
        ("mlp", "adamw-4bit", "torch", 1),
        ("mlp", "adamw-8bit", "none", 1),
        ("resnet", "adamw-4bit", "torch", 3),
        ("resnet", "adamw-8bit", "torch", 3),
    ]
    asked.clear()
    assert cli.main(args + ["--noise", "none"]) == 0
    assert [noise for _, _, noise, _ in asked] == ["none"] * 4
