"""The shared helper of the stateful specs' tours (`tour` in `spec_kv_cache.py`, `spec_async_scheduling.py`,
`spec_image_uuids.py`): a fixed walk through a machine's rules, each followed by the machine's invariants, that a
spec runs before the machine's random examples and each planted check runs before the machine. Which rules and
states the derandomized examples reach changes with Hypothesis's version; a tour reaches the same ones on every run,
so a planted bug that only one of them shows is always caught. A tour whose states depend on more than its rules
(the async tour's requests decode the tiny checkpoint's tokens) checks once it ends that it reached them.
"""

from __future__ import annotations

from hypothesis import find
from hypothesis.errors import NoSuchExample


class Chosen:
    """A rule's `data` in a tour: it draws the values given, in order, each one the strategy can draw (checked by
    `hypothesis.find`, so for small strategies: a sequence picked among those a rule may take, a prefix length)."""

    def __init__(self, *values) -> None:
        self.values = list(values)

    def draw(self, strategy):
        value = self.values.pop(0)
        try:
            find(strategy, lambda drawn: drawn == value)
        except NoSuchExample:
            raise AssertionError(f"the tour chose {value!r}, which {strategy!r} does not draw") from None
        return value
