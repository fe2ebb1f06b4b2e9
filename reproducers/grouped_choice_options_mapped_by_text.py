"""Found by review (session 22): a choice of more than 26 options is asked in groups, then among the group
winners; the winners' probabilities were mapped back to the options by text (`options.index`), so with repeated
option texts every winner landed on the first such option and the distribution summed to less than 1 (0.125 for
52 copies of one text). Fixed when the winners are mapped back by position."""

import _common  # noqa: F401
from specs.spec_decision_liveness import MAX_STEPS, decide_within, engine_under_test  # noqa: E402

from prism.decision.questions import Question  # noqa: E402

(answer,) = decide_within(engine_under_test(), [Question("choice", "Which fits?", ("the same",) * 52)], MAX_STEPS)
total = sum(answer.probabilities.values())
_common.verdict(abs(total - 1) < 1e-5, f"52 equal options: probabilities sum to {total:.6f}",
                f"52 equal options: probabilities sum to {total:.6f}, not 1")
