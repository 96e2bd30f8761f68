"""Test configuration: 8 host devices, strict dtype promotion, warnings as errors (pyproject)."""

import os

# Must happen before jax is imported anywhere: multi-device tests run on 8 virtual CPU devices.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# As `python -m parity` does: torch's OpenMP threads sleep instead of spinning against XLA's pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

# Implicit promotions (e.g. f16 * f32 -> f32) hide precision bugs: make them errors in tests.
# jaxamp's own code must run under strict promotion. optax and flax internals do not (e.g.
# optax's bias correction computes float ** int32), so tests that run them carry the marker
# `standard_promotion`, which switches back to JAX's default for that test only.
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield


FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def float_dtype(request):
    """Each low/full precision float dtype in turn."""
    return jnp.dtype(request.param)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Run a function as is, then under jax.jit."""
    return jax.jit if request.param else (lambda f, **kw: f)
