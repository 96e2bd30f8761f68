"""Restore checks what a leaf holds, not only its shape: a checkpoint whose leaves have another
dtype, or whose quantized optimizer state has another format (codes, signedness, block size,
block order), is refused naming the leaf, what the checkpoint holds and what the target expects.
Casting saved codes into another format would restore garbage moments without a word."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxamp.flax import checkpoint as ckpt
from jaxamp.optim_precision import low_precision_state

pytest.importorskip("orbax.checkpoint")

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 512, dtype=jnp.float32).reshape(2, 256)}
TRANSPOSED = np.arange(512).reshape(2, 256).T.reshape(-1)
REVERSED = np.arange(512)[::-1]


def _state(state_format, **kw):
    tx = low_precision_state(optax.adam(1e-3), state_format, min_size=0, **kw)
    state = tx.init(PARAMS)
    grads = {"w": jnp.full((2, 256), 0.01, jnp.float32)}
    with jax.numpy_dtype_promotion("standard"):
        _, state = jax.jit(tx.update)(grads, state, PARAMS)
    return {"params": PARAMS, "opt": state}


@pytest.mark.parametrize(
    ("saved", "target", "expect"),
    [
        ("8bit", "fp8", r"opt/.*mu/w/codes.*uint8.*checkpoint.*float8_e4m3fn"),
        ("fp8", "8bit", r"opt/.*mu/w/codes.*float8_e4m3fn.*checkpoint.*uint8"),
    ],
)
def test_restore_refuses_codes_of_another_dtype(tmp_path, saved, target, expect):
    """8-bit codes into an fp8 target (and back) have equal shapes; restore refused them
    only by shape and cast the codes."""
    ckpt.save(tmp_path, _state(saved), 1)
    with pytest.raises(ValueError, match=expect):
        ckpt.restore(tmp_path, _state(target))


@pytest.mark.parametrize(
    ("saved", "target", "expect"),
    [
        (
            {"block_order": {"w": TRANSPOSED}},
            {"block_order": {"w": REVERSED}},
            r"opt/.*mu/w: .*block order [0-9a-f]+.* in the checkpoint.*block order [0-9a-f]+",
        ),
        ({}, {"unsigned": ()}, r"opt/.*nu/w: 8bit unsigned.* in the checkpoint.*8bit signed"),
    ],
    ids=["block_order", "signedness"],
)
def test_restore_refuses_another_format(tmp_path, saved, target, expect):
    """Same dtypes, same shapes, codes of another format (blocked in another element order,
    or into the other map): refused by format."""
    ckpt.save(tmp_path, _state("8bit", **saved), 1)
    with pytest.raises(ValueError, match=expect):
        ckpt.restore(tmp_path, _state("8bit", **target))


def test_restore_refuses_another_float_dtype(tmp_path):
    """A float32 leaf is not cast into a bfloat16 target (nor the reverse)."""
    ckpt.save(tmp_path, {"w": jnp.ones((2, 3), jnp.float32)}, 1)
    with pytest.raises(ValueError, match=r"leaf w.*float32 in the checkpoint.*bfloat16"):
        ckpt.restore(tmp_path, {"w": jnp.ones((2, 3), jnp.bfloat16)})


def test_restore_of_the_same_format_is_bit_exact(tmp_path):
    state = _state("8bit", block_order={"w": TRANSPOSED})
    ckpt.save(tmp_path, state, 1)
    restored = ckpt.restore(tmp_path, _state("8bit", block_order={"w": TRANSPOSED}))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
