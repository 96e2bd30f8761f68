"""Optimizer precision on a real task (scikit-learn's bundled digits), by seed statistics.

Two studies on a 64-256-256-10 MLP, each run trained for `--steps` AdamW steps from the same
initialisation per seed, every variant on the same batches:

* **masters**: bf16 compute; float32 master weights (params float32, cast to bf16 for the forward
  pass) against bf16 weights updated by round to nearest (optax as is), by stochastic rounding
  (`jaxamp.optim_precision.stochastic_rounding`) and by Kahan summation (`jaxamp.optim_precision.kahan_summation`), at a
  learning rate and weight decay small enough that round to nearest drops most updates (an
  AdamW step of ~lr per weight is below half a bf16 spacing of weights above ~lr * 2**8).
* **state**: float32 params and compute; AdamW's moments in float32 against bf16, fp8, 8-bit and
  4-bit states (`jaxamp.optim_precision.low_precision_state`, torchao's schemes).

Per variant: final test accuracy, test loss and the mean training loss of the last 10% of steps,
mean and sample sd over seeds, Welch's t-test against the float32 reference (two-sided p), and a
verdict with power (`compare`): equivalent within a margin (1 point of accuracy, 10% of a loss)
by two one-sided tests, worse or better by more than the margin, or inconclusive. Also the fraction of bf16 weights that never
moved (round to nearest's stall, measured), and the optimizer-state bytes per parameter of each
state kind, measured from the state objects (`state_bytes`) for this model and for one
4096 x 4096 weight, and the bytes of the weights themselves. Compile time is reported apart. Writes one JSON record.

    .venv/bin/python benchmarks/bench_optim_precision.py [--seeds 6] [--steps 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import stats

import jaxamp
from jaxamp import optim_precision

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity.data import load_digits  # noqa: E402

WIDTHS = (64, 256, 256, 10)


def init_params(seed: int) -> dict:
    keys = jax.random.split(jax.random.key(seed), len(WIDTHS) - 1)
    params = {}
    for i, (key, fan_in, fan_out) in enumerate(zip(keys, WIDTHS[:-1], WIDTHS[1:], strict=True)):
        params[f"w{i}"] = jax.random.normal(key, (fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
        params[f"b{i}"] = jnp.zeros(fan_out)
    return params


def cast(tree: dict, dtype) -> dict:
    return jax.tree.map(lambda p: p.astype(dtype), tree)


def forward(params: dict, x: jax.Array) -> jax.Array:
    x = x.astype(jnp.bfloat16) if params["w0"].dtype == jnp.bfloat16 else x
    for i in range(len(WIDTHS) - 1):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < len(WIDTHS) - 2:
            x = jax.nn.relu(x)
    return x.astype(jnp.float32)


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y).mean()


def make_train(tx, compute_bf16: bool):
    """A jitted run: `steps` AdamW steps over the given batch indices (lax.scan)."""

    def step(carry, batch):
        params, state = carry
        x, y = batch
        compute = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params) if compute_bf16 else params
        loss, grads = jax.value_and_grad(loss_fn)(compute, x, y)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), loss

    @jax.jit
    def train(params, state, xs, ys):
        (params, state), losses = jax.lax.scan(step, (params, state), (xs, ys))
        return params, state, losses

    return train


def evaluate(params, images, labels) -> tuple[float, float]:
    """Test accuracy and test cross-entropy (the loss is the finer measure: 359 test images
    make accuracy move in steps of 0.0028)."""
    logits = forward(params, jnp.asarray(images))
    labels = jnp.asarray(labels)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return float((jnp.argmax(logits, -1) == labels).mean()), float(loss)


def variants(lr_masters: float, wd_masters: float, lr_state: float, wd_state: float):
    adamw_m = lambda: optax.adamw(lr_masters, weight_decay=wd_masters)  # noqa: E731
    adamw_s = lambda: optax.adamw(lr_state, weight_decay=wd_state)  # noqa: E731
    masters = {
        "float32 masters": (adamw_m(), jnp.float32, True),
        "bf16 nearest": (adamw_m(), jnp.bfloat16, False),
        "bf16 stochastic": (
            jaxamp.optim_precision.stochastic_rounding(adamw_m()),
            jnp.bfloat16,
            False,
        ),
        "bf16 kahan": (jaxamp.optim_precision.kahan_summation(adamw_m()), jnp.bfloat16, False),
    }
    state = {"float32 state": (adamw_s(), jnp.float32, False)}
    for fmt in ("bf16", "fp8", "8bit", "4bit"):
        state[f"{fmt} state"] = (
            jaxamp.optim_precision.low_precision_state(adamw_s(), fmt),
            jnp.float32,
            False,
        )
    return masters, state


def run_study(name, table, data, seeds, steps, batch_size):
    rows, compile_s = {}, {}
    x_train = np.asarray(data.train_images).reshape(len(data.train_labels), -1)
    y_train = np.asarray(data.train_labels)
    x_test = np.asarray(data.test_images).reshape(len(data.test_labels), -1)
    for label, (tx, dtype, compute_bf16) in table.items():
        train = make_train(tx, compute_bf16)
        accs, test_losses, losses, frozen, seconds = [], [], [], [], []
        for seed in seeds:
            rng = np.random.default_rng(1000 + seed)
            idx = np.stack(
                [rng.choice(len(y_train), batch_size, replace=False) for _ in range(steps)]
            )
            params = cast(init_params(seed), dtype)
            state = tx.init(params)
            if isinstance(state, jaxamp.optim_precision.StochasticRoundingState):
                state = state._replace(key=jax.random.key_data(jax.random.key(seed)))
            args = (params, state, jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx]))
            if seed == seeds[0]:
                start = time.perf_counter()
                compiled = train.lower(*args).compile()
                compile_s[label] = time.perf_counter() - start
            start = time.perf_counter()
            new_params, _, loss_curve = compiled(*args)
            jax.block_until_ready(new_params)
            seconds.append(time.perf_counter() - start)
            acc, test_loss = evaluate(new_params, x_test, data.test_labels)
            accs.append(acc)
            test_losses.append(test_loss)
            losses.append(float(np.asarray(loss_curve)[-max(steps // 10, 1) :].mean()))
            moved = [
                np.asarray(new_params[k] != params[k]) for k in new_params if k.startswith("w")
            ]
            frozen.append(1.0 - float(np.concatenate([m.ravel() for m in moved]).mean()))
        rows[label] = {
            "test_accuracy": accs,
            "test_loss": test_losses,
            "final_train_loss": losses,
            "weights_never_moved": frozen,
            "run_seconds_median": float(np.median(seconds)),
            "compile_seconds": compile_s[label],
        }
        print(f"  {name}: {label} done ({np.mean(accs):.3f} acc)", flush=True)
    return rows


# Equivalence margins: what "as good as the float32 reference" means here. Test accuracy within
# one percentage point; losses within 10% of the reference mean.
MARGINS = {
    "test_accuracy": ("abs", 0.01),
    "test_loss": ("rel", 0.10),
    "final_train_loss": ("rel", 0.10),
}
ALPHA = 0.05


def _welch(a, b, alternative="two-sided") -> float:
    if a.std() == 0 and b.std() == 0:  # Welch's t is undefined: decide on the means
        diff = a.mean() - b.mean()
        hold = {"two-sided": diff != 0, "greater": diff > 0, "less": diff < 0}[alternative]
        return 0.0 if hold else 1.0
    return float(stats.ttest_ind(a, b, equal_var=False, alternative=alternative).pvalue)


def compare(rows: dict, reference: str) -> None:
    """Per metric: Welch's two-sided p against the reference, and a verdict that has power:
    "equivalent" when two one-sided tests (TOST, alpha 0.05) put the difference inside the
    margin, "worse" when a one-sided test finds it worse by more than the margin (alpha 0.05),
    "better" likewise, else "inconclusive" (too few seeds for the margin)."""
    ref = rows[reference]
    for row in rows.values():
        for metric, better in (("test_accuracy", 1), ("test_loss", -1), ("final_train_loss", -1)):
            values, base = np.asarray(row[metric]), np.asarray(ref[metric])
            kind, size = MARGINS[metric]
            margin = size if kind == "abs" else size * abs(float(base.mean()))
            # H1 of each one-sided test, as a shift of `values` against `base`:
            p_above = _welch(values + margin, base, "greater")  # diff > -margin
            p_below = _welch(values - margin, base, "less")  # diff < +margin
            if better > 0:
                p_worse = _welch(values + margin, base, "less")  # diff < -margin
                p_better = _welch(values - margin, base, "greater")  # diff > +margin
            else:
                p_worse = _welch(values - margin, base, "greater")
                p_better = _welch(values + margin, base, "less")
            if not np.isfinite(values).all():
                verdict = "worse"  # a non-finite loss: diverged
            elif max(p_above, p_below) < ALPHA:
                verdict = "equivalent"
            elif p_worse < ALPHA:
                verdict = "worse"
            elif p_better < ALPHA:
                verdict = "better"
            else:
                verdict = "inconclusive"
            row[f"{metric}_mean"] = float(values.mean())
            row[f"{metric}_sd"] = float(values.std(ddof=1)) if values.size > 1 else 0.0
            row[f"{metric}_p_vs_reference"] = _welch(values, base)
            row[f"{metric}_margin"] = margin
            row[f"{metric}_verdict"] = verdict


def bytes_per_param(table) -> dict:
    out = {}
    model = init_params(0)
    n_model = sum(p.size for p in jax.tree.leaves(model))
    big = {"w": jnp.zeros((4096, 4096))}
    for label, (tx, dtype, _) in table.items():
        params = cast(model, dtype)
        shapes = jax.eval_shape(tx.init, params)
        big_shapes = jax.eval_shape(tx.init, cast(big, dtype))
        out[label] = {
            "model": optim_precision.state_bytes(shapes) / n_model,
            "4096x4096 weight": optim_precision.state_bytes(big_shapes) / big["w"].size,
            "weights": optim_precision.state_bytes(params) / n_model,
        }
    return out


def print_table(title, rows, memory):
    print(f"\n{title}")
    print(
        f"{'variant':<16} {'test acc':>16} {'p':>6} {'':5} {'test loss':>17} {'p':>6} {'':5} "
        f"{'train loss':>17} {'p':>6} {'':5} {'unmoved':>8} {'state B/param model, 4096²':>27} "
        f"{'weights':>7}"
    )

    def cell(row, metric):
        mean, sd, p = (row[f"{metric}_{k}"] for k in ("mean", "sd", "p_vs_reference"))
        return f"{mean:>8.4g} ± {sd:<6.2g} {p:>6.3f} {row[f'{metric}_verdict'][:5]:<5}"

    for label, row in rows.items():
        mem = memory[label]
        print(
            f"{label:<16} {cell(row, 'test_accuracy')} {cell(row, 'test_loss')} "
            f"{cell(row, 'final_train_loss')} {np.mean(row['weights_never_moved']):>8.3f} "
            f"{mem['model']:>16.3f}, {mem['4096x4096 weight']:.3f} {mem['weights']:>8.0f}"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr-masters", type=float, default=1e-4)
    parser.add_argument("--wd-masters", type=float, default=0.1)
    parser.add_argument("--lr-state", type=float, default=1e-3)
    parser.add_argument("--wd-state", type=float, default=1e-2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/optim_precision.json"))
    args = parser.parse_args(argv)

    data = load_digits()
    seeds = list(range(args.seeds))
    masters, state = variants(args.lr_masters, args.wd_masters, args.lr_state, args.wd_state)
    load_before = os.getloadavg()[0]
    record = {"studies": {}}
    for name, table, reference in (
        ("masters", masters, "float32 masters"),
        ("state", state, "float32 state"),
    ):
        rows = run_study(name, table, data, seeds, args.steps, args.batch_size)
        compare(rows, reference)
        memory = bytes_per_param(table)
        for label in rows:
            rows[label]["state_bytes_per_param"] = memory[label]
        record["studies"][name] = {"reference": reference, "rows": rows}
        print_table(f"{name} (reference: {reference})", rows, memory)
    record.update(
        {
            "benchmark": "optim_precision",
            "task": "digits (sklearn, 1438 train / 359 test), MLP 64-256-256-10",
            "config": vars(args),
            "seeds": seeds,
            "device": str(jax.devices()[0]),
            "platform": platform.platform(),
            "processor": platform.processor(),
            "versions": {
                "jax": jax.__version__,
                "optax": optax.__version__,
                "numpy": np.__version__,
            },
            "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        }
    )
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nload average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; wrote {path}")
    return record


if __name__ == "__main__":
    main()
