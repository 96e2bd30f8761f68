"""parity.transfer.auto / validate_variables: automatic torch -> Flax mapping (linen and NNX)."""

from __future__ import annotations

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flax import nnx  # noqa: E402

from parity.models import MODEL_NAMES, get_model_pair  # noqa: E402
from parity.transfer import TransferError, auto, validate_variables  # noqa: E402


def _example(pair, batch=2):
    inputs, _ = pair.make_data(0, batch).batch(0)
    x = torch.as_tensor(inputs)
    if x.is_floating_point():
        return x.permute(0, 3, 1, 2) if pair.torch_channels_first else x
    return x.long()


def _same_bits(a, b):
    return all(
        jax.tree.leaves(
            jax.tree.map(lambda x, y: np.asarray(x).tobytes() == np.asarray(y).tobytes(), a, b)
        )
    )


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_auto_reproduces_every_builtin_transfer(name):
    """No hand-written transfer: auto on the Flax tree alone gives the same variables bit for bit."""
    pair = get_model_pair(name, seed=0)
    reference = pair.torch_to_flax()
    mapping = auto(pair.torch_model, reference, example_inputs=_example(pair))
    assert _same_bits(reference, mapping.to_flax(pair.torch_model))


@pytest.mark.slow
def test_auto_on_freshly_initialised_flax_variables_matches_by_shape_and_order():
    """Flax auto-names (Dense_0, Conv_1, BatchNorm_0): matched by type, shape and order."""

    class Net(fnn.Module):
        @fnn.compact
        def __call__(self, x, train=False):
            x = fnn.Conv(8, (3, 3), padding=1)(x)
            x = fnn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x)
            x = fnn.relu(x)
            x = fnn.Conv(8, (3, 3), padding=1, feature_group_count=4)(x)
            x = x.reshape(x.shape[0], -1)
            return fnn.Dense(5)(fnn.relu(fnn.Dense(16)(x)))

    torch_net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=4),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 5),
    )
    with torch.no_grad():
        torch_net[1].running_mean.uniform_()
        torch_net[1].running_var.uniform_(0.5, 2)
    images = np.random.default_rng(0).standard_normal((2, 6, 6, 3)).astype(np.float32)
    variables = jax.eval_shape(Net().init, jax.random.key(0), jnp.asarray(images))
    mapping = auto(torch_net, variables, example_inputs=torch.as_tensor(images).permute(0, 3, 1, 2))
    flax_vars = mapping.to_flax(torch_net)
    validate_variables(flax_vars, variables)
    torch_net.eval()
    want = torch_net(torch.as_tensor(images).permute(0, 3, 1, 2)).detach().numpy()
    with jax.default_matmul_precision("highest"):
        got = jax.jit(Net().apply)(flax_vars, jnp.asarray(images))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert any("chw(8,6,6)" in e.transform for e in mapping.entries)


def test_conv_net_without_example_inputs_asks_for_them():
    pair = get_model_pair("cnn", seed=0)
    with pytest.raises(TransferError, match="example_inputs") as info:
        auto(pair.torch_model, pair.torch_to_flax())
    # The hint names the model's own Flax kernel, not a placeholder.
    assert "rules={'fc.weight': ('params/fc/kernel', 'linear|chw(C,H,W)')}" in str(info.value)


def test_unmatched_layers_are_listed_with_a_rule_that_fixes_them():
    torch_net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3))
    flax_vars = {
        "params": {
            "a": {"kernel": np.zeros((4, 3), np.float32), "bias": np.zeros(3, np.float32)},
            "b": {"w": np.zeros((3, 3), np.float32), "bias": np.zeros(3, np.float32)},
        }
    }
    with pytest.raises(TransferError) as info:
        auto(torch_net, flax_vars)
    message = str(info.value)
    assert "1.weight (3, 3)" in message and "params/b/w (3, 3)" in message
    assert "rules=" in message
    mapping = auto(
        torch_net, flax_vars, rules={"1.weight": ("b/w", "linear"), "1.bias": "params/b/bias"}
    )
    out = mapping.to_flax(torch_net)
    np.testing.assert_array_equal(out["params"]["b"]["w"], torch_net[1].weight.detach().numpy().T)


def test_the_fix_hint_never_names_a_leaf_by_its_shape_alone():
    """A torch head the Flax model ties to its embedding has no leaf of its own: the hint must
    not name another layer's kernel because its shape fits."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 4, bias=False)

    proj = {"kernel": np.zeros((4, 4), np.float32), "bias": np.zeros(4, np.float32)}
    with pytest.raises(TransferError) as info:
        auto(Tied(), {"params": {"proj": proj}})
    fix = str(info.value)
    assert "head.weight (4, 4)" in fix
    assert "rules={'head.weight': ('flax/path', 'linear')}" in fix
    assert "params/proj/kernel" not in fix.split("Fix:")[1]


def test_bad_rules_name_the_closest_key():
    torch_net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    flax_vars = {"params": {"d": {"kernel": np.zeros((4, 3)), "bias": np.zeros(3)}}}
    with pytest.raises(TransferError, match="closest: '0.weight'"):
        auto(torch_net, flax_vars, rules={"0.weigth": ("d/kernel", "linear")})
    with pytest.raises(TransferError, match="closest: 'params/d/kernel'"):
        auto(torch_net, flax_vars, rules={"0.weight": ("d/kernle", "linear")})


def test_ambiguous_layers_are_refused():
    """Two torch Linears of one shape, three Flax Dense of that shape: order cannot decide."""
    torch_net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    dense = {"kernel": np.zeros((3, 3), np.float32), "bias": np.zeros(3, np.float32)}
    flax_vars = {"params": {f"Dense_{i}": dict(dense) for i in range(3)}}
    with pytest.raises(TransferError, match="Ambiguous"):
        auto(torch_net, flax_vars)


class _TorchSeq(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.lstm = torch.nn.LSTM(6, 5, batch_first=True)
        self.gru = torch.nn.GRU(5, 4, batch_first=True)
        self.norm = torch.nn.RMSNorm(4, eps=1e-6)
        self.group = torch.nn.GroupNorm(2, 4)
        self.up = torch.nn.ConvTranspose1d(4, 3, 3, stride=2)


class _FlaxSeq(fnn.Module):
    @fnn.compact
    def __call__(self, tokens):
        x = fnn.Embed(11, 6, name="embed")(tokens)
        x = fnn.RNN(fnn.OptimizedLSTMCell(5), name="lstm")(x)
        x = fnn.RNN(fnn.GRUCell(4), name="gru")(x)
        x = fnn.RMSNorm(epsilon=1e-6, name="norm")(x)
        x = fnn.GroupNorm(num_groups=2, epsilon=1e-5, name="group")(x)
        return fnn.ConvTranspose(3, (3,), strides=(2,), padding="VALID", name="up")(x)


@pytest.mark.slow
def test_recurrent_norms_and_transposed_conv_forward_agree():
    torch.manual_seed(0)
    model = _TorchSeq().eval()
    tokens = np.random.default_rng(0).integers(0, 11, (2, 7))
    variables = jax.eval_shape(_FlaxSeq().init, jax.random.key(0), jnp.asarray(tokens))
    # Flax's LSTM and GRU cells have one bias where torch has two: auto says so.
    with pytest.warns(
        UserWarning, match=r"lstm\.bias_ih_l0 \+ lstm\.bias_hh_l0 .*train differently"
    ):
        mapping = auto(model, variables)
    flax_vars = mapping.to_flax(model)
    validate_variables(flax_vars, variables)
    with torch.no_grad():
        x = model.embed(torch.as_tensor(tokens))
        x, _ = model.lstm(x)
        x, _ = model.gru(x)
        x = model.group(model.norm(x).transpose(1, 2))
        want = model.up(x).transpose(1, 2).numpy()
    with jax.default_matmul_precision("highest"):
        got = jax.jit(_FlaxSeq().apply)(flax_vars, jnp.asarray(tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class _NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, (3, 3), padding=1, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, 4, 4, decode=False, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        x = x.reshape(x.shape[0], -1, 4)
        x = self.attn(x, x, x)
        for block in self.blocks:
            x = block(x)
        return x.mean(axis=1)


class _TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.attn = torch.nn.MultiheadAttention(4, 4, batch_first=True)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = x.permute(0, 2, 3, 1).reshape(x.shape[0], -1, 4)
        x, _ = self.attn(x, x, x, need_weights=False)
        for block in self.blocks:
            x = block(x)
        return x.mean(dim=1)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["module", "state"])
def test_nnx_module_or_state_with_batchnorm_and_attention(source):
    torch.manual_seed(0)
    model = _TorchNet().eval()
    with torch.no_grad():
        model.bn.running_var.uniform_(0.5, 2.0)
    flax_model = _NNXNet(nnx.Rngs(0))
    target = flax_model if source == "module" else nnx.state(flax_model)
    images = np.random.default_rng(1).standard_normal((2, 5, 5, 3)).astype(np.float32)
    mapping = auto(model, target, example_inputs=torch.as_tensor(images).permute(0, 3, 1, 2))
    variables = mapping.to_flax(model)
    validate_variables(variables, flax_model)
    assert sorted(variables) == ["batch_stats", "params"]
    from parity.pairs.adapters import nnx_load

    nnx_load(flax_model, variables)
    flax_model.eval()
    with jax.default_matmul_precision("highest"):
        got = flax_model(jnp.asarray(images))
    want = model(torch.as_tensor(images).permute(0, 3, 1, 2)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_validate_variables_names_every_problem():
    reference = {
        "params": {"fc": {"kernel": np.zeros((4, 3), np.float32), "bias": np.zeros(3, np.float32)}},
        "batch_stats": {"bn": {"mean": np.zeros(3, np.float32)}},
    }
    bad = {
        "params": {
            "fc": {"kernel": np.zeros((3, 4), np.float32), "bais": np.zeros(3, np.float32)},
            "extra": {"w": np.zeros(2, np.float32)},
        }
    }
    with pytest.raises(TransferError) as info:
        validate_variables(bad, reference)
    message = str(info.value)
    for fragment in (
        "collection 'batch_stats' is missing",
        "BatchNorm",
        "missing params/fc/bias (3,) (the transfer has 'params/fc/bais')",
        "extra params/extra/w",
        "shape of params/fc/kernel: (3, 4), the Flax model has (4, 3)",
    ):
        assert fragment in message
    half = {
        "params": {"fc": {"kernel": np.zeros((4, 3), np.float16), "bias": np.zeros(3, np.float32)}}
    }
    with pytest.raises(TransferError, match="dtype of params/fc/kernel: float16"):
        validate_variables(half, {"params": reference["params"]})


def test_separate_qkv_linears_map_onto_flax_attention():
    """torch q/k/v/out Linears (as in many hand-written attentions) -> linen MHA's DenseGeneral."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.key, self.value = (torch.nn.Linear(8, 8) for _ in range(3))
            self.out = torch.nn.Linear(8, 8)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention()

    attention = fnn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, out_features=8)
    x = jnp.ones((1, 3, 8))
    variables = {"params": {"attn": attention.init(jax.random.key(0), x, x)["params"]}}
    model = Block()
    mapping = auto(model, variables)
    transforms = {e.torch_name: e.transform for e in mapping.entries}
    assert transforms["attn.query.weight"] == "linear|reshape(8,2,4)"
    assert transforms["attn.out.weight"] == "linear|reshape(2,4,8)"
    out = mapping.to_flax(model)["params"]["attn"]
    np.testing.assert_array_equal(
        np.asarray(out["key"]["kernel"]).reshape(8, 8), model.attn.key.weight.detach().numpy().T
    )
