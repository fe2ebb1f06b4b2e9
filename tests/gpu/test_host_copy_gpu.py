"""ops/host_copy.py on the GPU: a host tensor reaches the device bitwise, staged in pinned memory by a memcpy (no
torch copy over the intra-op pool), and the caller may change its tensor as soon as `to_device` returns."""

from __future__ import annotations

import pytest
import torch

from prism.ops.host_copy import staged_in_pinned_memory, to_device
from prism.testing.host_reads import host_copies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_to_device_is_bitwise_and_the_source_is_free_at_once(dtype):
    src = (torch.randn(448, 448, 3) * 50).to(dtype)
    want = src.clone()
    torch.cuda._sleep(50_000_000)  # keep the stream busy: the copy is queued behind it, not run yet
    got = to_device(src, "cuda")
    src.view(torch.uint8).fill_(0)  # the staging buffer, not `src`, is what the queued copy reads
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_staging_is_pinned_and_copies_with_no_torch_op():
    frame = torch.randint(0, 256, (448, 448, 3), dtype=torch.uint8)
    assert host_copies(lambda: staged_in_pinned_memory(frame)) == []
    staged = staged_in_pinned_memory(frame)
    assert staged.is_pinned() and torch.equal(staged, frame)


def test_a_batch_of_frames_reaches_the_device_as_each_frame_would():
    """`batch_pixels_on`: one staged copy and one lookup for all frames, bitwise each image's own pixel values."""
    from prism.media.pixels import PatchPixels, batch_pixels_on, pixels_on

    g = torch.Generator().manual_seed(3)
    table = torch.rand(3, 256, generator=g) * 4 - 2
    images = [PatchPixels(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g), table, 16, 2, 2)
              for h, w in ((448, 448), (224, 640), (448, 448))]
    got = batch_pixels_on(images, "cuda", torch.bfloat16)
    want = torch.cat([pixels_on(p, "cuda") for p in images]).to(torch.bfloat16)
    assert torch.equal(got, want)
