"""Spec of 64-bit FP8 pool addressing (REFERENCE §2, invariant 4) on the real Qwen3-VL-8B geometry.

The Triton copy kernels compute every address with the module's offset type. On the 8B pool in ~4 GiB
(36 layers x K/V = 72 rows, 220 pages x 256 slots, 8 KV heads x 128) a row's stride is 57,671,680
elements, so rows >= 38 sit past 2^31. The kernel's own offset helper (run through its probe kernel,
no 4 GiB allocation needed) must give exactly the Python-integer offsets of the layout's real strides,
for payload and scales alike. Byte-identical copies across pool sizes are covered by the kernel tests.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.kv import fp8
from prism.ops.page_copy import probe_copy_offsets

QWEN3_VL_8B = fp8.KVLayout(
    num_layers=36, num_kv_heads=8, head_dim=128, page_size=256, num_pages=220, kv_dtype="fp8"
)


@st.composite
def slots(draw: st.DrawFn) -> tuple[int, int, int, int]:
    kv = draw(st.integers(0, 1))
    layer = draw(st.integers(0, QWEN3_VL_8B.num_layers - 1))
    page = draw(st.integers(0, QWEN3_VL_8B.num_pages - 1))
    slot = draw(st.integers(0, QWEN3_VL_8B.page_size - 1))
    return kv, layer, page, slot


@settings(max_examples=60, deadline=None)
@given(st.lists(slots(), min_size=1, max_size=16), st.sampled_from(["payload", "scales"]))
def spec_kernel_offsets_are_exact_on_the_8b_pool(picks, tensor) -> None:
    rows = [kv * QWEN3_VL_8B.num_layers + layer for kv, layer, _, _ in picks]
    pages = [p for _, _, p, _ in picks]
    slot_ids = [s for _, _, _, s in picks]
    got = probe_copy_offsets(QWEN3_VL_8B, rows, pages, slot_ids, tensor=tensor, device="cpu").tolist()
    offset = fp8.payload_offset if tensor == "payload" else fp8.scale_offset
    want = [offset(QWEN3_VL_8B, kv, layer, p, s, 0) for kv, layer, p, s in picks]
    assert got == want, f"kernel offsets {got} != layout offsets {want}"


def spec_row_38_is_past_2_31() -> None:
    """The historical overflow point is inside the explored space (not a vacuous property)."""
    assert fp8.payload_offset(QWEN3_VL_8B, 1, 2, 0, 0, 0) > 2**31 - 1  # row 38 = V of layer 2
    assert fp8.payload_offset(QWEN3_VL_8B, 1, 1, 0, 0, 0) < 2**31  # row 37 starts below
