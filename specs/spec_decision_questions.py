"""Spec: a question takes numbers for what they are (`decision/questions.py` `Question`).

A score's levels are integers to a user whatever type holds them: Python's or numpy's of any width or sign (any
`numbers.Integral`), kept as Python ints, so that the question renders, reads and averages them as it does Python's;
a readout temperature is any finite positive real number, kept as a float. A bool (Python's or numpy's), a float
however integral, a string or None is refused with a `QuestionError` saying what is wanted, never an error of
another type later.

Historical (session 35's review): numpy's integers (`levels=list(np.arange(1, 6))`) were refused as not integers.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prism.decision.questions import Question, QuestionError, make_answer

INTEGER_TYPES = (int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
NOT_INTEGERS = (1.0, np.float64(2.0), np.float32(3.0), True, np.bool_(False), "4", None, Fraction(5), Decimal(6))
REAL = st.sampled_from((float, np.float64, np.float32, Fraction))


def as_type(kind, value: int):
    return kind(value % 128)  # within every listed type's range


@given(st.lists(st.tuples(st.sampled_from(INTEGER_TYPES), st.integers(0, 10**6)), min_size=2, max_size=6,
                unique_by=lambda pair: pair[1] % 128),
       st.one_of(st.none(), st.tuples(st.integers(0, 5), st.sampled_from(NOT_INTEGERS))))
def spec_score_levels_are_any_integers(levels, bad) -> None:
    values = [as_type(kind, value) for kind, value in levels]
    if bad is not None:
        values.insert(bad[0] % (len(values) + 1), bad[1])
        with pytest.raises(QuestionError, match="score levels must be integers"):
            Question("score", "How bright is it?", levels=values)
        return
    question = Question("score", "How bright is it?", levels=values)
    assert question.levels == tuple(int(v) for v in values) and all(type(v) is int for v in question.levels)
    assert question.labels == tuple(str(int(v)) for v in values)
    uniform = make_answer(0, question, [1 / len(values)] * len(values))
    assert uniform.expected_value == pytest.approx(sum(int(v) for v in values) / len(values))


@given(REAL, st.floats(1e-6, 1e6), st.sampled_from((0.0, -1.0, float("nan"), float("inf"), True, np.bool_(True), "1")))
def spec_a_temperature_is_any_positive_real(kind, value, bad) -> None:
    temperature = kind(value) if kind is not Fraction else Fraction(value)
    question = Question("yes_no", "Is the lamp on?", temperature=temperature)
    assert type(question.temperature) is float and question.temperature == float(temperature)
    with pytest.raises(QuestionError, match="temperature must be a positive number"):
        Question("yes_no", "Is the lamp on?", temperature=bad)
