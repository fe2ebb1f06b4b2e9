"""`prism.testing.knobs`: the launch knobs the benchmarks set from their command lines (`--set MODULE.NAME=VALUE`)
and the specs set for a while."""

from __future__ import annotations

import pytest

from prism.ops import gemv
from prism.testing.knobs import module_knobs, ops_knob, parse_value, set_ops_knob


def test_parse_value_reads_bools_ints_floats_and_text():
    assert [parse_value(t) for t in ("true", "False", "8", "0.5", "tf32")] == [True, False, 8, 0.5, "tf32"]


def test_set_ops_knob_sets_a_knob_of_an_ops_module(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(gemv, "BLOCK_K", gemv.BLOCK_K)  # restored after the test
    set_ops_knob("gemv.BLOCK_K=1024")
    assert gemv.BLOCK_K == 1024


@pytest.mark.parametrize(("assignment", "message"), [("gemv.BLOCK_K", "is not MODULE.NAME=VALUE"),
                                                     ("BLOCK_K=8", "is not MODULE.NAME=VALUE"),
                                                     ("gemv.NO_SUCH_KNOB=1", "has no knob NO_SUCH_KNOB")])
def test_set_ops_knob_refuses_what_it_cannot_set(assignment, message):
    before = gemv.BLOCK_K
    with pytest.raises(SystemExit, match=message):
        set_ops_knob(assignment)
    assert gemv.BLOCK_K == before


def test_module_knobs_restores_the_module_values():
    before = gemv.BLOCK_N
    with module_knobs(gemv, {"BLOCK_N": before * 2}):
        assert gemv.BLOCK_N == before * 2
    assert gemv.BLOCK_N == before


def test_ops_knob_names_a_module_or_takes_the_default_one():
    from prism.ops import pdl

    assert ops_knob("pdl.TRIGGER_FIRST") == (pdl, "TRIGGER_FIRST")
    assert ops_knob("BLOCK_K", default_module="gemv") == (gemv, "BLOCK_K")
    with pytest.raises(SystemExit, match="is not MODULE.NAME"):
        ops_knob("BLOCK_K")
