"""Image patches kept as uint8 until the device that encodes them.

Owns: where the normalization of image patches happens. The patches are stored patchified but unnormalized
(uint8, channel-major columns) beside HF's normalization as a 256-level table per channel
(`image.normalize_table`); `normalized(device)` looks the values up where they are used: on the GPU right
before the patch embedding, or on the CPU for callers that want float32 `pixel_values` (HF comparisons).
A table lookup is bitwise the same wherever it runs. The uint8 form is 4x smaller than float32 in the
preprocessing cache, in tensor-parallel payloads and through the host-to-device copy (8 images of 448x448:
9.6 MB instead of 38.5 MB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.host_copy import to_device


@dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class PatchPixels:
    patches: torch.Tensor  # uint8 [rows, C*T*p*p], columns channel-major (see `image.patchify`)
    table: torch.Tensor  # float32 [C, 256]: the normalized value of every level of every channel

    def __post_init__(self) -> None:
        if self.patches.dtype != torch.uint8 or self.patches.dim() != 2:
            raise ValueError(f"patches must be uint8 [rows, cols], got {self.patches.dtype} {tuple(self.patches.shape)}")
        channels = self.table.shape[0]
        if self.table.shape != (channels, 256) or self.patches.shape[1] % channels:
            raise ValueError(f"table {tuple(self.table.shape)} does not fit {self.patches.shape[1]} columns")

    @property
    def shape(self) -> torch.Size:
        return self.patches.shape

    @property
    def nbytes(self) -> int:
        return self.patches.numel() + self.table.numel() * self.table.element_size()

    def normalized(self, device: torch.device | str | None = None) -> torch.Tensor:
        """float32 [rows, cols] on `device` (default: where the patches are)."""
        patches = self.patches if device is None else to_device(self.patches, device)
        table = to_device(self.table, patches.device)
        channels = table.shape[0]
        column_base = torch.arange(channels, device=patches.device).repeat_interleave(patches.shape[1] // channels)
        return table.flatten()[patches.to(torch.int64) + column_base * 256]


def pixels_on(pixels: PatchPixels | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """float32 pixel values on `device`, from uint8 patches (images) or float32 ones (videos)."""
    if isinstance(pixels, PatchPixels):
        return pixels.normalized(device)
    return to_device(pixels, device)
