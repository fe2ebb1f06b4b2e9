"""Historical (REFERENCE, deterministic inference): a cache hit computed the rest of its frontier page from the
hit onwards while a miss computed that page whole, so the same tokens sat at other rows of other shapes and the
logits differed in the last bits; bitwise reproducibility needs a miss and a hit to compute the same splits.
Fixed when deterministic mode uses page-aligned hits and recomputes the frontier page from its start, in tiles of
exactly one page. Checks two questions over the same two images, hit vs cache off, with `torch.equal`."""

import _common
from specs.spec_hit_equals_miss import check  # noqa: E402

try:
    check([0, 1], ["What is it?", "Count the shapes."], page_size=8, budget=96, deterministic=True)
    ok, detail = True, ""
except AssertionError as error:
    ok, detail = False, str(error)
_common.verdict(ok, "deterministic mode: the second question's logits on a prefix hit equal the cache-off ones, bitwise",
                detail)
