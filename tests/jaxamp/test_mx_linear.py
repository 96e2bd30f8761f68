"""jaxamp.mx recipes and the block-scaled linear layer: forward and both gradients against torchao's
emulated ``mx_mm`` (the op behind ``MXFP8Linear`` / ``MXFP8TrainingOpConfig``), refusals, and the
library flow (convert, module filters, report, autocast, loss_scaled skips, checkpoints)."""

import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
import jaxamp.mx as mx
from jaxamp.mx import _linear

torch = pytest.importorskip("torch")
mxfp8_linear = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")
kernel_pref = pytest.importorskip("torchao.quantization.quantize_.common.kernel_preference")

DN_XW = (((1,), (0,)), ((), ()))
F32_EPS = float(np.finfo(np.float32).eps)


def _emu(name, **kw):
    return mx.get_recipe(name, emulate=True, **kw)


# --- recipes as data ---------------------------------------------------------------------------


def test_recipes_are_torchaos_configurations():
    r = mx.get_recipe("mxfp8")
    assert {f.name for f, _ in r.operands().values()} == {"mxfp8"}
    assert {f.scale_mode for f, _ in r.operands().values()} == {"rceil"}  # MXFP8TrainingOpConfig
    assert [axis for _, axis in r.operands().values()] == ["K", "K", "N", "N", "M", "M"]
    assert mx.get_recipe("mxfp8_floor").weight_for_grad_input.scale_mode == "floor"
    assert mx.get_recipe("mxfp8_wgrad_with_hp").grad_weight_hp
    assert mx.get_recipe("mxfp4").input.element == "e2m1"
    assert mx.get_recipe("mxfp8", scale_mode="even").grad_output.scale_mode == "even"
    assert not r.emulate and _emu("mxfp8").emulate
    custom = mx.Recipe("mine", "mxfp8", "mxfp8", mx.get_format("mxfp8_e5m2"))
    assert custom.grad_output_for_grad_weight.element == "e5m2"  # the partner's format
    assert "grad_weight=high precision" in mx.get_recipe("mxfp8_wgrad_with_hp").describe()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mx.get_recipe("mxfp9"), "Did you mean 'mxfp8'"),
        (lambda: mx.get_recipe("mxfp8", scale_mode="rciel"), "Did you mean 'rceil'"),
        (lambda: mx.Recipe("r", "mxfp8", "nvfp4"), "block sizes 32 \\(input\\) and 16"),
        (lambda: mx.Recipe("r", input=3), "must be a jaxamp.mx.Format"),
        (lambda: mx.get_recipe("mxfp8", emulate=1), "emulate must be a bool"),
    ],
)
def test_recipe_bad_input(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_recipe_is_plain_data_for_checkpoints():
    r = _emu("mxfp4_floor")
    assert pickle.loads(pickle.dumps(r)) == r and hash(r) == hash(_emu("mxfp4_floor"))


# --- against torchao's emulated training op -----------------------------------------------------


def _torchao_mm(x, w, gy, rec, dtype=torch.float32):
    """torchao's mx_mm (EMULATED): output and the gradients of input and weight (torch layout)."""
    elem = torch.float8_e4m3fn if rec.input.element == "e4m3" else torch.float4_e2m1fn_x2
    tx = torch.tensor(x).to(dtype).requires_grad_(True)
    tw = torch.tensor(w).to(dtype).requires_grad_(True)
    y = mxfp8_linear.mx_mm.apply(
        tx,
        tw,
        elem,
        elem,
        elem,
        32,
        kernel_pref.KernelPreference.EMULATED,
        mx_config.MXFP8Dim0CastKernelChoice.TORCH,
        mx_config.MXFP8Dim1CastKernelChoice.TORCH,
        mx_config.ScaleCalculationMode(rec.input.scale_mode),
        rec.grad_weight_hp,
    )
    y.backward(torch.tensor(gy).to(dtype))
    return [t.float().numpy() for t in (y.detach(), tx.grad, tw.grad)]


def _jax_mm(x, w_torch, gy, rec, jit=True):
    f = lambda a, b: mx.dot_general(a, b, DN_XW, recipe=rec)  # noqa: E731
    y, vjp = jax.vjp(jax.jit(f) if jit else f, x, w_torch.T)
    gx, gw = vjp(gy)
    return [np.asarray(y, np.float32), np.asarray(gx, np.float32), np.asarray(gw, np.float32).T]


def _mm_and_grads(x, w_torch, gy, rec):
    """Output and the gradients of input and weight (torch layout) of the mx matmul, traced."""
    y, vjp = jax.vjp(lambda a, b: mx.dot_general(a, b, DN_XW, recipe=rec), x, w_torch.T)
    gx, gw = vjp(gy)
    return y, gx, gw.T


@functools.cache
def _every_recipe_on_data():
    """{recipe name: [output, grad_input, grad_weight]} (float32 numpy, torch layout) on
    `_data()` for every recipe, and under "bfloat16" mxfp8's on `_data(seed=2)` in bfloat16: one
    jitted program for all (each its own computation; one XLA compile instead of two per
    recipe), shared by the tests."""
    bf16 = tuple(jnp.asarray(a, jnp.bfloat16) for a in _data(seed=2))

    def each(data, bf16):
        runs = {n: _mm_and_grads(*data, _emu(n)) for n in mx.RECIPE_NAMES}
        return {**runs, "bfloat16": _mm_and_grads(*bf16, _emu("mxfp8"))}

    runs = jax.jit(each)(_data(), bf16)
    return {n: [np.asarray(a, np.float32) for a in out] for n, out in runs.items()}


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _data(m=64, k=96, n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 5] *= 40.0  # an outlier feature: blocks of very different scales
    w = (rng.standard_normal((n, k)) * 0.2).astype(np.float32)
    gy = rng.standard_normal((m, n)).astype(np.float32) * np.float32(1e-3)
    return x, w, gy


@pytest.mark.parametrize("name", mx.RECIPE_NAMES)
def test_linear_forward_and_gradients_match_torchao(name):
    rec = _emu(name)
    x, w, gy = _data()
    ours = _every_recipe_on_data()[name]  # under jit, as a training step runs it
    theirs = _torchao_mm(x, w, gy, rec)
    for what, a, b in zip(("output", "grad_input", "grad_weight"), ours, theirs, strict=True):
        # identical quantized operands; float32 matmuls summed in another order
        assert _rel(a, b) <= 4 * F32_EPS, f"{name} {what}: {_rel(a, b):.3g}"


def test_linear_eager_equals_compiled():
    # eagerly (op by op; jaxamp's bit helpers a program each): the forward matmul
    rec = _emu("mxfp8_floor")
    x, w, _ = _data(m=32, k=32, n=32, seed=1)
    f = lambda a, b: mx.dot_general(a, b, DN_XW, recipe=rec)  # noqa: E731
    np.testing.assert_array_equal(f(x, w.T), jax.jit(f)(x, w.T))


def test_linear_bfloat16_matches_torchao():
    rec = _emu("mxfp8")
    x, w, gy = _data(seed=2)
    ours = _every_recipe_on_data()["bfloat16"]  # mxfp8 on these operands rounded to bfloat16
    theirs = _torchao_mm(x, w, gy, rec, torch.bfloat16)
    for a, b in zip(ours, theirs, strict=True):
        assert _rel(a, b) <= 2.0**-8  # one bfloat16 rounding of the float32 sums


LINEAR_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


@functools.cache
def _linear_dtypes_runs():
    """{dtype: (output, grad_input, grad_weight in torch layout)} of the mxfp8 matmul on operands
    in each float dtype: one jitted program for the three (each its own computation)."""
    rec = _emu("mxfp8")
    x, w, gy = _data(m=32, k=32, n=32, seed=3)
    inputs = [tuple(jnp.asarray(a, d) for a in (x, w, gy)) for d in LINEAR_DTYPES]
    runs = jax.jit(lambda inputs: [_mm_and_grads(*a, rec) for a in inputs])(inputs)
    return dict(zip(LINEAR_DTYPES, runs, strict=True))


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_linear_dtypes(dtype):
    rec = _emu("mxfp8")
    x, w, gy = _data(m=32, k=32, n=32, seed=3)
    y, gx, gw_torch = _linear_dtypes_runs()[dtype]
    gw = gw_torch.T
    assert y.dtype == gx.dtype == gw.dtype == dtype
    ref = _jax_mm(
        np.asarray(jnp.asarray(x, dtype), np.float32), np.asarray(jnp.asarray(w, dtype), np.float32),
        np.asarray(jnp.asarray(gy, dtype), np.float32), rec,
    )  # fmt: skip
    tol = float(jnp.finfo(dtype).eps)
    for a, b in zip((y, gx, gw.T), ref, strict=True):
        assert _rel(np.asarray(a, np.float32), b) <= tol


def test_planted_wrong_block_axis_or_mode_is_caught():
    # the comparison above has power: blocking the weight along N in the forward matmul, or
    # FLOOR scales where torchao ran RCEIL, moves the output far beyond float32 rounding
    rec = _emu("mxfp8")
    x, w, gy = _data()
    theirs = _torchao_mm(x, w, gy, rec)[0]
    # FLOOR scales: the mxfp8_floor recipe's operands (its output from the shared program)
    assert rec.with_scale_mode("floor").operands() == _emu("mxfp8_floor").operands()
    wrong_mode = _every_recipe_on_data()["mxfp8_floor"][0]
    # blocks along N: the wrong axis
    wrong_axis = x @ np.asarray(
        jax.jit(
            lambda a: mx.from_block_scaled(
                *mx.to_block_scaled(a, rec.weight, axis=1), rec.weight, axis=1
            )
        )(w.T)
    )
    assert _rel(wrong_mode, theirs) > 1e-3 and _rel(wrong_axis, theirs) > 1e-3


# --- refusals ----------------------------------------------------------------------------------


def test_refuses_shapes_torchao_cannot_block():
    rec = _emu("mxfp8")
    with pytest.raises(ValueError, match="K \\(input features\\) is 48, not a multiple of the 32"):
        mx.dot_general(jnp.ones((32, 48)), jnp.ones((48, 32)), DN_XW, recipe=rec)
    with pytest.raises(ValueError, match="M \\(rows of the input\\) is 8"):
        mx.dot_general(jnp.ones((8, 32)), jnp.ones((32, 32)), DN_XW, recipe=rec)
    # grad_weight in high precision: the batch need not be a multiple of 32
    hp = _emu("mxfp8_wgrad_with_hp")
    out = jax.eval_shape(
        lambda a, b: mx.dot_general(a, b, DN_XW, recipe=hp), jnp.ones((8, 32)), jnp.ones((32, 32))
    )
    assert out.shape == (8, 32)
    with pytest.raises(ValueError, match="batch dimensions"):
        mx.dot_general(
            jnp.ones((2, 32, 32)), jnp.ones((2, 32, 32)), (((2,), (1,)), ((0,), (0,))), recipe=rec
        )


def test_refuses_hardware_path_where_there_is_none():
    if mx.mx_matmul_hardware() is None:
        pytest.skip("this backend has block-scaled matmuls")
    with pytest.raises(ValueError, match="Pass emulate=True"):
        mx.dot_general(jnp.ones((32, 32)), jnp.ones((32, 32)), DN_XW, recipe="mxfp8")
    with pytest.raises(ValueError, match="Pass emulate=True"):
        mx.convert(lambda x, w: x @ w, "mxfp8")(jnp.ones((32, 32)), jnp.ones((32, 32)))


def test_hardware_path_feeds_scaled_matmul_its_layout(monkeypatch):
    # On sm100+ each matmul is jax.nn.scaled_matmul on (codes, e8m0 scales) blocked along the
    # contraction; traced abstractly here (no lowering on CPU), forward and backward.
    monkeypatch.setattr(_linear, "mx_matmul_hardware", lambda: None)
    rec = mx.get_recipe("mxfp8")
    f = lambda a, b: jnp.sum(mx.dot_general(a, b, DN_XW, recipe=rec))  # noqa: E731
    gx, gw = jax.eval_shape(jax.grad(f, argnums=(0, 1)), jnp.ones((64, 96)), jnp.ones((96, 32)))
    assert (gx.shape, gw.shape) == ((64, 96), (96, 32))
    with pytest.raises(ValueError, match="scaled_matmul runs MXFP8"):
        mx.check_hardware(mx.get_recipe("mxfp4"))


# --- the library flow --------------------------------------------------------------------------


def _mlp(params, x):
    h = jnp.tanh(jax.named_call(lambda a: a @ params["w1"], name="fc1")(x))
    return jax.named_call(lambda a: a @ params["w2"], name="fc2")(h)


def _setup(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.standard_normal((64, 32)) * 0.2, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((32, 32)) * 0.2, jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    return params, x, y


def test_convert_filter_and_report():
    params, x, _ = _setup()
    rec = _emu("mxfp8")
    rows = mx.report(_mlp, params, x, recipe=rec, mx_filter="*fc2*")
    assert [(r.path, r.fp8) for r in rows] == [("fc1", False), ("fc2", True)]
    assert "mxfp8/rceil" in rows[1].how and "emulated" in rows[1].how
    only_fc2 = mx.convert(_mlp, rec, mx_filter="*fc2*")(params, x)
    h = jnp.tanh(x @ params["w1"])
    np.testing.assert_array_equal(only_fc2, mx.dot_general(h, params["w2"], DN_XW, recipe=rec))
    with pytest.raises(ValueError, match="selects none of the function's 2 matmuls"):
        mx.convert(_mlp, rec, mx_filter="decoder/*")(params, x)


def test_autocast_takes_an_mx_recipe():
    params, x, _ = _setup()
    rec = _emu("mxfp8")
    loss = lambda p, x: jnp.sum(_mlp(p, x))  # noqa: E731
    records = []
    hooks = jaxamp._autocast.api.AutocastFp8(rec, None, records)
    assert hooks.recipe is rec
    g = jax.jit(jax.grad(jaxamp.autocast(loss, dtype=jnp.float32, device="cpu", fp8=rec)))(
        params, x
    )
    want = jax.jit(jax.grad(mx.convert(loss, rec)))(params, x)
    jax.tree.map(np.testing.assert_array_equal, g, want)


@pytest.mark.standard_promotion  # optax internals
def test_loss_scaled_low_precision_state_skip_and_checkpoint(tmp_path):
    # mx.convert composes with loss_scaled around optimizer precision (bf16 Adam moments): a
    # non-finite step keeps params and every state bit for bit; a checkpoint of the train state
    # (MX recipes add none) restores to a bit-identical next step.
    ocp = pytest.importorskip("orbax.checkpoint")
    params, x, y = _setup()
    loss = mx.convert(lambda p, x, y: jnp.mean((_mlp(p, x) - y) ** 2), _emu("mxfp8"))
    inner = jaxamp.optim_precision.low_precision_state(optax.adam(1e-2), "bf16")
    tx = jaxamp.loss_scaled(inner, jaxamp.DynamicLossScale.create(init_scale=2.0**4))

    @jax.jit
    def step(params, opt_state, x, y):
        scale = jaxamp.get_loss_scale(opt_state).loss_scale
        grads = jax.grad(lambda p: loss(p, x, y) * scale)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    p1, s1 = step(params, opt_state, x.at[0, 0].set(jnp.nan), y)
    assert not bool(jaxamp.amp_info(s1).last_step_applied)
    jax.tree.map(np.testing.assert_array_equal, p1, params)
    same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)  # noqa: E731
    same(jax.tree.leaves(s1.inner_state), jax.tree.leaves(opt_state.inner_state))
    p2, s2 = step(p1, s1, x, y)
    assert bool(jaxamp.amp_info(s2).last_step_applied)
    assert not np.array_equal(np.asarray(p2["w1"]), np.asarray(p1["w1"]))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", {"params": p2, "opt": s2})
        ckpt.wait_until_finished()
        back = ckpt.restore(tmp_path / "state", {"params": p2, "opt": s2})
    same(step(back["params"], back["opt"], x, y), step(p2, s2, x, y))
