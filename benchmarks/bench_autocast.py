"""autocast overhead: an autocast train step against the same step with hand-placed casts.

Prints a table and writes benchmarks/results/autocast.json. Gates on correctness first (same loss,
same compiled HLO modulo names), then times both steps interleaved step by step (alternating
order), medians after warm-up with block_until_ready and bootstrap 95% CIs for each median and for
the autocast/hand ratio (`parity.perf.speed`); compile time apart; the machine load is recorded and a
wide CI is flagged. Also reports the trace-time cost of autocast for a 12-layer transformer.

    .venv/bin/python benchmarks/bench_autocast.py [--steps 200] [--width 512]
    python benchmarks/bench_autocast.py --device gpu --steps 200   # torch's CUDA op lists
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import re
import statistics
import sys
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.perf import measure, speed  # noqa: E402


class MLP(nn.Module):
    width: int
    depth: int = 4
    dtype: jnp.dtype | None = None  # None: autocast decides; bfloat16: flax's hand casts

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = jax.nn.relu(nn.Dense(self.width, dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x)


def make_steps(width: int, device: str = "cpu"):
    tx = optax.sgd(1e-2, momentum=0.9)
    auto_model, hand_model = MLP(width), MLP(width, dtype=jnp.bfloat16)

    def auto_loss(params, x, y):
        logits = auto_model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def hand_loss(params, x, y):
        logits = hand_model.apply(params, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def make(loss_fn):
        @jax.jit
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    autocast_device = "cuda" if device == "gpu" else "cpu"  # torch's op lists for that device
    auto = make(jaxamp.autocast(auto_loss, device=autocast_device, dtype=jnp.bfloat16))
    hand = make(hand_loss)
    return auto_model, tx, auto, hand


def normalize_hlo(text: str) -> str:
    text = text.split("\n", 1)[1]
    text = re.sub(r",? ?metadata=\{[^}]*\}", "", text)
    text = re.sub(r"\.\d+\b", "", text)
    return text.split("FileNames")[0].strip()


class Block(nn.Module):
    dim: int
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(self.heads)(h, h)
        x = x + h
        h = nn.Dense(4 * self.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(jax.nn.gelu(h))


class Transformer(nn.Module):
    layers: int = 12
    dim: int = 128
    vocab: int = 256

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        for _ in range(self.layers):
            x = Block(self.dim)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def trace_cost(repeats: int = 3) -> dict:
    model = Transformer()
    tokens = jnp.zeros((2, 32), jnp.int32)
    params = model.init(jax.random.key(0), tokens)

    def loss(params, tokens):
        logits = model.apply(params, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    # A fresh function each time: make_jaxpr would otherwise hit JAX's trace cache.
    makers = {
        "plain": lambda: jax.value_and_grad(lambda p, t: loss(p, t)),
        "autocast": lambda: jax.value_and_grad(
            jaxamp.autocast(lambda p, t: loss(p, t), device="cpu")
        ),
    }
    out = {}
    for _ in range(repeats):
        for name, make in makers.items():
            t0 = time.perf_counter()
            jaxpr = jax.make_jaxpr(make())(params, tokens)
            out.setdefault(f"{name}_trace_times_s", []).append(time.perf_counter() - t0)
            out[f"{name}_eqns"] = len(jaxpr.jaxpr.eqns)
    for name in makers:
        out[f"{name}_trace_s"] = statistics.median(out[f"{name}_trace_times_s"])
    out["autocast_extra_trace_s"] = out["autocast_trace_s"] - out["plain_trace_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--out", default="benchmarks/results/autocast.json")
    args = parser.parse_args()
    if args.device == "cpu":
        jax.config.update("jax_platforms", "cpu")  # before the backend starts
    elif jax.default_backend() != "gpu":
        raise SystemExit(f"--device gpu: JAX's backend is {jax.default_backend()!r}, not 'gpu'")
    threads = measure.thread_settings()
    load_before = measure.load_average()

    model, tx, auto, hand = make_steps(args.width, args.device)
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (args.batch, args.width))
    y = jax.random.randint(ky, (args.batch,), 0, 10)
    params = model.init(jax.random.key(1), x)
    opt_state = tx.init(params)

    compile_s, hlo = {}, {}
    for name, step in [("autocast", auto), ("hand", hand)]:
        t0 = time.perf_counter()
        lowered = step.lower(params, opt_state, x, y)
        compiled = lowered.compile()
        compile_s[name] = time.perf_counter() - t0
        hlo[name] = normalize_hlo(compiled.as_text())
    hlo_equal = hlo["autocast"] == hlo["hand"]

    # Correctness gate: the two steps compute the same thing.
    la = auto(params, opt_state, x, y)[2]
    lh = hand(params, opt_state, x, y)[2]
    if abs(float(la) - float(lh)) > 1e-6 * max(1.0, abs(float(lh))):
        raise SystemExit(f"autocast loss {float(la)} != hand-cast loss {float(lh)}")

    times = {"autocast": [], "hand": []}
    state = {"autocast": (params, opt_state), "hand": (params, opt_state)}
    for i in range(args.steps + 10):
        order = ("autocast", "hand") if i % 2 == 0 else ("hand", "autocast")
        for name in order:
            step = auto if name == "autocast" else hand
            p, o = state[name]
            t0 = time.perf_counter()
            p, o, loss = step(p, o, x, y)
            jax.block_until_ready((p, o, loss))
            if i >= 10:  # warm-up
                times[name].append(time.perf_counter() - t0)
            state[name] = (p, o)
    med = {k: statistics.median(v) for k, v in times.items()}
    ci = {k: speed.median_ci(v)[1:] for k, v in times.items()}
    ratio, ratio_low, ratio_high = speed.ratio_ci(times["autocast"], times["hand"])
    warnings = [
        f"{k}: 95% CI spans {100 * (hi - lo) / med[k]:.0f}% of the median"
        for k, (lo, hi) in ci.items()
        if (hi - lo) / med[k] > speed.CI_WIDTH_LIMIT
    ]
    trace = trace_cost()

    record = {
        "benchmark": "autocast_overhead",
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__},
        "policy": "autocast(device='cpu', dtype=bfloat16) vs flax dtype=bfloat16 hand casts",
        "config": {"width": args.width, "batch": args.batch, "depth": 4, "steps": args.steps},
        "step_time_median_s": med,
        "step_time_ci_s": ci,
        "ratio_autocast_over_hand": ratio,
        "ratio_ci": [ratio_low, ratio_high],
        "timing": "interleaved step by step, order alternating; bootstrap 95% CIs",
        "threads": threads,
        "load_average_before": load_before,
        "load_average_after": measure.load_average(),
        "warnings": warnings,
        "compile_time_s": compile_s,
        "hlo_equal": hlo_equal,
        "transformer_12_layer_trace": trace,
    }
    print(f"{'step':<10} {'median ms (95% CI)':>26} {'compile s':>10}")
    for name in ("autocast", "hand"):
        lo, hi = ci[name]
        text = f"{med[name] * 1e3:.3f} ({lo * 1e3:.3f}-{hi * 1e3:.3f})"
        print(f"{name:<10} {text:>26} {compile_s[name]:>10.2f}")
    print(
        f"ratio autocast/hand: {ratio:.4f} (95% CI {ratio_low:.4f}-{ratio_high:.4f})   "
        f"compiled HLO identical: {hlo_equal}"
    )
    print(
        f"load average {record['load_average_before']:.1f} before, "
        f"{record['load_average_after']:.1f} after"
        + ("; UNRELIABLE: " + "; ".join(warnings) if warnings else "")
    )
    print(
        "12-layer transformer value_and_grad trace (median of 3, fresh functions): plain "
        "{plain_trace_s:.3f} s, autocast {autocast_trace_s:.3f} s "
        "({plain_eqns} -> {autocast_eqns} top-level eqns)".format(**trace)
    )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(out)


if __name__ == "__main__":
    main()
