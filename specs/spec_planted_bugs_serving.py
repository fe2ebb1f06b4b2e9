"""Proof that the server's specs bite: each historical bug of its internal errors (a 500 or a stream's error event,
a choice failing unseen), of the body deadline and of the rendered text (legacy logprobs, the echo), planted.

Each test monkeypatches one buggy variant into the real server and requires the spec that owns the invariant to fail
(see `specs/planted.py`).
"""

from __future__ import annotations

import pytest

from specs.planted import _spec_fails


def test_a_500_carrying_the_engines_reason_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the operator's review: a choice the engine failed was answered with the engine's reason as the message
    ("RuntimeError: <the exception's text>"). Planted: `json_or_error` as it was."""
    from fastapi.responses import JSONResponse

    from prism.serving import app
    from prism.serving.responses import RequestFailedError, error_body
    from specs import spec_internal_errors

    def reason_in_the_body(build, completion_id):
        try:
            response = build()
        except RequestFailedError as error:
            return JSONResponse(error_body(error.status, str(error)), status_code=error.status)
        return JSONResponse(response.model_dump(mode="json"))

    monkeypatch.setattr(app, "json_or_error", reason_in_the_body)  # looked up by the endpoints
    _spec_fails(spec_internal_errors.spec_a_500_names_only_a_request_id, "the failure's text went out")


def test_a_stream_ending_with_the_engines_reason_or_cut_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the operator's review: a stream whose choice the engine failed ended with the engine's reason in its
    error event, and one failing to render was cut without an end. Planted: `sse` as it was."""
    from prism.serving import app, choices
    from prism.serving.responses import RequestFailedError
    from specs import spec_internal_errors

    async def reason_in_the_event(out, streams):
        merged = choices._merge(streams)
        try:
            yield out.start()
            async for index, event in merged:
                try:
                    data = out.on_output(index, event)
                except RequestFailedError as error:
                    yield out.error(error.status, str(error))
                    return
                if data:
                    yield data
            yield out.finish()
        finally:
            await merged.aclose()

    monkeypatch.setattr(app, "sse", reason_in_the_event)  # looked up by the endpoints
    _spec_fails(spec_internal_errors.spec_a_500_names_only_a_request_id, "the failure's text went out|was cut")


def test_a_choice_whose_events_fail_unseen_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found while checking the operator's review: with n > 1, a choice whose events failed to be read (its pump task
    raised) died unseen, and the completion waited for its events forever. Planted: `_merge` as it was."""
    import asyncio

    from prism.serving import choices
    from specs import spec_internal_errors

    merge = choices._merge

    class FailingUnseen:
        """A choice's events as the old pump read them: after a failure, none come (the task had died)."""

        def __init__(self, stream) -> None:
            self.stream = stream

        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                return await self.stream.__anext__()
            except StopAsyncIteration:
                raise
            except Exception:  # noqa: BLE001 - lost, as the pump task's exception was
                await asyncio.Event().wait()

        async def aclose(self) -> None:
            await self.stream.aclose()

    def pumps_failing_unseen(streams):
        return merge([FailingUnseen(s) for s in streams] if len(streams) > 1 else streams)

    monkeypatch.setattr(choices, "_merge", pumps_failing_unseen)  # looked up by sse and collect
    _spec_fails(spec_internal_errors.spec_a_choice_failing_while_its_events_are_read_ends_its_completion, "no answer")


def test_a_body_waited_for_without_a_deadline_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the operator's review: a client that sent its headers and withheld its body held a connection and a
    handler for as long as it kept the connection open. Planted: the body read without a deadline again."""
    from prism.serving.body_deadline import BodyDeadline
    from specs import spec_body_deadline

    async def untimed(self, scope, receive, send):
        await self.app(scope, receive, send)

    monkeypatch.setattr(BodyDeadline, "__call__", untimed)
    _spec_fails(spec_body_deadline.spec_a_body_arrives_in_time_or_is_a_408_that_leaves_nothing,
                "no answer|not a 408")


def test_a_body_timed_per_read_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline is the whole body's. Planted: a timeout per read, which a body trickled a piece at a time passes."""
    import asyncio

    from prism.serving.body_deadline import BodyDeadline, BodyReadTimeout
    from specs import spec_body_deadline

    async def timed_per_read(self, scope, receive, send):
        timeout_s = self.timeout_s()

        async def receive_in_time():
            try:
                return await asyncio.wait_for(receive(), timeout_s)
            except TimeoutError:
                raise BodyReadTimeout(timeout_s) from None

        await self.app(scope, receive_in_time if scope["type"] == "http" else receive, send)

    monkeypatch.setattr(BodyDeadline, "__call__", timed_per_read)
    _spec_fails(spec_body_deadline.spec_a_body_arrives_in_time_or_is_a_408_that_leaves_nothing, "not a 408")


def test_legacy_top_logprobs_keeping_the_last_of_equal_texts_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found hunting the streamed text: a legacy completion's `top_logprobs` kept, of tokens of equal text, the last
    (least likely) one's logprob, so that the byte tokens of a split character (all U+FFFD) listed the chosen token
    with a runner-up's logprob, not its own `token_logprobs` entry. Planted: the dict as it was built."""
    from prism.serving.completions import LegacyLogprobs
    from prism.serving.stream import finite_logprob
    from specs import spec_rendered_text

    def last_of_equal_texts(self, entry, text):
        top = {self._text(t): finite_logprob(lp) for t, lp in entry.top}
        top.setdefault(text, finite_logprob(entry.logprob))
        return top

    monkeypatch.setattr(LegacyLogprobs, "_top", last_of_equal_texts)
    _spec_fails(spec_rendered_text.spec_what_a_client_reads_is_the_engines_text, "another logprob than its own")


def test_legacy_text_offsets_lagging_after_a_cut_character_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the review of the streamed text: a legacy completion's `text_offset` counted the U+FFFD of an
    incomplete character cut by a token's first byte only after that token ("\\xe4", "a": offsets [0, 0], "a" at 1 in
    "\\ufffda"), so the token's own text did not start at its offset. Planted: no cut counted before a token."""
    from prism.serving.completions import LegacyLogprobs
    from specs import spec_rendered_text

    monkeypatch.setattr(LegacyLogprobs, "_cut_before", lambda self, raw: 0)
    _spec_fails(spec_rendered_text.spec_what_a_client_reads_is_the_engines_text, "text offsets")


def test_an_echo_with_a_cut_character_at_the_seam_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the review of the streamed text: a legacy completion echoing a prompt of token ids that ends inside a
    character showed that character as U+FFFD, and the completion's text began with one U+FFFD per byte completing it
    (its tokens decoded on their own), not the decode of prompt and completion together. Planted: no prompt ends
    inside a character, for the engine's text and for the echo."""
    from prism.engine import detokenize
    from prism.serving import app
    from specs import spec_rendered_text

    for module in (detokenize, app):
        monkeypatch.setattr(module, "incomplete_tail", lambda vocab, token_ids: b"")
    _spec_fails(spec_rendered_text.spec_what_a_client_reads_is_the_engines_text, "completions answered")
