"""parity.automap: layers paired by execution order and function, never by how names sort.

Every case found: two same-shape layers whose names sort the other way round on the
Flax side map right or raise; the error's hint names real paths; a ResNet-style twin with
mixed naming and BatchNorm passes step 0 with no rules; a property test over random stacks.
"""

from __future__ import annotations

import re

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flax import nnx  # noqa: E402
from hf_flax import hf_flax_model  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from parity import api  # noqa: E402
from parity.pairs.variables import flatten_variables  # noqa: E402
from parity.transfer import TransferError, auto, explain, format_explanation  # noqa: E402
from parity.twins.layers import TorchBatchNorm, TorchLSTM  # noqa: E402
from parity.verdicts.step0 import check_step0  # noqa: E402

X = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)


def _pairs(mapping) -> dict[str, str]:
    """torch module -> Flax module path."""
    return {e.torch_module: "/".join(e.flax_module) for e in mapping.entries}


def _how(mapping) -> dict[str, str]:
    return {e.torch_module: e.decided_by for e in mapping.entries}


def _same_output(torch_model, flax_module, mapping, x=X):
    torch_model.eval()
    with torch.no_grad():
        want = torch_model(torch.as_tensor(x)).numpy()
    with jax.default_matmul_precision("highest"):
        got = flax_module.apply(mapping.to_flax(torch_model), jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# --- enc/dec against encoder/decoder (linen and NNX) ----------------------------------------------


class EncDec(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(8, 8)
        self.dec = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.dec(torch.tanh(self.enc(x)))


class FlaxEncDec(fnn.Module):
    @fnn.compact
    def __call__(self, x):
        return fnn.Dense(8, name="decoder")(jnp.tanh(fnn.Dense(8, name="encoder")(x)))


class NNXEncDec(nnx.Module):
    def __init__(self, rngs):
        self.decoder = nnx.Linear(8, 8, rngs=rngs)  # "decoder" sorts and is declared first
        self.encoder = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.decoder(jnp.tanh(self.encoder(x)))


def test_enc_dec_pairs_by_execution_order_in_linen_and_nnx():
    torch.manual_seed(0)
    model = EncDec()
    variables = jax.eval_shape(FlaxEncDec().init, jax.random.key(0), X)
    mapping = auto(model, variables, example_inputs=torch.as_tensor(X), flax_model=FlaxEncDec())
    assert _pairs(mapping) == {"enc": "encoder", "dec": "decoder"}
    assert set(_how(mapping).values()) == {"execution order"}
    _same_output(model, FlaxEncDec(), mapping)

    flax_model = NNXEncDec(nnx.Rngs(0))
    mapping = auto(model, flax_model, example_inputs=torch.as_tensor(X))
    assert _pairs(mapping) == {"enc": "encoder", "dec": "decoder"}
    nnx_vars = mapping.to_flax(model)
    np.testing.assert_array_equal(
        nnx_vars["params"]["encoder"]["kernel"], model.enc.weight.detach().numpy().T
    )


def test_enc_dec_without_a_forward_pass_raises_with_a_rule_that_settles_it():
    model = EncDec()
    variables = jax.eval_shape(FlaxEncDec().init, jax.random.key(0), X)
    with pytest.raises(TransferError) as info:
        auto(model, variables)  # weights only: no order to see, and names do not agree
    message = str(info.value)
    assert "enc, dec" in message and "decoder, encoder" in message
    assert "example_inputs=" in message and "flax_model=" in message
    rule = re.search(r"rules=(\{.*\})", message).group(1)
    paths = {"/".join(p) for p in flatten_variables(variables)}
    assert set(re.findall(r"'(params/[^']+)'", rule)) <= paths  # real paths only
    rules = {
        "enc.weight": ("params/encoder/kernel", "linear"),
        "enc.bias": "params/encoder/bias",
        "dec.weight": ("params/decoder/kernel", "linear"),
        "dec.bias": "params/decoder/bias",
    }
    mapping = auto(model, variables, rules=rules)
    assert set(_how(mapping).values()) == {"rule"}
    _same_output(model, FlaxEncDec(), mapping)


# --- query/key against q/k: siblings decided by function ------------------------------------------


class QueryKey(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.query = torch.nn.Linear(8, 8)
        self.key = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        scores = torch.softmax(self.query(x) @ self.key(x).T, dim=-1)
        return self.out(scores @ x)


class FlaxQK(fnn.Module):
    key_first: bool = True

    @fnn.compact
    def __call__(self, x):
        if self.key_first:  # the other call order: execution order alone would swap them
            k = fnn.Dense(8, name="k")(x)
            q = fnn.Dense(8, name="q")(x)
        else:
            q = fnn.Dense(8, name="q")(x)
            k = fnn.Dense(8, name="k")(x)
        scores = jax.nn.softmax(q @ k.T, axis=-1)
        return fnn.Dense(8, name="o")(scores @ x)


@pytest.mark.parametrize("key_first", [True, False])
def test_query_key_siblings_are_decided_by_function(key_first):
    torch.manual_seed(0)
    model = QueryKey()
    flax_module = FlaxQK(key_first=key_first)
    variables = jax.eval_shape(flax_module.init, jax.random.key(0), X)
    mapping = auto(model, variables, example_inputs=torch.as_tensor(X), flax_model=flax_module)
    assert _pairs(mapping) == {"query": "q", "key": "k", "out": "o"}
    assert _how(mapping)["query"] == "function" and _how(mapping)["out"] == "execution order"
    _same_output(model, flax_module, mapping)


class SumOfTwo(torch.nn.Module):
    """Two siblings whose outputs are summed: no forward pass can tell them apart."""

    def __init__(self):
        super().__init__()
        self.left = torch.nn.Linear(8, 8)
        self.right = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.left(x) + self.right(x)


class FlaxSumOfTwo(fnn.Module):
    @fnn.compact
    def __call__(self, x):
        return fnn.Dense(8, name="b")(x) + fnn.Dense(8, name="a")(x)


def test_siblings_that_no_function_separates_raise_with_both_pairings():
    model = SumOfTwo()
    variables = jax.eval_shape(FlaxSumOfTwo().init, jax.random.key(0), X)
    with pytest.raises(TransferError) as info:
        auto(model, variables, example_inputs=torch.as_tensor(X), flax_model=FlaxSumOfTwo())
    message = str(info.value)
    assert "pairings that fit" in message and "left -> b" in message and "left -> a" in message
    assert "rules={'left.weight'" in message


# --- fc_a/fc_b against second_stage/first_stage ---------------------------------------------------


class Stages(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_a = torch.nn.Linear(8, 8)
        self.fc_b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc_b(torch.relu(self.fc_a(x)))


class FlaxStages(fnn.Module):
    def setup(self):
        self.second_stage = fnn.Dense(8)
        self.first_stage = fnn.Dense(8)

    def __call__(self, x):
        return self.second_stage(fnn.relu(self.first_stage(x)))


def test_fc_a_fc_b_against_second_stage_first_stage():
    torch.manual_seed(1)
    model = Stages()
    variables = jax.eval_shape(FlaxStages().init, jax.random.key(0), X)
    mapping = auto(model, variables, example_inputs=torch.as_tensor(X), flax_model=FlaxStages())
    assert _pairs(mapping) == {"fc_a": "first_stage", "fc_b": "second_stage"}
    _same_output(model, FlaxStages(), mapping)


# --- a.1 and a_1 in one torch model ---------------------------------------------------------------


class Collide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        self.a_1 = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.a_1(torch.tanh(self.a[1](torch.tanh(self.a[0](x)))))


class FlaxCollide(fnn.Module):
    def setup(self):
        self.a = [fnn.Dense(8), fnn.Dense(8)]  # a_0, a_1
        self.head = fnn.Dense(8)

    def __call__(self, x):
        return self.head(jnp.tanh(self.a[1](jnp.tanh(self.a[0](x)))))


def test_a_dot_1_and_a_underscore_1_do_not_share_a_name():
    torch.manual_seed(2)
    model = Collide()
    variables = jax.eval_shape(FlaxCollide().init, jax.random.key(0), X)
    mapping = auto(model, variables, example_inputs=torch.as_tensor(X), flax_model=FlaxCollide())
    assert _pairs(mapping) == {"a.0": "a_0", "a.1": "a_1", "a_1": "head"}
    assert _how(mapping) == {"a.0": "name", "a.1": "execution order", "a_1": "execution order"}
    _same_output(model, FlaxCollide(), mapping)


# --- Sequential(Linear, Tanh, Linear) against one compact expression ------------------------------


class Nested(fnn.Module):
    @fnn.compact
    def __call__(self, x):
        return fnn.Dense(8)(jnp.tanh(fnn.Dense(8)(x)))  # the outer Dense is built first: Dense_0


def test_sequential_against_nested_compact_calls():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    variables = jax.eval_shape(Nested().init, jax.random.key(0), X)
    mapping = auto(model, variables, example_inputs=torch.as_tensor(X), flax_model=Nested())
    assert _pairs(mapping) == {"0": "Dense_1", "2": "Dense_0"}
    _same_output(model, Nested(), mapping)
    text = format_explanation(explain(mapping, model))
    assert "0.weight -> params/Dense_1/kernel  [linear; execution order]" in text


# --- a layer run twice is one layer ---------------------------------------------------------------


class Reused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.other = torch.nn.Linear(8, 8)
        self.shared = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.shared(torch.tanh(self.other(torch.tanh(self.shared(x)))))


class FlaxReused(fnn.Module):
    @fnn.compact
    def __call__(self, x):
        shared = fnn.Dense(8, name="zz")  # sorts last, runs first
        return shared(jnp.tanh(fnn.Dense(8, name="aa")(jnp.tanh(shared(x)))))


def test_a_layer_run_twice_is_one_layer_at_its_first_call():
    torch.manual_seed(5)
    model = Reused()
    variables = jax.eval_shape(FlaxReused().init, jax.random.key(0), X)
    mapping = auto(model, variables, example_inputs=torch.as_tensor(X), flax_model=FlaxReused())
    assert _pairs(mapping) == {"shared": "zz", "other": "aa"}
    _same_output(model, FlaxReused(), mapping)


class StackedLSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 8, num_layers=2, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


class FlaxStackedLSTM(fnn.Module):
    @fnn.compact
    def __call__(self, x):
        return TorchLSTM(8, name="second")(TorchLSTM(8, name="first")(x))


def test_the_layers_of_one_stacked_lstm_pair_in_layer_order():
    """One nn.LSTM runs both layers in one call: they are ordered, not siblings."""
    torch.manual_seed(6)
    model = StackedLSTM()
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    variables = jax.eval_shape(FlaxStackedLSTM().init, jax.random.key(0), x)
    mapping = auto(
        model, variables, example_inputs=torch.as_tensor(x), flax_model=FlaxStackedLSTM()
    )
    assert _pairs(mapping) == {"lstm.0": "first", "lstm.1": "second"}
    _same_output(model, FlaxStackedLSTM(), mapping, x)


# --- hints name real paths; folds are said --------------------------------------------------------


class FlaxTwo(fnn.Module):
    @fnn.compact
    def __call__(self, x):
        return fnn.Dense(2, name="fc2")(fnn.relu(fnn.Dense(8, name="fc1")(x)))


def test_the_fix_hint_names_no_path_that_only_exists_or_fits():
    class Three(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.extra = (
                torch.nn.Linear(4, 8),
                torch.nn.Linear(8, 2),
                torch.nn.Linear(3, 5),
            )

    variables = jax.eval_shape(FlaxTwo().init, jax.random.key(0), np.zeros((1, 4), np.float32))
    with pytest.raises(TransferError) as info:
        auto(Three(), variables)
    message = str(info.value)
    assert "extra.weight (5, 3)" in message and "Dense_0" not in message
    # extra has no counterpart: no leaf of the model is named for it (fc1/fc2 are other layers)
    hinted = re.search(r"rules=\{'extra\.weight': \('([^']+)'", message).group(1)
    assert hinted == "flax/path"
    assert "No Flax leaf left unfilled reads like extra.weight" in message


def test_a_folded_gru_bias_is_warned_and_explained():
    class GRU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = torch.nn.GRU(3, 4, batch_first=True)

    variables = jax.eval_shape(
        fnn.RNN(fnn.GRUCell(4)).init, jax.random.key(0), np.zeros((1, 2, 3), np.float32)
    )
    variables = {"params": {"gru": variables["params"]}}
    model = GRU()
    with pytest.raises(UserWarning, match=r"gru\.bias_ih_l0 \+ gru\.bias_hh_l0"):
        auto(model, variables)
    with pytest.warns(UserWarning, match="train differently"):
        mapping = auto(model, variables)
    rows = {row["torch"]: row for row in explain(mapping, model)}
    notes = {name: row["note"] for name, row in rows.items()}
    assert "folded: summed with gru.bias_hh_l0" in notes["gru.bias_ih_l0"]
    assert (
        rows["gru.bias_ih_l0"]["folded_into"] == "params/gru/cell/ir/bias, params/gru/cell/iz/bias"
    )
    assert rows["gru.weight_ih_l0"]["folded_into"] == ""
    assert "split into" in notes["gru.weight_ih_l0"]


# --- a ResNet-style twin with mixed naming and BatchNorm ------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = torch.nn.Sequential(
                torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        identity = x if self.downsample is None else self.downsample(x)
        return torch.relu(y + identity)


class TorchResNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.layer1 = torch.nn.Sequential(Block(4, 4, 1))
        # A projection that changes channels at stride 1: this CPU torch's weight gradient of a
        # strided 1x1 convolution differs between two identical backward passes.
        self.layer2 = torch.nn.Sequential(Block(4, 8, 1))
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(x.mean(dim=(2, 3)))


def _norm(train, name=None):
    # torch's BatchNorm semantics (unbiased running variance) under linen's own variable names.
    return lambda x: TorchBatchNorm(name=name)(x, train)


class ResNetBlock(fnn.Module):
    filters: int
    strides: int

    @fnn.compact
    def __call__(self, x, train):
        residual = x
        conv = lambda f, k, s, **kw: fnn.Conv(f, (k, k), s, padding=k // 2, use_bias=False, **kw)  # noqa: E731
        y = fnn.relu(_norm(train)(conv(self.filters, 3, self.strides)(x)))
        y = _norm(train)(conv(self.filters, 3, 1)(y))
        if residual.shape != y.shape:  # the Flax ImageNet example's names
            residual = conv(self.filters, 1, self.strides, name="conv_proj")(residual)
            residual = _norm(train, "norm_proj")(residual)
        return fnn.relu(y + residual)


class FlaxResNet(fnn.Module):
    @fnn.compact
    def __call__(self, x, train: bool = False):
        x = fnn.Conv(4, (3, 3), padding=1, use_bias=False, name="conv_init")(x)
        x = fnn.relu(_norm(train, "bn_init")(x))
        for filters, strides in ((4, 1), (8, 1)):
            x = ResNetBlock(filters, strides)(x, train)  # ResNetBlock_0.. sort before bn_init
        return fnn.Dense(5)(x.mean(axis=(1, 2)))


@pytest.mark.slow
def test_resnet_twin_with_mixed_naming_passes_step0_with_no_rules():
    torch.manual_seed(4)
    model = TorchResNet()
    with torch.no_grad():  # BatchNorms that differ: a shifted pairing would show at step 0
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((4, 6, 6, 3)).astype(np.float32), rng.integers(0, 5, 4))
    pair = api.prepare_pair(model, FlaxResNet(), None, api._UserBatches([batch], None))
    pairs = _pairs(pair.mapping)
    assert pairs["bn1"] == "bn_init" and pairs["conv1"] == "conv_init"
    assert pairs["layer1.0.bn2"] == "ResNetBlock_0/TorchBatchNorm_1"
    assert pairs["layer2.0.downsample.1"] == "ResNetBlock_1/norm_proj"
    assert pairs["fc"] == "Dense_0"
    result = check_step0(pair, "fp32", batch=batch, diagnose=False)
    assert result.passed, result.summary()


# --- property: random stacks with unrelated names: right or raises --------------------------------


class FlaxStack(fnn.Module):
    kinds: tuple
    names: tuple

    @fnn.compact
    def __call__(self, x):
        for (kind, features), name in zip(self.kinds, self.names, strict=True):
            if kind == "conv":
                x = jnp.tanh(fnn.Conv(features, (3, 3), padding=1, name=name)(x))
            else:
                if x.ndim == 4:
                    x = x.reshape(x.shape[0], -1)
                x = jnp.tanh(fnn.Dense(features, name=name)(x))
        return x


def _torch_stack(kinds, names, channels, image):
    layers = torch.nn.Sequential()
    features = channels
    flat = False
    for (kind, width), name in zip(kinds, names, strict=True):
        if kind == "conv":
            layers.add_module(name, torch.nn.Conv2d(features, width, 3, padding=1))
        else:
            if not flat and image:
                layers.add_module(f"{name}_flat", torch.nn.Flatten())
                features = features * image * image
                flat = True
            layers.add_module(name, torch.nn.Linear(features, width))
        layers.add_module(f"{name}_act", torch.nn.Tanh())
        features = width
    return layers


_letters = st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=5)


@st.composite
def _stacks(draw):
    convs = draw(st.integers(0, 2))
    dense = draw(st.integers(1 if convs else 2, 3))
    kinds = tuple(("conv", draw(st.sampled_from([2, 3]))) for _ in range(convs))
    kinds += tuple(("dense", draw(st.sampled_from([3, 4]))) for _ in range(dense))
    count = len(kinds)
    # (no torch name that is an attribute of nn.Sequential already: "to", "type", "train")
    free = _letters.filter(lambda n: not hasattr(torch.nn.Sequential, "t" + n))
    torch_names = draw(st.lists(free, min_size=count, max_size=count, unique=True))
    flax_names = draw(st.lists(_letters, min_size=count, max_size=count, unique=True))
    # Unrelated names: torch's start with "t", Flax's with "f", so no name agrees.
    return kinds, tuple("t" + n for n in torch_names), tuple("f" + n for n in flax_names)


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_stacks())
def test_random_stacks_map_right_or_raise(stack):
    kinds, torch_names, flax_names = stack
    image = 3 if kinds[0][0] == "conv" else 0
    channels = 2 if image else 4
    torch.manual_seed(0)
    model = _torch_stack(kinds, torch_names, channels, image)
    rng = np.random.default_rng(0)
    if image:
        x_flax = rng.standard_normal((2, image, image, channels)).astype(np.float32)
        x_torch = torch.as_tensor(x_flax).permute(0, 3, 1, 2)
    else:
        x_flax = rng.standard_normal((2, channels)).astype(np.float32)
        x_torch = torch.as_tensor(x_flax)
    flax_module = FlaxStack(kinds, flax_names)
    # the variables' structure and shapes only (the weights are torch's): no initialiser compiled
    variables = jax.eval_shape(flax_module.init, jax.random.key(0), x_flax)
    # Right or raise is the contract; a chain of layers has one execution order, so it maps.
    mapping = auto(model, variables, example_inputs=x_torch, flax_model=flax_module)
    assert _pairs(mapping) == dict(zip(torch_names, flax_names, strict=True))
    with torch.no_grad():
        want = model(x_torch).numpy()
    with jax.default_matmul_precision("highest"):
        got = flax_module.apply(mapping.to_flax(model), jnp.asarray(x_flax))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# --- Hugging Face pairs still need no transfer code -----------------------------------------------


@pytest.mark.slow
@pytest.mark.standard_promotion  # Hugging Face Flax code mixes bool and int32
def test_bert_pair_maps_by_name_with_no_transfer_code():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxBertModel"):
        pytest.skip("this transformers has no Flax models (transformers 5 dropped them)")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    torch_model = transformers.BertModel(config).eval()
    flax_model = hf_flax_model(transformers.FlaxBertModel, config, weights="zeros")
    mapping = auto(torch_model, flax_model)
    assert len(mapping.torch_names()) == len(list(torch_model.parameters()))
    assert {row["decided_by"] for row in explain(mapping, torch_model)} == {"name"}
    ids = np.random.default_rng(0).integers(0, 64, (2, 8))
    with torch.no_grad():
        want = torch_model(torch.as_tensor(ids)).last_hidden_state.numpy()
    with jax.default_matmul_precision("highest"):  # one compiled forward, not op by op
        forward = jax.jit(lambda params: flax_model(ids, params=params).last_hidden_state)
        got = forward(mapping.to_flax(torch_model)["params"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
@pytest.mark.standard_promotion  # optax internals
def test_the_record_and_report_show_the_mapping(tmp_path):
    """enc/dec against encoder/decoder through compare_models: the records carry each pair and
    how it was decided, and report.md shows them."""
    import parity

    rng = np.random.default_rng(0)
    batches = [
        (rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, 8)))
        for _ in range(2)
    ]
    batches = [(x, y.astype(np.float32)) for x, y in batches]
    torch.manual_seed(0)
    result = parity.compare_models(
        EncDec(), FlaxEncDec(), batches=batches, task="regression", steps=2, out_dir=tmp_path
    )
    rows = {r["torch"]: r for r in result.runs[0]["weight_mapping"]}
    assert rows["enc.weight"]["flax"] == "params/encoder/kernel"
    assert rows["dec.bias"]["decided_by"] == "execution order"
    report = (tmp_path / "report.md").read_text()
    assert "## Weight mapping (user_model)" in report
    assert "| enc.weight | params/encoder/kernel | linear | execution order |  |" in report
