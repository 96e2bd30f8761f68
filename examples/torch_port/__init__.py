"""Example: torch_port."""
