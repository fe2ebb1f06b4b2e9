"""Found in session 11: `KVCacheManager.clear_cache` dropped the cache entries, but a freed page keeps its prefix
record until the pool hands it out again, so the next identical prompt still hit the KV computed before the clear.
Specs that cleared the cache to compare against a miss compared against a hit instead, and the async-scheduling
spec failed now and then (one engine's run hit, the other's did not; FP8 KV turned the different rounding into a
1e-3 logprob difference)."""

import _common  # noqa: F401

from prism.kv.content import SeqContent
from prism.testing.kv_world import KVWorld

world = KVWorld(num_gpu_pages=6, page_size=4)
prompt = list(range(1, 11))  # two full pages and a tail
world.admit(1, SeqContent(prompt), chunk=10)
world.step()
world.release(1)  # finished: its pages become a cache entry
assert world.manager.lookup(SeqContent(prompt)).num_tokens > 0, "the setup should hit before the clear"
world.manager.clear_cache()
world.check_all()
after = world.manager.lookup(SeqContent(prompt))
_common.verdict(
    after.num_tokens == 0,
    "after clear_cache the same prompt finds nothing",
    f"after clear_cache the same prompt still hits {after.num_tokens} tokens on freed pages {after.pages_read}",
)
