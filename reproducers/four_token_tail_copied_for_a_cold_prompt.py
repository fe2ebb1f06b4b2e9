"""Found in session 11 (H200, W1): every cold 8-image prompt shared its first 4 tokens of chat template with the
previous one, so the prefix cache copied a 4-row tail of a 256-token page into a private page: 0.6 ms of host on
the step's critical path to save 4 tokens of a 1,640-token prefill. A partial page is now reused only when it holds
`EngineConfig.tail_copy_threshold` tokens (an eighth of a page unless set)."""

import _common  # noqa: F401

from prism.engine.config import EngineConfig
from prism.kv.content import SeqContent
from prism.testing.kv_world import KVWorld

config = EngineConfig(page_size=256)
world = KVWorld(num_gpu_pages=8, page_size=256, min_tail_tokens=config.tail_copy_threshold)
template = [1, 2, 3, 4]  # "<|im_start|>user\n<|vision_start|>" before the first image
world.admit(1, SeqContent(template + list(range(100, 400))), chunk=304)
world.step()
world.release(1)
hit = world.manager.lookup(SeqContent(template + list(range(500, 800))))  # new images from token 4 on
world.check_all()
_common.verdict(
    hit.num_tokens == 0 and hit.tail_source is None,
    f"a 4-token tail is not copied (threshold {config.tail_copy_threshold} tokens at 256-token pages)",
    f"the cold prompt reuses a {hit.tail_rows}-row tail of page {hit.tail_source}: a page copy for 4 tokens",
)
