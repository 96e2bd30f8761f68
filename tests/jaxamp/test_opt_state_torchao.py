"""Low-precision optimizer state against torchao 0.18 itself: the quantization maps, the codes and
scales after a first AdamW8bit / AdamW4bit / AdamWFp8 step (bit for bit), a second step from
torchao's own state (within one code), and the bf16 stochastic rounding of ``_AdamW``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchao_optim = pytest.importorskip("torchao.optim")
quant_utils = pytest.importorskip("torchao.optim.quant_utils")
subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")
subclass_4bit = pytest.importorskip("torchao.optim.subclass_4bit")

from jaxamp import optim_precision  # noqa: E402
from jaxamp.optim_precision import _masters, _qmaps  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.standard_promotion]  # optax internals

# (torchao optimizer, our factory, state format); Linear(64, 64): a 4096-element weight (the
# smallest torchao quantizes) and a 64-element bias (kept unquantized on both sides).
OPTIMIZERS = {
    "8bit": (torchao_optim.AdamW8bit, optim_precision.adamw_8bit),
    "4bit": (torchao_optim.AdamW4bit, optim_precision.adamw_4bit),
    "fp8": (torchao_optim.AdamWFp8, optim_precision.adamw_fp8),
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao's step without torch.compile (its kernels run eagerly: seconds less per test).
    `test_compiled_torchao_gives_the_same_first_step` checks the compiled step agrees."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


def test_quantization_maps_are_torchaos_bit_for_bit():
    tables = {
        "SIGNED_8BIT": subclass_8bit.get_qmap_signed(),
        "UNSIGNED_8BIT": subclass_8bit.get_qmap_unsigned(),
        "SIGNED_4BIT": subclass_4bit.get_qmap_signed(),
        "UNSIGNED_4BIT": subclass_4bit.get_qmap_unsigned(),
    }
    for name, values in tables.items():
        ours = getattr(_qmaps, name)
        theirs = np.asarray(values, dtype=np.float32)
        assert ours.dtype == np.float32 and ours.shape == theirs.shape, name
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), name


def _torch_step(cls, dtype, grads_np, state=None):
    """One torchao step on a Linear(64, 64) whose parameters are all ones; returns its state."""
    lin = torch.nn.Linear(64, 64).to(dtype)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.fill_(1.0)
    opt = cls(lin.parameters())
    if state is not None:  # run one step to create the state, then overwrite it
        lin.weight.grad = torch.zeros_like(lin.weight)
        lin.bias.grad = torch.zeros_like(lin.bias)
        opt.step()
        for param, saved in ((lin.weight, state["weight"]), (lin.bias, state["bias"])):
            for key, value in saved.items():
                target = opt.state[param][key]
                if key == "step":
                    target.fill_(value)
                elif hasattr(target, "codes"):
                    target.codes.copy_(value[0])
                    target.scale.copy_(value[1])
                else:
                    target.copy_(value)
        with torch.no_grad():
            lin.weight.fill_(1.0)
            lin.bias.fill_(1.0)
    lin.weight.grad = torch.from_numpy(grads_np["w"]).to(dtype)
    lin.bias.grad = torch.from_numpy(grads_np["b"]).to(dtype)
    opt.step()
    out = {}
    for name, param in (("weight", lin.weight), ("bias", lin.bias)):
        out[name] = {}
        for key, value in opt.state[param].items():
            if hasattr(value, "codes"):
                out[name][key] = (value.codes.clone(), value.scale.clone())
            else:
                out[name][key] = value.clone()
    out["params"] = (lin.weight.detach().float().numpy(), lin.bias.detach().float().numpy())
    return out


def _codes_bits(codes):
    """Codes as unsigned integers (fp8 codes by their bit pattern), from torch or JAX."""
    if isinstance(codes, torch.Tensor):
        return codes.view(torch.uint8).numpy().reshape(-1).astype(np.int64)
    return np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8)).reshape(-1).astype(np.int64)


def _grads(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 64)).astype(np.float32),
        "b": rng.standard_normal(64).astype(np.float32),
    }


def _jax_step(factory, dtype, grads_np, maybe_jit, state=None):
    # torch's Linear weight is (out, in) and ours is stored the same way here: no transpose.
    params = {"w": jnp.ones((64, 64), dtype), "b": jnp.ones(64, dtype)}
    grads = {k: jnp.asarray(v).astype(dtype) for k, v in grads_np.items()}
    tx = factory()
    if state is None:
        state = tx.init(params)
    updates, state = maybe_jit(tx.update)(grads, state, params)
    return updates, state


@functools.cache
def _first_steps(cases, jitted):
    """{(state format, dtype name): optimizer state} after one step on `_grads(0)` for each case
    in `cases` (see `_jax_step`): under jit every case in one program (one XLA compile for the
    six), shared by the tests."""
    txs, args = {}, {}
    for state_format, dtype_name in cases:
        dtype = jnp.dtype(dtype_name)
        params = {"w": jnp.ones((64, 64), dtype), "b": jnp.ones(64, dtype)}
        grads = {k: jnp.asarray(v).astype(dtype) for k, v in _grads(0).items()}
        tx = txs[state_format, dtype_name] = OPTIMIZERS[state_format][1]()
        args[state_format, dtype_name] = (grads, tx.init(params), params)

    def step(args):
        return {case: txs[case].update(*a)[1] for case, a in args.items()}

    return (jax.jit(step) if jitted else step)(args)


@pytest.mark.usefixtures("eager_torchao")
@pytest.mark.parametrize("dtype_name", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("state_format", sorted(OPTIMIZERS))
def test_first_step_codes_and_scales_equal_torchaos(state_format, dtype_name, maybe_jit):
    torch_cls, _ = OPTIMIZERS[state_format]
    grads = _grads(0)
    theirs = _torch_step(torch_cls, TORCH_DTYPES[dtype_name], grads)
    jitted = maybe_jit is jax.jit
    every = tuple((f, d) for f in sorted(OPTIMIZERS) for d in sorted(TORCH_DTYPES))
    state = _first_steps(every if jitted else ((state_format, dtype_name),), jitted)[
        state_format, dtype_name
    ]
    adam = state.inner_state[0]
    for field, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
        ours = getattr(adam, field)["w"]
        codes, scale = theirs["weight"][key]
        assert (
            isinstance(ours, optim_precision.QuantizedArray) and ours.state_format == state_format
        )
        assert ours.codes.size == codes.numel() and ours.scale.shape == tuple(scale.shape)
        np.testing.assert_array_equal(_codes_bits(ours.codes), _codes_bits(codes), err_msg=field)
        np.testing.assert_array_equal(
            np.asarray(ours.scale).view(np.uint32), scale.numpy().view(np.uint32), err_msg=field
        )
        # The bias (64 elements) stays unquantized on both sides, in the parameter's dtype.
        bias = getattr(adam, field)["b"]
        assert bias.dtype == jnp.dtype(dtype_name)
        np.testing.assert_array_equal(
            np.asarray(bias.astype(jnp.float32)), theirs["bias"][key].float().numpy()
        )


@pytest.mark.usefixtures("eager_torchao")
@pytest.mark.parametrize("state_format", sorted(OPTIMIZERS))
def test_first_step_parameters_match_torchao_within_rounding(state_format):
    torch_cls, factory = OPTIMIZERS[state_format]
    grads = _grads(1)
    theirs = _torch_step(torch_cls, torch.float32, grads)
    updates, _ = _jax_step(factory, jnp.float32, grads, jax.jit)
    ours = 1.0 + np.asarray(updates["w"])
    # Same float32 moments; the two AdamW formulas (eps outside or inside the bias-corrected
    # sqrt, decay folded in or applied first) differ by a few float32 roundings of ~1e-3-sized
    # terms around 1.0: a few ulps of 1.0.
    np.testing.assert_allclose(ours, theirs["params"][0], rtol=0, atol=8 * 2.0**-23)


@pytest.mark.usefixtures("eager_torchao")
@pytest.mark.parametrize("state_format", sorted(OPTIMIZERS))
def test_initial_state_is_torchaos_zeros_and_bends_no_small_gradient(state_format, maybe_jit):
    """torchao starts each state from ``zeros`` (scales 0: exactly zero). Quantizing zeros
    instead clips the scales to 1e-12, and the 4-bit unsigned map holds no zero: the second
    moment would start at 6.25e-14 and move the first update of a 1e-6-sized gradient by ~1e-5
    relative. With exact zeros both sides take the float32 first step."""
    torch_cls, factory = OPTIMIZERS[state_format]
    params = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}
    state = maybe_jit(factory().init)(params)
    for field in ("mu", "nu"):
        stored = getattr(state.inner_state[0], field)["w"]
        assert isinstance(stored, optim_precision.QuantizedArray)
        np.testing.assert_array_equal(np.asarray(stored.scale), 0.0)
        np.testing.assert_array_equal(np.asarray(optim_precision.decode_blockwise(stored)), 0.0)
    grads = {k: v * np.float32(1e-6) for k, v in _grads(2).items()}
    theirs = _torch_step(torch_cls, torch.float32, grads)
    updates, _ = _jax_step(factory, jnp.float32, grads, maybe_jit)
    np.testing.assert_allclose(
        1.0 + np.asarray(updates["w"]), theirs["params"][0], rtol=0, atol=8 * 2.0**-23
    )


@pytest.mark.usefixtures("eager_torchao")
@pytest.mark.parametrize("state_format", sorted(OPTIMIZERS))
def test_second_step_from_torchaos_state_is_within_one_code(state_format):
    """From torchao's own step-1 state, one more step on both sides. optax's EMA
    ``(1 - b) * g + b * m`` and torch's ``lerp`` round differently in the last float32 bit,
    which moves a value across a rounding midpoint only rarely, and then by one code."""
    torch_cls, factory = OPTIMIZERS[state_format]
    first = _torch_step(torch_cls, torch.float32, _grads(2))
    second = _torch_step(torch_cls, torch.float32, _grads(3), state=first)

    params = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}
    tx = factory()
    state = tx.init(params)
    adam = state.inner_state[0]
    loaded = {}
    for field, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
        ours = getattr(adam, field)["w"]
        codes, scale = first["weight"][key]
        codes = jnp.asarray(codes.view(torch.uint8).numpy())
        if state_format == "fp8":
            codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
        codes = codes.reshape(ours.codes.shape)
        weight = optim_precision.QuantizedArray(
            codes,
            jnp.asarray(scale.numpy()),
            ours.state_format,
            ours.signed,
            ours.shape,
            ours.block_size,
        )
        loaded[field] = {"w": weight, "b": jnp.asarray(first["bias"][key].numpy())}
    adam = adam._replace(count=jnp.asarray(1, jnp.int32), **loaded)
    state = optim_precision.LowPrecisionState((adam, *state.inner_state[1:]))
    grads = {k: jnp.asarray(v) for k, v in _grads(3).items()}
    _, state = jax.jit(tx.update)(grads, state, params)

    for field, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
        ours = getattr(state.inner_state[0], field)["w"]
        codes, scale = second["weight"][key]
        ours_scale, their_scale = np.asarray(ours.scale), scale.numpy()
        # A block's scale is its largest |value|: the two formulas' float32 values, a few ulps
        # apart (fp8's scale divides by 448 once more).
        np.testing.assert_allclose(ours_scale, their_scale, rtol=4 * 2.0**-23, atol=0)
        diff = np.abs(_codes_bits(ours.codes) - _codes_bits(codes))
        if state_format == "4bit":  # compare nibbles, not packed bytes
            diff = np.abs(
                np.stack([_codes_bits(ours.codes) >> 4, _codes_bits(ours.codes) & 15])
                - np.stack([_codes_bits(codes) >> 4, _codes_bits(codes) & 15])
            )
        assert diff.max() <= 1, (field, int(diff.max()))
        # ... and only at rounding midpoints: a small fraction of elements.
        assert (diff > 0).mean() < 0.01, (field, float((diff > 0).mean()))


@pytest.mark.slow
@pytest.mark.kernel_class  # inductor vectorises the compiled step for the CPU's vector width
# torch.compile's own deprecations and torchao's caching hint, inside inductor: not ours to fix.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_torchao_gives_the_same_first_step():
    """The first-step comparison above runs torchao eagerly; its compiled step (what users run)
    gives the same codes and scales from zeros, with inductor's AVX-512 kernels and its AVX2
    ones alike."""
    grads = _grads(0)
    theirs = _torch_step(torchao_optim.AdamW8bit, torch.float32, grads)
    _, state = _jax_step(optim_precision.adamw_8bit, jnp.float32, grads, jax.jit)
    for field, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
        ours = getattr(state.inner_state[0], field)["w"]
        codes, scale = theirs["weight"][key]
        np.testing.assert_array_equal(_codes_bits(ours.codes), _codes_bits(codes))
        np.testing.assert_array_equal(np.asarray(ours.scale), scale.numpy())


@pytest.mark.parametrize("maybe_jit_name", ["eager", "jit"])
def test_bf16_stochastic_rounding_equals_torchaos_given_the_same_random_bits(
    monkeypatch, maybe_jit_name
):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4096).astype(np.float32) * np.float32(1e3)
    x[:4] = [0.0, -0.0, np.inf, -np.inf]
    x[4:8] = np.float32(1.0) + np.float32(2.0**-20) * np.arange(4, dtype=np.float32)
    random16 = rng.integers(0, 1 << 16, size=x.shape, dtype=np.int64).astype(np.int32)

    def fake_randint(low, high, size, device=None, dtype=None):
        assert (low, high, tuple(size)) == (0, 1 << 16, x.shape)
        return torch.from_numpy(random16).to(dtype)

    monkeypatch.setattr(torch, "randint", fake_randint)
    theirs = quant_utils._fp32_to_bf16_sr(torch.from_numpy(x)).view(torch.int16).numpy()
    fn = jax.jit(_masters._round_bf16) if maybe_jit_name == "jit" else _masters._round_bf16
    ours = fn(jnp.asarray(x), jnp.asarray(random16.astype(np.uint32)))
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours).view(np.int16), theirs)
    # The bits matter: with other random bits some elements round the other way.
    other = _masters._round_bf16(jnp.asarray(x), jnp.asarray((random16 ^ 0x8000).astype(np.uint32)))
    assert (np.asarray(other).view(np.int16) != theirs).any()


# --- step by step, in torch's element order -----------------------------------------------------
# A Flax kernel is torch's Linear weight transposed. torchao blocks the torch weight row-major;
# blocked in the Flax layout, a block holds other elements under another scale (what the
# harness's adamw-8bit/4bit/fp8 cells did until the state took torch's order). Linear(64, 96):
# a (96, 64) weight of 6144 elements (a multiple of both block sizes).
IN, OUT, STEPS = 64, 96, 3
TORCH_ORDER = np.arange(IN * OUT).reshape(IN, OUT).T.reshape(-1)  # kernel (in, out) -> (out, in)


def _torchao_trajectory(torch_cls, seed=0):
    """torchao's own run: states (codes, scales) and weights before and after each step."""
    rng = np.random.default_rng(seed)
    weight = torch.nn.Parameter(torch.from_numpy(rng.uniform(-1, 1, (OUT, IN)).astype(np.float32)))
    opt = torch_cls([weight])
    steps = []
    for _ in range(STEPS):
        grad = rng.standard_normal((OUT, IN)).astype(np.float32)
        before = weight.detach().numpy().copy()
        state = {
            k: (v.codes.clone(), v.scale.clone())
            for k, v in opt.state[weight].items()
            if hasattr(v, "codes")
        }
        weight.grad = torch.from_numpy(grad)
        opt.step()
        after = {
            k: (v.codes.clone(), v.scale.clone())
            for k, v in opt.state[weight].items()
            if hasattr(v, "codes")
        }
        steps.append((before, grad, state, after, weight.detach().numpy().copy()))
    return steps


def _load(state, field, torch_state):
    """Our state with `field`'s codes and scales replaced by torchao's (torch's order is ours)."""
    adam = state.inner_state[0]
    ours = getattr(adam, field)["w"]
    codes, scale = torch_state
    codes = jnp.asarray(codes.view(torch.uint8).numpy().reshape(ours.codes.shape))
    if ours.state_format == "fp8":
        codes = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    loaded = optim_precision.QuantizedArray(
        codes,
        jnp.asarray(scale.numpy()),
        ours.state_format,
        ours.signed,
        ours.shape,
        ours.block_size,
        ours.order,
    )
    return state._replace(
        inner_state=(adam._replace(**{field: {"w": loaded}}), *state.inner_state[1:])
    )


def _nibbles(bits, state_format):
    return np.stack([bits >> 4, bits & 15]) if state_format == "4bit" else bits


@pytest.mark.usefixtures("eager_torchao")
@pytest.mark.parametrize("state_format", sorted(OPTIMIZERS))
def test_states_and_weights_follow_torchao_step_by_step_in_torch_block_order(
    state_format, maybe_jit
):
    """Each step from torchao's own state and weights, the same gradient on both sides: the
    first step's codes and scales equal torchao's bit for bit; later steps' within one code at
    rounding midpoints (optax's EMA ``(1 - b) * g + b * m`` against torch's fused ``lerp``: one
    float32 rounding apart) and the scales (block maxima) within a few ulps; the weights within
    the few roundings by which the two AdamW formulas differ (8 ulps of 1.0, |w| <= 1). Blocked
    in the Flax layout instead, the codes and scales are another quantization altogether."""
    torch_cls, factory = OPTIMIZERS[state_format]
    trajectory = _torchao_trajectory(torch_cls)
    tx = factory(block_order={"w": TORCH_ORDER})
    update = maybe_jit(tx.update)
    state = tx.init({"w": jnp.zeros((IN, OUT))})
    for step, (before, grad, torch_state, after, weight) in enumerate(trajectory):
        if step:  # torchao's state before this step, its step count
            for field, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
                state = _load(state, field, torch_state[key])
            adam = state.inner_state[0]
            state = state._replace(
                inner_state=(
                    adam._replace(count=jnp.asarray(step, jnp.int32)),
                    *state.inner_state[1:],
                )
            )
        params = {"w": jnp.asarray(before.T)}
        updates, state = update({"w": jnp.asarray(grad.T)}, state, params)
        np.testing.assert_allclose(
            np.asarray(params["w"] + updates["w"]).T,
            weight,
            rtol=0,
            atol=8 * 2.0**-23,
            err_msg=f"weights after step {step}",
        )
        for field, key in (("mu", "exp_avg"), ("nu", "exp_avg_sq")):
            ours = getattr(state.inner_state[0], field)["w"]
            codes, scale = after[key]
            ours_bits = _nibbles(_codes_bits(ours.codes), state_format)
            their_bits = _nibbles(_codes_bits(codes), state_format)
            where = f"{field} after step {step}"
            if step == 0:
                np.testing.assert_array_equal(ours_bits, their_bits, err_msg=where)
                np.testing.assert_array_equal(
                    np.asarray(ours.scale).view(np.uint32),
                    scale.numpy().view(np.uint32),
                    err_msg=where,
                )
                continue
            np.testing.assert_allclose(
                np.asarray(ours.scale), scale.numpy(), rtol=4 * 2.0**-23, atol=0, err_msg=where
            )
            diff = np.abs(ours_bits - their_bits)
            assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (where, int(diff.max()))


@pytest.mark.usefixtures("eager_torchao")
@pytest.mark.parametrize("state_format", sorted(OPTIMIZERS))
def test_blocks_in_the_flax_layout_are_not_torchaos(state_format):
    """The order matters: from zeros, the first step's scales of the transposed kernel blocked
    row-major differ from torchao's (so the step-by-step test above fails without it)."""
    torch_cls, factory = OPTIMIZERS[state_format]
    (before, grad, _, after, _), *_ = _torchao_trajectory(torch_cls)
    for block_order, equal in ((None, False), ({"w": TORCH_ORDER}, True)):
        tx = factory(block_order=block_order)
        _, state = jax.jit(tx.update)(
            {"w": jnp.asarray(grad.T)},
            tx.init({"w": jnp.zeros((IN, OUT))}),
            {"w": jnp.asarray(before.T)},
        )
        ours = np.asarray(state.inner_state[0].mu["w"].scale)
        assert np.array_equal(ours, after["exp_avg"][1].numpy()) is equal, block_order
