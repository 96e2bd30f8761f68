"""Runnable Flax training scripts that use jaxamp (see README.md in this folder)."""
