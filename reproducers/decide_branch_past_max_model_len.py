"""Found by review (session 22): a decide whose question made a branch prompt past max_model_len was accepted
(`Engine.add_decision` checked only the material); the forked branch then waited for ever for pages a pool of
max_model_len tokens cannot give (the engine spun, the server's decide never answered). Fixed when every branch
prompt gets a request's checks before anything is added: the decide is refused with a RequestError."""

import _common  # noqa: F401
from specs.spec_decision_liveness import MAX_STEPS, Question, decide_within, engine_under_test  # noqa: E402

from prism.engine.engine import RequestError  # noqa: E402

llm = engine_under_test()  # tiny checkpoint, max_model_len 256 = its pool
questions = [Question("yes_no", "Is the lamp bright?"), Question("yes_no", "Is the lamp " + "very " * 80 + "bright?")]
try:
    decide_within(llm, questions, MAX_STEPS)
    ok, detail = False, "a question of ~300 tokens was answered past max_model_len 256"
except RequestError as error:
    ok, detail = True, str(error)
except AssertionError as error:  # the bug: the branch never finishes
    ok, detail = False, str(error)
_common.verdict(ok and not llm.engine.requests, f"refused before anything ran: {detail}", detail)
