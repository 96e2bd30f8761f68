"""autocast against torch.autocast("cpu"): output dtypes equal, values within bf16/fp16 tolerance."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._autocast import oplists as _oplists

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = pytest.mark.torch

DTYPES = {
    "bfloat16": (jnp.bfloat16, torch.bfloat16, 3e-2),
    "float16": (jnp.float16, torch.float16, 4e-3),
}

rng = np.random.default_rng(0)
# Tiny shapes: torch fp16 matmul on this CPU has no fast kernel.
X = rng.standard_normal((4, 8)).astype(np.float32)
W = (rng.standard_normal((8, 6)) / 3).astype(np.float32)
B = rng.standard_normal((6,)).astype(np.float32)
Y = rng.standard_normal((4, 6)).astype(np.float32)
LABELS = np.array([0, 3, 5, 1], dtype=np.int32)
IMG = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)  # NCHW
KER = (rng.standard_normal((4, 3, 3, 3)) / 3).astype(np.float32)  # OIHW
BATCH = rng.standard_normal((3, 4, 8)).astype(np.float32)
BATCH2 = rng.standard_normal((3, 8, 5)).astype(np.float32)
LN_W = (1 + rng.standard_normal((6,)) / 10).astype(np.float32)
LN_B = (rng.standard_normal((6,)) / 10).astype(np.float32)


def _t(a):
    return torch.from_numpy(np.asarray(a))


def _hand_ln_jax(h, w, b, eps=1e-5):
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    return (h - mean) * lax_rsqrt(var + eps) * w + b


def lax_rsqrt(x):
    return jax.lax.rsqrt(x)


def _hand_ln_torch(h, w, b, eps=1e-5):
    mean = h.mean(-1, keepdim=True)
    var = ((h - mean) ** 2).mean(-1, keepdim=True)
    return (h - mean) * torch.rsqrt(var + eps) * w + b


def _flax_ln(h):
    params = {"params": {"scale": jnp.asarray(LN_W), "bias": jnp.asarray(LN_B)}}
    return nn.LayerNorm(epsilon=1e-5).apply(params, h)


def _flax_conv(img, ker):
    x = jnp.transpose(img, (0, 2, 3, 1))
    params = {"params": {"kernel": jnp.transpose(ker, (2, 3, 1, 0))}}
    y = nn.Conv(4, (3, 3), padding="VALID", use_bias=False).apply(params, x)
    return jnp.transpose(y, (0, 3, 1, 2))


def _flax_dense(x, w, b):
    return nn.Dense(6).apply({"params": {"kernel": w, "bias": b}}, x)


# name -> (jax fn, torch fn, args); args are float32 numpy arrays (int labels stay int).
CASES = {
    "matmul": (lambda x, w: x @ w, lambda x, w: x @ w, (X, W)),
    "linear": (_flax_dense, lambda x, w, b: F.linear(x, w.T, b), (X, W, B)),
    "conv": (_flax_conv, lambda i, k: F.conv2d(i, k), (IMG, KER)),
    "bmm": (jnp.matmul, torch.bmm, (BATCH, BATCH2)),
    "einsum": (
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        lambda a, b: torch.einsum("bij,bjk->bik", a, b),
        (BATCH, BATCH2),
    ),
    "softmax": (lambda x, w: jax.nn.softmax(x @ w), lambda x, w: F.softmax(x @ w, -1), (X, W)),
    "log_softmax": (
        lambda x, w: jax.nn.log_softmax(x @ w),
        lambda x, w: F.log_softmax(x @ w, -1),
        (X, W),
    ),
    "layer_norm_flax": (
        lambda x, w: _flax_ln(x @ w),
        lambda x, w: F.layer_norm(x @ w, (6,), _t(LN_W), _t(LN_B), 1e-5),
        (X, W),
    ),
    "layer_norm_hand": (
        lambda x, w: _hand_ln_jax(x @ w, LN_W, LN_B),
        lambda x, w: _hand_ln_torch(x @ w, _t(LN_W), _t(LN_B)),
        (X, W),
    ),
    "gelu": (
        lambda x, w: jax.nn.gelu(x @ w, approximate=False),
        lambda x, w: F.gelu(x @ w),
        (X, W),
    ),
    "exp_log": (
        lambda x, w: jnp.log(jnp.exp(x @ w) + 1.0),
        lambda x, w: torch.log(torch.exp(x @ w) + 1.0),
        (X, W),
    ),
    "sum": (lambda x, w: jnp.sum(x @ w), lambda x, w: (x @ w).sum(), (X, W)),
    "mean": (lambda x, w: jnp.mean(x @ w, axis=0), lambda x, w: (x @ w).mean(0), (X, W)),
    "cumsum": (
        lambda x, w: jnp.cumsum(x @ w, axis=1),
        lambda x, w: torch.cumsum(x @ w, 1),
        (X, W),
    ),
    "mse": (
        lambda x, w, y: optax.squared_error(x @ w, y).mean(),
        lambda x, w, y: F.mse_loss(x @ w, y),
        (X, W, Y),
    ),
    "cross_entropy": (
        lambda x, w, lab: optax.softmax_cross_entropy_with_integer_labels(x @ w, lab).mean(),
        lambda x, w, lab: F.cross_entropy(x @ w, lab.long()),
        (X, W, LABELS),
    ),
}


@functools.cache
def _autocast_jitted():
    """{(case, dtype name): the jitted autocast output} for every case and dtype, all in one
    program (one XLA compile instead of one per case), shared by the jit forms of the tests."""
    every = [(case, name) for case in sorted(CASES) for name in sorted(DTYPES)]

    def run(args):
        return {
            (case, name): jaxamp.autocast(CASES[case][0], dtype=DTYPES[name][0], device="cpu")(
                *args[case]
            )
            for case, name in every
        }

    return jax.jit(run)({case: [jnp.asarray(a) for a in CASES[case][2]] for case in CASES})


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_cpu_autocast(case, dtype_name, maybe_jit):
    jdt, tdt, tol = DTYPES[dtype_name]
    jax_fn, torch_fn, args = CASES[case]
    with torch.autocast("cpu", dtype=tdt):
        expected = torch_fn(*[_t(a) for a in args])
    if maybe_jit is jax.jit:  # every case and dtype in one program
        got = _autocast_jitted()[case, dtype_name]
    else:
        got = jaxamp.autocast(jax_fn, dtype=jdt, device="cpu")(*[jnp.asarray(a) for a in args])
    assert jnp.dtype(got.dtype).name == str(expected.dtype).removeprefix("torch."), case
    scale = max(1.0, float(np.abs(expected.float().numpy()).max()))
    np.testing.assert_allclose(
        np.asarray(got, dtype=np.float32),
        expected.float().numpy(),
        atol=tol * scale * 4,
        rtol=tol * 4,
    )


def test_dtype_trace_diff_with_torch():
    from parity.training.dtype_trace import diff_dtype_traces, torch_dtype_trace

    def jax_fn(x, w, y):
        h = jnp.exp(x @ w)
        return jnp.sum(h * y)

    def torch_fn(x, w, y):
        h = torch.exp(x @ w)
        return (h * y).sum()

    jt = jaxamp.autocast_trace(jax_fn, X, W, Y, device="cpu")
    tt = torch_dtype_trace(torch_fn, _t(X), _t(W), _t(Y), device_type="cpu")
    assert diff_dtype_traces(jt, tt) == []
    # The same program with matmul forced to float32 on the JAX side is named as different.
    jt32 = jaxamp.autocast_trace(jax_fn, X, W, Y, device="cpu", overrides={"dot_general": "fp32"})
    problems = diff_dtype_traces(jt32, tt)
    assert problems and problems[0].startswith("dot_general #0: jax float32, torch bfloat16")


def test_cuda_list_dtypes():
    """No CUDA here: autocast(device="cuda") gives the dtypes the cuda list says."""
    x = jnp.asarray(X)
    w = jnp.asarray(W)

    def run(fn):
        return jnp.dtype(jaxamp.autocast(fn, device="cuda")(x, w).dtype).name

    assert _oplists.CUDA.category("mm") == "lower_precision_fp"
    assert run(lambda x, w: x @ w) == "float16"
    for torch_op, fn in {
        "exp": lambda x, w: jnp.exp(x @ w),
        "log": lambda x, w: jnp.log(jnp.abs(x @ w)),
        "sum": lambda x, w: jnp.sum(x @ w),
        "cumsum": lambda x, w: jnp.cumsum(x @ w),
        "softmax.int": lambda x, w: jax.nn.softmax(x @ w),
        "log_softmax.int": lambda x, w: jax.nn.log_softmax(x @ w),
        "layer_norm": lambda x, w: _flax_ln(x @ w),
        "mse_loss": lambda x, w: optax.squared_error(x @ w, x @ w).mean(),
        "pow": lambda x, w: (x @ w) ** 2,
        "rsqrt": lambda x, w: jax.lax.rsqrt(jnp.abs(x @ w)),
        "logsumexp": lambda x, w: jax.nn.logsumexp(x @ w),
    }.items():
        assert _oplists.CUDA.category(torch_op) in ("fp32", "fp32_set_opt_dtype"), torch_op
        assert run(fn) == "float32", torch_op
    # On no cuda list: keeps the float16 of its input.
    for torch_op, fn in {
        "gelu": lambda x, w: jax.nn.gelu(x @ w),
        "mean": lambda x, w: jnp.mean(x @ w),
        "relu": lambda x, w: jax.nn.relu(x @ w),
    }.items():
        assert _oplists.CUDA.category(torch_op) is None, torch_op
        assert run(fn) == "float16", torch_op
