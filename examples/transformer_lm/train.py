"""Transformer LM: an NNX decoder-only transformer trained under a jaxamp policy.

What jaxamp does here (see `create_model_and_optimizer` and `train_step`):

* ``jf.nnx.apply_policy(model, policy)`` gives every submodule its policy: matmuls in the compute
  dtype, LayerNorm in float32, the attention softmax in float32, logits in the output dtype;
* ``jf.Optimizer(model, tx, wrt=nnx.Param, policy=policy)`` wraps the optimizer in
  ``jaxamp.loss_scaled`` (dynamic scaling for float16 policies), skips non-finite steps and
  exposes ``amp_info()``;
* ``jf.nnx_value_and_grad`` scales the loss. The model code knows nothing about precision.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxamp
import jaxamp.flax as jf
from examples import utils
from examples.transformer_lm.config import Config
from parity import data as data_lib


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention and an MLP, each residual."""

    def __init__(self, config: Config, rngs: nnx.Rngs):
        d = config.d_model
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=config.num_heads, in_features=d, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, config.mlp_ratio * d, rngs=rngs)
        self.fc2 = nnx.Linear(config.mlp_ratio * d, d, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class TransformerLM(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.position = nnx.Param(init(rngs.params(), (config.seq_len, config.d_model)))
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.num_layers)])
        self.norm = nnx.LayerNorm(config.d_model, rngs=rngs)
        self.head = nnx.Linear(config.d_model, config.vocab_size, rngs=rngs)

    def __call__(self, tokens):
        length = tokens.shape[-1]
        x = self.embed(tokens) + self.position[...][:length]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).mean()


def create_model_and_optimizer(config: Config) -> tuple[TransformerLM, jf.Optimizer]:
    policy = jaxamp.get_policy(config.precision)
    # built under nnx.jit: its initialisers run as one compiled program, not one per op
    model = nnx.jit(lambda: TransformerLM(config, nnx.Rngs(config.seed)))()
    jf.nnx.apply_policy(model, policy)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        config.learning_rate,
        config.warmup_steps,
        max(config.num_steps, config.warmup_steps + 1),
    )
    tx = optax.chain(
        optax.clip_by_global_norm(config.clip_norm),  # inside loss_scaled: clips unscaled grads
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )
    return model, jf.Optimizer(model, tx, wrt=nnx.Param, policy=policy)


@nnx.jit
def train_step(model: TransformerLM, optimizer: jf.Optimizer, tokens, targets):
    def loss_fn(model, tokens, targets):
        return lm_loss(model(tokens), targets)

    grad_fn = jf.nnx_value_and_grad(loss_fn)
    loss, grads = grad_fn(model, tokens, targets, loss_scale=optimizer)
    optimizer.update(model, grads)
    return loss, optimizer.amp_info()


@nnx.jit
def eval_step(model: TransformerLM, tokens, targets):
    return lm_loss(model(tokens), targets)


def evaluate(model: TransformerLM, stream: data_lib.BatchStream) -> dict[str, float]:
    losses = [eval_step(model, jnp.asarray(x), jnp.asarray(y)) for x, y in stream.eval_batches()]
    loss = float(np.mean(jax.device_get(losses)))
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def train_and_evaluate(config: Config, workdir: str) -> dict[str, Any]:
    """Trains, evaluates every `eval_every` steps, writes metrics.json and loss.png.

    Returns:
      The metrics dict written to ``workdir/metrics.json``.
    """
    workdir_path = Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    stream = data_lib.synthetic_tokens(
        config.seed, config.batch_size, config.seq_len, config.vocab_size, task="lm"
    )
    model, optimizer = create_model_and_optimizer(config)
    pending, steps, evals = [], [], []
    start = time.perf_counter()
    for step in utils.progress(
        range(config.num_steps), total=config.num_steps, enabled=config.progress, desc="train"
    ):
        tokens, targets = stream.batch(step)
        loss, info = train_step(model, optimizer, jnp.asarray(tokens), jnp.asarray(targets))
        pending.append((step, loss, info))  # fetched in bulk: no host sync per step
        if (step + 1) % config.eval_every == 0 or step == config.num_steps - 1:
            steps.extend(utils.fetch_step_records(pending))
            pending = []
            evals.append({"step": step + 1, **evaluate(model, stream)})
    elapsed = time.perf_counter() - start
    metrics = {
        "example": "transformer_lm",
        "precision": config.precision,
        "policy": str(optimizer.policy),
        "config": dataclasses.asdict(config),
        "versions": {"jax": jax.__version__, "jaxamp": jaxamp.__version__},
        "module_policies": {
            path or "<root>": str(p) for path, p in jf.nnx.module_policies(model).items()
        },
        "steps": steps,
        "eval": evals,
        "summary": {
            "final_loss": steps[-1]["loss"] if steps else float("nan"),
            "eval_loss": evals[-1]["loss"] if evals else float("nan"),
            "eval_perplexity": evals[-1]["perplexity"] if evals else float("nan"),
            "skipped_steps": int(sum(s["skipped"] for s in steps)),
            "final_loss_scale": steps[-1]["loss_scale"] if steps else None,
            "tokens_per_s": config.num_steps * config.batch_size * config.seq_len / elapsed,
            "wall_time_s": elapsed,
        },
    }
    utils.write_json_atomic(workdir_path / "metrics.json", metrics)
    utils.plot_losses(
        workdir_path / "loss.png",
        [s["step"] for s in steps],
        [s["loss"] for s in steps],
        title=f"transformer LM ({config.precision})",
        loss_scales=[s["loss_scale"] for s in steps],
    )
    return metrics
