"""parity.pairs.adapters + compare_models without a transfer: every raw error a user hit has a
message.

Each test reproduces one failure a user hit when bringing their own pair (the raw error in the
docstring) and checks the harness now names the problem and the fix, or simply works.
"""

from __future__ import annotations

import dataclasses

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flax import nnx  # noqa: E402

import parity  # noqa: E402
from parity import api  # noqa: E402
from parity.core.config import RunConfig  # noqa: E402
from parity.pairs import adapters  # noqa: E402
from parity.transfer import TransferError  # noqa: E402
from parity.twins.layers import TorchBatchNorm  # noqa: E402
from parity.twins.nnx_layers import TorchBatchNorm as NNXTorchBatchNorm  # noqa: E402
from parity.verdicts.step0 import check_step0  # noqa: E402
from parity.verdicts.step0_checks import DROPOUT_CHECK, dropout_verdict  # noqa: E402


def _images(count=2, batch=4, shape=(8, 8, 3), classes=5):
    rng = np.random.default_rng(0)
    return [
        (
            rng.standard_normal((batch, *shape)).astype(np.float32),
            rng.integers(0, classes, batch).astype(np.int32),
        )
        for _ in range(count)
    ]


class TorchConvBN(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.pool = torch.nn.MaxPool2d(2)
        self.drop = torch.nn.Dropout(dropout)
        self.fc = torch.nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.fc(self.drop(x.flatten(1)))


class LinenConvBN(fnn.Module):
    @fnn.compact
    def __call__(self, x, train: bool = False):
        x = fnn.Conv(4, (3, 3), padding=1, name="conv")(x)
        # torch's running-variance update (flax's BatchNorm uses the biased variance)
        x = TorchBatchNorm(momentum=0.9, epsilon=1e-5, name="bn")(x, train)
        x = fnn.max_pool(fnn.relu(x), (2, 2), (2, 2))
        return fnn.Dense(5, name="fc")(x.reshape(x.shape[0], -1))


class NNXConvBN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, (3, 3), padding=1, rngs=rngs)
        self.bn = NNXTorchBatchNorm(4, momentum=0.9, epsilon=1e-5, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.fc = nnx.Linear(64, 5, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.bn(self.conv(x))), (2, 2), (2, 2))
        return self.fc(self.drop(x.reshape(x.shape[0], -1)))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.standard_promotion  # optax internals
@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_conv_batchnorm_pair_compares_without_a_transfer(flavour):
    """A conv net with BatchNorm (running statistics) and a Linear after an NCHW flatten."""
    torch.manual_seed(0)
    flax_model = LinenConvBN() if flavour == "linen" else NNXConvBN(nnx.Rngs(0))
    result = parity.compare_models(TorchConvBN(), flax_model, batches=_images(3), step0=True)
    assert result.passed, [(v.check, v.value, v.passed) for v in result.verdicts]
    torch_losses = [s["loss"] for s in result.runs[0]["steps"]]
    jax_losses = [s["loss"] for s in result.runs[1]["steps"]]
    np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-5)


def _pair(torch_model, flax_model, batches=None, **kwargs):
    stream = api._UserBatches(batches or _images(1), None)
    return api.prepare_pair(torch_model, flax_model, kwargs.pop("transfer", None), stream, **kwargs)


def test_model_output_objects_are_unwrapped():
    """Was: 'CausalLMOutputWithCrossAttentions' object has no attribute 'float'."""

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        loss: torch.Tensor | None = None

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            return Output(self.fc(x))

    batches = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))]
    pair = _pair(Wrapped(), fnn.Dense(2), batches)
    logits = pair.torch_forward(pair.torch_model, torch.ones(4, 3), train=False)
    assert tuple(logits.shape) == (4, 2)
    assert adapters.output_logits({"logits": 1.0, "loss": 2.0}) == 1.0
    assert adapters.output_logits((np.zeros(2), None)).shape == (2,)
    with pytest.raises(adapters.AdapterError, match="no logits"):
        adapters.output_logits({"loss": 1.0})


def test_flax_module_without_train_argument_or_with_extra_inputs():
    """Was: __call__() got an unexpected keyword argument 'train'."""

    class NoTrain(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return fnn.Dense(2, name="fc")(x)

    class NeedsMask(fnn.Module):
        @fnn.compact
        def __call__(self, x, mask):
            return fnn.Dense(2, name="fc")(x * mask)

    class Torch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x)

    batches = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))]
    _pair(Torch(), NoTrain(), batches)
    with pytest.raises(adapters.AdapterError, match=r"needs \['mask'\].*flax_kwargs"):
        _pair(Torch(), NeedsMask(), batches)
    _pair(Torch(), NeedsMask(), batches, flax_kwargs=lambda x: {"mask": jnp.ones_like(x)})


def test_objects_that_are_not_flax_models_are_named():
    """Was: 'FlaxGPT2LMHeadModel' object has no attribute 'apply' (HF wrappers work: test_parity_hf)."""
    with pytest.raises(adapters.AdapterError, match="has no .apply"):
        adapters.as_flax_model(object())


def test_transfer_returning_a_bare_params_dict_is_accepted():
    """Was: KeyError: 'params'."""
    torch_model = torch.nn.Linear(3, 2)
    batches = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))]

    def bare(model):
        return {"kernel": model.weight.detach().numpy().T, "bias": model.bias.detach().numpy()}

    pair = _pair(torch_model, fnn.Dense(2), batches, transfer=bare)
    assert sorted(pair.torch_to_flax()) == ["params"]


def test_transfer_forgetting_batch_stats_is_caught_before_training():
    """Was: ScopeCollectionNotFound ... "batch_stats" in the middle of the JAX run."""
    from parity.transfer import conv_to_flax, linear_to_flax

    def forgetful(model):
        return {
            "params": {
                "conv": conv_to_flax(model.conv),
                "bn": {"scale": np.ones(4, np.float32), "bias": np.zeros(4, np.float32)},
                "fc": linear_to_flax(model.fc, input_chw=(4, 4, 4)),
            }
        }

    with pytest.raises(TransferError, match="collection 'batch_stats' is missing.*BatchNorm"):
        _pair(TorchConvBN(), LinenConvBN(), transfer=forgetful)


def test_image_layout_is_detected_or_refused_clearly():
    """Was: a torch shape error for NHWC images without torch_channels_first=True."""
    pair = _pair(TorchConvBN(), LinenConvBN())
    assert pair.torch_channels_first  # detected from Conv2d(in_channels=3) and NHWC data
    with pytest.raises(adapters.AdapterError, match="torch_channels_first=True"):
        _pair(TorchConvBN(), LinenConvBN(), torch_channels_first=False)
    nchw = [(x.transpose(0, 3, 1, 2).copy(), y) for x, y in _images(1, shape=(8, 8, 3))]
    with pytest.raises(adapters.AdapterError, match="NCHW.*NHWC"):
        adapters.check_image_layout(TorchConvBN(), nchw[0][0], None)


def test_dropout_is_disabled_on_both_sides_or_refused():
    torch_model = TorchConvBN(dropout=0.3)
    with pytest.raises(adapters.AdapterError, match="dropout"):
        _pair(torch_model, LinenConvBN(), dropout="refuse")
    pair = _pair(torch_model, NNXConvBN(nnx.Rngs(0)))
    assert pair.torch_model.drop.p == 0.0 and torch_model.drop.p == 0.3
    # both turned off, the rates differ (torch 0.3, NNX 0.5): an informational step-0 row says so
    row = dropout_verdict(pair, RunConfig(model="user_model", precision="fp32"))
    assert row.check == DROPOUT_CHECK and row.passed is None and row.mode == "informational"
    assert row.detail.startswith("dropout rates: torch 0.3 (drop); Flax 0.5 (drop)")
    assert "not tested" in row.detail
    # The NNX Dropout(0.5) is deterministic in the adapter's training forward: same output twice.
    variables = pair.torch_to_flax()
    x = jnp.asarray(_images(1)[0][0])
    first, _ = pair.flax_apply(variables, x, train=True)
    second, _ = pair.flax_apply(variables, x, train=True)
    np.testing.assert_array_equal(first, second)

    class LinenDropout(fnn.Module):
        @fnn.compact
        def __call__(self, x, train: bool = False):
            x = fnn.Dropout(0.5, deterministic=not train)(x)
            return fnn.Dense(2)(x)

    batches = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))]
    with pytest.raises(adapters.AdapterError, match="'dropout' PRNG key.*rate 0"):
        _pair(torch.nn.Linear(3, 2), LinenDropout(), batches)


def test_step0_names_dropout_rates_that_differ_and_stays_a_pass():
    """Turned off on both sides, dropout rates that differ went unsaid (torch 0.1, Flax 0.2)."""

    class LinenDrop(fnn.Module):
        @fnn.compact
        def __call__(self, x, deterministic: bool = True):
            x = fnn.Dropout(0.2)(fnn.Dense(4, name="fc")(x), deterministic=deterministic)
            return fnn.Dense(2, name="out")(x)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.1), torch.nn.Linear(4, 2))
    batches = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))]
    pair = _pair(net, LinenDrop(), batches)
    result = check_step0(pair, "fp32", batch=batches[0], diagnose=False)
    rows = [v for v in result.verdicts if v.check == DROPOUT_CHECK]
    assert result.passed and len(rows) == 1, [(v.check, v.passed) for v in result.verdicts]
    assert rows[0].detail.startswith("dropout rates: torch 0.1 (1); Flax 0.2 (Dropout_0)")
    # the same rates: no row
    same = _pair(
        torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 2)),
        LinenDrop(),
        batches,
    )
    assert dropout_verdict(same, RunConfig(model="user_model", precision="fp32")) is None


def test_task_errors_name_the_right_task():
    batches = [(np.ones((4, 3), np.float32), np.zeros(4, np.int32))]
    with pytest.raises(ValueError, match="'regression'"):
        _pair(torch.nn.Linear(3, 2), fnn.Dense(2), batches, task="regresion")
    targets = [(np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32))]
    pair = _pair(torch.nn.Linear(3, 2), fnn.Dense(2), targets, task="regression")
    from parity.core.losses import loss_jax, loss_torch

    logits = jnp.ones((4, 2), jnp.bfloat16)
    assert loss_jax("regression", logits, jnp.zeros((4, 2))).dtype == jnp.float32
    value = loss_torch("regression", torch.ones(4, 2, dtype=torch.bfloat16), torch.zeros(4, 2))
    assert value.dtype == torch.float32 and float(value) == 1.0
    assert pair.task == "regression"


@pytest.mark.slow
@pytest.mark.standard_promotion  # optax internals
def test_regression_pair_trains_in_parity():
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        x = rng.standard_normal((8, 3)).astype(np.float32)
        batches.append((x, (x @ np.ones((3, 2), np.float32)).astype(np.float32)))
    torch.manual_seed(0)
    result = parity.compare_models(
        torch.nn.Linear(3, 2), fnn.Dense(2), batches=batches, task="regression"
    )
    assert result.passed, [(v.check, v.value, v.passed) for v in result.verdicts]
    assert jax.tree.leaves(result.runs[0]["steps"][0]["loss"]) == [
        result.runs[0]["steps"][0]["loss"]
    ]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.standard_promotion  # optax internals
@pytest.mark.parametrize("precision", ["bf16-mixed"])  # autocast through the NNX adapter
def test_builtin_nnx_pair_trains_like_its_linen_twin(precision):
    """`mlp_nnx` (NNX) and `mlp` (linen) compute the same function: identical JAX runs."""
    from parity.core.config import RunConfig
    from parity.models import get_model_pair
    from parity.training.train_jax import train_jax

    overrides = {"image_shape": (8, 8, 3), "hidden": 16}
    runs = {}
    for name in ("mlp", "mlp_nnx"):
        pair = get_model_pair(name, seed=0, **overrides)
        config = RunConfig(model=name, precision=precision, steps=3, batch_size=8, eval=False)
        runs[name] = [s["loss"] for s in train_jax(config, pair)["steps"]]
    assert runs["mlp"] == runs["mlp_nnx"]
