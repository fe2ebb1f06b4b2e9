"""ops/host_copy.py on the GPU: a host tensor reaches the device bitwise, staged in pinned memory by a memcpy (no
torch copy over the intra-op pool), and the caller may change its tensor as soon as `to_device` returns."""

from __future__ import annotations

import pytest
import torch

from prism.ops.host_copy import concatenated_on, copy_into, staged_in_pinned_memory, to_device
from prism.testing.host_reads import host_copies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_to_device_is_bitwise_and_the_source_is_free_at_once(dtype):
    src = torch.randint(0, 256, (448, 448, 3)).to(dtype) if dtype == torch.uint8 else (torch.randn(448, 448, 3) * 50).to(dtype)
    want = src.clone()
    torch.cuda._sleep(50_000_000)  # keep the stream busy: the copy is queued behind it, not run yet
    got = to_device(src, "cuda")
    src.view(torch.uint8).fill_(0)  # the staging buffer, not `src`, is what the queued copy reads
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_copy_into_a_device_buffer_does_not_wait_for_the_stream():
    """The packed graphs' inputs (`PackedGraphs._fill`): copied into a slice of a static device buffer behind ~25 ms
    of queued work, the call returns without waiting for it, and the values arrive bitwise."""
    import time

    import numpy as np

    buffer = torch.zeros(6, 1024, dtype=torch.int64, device="cuda")
    host = np.arange(6 * 640, dtype=np.int64).reshape(6, 640)
    # The first strided copy of the process loads its kernel's module (CUDA's lazy loading), which waits for the
    # queued work once (H200, session 26: 25.5 ms the first call, 0.1-0.2 ms the next; 2.4 ms with eager module
    # loading). An engine has made that copy in its warm-up and captures long before a request's step does.
    copy_into(buffer[:, :640], host)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    start = time.perf_counter()
    copy_into(buffer[:, :640], host)
    returned_after = time.perf_counter() - start
    host[:] = -1  # staged: the queued copy does not read the caller's array
    assert torch.equal(buffer[:, :640].cpu(), torch.arange(6 * 640).view(6, 640))
    assert returned_after < 0.005, f"copy_into waited {returned_after * 1e3:.1f} ms for the stream"


def test_a_staging_buffer_is_not_reused_before_its_copy_has_run():
    """Staging buffers of one size, freed as soon as `to_device` returns, are not handed out again while the copy
    that reads them is still queued (PyTorch's caching host allocator records the copy on the stream)."""
    sources = [torch.full((448, 448, 3), i, dtype=torch.uint8) for i in range(4)]
    torch.cuda._sleep(50_000_000)  # every copy below is queued behind this
    copies = [to_device(s, "cuda") for s in sources[:2]] + [concatenated_on(sources[2:], "cuda")]
    for s in sources:
        s.fill_(255)
    assert [int(c.float().mean().item()) for c in copies[:2]] == [0, 1]
    joined = copies[2].view(2, 448, 448, 3)
    assert int(joined[0].float().mean().item()) == 2 and int(joined[1].float().mean().item()) == 3


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
