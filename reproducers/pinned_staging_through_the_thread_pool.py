"""A host tensor staged in pinned memory for the device (`ops/host_copy.to_device`) was copied there by
`Tensor.pin_memory()`, a torch copy split over the intra-op thread pool. On the H200's host that copy of a 602 KB
image frame took 5.4 ms instead of ~0.1 ms in about one cold 8-image request of two, once per image: W1's engine
part went 58 -> ~95 ms (session 10). The staging copy must be no torch op (it is one memcpy on the calling thread).
Checked by dispatch on the host (pageable memory where there is no GPU: the copy is the same)."""

import _common
import torch  # noqa: E402

from prism.ops.host_copy import staged_in_pinned_memory  # noqa: E402
from prism.testing.host_reads import host_copies  # noqa: E402

frame = torch.randint(0, 256, (448, 448, 3), dtype=torch.uint8)
copies = host_copies(lambda: staged_in_pinned_memory(frame, pin=torch.cuda.is_available()))
_common.verdict(
    not copies,
    "a host tensor is staged for the device by one memcpy, no torch copy",
    f"staging a host tensor for the device runs torch copies over the intra-op pool: {copies}",
)
