"""Historical: FP8 KV compaction computed flattened pool offsets in int32. For Qwen3-VL-8B (72 K/V layer
rows x 56,320 slots x 8 heads x 128) the offset overflowed at row 38. Fixed when the copy kernel's own
offset arithmetic (run through its probe kernel with the real strides, no 4 GiB allocation) gives the
exact offsets of every row, including those past 2^31."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU machines run the kernel in Triton's interpreter

import _common  # noqa: F401,E402

from prism.kv import fp8  # noqa: E402
from prism.ops.page_copy import probe_copy_offsets  # noqa: E402

layout = fp8.KVLayout(num_layers=36, num_kv_heads=8, head_dim=128, page_size=256, num_pages=220, kv_dtype="fp8")
rows = list(range(2 * layout.num_layers))
last_page = [layout.num_pages - 1] * len(rows)
last_slot = [layout.page_size - 1] * len(rows)
got = probe_copy_offsets(layout, rows, last_page, last_slot, device="cpu").tolist()
want = [fp8.payload_offset(layout, r // 36, r % 36, layout.num_pages - 1, layout.page_size - 1, 0) for r in rows]
wrong = [r for r, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
past = sum(w > 2**31 - 1 for w in want)
_common.verdict(
    not wrong and past > 0,
    f"all 72 K/V rows addressed exactly; {past} of them lie past 2^31 (row 38 starts at "
    f"{fp8.payload_offset(layout, 1, 2, 0, 0, 0):,})",
    f"rows {wrong} get wrong offsets",
)
