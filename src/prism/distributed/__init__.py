"""Tensor parallelism and encoder data parallelism (issue 8: not built yet)."""
