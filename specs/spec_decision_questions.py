"""Spec: a question takes numbers for what they are (`decision/questions.py` `Question`).

A score's levels are integers to a user whatever type holds them: Python's or numpy's of any width or sign (any
`numbers.Integral`), kept as Python ints, so that the question renders, reads and averages them as it does Python's;
a readout temperature is any finite positive real number, kept as a float. A bool (Python's or numpy's), a float
however integral, a string or None is refused with a `QuestionError` saying what is wanted, never an error of
another type later.

Options and levels come in any ordered container a user holds them in: a list, a tuple, a range, any other sequence
(a deque, an `array.array`), a one-dimensional numpy or torch array, with the same question as from the list of
their items; a string, bytes (a memoryview of them too), a set, a dict, a scalar or an array of another rank is
refused with a `QuestionError` (a set has no order to label options A, B, C by, a string is one value).

Historical (session 33's review): numpy's integers (`levels=list(np.arange(1, 6))`) were refused as not integers.
Session 34 (review of that fix): `levels=np.arange(1, 6)` and `levels=range(1, 6)` themselves were refused as not lists;
and after that fix (its review), a deque or an `array.array` still was, and a memoryview of bytes was taken for
levels of byte values where the bytes themselves were refused.
"""

from __future__ import annotations

import array
import collections
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
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



# every container is tried in every example: the spec does not depend on which ones Hypothesis draws
CONTAINERS = {"list": list, "tuple": tuple, "deque": collections.deque, "array.array": lambda v: array.array("q", v),
              "numpy": np.array, "torch": torch.tensor}
NOT_ORDERED = {"set": set, "frozenset": frozenset, "dict": dict.fromkeys, "2-D array": lambda v: np.array([v, v]),
               "string": lambda v: "".join(map(str, v)), "bytes": lambda v: bytes(len(v)),
               "memoryview": lambda v: memoryview(bytes(range(len(v)))), "scalar": lambda v: v[0],
               "0-d array": lambda v: np.array(v[0]), "generator": lambda v: iter(v)}


@given(st.lists(st.integers(-50, 50), min_size=2, max_size=6, unique=True), st.integers(-50, 50))
def spec_options_and_levels_come_in_any_ordered_container(values, first) -> None:
    as_list = Question("score", "How bright is it?", levels=values)
    for container in CONTAINERS.values():
        held = Question("score", "How bright is it?", levels=container(values))
        assert held == as_list and all(type(v) is int for v in held.levels)
    run = range(first, first + len(values))
    assert Question("score", "How bright?", levels=run) == Question("score", "How bright?", levels=list(run))
    options = [f"option {v}" for v in values]
    for container in (tuple, collections.deque, np.array):
        assert (Question("choice", "Which one?", options=container(options))
                == Question("choice", "Which one?", options=options))
    for refused in NOT_ORDERED.values():
        with pytest.raises(QuestionError, match="levels must be a list"):
            Question("score", "How bright is it?", levels=refused(values))
