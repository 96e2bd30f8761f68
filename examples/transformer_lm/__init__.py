"""Example: transformer_lm."""
