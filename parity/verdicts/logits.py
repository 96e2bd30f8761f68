"""A language model's eval logits compared across frameworks: per-token KL divergence and top-k
agreement at each eval point (MaxText's logit checker), judged with power.

Both trainers record, for a pair whose task is ``"lm"``, a float32 sample of the first eval
batch's logits at each eval point: the initial weights (step 0) and the weights after the last
update (`parity.core.records.eval_logit_point`). `logit_rows` turns the two records' samples
into two rows per eval point:

- ``eval logits, step S: per-token KL(torch || jax)``: mean and max over the sampled tokens of
  ``KL(softmax(z_torch) || softmax(z_jax))`` (`token_kl`), judged.
- ``eval logits, step S: top-1 agreement``: the share of tokens whose top-1 token is the same
  (top-5 overlap in the detail, `topk_agreement`), judged up to near-ties (`top1_agrees`).

**The tolerance.** Logits that agree to a normwise relative difference ``eps`` per token,
spread over the vocabulary as rounding is (each logit off by about ``eps * rms(z_t)``,
independently), give ``KL_t ~ Var_p(delta) / 2 ~ (eps * rms(z_t))**2 / 2`` to second order (a
shift common to all logits changes nothing). So the mean over tokens is held to
``eps**2 * mean_t(ms_t) / 2`` (``ms_t`` the mean square of torch's logits of token ``t``), and each
token to ``KL_t <= max_v delta_v**2 / 2 <= ln(2 N V) * eps**2 * ms_t``: the largest of ``N * V``
Gaussian errors of deviation ``sigma`` is about ``sigma * sqrt(2 ln(2 N V))``. ``eps`` comes from
the sources the loss rows use (`eval_logit_band`):

- step 0 (the same weights on both sides): ``max(1e-4, 8 u(compute dtype))``: the fp32 loss band
  of step 0 (`parity.verdicts.tolerances.step_band`), or 8 unit roundoffs of the dtype the logits
  are computed in (bfloat16 3.1e-2, float16 3.9e-3, float8_e4m3 0.5: inconclusive unless it
  fails), `parity.verdicts.tolerance.SAFETY` times the one rounding a stored logit carries.
- after training, fp32: the per-step loss tolerance of the last step
  (`parity.verdicts.tolerances.step_tolerances`: the fixed bands, or noise-calibrated with
  calibration runs).
- after training, below fp32: the final-loss band (5%, or ``k`` times the self-divergence
  envelope at the end when larger), at least the step-0 ``eps``.

The rows are qualified as every row is (`parity.verdicts.qualifiers`): an ``eps`` above the
loss bound (20%) is a pass without power; past step 30 uncalibrated a failure is excused
(exceeded, not failed) as the loss rows' are, and a pass stands.

The row's `power` is ``eps``: a relative logit difference spread over the vocabulary that it
could detect. Top-1 agreement is judged with the same ``eps``: a token agrees when torch's top
token is within ``m_t = 2 sqrt(2 ln(2 N V)) * eps * rms(z_t)`` of JAX's largest logit (each
side's logit may move by half of that), so a near-tie at the initial weights (nearly uniform
logits, where any rounding flips an argmax) never fails a correct port, and an argmax that moved
by more than the band does. The raw top-1 and top-5 rates are the row's figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from scipy import special

from parity.core.recipes import get_recipe
from parity.core.records import eval_logit_sample
from parity.verdicts.rows import LOSS_UNIT, Row, fmt_value
from parity.verdicts.tolerance import SAFETY, unit_roundoff
from parity.verdicts.tolerances import TOLERANCES, step_band

__all__ = [
    "eval_logit_band",
    "logit_rows",
    "token_kl",
    "top1_agrees",
    "topk_agreement",
]


def _float64(logits: Any) -> np.ndarray:
    values = np.asarray(logits)
    if values.ndim < 1 or values.shape[-1] < 1:
        raise ValueError(
            f"logits must have a vocabulary axis (last) of size >= 1; got shape {values.shape}"
        )
    return values.astype(np.float64)


def token_kl(reference: Any, candidate: Any) -> np.ndarray:
    """Per-token ``KL(softmax(reference) || softmax(candidate))`` over the last axis, in nats.

    Computed in float64 as ``log1p(E_p[expm1(e)]) - E_p[e]`` with ``e = d - E_p[d]``,
    ``d = candidate - reference`` and ``p = softmax(reference)`` (`scipy.special.softmax`): the
    two log-sum-exps never meet and a shift common to all logits drops out first, so logits that
    agree to float32 rounding (KL ~1e-14) are measured to ~1e-6 relative, where
    ``sum p log(p / q)`` loses ~3% to cancellation.

    Args:
      reference: ``(..., vocab)`` logits (torch's side), any float dtype (float16, bfloat16,
        float32, float64; numpy or JAX arrays).
      candidate: logits of the same shape (JAX's side).

    Returns:
      float64 array of shape ``reference.shape[:-1]``, every entry >= 0; inf for a token whose
      logits are not finite where the two sides differ (a -inf mask both sides share is fine).

    Example:
      >>> float(token_kl(np.array([0.0, 0.0]), np.array([1.0, 1.0])))
      0.0
    """
    a, b = _same_shape(reference, candidate)
    p = special.softmax(a, axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(a == b, 0.0, b - a)  # a -inf mask on both sides: no difference
        broken = np.any(~np.isfinite(d), axis=-1)
        d = np.where(np.isfinite(d), d, 0.0)
        p = p / np.sum(p, axis=-1, keepdims=True)
        e = d - np.sum(p * d, axis=-1, keepdims=True)
        kl = np.log1p(np.sum(p * np.expm1(e), axis=-1)) - np.sum(p * e, axis=-1)
    return np.where(broken, np.inf, np.maximum(kl, 0.0))


def _same_shape(reference: Any, candidate: Any) -> tuple[np.ndarray, np.ndarray]:
    a, b = _float64(reference), _float64(candidate)
    if a.shape != b.shape:
        raise ValueError(f"logits shapes differ: reference {a.shape}, candidate {b.shape}")
    return a, b


def topk_agreement(reference: Any, candidate: Any, k: int = TOLERANCES["top_k"]) -> np.ndarray:
    """Per-token share of the `k` largest logits the two sides have in common: ``|top_k(ref) ∩
    top_k(cand)| / k`` (``k = 1``: 1.0 where the argmax agrees, else 0.0).

    Ties are broken by the lower index on both sides (a stable sort).

    Args:
      reference, candidate: ``(..., vocab)`` logits of one shape, any float dtype.
      k: how many top entries, ``1 <= k <= vocab``.

    Returns:
      float64 array of shape ``reference.shape[:-1]`` with values in [0, 1].

    Example:
      >>> topk_agreement(np.array([[3.0, 2.0, 1.0]]), np.array([[3.0, 1.0, 2.0]]), k=2)
      array([0.5])
    """
    a, b = _same_shape(reference, candidate)
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= k <= a.shape[-1]:
        raise ValueError(
            f"`k` must be an integer in [1, {a.shape[-1]}] (the vocabulary); got {k!r}"
        )
    top_a = np.argsort(-a, axis=-1, kind="stable")[..., :k]
    top_b = np.argsort(-b, axis=-1, kind="stable")[..., :k]
    common = (top_a[..., :, None] == top_b[..., None, :]).any(axis=-1).sum(axis=-1)
    return common / k


def top1_agrees(reference: Any, candidate: Any, margin: Any) -> np.ndarray:
    """Per token: the candidate's logit of the reference's top-1 token is within `margin` of the
    candidate's largest logit (an argmax that differs only by a near-tie agrees).

    Args:
      reference, candidate: ``(..., vocab)`` logits of one shape.
      margin: ``>= 0``, a scalar or one per token (shape ``reference.shape[:-1]``).

    Example:
      >>> top1_agrees(np.array([[1.0, 0.999]]), np.array([[0.999, 1.0]]), 0.01)
      array([ True])
    """
    a, b = _same_shape(reference, candidate)
    top = np.argmax(a, axis=-1)[..., None]
    picked = np.take_along_axis(b, top, axis=-1)[..., 0]
    return picked >= np.max(b, axis=-1) - np.asarray(margin, np.float64)


# Unit roundoff of the dtypes logits are computed in below float32 (torchao's fp8 recipes:
# float8_e4m3, 3 mantissa bits): 8 of them make a band of 0.5, above the loss bound, so an fp8
# row can fail but never decides a pass.
_ROUNDOFF = {
    "bfloat16": unit_roundoff("bfloat16"),
    "float16": unit_roundoff("float16"),
    "float8": 2.0**-4,
}


def _compute_dtype(run: Mapping[str, Any]) -> str:
    try:
        return get_recipe(run["precision"]).compute_dtype_name
    except ValueError:
        return "float32"


def eval_logit_band(pair: Any, step: int) -> tuple[float, str, str]:
    """``(eps, mode, source)``: the relative logit difference the eval point after `step`
    updates is held to (module docstring), what decides, and where ``eps`` comes from; `pair`
    is the judged pair's context (`parity.verdicts.judge.Pair`: its loss gaps, per-step
    tolerances and final-loss band)."""
    dtype = _compute_dtype(pair.ref)
    rounding = SAFETY * _ROUNDOFF.get(dtype, 0.0)
    step0 = max(step_band(0), rounding)
    if step == 0:
        source = (
            f"step 0: max(fp32 step-0 loss band {fmt_value(step_band(0))}, "
            f"{SAFETY:g} u({dtype}) {fmt_value(rounding)})"
            if rounding
            else f"step 0: the fp32 step-0 loss band {fmt_value(step_band(0))}"
        )
        return step0, "step 0", source
    calibrated = "noise-calibrated" if pair.envelope else "fixed bands"
    if pair.fp32 and pair.gaps:
        last = min(step, len(pair.gaps)) - 1
        return pair.tolerances[last], calibrated, f"the per-step loss tolerance of step {last}"
    eps, _ = pair.final_band()
    if step0 > eps:
        return step0, "fixed bands", f"{SAFETY:g} u({dtype})"
    if eps > TOLERANCES["final_loss_rel"]:
        return eps, calibrated, "k x the self-divergence envelope at the end"
    return eps, "fixed bands", "the final-loss band"


def _points(run: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    return {int(p["step"]): p for p in run.get("eval_logits") or [] if isinstance(p, Mapping)}


def logit_rows(pair: Any) -> list[Row]:
    """The KL and top-1 rows of every eval point both records of a judged pair sampled (module
    docstring).

    Args:
      pair: the pair's context (`parity.verdicts.judge.Pair`): torch's run record ``ref`` (the
        reference of ``KL(ref || cand)``), JAX's ``cand``, and the bands `eval_logit_band` reads.

    Returns:
      Two rows per common eval point (`parity.verdicts.rows.Row`, judged by
      `parity.verdicts.judge`) (step order); [] where either record has no
      ``eval_logits`` (not a language model, or evaluation off).
    """
    mine, theirs = _points(pair.ref), _points(pair.cand)
    rows: list[Row] = []
    for step in sorted(set(mine) & set(theirs)):
        a, b = mine[step], theirs[step]
        prefix = f"eval logits, step {step}"
        if a["positions"] != b["positions"] or a.get("inputs_sha256") != b.get("inputs_sha256"):
            rows.append(
                Row(
                    "logit tokens",
                    check=f"{prefix}: sampled tokens",
                    value="different tokens",
                    tolerance="the same tokens",
                    passed=False,
                    detail="the two records sampled different eval tokens (positions or inputs "
                    "differ): the eval batches are not the same data, so nothing else was compared",
                    mode="exact",
                )
            )
            continue
        rows += _point_rows(prefix, pair, step, a, b)
    return rows


def _point_rows(prefix, pair, step, a, b) -> list[Row]:
    z_ref, z_cand = eval_logit_sample(a), eval_logit_sample(b)
    tokens, vocab = z_ref.shape
    eps, mode, source = eval_logit_band(pair, step)
    finite = bool(np.isfinite(z_ref).all() and np.isfinite(z_cand).all())
    ms = np.mean(np.square(z_ref.astype(np.float64)), axis=-1)
    spread = math.log(2 * tokens * vocab)
    mean_tol = 0.5 * eps**2 * float(np.mean(ms))
    max_tol = spread * eps**2 * float(np.max(ms))
    if finite:
        kl = token_kl(z_ref, z_cand)
        mean_kl, max_kl, worst = float(np.mean(kl)), float(np.max(kl)), int(np.argmax(kl))
        top1 = float(np.mean(topk_agreement(z_ref, z_cand, 1)))
        top5 = float(np.mean(topk_agreement(z_ref, z_cand, min(TOLERANCES["top_k"], vocab))))
        margin = 2 * math.sqrt(2 * spread) * eps * np.sqrt(ms)
        agrees = top1_agrees(z_ref, z_cand, margin)
    else:
        mean_kl = max_kl = math.inf
        worst, top1, top5, agrees = 0, 0.0, 0.0, np.zeros(tokens, bool)
    kl_passed: bool | None = mean_kl <= mean_tol and max_kl <= max_tol
    top_passed: bool | None = bool(agrees.all())
    # Past the chaos step, uncalibrated, a failure is excused as the loss rows' are (qualifier
    # "uncalibrated chaos"); above the loss bound a pass has no power (qualifier "no power").
    uncalibrated = mode == "fixed bands" and step > TOLERANCES["chaos_step"] and pair.fp32
    where = (
        f"{tokens} tokens of the first eval batch x vocab {vocab}, eval mode, after {step} "
        f"update(s); eps {fmt_value(eps)} ({source}): could detect a relative logit difference "
        f"of {fmt_value(eps)} spread over the vocabulary"
    )

    kl_detail = (
        f"KL mean {fmt_value(mean_kl, LOSS_UNIT)} against eps^2 mean(z^2) / 2 = "
        f"{fmt_value(mean_tol, LOSS_UNIT)}; max {fmt_value(max_kl, LOSS_UNIT)} (token {worst}) "
        f"against ln(2NV) eps^2 max(z^2) = {fmt_value(max_tol, LOSS_UNIT)}; {where}"
    )
    disagree = int(np.sum(~agrees))
    top_detail = (
        f"top-1 agreement {top1:.3f}, top-{min(TOLERANCES['top_k'], vocab)} overlap {top5:.3f}; "
        + (
            f"{disagree} token(s) whose top-1 differs by more than a near-tie "
            "(2 sqrt(2 ln(2NV)) eps rms(z) of the largest logit)"
            if disagree
            else "every top-1 agrees up to near-ties within 2 sqrt(2 ln(2NV)) eps rms(z)"
        )
        + f"; {where}"
    )
    return [
        Row(
            "logit kl",
            check=f"{prefix}: per-token KL(torch || jax)",
            value=mean_kl,
            tolerance=mean_tol,
            passed=kl_passed,
            detail=kl_detail,
            mode=mode,
            absolute=max_kl,
            unit=LOSS_UNIT,
            power=eps,
            split_at_chaos=uncalibrated,
        ),
        Row(
            "logit top1",
            check=f"{prefix}: top-1 agreement",
            value=top1,
            tolerance="1 up to near-ties",
            passed=top_passed,
            detail=top_detail,
            mode=mode,
            power=eps,
            split_at_chaos=uncalibrated,
        ),
    ]
