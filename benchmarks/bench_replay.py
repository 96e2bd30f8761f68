"""What the replay of a user's training loop costs, against the training run it gates.

For each built-in model (and, with ``--gpt2``, a tiny Hugging Face GPT-2) this runs
`parity.compare_models` with a user loop: torch AdamW with two param groups (decay on matrices
only), a LambdaLR warm-up and cosine, global-norm clipping and a label-smoothed cross-entropy,
against its optax port. The run record's phase timings (`parity.perf.phases`) give the CPU and
wall seconds of the replay and of everything else; the table prints the replay's share of the
cell, and the JSON keeps every phase.

    python benchmarks/bench_replay.py --steps 30 --out benchmarks/results/replay_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

import parity  # noqa: E402
from parity.core.hardware import hardware_info  # noqa: E402
from parity.models import get_model_pair  # noqa: E402

LR, WD, WARMUP, SMOOTHING = 1e-3, 0.1, 5, 0.1


def decayed(params):
    """The optax mask of torch's first param group: weights and embeddings, by leaf name (not
    by rank: Flax's attention biases are 2-D, (heads, head_dim), where torch's are 1-D)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"), params
    )


def user_loop(steps: int) -> dict:
    def lam(step):
        if step < WARMUP:
            return step / WARMUP
        return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(steps - WARMUP, 1)))

    def optimizer(model):
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": matrices, "weight_decay": WD}, {"params": vectors, "weight_decay": 0.0}],
            lr=LR,
        )

    def torch_loss(logits, targets):
        return torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1).long(),
            label_smoothing=SMOOTHING,
        )

    def jax_loss(logits, targets):
        keep = targets != -100
        onehot = jax.nn.one_hot(jnp.where(keep, targets, 0), logits.shape[-1])
        losses = optax.softmax_cross_entropy(
            logits.astype(jnp.float32), optax.smooth_labels(onehot, SMOOTHING)
        )
        return jnp.sum(losses * keep) / jnp.maximum(keep.sum(), 1)

    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, WARMUP, steps)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=WD, mask=decayed),
    )
    return dict(
        torch_optimizer=optimizer,
        torch_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lam),
        torch_clip=1.0,
        jax_optimizer=tx,
        torch_loss=torch_loss,
        jax_loss=jax_loss,
    )


def gpt2_pair():
    import numpy as np
    import transformers

    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    torch_model = transformers.GPT2LMHeadModel(config)
    flax_model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
    rng = np.random.default_rng(0)

    def batch(step):
        tokens = np.random.default_rng(step).integers(0, 64, (4, 17)).astype(np.int32)
        return tokens[:, :-1], tokens[:, 1:]

    del rng
    return torch_model, flax_model, batch, "lm"


def measure(name: str, steps: int) -> dict:
    if name == "gpt2":
        torch_model, flax_model, batches, task = gpt2_pair()
    else:
        pair = get_model_pair(name, seed=0)
        torch_model, flax_model, task = pair.torch_model, pair.flax_model, pair.task
        stream = pair.make_data(0, 16)
        batches = stream.batch
    result = parity.compare_models(
        torch_model, flax_model, batches=batches, steps=steps, task=task, eval=False,
        **user_loop(steps),
    )  # fmt: skip
    phases = result.runs[0]["phases"]
    top = {p["phase"]: p for p in phases if "/" not in p["phase"]}
    total_cpu = sum(p["cpu_s"] for p in top.values())
    total_wall = sum(p["wall_s"] for p in top.values())
    replay = top.get("replay", {"cpu_s": 0.0, "wall_s": 0.0})
    train_cpu = sum(p["cpu_s"] for k, p in top.items() if k.startswith("train"))
    return {
        "model": name,
        "steps": steps,
        "status": result.status,
        "replay_cpu_s": replay["cpu_s"],
        "replay_wall_s": replay["wall_s"],
        "train_cpu_s": train_cpu,
        "cell_cpu_s": total_cpu,
        "cell_wall_s": total_wall,
        "replay_share_cpu": replay["cpu_s"] / total_cpu if total_cpu else None,
        "phases": phases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    parser.add_argument("--gpt2", action="store_true", help="also a tiny Hugging Face GPT-2")
    parser.add_argument("--steps", type=int, nargs="+", default=[30])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    models = list(args.models) + (["gpt2"] if args.gpt2 else [])
    rows = [measure(m, s) for m in models for s in args.steps]
    print("| model | steps | status | replay CPU s | training CPU s | cell CPU s | replay share |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['steps']} | {r['status']} | {r['replay_cpu_s']:.2f} | "
            f"{r['train_cpu_s']:.2f} | {r['cell_cpu_s']:.2f} | {r['replay_share_cpu']:.1%} |"
        )
    record = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": hardware_info(),
        "clock": "CPU seconds of this process (phase timings of the run record)",
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps([{k: v for k, v in r.items() if k != "phases"} for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
