"""jaxamp: torch.amp for JAX — mixed-precision policies, dynamic loss scaling, autocast."""

__all__: list[str] = []
