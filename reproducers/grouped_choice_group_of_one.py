"""Found by review (session 22): 27 options (or 53, 651: 26k + 1) were split into groups of 26 and a last group of
one option, which is no question: the valid choice was refused with "a choice question needs at least two
options". Fixed when the groups are as even as they can be (27 -> 13 + 14)."""

import _common  # noqa: F401

from prism.decision.plan import grouped  # noqa: E402
from prism.decision.questions import Question, QuestionError  # noqa: E402

try:
    sizes = {n: [len(g.options) for g in grouped(Question("choice", "Which?", tuple(map(str, range(n)))))]
             for n in (27, 53, 651)}
    ok, detail = all(min(s) >= 2 and max(s) <= 26 for s in sizes.values()), f"group sizes {sizes}"
except QuestionError as error:
    ok, detail = False, f"refused: {error}"
_common.verdict(ok, detail, detail)
