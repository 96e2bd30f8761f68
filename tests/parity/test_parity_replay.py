"""The replay of a user's training loop: a correct torch loop (AdamW with two param groups, a
LambdaLR warm-up and cosine, global-norm clipping) against optax ports, each training-loop bug
planted on the JAX side and named by the replay; correct ports pass, eager and jitted."""

from __future__ import annotations

import functools
import math

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from hf_flax import hf_flax_model

import jaxamp
from parity.api import _UserBatches, prepare_pair
from parity.core.config import RunConfig
from parity.replay.gradients import replay_optimizers
from parity.training.user_loop import TrainingLoop

pytestmark = pytest.mark.standard_promotion

LR, WD, WARMUP, TOTAL, CLIP = 1e-2, 0.1, 2, 6, 1.0


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.ln(torch.tanh(self.fc1(x))))


class FlaxNet(fnn.Module):
    @fnn.compact
    def __call__(self, x, train=False):
        h = jnp.tanh(fnn.Dense(8, name="fc1")(x))
        return fnn.Dense(4, name="fc2")(fnn.LayerNorm(epsilon=1e-5, name="ln")(h))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 4, size=8)) for _ in range(4)
    ]
    stream = _UserBatches(batches, None)
    pair = prepare_pair(TorchNet(), FlaxNet(), None, stream)
    return pair, stream


def lam(step):
    if step < WARMUP:
        return step / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (TOTAL - WARMUP)))


def torch_adamw(model, constant=False, **kw):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln" not in n]
    other = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "ln" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
        lr=LR,
        **kw,
    )


def torch_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lam)


def schedule(warmup=WARMUP, end=0.0, shift=0):
    sched = optax.warmup_cosine_decay_schedule(0.0, LR, warmup, TOTAL, end_value=end)
    return (lambda count: sched(count + shift)) if shift else sched


def mask(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)


def port(sched=None, clip=True, **kw):
    """The correct optax port (with a mutation through keyword arguments)."""
    kw = {"weight_decay": WD, "mask": mask, **kw}
    tx = optax.adamw(sched or schedule(), **kw)
    return optax.chain(optax.clip_by_global_norm(CLIP), tx) if clip else tx


def no_bias_correction(lr, b1=0.9, b2=0.999, eps=1e-8):
    """Adam as some hand-written ports have it: moments without bias correction."""

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros)

    def update(updates, state, params=None):
        mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
        out = jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return out, optax.ScaleByAdamState(state.count + 1, mu, nu)

    return optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.GradientTransformation(init, update),
        optax.add_decayed_weights(WD, mask),
        optax.scale_by_learning_rate(lr),
    )


def per_parameter_clip(max_norm):
    def update(updates, state, params=None):
        def clip(g):
            return g * jnp.minimum(1.0, max_norm / (jnp.linalg.norm(g) + 1e-6))

        return jax.tree_util.tree_map(clip, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def fp16_scale():
    config = RunConfig(precision="fp16-mixed")
    return config.recipe.jax_loss_scale(config)


# name -> (torch optimizer, jax optimizer, precision, expected quantity, words in the message)
CORRECT = {
    "adamw mask vs param groups": (torch_adamw, lambda: port(), "fp32"),
    "adamw under fp16 loss scaling, constant lr": (
        functools.partial(torch_adamw, constant=True),
        lambda: port(LR),
        "fp16-mixed",
    ),
    "sgd nesterov": (
        lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9, nesterov=True),
        lambda: optax.chain(
            optax.clip_by_global_norm(CLIP), optax.sgd(schedule(), momentum=0.9, nesterov=True)
        ),
        "fp32",
    ),
    "torch Adam(weight_decay) vs coupled optax": (
        lambda m: torch.optim.Adam(m.parameters(), lr=LR, weight_decay=WD),
        lambda: optax.chain(
            optax.clip_by_global_norm(CLIP),
            optax.add_decayed_weights(WD),
            optax.adam(schedule()),
        ),
        "fp32",
    ),
}

MUTATIONS = {
    "weight decay on LayerNorm and biases": (
        torch_adamw,
        lambda: port(mask=None),
        "fp32",
        "weight decay",
        ["ln/scale", "JAX side only"],
    ),
    "coupled decay (add_decayed_weights before adam)": (
        torch_adamw,
        lambda: optax.chain(
            optax.clip_by_global_norm(CLIP),
            optax.add_decayed_weights(WD, mask),
            optax.adam(schedule()),
        ),
        "fp32",
        "weight decay",
        ["coupled", "JAX side"],
    ),
    "decoupled where torch couples": (
        lambda m: torch.optim.Adam(m.parameters(), lr=LR, weight_decay=WD),
        lambda: optax.chain(
            optax.clip_by_global_norm(CLIP), optax.adamw(schedule(), weight_decay=WD)
        ),
        "fp32",
        "weight decay",
        ["torch side only"],
    ),
    "weight decay strength": (
        torch_adamw,
        lambda: port(weight_decay=0.01),
        "fp32",
        "weight decay",
        ["torch 0.1, JAX 0.01"],
    ),
    "eps inside the square root": (
        torch_adamw,
        lambda: port(eps=0.0, eps_root=1e-8),
        "fp32",
        "eps placement",
        ["eps inside the square root"],
    ),
    "bias correction off": (
        torch_adamw,
        lambda: no_bias_correction(schedule()),
        "fp32",
        "bias correction",
        ["bias correction off"],
    ),
    "amsgrad on the JAX side only": (
        lambda m: torch.optim.Adam(m.parameters(), lr=LR),
        lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.amsgrad(schedule())),
        "fp32",
        "amsgrad",
        ["AMSGrad on the JAX side only"],
    ),
    "nesterov on the torch side only": (
        lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9, nesterov=True),
        lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(schedule(), momentum=0.9)),
        "fp32",
        "nesterov",
        ["Nesterov", "torch side only"],
    ),
    "schedule one step ahead": (
        torch_adamw,
        lambda: port(schedule(shift=1)),
        "fp32",
        "lr",
        ["lr at step 0: torch 0 (warm-up), JAX 0.005", "one step ahead"],
    ),
    "warm-up length": (
        torch_adamw,
        lambda: port(schedule(warmup=1)),
        "fp32",
        "lr",
        ["lr at step 1: torch 0.005", "JAX 0.01"],
    ),
    "cosine end value": (
        torch_adamw,
        lambda: port(schedule(end=LR / 10)),
        "fp32",
        "lr",
        ["lr at step 3"],
    ),
    "peak learning rate": (
        torch_adamw,
        lambda: optax.chain(
            optax.clip_by_global_norm(CLIP),
            optax.adamw(
                optax.warmup_cosine_decay_schedule(0.0, 2 * LR, WARMUP, TOTAL),
                weight_decay=WD,
                mask=mask,
            ),
        ),
        "fp32",
        "lr",
        ["lr at step 1: torch 0.005, JAX 0.01"],
    ),
    "no clipping on the JAX side": (
        torch_adamw,
        lambda: port(clip=False),
        "fp32",
        "clip factor",
        ["does not clip"],
    ),
    "clipping per parameter": (
        torch_adamw,
        lambda: optax.chain(
            per_parameter_clip(CLIP), optax.adamw(schedule(), weight_decay=WD, mask=mask)
        ),
        "fp32",
        "clip factor",
        ["per parameter"],
    ),
    "schedule counting applied updates (fp16 skipped step)": (
        torch_adamw,
        lambda: port(),
        "fp16-mixed",
        "lr",
        ["one step behind after the skipped step 1"],
    ),
    "adam beta2": (
        torch_adamw,
        lambda: port(b2=0.99),
        "fp32",
        "nu",
        ["nu of"],
    ),
}


def replay(setup, torch_optimizer, jax_optimizer, precision, jit):
    pair, stream = setup
    constant = getattr(torch_optimizer, "keywords", {}).get("constant", False)
    loop = TrainingLoop(
        torch_optimizer=torch_optimizer,
        torch_scheduler=None if constant else torch_scheduler,
        torch_clip=CLIP,
        jax_optimizer=jax_optimizer,
    )
    config = RunConfig(precision=precision, steps=TOTAL, batch_size=8)
    return replay_optimizers(pair, loop, config, stream.batch, steps=4, jit=jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_ports_pass(setup, name, jit):
    torch_optimizer, jax_optimizer, precision = CORRECT[name]
    result = replay(setup, torch_optimizer, jax_optimizer(), precision, jit)
    assert result.passed, result.first.message
    expected = {"real", "tiny", "extremes"} | ({"non-finite"} if precision != "fp32" else set())
    assert set(result.findings) == expected


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_named(setup, name):
    torch_optimizer, jax_optimizer, precision, quantity, words = MUTATIONS[name]
    # every other mutation jitted: eager and jitted optax alike
    jit = list(MUTATIONS).index(name) % 2 == 1
    result = replay(setup, torch_optimizer, jax_optimizer(), precision, jit)
    first = result.first
    assert first is not None, f"{name}: not caught"
    assert first.quantity == quantity, first.message
    for word in words:
        assert word in first.message, first.message


def test_clipping_before_unscaling_is_refused(setup):
    """Clipping outside jaxamp.loss_scaled (it would clip the scaled gradients) never reaches
    the replay's comparison: jaxamp refuses the chain, naming the fix."""
    tx = optax.chain(
        optax.clip_by_global_norm(CLIP),
        jaxamp.loss_scaled(optax.adamw(schedule(), weight_decay=WD, mask=mask), fp16_scale()),
    )
    with pytest.raises(ValueError, match="outermost"):
        replay(setup, torch_adamw, tx, "fp16-mixed", False)


# -- the loop's inputs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"torch_optimizer": torch_adamw}, ValueError, "without `jax_optimizer`"),
        ({"jax_optimizer": optax.sgd(0.1)}, ValueError, "without `torch_optimizer`"),
        ({"torch_loss": torch.nn.functional.cross_entropy}, ValueError, "without `jax_loss`"),
        ({"torch_scheduler": torch_scheduler}, ValueError, "needs `torch_optimizer`"),
        (
            {"torch_optimizer": torch_adamw, "jax_optimizer": optax.sgd(0.1), "torch_clip": -1.0},
            ValueError,
            "positive max norm",
        ),
        ({"torch_optimizer": torch_adamw, "jax_optimizer": "adamw"}, TypeError, "optax"),
        ({"replay_steps": 0}, ValueError, "replay_steps"),
    ],
)
def test_loop_refuses_bad_input(kwargs, error, words):
    with pytest.raises(error, match=words):
        TrainingLoop(**kwargs)


def test_loop_refuses_a_factory_that_returns_no_optimizer():
    loop = TrainingLoop(
        torch_optimizer=lambda m: list(m.parameters()), jax_optimizer=optax.sgd(1.0)
    )
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        loop.build_torch(TorchNet())


def test_compare_models_refuses_the_harness_optimizer_fields_beside_yours(setup):
    import parity

    with pytest.raises(ValueError, match="clip_norm, lr describe the harness's own optimizer"):
        parity.compare_models(
            TorchNet(),
            FlaxNet(),
            batches=[(np.zeros((8, 6), np.float32), np.zeros(8, np.int64))],
            torch_optimizer=torch_adamw,
            jax_optimizer=port(),
            lr=1e-3,
            clip_norm=1.0,
        )


def test_docstring_examples():
    import doctest

    from parity.core import references
    from parity.replay import layout, record, rows
    from parity.training import user_loop

    for module in (layout, record, rows, user_loop, references):
        failures, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert tried and not failures


# -- a full cell -------------------------------------------------------------------------------------


def smoothed_torch(x, y):
    return torch.nn.functional.cross_entropy(x.float(), y.long(), label_smoothing=0.1)


def smoothed_jax(x, y):
    keep = y != -100  # torch's ignore_index
    labels = optax.smooth_labels(jax.nn.one_hot(jnp.where(keep, y, 0), x.shape[-1]), 0.1)
    per_example = optax.softmax_cross_entropy(x.astype(jnp.float32), labels)
    return jnp.sum(per_example * keep) / jnp.maximum(keep.sum(), 1)


@pytest.mark.integration
def test_compare_models_with_the_users_loop(setup):
    """The user's AdamW (two param groups), LambdaLR warm-up and cosine, clipping and
    label-smoothed loss against the optax port: step 0, replay, training, verdicts; the replay's
    cost is its own phase. The port with weight decay on every tensor stops at step 0."""
    import parity

    rng = np.random.default_rng(1)
    batches = [
        (rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 4, size=8))
        for _ in range(TOTAL)
    ]
    common = dict(
        batches=batches,
        torch_optimizer=torch_adamw,
        torch_scheduler=torch_scheduler,
        torch_clip=CLIP,
        torch_loss=smoothed_torch,
        jax_loss=smoothed_jax,
        eval=False,
    )
    torch.manual_seed(0)
    result = parity.compare_models(TorchNet(), FlaxNet(), jax_optimizer=port(), **common)
    assert result.status == "PASS", [(v.check, v.detail) for v in result.verdicts if not v.passed]
    checks = {v.check: v for v in result.verdicts}
    assert checks["step 0 replay: optimizer on identical gradients"].passed
    assert checks["step 0 replay: loss on identical logits"].passed
    run = result.runs[0]
    assert [p["phase"] for p in run["phases"] if p["phase"] == "replay"] == ["replay"]
    assert run["training_loop"]["torch_optimizer"] == "torch_adamw"
    assert len(run["steps"]) == TOTAL

    torch.manual_seed(0)
    bad = parity.compare_models(TorchNet(), FlaxNet(), jax_optimizer=port(mask=None), **common)
    assert bad.status == "FAIL"
    row = next(
        v for v in bad.verdicts if v.check == "step 0 replay: optimizer on identical gradients"
    )
    assert row.passed is False
    assert "ln/scale" in row.detail and "JAX side only" in row.detail


def test_replay_loop_and_assert_loop_matches():
    """The replay alone (no training) through the library and the pytest assertion."""
    import parity
    from parity.testing import assert_loop_matches

    rng = np.random.default_rng(2)
    batches = [
        (rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 4, 8)) for _ in range(3)
    ]
    common = dict(
        torch_optimizer=torch_adamw,
        torch_scheduler=torch_scheduler,
        torch_clip=CLIP,
        torch_loss=smoothed_torch,
        jax_loss=smoothed_jax,
        steps=2,
        jit=False,
    )
    torch.manual_seed(0)
    result = parity.replay_loop(
        TorchNet(), FlaxNet(), batches=batches, jax_optimizer=port(), **common
    )
    assert result.status == "PASS" and result.runs == []
    assert set(result.replay) == {"optimizer", "loss", "seconds"}
    torch.manual_seed(0)
    with pytest.raises(AssertionError, match="weight decay applied to .*ln/scale"):
        assert_loop_matches(TorchNet(), FlaxNet(), batches, jax_optimizer=port(mask=None), **common)
    with pytest.raises(ValueError, match="nothing to replay"):
        parity.replay_loop(TorchNet(), FlaxNet(), batches=batches)


def _gpt2_transformers():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        pytest.skip("this transformers has no Flax models")
    return transformers


def _gpt2_config(transformers):
    return transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=1,  # one block has every kind of parameter the loop treats apart
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _gpt2_batches(count):
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 64, (4, 17)).astype(np.int32) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@pytest.mark.integration
@pytest.mark.slow
def test_gpt2_with_the_users_loop():
    """Hugging Face GPT-2 (tiny, random init): the nanoGPT-style loop (AdamW decaying 2-D
    tensors only, warm-up and cosine, clipping, label smoothing) and its optax port run a full
    cell and pass."""
    transformers = _gpt2_transformers()
    import parity

    config = _gpt2_config(transformers)
    torch.manual_seed(0)
    torch_model = transformers.GPT2LMHeadModel(config)
    flax_model = hf_flax_model(transformers.FlaxGPT2LMHeadModel, config, weights="zeros")
    batches = _gpt2_batches(TOTAL)

    def adamw(model):
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": matrices, "weight_decay": WD}, {"params": vectors, "weight_decay": 0.0}],
            lr=LR,
        )

    def lm_loss(x, y):
        return smoothed_torch(x.reshape(-1, x.shape[-1]), y.reshape(-1))

    tx = optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(
            schedule(), weight_decay=WD, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
        ),
    )
    result = parity.compare_models(
        torch_model,
        flax_model,
        batches=batches,
        task="lm",
        torch_optimizer=adamw,
        torch_scheduler=torch_scheduler,
        torch_clip=CLIP,
        jax_optimizer=tx,
        torch_loss=lm_loss,
        jax_loss=smoothed_jax,
        eval=False,
    )
    assert result.status == "PASS", [
        (v.check, v.detail) for v in result.verdicts if v.passed is False
    ]
    assert result.replay["optimizer"]["findings"] == {"real": None, "tiny": None, "extremes": None}


@pytest.mark.slow
def test_gpt2_bf16_true_failure_names_the_compute_dtype_check():
    """The same GPT-2 and step-0 batch as above (its float32 stage's programs are that cell's
    step 0's) at bf16-true: Hugging Face's Flax GPT-2 computes in float32 whatever its
    parameters, so step 0 fails and the cause is named, not a layer."""
    from parity.verdicts.step0 import check_step0

    transformers = _gpt2_transformers()
    config = _gpt2_config(transformers)
    torch.manual_seed(0)
    torch_model = transformers.GPT2LMHeadModel(config)
    flax_model = hf_flax_model(transformers.FlaxGPT2LMHeadModel, config, weights="zeros")
    batch = _gpt2_batches(1)[0]
    pair = prepare_pair(torch_model, flax_model, None, _UserBatches([batch], None), task="lm")
    result = check_step0(pair, RunConfig(model="gpt2", precision="bf16-true", batch_size=4), batch)
    assert not result.passed
    assert result.diagnosis.summary().startswith("cause: compute dtype (jax)")
    assert "cause: compute dtype (jax)" in result.summary()


@pytest.mark.integration
def test_golden_records_the_torch_loop_and_checks_the_jax_one(tmp_path):
    """export_models with your torch optimizer, scheduler, clipping and loss trains torch with
    them and records what they were; check_golden then runs your optax port and loss (required:
    a check without them is refused), and a schedule one step ahead fails the trajectory."""
    from examples.parity_ci.data import make_batches
    from examples.parity_ci.torch_model import reference
    from parity.golden.check import check_golden
    from parity.golden.export import export_models

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)

    torch.manual_seed(0)
    path = export_models(
        tmp_path / "loop.npz",
        reference(),
        "examples.parity_ci.flax_model:FlaxNet",
        make_batches(TOTAL),
        torch_optimizer=adamw,
        torch_scheduler=torch_scheduler,
        torch_clip=CLIP,
        torch_loss=smoothed_torch,
        eval=False,
    )

    def port_of(sched):
        return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(sched, weight_decay=WD))

    result = check_golden(path, jax_optimizer=port_of(schedule()), jax_loss=smoothed_jax)
    assert result.status == "PASS", result.report()
    with pytest.raises(ValueError, match="pass its JAX port as jax_optimizer="):
        check_golden(path, jax_loss=smoothed_jax)
    ahead = check_golden(path, jax_optimizer=port_of(schedule(shift=1)), jax_loss=smoothed_jax)
    assert ahead.status == "FAIL", ahead.report()


def looped_pair(seed: int):
    """A user's pair factory whose pair carries their training loop."""
    import dataclasses

    from parity.models import get_model_pair

    pair = get_model_pair("mlp", seed=seed)
    loop = TrainingLoop(
        torch_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        jax_optimizer=optax.sgd(0.1),
    )
    return dataclasses.replace(pair, loop=loop)


def test_distributed_runs_refuse_a_pair_with_the_users_loop(tmp_path):
    """Distributed workers train with the harness's optimizer and loss: a pair carrying the
    user's loop is refused before any worker starts, naming the loop and what to do instead."""
    from parity.distributed.run import DistributedPlan, run_distributed

    config = RunConfig(model="mlp", precision="fp32", steps=2, batch_size=8)
    with pytest.raises(ValueError, match="carries your training loop") as error:
        run_distributed(
            config,
            DistributedPlan(devices=2, strategy="ddp"),
            tmp_path,
            pair_factory=f"{__name__}:looped_pair",
        )
    message = str(error.value)
    assert "torch_optimizer, jax_optimizer" in message and "one device" in message
    assert not list(tmp_path.glob("*.log")), "a worker started"


def test_replay_threads_one_for_a_small_model_and_restored():
    from parity.replay.optimizers import FEW_PARAMETERS, replay_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with replay_threads(TorchNet()):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        big = torch.nn.Linear(FEW_PARAMETERS, 1, bias=False)  # as many parameters as the bound
        with replay_threads(big):
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), replay_threads(TorchNet()):
            raise RuntimeError("a failing replay")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
