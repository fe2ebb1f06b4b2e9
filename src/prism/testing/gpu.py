"""GPU test helpers: give back the memory of engines that are no longer referenced."""

from __future__ import annotations

import gc

import torch


def release_gpu_memory() -> None:
    """Collect unreachable engines (reference cycles keep them alive past `del`), then return the cached
    blocks to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
