"""Example: image_classifier."""
