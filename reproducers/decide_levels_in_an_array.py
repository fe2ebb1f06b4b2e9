"""Found by review (session 34): a score question whose levels were given as an array or a range
(`levels=np.arange(1, 6)`, `levels=range(1, 6)`) was refused with "levels must be a list, got ndarray"; only lists
and tuples were taken, though a numpy array's integers were accepted once listed. Fixed: any one-dimensional ordered
container (list, tuple, range, numpy or torch array) holds options or levels; sets, strings and other ranks are still
refused."""

import _common  # noqa: F401
import numpy as np

from prism.decision.questions import Question, QuestionError  # noqa: E402

try:
    from_array = Question("score", "How bright is it?", levels=np.arange(1, 6))
    from_range = Question("score", "How bright is it?", levels=range(1, 6))
    ok = from_array.levels == from_range.levels == (1, 2, 3, 4, 5) and all(type(v) is int for v in from_array.levels)
    detail = f"accepted as levels {from_array.levels!r} and {from_range.levels!r}"
except QuestionError as error:
    ok, detail = False, f"refused: {error}"
_common.verdict(ok, detail, detail)
