"""Found by a review of the specs whose examples share one engine (after `async_example_after_a_failed_one.py`): an
example that failed left its requests in the engine, and the next example, given the same engine, failed for them.
The unforked questions spec names its decide d<serial>, and Hypothesis shrinks serial to 0: after an example whose
first step failed, the next one's decide was refused as already in use; shrinking, Hypothesis reported an example
that fails only after another. Here the first example's first step fails, and the next example, the fault gone, must
pass. Fixed when a spec's shared engine goes to the next example only while it holds nothing
(`prism.testing.shared_engines`), for every spec sharing one."""

import _common
from specs import spec_unforked_questions  # noqa: E402

from prism.engine.engine import Engine  # noqa: E402


def example() -> None:
    spec_unforked_questions.spec_every_question_ends_once.hypothesis.inner_test(
        questions=2, ending="material fails", at_step=3, which=0, serial=0)


def step_failing(self):
    raise AssertionError("planted: a check in the example's first step failed")


step = Engine.step
Engine.step = step_failing
try:
    example()
    first = "it passed"
except AssertionError as error:
    first = str(error)
finally:
    Engine.step = step
if "planted" not in first:
    _common.verdict(False, "", f"the example with its first step failing did not fail for it ({first[:200]}): the "
                               "reproducer is stale")
try:
    example()
    ok, detail = True, ""
except Exception as error:  # what the leftover makes of the next example, whatever it is
    ok, detail = False, f"{type(error).__name__}: {str(error)[:300]}"
_common.verdict(ok, "an example after one that failed with its decide in the engine passed on an engine of its own",
                f"an example failed because the one before it left its decide in the shared engine: {detail}")
