"""Found by profiling W2's host path (session 5): every question about the same images leaves one page under the
images' last full page, and the prefix lookup compared each such sibling with the new prompt row by row in Python
to find the best tail (twice per admission). The cost of a lookup grew with every question ever asked about those
images: ~50 siblings were most of a hot request's host time, thousands would cost tens of milliseconds per request.
Fixed when the siblings of a parent are a matrix of row codes searched in one vectorized pass
(kv/tail_sources.py); the exact row comparison then runs once, on the chosen tail."""

import _common

from prism.kv import prefix  # noqa: E402
from prism.kv.content import SeqContent  # noqa: E402
from prism.kv.prefix import PrefixIndex  # noqa: E402

PAGE, SIBLINGS = 256, 2000
root = b"r" * 16
index = PrefixIndex(PAGE)
shared = list(range(1000, 1060))  # the images' last rows and the chat template: every question starts so
for page in range(SIBLINGS):
    index.publish_partial(page, root, tuple(shared + [7, page % 50_000, page // 50_000, 8]), ())

compared = 0
exact = prefix.common_rows


def counting_common_rows(*args):
    global compared
    compared += 1
    return exact(*args)


prefix.common_rows = counting_common_rows
query = SeqContent(shared + [7, 1234, 0, 9, 9, 9], ())
hit = index.lookup(query, root, len(query) - 1)
_common.verdict(compared <= 2 and hit.tail_source == 1234 and hit.tail_rows == len(shared) + 3,
                f"one lookup among {SIBLINGS} sibling pages compared {compared} of them row by row and found the "
                f"best tail (page {hit.tail_source}, {hit.tail_rows} rows)",
                f"one lookup among {SIBLINGS} sibling pages compared {compared} of them row by row (tail page "
                f"{hit.tail_source}, {hit.tail_rows} rows): the lookup's cost grows with every question ever asked "
                "about the same images")
