"""Historical: two identical 13-token prompts, page = chunk = 4. The first had computed 4 tokens when the
second arrived, and the second treated 12 tokens as cached (pages were findable once allocated).
Fixed when the second request reuses only what was computed (4 tokens), and its KV is right."""

import _common  # noqa: F401  (puts src/ on the path)

from prism.kv.content import SeqContent
from prism.testing.kv_world import KVWorld

world = KVWorld(num_gpu_pages=16, page_size=4)
prompt = list(range(1, 14))
world.manager.admit(1, SeqContent(list(prompt)), reserve_tokens=13)  # all pages allocated up front
world.pending[1] = (0, 4)  # ... but only the first chunk of 4 is computed
world.step()
hit = world.admit(2, SeqContent(list(prompt)), chunk=4)
world.step()
world.check_all()
_common.verdict(
    hit == 4,
    f"the second prompt reused {hit} computed tokens and its KV matches its content",
    f"the second prompt treated {hit} tokens as cached while only 4 were computed",
)
