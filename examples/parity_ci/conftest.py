"""The example project's pytest set-up: the `trains_like` fixture from parity's pytest API."""

from parity.testing import trains_like  # noqa: F401
