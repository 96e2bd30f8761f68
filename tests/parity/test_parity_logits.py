"""Eval-logit KL divergence and top-k agreement (`parity.verdicts.logits`), the sample each run
record carries (`parity.core.eval_logits`), and the rows they make: the pure functions
against scipy/torch/numpy references, the bands on records perturbed by known amounts, and a
planted port bug (Flax's causal mask off) caught by the KL row on real runs.

A correct transformer port passing the rows at every precision is checked where every model x
precision is trained (tests/parity/test_parity_train.py::test_every_model_and_precision_runs).
"""

from __future__ import annotations

import copy
import math

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

torch = pytest.importorskip("torch")

from parity.core.config import RunConfig  # noqa: E402
from parity.core.eval_logits import (  # noqa: E402
    EVAL_LOGIT_MIN_TOKENS,
    EVAL_LOGIT_TOKENS,
    eval_logit_point,
    eval_logit_sample,
)
from parity.core.recipes import get_recipe  # noqa: E402
from parity.core.records import ResultsFileError, validate_run  # noqa: E402
from parity.models import get_model_pair  # noqa: E402
from parity.training.train_torch import train_torch  # noqa: E402
from parity.verdicts.judge import Pair, compare_runs  # noqa: E402
from parity.verdicts.logits import logit_rows as pair_logit_rows  # noqa: E402
from parity.verdicts.logits import (  # noqa: E402
    token_kl,
    top1_agrees,
    topk_agreement,
)
from parity.verdicts.outcomes import overall_status  # noqa: E402
from parity.verdicts.tolerance import unit_roundoff  # noqa: E402

pytestmark = [pytest.mark.standard_promotion, pytest.mark.torch]

TINY = {
    "vocab_size": 32,
    "seq_len": 8,
    "d_model": 16,
    "num_heads": 2,
    "num_layers": 1,
    "mlp_ratio": 2,
}
STEPS = 2
DTYPES = (np.float16, jnp.bfloat16, np.float32)


def logit_rows(ref, cand):
    """The logit rows of `ref` (torch) against `cand` (JAX), uncalibrated, before qualifiers."""
    pair = Pair(
        cell=(ref["model"], ref["precision"], ref["device"]),
        ref=ref,
        cand=cand,
        noise=[],
        mains={"torch": ref, "jax": cand},
        seed_refs=[],
        seed_cands=[],
        envelope=None,
        calibrated_by="",
        recipe_checks=get_recipe(ref["precision"]).verdict_checks,
    )
    return pair_logit_rows(pair)


# --- the pure functions ------------------------------------------------------------------------


def _logits(seed, shape=(3, 5, 11), scale=2.0):
    return np.random.default_rng(seed).normal(0.0, scale, shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_kl_matches_scipy_and_torch(dtype):
    a = _logits(0).astype(dtype)
    b = (_logits(0) + 0.3 * _logits(1)).astype(dtype)
    got = token_kl(a, b)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    p, q = special.softmax(a64, axis=-1), special.softmax(b64, axis=-1)
    reference = stats.entropy(p, q, axis=-1)  # sum p log(p / q)
    np.testing.assert_allclose(got, reference, rtol=1e-10, atol=1e-14)
    by_torch = torch.nn.functional.kl_div(
        torch.log_softmax(torch.from_numpy(b64), -1),
        torch.log_softmax(torch.from_numpy(a64), -1),
        reduction="none",
        log_target=True,
    ).sum(-1)
    np.testing.assert_allclose(got, by_torch.numpy(), rtol=1e-10, atol=1e-14)
    assert got.shape == (3, 5) and got.dtype == np.float64 and (got > 0).all()
    assert np.array_equal(token_kl(a, a), np.zeros((3, 5)))


def test_token_kl_resolves_float32_rounding_and_ignores_a_common_shift():
    a = _logits(2, (4, 64)).astype(np.float32)
    # One float32 ulp apart: KL ~1e-14, measured to 1e-6 relative (summing p log(p / q), as
    # scipy's entropy does, is off by ~3% here): its second-order expansion Var_p(b - a) / 2 is exact
    # up to third-order terms (~1e-21).
    b = np.nextafter(a, np.float32(np.inf))
    p = special.softmax(a.astype(np.float64), -1)
    delta = (b - a).astype(np.float64)
    second_order = 0.5 * ((p * delta**2).sum(-1) - (p * delta).sum(-1) ** 2)
    np.testing.assert_allclose(token_kl(a, b), second_order, rtol=1e-6)
    assert 0 < token_kl(a, b).max() < 1e-12
    a64 = a.astype(np.float64)  # float32 + 7.5 would round: a shift exact in float64
    np.testing.assert_allclose(token_kl(a64, a64 + 7.5), 0.0, atol=1e-25)


def _topk_reference(a, b, k):
    out = np.empty(a.shape[:-1])
    for index in np.ndindex(*a.shape[:-1]):
        top_a = set(sorted(range(a.shape[-1]), key=lambda v: (-a[index][v], v))[:k])
        top_b = set(sorted(range(b.shape[-1]), key=lambda v: (-b[index][v], v))[:k])
        out[index] = len(top_a & top_b) / k
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", (1, 3, 11))
def test_topk_agreement_matches_a_set_reference(dtype, k):
    a = _logits(3).astype(dtype)
    b = (_logits(3) + 1.5 * _logits(4)).astype(dtype)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    got = topk_agreement(a, b, k)
    np.testing.assert_array_equal(got, _topk_reference(a64, b64, k))
    assert np.array_equal(topk_agreement(a, a, k), np.ones((3, 5)))
    if k == 1:
        np.testing.assert_array_equal(got, np.argmax(a64, -1) == np.argmax(b64, -1))
    if k == 11:  # the whole vocabulary: always all in common
        assert (got == 1).all()
    assert 0 < topk_agreement(a, b, 3).mean() < 1  # the sides differ: it can fail


def test_top1_agrees_up_to_the_margin_only():
    a = np.array([[1.0, 0.999, 0.0], [1.0, 0.0, 0.5]])
    b = np.array([[0.999, 1.0, 0.0], [0.0, 1.0, 0.5]])
    assert top1_agrees(a, b, 0.01).tolist() == [True, False]
    assert top1_agrees(a, b, 0.0).tolist() == [False, False]
    assert top1_agrees(a, b, np.array([0.0, 1.0])).tolist() == [False, True]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="shapes differ"):
        token_kl(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"`k` must be an integer in \[1, 3\]"):
        topk_agreement(np.zeros((2, 3)), np.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="vocabulary axis"):
        token_kl(np.float32(1.0), np.float32(1.0))


# --- the record's sample -----------------------------------------------------------------------


def test_eval_logit_point_is_bounded_exact_and_validated():
    logits = _logits(5, (8, 64, 256)).astype(np.float32)
    tokens = np.arange(8 * 64).reshape(8, 64)
    point = eval_logit_point(3, logits, tokens)
    sample = eval_logit_sample(point)
    assert point["step"] == 3 and point["vocab"] == 256
    assert len(point["positions"]) == EVAL_LOGIT_TOKENS == len(set(point["positions"]))
    assert point["positions"][0] == 0 and point["positions"][-1] == 8 * 64 - 1
    np.testing.assert_array_equal(sample, logits.reshape(-1, 256)[point["positions"]])
    assert len(point["logits_b64"]) < 90_000  # 64 KiB of float32 in base64
    # A large vocabulary keeps fewer tokens, never fewer than the minimum.
    wide = eval_logit_point(0, np.zeros((2, 16, 50257), np.float16), np.zeros((2, 16), int))
    assert len(wide["positions"]) == EVAL_LOGIT_MIN_TOKENS
    # Few tokens: every one.
    assert eval_logit_point(0, np.zeros((1, 3, 4)), np.zeros((1, 3), int))["positions"] == [0, 1, 2]
    assert point["inputs_sha256"] != eval_logit_point(3, logits, tokens + 1)["inputs_sha256"]


# --- real runs: a correct torch side, a JAX side with its causal mask off ---------------------


@pytest.fixture(scope="module")
def runs():
    """torch's fp32 record of a correct tiny transformer, and a JAX-side record whose step-0
    eval logits are those of the Flax twin with its causal mask off (the real forward on the
    same initial weights and eval batch; training a JAX side would add ~10 s for nothing the
    verdict reads: tests/parity/test_parity_train.py checks the JAX trainer's records)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    config = RunConfig(
        model="transformer", precision="fp32", steps=STEPS, batch_size=4, model_overrides=TINY
    )
    pair = get_model_pair("transformer", seed=0, **TINY)
    original = fnn.make_causal_mask
    # A module fixture runs outside tests/conftest.py's per-test switch: optax needs standard
    # promotion (its bias correction computes float ** int32).
    try:
        with jax.numpy_dtype_promotion("standard"), pytest.MonkeyPatch.context() as patch:
            torch_run = train_torch(config, pair)
            inputs = pair.make_data(config.stream_seed, config.batch_size).eval_batches()[0][0]
            patch.setattr(fnn, "make_causal_mask", lambda x, **kw: jnp.ones_like(original(x, **kw)))
            logits, _ = pair.flax_apply(pair.torch_to_flax(), jnp.asarray(inputs), train=False)
    finally:
        torch.set_num_threads(previous)
    unmasked = copy.deepcopy(torch_run)
    unmasked["framework"] = "jax"
    unmasked.pop("torch_mode")
    unmasked["eval_logits"] = [eval_logit_point(0, np.asarray(logits, np.float32), inputs)]
    return torch_run, unmasked


def _rows(verdicts, step, what="KL"):
    return [
        v for v in verdicts if v.check.startswith(f"eval logits, step {step}:") and what in v.check
    ]


def test_records_carry_the_eval_points(runs):
    torch_run, unmasked = runs
    validate_run(torch_run)
    validate_run(unmasked)
    assert [p["step"] for p in torch_run["eval_logits"]] == [0, STEPS]
    assert eval_logit_sample(torch_run["eval_logits"][0]).shape == (32, TINY["vocab_size"])
    assert (
        unmasked["eval_logits"][0]["inputs_sha256"] == torch_run["eval_logits"][0]["inputs_sha256"]
    )
    broken = copy.deepcopy(torch_run)
    broken["eval_logits"][1]["logits_b64"] = broken["eval_logits"][1]["logits_b64"][:-8]
    with pytest.raises(ResultsFileError, match=r"eval_logits\[1\]\.logits_b64"):
        validate_run(broken)


def test_causal_mask_off_fails_the_kl_row(runs):
    verdicts = compare_runs(list(runs))
    (kl,) = _rows(verdicts, 0)
    assert kl.passed is False and kl.mode == "step 0", kl
    assert kl.value > 100 * kl.tolerance  # measured ~1.7e-3 nats against 1.6e-9
    assert kl.power == pytest.approx(1e-4) and kl.unit == "nats"
    assert _rows(verdicts, STEPS) == []  # a point only one side has is not compared
    assert overall_status(verdicts) == "FAIL"
    # The same logits at bf16-mixed's step-0 band (8 u(bfloat16)) still fail.
    at_bf16 = [_at(run, "bf16-mixed") for run in runs]
    (kl,) = [v for v in logit_rows(*at_bf16) if "KL" in v.check]
    assert kl.passed is False and kl.power == 8 * unit_roundoff("bfloat16")


def _as_jax(run, precision="fp32", scale=0.0, seed=0, shift=0.0):
    """`run` relabelled as the JAX side of `precision`, its logits moved by a relative
    `scale` of Gaussian noise (normwise per token) and a common `shift`."""
    out = copy.deepcopy(run)
    out["framework"] = "jax"
    out.pop("torch_mode", None)
    rng = np.random.default_rng(seed)
    for point in out["eval_logits"]:
        z = eval_logit_sample(point).astype(np.float64)
        noise = rng.normal(size=z.shape)
        noise *= np.linalg.norm(z, axis=-1, keepdims=True) / np.linalg.norm(
            noise, axis=-1, keepdims=True
        )
        moved = z + scale * noise + shift
        point.update(eval_logit_point(point["step"], moved[None], np.zeros(0)))
        point["positions"] = run["eval_logits"][0]["positions"]
        point["inputs_sha256"] = run["eval_logits"][0]["inputs_sha256"]
    return out


def _at(run, precision):
    out = copy.deepcopy(run)
    out["precision"] = precision
    out["config"] = {**out["config"], "precision": precision}
    return out


@pytest.mark.parametrize(
    ("precision", "passing", "failing"),
    # fp32: rounding ~1e-7 (measured 1.2e-7); a band of 1e-4. Below fp32: bf16-mixed 3e-3
    # measured against 8 u(bfloat16) = 3.1e-2 at step 0 and 5% after; fp16 3.8e-4 against 3.9e-3.
    [("fp32", 1e-6, 1e-3), ("bf16-mixed", 3e-3, 0.2), ("fp16-mixed", 4e-4, 0.2)],
)
def test_bands_pass_rounding_and_fail_a_larger_difference(runs, precision, passing, failing):
    ref = _at(runs[0], precision)
    for scale, expected in ((passing, True), (failing, False)):
        rows = logit_rows(ref, _at(_as_jax(runs[0], scale=scale, shift=3.0), precision))
        kl = [v for v in rows if "KL" in v.check]
        assert [v.passed for v in kl] == [expected, expected], (scale, kl)
        if expected:  # the figures come from the noise: KL ~ scale^2 ms / 2
            assert 0 < kl[0].value < kl[0].tolerance
    # Step 0 holds bf16 to 8 u(bfloat16); after training the final-loss band (5%).
    powers = [v.power for v in rows if "KL" in v.check]
    assert (
        powers
        == {
            "fp32": [1e-4, 1e-4],
            "bf16-mixed": [8 * unit_roundoff("bfloat16"), 0.05],
            "fp16-mixed": [8 * unit_roundoff("float16"), 0.05],
        }[precision]
    )


def test_top1_row_fails_a_moved_argmax_and_forgives_near_ties(runs):
    ref = runs[0]
    same = logit_rows(ref, _as_jax(ref, scale=1e-6))
    assert all(v.passed for v in same)
    swapped = _as_jax(ref)
    for point in swapped["eval_logits"]:
        z = eval_logit_sample(point)
        top = np.argmax(z, -1)
        z[np.arange(len(z)), top] -= 1.0  # every argmax moves by a whole logit
        point["logits_b64"] = eval_logit_point(0, z, np.zeros(0))["logits_b64"]
    rows = [v for v in logit_rows(ref, swapped) if "top-1" in v.check]
    assert [v.passed for v in rows] == [False, False]
    assert all(v.value < 1 for v in rows)


def _judged(ref, cand, kind="logit kl"):
    """The rows of `kind` as the judging pass leaves them (its qualifiers applied)."""
    return [v for v in compare_runs([ref, cand]) if v.kind == kind]


def test_other_tokens_chaos_and_no_logits(runs):
    ref = runs[0]
    other = _as_jax(ref)
    other["eval_logits"][0]["inputs_sha256"] = "0" * 16
    rows = logit_rows(ref, other)
    assert rows[0].check == "eval logits, step 0: sampled tokens" and rows[0].passed is False
    # Past step 30 without calibration a failing fp32 row exceeded its band and is excused
    # (chaos), as the loss rows are; the same difference at step 0 fails.
    long_ref, long_cand = copy.deepcopy(ref), _as_jax(ref, scale=1e-2)
    for run in (long_ref, long_cand):
        run["steps"] = [dict(run["steps"][i % STEPS], step=i) for i in range(40)]
        run["config"] = {**run["config"], "steps": 40}
        run["eval_logits"][1]["step"] = 40
    kl = _judged(long_ref, long_cand)
    assert [v.passed for v in kl] == [False, None] and kl[1].mode == "exceeded"
    assert kl[1].qualified_by == "uncalibrated chaos"  # a noise run decides it (escalation)
    # ... and a row well inside its band there passes: the excuse is for a failure only
    near = copy.deepcopy(long_cand)
    for point, source in zip(near["eval_logits"], long_ref["eval_logits"], strict=True):
        point.update({k: v for k, v in source.items() if k != "step"})
    kl = _judged(long_ref, near)
    assert [v.passed for v in kl] == [True, True], kl
    assert logit_rows({**ref, "eval_logits": None}, ref) == []
    assert math.isfinite(kl[0].value)


def test_fp8_band_can_fail_but_never_decides_a_pass(runs):
    ref = _at(runs[0], "fp8-rowwise")
    close_jax = _at(_as_jax(runs[0], scale=0.01), "fp8-rowwise")
    close = _judged(ref, close_jax) + _judged(ref, close_jax, "logit top1")
    assert all(v.passed is None and v.mode == "inconclusive" for v in close), close
    assert {v.qualified_by for v in close} == {"no power"}
    assert {v.power for v in close} == {0.5}  # 8 roundoffs of float8_e4m3
    far = _judged(ref, _at(_as_jax(runs[0], scale=5.0), "fp8-rowwise"))
    assert [v.passed for v in far] == [False, False]
