"""Train-step overhead of `jaxamp.loss_scaled(adamw)` over plain `adamw`, same policy.

Three variants of one train step (forward, backward, AdamW update) are compiled and timed
interleaved, step by step, after warm-up, with `block_until_ready`:

* ``plain``: `optax.adamw` on unscaled gradients (no loss scaling at all);
* ``loss_scaled``: `jaxamp.loss_scaled(optax.adamw)` with a dynamic loss scale, stepped with
  `jaxamp.apply_gradients` (the parameter update inside the skip decision);
* ``loss_scaled_in_place``: the same with ``loss_scaled(..., in_place=True)``, the form meant
  for steps that donate params and state (timed both ways all the same);
* ``loss_scaled_update``: the same optimizer stepped optax-style, ``tx.update`` then
  `jaxamp.apply_updates` (the updates are written out and read back);
* ``naive``: a hand-written wrapper that unscales in a separate pass, checks finiteness in a
  separate pass and selects (`jnp.where`) over updates and the whole inner state;
* ``flax``: Flax's `DynamicScale.value_and_grad` (unscale, finite check, scale update) and
  `jnp.where` over the new params and optimizer state, as the Flax examples do;
* ``jmp``: `jmp.DynamicLossScale` (scale, unscale, `jmp.all_finite`, `adjust`) and
  `jmp.select_tree` over the new params and optimizer state, as jmp's README does;
* ``loss_scaled_policy``: the README's ``train_step`` verbatim: the policy handed to
  `jaxamp.value_and_grad` (``policy=``) rather than written out, so jaxamp casts, runs float16
  losses under autocast's lists and accumulates weight gradients in the policy's float32
  ``reduce_dtype`` (under ``fp32`` it is ``loss_scaled`` exactly);
* ``plain_policy``: the same gradient program without loss scaling (`jaxamp.value_and_grad`
  with the policy and no loss scale, then `optax.adamw`), the reference for
  ``loss_scaled_policy``'s own overhead (``ratio_to_plain_policy``).

Opt-in (``--variants ... loss_scaled_provenance``):

* ``loss_scaled_provenance``: ``loss_scaled`` with ``provenance=True`` (which gradient leaf
  overflowed, each leaf's headroom, measured inside the skip branch only): its ratio to
  ``loss_scaled`` is what provenance costs a finite step.

    python benchmarks/bench_loss_scaled.py --models mlp transformer --variants loss_scaled \
        loss_scaled_provenance --donate no --steps 200

Opt-in (``--variants ... order_floor``), a diagnostic and not a loss scaler:

* ``order_floor``: `loss_scaled`'s program with the inf/NaN check reduced to one element per
  gradient leaf. The update still waits for every gradient, as any exact whole-step skip must,
  but the check costs nothing: its ratio is the floor that ordering alone sets.

Every variant but the two ``*_policy`` ones differentiates the same policy-cast loss (the casts
written out, as Flax and jmp users write them, so that those variants compute the same
numbers); ``loss_scaled`` is otherwise the README's ``train_step`` as users write it (`jaxamp.value_and_grad`, `jaxamp.apply_gradients`, `jaxamp.amp_info` returned;
under ``fp32`` the casts are no-ops and it is that step exactly). Each variant is jitted twice, with its
params and optimizer state donated (``donate_argnums=(0, 1)``) and without (as the README's
step, and many training scripts, are written); ``--donate`` picks which. Every (variant,
donation) step is timed interleaved with the others (the order rotates); each ratio is to
``plain`` with the same donation and comes with a bootstrap 95% confidence interval
(resampling the paired step indices); each ``loss_scaled*`` variant also gets its ratio to
``flax`` and to ``jmp`` (``ratio_to_peer``, same CI), printed after its row. Compile times are
reported apart. ``--clock cpu`` times each step in CPU seconds of this process
(`time.process_time`) rather than wall-clock seconds: on a machine shared with other work the
wall clock also measures the waits for a core.

    python benchmarks/bench_loss_scaled.py --steps 100 --repeats 2
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale

import jaxamp


class MLP(nn.Module):
    features: tuple[int, ...] = (1024, 1024, 1024)
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        for width in self.features:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.classes)(x)


class Block(nn.Module):
    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.d_model)(h)
        return x + nn.Dense(self.d_model)(nn.gelu(h))


class TinyLM(nn.Module):
    vocab: int = 512
    d_model: int = 256
    layers: int = 2
    heads: int = 4
    seq_len: int = 64

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d_model)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model))
        for _ in range(self.layers):
            x = Block(self.d_model, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _naive_loss_scaled(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """The straightforward wrapper the issue measured at 1.12x: three separate passes."""

    def init(params):
        return (inner.init(params), jaxamp.DynamicLossScale.create())

    def update(grads, state, params=None):
        inner_state, loss_scale = state
        grads = jax.lax.optimization_barrier(loss_scale.unscale(grads))
        finite = jax.lax.optimization_barrier(jaxamp.all_finite(grads))
        updates, new_inner = inner.update(grads, inner_state, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        new_inner = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, inner_state)
        return updates, (new_inner, loss_scale.adjust(finite))

    return optax.GradientTransformation(init, update)


def _problem(name: str, batch_size: int, tiny: bool = False):
    """(params, x, y, loss_fn) of one model. `tiny`: the same model code at a fraction of the
    compile time (an MLP with no hidden layer, a one-block 16-wide TinyLM): the same kinds of
    leaves (kernels, biases, embeddings) and so the same code paths, for tests and smoke runs,
    never for timings."""
    rng = np.random.default_rng(0)
    if name == "mlp":
        model = MLP(features=()) if tiny else MLP()
        x = jnp.asarray(rng.normal(size=(batch_size, 784)), jnp.float32)
        y = jnp.asarray(rng.integers(0, 10, size=(batch_size,)), jnp.int32)
    elif name == "transformer":
        model = TinyLM(vocab=32, d_model=16, layers=1, heads=2, seq_len=8) if tiny else TinyLM()
        x = jnp.asarray(rng.integers(0, model.vocab, size=(batch_size, model.seq_len)), jnp.int32)
        y = jnp.roll(x, -1, axis=1)
    else:
        raise ValueError(f"model must be 'mlp' or 'transformer'; got {name!r}")
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]  # one program, not op by op

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return params, x, y, loss_fn


VARIANTS = (
    "plain",
    "loss_scaled",
    "loss_scaled_in_place",
    "loss_scaled_update",
    "naive",
    "flax",
    "jmp",
    "plain_policy",
    "loss_scaled_policy",
)
OPT_IN = ("loss_scaled_provenance",)
DIAGNOSTICS = ("order_floor",)


def _make_step(variant: str, loss_fn, policy, donate: bool = True):
    """(init(params) -> state, jitted step(params, state, x, y) -> (params, state, loss, ...)).

    With `donate` the params and optimizer state are donated (updated in place)."""
    jit = functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    policy = jaxamp.get_policy(policy)
    base = optax.adamw(1e-4, weight_decay=0.01)

    def compute_loss(params, x, y):
        # The same policy casts for every variant (the differentiated cast gives f32 grads).
        params, x = policy.cast_to_compute((params, x))
        return policy.cast_to_output(loss_fn(params, x, y)).astype(jnp.float32)

    if variant == "plain":
        grad_fn = jax.value_and_grad(compute_loss)

        def step(params, opt_state, x, y):
            loss, grads = grad_fn(params, x, y)
            updates, opt_state = base.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return base.init, jit(step)

    if variant in ("loss_scaled", "loss_scaled_in_place", "loss_scaled_provenance"):
        tx = jaxamp.loss_scaled(
            base,
            in_place=variant == "loss_scaled_in_place",
            provenance=variant == "loss_scaled_provenance",
        )

        def step(params, opt_state, x, y):  # the README's train_step
            loss, grads = jaxamp.value_and_grad(compute_loss)(params, x, y, loss_scale=opt_state)
            params, opt_state = jaxamp.apply_gradients(tx, grads, opt_state, params)
            return params, opt_state, loss, jaxamp.amp_info(opt_state)

        return tx.init, jit(step)

    if variant in ("plain_policy", "loss_scaled_policy"):
        # The policy is jaxamp's to apply: `loss_fn` without the casts written out.
        grad_fn = jaxamp.value_and_grad(loss_fn, policy=policy)
        if variant == "plain_policy":

            def step(params, opt_state, x, y):
                loss, grads = grad_fn(params, x, y)
                updates, opt_state = base.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            return base.init, jit(step)
        tx = jaxamp.loss_scaled(base)

        def step(params, opt_state, x, y):  # the README's train_step, verbatim
            loss, grads = grad_fn(params, x, y, loss_scale=opt_state)
            params, opt_state = jaxamp.apply_gradients(tx, grads, opt_state, params)
            return params, opt_state, loss, jaxamp.amp_info(opt_state)

        return tx.init, jit(step)

    if variant in ("loss_scaled_update", "naive"):
        tx = (
            jaxamp.loss_scaled(base)
            if variant == "loss_scaled_update"
            else _naive_loss_scaled(base)
        )
        grad_fn = jaxamp.value_and_grad(compute_loss)

        def step(params, opt_state, x, y):
            scale = opt_state[1] if variant == "naive" else opt_state
            loss, grads = grad_fn(params, x, y, loss_scale=scale)
            updates, opt_state = tx.update(grads, opt_state, params)
            if variant == "loss_scaled_update":
                return jaxamp.apply_updates(params, updates, opt_state), opt_state, loss
            return optax.apply_updates(params, updates), opt_state, loss

        return tx.init, jit(step)

    if variant == "order_floor":
        grad_fn = jaxamp.value_and_grad(compute_loss)

        def init(params):
            return base.init(params), jaxamp.DynamicLossScale.create()

        def step(params, state, x, y):
            opt_state, loss_scale = state
            loss, grads = grad_fn(params, x, y, loss_scale=loss_scale)
            # One element per leaf: the branch depends on every gradient, the check is free.
            firsts = jnp.stack([g.reshape(-1)[0] for g in jax.tree.leaves(grads)])
            finite = jnp.isfinite(firsts).all()

            def applied(operands):
                params, opt_state = operands
                updates, opt_state = base.update(loss_scale.unscale(grads), opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            params, opt_state = jax.lax.cond(finite, applied, lambda o: o, (params, opt_state))
            return params, (opt_state, loss_scale.adjust(finite)), loss

        return init, jit(step)

    if variant == "flax":

        def init(params):
            return base.init(params), DynamicScale()

        def step(params, state, x, y):
            opt_state, dynamic_scale = state
            dynamic_scale, is_finite, loss, grads = dynamic_scale.value_and_grad(compute_loss)(
                params, x, y
            )
            updates, new_opt_state = base.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            select = lambda new, old: jnp.where(is_finite, new, old)  # noqa: E731
            new_params = jax.tree.map(select, new_params, params)
            new_opt_state = jax.tree.map(select, new_opt_state, opt_state)
            return new_params, (new_opt_state, dynamic_scale), loss

        return init, jit(step)

    if variant == "jmp":
        # jmp's loss scale checks its fields when rebuilt, which `jit(...).lower` trips on:
        # carry its arrays and rebuild it inside the step.
        def init(params):
            scale = jmp.DynamicLossScale(jnp.float32(2.0**16))
            return base.init(params), (scale.loss_scale, scale.counter)

        def step(params, state, x, y):
            opt_state, (scale_value, counter) = state
            loss_scale = jmp.DynamicLossScale(scale_value, counter)

            def scaled_loss(params):
                loss = compute_loss(params, x, y)
                return loss_scale.scale(loss), loss

            grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
            grads = loss_scale.unscale(grads)
            grads_finite = jmp.all_finite(grads)
            loss_scale = loss_scale.adjust(grads_finite)
            updates, new_opt_state = base.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            new_params, new_opt_state = jmp.select_tree(
                grads_finite, (new_params, new_opt_state), (params, opt_state)
            )
            return new_params, (new_opt_state, (loss_scale.loss_scale, loss_scale.counter)), loss

        return init, jit(step)
    raise ValueError(f"variant must be one of {VARIANTS + OPT_IN + DIAGNOSTICS}; got {variant!r}")


PEERS = ("flax", "jmp")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _paired_ratio(times, reference) -> dict:
    """Median over the reference's median, with the paired bootstrap 95% CI."""
    return {
        "ratio": statistics.median(times) / statistics.median(reference),
        "ci95": _bootstrap_ratio_ci(times, reference),
    }


def _bootstrap_ratio_ci(times, plain, *, n_boot=2000, seed=0):
    """95% CI of median(times) / median(plain), resampling paired step indices (`plain` may be
    any step timed in the same interleaved run: the reference or a peer)."""
    times, plain = np.asarray(times), np.asarray(plain)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(times), size=(n_boot, len(times)))
    ratios = np.median(times[idx], axis=1) / np.median(plain[idx], axis=1)
    return [float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))]


def bench(
    model: str,
    policy: str,
    steps: int,
    warmup: int,
    batch_size: int,
    variants: tuple[str, ...] = VARIANTS,
    donate: tuple[bool, ...] = (True, False),
    tiny: bool = False,
    clock: str = "wall",
) -> list[dict]:
    """One interleaved run of every (variant, donation) step; one result per donation mode.
    `tiny` times the tiny models of `_problem` (tests and smoke runs); `clock` is "wall"
    (`time.perf_counter`) or "cpu" (`time.process_time`: this process's CPU seconds)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {tuple(CLOCKS)}; got {clock!r}")
    timer = CLOCKS[clock]
    if not variants or variants[0] != "plain":
        raise ValueError(f"variants must start with 'plain' (the reference); got {variants!r}")
    if not donate:
        raise ValueError("donate must hold True (donated), False (not donated) or both")
    params, x, y, loss_fn = _problem(model, batch_size, tiny)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    cells = [(variant, d) for d in donate for variant in variants]
    runs = {}
    for variant, d in cells:
        init, step = _make_step(variant, loss_fn, policy, donate=d)
        p = jax.tree.map(jnp.copy, params)
        s = init(p)
        t0 = time.perf_counter()
        compiled = step.lower(p, s, x, y).compile()
        compile_s = time.perf_counter() - t0
        runs[variant, d] = {
            "step": compiled,
            "params": p,
            "state": s,
            "times": [],
            "compile_s": compile_s,
        }

    def run_one(cell):
        r = runs[cell]
        out = r["step"](r["params"], r["state"], x, y)
        r["params"], r["state"] = out[0], out[1]
        jax.block_until_ready(out)
        return out

    for _ in range(warmup):
        for cell in cells:
            run_one(cell)
    for i in range(steps):
        # Interleave, rotating the order so no step always runs first after another.
        shift = i % len(cells)
        for cell in cells[shift:] + cells[:shift]:
            t0 = timer()
            run_one(cell)
            runs[cell]["times"].append(timer() - t0)
    results = []
    for d in donate:
        plain_times = runs["plain", d]["times"]
        plain = statistics.median(plain_times)
        result = {
            "model": model,
            "policy": policy,
            "params": int(n_params),
            "batch_size": batch_size,
            "tiny": tiny,
            "donated": d,
            "clock": clock,
            "steps": steps,
            "warmup": warmup,
            "variants": {},
        }
        for variant in variants:
            times = runs[variant, d]["times"]
            med = statistics.median(times)
            q1, _, q3 = statistics.quantiles(times, n=4)
            result["variants"][variant] = {
                "median_s": med,
                "iqr_s": [q1, q3],
                "ratio_to_plain": med / plain,
                "ratio_ci95": _bootstrap_ratio_ci(times, plain_times),
                "compile_s": runs[variant, d]["compile_s"],
            }
        # loss_scaled against each peer directly (same run, same donation): below 1 with the
        # whole CI below 1 is "ahead of that peer".
        for variant in variants:
            if not variant.startswith("loss_scaled"):
                continue
            result["variants"][variant]["ratio_to_peer"] = {
                peer: _paired_ratio(runs[variant, d]["times"], runs[peer, d]["times"])
                for peer in PEERS
                if peer in variants
            }
        if "plain_policy" in variants:
            # The README's step against the same gradient program unscaled: what loss
            # scaling itself costs there.
            reference = runs["plain_policy", d]["times"]
            for variant in variants:
                if variant.endswith("_policy") and variant != "plain_policy":
                    result["variants"][variant]["ratio_to_plain_policy"] = _paired_ratio(
                        runs[variant, d]["times"], reference
                    )
        results.append(result)
    return results


def _print_rows(r: dict) -> None:
    for variant, v in r["variants"].items():
        iqr = f"{v['iqr_s'][0] * 1e3:.2f}-{v['iqr_s'][1] * 1e3:.2f}"
        ci = f"{v['ratio_ci95'][0]:.3f}-{v['ratio_ci95'][1]:.3f}"
        donated = "yes" if r["donated"] else "no"
        compared = dict(v.get("ratio_to_peer", {}))
        if "ratio_to_plain_policy" in v:
            compared["plain_policy"] = v["ratio_to_plain_policy"]
        peers = "".join(
            f"  /{peer} {c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]"
            for peer, c in compared.items()
        )
        print(
            f"{r['model']:<12}{r['policy']:>11}{r['batch_size']:>6}{donated:>8}{variant:>22}"
            f"{v['median_s'] * 1e3:>11.2f}{iqr:>17}{v['ratio_to_plain']:>8.3f}{ci:>15}"
            f"{v['compile_s']:>11.2f}{peers}",
            flush=True,
        )


def _write_json_atomic(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer"]
    )
    parser.add_argument("--policies", nargs="+", default=["fp32", "bf16-mixed", "fp16-mixed"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="repeat the whole measurement")
    parser.add_argument(
        "--batch-size", "--batch-sizes", dest="batch_sizes", type=int, nargs="+", default=[32]
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS + OPT_IN + DIAGNOSTICS),
        help="what to time ('plain', the reference, is always timed)",
    )
    parser.add_argument(
        "--donate",
        choices=["both", "yes", "no"],
        default="both",
        help="jit each step with its params and state donated, without, or both (default)",
    )
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="time steps in wall-clock seconds (default) or in this process's CPU seconds",
    )
    parser.add_argument("--out", default="benchmarks/results/loss_scaled.json")
    parser.add_argument("--smoke", action="store_true", help="allow --steps < 50 (development)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny models with the same code paths (tests and smoke runs; not for timings)",
    )
    args = parser.parse_args(argv)
    if args.steps < 50 and not args.smoke:
        parser.error(f"--steps must be >= 50 for a stable median; got {args.steps}")
    variants = ("plain", *dict.fromkeys(v for v in args.variants if v != "plain"))
    donate = {"both": (True, False), "yes": (True,), "no": (False,)}[args.donate]
    load_before = os.getloadavg()
    header = (
        f"{'model':<12}{'policy':>11}{'batch':>6}{'donated':>8}{'variant':>22}{'median ms':>11}"
        f"{'IQR ms':>17}{'ratio':>8}{'95% CI':>15}{'compile s':>11}"
    )
    print(header)
    print("-" * len(header), flush=True)
    results = []

    def write(complete: bool) -> None:
        payload = {
            "benchmark": "loss_scaled_overhead",
            # False while configurations are still to come: written after each one, so a run
            # stopped part-way (a time cap) keeps what it measured.
            "complete": complete,
            "device": str(jax.devices()[0].device_kind),
            "platform": jax.default_backend(),
            "machine": {
                "processor": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(),
                # 1/5/15-minute load averages: a loaded machine widens the spread (compare ratios).
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
            },
            "versions": {
                "jax": jax.__version__,
                "optax": optax.__version__,
                "jaxamp": jaxamp.__version__,
                "flax": flax.__version__,
                "jmp": getattr(jmp, "__version__", "unknown"),
            },
            "results": results,
        }
        _write_json_atomic(args.out, payload)

    for repeat in range(args.repeats):
        for policy in args.policies:
            for model in args.models:
                for batch_size in args.batch_sizes:
                    for r in bench(
                        model,
                        policy,
                        args.steps,
                        args.warmup,
                        batch_size,
                        variants,
                        donate,
                        tiny=args.tiny,
                        clock=args.clock,
                    ):
                        r["repeat"] = repeat
                        results.append(r)
                        _print_rows(r)  # as each configuration finishes: long runs show progress
                    write(complete=False)
    write(complete=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
