"""The shared helper of the planted-bug checks (`specs/spec_planted_bugs_*.py`, one file per area): proof that each
spec bites.

Each check plants a historical bug (REFERENCE §2; a few plausible ones too) by monkeypatch in the real
component, runs the spec that owns the invariant, and requires the spec to fail: a spec that still passed with the
bug planted would be a spec that cannot fail. Not collected by pytest (neither `spec_*.py` nor `test_*.py`).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings


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

