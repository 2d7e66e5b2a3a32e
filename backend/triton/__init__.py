"""Serving through Triton: server launcher, and the logic behind the model repository's models."""
