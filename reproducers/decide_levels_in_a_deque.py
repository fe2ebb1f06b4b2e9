"""Found by session 34's review of `listed_values`: a question's options or levels were taken from a list, a tuple, a
range or a one-dimensional array only, so `levels=collections.deque(...)` or an `array.array` was refused ("levels
must be a list"), though the README promised any ordered one-dimensional container; and a memoryview of bytes was
taken for levels of byte values where the bytes themselves were refused. Fixed: any ordered sequence but a string or
bytes (in any wrapper) holds them."""

import array
import collections

import _common

from prism.decision.questions import Question, QuestionError  # noqa: E402

want = Question("score", "How bright is it?", levels=[1, 2, 3])
try:
    ok = (Question("score", "How bright is it?", levels=collections.deque([1, 2, 3])) == want
          == Question("score", "How bright is it?", levels=array.array("q", [1, 2, 3])))
    detail = "a deque's and an array.array's levels are a list's"
except QuestionError as error:
    ok, detail = False, f"refused: {error}"
try:
    Question("score", "How bright is it?", levels=memoryview(b"\x01\x02"))
    ok, detail = False, f"{detail}; a memoryview of bytes taken for levels (1, 2)"
except QuestionError:
    pass
_common.verdict(ok, detail, detail)
