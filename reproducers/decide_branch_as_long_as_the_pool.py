"""Found by the decision liveness spec (session 23): two questions on one material, the second one's branch
max_model_len - 1 = 255 tokens, on a pool of exactly max_model_len tokens. The branch forks the material's partly
filled tail page, still held by the material's cache entry; copying it on write needs one page past the pool, and
nothing younger runs to preempt: the decide was never answered (the server's decide hung). Fixed when a tail page
that, besides the branch, only cache entries hold is taken over (the entries give up their tail) instead of copied."""

import _common  # noqa: F401
from specs.spec_decision_liveness import (  # noqa: E402
    MATERIAL,
    MAX_MODEL_LEN,
    MAX_STEPS,
    Question,
    decide_within,
    engine_under_test,
)

llm = engine_under_test()  # tiny checkpoint, max_model_len 256 = its pool (64 pages of 4)
questions = [Question("yes_no", "Question 0: is the lamp bright?"),
             Question("yes_no", "Question 1: is the lamp " + "very " * 64 + "bright?")]
lengths = [len(llm.engine.inputs.prepare_chat([*MATERIAL, {"role": "user", "content": q.render()}]).token_ids)
           for q in questions]
assert max(lengths) == MAX_MODEL_LEN - 1, f"the long branch should be max_model_len - 1 tokens, not {lengths}"
try:
    answers = decide_within(llm, questions, MAX_STEPS)
    ok, detail = True, f"answered: {[round(sum(a.probabilities.values()), 6) for a in answers]}"
except AssertionError as error:  # the bug: the long branch never finishes
    ok, detail = False, str(error)
takeovers = getattr(llm.engine.kv.stats, "tail_takeovers", "none (not counted)")
_common.verdict(ok and not llm.engine.requests, f"{detail}; tail pages taken over: {takeovers}", detail)
