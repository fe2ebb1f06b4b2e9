"""Triton kernels, each beside the plain torch reference that is its spec (ops know nothing of models)."""
