"""The program each platform gets, read on any machine: ``jit(f).trace(...).lower(
lowering_platforms=(p,))`` builds XLA:CPU's and XLA:GPU's programs here. The forms are chosen when
the program is lowered for its platform, not from the machine that traces it.

* skip: a branch on XLA:CPU where the step donates (``in_place=True``); on GPU never a runtime
  conditional (XLA:GPU reads a conditional's predicate on the host every step), a select;
* the inf/NaN check: XLA:CPU reduces 16 x 16 blocks of a matrix first; GPU reduces each
  gradient whole, in one reduction (blocks over two non-adjacent axes would be split into two
  reductions with a buffer between them);
* provenance: measured inside the skip branch on CPU, measured and selected on GPU.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

PLATFORMS = ["cpu", "cuda"]
PARAMS = {"w": jnp.ones((32, 48)), "b": jnp.ones((48,))}


def _hlo(fn, *args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text(dialect="hlo")


def _instructions(hlo: str) -> list[tuple[str, str, str, list[str], str]]:
    """(name, type, opcode, operand names, attributes) of every HLO instruction."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)(.*)$", line)
        if m:
            name, typ, op, operands, attrs = m.groups()
            found.append((name, typ, op, [o.strip() for o in operands.split(",")], attrs))
    return found


def _runtime_conditionals(hlo: str) -> int:
    """Conditionals whose predicate is not a constant (`platform_dependent` leaves none)."""
    instructions = _instructions(hlo)
    constants = {name for name, _, op, _, _ in instructions if op == "constant"}
    return sum(
        1
        for _, _, op, operands, _ in instructions
        if op == "conditional" and operands[0] not in constants
    )


def _step(tx):
    return lambda g, s, p: jaxamp.apply_gradients(tx, g, s, p)


@pytest.mark.standard_promotion  # optax's Adam computes float ** int32
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("in_place", [False, True])
def test_skip_form(platform, in_place):
    tx = jaxamp.loss_scaled(optax.adam(1e-3), in_place=in_place)
    hlo = _hlo(_step(tx), PARAMS, tx.init(PARAMS), PARAMS, platform=platform)
    branch = platform == "cpu" and in_place
    assert _runtime_conditionals(hlo) == (1 if branch else 0)


@pytest.mark.standard_promotion
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="reads XLA:CPU's optimised program")
def test_reciprocal_computed_once_per_step():
    """The loss scale's reciprocal on XLA:CPU is computed once per step: after optimisation
    its subnormal form's rounding (one `floor`) appears once whether the step has 2 or 12
    gradient leaves. (As a chain of cheap scalar operations, XLA's fusion copied it into every
    fusion that reads the reciprocal, about two per leaf.)"""
    tx = jaxamp.loss_scaled(optax.adam(1e-3))
    for leaves in (2, 12):
        params = {f"w{i}": jnp.ones((16, 8 + i)) for i in range(leaves)}
        grads = jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), params)
        compiled = jax.jit(_step(tx)).lower(grads, tx.init(params), params).compile().as_text()
        floors = len(re.findall(r" floor\(", compiled))
        assert floors == 1, (leaves, floors)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize(
    ("shape", "blocks"),
    [((32, 48), (2, 16, 3, 16)), ((3, 64, 16), (3, 4, 16, 1, 16)), ((24, 10), (3, 8, 5, 2))],
)
def test_check_shape(platform, shape, blocks):
    """The first integer maximum over a gradient: 16 x 16 blocks on CPU (the same cache lines
    whichever way XLA:CPU stores the gradient), every element at once on GPU."""
    grads = {"w": jnp.ones(shape, jnp.float32)}
    instructions = _instructions(_hlo(jaxamp.all_finite, grads, platform=platform))
    types = {name: typ for name, typ, _, _, _ in instructions}
    reduces = [
        (types[operands[0]], attrs)
        for _, typ, op, operands, attrs in instructions
        if op == "reduce" and typ.startswith("u32")
    ]
    assert reduces, "no integer maximum: the check was not built from the bits"
    operand, attrs = reduces[0]
    dims = [int(d) for d in re.search(r"dimensions=\{([\d,]*)\}", attrs).group(1).split(",")]
    if platform == "cpu":
        assert operand.startswith(f"u32[{','.join(map(str, blocks))}]")
        assert dims == [len(blocks) - 3, len(blocks) - 1]
    else:
        assert len(reduces) == 1 and operand.startswith(f"u32[{','.join(map(str, shape))}]")
        assert dims == list(range(len(shape)))


@pytest.mark.standard_promotion
@pytest.mark.parametrize("platform", PLATFORMS)
def test_provenance_form(platform):
    tx = jaxamp.loss_scaled(optax.sgd(0.1), provenance=True)
    hlo = _hlo(tx.update, PARAMS, tx.init(PARAMS), PARAMS, platform=platform)
    assert _runtime_conditionals(hlo) == (1 if platform == "cpu" else 0)


@pytest.mark.parametrize("shape", [(5,), (32, 48), (3, 64, 16), (24, 10)])
def test_both_check_shapes_give_the_same_answer(shape, float_dtype):
    """The GPU form run here (the CPU machine lowers its own branch): the same largest
    magnitude, inf/NaN included, as the block form."""
    from jaxamp._numerics import _largest_at_once, _largest_in_blocks

    rng = np.random.default_rng(0)
    x = rng.normal(size=shape) * 100
    for bad in (None, np.inf, -np.inf, np.nan):
        y = x.copy()
        if bad is not None:
            y.flat[y.size // 2] = bad
        y = jnp.asarray(y, float_dtype)
        a, b = jax.jit(_largest_at_once)(y), jax.jit(_largest_in_blocks)(y)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), (shape, bad)


def test_divide_gpu_form_is_ieee_division():
    """`jaxamp._numerics.divide` off CPU divides the significands as integers (XLA:GPU's float32
    division is PTX div.full, up to 2 ulps off): that form, run here, is numpy's IEEE quotient
    bit for bit wherever operands and quotient are normal (and for 0, inf and NaN)."""
    from jaxamp._numerics import _divide_by_integers

    rng = np.random.default_rng(1)

    def draw(n):
        v = (rng.uniform(1.0, 2.0, n) * np.exp2(rng.integers(-126, 128, n).astype(float))).astype(
            np.float32
        )
        return np.where(rng.random(n) < 0.5, -v, v).astype(np.float32)

    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, 448.0, 255.0, 6.0, 3e38])
    a = np.concatenate([draw(20000), np.repeat(special, special.size)])
    b = np.concatenate([draw(20000), np.tile(special, special.size)])
    with np.errstate(all="ignore"):
        want = a / b
    got = np.asarray(jax.jit(_divide_by_integers)(jnp.asarray(a), jnp.asarray(b)))
    tiny = np.finfo(np.float32).tiny
    normal = (np.abs(want) >= tiny) | (want == 0) | ~np.isfinite(want)  # CPU flushes the rest
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same[normal].all(), (a[~same & normal][:3], b[~same & normal][:3])
