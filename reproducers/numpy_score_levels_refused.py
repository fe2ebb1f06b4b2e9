"""Found by review (session 33): the offline API refused a score question whose levels came from numpy
(`levels=list(np.arange(1, 6))`: np.int64) with "score levels must be integers". Fixed: any integral number but a
bool is a level, kept as a Python int (and any finite real number a temperature, as a float); non-integers are still
refused."""

import _common  # noqa: F401
import numpy as np

from prism.decision.questions import Question, QuestionError  # noqa: E402

try:
    question = Question("score", "How bright is it?", levels=list(np.arange(1, 6)), temperature=np.float32(0.5))
    ok = question.levels == (1, 2, 3, 4, 5) and all(type(level) is int for level in question.levels)
    detail = f"accepted as levels {question.levels!r}, temperature {question.temperature!r}"
except QuestionError as error:
    ok, detail = False, f"refused: {error}"
_common.verdict(ok, detail, detail)
