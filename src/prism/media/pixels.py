"""An image's pixels kept as its resized uint8 frame until the device that encodes them.

Owns: where an image's patches are made and normalized. The preprocessing cache holds the resized image as it
is (uint8 [H, W, C], one frame; or [H, W, C + 1] with a padding byte after each pixel's levels, the layout images
are kept in, `pil_pixels.rgb0_frame`) beside the patch geometry and HF's normalization as a 256-level table per
channel (`image.normalize_table`; its rows say how many channels there are). `normalized(device)` copies the frame
to `device`, looks each level up in the table, repeats the values over the temporal patch and cuts them into
patches in HF's order (`patchify_frame`), all there: on the GPU right before the patch embedding, or on the CPU for
callers that want float32 `pixel_values` (HF comparisons). A reshape and a table lookup are bitwise the same
wherever they run.

Why the frame and not the patches: patchifying on the host moved every byte through a strided gather into a
new buffer twice the image's size (the temporal repeat), 0.5-4 ms per 448x448 image on the CPU machine, most
of an 8-image request's preparation; the frame (4 bytes a pixel) is also two thirds of the bytes of uint8 patches
(and a sixth of float32 ones) in the cache, in tensor-parallel payloads and through the host-to-device copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops.host_copy import concatenated_on, to_device
from .errors import MediaError


def patchify_frame(frame: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int) -> torch.Tensor:
    """uint8 [H, W, C] -> [gh*gw, C*T*p*p] on the frame's device: the frame repeated T times, rows in merge-window
    order (gh/m, gw/m, m, m), columns channel-major (C, T, p, p), as `image.patchify` orders them."""
    height, width, channels = frame.shape
    t, p, m = temporal_patch_size, patch_size, merge_size
    gh, gw = height // p, width // p
    x = frame.unsqueeze(0).expand(t, height, width, channels)
    x = x.reshape(t, gh // m, m, p, gw // m, m, p, channels).permute(1, 4, 2, 5, 7, 0, 3, 6)
    return x.reshape(gh * gw, channels * t * p * p)


@dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class PatchPixels:
    frame: torch.Tensor  # uint8 [H, W, C] or [H, W, C + 1] (a padding byte per pixel): the image after smart resize
    table: torch.Tensor  # float32 [C, 256]: the normalized value of every level of every channel
    patch_size: int
    merge_size: int
    temporal_patch_size: int

    def __post_init__(self) -> None:
        if self.frame.dtype != torch.uint8 or self.frame.dim() != 3:
            raise MediaError(f"the frame must be uint8 [H, W, C], got {self.frame.dtype} {tuple(self.frame.shape)}")
        height, width, stored = self.frame.shape
        side = self.patch_size * self.merge_size
        if min(self.patch_size, self.merge_size, self.temporal_patch_size) < 1 or height % side or width % side:
            raise MediaError(f"a {height}x{width} frame is not cut into {self.patch_size}-pixel patches merged "
                             f"{self.merge_size}x{self.merge_size}")
        if self.table.dim() != 2 or self.table.shape[1] != 256 or stored - self.table.shape[0] not in (0, 1):
            raise MediaError(f"table {tuple(self.table.shape)} does not fit a frame of {stored} bytes a pixel "
                             "(the table's channels, then at most one padding byte)")

    @property
    def channels(self) -> int:
        return self.table.shape[0]

    @property
    def shape(self) -> torch.Size:
        """The patches' shape [gh*gw, C*T*p*p], without making them."""
        height, width, _ = self.frame.shape
        p = self.patch_size
        return torch.Size(((height // p) * (width // p), self.channels * self.temporal_patch_size * p * p))

    @property
    def nbytes(self) -> int:
        return self.frame.numel() + self.table.numel() * self.table.element_size()

    @property
    def patches(self) -> torch.Tensor:
        """uint8 [gh*gw, C*T*p*p] where the frame is (made on each access)."""
        return patchify_frame(self.frame[..., : self.channels], self.patch_size, self.merge_size,
                              self.temporal_patch_size)

    def normalized(self, device: torch.device | str | None = None) -> torch.Tensor:
        """float32 [gh*gw, C*T*p*p] on `device` (default: where the frame is)."""
        frame = self.frame if device is None else to_device(self.frame, device)
        values = _looked_up(frame[..., : self.channels], self.table, torch.float32)
        return patchify_frame(values, self.patch_size, self.merge_size, self.temporal_patch_size)


def _looked_up(levels: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 levels [..., C] (where they are) -> each one's value in its channel's row of host `table` [C, 256],
    as `dtype` (the table cast first: each level rounded once, as its float32 value would be). The lookup is per
    element, so it commutes with cutting into patches, and it runs over a frame once instead of over its
    temporal repeats."""
    values = to_device(table, levels.device).to(dtype).flatten()
    channel_base = torch.arange(table.shape[0], device=levels.device) * 256
    return values[levels.to(torch.int64) + channel_base]


def batch_pixels_on(items: Sequence[PatchPixels | torch.Tensor], device: torch.device | str,
                    dtype: torch.dtype) -> torch.Tensor:
    """The pixel values of `items` (images' frames, videos' float32 patches) concatenated in order, as `dtype` on
    `device`: what the vision encoder takes for one batch. Bitwise `torch.cat([pixels_on(p) ...]).to(dtype)`.

    When every item is an image and they share one normalization table and frame layout (every image of a
    checkpoint), they go to the device together: one staging buffer and one copy for all their frames (and one
    for the table), one table lookup over all their levels (in `dtype`: each level rounded once, as the float32
    value would be), then each cut into patches. One upload per image cost the engine's thread ~0.5 ms per image
    while the device waited (W1: ~4 ms before the encoder's first kernel)."""
    images = [p for p in items if isinstance(p, PatchPixels)]
    table = images[0].table if images else None
    stored = images[0].frame.shape[2] if images else None
    if not images or len(images) != len(items) or any(
            p.frame.shape[2] != stored or (p.table is not table and not _same_bits(p.table, table)) for p in images):
        return torch.cat([pixels_on(p, device) for p in items]).to(dtype)
    channels = table.shape[0]
    levels = concatenated_on([p.frame for p in images], device).view(-1, stored)[:, :channels]
    values = _looked_up(levels, table, dtype)
    out, offset = [], 0
    for p in images:
        height, width, _ = p.frame.shape
        frame = values[offset : offset + height * width].view(height, width, channels)
        out.append(patchify_frame(frame, p.patch_size, p.merge_size, p.temporal_patch_size))
        offset += height * width
    return torch.cat(out)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (`torch.equal` calls -0.0 and 0.0 equal, which normalize to different bits)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def pixels_on(pixels: PatchPixels | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """float32 pixel values on `device`, from an image's frame (`PatchPixels`) or a video's float32 patches."""
    if isinstance(pixels, PatchPixels):
        return pixels.normalized(device)
    return to_device(pixels, device)
