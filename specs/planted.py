"""The shared helper of the planted-bug checks (`specs/spec_planted_bugs_*.py`, one file per area): proof that each
spec bites.

Each check plants a historical bug (REFERENCE §2; a few plausible ones too) by monkeypatch in the real
component, runs the spec that owns the invariant, and requires the spec to fail: a spec that still passed with the
bug planted would be a spec that cannot fail. A spec whose examples share an engine is also checked with the sharing
bug planted (`_the_next_example_fails_for_what_one_left`): that its examples depend on getting an engine that holds
nothing. Not collected by pytest (neither `spec_*.py` nor `test_*.py`).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st


def _spec_fails(spec, match: str, errors: type[BaseException] | tuple[type[BaseException], ...] = AssertionError
                ) -> None:
    """Run a spec (a @given one with its own example budget, but no shrinking, one reported failure and the
    derandomized examples of the CI profile, whatever profile is loaded); it must find a counterexample (`errors`:
    what its failure may raise besides its own assertions, e.g. a component's own guard)."""
    own = getattr(spec, "_hypothesis_internal_use_settings", None)
    if own is not None:
        spec._hypothesis_internal_use_settings = settings(
            own, phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False, database=None,
            derandomize=True,
        )
    try:
        with pytest.raises(errors, match=match):
            spec()
    finally:
        if own is not None:
            spec._hypothesis_internal_use_settings = own


def _engines_shared_whatever(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plants the sharing bug (`prism.testing.shared_engines`): a spec's engine goes to its next example whatever a
    failed example left in it."""
    from prism.testing import shared_engines

    monkeypatch.setattr(shared_engines, "holdings", lambda owner: {})


def _one_example(spec, **arguments) -> None:
    """Run a @given spec on exactly `arguments`, once, as Hypothesis runs an explicit example (`event` works)."""
    inner = spec.hypothesis.inner_test

    def once(**kwargs) -> None:  # (not `inner`: the spec's own explicit examples are on it)
        inner(**kwargs)

    test = given(**{name: st.just(value) for name, value in arguments.items()})(once)
    settings(phases=[Phase.explicit], database=None, deadline=None)(example(**arguments)(test))()


def _the_next_example_fails_for_what_one_left(monkeypatch: pytest.MonkeyPatch, spec, arguments: dict, fault: str,
                                              match: str, errors: type[BaseException] = AssertionError) -> None:
    """With the sharing bug planted, one example of `spec` (whose engine its examples share), on `arguments`, run with
    `fault` fails, and then, the fault gone, it must fail again (`errors`, `match`) for what the first run left: a
    shrinking Hypothesis would report an example that fails only after another. Unplanted, it then passes (the spec
    takes its engine from `reused_while_clean`). `fault`: "a step fails" (the engine's first step raises, as a check
    in it would: the example's requests are left where they were), or "sequences leak" (each request's KV sequence
    kept when it ends: the first run fails for it, `match` too)."""
    from prism.engine.engine import Engine

    def step_failing(self):
        raise AssertionError("planted: a check in the example's first step failed")

    finish = Engine._finish

    def finish_keeping_its_sequence(self, request, reason, *args, **kwargs) -> None:
        seq = self.kv.seqs.pop(request.request_id, None)  # not released
        finish(self, request, reason, *args, **kwargs)
        if seq is not None:
            self.kv.seqs[request.request_id] = seq

    with monkeypatch.context() as shared:
        _engines_shared_whatever(shared)
        with monkeypatch.context() as faulty:
            if fault == "a step fails":
                faulty.setattr(Engine, "step", step_failing)
                first_errors, first_match = AssertionError, "planted"
            else:
                assert fault == "sequences leak", fault
                faulty.setattr(Engine, "_finish", finish_keeping_its_sequence)
                first_errors, first_match = errors, match
            with pytest.raises(first_errors, match=first_match):
                _one_example(spec, **arguments)
        with pytest.raises(errors, match=match):
            _one_example(spec, **arguments)
    _one_example(spec, **arguments)
