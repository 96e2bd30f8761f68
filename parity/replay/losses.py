"""Both losses on the same logits: values and gradients with respect to the logits.

Cases: the torch model's logits on the run's first batches (float32), then edge cases built
from the first: a quarter of the targets set to torch's default ``ignore_index`` (-100), one
sequence entirely ignored (language models), and extreme logits (scaled to a largest magnitude of
3e4, so that an unstabilised softmax overflows) in bfloat16 and float16. Each case compares the
two values and the two gradients within the dtype's rounding (``ULPS`` eps of the magnitudes),
and a non-finite result on one side only.

A difference is named where it fits one of the usual causes: a constant factor (sum vs mean:
the factor is the tokens per batch, the batch size or the sequence length), label smoothing, a
z-loss, ignored targets counted in the divisor or not masked at all, or sequence-weighted vs
token-weighted means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parity.replay.jax_side import COMPILER_OPTIONS

__all__ = [
    "IGNORE_INDEX",
    "LossFinding",
    "compare_losses",
    "loss_cases",
    "torch_loss_values",
]

IGNORE_INDEX = -100
ULPS = 8
EXTREME = 3e4
IGNORE_CASES = ("ignore-index", "all-masked row")


@dataclasses.dataclass(frozen=True)
class LossFinding:
    """The first case where the losses differ: ``case``, ``quantity`` (``"value"``,
    ``"gradient"``, ``"finite"``), both values and one sentence naming it. ``decisive`` is
    False for a difference on ignored targets (-100) when the real batches hold none: the two
    losses differ there, but not on this data."""

    case: str
    quantity: str
    torch_value: Any
    jax_value: Any
    message: str
    decisive: bool = True

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def loss_cases(task: str, logits: Sequence[np.ndarray], targets: Sequence[np.ndarray]):
    """``[(case name, logits, targets, dtype name)]``: the real batches, then the edge cases."""
    cases = [
        (f"batch {k}", x, y, "float32")
        for k, (x, y) in enumerate(zip(logits, targets, strict=True))
    ]
    if task not in ("classification", "lm") or not logits:
        return cases
    x, y = logits[0], np.asarray(targets[0]).copy()
    rng = np.random.default_rng(0)
    ignored = y.copy()
    ignored[rng.random(y.shape) < 0.25] = IGNORE_INDEX
    if np.all(ignored == IGNORE_INDEX):
        ignored.flat[0] = y.flat[0]
    cases.append(("ignore-index", x, ignored, "float32"))
    if task == "lm" and y.shape[0] > 1:
        masked = y.copy()
        masked[0] = IGNORE_INDEX
        cases.append(("all-masked row", x, masked, "float32"))
    extreme = x * (EXTREME / max(float(np.abs(x).max()), 1e-30))
    cases.append(("extreme logits bfloat16", extreme, y, "bfloat16"))
    cases.append(("extreme logits float16", extreme, y, "float16"))
    return cases


def _case_logits(x: np.ndarray, dtype: str) -> np.ndarray:
    """A case's logits as both sides get them: rounded to `dtype`, held in float32."""
    if dtype == "float32":
        return x
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


def torch_loss_values(
    task: str,
    torch_loss: Callable[[Any, Any], Any],
    logits: Sequence[np.ndarray],
    targets: Sequence[np.ndarray],
) -> list[tuple[float, np.ndarray] | str]:
    """torch's side of `compare_losses`: per case of `loss_cases`, ``(value, gradient w.r.t.
    the logits)``, or why torch could not compute it (no kernel for the dtype)."""
    import torch  # torch's side only: a golden check reads these values recorded

    out: list[tuple[float, np.ndarray] | str] = []
    for _case, x, y, dtype in loss_cases(task, list(logits), list(targets)):
        x = _case_logits(x, dtype)
        try:
            z = torch.tensor(x, dtype=getattr(torch, dtype), requires_grad=True)
            value = torch_loss(z, torch.as_tensor(y))
            value.backward()
            out.append((float(value.detach().float()), z.grad.detach().float().numpy()))
        except (RuntimeError, TypeError, ValueError) as e:  # torch has no kernel for the dtype
            out.append(f"torch: {str(e)[:120]}")
    return out


def _jax_side(fn, x, y, dtype):
    value, grad = fn(jnp.asarray(x, dtype), jnp.asarray(y))
    return float(value), np.asarray(grad, np.float32)


def _value_and_grad(jax_loss, jit: bool):
    """The JAX loss's value and gradient w.r.t. the logits, jitted (one program per dtype) or
    eager."""
    fn = jax.value_and_grad(lambda z, y: jax_loss(z, y).astype(jnp.float32))
    return jax.jit(fn, compiler_options=COMPILER_OPTIONS) if jit else fn


def _neg_log_probs(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(-1, keepdims=True)
    lse = np.log(np.exp(x - top).sum(-1, keepdims=True)) + top
    return lse - x


def _ce_variants(x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Per-case figures of the usual loss variants (float64): token CE, its mean over classes,
    logsumexp squared, per-sequence means..."""
    nlp = _neg_log_probs(x)
    flat_y = y.reshape(-1)
    flat = nlp.reshape(-1, nlp.shape[-1])
    keep = flat_y != IGNORE_INDEX
    picked = np.where(keep, flat[np.arange(flat.shape[0]), np.where(keep, flat_y, 0)], 0.0)
    x64 = x.astype(np.float64).reshape(-1, x.shape[-1])
    top = x64.max(-1)
    lse = np.log(np.exp(x64 - top[:, None]).sum(-1)) + top
    out = {
        "mean": picked.sum() / max(keep.sum(), 1),
        "uniform": np.where(keep, flat.mean(-1), 0.0).sum() / max(keep.sum(), 1),
        "zsq": np.where(keep, lse**2, 0.0).sum() / max(keep.sum(), 1),
        "all tokens": picked.sum() / keep.size,
    }
    if y.ndim == 2:
        rows = picked.reshape(y.shape)
        counts = keep.reshape(y.shape).sum(1)
        per_row = rows.sum(1) / np.maximum(counts, 1)
        out["sequence-weighted"] = per_row[counts > 0].mean() if (counts > 0).any() else 0.0
        out["sequence-weighted, empty rows as 0"] = per_row.mean()
    # ignored targets not masked: index -100 wraps (numpy, take_along_axis) to class V - 100
    wrapped = np.where(keep, flat_y, flat_y % flat.shape[-1])
    out["unmasked"] = flat[np.arange(flat.shape[0]), wrapped].mean()
    return out


def _sizes(row: dict) -> dict[str, int]:
    shape = row["targets_shape"]
    out = {
        "tokens per batch": int(np.prod(shape)),
        "non-ignored tokens": int(row["kept"]),
        "batch size": int(shape[0]),
    }
    if len(shape) > 1:
        out["sequence length"] = int(shape[1])
    return out


def _explain(rows: list[dict], task: str) -> str | None:
    """A cause that fits every case's values, or None."""
    real = [r for r in rows if r["case"].startswith("batch")]
    real = [r for r in real if "tg" in r]
    ratios = [r["jax"] / r["torch"] for r in real if r["torch"] != 0.0]
    proportional = all(
        np.max(np.abs(r["jg"] - (r["jax"] / r["torch"]) * r["tg"]))
        <= 1e-5 * np.max(np.abs(r["jg"]), initial=1e-30)
        for r in real
        if r["torch"] != 0.0
    )
    if ratios and proportional and len(ratios) == len(real):
        # a factor per batch that is one of the batch's sizes: sum vs mean
        for name in ("tokens per batch", "non-ignored tokens", "batch size", "sequence length"):
            sizes = [_sizes(r)[name] for r in real if name in _sizes(r)]
            if len(sizes) != len(real):
                continue
            if all(abs(q - n) <= 1e-3 * n for q, n in zip(ratios, sizes, strict=True)):
                shown = "/".join(str(n) for n in dict.fromkeys(sizes))
                return f"sum vs mean: ratio {shown} = {name} (JAX sums where torch averages)"
            if all(abs(q * n - 1) <= 1e-3 for q, n in zip(ratios, sizes, strict=True)):
                shown = "/".join(str(n) for n in dict.fromkeys(sizes))
                return f"mean vs sum: ratio 1/{shown} = 1/{name} (JAX averages where torch sums)"
        if np.allclose(ratios, ratios[0], rtol=1e-5) and abs(ratios[0] - 1) > 1e-5:
            return f"a constant factor: JAX's loss is {ratios[0]:.6g} x torch's in every case"
    # variants of mean cross-entropy (when torch's is the plain one)
    real = [r for r in rows if r["dtype"] == "float32" and r.get("variants")]
    if not real:
        return None
    fits = {}
    for label, key in (("label smoothing", "uniform"), ("z-loss", "zsq")):
        xs = np.array(
            [r["variants"][key] - (r["variants"]["mean"] if key == "uniform" else 0) for r in real]
        )
        ds = np.array([r["jax"] - r["torch"] for r in real])
        c = float(xs @ ds / (xs @ xs)) if xs @ xs > 0 else 0.0
        if abs(c) > 1e-6 and np.all(
            np.abs(ds - c * xs) <= 1e-5 * (1 + np.abs([r["torch"] for r in real]))
        ):
            fits[label] = c
    if "label smoothing" in fits:
        s = fits["label smoothing"]
        if s > 0:
            return f"label smoothing {s:.3g} on the JAX side (more than torch's)"
        return f"label smoothing {-s:.3g} on the torch side (more than JAX's)"
    if "z-loss" in fits:
        return f"a z-loss ({fits['z-loss']:.3g} x logsumexp^2) on the JAX side only"
    # the divisor and masking variants, where torch's is plain mean cross-entropy
    plain = all(
        abs(r["torch"] - r["variants"]["mean"]) <= 1e-5 * (1 + abs(r["torch"])) for r in real
    )
    if not plain:
        return None
    for key, text in (
        (
            "all tokens",
            "ignored targets count in the JAX mean's divisor (it divides by every token, torch by the non-ignored ones)",
        ),
        (
            "sequence-weighted",
            "JAX averages per sequence, then over sequences (sequence-weighted); torch over non-ignored tokens (token-weighted)",
        ),
        (
            "sequence-weighted, empty rows as 0",
            "JAX averages per sequence, then over sequences, an all-masked sequence counting 0 (sequence-weighted); torch over non-ignored tokens (token-weighted)",
        ),
        (
            "unmasked",
            f"JAX does not mask ignored targets ({IGNORE_INDEX}, torch's ignore_index): they index a class",
        ),
    ):
        if all(
            key in r["variants"]
            and abs(r["jax"] - r["variants"][key]) <= 1e-5 * (1 + abs(r["jax"]))
            for r in rows
            if r["dtype"] == "float32" and "variants" in r
        ):
            return text
    return None


def compare_losses(
    task: str,
    torch_loss: Callable[[Any, Any], Any] | Sequence[tuple[float, np.ndarray] | str],
    jax_loss: Callable[[Any, Any], Any],
    logits: Sequence[np.ndarray],
    targets: Sequence[np.ndarray],
    *,
    jit: bool = True,
) -> tuple[LossFinding | None, list[dict]]:
    """Both losses on the same logits and targets (`loss_cases`); the JAX loss under
    ``jax.jit`` (as training runs it) or eagerly.

    Args:
      torch_loss: torch's loss, or its values already computed (`torch_loss_values`: a golden
        file's).

    Returns:
      ``(first finding or None, per-case rows)``; a row holds ``case``, ``dtype``, ``torch``,
      ``jax`` (values), ``value_excess`` and ``grad_excess`` (difference over tolerance).
    """
    rows = []
    found: list[LossFinding] = []
    jax_value_and_grad = _value_and_grad(jax_loss, jit)
    cases = loss_cases(task, list(logits), list(targets))
    torch_values = (
        torch_loss_values(task, torch_loss, logits, targets) if callable(torch_loss) else torch_loss
    )
    if len(torch_values) != len(cases):
        raise ValueError(
            f"compare_losses: {len(torch_values)} torch values for {len(cases)} cases "
            f"({', '.join(c[0] for c in cases)})."
        )
    for (case, x, y, dtype), torch_value in zip(cases, torch_values, strict=True):
        eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
        x = _case_logits(x, dtype)  # the same rounded logits
        if isinstance(torch_value, str):
            rows.append({"case": case, "dtype": dtype, "skipped": torch_value})
            continue
        tv, tg = float(torch_value[0]), np.asarray(torch_value[1], np.float32)
        jv, jg = _jax_side(jax_value_and_grad, x, y, dtype)
        scale = float(np.abs(x).max()) if x.size else 1.0
        value_tol = ULPS * eps * (abs(tv) + scale + 1.0)
        grad_tol = ULPS * eps * (np.abs(tg) + float(np.abs(tg).max(initial=0.0)))
        row = {
            "case": case,
            "dtype": dtype,
            "torch": tv,
            "jax": jv,
            "targets_shape": tuple(np.shape(y)),
            "kept": int(np.sum(np.asarray(y) != IGNORE_INDEX)),
            "variants": _ce_variants(x, np.asarray(y)) if task in ("classification", "lm") else {},
        }
        finite_t, finite_j = (
            np.isfinite(tv) and np.isfinite(tg).all(),
            np.isfinite(jv) and np.isfinite(jg).all(),
        )
        if finite_t != finite_j:
            row["value_excess"] = row["grad_excess"] = float("inf")
            rows.append(row)
            side = "torch" if finite_t else "JAX"
            other = "JAX" if finite_t else "torch"
            cause = (
                f"targets {IGNORE_INDEX} (torch's ignore_index) not masked on the {other} side"
                if np.any(np.asarray(y) == IGNORE_INDEX)
                else "an unstabilised softmax or a low-precision reduction"
            )
            found.append(
                LossFinding(
                    case,
                    "finite",
                    tv,
                    jv,
                    f"loss on {case}: finite on the {side} side only ({other}'s value or "
                    f"gradient is inf/NaN: torch {tv:.6g}, JAX {jv:.6g}): {cause}",
                    # an edge case torch's own loss does not survive is not the port's fault
                    decisive=bool(finite_t) or case.startswith("batch"),
                )
            )
            continue
        if not finite_t:
            row["value_excess"] = row["grad_excess"] = 0.0
            rows.append(row)
            continue
        row["value_excess"] = abs(jv - tv) / value_tol
        row["grad_excess"] = float(np.max(np.abs(jg - tg) / np.maximum(grad_tol, 1e-45)))
        row["tg"], row["jg"] = tg, jg
        rows.append(row)
        if row["value_excess"] > 1 or row["grad_excess"] > 1:
            quantity = "value" if row["value_excess"] > 1 else "gradient"
            found.append(
                LossFinding(
                    case,
                    quantity,
                    tv,
                    jv,
                    f"loss {quantity} on {case}: torch {tv:.6g}, JAX {jv:.6g}"
                    + (
                        ""
                        if quantity == "value"
                        else f" (gradient w.r.t. the logits {row['grad_excess']:.3g} x its "
                        "tolerance)"
                    ),
                )
            )
    # a difference on ignored targets decides only where the real batches hold some
    has_ignored = any(np.any(np.asarray(y) == IGNORE_INDEX) for y in targets)
    for index, item in enumerate(found):
        if not has_ignored and item.case in IGNORE_CASES:
            found[index] = dataclasses.replace(
                item,
                decisive=False,
                message=item.message + f" (the real batches hold no {IGNORE_INDEX} targets)",
            )
    for index, item in enumerate(found):
        if item.quantity == "finite" and not np.isfinite(item.torch_value):
            found[index] = dataclasses.replace(
                item, message=item.message + " (torch's own loss overflows here: informational)"
            )
    decisive = [f for f in found if f.decisive]
    finding = (decisive or found or [None])[0]
    if finding is not None and finding.quantity != "finite":
        cause = _explain(
            [r for r in rows if "torch" in r and np.isfinite(r.get("torch", np.nan))], task
        )
        if cause is not None:
            finding = dataclasses.replace(finding, message=f"{finding.message}: {cause}")
    for row in rows:
        for key in ("variants", "tg", "jg"):
            row.pop(key, None)
    return finding, rows
